"""Request parsing and server configuration: what a bad request or flag is told."""

import pytest

from vllm_steer.config import SteerServerConfig, parse_steer_arg
from vllm_steer.request import SteerRequestError, parse_request_steer

KNOWN = {"detox": "d.safetensors", "sentiment": "s.safetensors"}


def test_mapping_and_string_forms_are_equivalent():
    a = parse_request_steer({"detox": 5, "sentiment": -3}, KNOWN, 50)
    b = parse_request_steer("detox:5, sentiment:-3", KNOWN, 50)
    assert a == b == {"detox": 5.0, "sentiment": -3.0}


def test_zero_strengths_are_dropped():
    assert parse_request_steer({"detox": 0, "sentiment": 0.0}, KNOWN, 50) == {}
    assert parse_request_steer(None, KNOWN, 50) == {}


@pytest.mark.parametrize("value, fragment", [
    ({"toxic": 1}, "unknown steer 'toxic'; loaded steers: detox, sentiment"),
    ({"detox": "abc"}, "must be a number, got 'abc'"),
    ({"detox": True}, "must be a number"),
    ({"detox": [1]}, "must be a number"),
    ({"detox": float("inf")}, "must be finite"),
    ({"detox": float("nan")}, "must be finite"),
    ({"detox": 51}, "exceeds the server's maximum |strength| 50"),
    ({"detox": -51}, "exceeds"),
    ("detox=5", "malformed entry 'detox=5'"),
    ("detox:5:1", "malformed entry"),
    ("detox:5,detox:2", "given twice"),
    (5, "expected an object mapping steer names to strengths"),
])
def test_bad_requests_name_the_field_and_problem(value, fragment):
    with pytest.raises(SteerRequestError) as e:
        parse_request_steer(value, KNOWN, 50)
    assert str(e.value).startswith("steer:") and fragment in str(e.value)


def test_steer_arg_forms(tmp_path):
    assert parse_steer_arg("detox=/x/d.safetensors") == ("detox", "/x/d.safetensors")
    from helpers.steers import random_steer
    from vllm_steer.format import save_steer

    p = tmp_path / "file.safetensors"
    save_steer(p, random_steer(16, 2, "from_meta"))
    assert parse_steer_arg(str(p)) == ("from_meta", str(p))
    with pytest.raises(ValueError, match="may use only ASCII letters"):
        parse_steer_arg("bad name=/x")


def test_server_config_round_trip_and_limits():
    cfg = SteerServerConfig(steers=dict(KNOWN), max_strength=10)
    assert SteerServerConfig.from_additional_config(cfg.to_additional_config()) == cfg
    assert SteerServerConfig.from_additional_config({"other": 1}) is None
    with pytest.raises(ValueError, match="--steer-max-strength=-1"):
        SteerServerConfig(max_strength=-1)
    with pytest.raises(ValueError, match="unknown keys"):
        SteerServerConfig.from_additional_config({"vllm_steer": {"steer": {}}})
    for bad in (True, 10 ** 400, float("nan"), float("inf"), "10"):
        with pytest.raises(ValueError, match="must be a positive finite number"):
            SteerServerConfig(max_strength=bad)


@pytest.mark.parametrize("field, flag", [("max_steers", "--max-steers"),
                                         ("max_steers_per_request", "--max-steers-per-request"),
                                         ("max_steer_rank", "--max-steer-rank")])
def test_counts_beyond_any_device_are_refused_by_name_before_anything_is_built(field, flag):
    """``--max-steers 1000000000`` was a MemoryError (one list entry per slot, built before
    the bank's own check); now the flag, the value and the limit."""
    assert SteerServerConfig(**{field: 65536})  # the limit itself is taken
    with pytest.raises(ValueError) as e:
        SteerServerConfig(**{field: 10 ** 9})
    assert str(e.value).startswith(f"{flag}=1000000000: over the limit of 65536")


@pytest.mark.parametrize("key, value, fragment", [
    ("defaults", {"detox": float("nan")}, "additional_config defaults: strength nan of steer "
                                          "'detox' must be a finite number"),
    ("floors", {"detox": True}, "additional_config floors: strength True of steer 'detox' is "
                                "not a number"),
    ("defaults", {"detox": "abc"}, "strength 'abc' of steer 'detox' is not a number"),
    ("defaults", {"detox": None}, "strength None of steer 'detox' is not a number"),
    ("floors", {"detox": 10 ** 400}, "an integer of 1329 bits, too large"),
    ("presets", {"p": {"detox": float("inf")}}, "additional_config presets p: strength inf"),
    ("presets", {"p": {"detox": [1]}}, "strength [1] of steer 'detox' is not a number"),
    ("presets", {"p": 4}, "additional_config presets p: expected a mapping steer -> strength"),
])
def test_additional_config_policy_values_are_checked_like_the_flags(key, value, fragment):
    """Offline users give presets, defaults and floors in ``additional_config``: a bad
    strength is refused naming the key, the steer and the problem, as the flags are."""
    with pytest.raises(ValueError) as e:
        SteerServerConfig.from_additional_config({"vllm_steer": {key: value}})
    assert fragment in str(e.value), str(e.value)


