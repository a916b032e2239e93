"""A request's steers: the typed :class:`SteerRequest`, parsed once, and every message about
them.

The ``steer`` value of a request (the OpenAI body's top-level field, ``vllm_xargs={"steer":
"name:strength,..."}`` or offline ``SamplingParams(extra_args={"steer": ...})``) is a user's
value: :meth:`SteerRequest.parse` is its one parser, run once, where it enters the frontend (API
server or ``LLM`` process). From there the typed request travels on:

- the frontend applies the operator's policy (presets, ``--steer-default``, ``--steer-floor``:
  :mod:`vllm_steer.policy`) to it once and writes its serialised form, which has a version
  (:meth:`SteerRequest.to_wire`), into ``extra_args["steer"]``; in the frontend that form
  still holds the typed request (:class:`SteerWire`), so nothing there decodes it again;
- the engine core decodes it once (:meth:`SteerRequest.from_wire`, the one decoder of the
  serialised form; :meth:`~SteerRequest.parse` never accepts it) and binds each steer to the
  bank slot and load that hold it (:class:`BoundSteer`);
- the worker reads only the bound form.

Limits (:data:`MAX_STEER_CHARS`, :data:`MAX_WINDOW_TOKEN`, ...) and every message about a
request's steers live here; "unknown steer" is built by :func:`unknown_steer` alone. Light:
standard library only (the frontend imports it).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, dataclass
from collections.abc import Mapping, Sequence  # isinstance on these, not typing's aliases
from typing import Any

from vllm_steer import REQUEST_FIELD
from vllm_steer.names import echo, steer_name_problem

#: Why the plugin refused a request: the ``reason`` label of
#: ``vllm_steer:requests_refused_total`` (:mod:`vllm_steer.metrics`), with what it means.
REFUSAL_REASONS = {
    "bad_steer": "the steer value is malformed (its form, a strength that is not a number, "
                 "a window, its size)",
    "unknown_steer": "a steer that is not loaded and has no file in --steer-dir",
    "strength_limit": "a strength over --steer-max-strength",
    "too_many_steers": "more steers than --max-steers-per-request or --max-steers",
    "bank_full": "no free steer slot for a --steer-dir steer's first use",
    "bad_file": "a --steer-dir steer's file refused (header, hidden size, contents)",
    "unknown_preset": "a model name that is neither the served model, a LoRA adapter nor a "
                      "preset (HTTP 404)",
    "beam_search": "a steered beam-search request",
    "preset_route": "a preset named as the model of a route that builds its own sampling "
                    "parameters (it would be served without the preset's steers)",
    "streaming_input": "a streaming-input request's later input chunk with other vector "
                       "steers than its first, or a window on a vector steer in such a request",
    "internal": "a fault of the plugin (HTTP 500)",
}
#: The reason of a refusal that names no other.
BAD_STEER = "bad_steer"


class SteerRequestError(ValueError):
    """A request's ``steer`` field is invalid. The message names the field and the problem;
    :attr:`reason` says which kind of refusal it is (a key of :data:`REFUSAL_REASONS`)."""

    def __init__(self, message: str = "", reason: str = BAD_STEER):
        super().__init__(message)
        self.reason = reason


def refusal_reason(exc: BaseException) -> str:
    """The :data:`REFUSAL_REASONS` key of a refusal (:data:`BAD_STEER` when it names none)."""
    reason = getattr(exc, "reason", None)
    return reason if reason in REFUSAL_REASONS else BAD_STEER


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




#: What a strength string may look like: a JSON number, optionally with a leading '+'
#: (ASCII digits only; no '_' separators, no 'inf'/'nan', no full-width digits).
STRENGTH_RE = re.compile(r"[+-]?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
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
                                    "(--steer-max-strength)", "strength_limit")
        try:
            return float(value)
        except OverflowError:
            raise bad(f"must be finite, got {echo(value)}") from None
    if isinstance(value, str):
        text = value.strip(" \t")
        if len(text) > MAX_STRENGTH_CHARS or not STRENGTH_RE.fullmatch(text):
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
                                "(--steer-max-strength)", "strength_limit")
    return s


def names_list(known: Mapping[str, Any]) -> str:
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
                                                   f"{where}: window base", 1),
                                    e.reason) from None
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


def _surely_short(value: Mapping) -> bool:
    """Whether a mapping is surely under :data:`MAX_STEER_CHARS` as JSON without encoding it:
    at most 8 entries, each an ASCII name of at most 64 characters (6 characters each once
    escaped) with a float or a 64-bit int (24 characters at most): under 3,400 in all."""
    if len(value) > 8:
        return False
    for name, raw in value.items():
        if type(name) is not str or len(name) > 64 or not name.isascii():
            return False
        kind = type(raw)
        if not (kind is float or (kind is int and -(1 << 63) <= raw < 1 << 63)):
            return False
    return True


def _serialised_length(value: Any) -> int | None:
    """The value's length as JSON; None when it cannot be encoded (its items are checked one
    by one after)."""
    try:
        return len(json.dumps(value, default=repr))
    except (TypeError, ValueError, RecursionError):  # checked item by item below
        return None


def _string_items(value: str, where: str) -> dict[str, str]:
    """The 'name:strength,...' string form (vllm_xargs) -> ``{name: strength text}``."""
    if len(value) > MAX_XARGS_CHARS:
        raise SteerRequestError(f"{where}: the 'name:strength,...' string is {len(value)} "
                                f"characters; at most {MAX_XARGS_CHARS} are allowed")
    items: dict[str, str] = {}
    if not value.strip():
        return items
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
    return items


def _check_names(items: Mapping[Any, Any], known: Mapping[str, Any] | None,
                 where: str) -> None:
    """Each name a string, and a loaded steer (or, with no ``known``, a valid name)."""
    for name in items:
        if not isinstance(name, str):
            raise SteerRequestError(f"{where}: steer names must be strings, got {echo(name)}")
        if known is not None and name not in known:
            raise SteerRequestError(unknown_steer(where, name, known), "unknown_steer")
        if known is None and steer_name_problem(name):
            raise SteerRequestError(f"{where}: {steer_name_problem(name)}")


def _parse_steer(value: Any, known: Mapping[str, Any] | None, max_strength: float,
                 where: str) -> tuple[tuple[str, float | Window], ...]:
    """The grammar: a raw ``steer`` value -> its entries ``(name, strength or Window)`` in the
    order given, zeros kept."""
    if value is None:
        return ()
    if isinstance(value, str):
        items = _string_items(value, where)
    elif isinstance(value, Mapping):
        if WIRE_KEY in value:
            raise SteerRequestError(f"{where}: {WIRE_KEY!r} marks the serialised form vllm-steer "
                                    "writes itself, not a request's value; send a mapping of "
                                    "steer names to strengths, e.g. {\"detox\": 5}")
        items = dict(value)
    else:
        raise SteerRequestError(f"{where}: expected an object mapping steer names to strengths "
                                f"(e.g. {{\"detox\": 5}}) or a 'name:strength,...' string, got "
                                f"{type(value).__name__}")
    _check_names(items, known, where)  # names first: an unknown name is told as such
    if not isinstance(value, str) and not _surely_short(items):  # encoded only when it may be long
        n = _serialised_length(value)
        if n is not None and n > MAX_STEER_CHARS:
            raise SteerRequestError(f"{where}: the steer value is {n} characters as JSON; at most "
                                    f"{MAX_STEER_CHARS} are allowed")
    entries: list[tuple[str, float | Window]] = []
    for name, raw in items.items():
        if isinstance(raw, Mapping):
            entries.append((name, _window(name, raw, where, max_strength)))
        else:
            entries.append((name, _strength(name, raw, where, max_strength)))
    return tuple(entries)


def parse_request_steer(value: Any, known: Mapping[str, Any] | None, max_strength: float,
                        where: str = REQUEST_FIELD) -> dict[str, float]:
    """The non-zero strengths of a steer value: ``SteerRequest.parse(...).strengths`` (see
    :meth:`SteerRequest.parse` for the grammar)."""
    return SteerRequest.parse(value, known, max_strength, where).strengths


def request_windows(value: Any, known: Mapping[str, Any] | None = None,
                    max_strength: float = math.inf, where: str = REQUEST_FIELD
                    ) -> dict[str, Window]:
    """The steers of a steer value given as window objects: ``SteerRequest.parse(...).windows``."""
    return SteerRequest.parse(value, known, max_strength, where).windows


def unknown_steer(where: str, name: Any, loaded, steer_dir: str | None = None,
                  label: str = "loaded steers", listing: str | None = None) -> str:
    """The one "unknown steer" message: ``name`` is not among ``loaded`` (names) and, with a
    ``steer_dir``, has no file there either. ``label``/``listing``: how the known names are
    introduced and listed (default: the first :data:`LIST_NAMES` loaded steers)."""
    listing = names_list(loaded) if listing is None else listing
    if steer_dir:
        return (f"{where}: unknown steer {echo(name)}: not loaded (loaded: {listing}) and no "
                f"file {name}.safetensors or {name}.gguf in --steer-dir {steer_dir}")
    return f"{where}: unknown steer {echo(name)}; {label}: {listing}"


#: Version of the serialised form (:meth:`SteerRequest.to_wire`; 2: the steers the request is
#: served with, the operator's policy applied). The key cannot be a steer name (``@`` is
#: outside the name rule), so the form is never taken for a user's mapping.
WIRE_VERSION = 2
WIRE_KEY = "@vllm_steer"


def _served(v: float | Window) -> float:
    """The strength a steer counts with: a number as it is; a window its ``strength``, or its
    ``base`` when the strength is 0 (a steer acting only outside its window is still on)."""
    if isinstance(v, Window):
        return v.strength if v.strength != 0.0 else v.base
    return v


def _wire_value(v: float | Window) -> float | dict[str, Any]:
    return asdict(v) if isinstance(v, Window) else v


@dataclass(frozen=True)
class SteerRequest:
    """A request's steers, parsed and checked: ``(name, strength or Window)`` in the order
    given, zeros kept (a steer named with strength 0 overrides a preset or default)."""

    entries: tuple[tuple[str, float | Window], ...] = ()
    """Each steer the request names, with its signed strength or its generation window."""

    # ---- parsing ----------------------------------------------------------------------------
    @classmethod
    def parse(cls, value: Any, known: Mapping[str, Any] | None = None,
              max_strength: float = math.inf, where: str = REQUEST_FIELD) -> "SteerRequest":
        """Parse and check a user's steer value (never the serialised form: that is
        :meth:`from_wire`'s).

        Accepts a mapping ``{"detox": 5, "sentiment": -3}`` or the ``vllm_xargs`` string form
        ``"detox:5,sentiment:-3"`` (an empty string is no steer). Strengths are numbers or
        strings holding a JSON number. In the mapping, a strength may be a generation window
        ``{"strength": 5, "start": 0, "end": 32, "ramp": 16, "base": 0}`` (see :class:`Window`;
        the string form has none). ``known=None`` checks names against the name rule only.
        Raises :class:`SteerRequestError` naming the field and the problem; the message
        repeats at most a short prefix of any value.
        """
        return cls(_parse_steer(value, known, max_strength, where))

    # ---- views ------------------------------------------------------------------------------
    @property
    def names(self) -> tuple[str, ...]:
        return tuple(n for n, _ in self.entries)

    @property
    def named(self) -> dict[str, float | Window]:
        """Every steer the request names -> its strength or window (zeros kept)."""
        return dict(self.entries)

    @property
    def strengths(self) -> dict[str, float]:
        """The steers it is served with -> strength (zeros dropped; a window counts with its
        ``strength``, or its ``base`` when the strength is 0, so a steer that acts only
        outside its window is still listed; a window whose strength and base are 0 is none)."""
        return {name: _served(v) for name, v in self.entries if _served(v) != 0.0}

    @property
    def windows(self) -> dict[str, Window]:
        """The steers given as windows (not those whose strength and base are both 0)."""
        return {n: v for n, v in self.entries
                if isinstance(v, Window) and (v.strength != 0.0 or v.base != 0.0)}

    def __bool__(self) -> bool:
        return bool(self.strengths)

    # ---- the serialised form -----------------------------------------------------------------
    def to_wire(self) -> "SteerWire":
        """The form carried in ``extra_args["steer"]`` (JSON-safe, versioned), holding this
        request for the process that made it (:class:`SteerWire`)."""
        wire = SteerWire({WIRE_KEY: WIRE_VERSION,
                          "steers": [[n, _wire_value(v)] for n, v in self.entries]})
        wire.request = self
        return wire

    @classmethod
    def from_wire(cls, value: Mapping[str, Any], where: str = REQUEST_FIELD) -> "SteerRequest":
        """The one decoder of the serialised form (:meth:`to_wire`): in the process that made it,
        the request it holds; elsewhere (the engine core) decoded. Raises
        :class:`SteerRequestError` for another version or a malformed form."""
        if isinstance(value, SteerWire):
            return value.request
        if not is_wire(value):
            raise SteerRequestError(f"{where}: {echo(value)} is not the serialised form "
                                    "vllm-steer's frontend writes: the request did not pass its "
                                    "admission (send it through vLLM's LLM, AsyncLLM or API "
                                    "server, with the plugin installed)")
        version = value.get(WIRE_KEY)
        if version != WIRE_VERSION:
            raise SteerRequestError(f"{where}: serialised steer request of version "
                                    f"{echo(version)}; this vllm-steer reads version "
                                    f"{WIRE_VERSION} (frontend and engine run different "
                                    "vllm-steer versions: install the same one everywhere)")
        try:  # checked as it is read (a form made elsewhere): never another exception
            entries = []
            items = value.get("steers") or ()
            if not isinstance(items, (list, tuple)) or not all(
                    isinstance(i, (list, tuple)) and len(i) == 2 for i in items):
                raise TypeError("'steers' must be a list of [name, strength or window] pairs")
            for name, v in items:
                problem = steer_name_problem(name)
                if problem:
                    raise SteerRequestError(f"{where}: {problem}")
                entries.append((name, _window(name, v, where, math.inf) if isinstance(v, Mapping)
                                else _strength(name, v, where, math.inf)))
        except SteerRequestError:
            raise
        except (TypeError, ValueError, OverflowError) as e:
            raise SteerRequestError(f"{where}: malformed serialised steer request ({e}); it "
                                    "is written by vllm-steer's frontend, not by hand") from None
        return cls(tuple(entries))


class SteerWire(dict):
    """The serialised form of a :class:`SteerRequest` (:meth:`SteerRequest.to_wire`): a plain
    JSON-safe dict wherever it is sent (msgpack, JSON keep only the dict), which in the process
    that made it still holds the typed request (``request``), so that process never decodes
    it. A plain dict of the same keys is a value from outside: the frontend parses it as a
    user's value (and refuses it), the engine core decodes it. ``origin``: the caller's own
    value, when admission wrote this form into the caller's ``SamplingParams`` (offline, or an
    ``AsyncLLM`` caller), which may be passed again after the caller changed that value."""

    __slots__ = ("request", "origin")


def is_wire(value: Any) -> bool:
    """Whether ``value`` is a :meth:`SteerRequest.to_wire` form (not a user's value)."""
    return isinstance(value, Mapping) and WIRE_KEY in value


def admitted(value: Any) -> SteerRequest | None:
    """The request a frontend of this process admitted, if ``value`` is its serialised form
    (:class:`SteerWire`), else None (a user's value, or none)."""
    return value.request if isinstance(value, SteerWire) else None


#: ``SamplingParams.extra_args`` key the engine core writes: the request's steers bound to the
#: bank slots that hold them, ``[[name, bank_slot, load_id, strength or window], ...]``
#: (:class:`BoundSteer`).
BOUND_KEY = "vllm_steer_bound"


@dataclass(frozen=True)
class BoundSteer:
    """One steer of a request, bound by the engine core to the bank slot and the load that
    hold it (:class:`vllm_steer.integrations.engine.registry.SteerRegistry`): the only form the
    workers read."""

    name: str
    bank_slot: int
    """The slot of the steer bank (every worker's factors) holding the steer."""
    load_id: int
    """Which load of the steer the slot must hold (the registry's load id; a slot
    re-used by another load no longer serves the request)."""
    value: float | Window
    """The strength, or the generation window."""

    @property
    def strength(self) -> float:
        return _served(self.value)

    @staticmethod
    def to_wire(bound: Sequence["BoundSteer"]) -> list:
        return [[b.name, b.bank_slot, b.load_id, _wire_value(b.value)] for b in bound]

    @staticmethod
    def from_wire(value: Any) -> list["BoundSteer"]:
        return [BoundSteer(n, int(s), int(g), Window(**v) if isinstance(v, Mapping) else float(v))
                for n, s, g, v in value or ()]
