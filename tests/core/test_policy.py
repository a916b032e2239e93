"""vllm_steer.policy: presets, defaults and floors; every precedence case of the table in
docs/serving.md ("Presets, defaults and floors"), and the start-up checks."""

from __future__ import annotations

import argparse

import pytest

from vllm_steer.config import SteerServerConfig
from vllm_steer.request import SteerRequest, Window
from vllm_steer.policy import (FLOORED_HEADER, APPLIED_HEADER, PolicyError, check_policy,
                               header_values, parse_mix, parse_preset_arg, parse_value_arg,
                               resolve)

PRESET = {"detox": 4.0, "sentiment": 2.0}


@pytest.mark.parametrize("request_value, preset, defaults, floors, want, floored", [
    # nothing: unsteered
    (None, None, {}, {}, {}, []),
    # a default applies to a request that names nothing
    (None, None, {"detox": 2}, {}, {"detox": 2}, []),
    # ... and the request overrides it, also with 0 (kept, so the steer is off)
    ({"detox": 5}, None, {"detox": 2}, {}, {"detox": 5}, []),
    ({"detox": 0}, None, {"detox": 2}, {}, {"detox": 0}, []),
    ("detox:0", None, {"detox": 2}, {}, {"detox": "0"}, []),
    # a default on another steer is added
    ({"sentiment": -3}, None, {"detox": 2}, {}, {"sentiment": -3, "detox": 2}, []),
    # a preset replaces the default for the steers it names
    (None, PRESET, {"detox": 2, "formal": 1}, {}, {"detox": 4, "sentiment": 2, "formal": 1}, []),
    # the request replaces the preset's value of a steer it names, keeps the others
    ({"detox": -1}, PRESET, {}, {}, {"detox": -1, "sentiment": 2}, []),
    ({"sentiment": 0}, PRESET, {}, {}, {"detox": 4, "sentiment": 0}, []),
    # ... and adds steers the preset does not name
    ({"formal": 3}, PRESET, {}, {}, {"detox": 4, "sentiment": 2, "formal": 3}, []),
    ("formal:3", PRESET, {}, {}, {"detox": 4, "sentiment": 2, "formal": "3"}, []),
    # a floor raises a request below it (also an explicit 0 and a negative)
    ({"detox": 1}, None, {}, {"detox": 2}, {"detox": 2}, ["detox"]),
    ({"detox": 0}, None, {}, {"detox": 2}, {"detox": 2}, ["detox"]),
    ({"detox": -5}, None, {}, {"detox": 2}, {"detox": 2}, ["detox"]),
    # ... leaves one at or above it alone
    ({"detox": 2}, None, {}, {"detox": 2}, {"detox": 2}, []),
    ({"detox": 7}, None, {}, {"detox": 2}, {"detox": 7}, []),
    # ... applies when nothing names the steer (0 < floor)
    ({"sentiment": 1}, None, {}, {"detox": 2}, {"sentiment": 1, "detox": 2}, ["detox"]),
    # ... and after the preset and the default
    (None, PRESET, {}, {"detox": 5}, {"detox": 5, "sentiment": 2}, ["detox"]),
    (None, None, {"detox": 1}, {"detox": 2}, {"detox": 2}, ["detox"]),
    (None, None, {"detox": 3}, {"detox": 2}, {"detox": 3}, []),
    # a negative floor bounds the negative direction only
    ({"detox": -7}, None, {}, {"detox": -2}, {"detox": -2}, ["detox"]),
    ({"detox": -1}, None, {}, {"detox": -2}, {"detox": -1}, []),
    # ... and names no steer in a request that does not (nor does a floor of 0)
    (None, None, {}, {"detox": -2}, {}, []),
    ({"formal": 1}, None, {}, {"detox": 0}, {"formal": 1}, []),
])
def test_precedence_table(request_value, preset, defaults, floors, want, floored):
    got, got_floored = resolve(SteerRequest.parse(request_value), preset, defaults, floors)
    assert {k: float(v) for k, v in got.named.items()} == \
        {k: float(v) for k, v in want.items()}
    assert got_floored == floored
    # idempotent: the engine core resolves again what the API server wrote (its wire form)
    again, _ = resolve(SteerRequest.from_wire(dict(got.to_wire())), None, defaults, floors)
    assert again == got