def test_additional_config_policy_strings_are_numbers():
    cfg = SteerServerConfig.from_additional_config(
        {"vllm_steer": {"defaults": {"detox": "2.5"}, "presets": {"p": {"detox": 3}}}})
    assert cfg.defaults == {"detox": 2.5} and cfg.presets == {"p": {"detox": 3.0}}


# ---- hostile values (issue 14) --------------------------------------------------------------

HUGE = int("9" * 400)


@pytest.mark.parametrize("value, fragment", [
    ({"detox": HUGE}, "exceeds the server's maximum |strength| 50"),
    ({"detox": -HUGE}, "exceeds"),
    ({"detox": "1_0"}, "must be a number, got '1_0'"),
    ({"detox": "\uff15"}, "must be a number"),            # full-width 5
    ({"detox": "\u0665"}, "must be a number"),            # Arabic-Indic 5
    ({"detox": "inf"}, "must be a number"),
    ({"detox": "nan"}, "must be a number"),
    ({"detox": "0x10"}, "must be a number"),
    ({"detox": "1e400"}, "must be finite"),
    ({"detox": "5 "}, None),                             # ASCII blanks around are fine
    ("detox:5,,", "empty entry"),
    (",,,", "empty entry"),
    ("detox:5,", "empty entry"),
    ("detox::5", "malformed entry"),
])
def test_strength_strings_are_json_numbers(value, fragment):
    if fragment is None:
        assert parse_request_steer(value, KNOWN, 50) == {"detox": 5.0}
        return
    with pytest.raises(SteerRequestError) as e:
        parse_request_steer(value, KNOWN, 50)
    assert str(e.value).startswith("steer:") and fragment in str(e.value)
    assert len(str(e.value)) < 400


def test_json_number_forms_are_accepted():
    for text, want in (("5", 5.0), ("-2.5", -2.5), ("+3", 3.0), ("1e1", 10.0), ("1E+1", 10.0),
                       ("0.5", 0.5), ("-0", 0.0)):
        assert parse_request_steer({"detox": text}, KNOWN, 50) == ({"detox": want} if want else {})


def test_huge_integer_without_a_maximum_is_refused_not_a_crash():
    with pytest.raises(SteerRequestError, match="must be finite"):
        parse_request_steer({"detox": HUGE}, None, float("inf"))


def test_error_bodies_are_bounded():
    big = "x" * 1_000_000
    for value in ({big: 1}, f"{big}:1", {"detox": big}, "detox:" + big[:3000]):
        with pytest.raises(SteerRequestError) as e:
            parse_request_steer(value, KNOWN, 50)
        assert len(str(e.value)) < 400, str(e.value)[:500]
    many = {f"s{i:03d}": "x" for i in range(500)}
    with pytest.raises(SteerRequestError) as e:
        parse_request_steer({"toxic": 1}, many, 50)
    assert "s000, s001" in str(e.value) and "and 492 more" in str(e.value)
    assert len(str(e.value)) < 400


def test_empty_string_is_no_steer():
    assert parse_request_steer("", KNOWN, 50) == {} == parse_request_steer(" ", KNOWN, 50)


def test_server_config_checks_steer_names():
    with pytest.raises(ValueError, match="may use only ASCII"):
        SteerServerConfig(steers={"a,b": "x.safetensors"})
    with pytest.raises(ValueError, match="expected a file path"):
        SteerServerConfig(steers={"ok": 5})
    with pytest.raises(ValueError, match="may use only ASCII"):
        SteerServerConfig.from_additional_config({"vllm_steer": {"steers": {"a b": "x"}}})


# ---- generation windows (issue 24) -------------------------------------------------------
import json  # noqa: E402

from vllm_steer.request import MAX_WINDOW_TOKEN, Window, request_windows  # noqa: E402


def test_window_objects_parse_to_their_strength_and_window():
    value = {"detox": {"strength": 5, "start": 2, "end": 32, "ramp": 4},
             "sentiment": -3, "x": {"strength": "2.5"}}
    known = dict(KNOWN, x="x.safetensors")
    assert parse_request_steer(value, known, 50) == {"detox": 5.0, "sentiment": -3.0, "x": 2.5}
    assert request_windows(value, known, 50) == {
        "detox": Window(5.0, start=2, end=32, ramp=4, base=0.0), "x": Window(2.5)}
    # integral floats are token indices; null is the default
    assert request_windows({"detox": {"strength": 1, "start": 3.0, "end": None}}) == {
        "detox": Window(1.0, start=3)}
    assert request_windows({"detox": 5}) == {} and request_windows(None) == {}


