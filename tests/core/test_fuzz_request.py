"""Fuzzing the request's steer field (issue 14): any JSON value, any ``vllm_xargs`` string.

The outcome is either the exact strengths (checked against an independent reading of the
value: JSON numbers via ``json.loads``) or a ``SteerRequestError`` naming the field with a
short message: never another exception (which the server would answer with HTTP 500).
Reproducible (derandomized) and bounded in time.
"""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vllm_steer.config import SteerServerConfig
from vllm_steer.request import SteerRequestError, Window, parse_request_steer, request_windows

FUZZ = settings(max_examples=300, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow])
KNOWN = {"detox": "d", "sentiment": "s", "a.b-c_1": "x"}
MAX = 20.0

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.integers(-10**500, 10**500)
    | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner,
                                                                max_size=3),
    max_leaves=10)
NAMES = st.sampled_from(sorted(KNOWN)) | st.text(max_size=10)
NUMBER_TEXT = st.text(alphabet="0123456789+-.eE _\t\n\uff15\u0665xinfa", max_size=12)
STRENGTH = (st.integers() | st.integers(-10**400, 10**400) | st.floats() | st.booleans()
            | st.none() | NUMBER_TEXT | st.from_regex(r"\A[+-]?[0-9]{1,3}(\.[0-9]{1,3})?"
                                                       r"([eE][+-]?[0-9]{1,2})?\Z")
            | st.lists(st.integers(), max_size=2))


def _json_number(text: str):
    """An independent reading of a strength string: one optional '+' or '-' sign, then a
    JSON number (json.loads), surrounded only by spaces/tabs; None when it is not one."""
    t = text.strip(" \t")
    body = t[1:] if t[:1] == "+" and t[1:2] not in ("+", "-") else t
    if not body or len(t) > 32 or any(c.isspace() for c in body):
        return None
    try:
        v = json.loads(body, parse_constant=lambda c: None)
    except ValueError:
        return None
    return v if isinstance(v, (int, float)) and not isinstance(v, bool) else None


_BAD = object()


def _expected_strength(v):
    """A plain strength's value, or _BAD."""
    if isinstance(v, str):
        v = _json_number(v)
    if v is None or isinstance(v, bool) or not isinstance(v, (int, float)):
        return _BAD
    if isinstance(v, int):
        if abs(v) > MAX:
            return _BAD
        v = float(v)
    if not math.isfinite(v) or abs(v) > MAX:
        return _BAD
    return v


