"""The steer-name rule, in one place: what a steer may be called.

A steer name appears in request bodies (``{"steer": {"detox": 5}}``), in the ``vllm_xargs``
string form (``"detox:5,sentiment:-3"``, so no ``,`` ``:`` or spaces), on the command line
(``--steer NAME=PATH``, so no ``=``), in file names and in logs. Checked when a steer is
saved, when a file is read, and for ``--steer NAME=PATH``. Light: no imports beyond the
standard library.
"""

from __future__ import annotations

import re

#: Characters a steer name may use (ASCII only).
NAME_CHARSET = "ASCII letters, digits, '_', '-' and '.'"
#: Longest steer name (characters).
MAX_NAME_LENGTH = 64
_NAME_RE = re.compile(r"[A-Za-z0-9_.\-]+")
#: How much of a rejected name an error message repeats.
ECHO_LENGTH = 40


def echo(value: object, limit: int = ECHO_LENGTH) -> str:
    """``repr`` of ``value`` cut to about ``limit`` characters (error messages stay short)."""
    if isinstance(value, str) and len(value) > limit:
        return repr(value[:limit]) + f"... ({len(value)} characters)"
    if isinstance(value, int) and value.bit_length() > 4096:  # repr refuses > 4300 digits
        return f"an integer of {value.bit_length()} bits"
    r = repr(value)
    return r if len(r) <= limit + 2 else r[:limit] + "..."


def steer_name_problem(name: object) -> str | None:
    """Why ``name`` is not a valid steer name, or ``None`` when it is."""
    if not isinstance(name, str):
        return f"steer name {echo(name)} must be a string, got {type(name).__name__}"
    if not name:
        return "steer name is empty"
    if len(name) > MAX_NAME_LENGTH:
        return (f"steer name {echo(name)} is {len(name)} characters long; at most "
                f"{MAX_NAME_LENGTH} are allowed")
    if name in (".", ".."):
        return f"steer name {echo(name)} is reserved: as a file name it names a folder"
    if not _NAME_RE.fullmatch(name):
        return (f"steer name {echo(name)} may use only {NAME_CHARSET} "
                f"(at most {MAX_NAME_LENGTH} characters)")
    return None


def is_steer_name(name: object) -> bool:
    """Whether ``name`` follows the rule (see :func:`check_steer_name`)."""
    return steer_name_problem(name) is None


def check_steer_name(name: object) -> str:
    """Return ``name`` if it is a valid steer name, else raise ``ValueError`` saying why."""
    problem = steer_name_problem(name)
    if problem is not None:
        raise ValueError(problem)
    return name  # type: ignore[return-value]


def safe_steer_name(text: str, fallback: str = "steer") -> str:
    """A valid steer name made from ``text`` (e.g. a file name): runs of other characters
    become ``-``, cut to the longest length; ``fallback`` when nothing is left."""
    name = re.sub(r"[^A-Za-z0-9_.\-]+", "-", text).strip("-.")[:MAX_NAME_LENGTH].strip("-.")
    return name if is_steer_name(name) else fallback