def test_window_strength_and_base_zero_is_no_steer_but_a_base_alone_is_one():
    assert parse_request_steer({"detox": {"strength": 0, "end": 4}}, KNOWN, 50) == {}
    assert request_windows({"detox": {"strength": 0, "base": 0.0}}) == {}
    # on only outside its window: listed (under its base) so it is bound and applied
    assert parse_request_steer({"detox": {"strength": 0, "base": 2, "end": 4}}, KNOWN, 50) \
        == {"detox": 2.0}
    assert request_windows({"detox": {"strength": 0, "base": 2, "end": 4}}) == {
        "detox": Window(0.0, end=4, base=2.0)}


@pytest.mark.parametrize("window, fragment", [
    ({"start": 0}, "has no 'strength'"),
    ({"strength": 5, "stop": 3, "foo": 1}, "unknown key(s) 'stop', 'foo'; allowed: strength, "
                                           "start, end, ramp, base"),
    ({"strength": 5, "start": -1}, "'start' is -1; it must be at least 0"),
    ({"strength": 5, "ramp": -2}, "'ramp' is -2; it must be at least 0"),
    ({"strength": 5, "start": 8, "end": 8}, "'end' 8 must be greater than 'start' 8"),
    ({"strength": 5, "start": 8, "end": 3}, "'end' 3 must be greater than 'start' 8"),
    ({"strength": 5, "end": 0}, "'end' is 0; it must be at least 1"),
    ({"strength": 5, "start": 1.5}, "'start' must be an integer token index, got 1.5"),
    ({"strength": 5, "end": "32"}, "'end' must be an integer token index, got str '32'"),
    ({"strength": 5, "ramp": True}, "'ramp' must be an integer token index"),
    ({"strength": 5, "start": float("inf")}, "'start' must be an integer token index"),
    ({"strength": 5, "end": MAX_WINDOW_TOKEN + 1}, "at most 1048576 (1<<20) is allowed"),
    ({"strength": 5, "start": 10**400}, "integer of 1329 bits; at most 1048576"),
    ({"strength": 51}, "strength 51 of steer 'detox' exceeds the server's maximum"),
    ({"strength": float("nan")}, "must be finite"),
    ({"strength": [5]}, "strength of steer 'detox' must be a number"),
    ({"strength": 5, "base": -60}, "window base -60 of steer 'detox' exceeds"),
    ({"strength": 5, "base": "x"}, "window base of steer 'detox' must be a number"),
])
def test_bad_windows_name_the_key_the_value_and_the_limit(window, fragment):
    with pytest.raises(SteerRequestError) as e:
        parse_request_steer({"detox": window}, KNOWN, 50)
    assert str(e.value).startswith("steer: ") and fragment in str(e.value), str(e.value)
    with pytest.raises(SteerRequestError):
        request_windows({"detox": window}, KNOWN, 50)


def test_steer_value_over_4096_characters_is_refused():
    window = {"strength": 5, "start": 0, "end": 32}
    ok = {"detox": window, "sentiment": {"strength": 1, "base": 0.5}}
    assert parse_request_steer(ok, KNOWN, 50) == {"detox": 5.0, "sentiment": 1.0}
    many = {f"s{i}": window for i in range(100)}  # every entry valid, too long in all
    assert len(json.dumps(many)) > 4096 and len(json.dumps(dict(list(many.items())[:80]))) < 4096
    assert len(parse_request_steer(dict(list(many.items())[:80]), None, 50)) == 80
    with pytest.raises(SteerRequestError, match=r"steer value is \d+ characters as JSON; "
                                                r"at most 4096 are allowed"):
        parse_request_steer(many, None, 50)
    big = {"detox": dict(window, note="x" * 4100)}  # checked before its keys
    with pytest.raises(SteerRequestError, match=r"steer value is 41\d\d characters as JSON"):
        parse_request_steer(big, KNOWN, 50)


def test_the_values_taken_as_short_without_json_are_all_under_the_limit():
    """A mapping of at most 8 ASCII names of at most 64 characters to floats or 64-bit ints
    is taken as short without encoding it: the longest such value is still under 4096."""
    from vllm_steer.request import MAX_STEER_CHARS, _serialised_length, _surely_short

    worst = {chr(1) * 63 + chr(48 + i): -1.2345678901234567e-308 for i in range(8)}
    worst_int = {chr(1) * 63 + chr(48 + i): -(1 << 63) for i in range(8)}
    for value in (worst, worst_int):
        assert _surely_short(value)  # not encoded
        assert len(json.dumps(value)) < MAX_STEER_CHARS
    # one step past any bound: encoded, and its real length told
    for value in ({**worst, "x": 1.0}, {"a" * 65: 1.0}, {"d\u00e9": 1.0}, {"a": 1 << 63},
                  {"a": True}, {"a": "5"}):
        assert not _surely_short(value), value
        assert _serialised_length(value) == len(json.dumps(value)), value


@pytest.mark.parametrize("text", ["detox:5@0-32", "detox:5~16", "detox:{5}"])
def test_windows_have_no_xargs_string_form(text):
    with pytest.raises(SteerRequestError, match="has no generation windows; send the steer as "
                                                "a JSON object in the top-level 'steer' field"):
        parse_request_steer(text, KNOWN, 50)
