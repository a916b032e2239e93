"""Presets that change while the server runs, without a server: the presets file (parsing,
checks, the start-up check, one API server's reader) and the engine core's table (replacement
in one step, the file's layer). The live server: tests/e2e/test_vllm_auth_presets.py."""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import time

import pytest

from vllm_steer import presets_file as pf
from vllm_steer.integrations.engine.presets import PresetTable, file_op

STEERS = {"detox", "sentiment"}
RESERVED = {"tiny": "the served model name", "polite": "a preset set by --steer-preset"}


def write(path, doc):
    path.write_text(doc if isinstance(doc, str) else json.dumps(doc))
    return str(path)


# ---- the file's format -------------------------------------------------------------------
def test_json_and_yaml_files_give_the_same_presets(tmp_path):
    j = write(tmp_path / "p.json", {"presets": {"kind": {"detox": 4, "sentiment": -2},
                                                "calm": "detox:1.5"}})
    y = write(tmp_path / "p.yaml", "presets:\n  kind: {detox: 4, sentiment: -2}\n"
                                   "  calm: 'detox:1.5'\n")
    want = {"kind": {"detox": 4.0, "sentiment": -2.0}, "calm": {"detox": 1.5}}
    for path in (j, y):
        began = time.time_ns()
        got, stamp = pf.load(path, STEERS, 10.0, RESERVED)
        assert got == want
        data = open(path, "rb").read()
        assert stamp[:2] == (os.stat(path).st_mtime_ns, hashlib.sha256(data).hexdigest())
        assert began <= stamp[2] <= time.time_ns()  # when the read began orders versions
    assert pf.load(write(tmp_path / "e.yml", "presets: {}\n"), STEERS, 10.0)[0] == {}


@pytest.mark.parametrize("name, doc, fragment", [
    ("p.json", '{"presets": {"kind": ', "not valid JSON ("),
    ("p.yaml", "presets: [a, b\n", "not valid YAML ("),
    ("p.json", "[1, 2]", 'expected an object with "presets", got [1, 2]'),
    ("p.json", {"preset": {}}, "unknown key(s) 'preset'; the file has one key"),
    ("p.json", {}, '"presets" is missing'),
    ("p.json", {"presets": ["kind"]}, '"presets" must map preset names to steer mixes'),
    ("p.json", {"presets": {"kind": {"toxic": 1}}},
     "preset 'kind': unknown steer 'toxic'; loaded steers (and --steer-dir files): detox, "
     "sentiment"),
    ("p.json", {"presets": {"kind": {"detox": 11}}},
     "preset 'kind': strength 11 of steer 'detox' exceeds the server's maximum |strength| 10"),
    ("p.json", {"presets": {"kind": {"detox": "4"}}},
     "preset 'kind': strength '4' of steer 'detox' is not a number"),
    ("p.json", {"presets": {"kind": {}}}, "preset 'kind': \"steer\" names no steer"),
    ("p.json", {"presets": {"x y": {"detox": 1}}}, "preset name 'x y' may use only"),
    ("p.json", {"presets": {"tiny": {"detox": 1}}},
     "preset name 'tiny' is already the served model name; give the preset another name"),
    ("p.json", {"presets": {"polite": {"detox": 1}}},
     "preset name 'polite' is already a preset set by --steer-preset"),
    ("p.toml", {"presets": {}}, "unknown format; name the file .json (JSON) or .yaml / .yml"),
    ("p.json", '{"presets": {"kind": {"detox": 1}, "kind": {"detox": 2}}}',
     "'kind' is given twice; each name may be given once"),
    ("p.yaml", "presets:\n  kind: {detox: 1}\n  kind: {detox: 2}\n",
     "'kind' is given twice; each name may be given once"),
    ("p.json", '{"presets": {"kind": {"detox": 1, "detox": 2}}}', "'detox' is given twice"),
    ("p.yaml", "presets:\n  kind: {detox: 1, detox: 2}\n", "'detox' is given twice"),
    ("p.json", '{"presets": {"kind": {"detox": 1' + "0" * 400 + '}}}',
     "preset 'kind': strength of steer 'detox' is an integer of 1329 bits, too large"),
    ("p.yaml", "presets:\n  kind: {detox: 1" + "0" * 400 + "}\n", "integer of 1329 bits"),
])
def test_a_bad_file_is_refused_naming_the_file_and_the_problem(tmp_path, name, doc, fragment):
    path = write(tmp_path / name, doc)
    with pytest.raises(pf.PresetsFileError) as e:
        pf.load(path, STEERS, 10.0, RESERVED)
    assert path in str(e.value) and fragment in str(e.value), str(e.value)


