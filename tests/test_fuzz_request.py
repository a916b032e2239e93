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

from vllm_steer.config import SteerRequestError, SteerServerConfig, parse_request_steer

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


def _expected(mapping: dict) -> dict | None:
    """What a mapping must give, or None when it must be refused."""
    out = {}
    for name, v in mapping.items():
        if name not in KNOWN:
            return None
        if isinstance(v, str):
            v = _json_number(v)
        if v is None or isinstance(v, bool) or not isinstance(v, (int, float)):
            return None
        if isinstance(v, int):
            if abs(v) > MAX:
                return None
            v = float(v)
        if not math.isfinite(v) or abs(v) > MAX:
            return None
        if v != 0:
            out[name] = v
    return out


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


@FUZZ
@given(st.text(alphabet="detoxsnim:,+-.e0123456789 _\t\uff15", max_size=30))
def test_any_xargs_string(text):
    got = _parse(text)
    if got is not None:
        assert all(n in KNOWN and 0 < abs(v) <= MAX for n, v in got.items())
        again = _parse(",".join(f"{n}:{v!r}" for n, v in got.items()))
        assert again == got


@FUZZ
@given(JSON)
def test_server_without_steers(value):
    from vllm_steer.integrations import frontend

    old = frontend.get_config()
    try:
        for cfg in (None, SteerServerConfig()):
            frontend.set_config(cfg)
            try:
                got = frontend.check_value(value)
            except SteerRequestError as e:
                assert str(e).startswith("steer:") and len(str(e)) < 500
            else:
                assert got == {}
    finally:
        frontend.set_config(old)


@FUZZ
@given(JSON, st.one_of(st.none(), st.dictionaries(st.sampled_from(["steer", "other"]), JSON,
                                                   max_size=2)))
def test_request_model_validation(steer, xargs):
    """The OpenAI request model with our field: a parsed request or a pydantic
    ValidationError (HTTP 400), never another exception."""
    pytest.importorskip("vllm")
    import pydantic
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    from vllm_steer.integrations import frontend, plugin

    plugin.install_hooks([h for h in plugin.HOOKS if h.install is plugin.add_request_field])
    old = frontend.get_config()
    frontend.set_config(SteerServerConfig(steers=dict(KNOWN), max_strength=MAX))
    try:
        body = {"model": "m", "prompt": "hi", "steer": steer, "vllm_xargs": xargs}
        try:
            CompletionRequest.model_validate(body)
        except pydantic.ValidationError as e:
            for err in e.errors():
                assert len(str(err.get("msg", ""))) < 600
    finally:
        frontend.set_config(old)
