"""Operator steer policy: presets (served as model names), defaults and floors. Pure and
torch-free (the API server and the engine core both use it).

The strength a request is served with, per steer (the one rule; docs/serving.md has it as a
table, "Presets, defaults and floors"):

1. the request's ``steer`` names the steer (also with strength 0): the request's value;
2. else the preset named by the request's ``model`` names it: the preset's strength;
3. else ``--steer-default NAME=X`` names it: ``X``;
4. else 0 (unsteered).

Then ``--steer-floor NAME=F`` raises it: a number below ``F`` is served as ``F``; a generation
window (:class:`vllm_steer.request.Window`, or its request form ``{"strength": ...}``) gets
``strength`` and ``base`` each raised to ``F``, so its strength at no token is below ``F``.
A floor is a minimum of the *signed* strength (``value >= F``): ``detox=2`` means at least 2
towards the steer's positive label; a negative floor ``detox=-2`` lets a request steer
towards the negative label by at most 2 and leaves every other request alone.

Everything here works on the typed request (:class:`vllm_steer.request.SteerRequest`); the math
of steering is in :mod:`vllm_steer.reference` (Semantics: see reference).
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any, Mapping

from vllm_steer.names import echo, steer_name_problem
from vllm_steer.request import (MAX_STRENGTH_CHARS, STRENGTH_RE, SteerRequest, Window,
                                unknown_steer)

#: Response headers the API server sets on a steered request (see :func:`header_values`).
APPLIED_HEADER = "x-vllm-steer-applied"
FLOORED_HEADER = "x-vllm-steer-floored"


#: How policy errors introduce the names a preset, default or floor may use.
_KNOWN_LABEL = "loaded steers (and --steer-dir files)"


class PolicyError(ValueError):
    """A bad ``--steer-preset`` / ``--steer-default`` / ``--steer-floor`` value; the message
    names the flag, the value, the problem and the fix."""


def _number(flag: str, arg: str, name: str, text: str) -> float:
    """A strength written as text, in a request's grammar (:data:`vllm_steer.request.
    STRENGTH_RE`: a JSON number, optionally with a leading '+'; not ``1_0`` nor full-width
    digits, which Python's ``float`` would take)."""
    t = text.strip(" \t")
    try:
        v = float(t)
    except ValueError:
        v = None
    if v is not None and not math.isfinite(v):
        raise PolicyError(f"{flag} {echo(arg, 80)}: strength of steer {echo(name)} must be "
                          "finite")
    if v is None or len(t) > MAX_STRENGTH_CHARS or not STRENGTH_RE.fullmatch(t):
        raise PolicyError(f"{flag} {echo(arg, 80)}: strength {echo(text)} of steer {echo(name)} "
                          "is not a number (e.g. detox:4)")
    return v


def strength_value(owner: str, name: Any, value: Any) -> float:
    """A strength given as a JSON / Python value (a number, or a string holding one): the float,
    or a :class:`PolicyError` naming ``owner``, the steer and the problem (not a number, a
    boolean, not finite, too large for a float)."""
    if isinstance(value, str):
        return _number(owner, value, str(name), value)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise PolicyError(f"{owner}: strength {echo(value)} of steer {echo(name)} is not a "
                          "number (e.g. {\"detox\": 4})")
    try:
        v = float(value)
    except OverflowError:  # an int beyond any float: not repeated (it may be thousands of digits)
        raise PolicyError(f"{owner}: strength of steer {echo(name)} is an integer of "
                          f"{value.bit_length()} bits, too large for a number; give a finite "
                          "strength (e.g. 4)") from None
    if not math.isfinite(v):
        raise PolicyError(f"{owner}: strength {echo(value, 40)} of steer {echo(name)} must be "
                          "a finite number")
    return v


def parse_mix(text: str, flag: str = "--steer-preset", arg: str | None = None
              ) -> dict[str, float]:
    """``"detox:4,sentiment:2"`` -> ``{"detox": 4.0, "sentiment": 2.0}`` (zeros kept)."""
    arg = text if arg is None else arg
    out: dict[str, float] = {}
    for part in (p.strip() for p in text.split(",")):
        name, sep, s = part.partition(":")
        name = name.strip()
        if not sep or not name or not s.strip():
            form = ("NAME=steer:strength[,steer:strength...], e.g. polite=detox:4,sentiment:2"
                    if flag == "--steer-preset" else  # elsewhere the preset's name is its key
                    "steer:strength[,steer:strength...], e.g. detox:4,sentiment:2")
            raise PolicyError(f"{flag} {echo(arg, 80)}: malformed entry {echo(part)}; expected "
                              f"{form}")
        problem = steer_name_problem(name)
        if problem:
            raise PolicyError(f"{flag} {echo(arg, 80)}: {problem}")
        if name in out:
            raise PolicyError(f"{flag} {echo(arg, 80)}: steer {echo(name)} given twice")
        out[name] = _number(flag, arg, name, s)
    return out


def parse_preset_arg(arg: str) -> tuple[str, dict[str, float]]:
    """``--steer-preset NAME=detox:4,sentiment:2`` -> ``(NAME, {"detox": 4, ...})``."""
    name, sep, mix = arg.partition("=")
    name = name.strip()
    if not sep or not mix.strip():
        raise PolicyError(f"--steer-preset {echo(arg, 80)}: expected NAME=steer:strength"
                          "[,steer:strength...], e.g. polite=detox:4,sentiment:2")
    problem = preset_name_problem(name)
    if problem:
        raise PolicyError(f"--steer-preset {echo(arg, 80)}: {problem}")
    return name, parse_mix(mix, "--steer-preset", arg)


def parse_value_arg(arg: str, flag: str) -> dict[str, float]:
    """``--steer-default detox=2`` / ``--steer-floor detox=2,sentiment=-1`` -> a mapping."""
    out: dict[str, float] = {}
    for part in (p.strip() for p in arg.split(",")):
        name, sep, s = part.partition("=")
        name = name.strip()
        if not sep or not name or not s.strip():
            raise PolicyError(f"{flag} {echo(arg, 80)}: expected STEER=STRENGTH (e.g. "
                              f"{flag} detox=2)")
        problem = steer_name_problem(name)
        if problem:
            raise PolicyError(f"{flag} {echo(arg, 80)}: {problem}")
        if name in out:
            raise PolicyError(f"{flag} {echo(arg, 80)}: steer {echo(name)} given twice")
        out[name] = _number(flag, arg, name, s)
    return out


def preset_name_problem(name: Any) -> str | None:
    """Why ``name`` cannot be a preset (model) name, or None. Same rule as steer names."""
    problem = steer_name_problem(name)
    return problem.replace("steer name", "preset name") if problem else None


def check_policy(presets: Mapping[str, Mapping[str, float]], defaults: Mapping[str, float],
                 floors: Mapping[str, float], steers, max_strength: float,
                 reserved: Mapping[str, str] | None = None) -> None:
    """Start-up check of the operator's policy. ``steers``: the names a request may use (the
    loaded steers and the files of ``--steer-dir``); ``reserved``: model names already taken
    (name -> what takes it, e.g. the served model name or a LoRA module). Raises
    :class:`PolicyError` naming the flag, the value, the problem and the fix."""
    steers = set(steers)
    known = ", ".join(sorted(steers)) or "none"

    def check(flag: str, owner: str, name: str, value: float) -> None:
        if name not in steers:
            raise PolicyError(unknown_steer(f"{flag} {owner}", name, steers, label=_KNOWN_LABEL,
                                            listing=known)
                              + ". Load it with --steer NAME=PATH or fix the name")
        if abs(value) > max_strength:
            raise PolicyError(f"{flag} {owner}: strength {value:g} of steer {echo(name)} "
                              f"exceeds the server's maximum |strength| {max_strength:g}; "
                              "lower it or raise --steer-max-strength")

    for preset, mix in presets.items():
        if reserved and preset in reserved:
            raise PolicyError(f"--steer-preset {preset}: the name {preset!r} is already "
                              f"{reserved[preset]}; give the preset another name")
        if not mix:
            raise PolicyError(f"--steer-preset {preset}: names no steer")
        for name, value in mix.items():
            check("--steer-preset", preset, name, value)
    for flag, values in (("--steer-default", defaults), ("--steer-floor", floors)):
        for name, value in values.items():
            check(flag, f"{name}={value:g}", name, value)


PRESET_BODY_EXAMPLE = '{"name": "polite", "steer": {"detox": 4, "sentiment": -2}}'


def preset_from_body(body: Any, steers, max_strength: float,
                     reserved: Mapping[str, str] | None = None) -> tuple[str, dict[str, float]]:
    """The preset of a ``POST /v1/steer-presets`` body, checked like ``--steer-preset`` (the
    name is a valid model name taken by nothing in ``reserved``: name -> what takes it; every
    steer is in ``steers``; every strength a finite number within ``max_strength``). The
    mix may also be the flag's string form ``"detox:4,sentiment:-2"``. Raises
    :class:`PolicyError` with the message for the HTTP 400."""
    if not isinstance(body, Mapping):
        raise PolicyError(f"expected a JSON object, e.g. {PRESET_BODY_EXAMPLE}")
    unknown = sorted(set(body) - {"name", "steer"})
    if unknown:
        raise PolicyError(f"unknown field(s) {', '.join(map(repr, unknown))}; a preset has "
                          f"\"name\" and \"steer\", e.g. {PRESET_BODY_EXAMPLE}")
    name = body.get("name")
    if name is None:
        raise PolicyError(f"\"name\" is missing: the preset's model name, e.g. "
                          f"{PRESET_BODY_EXAMPLE}")
    problem = preset_name_problem(name)
    if problem:
        raise PolicyError(f"\"name\": {problem}")
    if reserved and name in reserved:
        raise PolicyError(f"preset name {name!r} is already {reserved[name]}; give the preset "
                          "another name")
    mix = body.get("steer")
    if isinstance(mix, str):
        mix = parse_mix(mix, f"preset {name!r}: \"steer\"", mix)
    if not isinstance(mix, Mapping):
        raise PolicyError(f"preset {name!r}: \"steer\" must map steer names to strengths, "
                          f"got {echo(mix)}; e.g. {PRESET_BODY_EXAMPLE}")
    if not mix:
        raise PolicyError(f"preset {name!r}: \"steer\" names no steer")
    steers = set(steers)
    out: dict[str, float] = {}
    for steer, value in mix.items():
        problem = steer_name_problem(steer)
        if problem:
            raise PolicyError(f"preset {name!r}: {problem}")
        if isinstance(value, str):
            raise PolicyError(f"preset {name!r}: strength {echo(value)} of steer {steer!r} "
                              "is not a number (e.g. {\"detox\": 4})")
        value = strength_value(f"preset {name!r}", steer, value)
        if steer not in steers:
            raise PolicyError(unknown_steer(f"preset {name!r}", steer, steers,
                                            label=_KNOWN_LABEL,
                                            listing=", ".join(sorted(steers)) or "none")
                              + ". Load it first (POST /v1/steers) or fix the name")
        if abs(value) > max_strength:
            raise PolicyError(f"preset {name!r}: strength {value:g} of steer {steer!r} exceeds "
                              f"the server's maximum |strength| {max_strength:g} "
                              "(--steer-max-strength); lower it")
        out[steer] = value
    return name, out


def with_preset(request: SteerRequest, preset: Mapping[str, float] | None) -> SteerRequest:
    """The request's steers on top of a preset: steers the request names keep the request's
    value (it replaces the preset's), the preset's other steers are added."""
    if not preset:
        return request
    return SteerRequest(tuple({**{n: float(v) for n, v in preset.items()},
                               **request.named}.items()))


def _floor(value: float | Window, floor: float) -> tuple[float | Window, bool]:
    """``value`` raised to ``floor``; and whether that changed it."""
    if isinstance(value, Window):
        if value.strength >= floor and value.base >= floor:
            return value, False
        return replace(value, strength=max(value.strength, floor),
                       base=max(value.base, floor)), True
    return (floor, True) if value < floor else (value, False)


def resolve(request: SteerRequest, preset: Mapping[str, float] | None = None,
            defaults: Mapping[str, float] | None = None,
            floors: Mapping[str, float] | None = None) -> tuple[SteerRequest, list[str]]:
    """The steers a request is served with (see the module doc for the rule).

    Returns ``(request, floored)``: the resolved request (numbers or windows; zeros kept, so
    resolving again gives the same answer) and the names a floor raised, sorted.
    """
    out = with_preset(request, preset).named
    for name, v in (defaults or {}).items():
        out.setdefault(name, float(v))
    floored = []
    for name, f in (floors or {}).items():
        value, changed = _floor(out.get(name, 0.0), float(f))
        if changed:
            floored.append(name)
        if changed or name in out:  # a floor that raises nothing names no steer
            out[name] = value
    return SteerRequest(tuple(out.items())), sorted(floored)


def header_values(values: Mapping[str, float | Window], floored: list[str]) -> dict[str, str]:
    """The response headers for a resolved request (``values``: its :attr:`SteerRequest.named`):
    ``x-vllm-steer-applied: detox=2,sentiment=-3`` (the non-zero steers; a window as its JSON,
    the keys that differ from a window's defaults) and, when a floor raised something,
    ``x-vllm-steer-floored: detox``."""
    import json

    def fmt(v: float | Window) -> str:
        if isinstance(v, Window):
            d = {"strength": v.strength, "start": v.start, "end": v.end, "ramp": v.ramp,
                 "base": v.base}
            d = {k: (int(x) if isinstance(x, float) and x.is_integer() else x)
                 for k, x in d.items() if k in ("strength", "start") or x not in (None, 0, 0.0)}
            return json.dumps(d, separators=(",", ":"), sort_keys=True)
        v = float(v)  # exactly the strength served: an integer as one, else Python's repr
        return str(int(v)) if v.is_integer() and abs(v) < 2 ** 53 else repr(v)

    def nonzero(v: float | Window) -> bool:
        return (v.strength != 0.0 or v.base != 0.0) if isinstance(v, Window) else v != 0.0

    applied = ",".join(f"{n}={fmt(v)}" for n, v in sorted(values.items()) if nonzero(v))
    out = {APPLIED_HEADER: applied}
    if floored:
        out[FLOORED_HEADER] = ",".join(floored)
    return out