def _expected_index(v, low):
    """A window's token index (JSON integer, or a float holding one; strings are not), or
    _BAD; None (absent) is left to the caller."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return _BAD
    if isinstance(v, float):
        if v != v or v in (math.inf, -math.inf) or v != math.floor(v):
            return _BAD
        v = int(v)
    return v if low <= v <= 2**20 else _BAD


def _expected_window(d: dict):
    """The Window a window object must give, or _BAD (the docs/serving.md rules)."""
    if set(d) - {"strength", "start", "end", "ramp", "base"} or "strength" not in d:
        return _BAD
    strength = _expected_strength(d["strength"])
    base = 0.0 if d.get("base") is None else _expected_strength(d["base"])
    start = 0 if d.get("start") is None else _expected_index(d["start"], 0)
    ramp = 0 if d.get("ramp") is None else _expected_index(d["ramp"], 0)
    end = None if d.get("end") is None else _expected_index(d["end"], 1)
    if _BAD in (strength, base, start, ramp, end):
        return _BAD
    if end is not None and end <= start:
        return _BAD
    return Window(strength, start=start, end=end, ramp=ramp, base=base)


def _expected(mapping: dict, windows: bool = False) -> dict | None:
    """What a mapping must give (name -> strength; with ``windows``: name -> Window, only
    the window objects), or None when it must be refused."""
    out, wins = {}, {}
    for name, v in mapping.items():
        if name not in KNOWN:
            return None
        if isinstance(v, dict):
            w = _expected_window(v)
            if w is _BAD:
                return None
            if w.strength != 0 or w.base != 0:
                out[name] = w.strength if w.strength != 0 else w.base
                wins[name] = w
            continue
        v = _expected_strength(v)
        if v is _BAD:
            return None
        if v != 0:
            out[name] = v
    return wins if windows else out


def _parse(value, known=KNOWN):
    try:
        return parse_request_steer(value, known, MAX)
    except SteerRequestError as e:
        msg = str(e)
        assert msg.startswith("steer:") and len(msg) < 500, msg[:600]
        return None


@FUZZ
@given(JSON)
def test_any_json_value(value):
    got = _parse(value)
    if isinstance(value, dict):
        assert got == _expected(value)
    elif value is None:
        assert got == {}
    elif not isinstance(value, str):
        assert got is None


@FUZZ
@given(st.dictionaries(NAMES, STRENGTH, max_size=4))
def test_mappings_have_exact_semantics(value):
    assert _parse(value) == _expected(value)


@FUZZ
@given(st.lists(st.tuples(st.sampled_from(sorted(KNOWN)), NUMBER_TEXT | st.from_regex(
    r"\A[+-]?[0-9]{1,3}(\.[0-9]{1,3})?([eE][+-]?[0-9]{1,2})?\Z")), max_size=4))
def test_xargs_strings_from_pairs(pairs):
    text = ",".join(f"{n}:{v}" for n, v in pairs)
    got = _parse(text)
    names = [n for n, _ in pairs]
    if not text.strip():
        assert got == {}
    elif len(set(names)) < len(names) or any(not v.strip() for _, v in pairs):
        assert got is None  # a steer twice, or an empty strength
    else:
        assert got == _expected({n: v.strip() for n, v in pairs})  # entries are stripped


#: xargs strings built from the form's own pieces (names, separators, strength texts), so
#: that accepted strings are drawn too, not only refused ones
XARGS_ENTRY = st.tuples(
    st.sampled_from([*sorted(KNOWN), "nope", "", " detox", "detox "]),
    st.sampled_from([":", ":", "", "::", " : "]),
    st.sampled_from(["5", "-2.5", "+1", "1e1", "0", "99", "", "\uff15", " 3 ", "1_0", "inf",
                     "0.5"])).map("".join)
XARGS_PIECES = st.lists(XARGS_ENTRY, max_size=4).map(",".join)


@FUZZ
@given(XARGS_PIECES | st.text(alphabet="detoxsnim:,+-.e0123456789 _\t\uff15", max_size=30))
def test_any_xargs_string(text):
    got = _parse(text)
    if got is not None:
        assert all(n in KNOWN and 0 < abs(v) <= MAX for n, v in got.items())
        again = _parse(",".join(f"{n}:{v!r}" for n, v in got.items()))
        assert again == got


@FUZZ
@given(JSON)
def test_server_without_steers(value):
    from vllm_steer.integrations.frontend import admission as frontend
    from vllm_steer.integrations.frontend.state import frontend_state

    old = frontend_state().config
    try:
        for cfg in (None, SteerServerConfig()):
            frontend_state().reset(cfg)
            try:
                got = frontend.check_value(value)
            except SteerRequestError as e:
                assert str(e).startswith("steer:") and len(str(e)) < 500
            else:
                assert got.strengths == {}
    finally:
        frontend_state().reset(old)


@FUZZ
@given(JSON, st.one_of(st.none(), st.dictionaries(st.sampled_from(["steer", "other"]), JSON,
                                                   max_size=2)))
def test_request_model_validation(steer, xargs):
    """The OpenAI request model with our field: a parsed request or a pydantic
    ValidationError (HTTP 400), never another exception."""
    pytest.importorskip("vllm")
    import pydantic
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    from vllm_steer.integrations.frontend.state import frontend_state
    from vllm_steer.integrations import hooks
    from vllm_steer.integrations import plugin
    from vllm_steer.integrations.frontend import request_field

    hooks.install_hooks([h for h in plugin.HOOKS if h.install is request_field.add_request_field
                        or h.wrapper is request_field.to_sampling_params])
    old = frontend_state().config
    frontend_state().reset(SteerServerConfig(steers=dict(KNOWN), max_strength=MAX))
    try:
        body = {"model": "m", "prompt": "hi", "steer": steer, "vllm_xargs": xargs}
        try:
            CompletionRequest.model_validate(body)
        except pydantic.ValidationError as e:
            for err in e.errors():
                assert len(str(err.get("msg", ""))) < 600
    finally:
        frontend_state().reset(old)


# ---- generation windows (issue 24) -------------------------------------------------------
INDEX = (st.integers(-3, 40) | st.integers(2**20 - 2, 2**20 + 2) | st.integers(-10**400, 10**400)
         | st.floats() | st.sampled_from([0.0, 3.0, 16.0, -1.0, 2.5]) | st.none() | st.booleans()
         | st.text(alphabet="0123-.", max_size=3))
WINDOW_VALUE = st.fixed_dictionaries(
    {"strength": STRENGTH},
    optional={"start": INDEX, "end": INDEX, "ramp": INDEX, "base": STRENGTH})
ANY_WINDOW = WINDOW_VALUE | st.dictionaries(
    st.sampled_from(["strength", "start", "end", "ramp", "base", "stop", "Strength", ""]),
    INDEX | STRENGTH, max_size=5)
EDGE_WINDOW = st.builds(  # near the edges: end - start in -2..2, indices around 0 and 1<<20
    lambda s, start, d, ramp: {"strength": s, "start": start, "end": start + d, "ramp": ramp},
    st.integers(-3, 3), st.integers(-1, 3) | st.sampled_from([2**20 - 1, 2**20, 2**20 + 1]),
    st.integers(-2, 2), st.integers(-1, 2) | st.sampled_from([2**20, 2**20 + 1]))
VALID_WINDOW = st.builds(
    lambda s, start, length, ramp, base: {"strength": s, "start": start,
                                          "end": None if length is None else start + length,
                                          "ramp": ramp, "base": base},
    st.floats(-MAX, MAX), st.integers(0, 2**20 - 1), st.none() | st.integers(1, 64),
    st.integers(0, 2**20), st.floats(-MAX, MAX) | st.just(0.0)).filter(
        lambda d: d["end"] is None or d["end"] <= 2**20)


@FUZZ
@given(st.dictionaries(NAMES, ANY_WINDOW | STRENGTH, max_size=3)
       | st.dictionaries(st.sampled_from(sorted(KNOWN)), EDGE_WINDOW, max_size=2))
def test_window_objects_have_exact_semantics(value):
    """Any mix of plain strengths and window objects: the exact strengths and windows, or
    a SteerRequestError naming the field (never another exception)."""
    assert _parse(value) == _expected(value)
    try:
        got = request_windows(value, KNOWN, MAX)
    except SteerRequestError as e:
        assert str(e).startswith("steer:") and len(str(e)) < 500, str(e)[:600]
        got = None
    assert got == _expected(value, windows=True)


@FUZZ
@given(st.dictionaries(st.sampled_from(sorted(KNOWN)), VALID_WINDOW, min_size=1, max_size=3))
def test_valid_windows_parse_and_round_trip(value):
    """A valid window parses to the Window of its fields, and that Window's fields (as JSON)
    parse back to the same Window; its strength is the listed strength."""
    import dataclasses

    wins = request_windows(json.loads(json.dumps(value)), KNOWN, MAX)
    strengths = parse_request_steer(value, KNOWN, MAX)
    for name, d in value.items():
        if d["strength"] == 0 and d["base"] == 0:
            assert name not in wins and name not in strengths
            continue
        w = wins[name]
        assert (w.strength, w.start, w.end, w.ramp, w.base) == (
            d["strength"], d["start"], d["end"], d["ramp"], d["base"])
        assert strengths[name] == (d["strength"] or d["base"])
        again = request_windows({name: json.loads(json.dumps(dataclasses.asdict(w)))}, KNOWN,
                                MAX)
        assert again == {name: w}


# ---- the serialised form (what the frontend sends the engine core) -----------------------
@FUZZ
@given(st.dictionaries(st.sampled_from(sorted(KNOWN)), VALID_WINDOW | st.floats(-MAX, MAX),
                       max_size=3))
def test_the_serialised_form_round_trips_and_is_not_a_users_value(value):
    """A parsed request's serialised form, sent to another process (JSON-safe), decodes to the
    same request; in the process that made it, it holds that request. Sent back as a user's
    value it is refused, naming the key."""
    from vllm_steer.request import WIRE_KEY, SteerRequest

    request = SteerRequest.parse(value, KNOWN, MAX)
    wire = request.to_wire()
    assert SteerRequest.from_wire(json.loads(json.dumps(wire))) == request
    assert SteerRequest.from_wire(wire) is request
    with pytest.raises(SteerRequestError) as e:
        SteerRequest.parse(json.loads(json.dumps(wire)), KNOWN, MAX)
    assert str(e.value).startswith(f"steer: {WIRE_KEY!r} marks the serialised form")


@FUZZ
@given(st.lists(st.tuples(NAMES, STRENGTH | WINDOW_VALUE).map(list), max_size=3) | JSON)
def test_any_json_as_the_serialised_forms_steers(steers):
    """Whatever a serialised form holds, decoding it gives a request of valid names and finite
    strengths or a SteerRequestError naming the field, never another exception."""
    from vllm_steer.request import WIRE_KEY, WIRE_VERSION, SteerRequest

    try:
        got = SteerRequest.from_wire({WIRE_KEY: WIRE_VERSION, "steers": steers})
    except SteerRequestError as e:
        assert str(e).startswith("steer:") and len(str(e)) < 600, str(e)[:700]
        return
    from vllm_steer.names import is_steer_name

    assert [n for n, _ in got.entries] == [x[0] for x in steers or ()]
    for name, v in got.entries:
        assert is_steer_name(name)
        for s in ((v.strength, v.base) if isinstance(v, Window) else (v,)):
            assert isinstance(s, float) and math.isfinite(s)


# ---- the operator's policy: presets, defaults and floors from any value --------------------

def _policy_expected(value):
    """An independent reading of a preset's strength: a finite int or float (no bool) within
    the limit, else None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    if isinstance(value, int) and abs(value) > 10 ** 308:
        return None
    v = float(value)
    return v if math.isfinite(v) and abs(v) <= MAX else None


