"""Server configuration and request parsing. Light: no torch import (the frontend uses it)."""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import asdict, dataclass, field
from typing import Any, Literal, Mapping

from vllm_steer import ADDITIONAL_CONFIG_KEY, REQUEST_FIELD
from vllm_steer.names import echo, steer_name_problem

DEFAULT_MAX_STRENGTH = 50.0


class SteerRequestError(ValueError):
    """A request's ``steer`` field is invalid. The message names the field and the problem."""


@dataclass(frozen=True)
class Window:
    """A steer's strength over the generated tokens of one request (a generation window).

    ``t`` counts the request's generated tokens (0: the first one). The strength is ``base``
    outside ``[start, end)``; inside, it rises linearly from ``base`` to ``strength`` over the
    first ``ramp`` tokens of the window (reaching ``strength`` at ``t = start + ramp - 1``;
    ``ramp`` 0: at once) and stays there. Rows that are not generated tokens (prompt
    logprobs) have no ``t`` and get ``base``. The arithmetic, vectorised over rows:
    :func:`vllm_steer.reference.window_strengths`.
    """

    strength: float
    """The steer's strength inside the window (units of its epsilon)."""
    start: int = 0
    """First generated token (0-based) the window covers."""
    end: int | None = None
    """First generated token after the window (exclusive); None: to the last token."""
    ramp: int = 0
    """Tokens over which the strength rises from ``base`` to ``strength``; 0: at once."""
    base: float = 0.0
    """The strength outside the window (0; an operator floor raises it)."""

    def at(self, t: int) -> float:
        """The strength at generated token ``t`` (scalar form of ``window_strengths``)."""
        if t < self.start or (self.end is not None and t >= self.end):
            return self.base
        w = 1.0 if self.ramp <= 0 else min(1.0, (t - self.start + 1) / self.ramp)
        return self.base + w * (self.strength - self.base)


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
    steer_drafter: bool = True
    """Speculative decoding: steer the drafter's rows too (a draft model of the steers' hidden
    size) to keep the acceptance rate up; ``--no-steer-drafter``: propose unsteered. Either
    way the output follows the steered target (rejection sampling)."""
    presets: dict[str, dict[str, float]] = field(default_factory=dict)
    """``--steer-preset NAME=detox:4,sentiment:2``: preset name -> steer mix. Each preset is
    served as a model name (listed in ``/v1/models``); a request with ``"model": NAME`` gets
    the mix (precedence: :mod:`vllm_steer.policy`)."""
    defaults: dict[str, float] = field(default_factory=dict)
    """``--steer-default detox=2``: steer -> strength applied to every request that names
    neither the steer nor a preset naming it (a request may override it, also with 0)."""
    floors: dict[str, float] = field(default_factory=dict)
    """``--steer-floor detox=2``: steer -> the least signed strength a request is served with;
    a request asking for less is raised to it (the response says so in
    ``x-vllm-steer-floored``)."""

    def __post_init__(self):
        if not (isinstance(self.max_strength, (int, float)) and math.isfinite(self.max_strength)
                and self.max_strength > 0):
            raise ValueError(f"--steer-max-strength={self.max_strength!r}: must be a positive "
                             f"finite number (default {DEFAULT_MAX_STRENGTH})")
        self.max_strength = float(self.max_strength)
        if not isinstance(self.steers, dict):
            raise ValueError(f"steers must map steer names to file paths, got "
                             f"{type(self.steers).__name__}")
        for name, path in self.steers.items():
            problem = steer_name_problem(name)
            if problem:
                raise ValueError(f"steers: {problem}")
            if not isinstance(path, (str, os.PathLike)):
                raise ValueError(f"steers[{name!r}]: expected a file path, got "
                                 f"{type(path).__name__}")
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
        if d.get("steer_drafter", True) is True:  # the default is not written
            d.pop("steer_drafter", None)
        for k in _POLICY_KEYS:  # presets, defaults, floors only when set
            if not d.get(k):
                d.pop(k, None)
        return {ADDITIONAL_CONFIG_KEY: d}

    @classmethod
    def from_additional_config(cls, additional_config: Mapping[str, Any] | None
                               ) -> "SteerServerConfig | None":
        if not additional_config or ADDITIONAL_CONFIG_KEY not in additional_config:
            return None
        d = dict(additional_config[ADDITIONAL_CONFIG_KEY])
        unknown = (set(d) - {"steers", "max_strength", "backend", "steer_drafter"}
                   - _RUNTIME_KEYS - _POLICY_KEYS)
        if unknown:
            raise ValueError(f"additional_config[{ADDITIONAL_CONFIG_KEY!r}] has unknown keys "
                             f"{sorted(unknown)}; known: steers, max_strength, backend, "
                             "steer_drafter, "
                             f"{', '.join(sorted(_RUNTIME_KEYS | _POLICY_KEYS))}")
        steers = d.get("steers") or {}
        if isinstance(steers, (list, tuple)):
            steers = dict(parse_steer_arg(s) for s in steers)
        return cls(steers=dict(steers), max_strength=d.get("max_strength", DEFAULT_MAX_STRENGTH),
                   backend=d.get("backend", "auto"),
                   steer_drafter=bool(d.get("steer_drafter", True)),
                   **{k: d[k] for k in _RUNTIME_KEYS if k in d},
                   **_policy_fields(d))