def test_a_missing_or_huge_file_is_refused(tmp_path):
    with pytest.raises(pf.PresetsFileError, match="cannot be read .*--steer-presets-file"):
        pf.load(str(tmp_path / "none.json"), STEERS, 10.0)
    big = tmp_path / "big.json"
    big.write_bytes(b" " * (pf.MAX_FILE_BYTES + 1))
    with pytest.raises(pf.PresetsFileError, match="larger than 1048576 bytes"):
        pf.load(str(big), STEERS, 10.0)
    assert pf.stat_key(str(tmp_path / "none.json")) is None


def test_the_start_up_check_refuses_a_bad_file_and_keeps_a_good_ones_path(tmp_path):
    from vllm_steer.integrations.frontend import cli_args

    steer_dir = tmp_path / "steers"
    steer_dir.mkdir()
    (steer_dir / "sentiment.safetensors").write_bytes(b"")  # a --steer-dir file: a known name

    def args(path, **kw):
        base = dict(steer=None, steer_dir=str(steer_dir), model="tiny", served_model_name=None,
                    steer_preset=["polite=sentiment:1"], steer_presets_file=path)
        return argparse.Namespace(**{**base, **kw})

    good = write(tmp_path / "p.json", {"presets": {"kind": {"sentiment": 2}}})
    cfg = cli_args.config_from_args(args(os.path.relpath(good)))
    assert cfg.presets_file == good and cfg.presets_change
    assert cfg.to_additional_config()["vllm_steer"]["presets_file"] == good
    from vllm_steer.config import SteerServerConfig

    again = SteerServerConfig.from_additional_config(cfg.to_additional_config())
    assert again.presets_file == good  # carried to every process
    for doc, fragment in (({"presets": {"kind": {"detox": 2}}}, "unknown steer 'detox'"),
                          ({"presets": {"polite": {"sentiment": 2}}},
                           "'polite' is already a preset set by --steer-preset"),
                          ({"presets": {"tiny": {"sentiment": 2}}},
                           "'tiny' is already the served model name")):
        with pytest.raises(pf.PresetsFileError, match=fragment):
            cli_args.config_from_args(args(write(tmp_path / "p.json", doc)))
    with pytest.raises(ValueError, match="--steer-presets-file given without any steer"):
        cli_args.config_from_args(args(good, steer_dir=None, steer_preset=None))


# ---- the engine core's table ---------------------------------------------------------------
def test_put_replaces_a_run_time_preset_in_one_step():
    t = PresetTable()
    assert t.add("kind", {"detox": 1}, "t1")["ok"]
    refused = t.add("kind", {"detox": 2}, "t2")  # POST: a taken name
    assert (refused["ok"], refused["status"]) == (False, 400)
    assert "(PUT /v1/steer-presets/kind replaces it)" in refused["error"]
    got = t.add("kind", {"detox": 2}, "t3", replace=True)
    assert got["ok"] and got["replaced"] == {"detox": 1.0}
    assert (got["version"], got["presets"]) == (2, {"kind": {"detox": 2.0}})
    assert t.add("new", {"detox": 3}, "t4", replace=True)["replaced"] is None  # PUT adds too
    # a replacement that failed on another data-parallel engine core: the old mix comes back
    assert t.rollback("kind", "t3")["presets"]["kind"] == {"detox": 1.0}
    assert t.rollback("kind", "t3")["presets"]["kind"] == {"detox": 1.0}  # once
    assert t.rollback("new", "t4")["presets"] == {"kind": {"detox": 1.0}}
    for name, fragment in (("tiny", "the served model name"),
                           ("polite", "a preset set by --steer-preset")):
        got = t.add(name, {"detox": 1}, "t5", RESERVED, replace=True)
        assert not got["ok"] and fragment in got["error"]