@FUZZ
@given(mix=st.dictionaries(NAMES, st.integers(-25, 25) | st.floats(-25, 25) | JSON,
                           max_size=3) | JSON)
def test_a_preset_body_from_any_json_is_the_exact_mix_or_a_policy_error(mix):
    """``POST /v1/steer-presets`` (and each preset of a presets file): any JSON gives the
    exact numbers or a ``PolicyError`` (HTTP 400), never another exception (HTTP 500)."""
    from vllm_steer.policy import PolicyError, preset_from_body

    try:
        name, got = preset_from_body({"name": "p", "steer": mix}, set(KNOWN), MAX)
    except PolicyError as e:
        assert len(str(e)) < 2000
        if isinstance(mix, dict) and mix and all(n in KNOWN for n in mix):
            assert any(_policy_expected(v) is None for v in mix.values()), (mix, str(e))
        return
    assert name == "p" and isinstance(mix, (dict, str))
    if isinstance(mix, dict):
        assert got == {n: _policy_expected(v) for n, v in mix.items()}, mix


@FUZZ
@given(key=st.sampled_from(["defaults", "floors", "presets"]), value=JSON)
def test_additional_config_policy_from_any_value_is_numbers_or_a_value_error(key, value):
    try:
        cfg = SteerServerConfig.from_additional_config({"vllm_steer": {key: value}})
    except ValueError as e:
        assert len(str(e)) < 2000
        return
    table = getattr(cfg, key)
    for v in (table.values() if key != "presets" else
              [s for mix in table.values() for s in mix.values()]):
        assert isinstance(v, float) and math.isfinite(v)


@pytest.mark.parametrize("value", [{"detox": 10**5000}, {"detox": {"strength": 10**5000}},
                                   {"detox": {"strength": 1, "base": -10**5000}},
                                   {10**5000: 1}])
@pytest.mark.parametrize("max_strength", [MAX, math.inf])
def test_an_integer_of_thousands_of_digits_is_refused_as_a_steer_error(value, max_strength):
    """Beyond Python's 4300-digit limit ``repr`` of an int raises ``ValueError``: the message
    must still be the steer field's own (an offline ``SamplingParams`` can hold such an int)."""
    with pytest.raises(SteerRequestError) as e:
        parse_request_steer(value, KNOWN, max_strength)
    assert str(e.value).startswith("steer: ") and "set_int_max_str_digits" not in str(e.value)