def test_a_floor_raises_a_windows_strength_and_base():
    w = Window(strength=1.0, start=4, end=8, ramp=2)
    got, floored = resolve(SteerRequest((("detox", w),)), None, {}, {"detox": 2.0})
    assert floored == ["detox"]
    assert all(got.named["detox"].at(t) >= 2.0 for t in range(16))
    assert got.named["detox"].at(5) == 2.0 and got.named["detox"].at(0) == 2.0
    strong = Window(strength=6.0, start=4, end=8)
    got, _ = resolve(SteerRequest((("detox", strong),)), None, {}, {"detox": 2.0})
    assert [got.named["detox"].at(t) for t in range(10)] == [2.0] * 4 + [6.0] * 4 + [2.0] * 2
    # the request form of a window (an object), parsed
    got, floored = resolve(SteerRequest.parse({"detox": {"strength": 5, "start": 0, "end": 32}}),
                           None, {}, {"detox": 2.0})
    assert got.named["detox"] == Window(strength=5.0, start=0, end=32, base=2.0)
    assert floored == ["detox"]


def test_headers_name_the_applied_steers_and_the_floored_ones():
    h = header_values({"detox": 2.0, "sentiment": -3, "off": 0}, ["detox"])
    assert h == {APPLIED_HEADER: "detox=2,sentiment=-3", FLOORED_HEADER: "detox"}
    assert header_values({}, []) == {APPLIED_HEADER: ""}


def test_the_applied_header_reads_back_split_at_the_commas_outside_braces():
    """As docs/serving.md says to read it: a window is its JSON object."""
    import json
    import re

    values = {"detox": Window(strength=5.0, start=0, end=32, ramp=4, base=1.5),
              "sentiment": -3.0, "calm": Window(strength=2.0, start=8)}
    got = header_values(values, [])[APPLIED_HEADER]
    items = dict(kv.split("=", 1) for kv in re.split(r",(?![^{]*})", got))
    assert json.loads(items["detox"]) == {"strength": 5, "start": 0, "end": 32, "ramp": 4,
                                          "base": 1.5}
    assert json.loads(items["calm"]) == {"strength": 2, "start": 8}
    assert float(items["sentiment"]) == -3.0


def test_the_applied_header_gives_each_strength_exactly():
    """Not rounded: the header reads back as the very strengths served."""
    values = {"a": 12.3456789, "b": -0.1 + 0.2, "c": 1e-7, "d": 5.0, "e": 2.5e20}
    got = header_values(values, [])[APPLIED_HEADER]
    assert {k: float(v) for k, v in (kv.split("=") for kv in got.split(","))} == values
    assert "d=5," in got


def test_flag_parsing():
    assert parse_preset_arg("polite=detox:4,sentiment:-2.5") == \
        ("polite", {"detox": 4.0, "sentiment": -2.5})
    assert parse_value_arg("detox=2", "--steer-default") == {"detox": 2.0}
    assert parse_value_arg("detox=2,formal=-1", "--steer-floor") == {"detox": 2.0,
                                                                      "formal": -1.0}
    assert parse_mix("detox:0") == {"detox": 0.0}