#: Keys of the run-time steer management (issue 15) in ``additional_config["vllm_steer"]``.
_RUNTIME_KEYS = frozenset({"max_steers", "max_steer_rank", "steer_dir", "enable_updates",
                           "updates_any_path"})


#: Keys of the operator policy (issue 24: presets, defaults, floors; see vllm_steer.policy).
_POLICY_KEYS = frozenset({"presets", "defaults", "floors"})


def _policy_fields(d: Mapping[str, Any]) -> dict[str, Any]:
    """Presets, defaults and floors from ``additional_config`` (offline: the mix may also be
    the flag's string form, ``{"presets": {"polite": "detox:4"}}``)."""
    from vllm_steer.policy import parse_mix

    out: dict[str, Any] = {}
    presets = d.get("presets") or {}
    if presets:
        if not isinstance(presets, Mapping):
            raise ValueError("additional_config presets: expected a mapping preset name -> "
                             "{steer: strength} (or 'steer:strength,...')")
        out["presets"] = {n: (parse_mix(m, "presets", f"{n}={m}") if isinstance(m, str)
                              else {k: float(v) for k, v in dict(m).items()})
                          for n, m in presets.items()}
    for k in ("defaults", "floors"):
        v = d.get(k) or {}
        if v:
            if not isinstance(v, Mapping):
                raise ValueError(f"additional_config {k}: expected a mapping steer -> strength")
            out[k] = {n: float(s) for n, s in v.items()}
    return out


def parse_steer_arg(arg: str) -> tuple[str, str]:
    """``NAME=PATH`` -> (NAME, PATH); ``PATH`` alone takes the name from the file's metadata."""
    if "=" in arg and not os.path.exists(arg):
        name, path = arg.split("=", 1)
        name = name.strip()
        problem = steer_name_problem(name)
        if problem:
            raise ValueError(f"--steer {echo(arg, 80)}: {problem} (use NAME=PATH)")
        return name, path
    from vllm_steer.format import read_metadata

    return read_metadata(arg).name, arg


