"""Server configuration and request parsing. Light: no torch import (the frontend uses it)."""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, field
from typing import Any, Literal, Mapping

from vllm_steer import ADDITIONAL_CONFIG_KEY, REQUEST_FIELD

DEFAULT_MAX_STRENGTH = 50.0


class SteerRequestError(ValueError):
    """A request's ``steer`` field is invalid. The message names the field and the problem."""


@dataclass
class SteerServerConfig:
    """What the server loads and allows; carried to workers in ``additional_config``."""

    steers: dict[str, str] = field(default_factory=dict)
    """Steer name -> path of its ``.safetensors`` file, as given by ``--steer NAME=PATH``."""
    max_strength: float = DEFAULT_MAX_STRENGTH
    """Largest ``|strength|`` a request may ask for (units of the steer's epsilon)."""
    backend: Literal["auto", "reference", "torch", "triton"] = "auto"
    """Implementation of the batched steer operation (see ``vllm_steer.ops``)."""
    max_steers: int | None = None
    """Steer slots (``--max-steers``): how many steers may be loaded at once; the per-request
    coefficient table and the bank are sized for it up front. Default: the number of
    ``--steer`` options, at least 8."""
    max_steer_rank: int | None = None
    """Largest rank a loaded steer may have (``--max-steer-rank``); None: any."""
    steer_dir: str | None = None
    """``--steer-dir``: a request naming a steer that is not loaded loads
    ``DIR/NAME.safetensors`` on first use."""
    enable_updates: bool = False
    """``--enable-steer-updates``: allow ``POST /v1/steers`` and ``DELETE /v1/steers/NAME``."""
    updates_any_path: bool = False
    """``--steer-updates-any-path``: ``POST /v1/steers`` may name a file outside
    ``--steer-dir`` (default: only files inside it)."""

    def __post_init__(self):
        if not (isinstance(self.max_strength, (int, float)) and math.isfinite(self.max_strength)
                and self.max_strength > 0):
            raise ValueError(f"--steer-max-strength={self.max_strength!r}: must be a positive "
                             f"finite number (default {DEFAULT_MAX_STRENGTH})")
        self.max_strength = float(self.max_strength)
        for flag, v in (("--max-steers", self.max_steers),
                        ("--max-steer-rank", self.max_steer_rank)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(f"{flag}={v!r}: must be a positive integer")
        if self.max_steers is not None and self.max_steers < len(self.steers):
            raise ValueError(f"--max-steers={self.max_steers} is less than the "
                             f"{len(self.steers)} steers given with --steer; raise it")
        if self.backend not in ("auto", "reference", "torch", "triton"):
            raise ValueError(f"steer backend {self.backend!r}: choose auto, reference, torch "
                             "or triton")

    @property
    def capacity(self) -> int:
        """Steer slots: ``max_steers``, default the number of ``--steer``, at least 8."""
        return self.max_steers if self.max_steers is not None else max(len(self.steers), 8)

    @property
    def enabled(self) -> bool:
        """Whether steering is on: steers given, a steer directory, run-time updates, or a
        capacity (offline: ``{"max_steers": 8}`` with no steers, to load them later)."""
        return bool(self.steers or self.steer_dir or self.enable_updates
                    or self.max_steers is not None)

    def to_additional_config(self) -> dict[str, Any]:
        d = asdict(self)
        for k in _RUNTIME_KEYS:  # run-time management keys only when set
            if d.get(k) in (None, False):
                d.pop(k, None)
        return {ADDITIONAL_CONFIG_KEY: d}

    @classmethod
    def from_additional_config(cls, additional_config: Mapping[str, Any] | None
                               ) -> "SteerServerConfig | None":
        if not additional_config or ADDITIONAL_CONFIG_KEY not in additional_config:
            return None
        d = dict(additional_config[ADDITIONAL_CONFIG_KEY])
        unknown = set(d) - {"steers", "max_strength", "backend"} - _RUNTIME_KEYS
        if unknown:
            raise ValueError(f"additional_config[{ADDITIONAL_CONFIG_KEY!r}] has unknown keys "
                             f"{sorted(unknown)}; known: steers, max_strength, backend")
        steers = d.get("steers") or {}
        if isinstance(steers, (list, tuple)):
            steers = dict(parse_steer_arg(s) for s in steers)
        return cls(steers=dict(steers), max_strength=d.get("max_strength", DEFAULT_MAX_STRENGTH),
                   backend=d.get("backend", "auto"),
                   **{k: d[k] for k in _RUNTIME_KEYS if k in d})


#: Keys of the run-time steer management (issue 15) in ``additional_config["vllm_steer"]``.
_RUNTIME_KEYS = frozenset({"max_steers", "max_steer_rank", "steer_dir", "enable_updates",
                           "updates_any_path"})


def parse_steer_arg(arg: str) -> tuple[str, str]:
    """``NAME=PATH`` -> (NAME, PATH); ``PATH`` alone takes the name from the file's metadata."""
    if "=" in arg and not os.path.exists(arg):
        name, path = arg.split("=", 1)
        name = name.strip()
        if not name or not _valid_name(name):
            raise ValueError(f"--steer {arg!r}: the name {name!r} must be letters, digits, '_', "
                             "'-' or '.' (use NAME=PATH)")
        return name, path
    from vllm_steer.format import read_metadata

    return read_metadata(arg).name, arg


def _valid_name(name: str) -> bool:
    return all(ch.isalnum() or ch in "_-." for ch in name)


def _strength(name: str, value: Any, where: str, max_strength: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise SteerRequestError(f"{where}: strength of steer {name!r} must be a number, got "
                                f"{type(value).__name__} {value!r}")
    try:
        s = float(value)
    except ValueError:
        raise SteerRequestError(f"{where}: strength of steer {name!r} must be a number, got "
                                f"{value!r}") from None
    if not math.isfinite(s):
        raise SteerRequestError(f"{where}: strength of steer {name!r} must be finite, got {value!r}")
    if abs(s) > max_strength:
        raise SteerRequestError(f"{where}: strength {s:g} of steer {name!r} exceeds the server's "
                                f"maximum |strength| {max_strength:g} (--steer-max-strength)")
    return s


def parse_request_steer(value: Any, known: Mapping[str, Any] | None, max_strength: float,
                        where: str = REQUEST_FIELD) -> dict[str, float]:
    """Parse and check a request's steer field. Returns name -> strength (zeros dropped).

    Accepts a mapping ``{"detox": 5, "sentiment": -3}`` or the ``vllm_xargs`` string form
    ``"detox:5,sentiment:-3"``. Raises :class:`SteerRequestError` naming the field and problem.
    """
    if value is None:
        return {}
    if isinstance(value, str):
        items: dict[str, Any] = {}
        for part in filter(None, (p.strip() for p in value.split(","))):
            name, sep, s = part.partition(":")
            if not sep or not name.strip() or not s.strip() or ":" in s:
                raise SteerRequestError(f"{where}: malformed entry {part!r} in {value!r}; "
                                        "expected 'name:strength[,name:strength...]'")
            if name.strip() in items:
                raise SteerRequestError(f"{where}: steer {name.strip()!r} given twice in {value!r}")
            items[name.strip()] = s.strip()
    elif isinstance(value, Mapping):
        items = dict(value)
    else:
        raise SteerRequestError(f"{where}: expected an object mapping steer names to strengths "
                                f"(e.g. {{\"detox\": 5}}) or a 'name:strength,...' string, got "
                                f"{type(value).__name__}")
    out: dict[str, float] = {}
    for name, raw in items.items():
        if not isinstance(name, str):
            raise SteerRequestError(f"{where}: steer names must be strings, got {name!r}")
        if known is not None and name not in known:
            avail = ", ".join(sorted(known)) or "none (start the server with --steer NAME=PATH)"
            raise SteerRequestError(f"{where}: unknown steer {name!r}; loaded steers: {avail}")
        s = _strength(name, raw, where, max_strength)
        if s != 0.0:
            out[name] = s
    return out