@pytest.mark.parametrize("arg, fragment", [
    ("polite", "expected NAME=steer:strength"),
    ("polite=", "expected NAME=steer:strength"),
    ("../x=detox:4", "preset name"),
    ("polite=detox=4", "malformed entry 'detox=4'"),
    ("polite=detox:4,,sentiment:1", "malformed entry ''"),
    ("polite=detox:strong", "strength 'strong' of steer 'detox' is not a number"),
    ("polite=detox:inf", "must be finite"),
    ("polite=detox:1,detox:2", "given twice"),
    # a request's grammar: Python's float() would read these as 10 and 5
    ("polite=detox:1_0", "strength '1_0' of steer 'detox' is not a number"),
    ("polite=detox:\uff15", "strength '\uff15' of steer 'detox' is not a number"),
    ("polite=detox:\u30004", "strength '\\u30004' of steer 'detox' is not a number"),
    ("polite=detox:" + "1" * 33, "of steer 'detox' is not a number"),
])
def test_bad_preset_flags_name_the_flag_and_problem(arg, fragment):
    with pytest.raises(PolicyError, match="--steer-preset") as e:
        parse_preset_arg(arg)
    assert fragment in str(e.value)


def test_start_up_check_names_the_preset_the_problem_and_the_fix():
    steers = {"detox", "sentiment"}
    check_policy({"polite": PRESET}, {"detox": 1}, {"detox": 2}, steers, 10.0)
    with pytest.raises(PolicyError, match=r"--steer-preset polite: unknown steer 'toxic'.*"
                                          r"detox, sentiment.*--steer NAME=PATH"):
        check_policy({"polite": {"toxic": 1}}, {}, {}, steers, 10.0)
    with pytest.raises(PolicyError, match=r"--steer-preset polite: strength 40 of steer "
                                          r"'detox' exceeds.*10.*--steer-max-strength"):
        check_policy({"polite": {"detox": 40}}, {}, {}, steers, 10.0)
    with pytest.raises(PolicyError, match=r"--steer-preset tiny: the name 'tiny' is already "
                                          r"the served model name; give the preset another"):
        check_policy({"tiny": PRESET}, {}, {}, steers, 10.0, {"tiny": "the served model name"})
    with pytest.raises(PolicyError, match=r"--steer-floor detox=11: .*exceeds"):
        check_policy({}, {}, {"detox": 11}, steers, 10.0)
    with pytest.raises(PolicyError, match=r"--steer-default nope=1: unknown steer 'nope'"):
        check_policy({}, {"nope": 1}, {}, steers, 10.0)


def _args(**kw):
    base = dict(steer=None, steer_dir=None, enable_steer_updates=False, steer_max_strength=20.0,
                steer_backend="auto", max_steers=None, max_steer_rank=None,
                steer_updates_any_path=False, steer_preset=None, steer_default=None,
                steer_floor=None, served_model_name=None, model="m", lora_modules=None)
    base.update(kw)
    return argparse.Namespace(**base)


def test_cli_flags_reach_the_config_and_additional_config(tmp_path):
    from helpers.steers import random_steer, save_steers
    from vllm_steer.integrations.frontend.cli_args import config_from_args

    paths = save_steers(tmp_path, {"detox": random_steer(8, 2, "detox")})
    cfg = config_from_args(_args(steer=[f"detox={paths['detox']}"],
                                 steer_preset=["polite=detox:4"], steer_default=["detox=1"],
                                 steer_floor=["detox=-2"], served_model_name=["tiny"]))
    assert cfg.presets == {"polite": {"detox": 4.0}}
    assert cfg.defaults == {"detox": 1.0} and cfg.floors == {"detox": -2.0}
    back = SteerServerConfig.from_additional_config(cfg.to_additional_config())
    assert (back.presets, back.defaults, back.floors) == (cfg.presets, cfg.defaults, cfg.floors)
    # the offline string form of a preset
    off = SteerServerConfig.from_additional_config(
        {"vllm_steer": {"steers": paths, "presets": {"polite": "detox:4"}}})
    assert off.presets == {"polite": {"detox": 4.0}}
    with pytest.raises(PolicyError, match="already the served model name"):
        config_from_args(_args(steer=[f"detox={paths['detox']}"],
                               steer_preset=["tiny=detox:4"], served_model_name=["tiny"]))
    with pytest.raises(PolicyError, match="already a LoRA module"):
        config_from_args(_args(steer=[f"detox={paths['detox']}"], steer_preset=["ad=detox:4"],
                               lora_modules=[argparse.Namespace(name="ad", path="/x")]))
    with pytest.raises(ValueError, match="without any steer"):
        config_from_args(_args(steer_preset=["polite=detox:4"]))