#: What a strength string may look like: a JSON number, optionally with a leading '+'
#: (ASCII digits only; no '_' separators, no 'inf'/'nan', no full-width digits).
_STRENGTH_RE = re.compile(r"[+-]?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
#: Longest strength string accepted.
MAX_STRENGTH_CHARS = 32
#: Longest ``vllm_xargs`` steer string accepted.
MAX_XARGS_CHARS = 4096
#: How many loaded steer names an "unknown steer" error lists.
LIST_NAMES = 8


def _strength(name: str, value: Any, where: str, max_strength: float) -> float:
    def bad(what: str) -> SteerRequestError:
        return SteerRequestError(f"{where}: strength of steer {echo(name)} {what}")

    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise bad(f"must be a number, got {type(value).__name__} {echo(value)}")
    if isinstance(value, int):  # exact: a 400-digit integer is over any maximum, not a crash
        if abs(value) > max_strength:
            raise SteerRequestError(f"{where}: strength {echo(value)} of steer {echo(name)} "
                                    f"exceeds the server's maximum |strength| {max_strength:g} "
                                    "(--steer-max-strength)")
        try:
            return float(value)
        except OverflowError:
            raise bad(f"must be finite, got {echo(value)}") from None
    if isinstance(value, str):
        text = value.strip(" \t")
        if len(text) > MAX_STRENGTH_CHARS or not _STRENGTH_RE.fullmatch(text):
            raise bad(f"must be a number, got {echo(value)} (a JSON number such as 5, -2.5 "
                      "or 1e1)")
        s = float(text)
    else:
        s = value
    if not math.isfinite(s):
        raise bad(f"must be finite, got {echo(value)}")
    if abs(s) > max_strength:
        raise SteerRequestError(f"{where}: strength {s:g} of steer {echo(name)} exceeds the "
                                f"server's maximum |strength| {max_strength:g} "
                                "(--steer-max-strength)")
    return s


def _names_list(known: Mapping[str, Any]) -> str:
    names = sorted(known)
    if not names:
        return "none (start the server with --steer NAME=PATH)"
    more = len(names) - LIST_NAMES
    return ", ".join(names[:LIST_NAMES]) + (f" and {more} more" if more > 0 else "")


#: Largest generated-token index (``start``, ``end``, ``ramp``) a window may name.
MAX_WINDOW_TOKEN = 1 << 20
#: Longest steer value (a mapping: its JSON serialisation) accepted.
MAX_STEER_CHARS = 4096
#: The keys a window object may have.
WINDOW_KEYS = ("strength", "start", "end", "ramp", "base")


def _show(value: int) -> str:
    return echo(value) if abs(value) < 10**18 else f"an integer of {value.bit_length()} bits"


def _token_index(name: str, key: str, value: Any, where: str, low: int) -> int:
    """A window's token index: a JSON integer (``3.0`` accepted as 3), ``low..MAX_WINDOW_TOKEN``."""
    def bad(what: str) -> SteerRequestError:
        return SteerRequestError(f"{where}: window of steer {echo(name)}: {key!r} {what}")

    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise bad(f"must be an integer token index, got {type(value).__name__} {echo(value)}")
    if isinstance(value, float):
        if not (math.isfinite(value) and value.is_integer()):
            raise bad(f"must be an integer token index, got {echo(value)}")
        value = int(value)
    if value < low:
        raise bad(f"is {_show(value)}; it must be at least {low}"
                  + (" (tokens are counted from 0)" if low == 0 else ""))
    if value > MAX_WINDOW_TOKEN:
        raise bad(f"is {_show(value)}; at most {MAX_WINDOW_TOKEN} (1<<20) is allowed")
    return value


def _window(name: str, value: Mapping, where: str, max_strength: float) -> Window:
    unknown = [k for k in value if k not in WINDOW_KEYS]
    if unknown:
        raise SteerRequestError(
            f"{where}: window of steer {echo(name)} has unknown key(s) "
            f"{', '.join(echo(k) for k in unknown[:4])}{' ...' if len(unknown) > 4 else ''}; "
            f"allowed: {', '.join(WINDOW_KEYS)}")
    if "strength" not in value:
        raise SteerRequestError(f"{where}: window of steer {echo(name)} has no 'strength' (the "
                                "strength inside the window; 'start', 'end', 'ramp' and 'base' "
                                "are optional)")
    strength = _strength(name, value["strength"], where, max_strength)
    base = 0.0
    if value.get("base") is not None:
        try:
            base = _strength(name, value["base"], where, max_strength)
        except SteerRequestError as e:  # the same checks, told as the window's base
            raise SteerRequestError(str(e).replace(f"{where}: strength",
                                                   f"{where}: window base", 1)) from None
    start = _token_index(name, "start", value.get("start", 0), where, 0) \
        if value.get("start") is not None else 0
    ramp = _token_index(name, "ramp", value.get("ramp", 0), where, 0) \
        if value.get("ramp") is not None else 0
    end = None
    if value.get("end") is not None:
        end = _token_index(name, "end", value["end"], where, 1)
        if end <= start:
            raise SteerRequestError(f"{where}: window of steer {echo(name)}: 'end' {end} must be "
                                    f"greater than 'start' {start} (the window is [start, end) "
                                    "over generated tokens; leave 'end' out for no end)")
    return Window(strength=strength, start=start, end=end, ramp=ramp, base=base)


def _serialised_length(value: Any) -> int | None:
    try:
        return len(json.dumps(value, default=repr))
    except (TypeError, ValueError, RecursionError):  # checked item by item below
        return None


def _parse_steer(value: Any, known: Mapping[str, Any] | None, max_strength: float,
                 where: str) -> tuple[dict[str, float], dict[str, Window]]:
    if value is None:
        return {}, {}
    if isinstance(value, str):
        if len(value) > MAX_XARGS_CHARS:
            raise SteerRequestError(f"{where}: the 'name:strength,...' string is {len(value)} "
                                    f"characters; at most {MAX_XARGS_CHARS} are allowed")
        items: dict[str, Any] = {}
        if value.strip():
            for part in (p.strip() for p in value.split(",")):
                name, sep, s = part.partition(":")
                name, s = name.strip(), s.strip()
                if not sep or not name or not s or ":" in s:
                    raise SteerRequestError(
                        f"{where}: malformed entry {echo(part)} in {echo(value)}; expected "
                        "'name:strength[,name:strength...]'"
                        + (" (empty entry: a stray ',')" if not part else ""))
                if name in items:
                    raise SteerRequestError(f"{where}: steer {echo(name)} given twice in "
                                            f"{echo(value)}")
                if any(c in s for c in "@~{}"):
                    raise SteerRequestError(
                        f"{where}: {echo(part)}: the 'name:strength' string form (vllm_xargs) "
                        "has no generation windows; send the steer as a JSON object in the "
                        "top-level 'steer' field, e.g. extra_body={'steer': {'detox': "
                        "{'strength': 5, 'start': 0, 'end': 32}}}")
                items[name] = s
    elif isinstance(value, Mapping):
        items = dict(value)
    else:
        raise SteerRequestError(f"{where}: expected an object mapping steer names to strengths "
                                f"(e.g. {{\"detox\": 5}}) or a 'name:strength,...' string, got "
                                f"{type(value).__name__}")
    for name in items:  # names first: an unknown name is told as such, however long
        if not isinstance(name, str):
            raise SteerRequestError(f"{where}: steer names must be strings, got {echo(name)}")
        if known is not None and name not in known:
            raise SteerRequestError(f"{where}: unknown steer {echo(name)}; loaded steers: "
                                    f"{_names_list(known)}")
        if known is None and steer_name_problem(name):
            raise SteerRequestError(f"{where}: {steer_name_problem(name)}")
    if not isinstance(value, str):
        n = _serialised_length(value)
        if n is not None and n > MAX_STEER_CHARS:
            raise SteerRequestError(f"{where}: the steer value is {n} characters as JSON; at most "
                                    f"{MAX_STEER_CHARS} are allowed")
    out: dict[str, float] = {}
    windows: dict[str, Window] = {}
    for name, raw in items.items():
        if isinstance(raw, Mapping):
            w = _window(name, raw, where, max_strength)
            if w.strength != 0.0 or w.base != 0.0:
                out[name] = w.strength if w.strength != 0.0 else w.base
                windows[name] = w
            continue
        s = _strength(name, raw, where, max_strength)
        if s != 0.0:
            out[name] = s
    return out, windows


def parse_request_steer(value: Any, known: Mapping[str, Any] | None, max_strength: float,
                        where: str = REQUEST_FIELD) -> dict[str, float]:
    """Parse and check a request's steer field. Returns name -> strength (zeros dropped).

    Accepts a mapping ``{"detox": 5, "sentiment": -3}`` or the ``vllm_xargs`` string form
    ``"detox:5,sentiment:-3"`` (an empty string is no steer). Strengths are numbers or
    strings holding a JSON number. In the mapping, a strength may be a generation window
    ``{"strength": 5, "start": 0, "end": 32, "ramp": 16, "base": 0}`` (see :class:`Window`;
    the string form has none): it maps to its window's ``strength`` (its ``base`` when the
    strength is 0, so a steer that acts only outside its window is still listed); a window
    whose strength and base are both 0 is no steer. The windows themselves:
    :func:`request_windows`. ``known=None`` checks names against the name rule only.
    Raises :class:`SteerRequestError` naming the field and the problem; the message repeats
    at most a short prefix of any value.
    """
    return _parse_steer(value, known, max_strength, where)[0]


def request_windows(value: Any, known: Mapping[str, Any] | None = None,
                    max_strength: float = math.inf, where: str = REQUEST_FIELD
                    ) -> dict[str, Window]:
    """The steers of a request's steer field that are given as window objects: name ->
    :class:`Window` (steers given as plain numbers are not listed; nor are windows whose
    strength and base are both 0). Checks the whole value as :func:`parse_request_steer`
    does and raises :class:`SteerRequestError` likewise."""
    return _parse_steer(value, known, max_strength, where)[1]