def test_the_files_layer_replaces_as_a_whole_and_takes_names_over():
    t = PresetTable()
    t.add("kind", {"detox": 1}, "t1")
    assert "from_file" not in t.snapshot()  # no file read yet: the answer as before
    got = t.set_file({"house": {"detox": 2}, "kind": {"detox": 3}}, (10, "d1"), RESERVED)
    assert got["ok"] and got["changed"] and got["took_over"] == ["kind"]
    assert got["presets"] == {"house": {"detox": 2.0}, "kind": {"detox": 3.0}}
    assert got["from_file"] == ["house", "kind"] and t.presets == {}
    v = t.version
    # the same content (another API server), or an older read: nothing changes
    assert not t.set_file({"house": {"detox": 2}, "kind": {"detox": 3}}, (10, "d1"))["changed"]
    assert not t.set_file({"old": {"detox": 1}}, (9, "d0"))["changed"]
    assert t.version == v and set(t.file) == {"house", "kind"}
    # a name of the file: not added, replaced or deleted over HTTP
    for replace in (False, True):
        got = t.add("house", {"detox": 5}, "t2", replace=replace)
        assert not got["ok"] and "presets file (--steer-presets-file" in got["error"]
    got = t.delete("house")
    assert (got["ok"], got["status"]) == (False, 400) and "remove it from the file" in \
        got["error"]
    # a reserved name refuses the whole version: the one before stays
    got = t.set_file({"tiny": {"detox": 1}}, (11, "d2"), RESERVED)
    assert (got["ok"], got["status"]) == (False, 400) and "'tiny'" in got["error"]
    assert set(t.file) == {"house", "kind"} and t.version == v
    got = file_op(t, {"presets": {"house": {"detox": -2}}, "stamp": [12, "d3"], "path": "p"})
    assert got["changed"] and (got["removed"], got["updated"]) == (["kind"], ["house"])
    assert t.snapshot() == {"version": v + 1, "presets": {"house": {"detox": -2.0}},
                            "from_file": ["house"], "file_stamp": [12, "d3"]}


# ---- one API server's reader -----------------------------------------------------------------
class FakeEngine:
    """The engine-control calls the reader makes, answered by one engine core's table;
    ``steers``: the steers loaded (or files of ``--steer-dir``) as the engine sees them."""

    def __init__(self, steers=STEERS):
        self.table = PresetTable()
        self.steers = set(steers)
        self.calls: list[str] = []

    async def control(self, engine, op, **kw):
        self.calls.append(op)
        if op == "list":
            return {"enabled": True, "steers": [{"name": n, "state": "ready"}
                                                for n in sorted(self.steers)]}
        if op == "presets":
            return self.table.snapshot()
        assert op == "preset_file"
        return file_op(self.table, kw, {"tiny": "the served model name"})