# ---- presets at run time (POST /v1/steer-presets) ------------------------------------------
RESERVED = {"tiny": "the served model name", "ad": "a LoRA adapter",
            "polite": "a preset set by --steer-preset"}


def test_a_preset_body_is_checked_like_the_flag():
    from vllm_steer.policy import preset_from_body

    steers = {"detox", "sentiment"}
    assert preset_from_body({"name": "kind", "steer": {"detox": 4, "sentiment": -2.5}},
                            steers, 10.0, RESERVED) == ("kind", {"detox": 4.0,
                                                                 "sentiment": -2.5})
    # the flag's string form of the mix, and a strength of exactly the maximum
    assert preset_from_body({"name": "kind", "steer": "detox:10,sentiment:0"}, steers, 10.0) \
        == ("kind", {"detox": 10.0, "sentiment": 0.0})


@pytest.mark.parametrize("body, fragment", [
    (["kind"], "expected a JSON object"),
    ({"name": "kind", "steers": {"detox": 1}}, "unknown field(s) 'steers'"),
    ({"steer": {"detox": 1}}, '"name" is missing'),
    ({"name": 7, "steer": {"detox": 1}}, "preset name 7 must be a string"),
    ({"name": "a b", "steer": {"detox": 1}}, "preset name 'a b' may use only"),
    ({"name": "tiny", "steer": {"detox": 1}}, "'tiny' is already the served model name"),
    ({"name": "ad", "steer": {"detox": 1}}, "'ad' is already a LoRA adapter"),
    ({"name": "polite", "steer": {"detox": 1}}, "already a preset set by --steer-preset"),
    ({"name": "kind"}, '"steer" must map steer names to strengths, got None'),
    ({"name": "kind", "steer": [1]}, '"steer" must map steer names to strengths'),
    ({"name": "kind", "steer": {}}, '"steer" names no steer'),
    ({"name": "kind", "steer": "detox=4"}, "malformed entry 'detox=4'"),
    ({"name": "kind", "steer": {"a,b": 1}}, "steer name 'a,b' may use only"),
    ({"name": "kind", "steer": {"detox": "4"}}, "strength '4' of steer 'detox' is not a "
                                                "number"),
    ({"name": "kind", "steer": {"detox": True}}, "strength True of steer 'detox' is not a"),
    ({"name": "kind", "steer": {"detox": float("nan")}}, "must be a finite number"),
    ({"name": "kind", "steer": {"detox": 10 ** 400}}, "an integer of 1329 bits, too large"),
    ({"name": "kind", "steer": {"detox": -10 ** 400}}, "an integer of 1329 bits, too large"),
    ({"name": "kind", "steer": {"toxic": 1}}, "unknown steer 'toxic'; loaded steers (and "
                                              "--steer-dir files): detox, sentiment. Load it"),
    ({"name": "kind", "steer": {"detox": -10.5}}, "strength -10.5 of steer 'detox' exceeds "
                                                  "the server's maximum |strength| 10"),
])
def test_a_bad_preset_body_names_the_value_and_the_fix(body, fragment):
    from vllm_steer.policy import preset_from_body

    with pytest.raises(PolicyError) as e:
        preset_from_body(body, {"detox", "sentiment"}, 10.0, RESERVED)
    assert fragment in str(e.value)


