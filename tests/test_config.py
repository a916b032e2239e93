"""Request parsing and server configuration: what a bad request or flag is told."""

import pytest

from vllm_steer.config import (
    SteerRequestError, SteerServerConfig, parse_request_steer, parse_steer_arg,
)

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
    from conftest import random_steer
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