@pytest.fixture
def file_metrics(monkeypatch):
    """The process's steer metrics on a registry of their own; ``read()``: the presets file's
    three series as ``/metrics`` shows them."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from vllm_steer import metrics

    reg = CollectorRegistry()
    monkeypatch.setattr(metrics, "_METRICS", metrics.SteerMetrics(reg))
    names = (metrics.PRESETS_FILE_REFUSED, metrics.PRESETS_FILE_RELOADS,
             metrics.PRESETS_FILE_REFUSALS)

    def read() -> dict[str, float]:
        text = generate_latest(reg).decode()
        got = {s.name: s.value for f in text_string_to_metric_families(text)
               for s in f.samples if s.name in names}
        return {n: got.get(n) for n in names}

    return read


def test_a_backup_restored_with_its_old_modification_time_is_served(tmp_path, monkeypatch):
    """A roll-back to a saved version copied with its modification time (``cp -p``,
    ``rsync -a``) and renamed over the file: the newest version, served (it was ignored as
    older than the version in force, while the reader counted it as served)."""
    import shutil

    from vllm_steer.config import SteerServerConfig
    from vllm_steer.integrations.frontend.state import frontend_state
    from vllm_steer.server import presets_route

    fake = FakeEngine()
    monkeypatch.setattr(presets_route, "manage", fake.control)
    monkeypatch.setattr(frontend_state(), "presets", {})
    monkeypatch.setattr(frontend_state(), "presets_version", -1)
    backup = write(tmp_path / "saved.json", {"presets": {"house": {"detox": 1}}})
    os.utime(backup, ns=(1_700_000_000 * 10**9,) * 2)  # saved long ago
    path = str(tmp_path / "p.json")
    shutil.copy2(backup, path)
    cfg = SteerServerConfig(steers={"detox": "x"}, presets_file=path)
    w = presets_route.PresetsFileWatcher(path)
    assert asyncio.run(w.check(None, cfg))["presets"] == {"house": {"detox": 1.0}}
    write(tmp_path / "new.json", {"presets": {"house": {"detox": 4}}})
    os.replace(tmp_path / "new.json", path)  # an edit
    assert asyncio.run(w.check(None, cfg))["presets"] == {"house": {"detox": 4.0}}
    shutil.copy2(backup, tmp_path / "restore.json")  # the roll-back, its mtime kept
    os.replace(tmp_path / "restore.json", path)
    assert os.stat(path).st_mtime_ns < fake.table.file_stamp[0]
    got = asyncio.run(w.check(None, cfg))
    assert got["changed"] and got["presets"] == {"house": {"detox": 1.0}}
    assert fake.table.file == {"house": {"detox": 1.0}}
    state = w.state(fake.table.snapshot())
    assert state["refused"] is None
    assert state["serving"]["sha256"] == hashlib.sha256(open(path, "rb").read()).hexdigest()


def test_the_reader_loads_each_new_version_once_and_keeps_the_last_good_one(tmp_path,
                                                                         monkeypatch):
    from vllm_steer.config import SteerServerConfig
    from vllm_steer.integrations.frontend.state import frontend_state
    from vllm_steer.server import presets_route

    fake = FakeEngine()
    monkeypatch.setattr(presets_route, "manage", fake.control)
    errors: list[str] = []
    monkeypatch.setattr(presets_route.logger, "error", lambda msg, *a: errors.append(msg % a))
    monkeypatch.setattr(frontend_state(), "presets", {})
    monkeypatch.setattr(frontend_state(), "presets_version", -1)
    path = write(tmp_path / "p.json", {"presets": {"house": {"detox": 2}}})
    cfg = SteerServerConfig(steers={"detox": "x"}, presets_file=path)
    w = presets_route.PresetsFileWatcher(path)

    def check():
        res = asyncio.run(w.check(None, cfg))
        if res is not None:
            frontend_state().update_presets(res)
        return res

    assert check()["presets"] == {"house": {"detox": 2.0}}
    assert check() is None and fake.calls == ["list", "preset_file"]  # unchanged: one stat
    os.utime(path, ns=(1, 1))  # touched (another mtime), same content: not sent again
    assert check() is None and fake.calls == ["list", "preset_file"]
    write(tmp_path / "p.json", {"presets": {"house": {"toxic": 2}}})
    assert check()["ok"] is False
    assert len(errors) == 1 and "unknown steer 'toxic'" in errors[0]
    assert errors[0].endswith("The file was not loaded: the presets in force before stay "
                              "(house); it is read again every 2 s until a version loads"), \
        errors[0]
    os.utime(path, ns=(2, 2))
    # the same bad version, touched or not: read again at every poll, logged once
    assert check()["ok"] is False and check()["ok"] is False and len(errors) == 1
    assert fake.calls == ["list", "preset_file"] + ["list"] * 3
    os.remove(path)
    assert check()["ok"] is False and "missing" in errors[-1] and len(errors) == 2
    assert fake.table.file == {"house": {"detox": 2.0}}  # still served
    write(tmp_path / "p.json", {"presets": {"house": {"detox": -1}, "calm": "sentiment:1"}})
    got = check()
    assert got["changed"] and got["presets"] == {"house": {"detox": -1.0},
                                                 "calm": {"sentiment": 1.0}}
    write(tmp_path / "p.json", {"presets": {"tiny": {"detox": 1}}})  # refused by the engine
    assert check()["ok"] is False and "'tiny' is already the served model name" in errors[-1]
    assert set(fake.table.file) == {"house", "calm"}


def test_a_presets_file_without_run_time_updates_serves_its_presets(monkeypatch):
    """``--steer-presets-file`` alone (no ``--enable-steer-updates``): the file's presets are
    model names (read from the engine core's table), the HTTP write routes stay 403."""
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from vllm_steer.config import SteerServerConfig
    from vllm_steer.integrations.frontend import preset_models
    from vllm_steer.integrations.frontend.state import FrontendState
    from vllm_steer.server import presets_route

    st = FrontendState()
    monkeypatch.setattr(preset_models, "frontend_state", lambda: st)
    monkeypatch.setattr(presets_route, "frontend_state", lambda: st)
    st.reset(SteerServerConfig(steers={"detox": "x"}, presets={"polite": {"detox": 4.0}},
                               presets_file="/etc/p.json"))
    t = PresetTable()
    st.update_presets(t.set_file({"house": {"detox": 2}}, (1, "d"), {}))
    assert preset_models.presets() == {"polite": {"detox": 4.0}, "house": {"detox": 2.0}}
    st.reset(SteerServerConfig(steers={"detox": "x"}, presets={"polite": {"detox": 4.0}}))
    st.update_presets(t.snapshot())
    assert preset_models.presets() == {"polite": {"detox": 4.0}}  # neither flag: static only
    st.reset(SteerServerConfig(steers={"detox": "x"}, presets_file="/etc/p.json"))
    app = FastAPI()
    app.include_router(presets_route.router)
    c = TestClient(app)
    for method, path in (("POST", "/v1/steer-presets"), ("PUT", "/v1/steer-presets/house"),
                         ("DELETE", "/v1/steer-presets/house")):
        r = c.request(method, path, json={"name": "house", "steer": {"detox": 1}})
        assert r.status_code == 403, r.text
        assert "--enable-steer-updates" in r.json()["error"]["message"]
        assert "--steer-presets-file" in r.json()["error"]["message"]


def test_a_refused_version_is_read_again_at_every_poll_until_it_loads(tmp_path, monkeypatch,
                                                                      file_metrics):
    """A replica whose volume shows the new steer file after the new presets file: the version
    is refused while the steer is unknown, read again at every poll, and served once the steer
    is there; the old version serves meanwhile. ``GET /v1/steer-presets`` and the metrics say
    which version serves and which is refused, and why."""
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from vllm_steer.config import SteerServerConfig
    from vllm_steer.integrations.frontend.state import FrontendState
    from vllm_steer.server import presets_route

    st = FrontendState()
    monkeypatch.setattr(presets_route, "frontend_state", lambda: st)
    fake = FakeEngine({"detox-v1"})
    monkeypatch.setattr(presets_route, "manage", fake.control)
    errors: list[str] = []
    monkeypatch.setattr(presets_route.logger, "error", lambda msg, *a: errors.append(msg % a))
    path = tmp_path / "presets.json"

    def swap(doc) -> str:
        """A new version in one step, as docs/deploy.md says: a sibling file renamed over it."""
        tmp = tmp_path / ".presets.json.tmp"
        tmp.write_text(json.dumps(doc))
        os.replace(tmp, path)
        return hashlib.sha256(path.read_bytes()).hexdigest()

    v1 = swap({"presets": {"detox-stable": "detox-v1:4"}})
    cfg = SteerServerConfig(steers={}, steer_dir=str(tmp_path / "none"), presets_file=str(path))
    st.reset(cfg)
    st.set_engine(fake)
    w = presets_route.PresetsFileWatcher(str(path))
    app = FastAPI()
    app.include_router(presets_route.router)
    app.state.vllm_steer_presets_watcher = w
    client = TestClient(app)

    def check():
        res = asyncio.run(w.check(fake, cfg, app.state))
        if res is not None:
            st.update_presets(res)
        return res

    def listed() -> dict:
        r = client.get("/v1/steer-presets")
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["presets_file"] == str(path)
        return body

    assert check()["changed"]
    state = listed()["presets_file_state"]
    assert state["serving"]["sha256"] == v1 and state["refused"] is None
    assert (state["path"], state["reloads"], state["refusals"]) == (str(path), 1, 0)
    assert file_metrics() == {"vllm_steer:presets_file_refused": 0.0,
                              "vllm_steer:presets_file_reloads_total": 1.0,
                              "vllm_steer:presets_file_refusals_total": 0.0}

    v2 = swap({"presets": {"detox-stable": "detox-v2:4"}})  # detox-v2 not on the volume yet
    for reads in (1, 2, 3):
        res = check()
        assert (res["ok"], res["status"]) == (False, 400)
        assert "preset 'detox-stable': unknown steer 'detox-v2'" in res["error"], res
        body = listed()
        state = body["presets_file_state"]
        assert state["serving"]["sha256"] == v1  # the old version serves
        assert state["refused"]["sha256"] == v2 and state["refused"]["reads"] == reads
        assert "unknown steer 'detox-v2'" in state["refused"]["reason"]
        assert [(p["name"], p["steer"], p["source"]) for p in body["data"]] == \
            [("detox-stable", {"detox-v1": 4.0}, "file")]
    assert len(errors) == 1 and str(path) in errors[0]  # logged once, read three times
    assert file_metrics() == {"vllm_steer:presets_file_refused": 1.0,
                              "vllm_steer:presets_file_reloads_total": 1.0,
                              "vllm_steer:presets_file_refusals_total": 1.0}

    fake.steers.add("detox-v2")  # the steer file shows up on this replica's volume
    res = check()  # the next poll: the file itself did not change
    assert res["ok"] and res["changed"]
    assert res["presets"] == {"detox-stable": {"detox-v2": 4.0}}
    state = listed()["presets_file_state"]
    assert state["serving"]["sha256"] == v2 and state["refused"] is None
    assert (state["reloads"], state["refusals"]) == (2, 1)
    assert file_metrics() == {"vllm_steer:presets_file_refused": 0.0,
                              "vllm_steer:presets_file_reloads_total": 2.0,
                              "vllm_steer:presets_file_refusals_total": 1.0}
    n = len(fake.calls)
    assert check() is None and len(fake.calls) == n  # served: back to one stat per poll

    # a refused version undone (the version in force written back): nothing to retry
    swap({"presets": {"detox-stable": "detox-v3:4"}})
    assert check()["ok"] is False and listed()["presets_file_state"]["refused"]
    assert swap({"presets": {"detox-stable": "detox-v2:4"}}) == v2
    assert check() is None
    state = listed()["presets_file_state"]
    assert state["serving"]["sha256"] == v2 and state["refused"] is None
    assert file_metrics() == {"vllm_steer:presets_file_refused": 0.0,
                              "vllm_steer:presets_file_reloads_total": 2.0,
                              "vllm_steer:presets_file_refusals_total": 2.0}
    n = len(fake.calls)
    assert check() is None and len(fake.calls) == n

    # a missing file is refused, read again, and served again once written back
    path.unlink()
    assert "is missing" in check()["error"] and "is missing" in check()["error"]
    assert listed()["presets_file_state"]["refused"]["sha256"] is None
    swap({"presets": {"detox-stable": "detox-v1:4"}})
    assert check()["presets"] == {"detox-stable": {"detox-v1": 4.0}}
    assert file_metrics()["vllm_steer:presets_file_refused"] == 0.0
    assert fake.table.file == {"detox-stable": {"detox-v1": 4.0}}


# ---- a ConfigMap volume, updated as the kubelet updates one -------------------------------
def test_the_kubelet_stand_in_lays_out_and_swaps_a_configmap_volume_as_the_kubelet_does(
        tmp_path):
    """The layout of a mounted ConfigMap (``NAME -> ..data/NAME``, ``..data`` -> a timestamped
    folder), each update a new folder and one rename of ``..data``, the old folder removed,
    an unchanged payload not written at all."""
    from helpers.kubelet import DATA_DIR, atomic_write

    mount = tmp_path / "presets"
    assert atomic_write(mount, {"presets.yaml": "presets: {a: 'detox:1'}\n"}, now=0.0)
    assert os.readlink(mount / "presets.yaml") == "..data/presets.yaml"
    first = os.readlink(mount / DATA_DIR)
    assert first.startswith("..1970_01_01_00_00_00.")
    assert sorted(p.name for p in mount.iterdir()) == sorted([DATA_DIR, first, "presets.yaml"])
    assert oct((mount / first / "presets.yaml").stat().st_mode & 0o777) == "0o644"
    assert not atomic_write(mount, {"presets.yaml": "presets: {a: 'detox:1'}\n"})
    assert os.readlink(mount / DATA_DIR) == first  # nothing written
    assert atomic_write(mount, {"presets.yaml": "presets: {a: 'detox:2'}\n", "extra": "x"})
    second = os.readlink(mount / DATA_DIR)
    assert second != first and not (mount / first).exists()
    assert sorted(p.name for p in mount.iterdir()) == sorted(
        [DATA_DIR, second, "presets.yaml", "extra"])
    assert (mount / "presets.yaml").read_text() == "presets: {a: 'detox:2'}\n"
    assert atomic_write(mount, {"presets.yaml": "presets: {}\n"})  # a name dropped
    assert sorted(p.name for p in mount.iterdir() if not p.name.startswith("..")) == [
        "presets.yaml"]


def test_the_reader_sees_each_configmap_swap_through_the_unchanged_link(tmp_path, monkeypatch):
    """The presets file in a ConfigMap volume: the file's own link (``presets.yaml ->
    ..data/presets.yaml``) never changes, only ``..data`` is renamed; the reader serves each
    new version at its next poll, and a re-applied unchanged ConfigMap is not read again."""
    from helpers.kubelet import DATA_DIR, atomic_write

    from vllm_steer.config import SteerServerConfig
    from vllm_steer.integrations.frontend.state import frontend_state
    from vllm_steer.server import presets_route

    fake = FakeEngine({"detox-v1", "detox-v2"})
    monkeypatch.setattr(presets_route, "manage", fake.control)
    monkeypatch.setattr(frontend_state(), "presets", {})
    monkeypatch.setattr(frontend_state(), "presets_version", -1)
    mount = tmp_path / "etc" / "presets"
    path = str(mount / "presets.yaml")

    def apply(version: str) -> bool:
        return atomic_write(mount, {"presets.yaml": f"presets:\n  detox-stable: \"{version}:4\"\n"})

    apply("detox-v1")
    cfg = SteerServerConfig(steers={}, steer_dir=str(tmp_path / "steers"), presets_file=path)
    w = presets_route.PresetsFileWatcher(path)

    def check():
        return asyncio.run(w.check(fake, cfg))

    assert check()["presets"] == {"detox-stable": {"detox-v1": 4.0}}
    link = os.lstat(path)
    for old, new in (("detox-v1", "detox-v2"), ("detox-v2", "detox-v1")):
        before = os.readlink(mount / DATA_DIR)
        assert apply(new)
        assert os.readlink(mount / DATA_DIR) != before
        # the link the flag names is the same link (inode and time): only ..data moved
        assert (os.lstat(path).st_ino, os.lstat(path).st_mtime_ns) == (link.st_ino,
                                                                       link.st_mtime_ns)
        res = check()
        assert res["changed"] and res["presets"] == {"detox-stable": {new: 4.0}}, (old, res)
        assert fake.table.file == {"detox-stable": {new: 4.0}}
        n = len(fake.calls)
        assert check() is None and len(fake.calls) == n  # one stat per poll until the next
    assert not apply("detox-v1")  # kubectl apply of the same ConfigMap: no swap, no read
    assert check() is None


#: ConfigMap swaps under a polling reader: without the reader's second look at a vanished path
#: (presets_file.RESOLVE_TRIES), 1 of 3 runs of the test below failed at 300 swaps and 3 of 3
#: at 1500 (a loaded 2-core CPU); with three looks at once, 1 of 2 whole-suite runs still
#: failed; five looks, each after a pause (presets_file.RESOLVE_PAUSE_S), pass.
SWAPS = 1500


def test_a_reader_during_configmap_swaps_serves_one_whole_version_each_time(tmp_path,
                                                                           monkeypatch):
    """What the rename of ``..data`` buys, and what the reader must allow for: the kubelet
    removes the old version's folder right after the rename, so a look that went through the
    old ``..data`` can find its file gone. A reader polling while the ConfigMap is swapped
    :data:`SWAPS` times serves a whole version at every look, never refuses the file as
    missing, and ends on the last version."""
    import threading

    from helpers.kubelet import atomic_write

    from vllm_steer.config import SteerServerConfig
    from vllm_steer.integrations.frontend.state import frontend_state
    from vllm_steer.server import presets_route

    fake = FakeEngine({"detox-v1", "detox-v2", "detox-v3"})
    monkeypatch.setattr(presets_route, "manage", fake.control)
    monkeypatch.setattr(frontend_state(), "presets", {})
    monkeypatch.setattr(frontend_state(), "presets_version", -1)
    errors: list[str] = []
    monkeypatch.setattr(presets_route.logger, "error", lambda msg, *a: errors.append(msg % a))
    mount = tmp_path / "presets"
    texts = [f"presets:\n  detox-stable: \"detox-v{k}:4\"\n" + "# pad\n" * (k * 50)
             for k in range(1, 4)]
    atomic_write(mount, {"presets.yaml": texts[0]})
    path = str(mount / "presets.yaml")
    cfg = SteerServerConfig(steers={}, steer_dir=str(tmp_path / "steers"), presets_file=path)
    w = presets_route.PresetsFileWatcher(path)
    served, reads, failures, stop = [], set(), [], threading.Event()

    def raw():  # the reader's two looks, as fast as they go: a whole version every time
        while not stop.is_set():
            if pf.stat_key(path) is None:
                failures.append("stat: missing")
            try:
                reads.add(pf.read_file(path)[0])
            except pf.PresetsFileError as e:
                failures.append(str(e))

    def watch():
        while not stop.is_set():
            try:
                res = asyncio.run(w.check(fake, cfg))
            except Exception as e:  # noqa: BLE001 - reported below
                failures.append(repr(e))
                continue
            if res is not None and res.get("ok"):
                served.append(res["presets"]["detox-stable"])

    threads = [threading.Thread(target=f) for f in (raw, watch)]
    for t in threads:
        t.start()
    try:
        for k in range(SWAPS):
            atomic_write(mount, {"presets.yaml": texts[(k + 1) % 3]})
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert failures == [] and errors == [] and w.refusals == 0, (failures[:3], errors[:3])
    assert reads <= set(texts) and len(served) >= 2, (len(reads), served[:5])
    asyncio.run(w.check(fake, cfg))  # a last look, after the last swap
    assert fake.table.file == {"detox-stable": {"detox-v1": 4.0}}  # SWAPS swaps end on v1


def test_the_docs_host_steps_swap_the_presets_file_and_the_reader_serves_each(tmp_path,
                                                                              monkeypatch):
    """docs/deploy.md's roll-out on a host (a sibling file renamed over the presets file),
    run as a user types it; the ConfigMap steps run against live replicas in
    tests/e2e/test_vllm_rollout.py."""
    import subprocess

    from helpers.rollout_doc import rollout_blocks

    from vllm_steer.config import SteerServerConfig
    from vllm_steer.integrations.frontend.state import frontend_state
    from vllm_steer.server import presets_route

    fake = FakeEngine({"detox-v1", "detox-v2"})
    monkeypatch.setattr(presets_route, "manage", fake.control)
    monkeypatch.setattr(frontend_state(), "presets", {})
    monkeypatch.setattr(frontend_state(), "presets_version", -1)
    path = write(tmp_path / "presets.json", {"presets": {"detox-stable": "detox-v1:4"}})
    cfg = SteerServerConfig(steers={}, steer_dir=str(tmp_path / "steers"), presets_file=path)
    w = presets_route.PresetsFileWatcher(path)
    assert asyncio.run(w.check(fake, cfg))["presets"] == {"detox-stable": {"detox-v1": 4.0}}
    blocks = rollout_blocks()
    for block, new in ((blocks["swap_host"], "detox-v2"), (blocks["rollback_host"], "detox-v1")):
        subprocess.run(["bash", "-euo", "pipefail", "-c",
                        block.replace("/etc/vllm-steer/", f"{tmp_path}/")], check=True,
                       cwd=tmp_path)
        res = asyncio.run(w.check(fake, cfg))
        assert res["changed"] and res["presets"] == {"detox-stable": {new: 4.0}}, res
    assert sorted(p.name for p in tmp_path.iterdir()) == ["presets.json"]  # no .tmp left


def test_a_read_of_the_old_version_that_began_before_a_configmap_swap_loses(tmp_path,
                                                                             monkeypatch):
    """A reader opens the old version, the kubelet swaps ``..data`` to the new one and removes
    the old folder (which moves the open file's change time past the new version's), and the
    old version is sent after the new one: it is older (its read began first), so the new
    version stays served, and is not ignored when sent again."""
    import shutil

    from helpers import kubelet
    from vllm_steer.integrations.engine.presets import PresetTable

    old, new = '{"presets": {"kind": {"detox": 1}}}', '{"presets": {"kind": {"detox": 9}}}'
    kubelet.atomic_write(tmp_path, {"presets.json": old})
    path = str(tmp_path / "presets.json")
    real_open, real_rmtree = pf._open, shutil.rmtree

    def open_then_swap(p):
        f = real_open(p)  # the old version, open
        monkeypatch.setattr(kubelet.shutil, "rmtree",
                            lambda *a, **k: (time.sleep(0.01), real_rmtree(*a, **k)))
        kubelet.atomic_write(tmp_path, {"presets.json": new})
        monkeypatch.setattr(kubelet.shutil, "rmtree", real_rmtree)
        return f

    monkeypatch.setattr(pf, "_open", open_then_swap)
    text_old, stamp_old = pf.read_file(path)
    monkeypatch.setattr(pf, "_open", real_open)
    text_new, stamp_new = pf.read_file(path)
    assert (json.loads(text_old), json.loads(text_new)) == (json.loads(old), json.loads(new))
    t = PresetTable()
    assert t.set_file(json.loads(text_new)["presets"], list(stamp_new))["changed"]
    assert not t.set_file(json.loads(text_old)["presets"], list(stamp_old))["changed"]
    assert t.file == {"kind": {"detox": 9.0}}
    again = t.set_file(json.loads(text_new)["presets"], list(stamp_new))
    assert again["ok"] and t.file == {"kind": {"detox": 9.0}}