def test_the_engine_cores_preset_table():
    from vllm_steer.integrations.engine.presets import PresetTable

    t = PresetTable()
    assert t.snapshot() == {"version": 0, "presets": {}}
    got = t.add("kind", {"detox": 4}, "t1", {"tiny": "the served model name"})
    assert got["ok"] and got["presets"] == {"kind": {"detox": 4.0}} and got["version"] == 1
    # taken names: refused, the table unchanged
    for name, fragment in (("kind", "already a preset added at run time"),
                           ("tiny", "already the served model name")):
        got = t.add(name, {"detox": 1}, "t2", {"tiny": "the served model name"})
        assert (got["ok"], got["status"], got["version"]) == (False, 400, 1)
        assert fragment in got["error"] and got["presets"] == {"kind": {"detox": 4.0}}
    # delete: unknown is 404, a --steer-preset one 400
    got = t.delete("nope", {"polite": {}})
    assert (got["ok"], got["status"]) == (False, 404) and "presets added at run time: kind" \
        in got["error"]
    got = t.delete("polite", {"polite": {}})
    assert (got["ok"], got["status"]) == (False, 400) and "--steer-preset" in got["error"]
    got = t.delete("kind")
    assert got["ok"] and got["preset"] == {"name": "kind", "steer": {"detox": 4.0}}
    assert (got["version"], got["presets"]) == (2, {})
    # a rollback removes only the add of its own token
    t.add("kind", {"detox": 2}, "t3")
    assert t.rollback("kind", "other")["presets"] == {"kind": {"detox": 2.0}}
    assert t.rollback("kind", "t3")["presets"] == {} and t.version == 4


def test_data_parallel_answers_and_the_api_servers_view():
    from vllm_steer.integrations.protocol import merge_preset_answers

    ok = {"ok": True, "version": 3, "presets": {"kind": {"detox": 4.0}}}
    no = {"ok": False, "status": 400, "error": "taken", "version": 3, "presets": {}}
    assert merge_preset_answers("preset_add", [ok, no]) is no  # added only if every engine did
    assert merge_preset_answers("preset_add", [ok, dict(ok)]) is ok
    assert merge_preset_answers("preset_delete", [no, ok]) is ok  # deleted if any engine had it
    from vllm_steer.integrations.frontend.state import FrontendState

    st = FrontendState()  # an API server's view of the table
    st.update_presets(ok)
    assert st.presets_view() == {"kind": {"detox": 4.0}}
    st.update_presets({"version": 2, "presets": {}})  # an older read (a slow poll): ignored
    assert st.presets_view() == {"kind": {"detox": 4.0}}
    st.update_presets({"version": 4, "presets": {}})
    assert st.presets_view() == {}
    st.update_presets({"ok": False, "status": 404})  # no table in it: ignored
    assert st.presets_view() == {}


@pytest.mark.parametrize("mix", ["detox", "detox=4", "detox:4,"])
def test_a_string_mix_outside_the_flag_is_explained_without_the_flag_s_preset_name(mix):
    """A preset's string mix in a ``POST /v1/steer-presets`` body or a presets file has no
    ``NAME=`` (the preset's name is its own key): the message must not ask for one, else
    following it (``polite=detox:4``) only gives another error."""
    from vllm_steer import presets_file
    from vllm_steer.policy import preset_from_body

    with pytest.raises(PolicyError) as e:
        preset_from_body({"name": "polite", "steer": mix}, {"detox"}, 10.0)
    assert "NAME=" not in str(e.value) and "detox:4" in str(e.value), str(e.value)
    with pytest.raises(presets_file.PresetsFileError) as e:
        presets_file.check({"polite": mix}, "presets.yaml", {"detox"}, 10.0)
    assert "NAME=" not in str(e.value) and "detox:4" in str(e.value), str(e.value)


def test_preset_strengths_take_a_requests_number_forms():
    assert parse_preset_arg("polite=detox:+4,sentiment:1e1") == (
        "polite", {"detox": 4.0, "sentiment": 10.0})
    assert parse_preset_arg("polite=detox:-2.5 ,sentiment: 0") == (
        "polite", {"detox": -2.5, "sentiment": 0.0})
