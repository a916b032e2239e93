"""The engine's set of steers: bank slots, load ids, draining, eviction, names, paths."""

from __future__ import annotations

import os

import pytest

from vllm_steer.format import SteerMetadata
from vllm_steer.integrations.engine.registry import (SteerCapacityError, SteerEntry, SteerNameError,
                                              SteerRegistry, bound_in, dir_path, name_problem,
                                              path_inside)
from helpers.fakes import engine_core


def _load(reg, name, in_use=frozenset(), source="api", file=None):
    slot, evicted = reg.free_slot(set(in_use), evictable=True, replacing=name)
    meta = SteerMetadata(name=name, hidden_size=64, rank=4)
    return reg.commit(SteerEntry.from_metadata(name, file or f"/s/{name}.safetensors", meta,
                                               reg.new_load_id(), slot, source), evicted)


def test_reload_under_a_name_makes_a_new_load_in_another_bank_slot_while_the_old_is_used():
    reg = SteerRegistry(3)
    old = _load(reg, "detox", file="/s/v1.safetensors")
    bound_old = reg.bind(["detox"])
    assert bound_old == {"detox": [old.bank_slot, old.load_id]}
    new = _load(reg, "detox", in_use={(old.bank_slot, old.load_id)}, file="/s/v2.safetensors")
    assert new.bank_slot != old.bank_slot and new.load_id > old.load_id
    assert reg.bind(["detox"]) == {"detox": [new.bank_slot, new.load_id]}
    assert reg.slots[old.bank_slot].state == "draining"  # kept for the request bound before
    assert [s["file"] for s in reg.listing() if s["state"] == "loaded"] == ["/s/v2.safetensors"]
    assert reg.reap({(old.bank_slot, old.load_id)}) == []
    assert reg.reap(set()) == [old.bank_slot] and reg.slots[old.bank_slot] is None


def test_reload_of_an_unused_name_reuses_its_bank_slot_with_a_new_load_id():
    reg = SteerRegistry(1)
    old = _load(reg, "detox")
    new = _load(reg, "detox")
    assert new.bank_slot == old.bank_slot and new.load_id == old.load_id + 1


def test_unload_drains_while_used_and_frees_when_not():
    reg = SteerRegistry(2)
    a = _load(reg, "a")
    entry, freed = reg.unload("a", {(a.bank_slot, a.load_id)})
    assert entry.state == "draining" and freed == [] and "a" not in reg.bound
    with pytest.raises(KeyError):
        reg.bind(["a"])
    assert reg.reap(set()) == [a.bank_slot]
    with pytest.raises(KeyError):
        reg.unload("a", set())
    assert reg.counters["unloads"] == 1


def test_capacity_evicts_the_least_recently_used_unused_steer_dir_steer_only():
    reg = SteerRegistry(3)
    pinned = _load(reg, "pinned", source="api")
    x = _load(reg, "x", source="steer-dir")
    y = _load(reg, "y", source="steer-dir")
    reg.bind(["x"])  # x used more recently than y
    reg.slots[y.bank_slot].last_used = reg.slots[x.bank_slot].last_used - 10
    z = _load(reg, "z", source="steer-dir")
    assert z.bank_slot == y.bank_slot and "y" not in reg.bound and reg.counters["evictions"] == 1
    # every steer-dir steer in use, the rest pinned: refused naming the limit and the flag
    with pytest.raises(SteerCapacityError, match=r"all 3 steer slots.*--max-steers=3"):
        _load(reg, "w", in_use={(x.bank_slot, x.load_id), (z.bank_slot, z.load_id)})
    assert set(reg.bound) == {"pinned", "x", "z"} and pinned.bank_slot == 0


def test_full_with_draining_slots_says_so():
    reg = SteerRegistry(1)
    a = _load(reg, "a")
    reg.unload("a", {(a.bank_slot, a.load_id)})
    with pytest.raises(SteerCapacityError, match="still used by running requests"):
        _load(reg, "b", in_use={(a.bank_slot, a.load_id)})


def test_served_counts_per_name_and_bound_in_reads_requests():
    reg = SteerRegistry(2)
    _load(reg, "a"), _load(reg, "b")
    reg.bind(["a"]), reg.bind(["a", "b"])
    assert reg.served == {"a": 2, "b": 1}
    assert reg.get("a").requests_served == 2

    class SP:
        extra_args = {"vllm_steer_bound": [["a", 0, 1, 5.0], ["b", 1, 2, -3.0]]}

    class R:
        sampling_params = SP()

    assert bound_in([R(), object()]) == {(0, 1), (1, 2)}


@pytest.mark.parametrize("name", ["../etc/passwd", "a/b", "..", ".hidden", "a b", "x" * 65, "",
                                  "a\\b", "détox", "a..b"])
def test_unsafe_names_are_refused(name, tmp_path):
    assert name_problem(name) is not None
    with pytest.raises(SteerNameError):
        dir_path(str(tmp_path), name)


def test_dir_path_stays_inside_the_directory(tmp_path):
    assert dir_path(str(tmp_path), "detox") == os.path.join(os.path.realpath(tmp_path),
                                                            "detox.safetensors")
    outside = tmp_path.parent / "outside.safetensors"
    outside.write_bytes(b"x")
    (tmp_path / "link.safetensors").symlink_to(outside)
    with pytest.raises(SteerNameError, match="outside --steer-dir"):
        dir_path(str(tmp_path), "link")
    assert path_inside(str(tmp_path / "a.safetensors"), str(tmp_path))
    assert not path_inside(str(tmp_path / ".." / "a.safetensors"), str(tmp_path))
    assert not path_inside("/etc/passwd", None)


# ---- data parallelism: one answer from every engine core's (protocol.merge_answers) ---------
def _core(index, capacity, steer_dir=None, **policy):
    """An engine core as management.run_op sees it: its own registry, no requests, workers that
    accept every op (``policy``: defaults, floors, presets)."""
    from types import SimpleNamespace

    from vllm_steer.config import SteerServerConfig
    from vllm_steer.integrations.engine.state import EngineSteerState

    cfg = SteerServerConfig(steers={}, max_steers=capacity, steer_dir=steer_dir,
                            enable_updates=True, **policy)
    return engine_core(
        engine_index=index, steer_state=EngineSteerState(cfg, SteerRegistry(capacity), 64),
        scheduler=SimpleNamespace(requests={}),
        model_executor=SimpleNamespace(collective_rpc=lambda fn, args=(): [True]),
        vllm_config=SimpleNamespace(model_config=SimpleNamespace(model="tiny")))


def _all(cores, op, **kw):
    from vllm_steer.integrations.engine import management

    return [management.run_op(c, op, kw) for c in cores]


def test_dp_load_list_unload_merge_and_a_partial_failure_is_rolled_back(tmp_path):
    from helpers.steers import random_steer

    from vllm_steer.format import save_steer
    from vllm_steer.integrations.protocol import merge_answers as merge, rollback_kwargs

    for n in ("a", "b", "c"):
        save_steer(tmp_path / f"{n}.safetensors", random_steer(64, 4, n))
    cores = [_core(0, 2), _core(1, 2)]
    path = lambda n: str(tmp_path / f"{n}.safetensors")  # noqa: E731
    # engine 1 already used a slot for 'b' (loaded there only, say by its own first use)
    assert _all(cores[1:], "load", name="b", path=path("b"), source="api")[0]["ok"]
    answers = _all(cores, "load", name="a", path=path("a"), source="api")
    res = merge("load", answers)
    assert res["ok"] and [(p["engine"], p["bank_slot"]) for p in res["steer"]["per_engine"]] == \
        [(0, 0), (1, 1)]  # each engine core its own slot
    listing = merge("list", _all(cores, "list"))
    states = {s["name"]: s["state"] for s in listing["steers"]}
    assert states == {"a": "loaded", "b": "partial"}
    a = next(s for s in listing["steers"] if s["name"] == "a")
    assert sorted(p["engine"] for p in a["per_engine"]) == [0, 1]
    assert listing["stats"]["counters"]["loads"] == 3 and listing["stats"]["engines"] == 2
    # 'c': room on engine 0, none on engine 1 (two pinned API steers): refused, and engine
    # 0's copy is unloaded again, so no engine core serves a steer the others refuse
    answers = _all(cores, "load", name="c", path=path("c"), source="api")
    assert [x["ok"] for x in answers] == [True, False]
    res = merge("load", answers)
    assert not res["ok"] and res["status"] == 507 and "--max-steers=2" in res["error"]
    undo = rollback_kwargs("c", answers)
    assert undo == {"name": "c", "load_ids": {"0": answers[0]["steer"]["load_id"]}}
    _all(cores, "rollback", **undo)
    names = [{s["name"] for s in x["steers"] if s["state"] == "loaded"}
             for x in _all(cores, "list")]
    assert names == [{"a"}, {"a", "b"}]
    # unload: ok when any engine core had it; 404 only when none did
    assert merge("unload", _all(cores, "unload", name="b"))["ok"]
    res = merge("unload", _all(cores, "unload", name="b"))
    assert not res["ok"] and res["status"] == 404
    assert rollback_kwargs("a", _all(cores, "list")) is None


def test_dp_steer_op_time_is_summed_over_engine_cores_one_head_worker_each():
    """metrics: each engine core counts the worker that steers (TP ranks all steer the same
    rows, a PP stage without the head none); data parallelism sums the engine cores."""
    from types import SimpleNamespace

    from vllm_steer.integrations import protocol as dp

    tp = [{"op_seconds": 0.5, "op_calls": 10, "slots": []},
          {"op_seconds": 0.7, "op_calls": 10, "slots": []}]     # TP=2: the same 10 calls
    pp = [{"op_seconds": 0.0, "op_calls": 0, "slots": []},
          {"op_seconds": 0.25, "op_calls": 4, "slots": []}]     # PP=2: the last stage steers
    assert dp.op_totals(tp) == {"seconds": 0.5, "calls": 10}
    assert dp.op_totals(pp) == {"seconds": 0.25, "calls": 4}
    assert dp.op_totals([True, None]) == {"seconds": 0.0, "calls": 0}
    cores = [_core(0, 2), _core(1, 2)]
    for core, workers in zip(cores, (tp, pp), strict=True):
        core.model_executor = SimpleNamespace(
            collective_rpc=lambda fn, args=(), w=workers: list(w) if args[0] == "stats"
            else [True] * len(w))
    answers = _all(cores, "list")
    assert [a["stats"]["op"]["calls"] for a in answers] == [10, 4]
    merged = dp.merge_answers("list", answers)
    assert merged["stats"]["op"] == {"seconds": 0.75, "calls": 14}


# ---- a full bank: capacity before the file, contention is not a failure --------------------
def _running(core, *entries):
    """Requests running in ``core``, each bound to one loaded steer (as binding writes it)."""
    from types import SimpleNamespace

    from vllm_steer.request import BOUND_KEY, BoundSteer

    for i, e in enumerate(entries):
        bound = BoundSteer.to_wire([BoundSteer(e["name"], e["bank_slot"], e["load_id"], 1.0)])
        core.scheduler.requests[f"run{i}"] = SimpleNamespace(
            sampling_params=SimpleNamespace(extra_args={BOUND_KEY: bound}))


def test_a_full_bank_answers_507_before_reading_the_file_and_counts_no_failure(tmp_path,
                                                                               monkeypatch):
    """Every slot held by steers running requests use: a first-use load answers 507 at once,
    opening no file (counted by a wrapper of the file reader, not by the plugin's counter),
    however often it is asked; it counts contention, not a load failure. Once the requests
    end, one ask loads it, reading the file once."""
    from helpers.steers import random_steer

    from vllm_steer import format as steer_format
    from vllm_steer.format import save_steer
    from vllm_steer.integrations.engine.state import engine_state

    for n in ("a", "b", "c"):
        save_steer(tmp_path / f"{n}.safetensors", random_steer(64, 4, n))
    opened = []
    real = steer_format.load_steer
    monkeypatch.setattr(steer_format, "load_steer", lambda p: opened.append(p) or real(p))
    core = _core(0, 2, steer_dir=str(tmp_path))
    path = lambda n: str(tmp_path / f"{n}.safetensors")  # noqa: E731
    held = [_all([core], "load", name=n, path=path(n), source="steer-dir")[0]["steer"]
            for n in ("a", "b")]
    assert len(opened) == 2
    _running(core, *held)
    reg = engine_state(core).registry
    failures = reg.counters["failures"]
    for _ in range(20):
        res = _all([core], "load", name="c", path=path("c"), source="steer-dir",
                   protect=["c"])[0]
        assert not res["ok"] and res["status"] == 507, res
        assert "all 2 steer slots are in use" in res["error"] and "--max-steers=2" in res["error"]
    # a path that no longer exists is not even looked at while the bank is full
    res = _all([core], "load", name="c", path=str(tmp_path / "gone.safetensors"),
               source="steer-dir", protect=["c"])[0]
    assert res["status"] == 507, res
    assert opened == [path("a"), path("b")]
    assert reg.counters["failures"] == failures and reg.counters["bank_full"] == 21
    assert reg.counters["file_reads"] == 2
    # an operator's load over HTTP at a full bank is a refused load (a failure), still unread
    res = _all([core], "load", name="c", path=path("c"), source="api")[0]
    assert res["status"] == 507 and reg.counters["failures"] == failures + 1
    assert len(opened) == 2
    # the running requests end: one ask loads it, one read, the least recently used evicted
    core.scheduler.requests.clear()
    res = _all([core], "load", name="c", path=path("c"), source="steer-dir", protect=["c"])[0]
    assert res["ok"] and res["evicted"] == "a", res
    assert opened == [path("a"), path("b"), path("c")] and reg.counters["file_reads"] == 3


def test_a_request_that_never_fits_is_a_400_before_any_read(tmp_path, monkeypatch):
    """The request's steers and the steers never evicted are more than the bank: a 400 naming
    the limit (no wait helps), with no file read."""
    from helpers.steers import random_steer

    from vllm_steer import format as steer_format
    from vllm_steer.format import save_steer

    for n in ("p", "a", "c"):
        save_steer(tmp_path / f"{n}.safetensors", random_steer(64, 4, n))
    core = _core(0, 2, steer_dir=str(tmp_path))
    assert _all([core], "load", name="p", path=str(tmp_path / "p.safetensors"),
                source="api")[0]["ok"]
    opened = []
    real = steer_format.load_steer
    monkeypatch.setattr(steer_format, "load_steer", lambda p: opened.append(p) or real(p))
    res = _all([core], "load", name="c", path=str(tmp_path / "c.safetensors"),
               source="steer-dir", protect=["a", "c"])[0]
    assert not res["ok"] and res["status"] == 400, res
    assert "--max-steers=2" in res["error"] and "never evicted" in res["error"], res
    assert opened == []


def test_engine_core_admission_without_room_is_a_busy_refusal_and_never_fitting_a_400(
        tmp_path):
    """A request reaching the engine core whose first-use steer finds every slot held by
    running requests is finished with the busy prefix (the API server's HTTP 429); one whose
    steers can never fit beside the steers never evicted with the refusal prefix (HTTP 400).
    Neither counts a load failure."""
    from types import SimpleNamespace

    from helpers.steers import random_steer

    from vllm_steer.format import save_steer
    from vllm_steer.integrations.engine import core as engine_hooks
    from vllm_steer.integrations.engine.state import engine_state
    from vllm_steer.integrations.protocol import BUSY_PREFIX, REFUSED_PREFIX
    from vllm_steer.request import SteerRequest

    for n in ("p", "q", "a", "c"):
        save_steer(tmp_path / f"{n}.safetensors", random_steer(64, 4, n))
    core = _core(0, 3, steer_dir=str(tmp_path))
    sent = []
    core.output_queue = SimpleNamespace(put_nowait=sent.append)
    for n in ("p", "q"):  # never evicted
        assert _all([core], "load", name=n, path=str(tmp_path / f"{n}.safetensors"),
                    source="api")[0]["ok"]
    held = _all([core], "load", name="a", path=str(tmp_path / "a.safetensors"),
                source="steer-dir")[0]["steer"]
    _running(core, held)
    reg = engine_state(core).registry
    failures = reg.counters["failures"]

    def admit(rid, steers):
        request = SimpleNamespace(request_id=rid, client_index=0, sampling_params=SimpleNamespace(
            extra_args={"steer": SteerRequest.parse(steers, None, 10.0).to_wire()}))
        engine_hooks.add_request(lambda *a: pytest.fail("admitted"), core, request)
        (_, outs), = sent[-1:]
        return outs.outputs[0].stop_reason

    reason = admit("r1", {"c": 1.0})  # fits once the request using 'a' ends
    assert reason.startswith(BUSY_PREFIX) and "only 0 of the 3 steer slots" in reason, reason
    reason = admit("r2", {"p": 1.0, "c": -1.0})
    assert reason.startswith(BUSY_PREFIX), reason
    reason = admit("r3", {"a": 1.0, "c": 1.0})  # with p and q: 4 steers in 3 slots, ever
    assert reason.startswith(REFUSED_PREFIX) and "--max-steers=3" in reason, reason
    assert reg.counters["failures"] == failures and reg.counters["bank_full"] == 2
    # the message the API server's first-use load gives (docs/serving.md's table), word for word
    load = _all([core], "load", name="c", path=str(tmp_path / "c.safetensors"),
                source="steer-dir", protect=["a", "c"])[0]
    assert load["status"] == 400 and "are more than the 3 steer slots" in load["error"], load
    assert reason == f"{REFUSED_PREFIX}steer: {load['error']}", (reason, load)
    assert reg.refused == {"429:bank_full": 2, "400:too_many_steers": 1}, reg.refused
    core.scheduler.requests.clear()  # the request using 'a' ends: the same request fits
    admitted = []
    request = SimpleNamespace(request_id="r4", client_index=0, sampling_params=SimpleNamespace(
        extra_args={"steer": SteerRequest.parse({"c": 1.0}, None, 10.0).to_wire()}))
    engine_hooks.add_request(lambda core_, req, wave: admitted.append(req), core, request)
    assert admitted == [request] and set(reg.bound) == {"p", "q", "c"}


def test_an_engine_core_in_the_callers_process_hands_its_refusals_to_the_next_step(
        monkeypatch):
    """With the engine core in the ``LLM``'s process (no output queue), a refused request is
    not raised out of ``EngineCore.add_request`` (vLLM's output processor would keep it
    unfinished for ever): its error output is added to the next step's outputs of the
    in-process client, once; a fault of the admission code too."""
    from types import SimpleNamespace

    from vllm.v1.engine import EngineCoreOutputs, FinishReason

    from vllm_steer.integrations.engine import core as engine_hooks
    from vllm_steer.integrations.protocol import FAILED_PREFIX, REFUSED_PREFIX
    from vllm_steer.request import SteerRequest

    core = _core(0, 2)
    client = SimpleNamespace(engine_core=core)
    step = EngineCoreOutputs(outputs=[SimpleNamespace(request_id="served")])

    def request(rid, steers):
        return SimpleNamespace(request_id=rid, client_index=0, sampling_params=SimpleNamespace(
            extra_args={"steer": SteerRequest.parse(steers, None, 10.0).to_wire()}))

    engine_hooks.add_request(lambda *a: pytest.fail("admitted"), core, request("r1", {"x": 1}))

    def fault(core, request):
        raise RuntimeError("planted")

    monkeypatch.setattr(engine_hooks, "bind_request", fault)
    engine_hooks.add_request(lambda *a: pytest.fail("admitted"), core, request("r2", {"x": 1}))
    outs = engine_hooks.inproc_get_output(lambda c: step, client).outputs
    assert [o.request_id for o in outs] == ["served", "r1", "r2"]
    assert all(o.finish_reason == FinishReason.ERROR for o in outs[1:])
    assert outs[1].stop_reason.startswith(REFUSED_PREFIX) and "'x'" in outs[1].stop_reason
    assert outs[2].stop_reason.startswith(FAILED_PREFIX)
    empty = EngineCoreOutputs()
    assert engine_hooks.inproc_get_output(lambda c: empty, client).outputs == []  # once


def test_a_steer_a_default_or_positive_floor_names_is_not_unloaded_unless_a_use_reloads_it(
        tmp_path):
    from helpers.steers import random_steer

    from vllm_steer.format import save_steer

    d = tmp_path / "dir"
    d.mkdir()
    for n in ("b", "c", "f"):
        save_steer(tmp_path / f"{n}.safetensors", random_steer(64, 4, n))
    save_steer(d / "dd.safetensors", random_steer(64, 4, "dd"))
    core = _core(0, 4, steer_dir=str(d), defaults={"b": 1.0, "dd": 2.0},
                 floors={"c": 2.0, "f": -1.0})
    for n, path in (("b", tmp_path / "b.safetensors"), ("c", tmp_path / "c.safetensors"),
                    ("f", tmp_path / "f.safetensors"), ("dd", d / "dd.safetensors")):
        assert _all([core], "load", name=n, path=str(path), source="api")[0]["ok"]
    b, c = (_all([core], "unload", name=n)[0] for n in ("b", "c"))
    assert (b["ok"], b["status"], c["ok"], c["status"]) == (False, 409, False, 409)
    assert b["error"].startswith("steer 'b' is named by --steer-default b=1 (every request gets "
                                 "it; restart without it): unloaded, it could not be loaded "
                                 "again at a request's first use (it is no file of "
                                 "--steer-dir)"), b["error"]
    assert "--steer-floor c=2 (every request gets at least it" in c["error"]
    # a negative floor changes only the requests naming the steer; a --steer-dir file is
    # loaded again at its next use: both unloaded
    assert _all([core], "unload", name="f")[0]["ok"]
    assert _all([core], "unload", name="dd")[0]["ok"]
    listing = _all([core], "list")[0]
    assert {s["name"] for s in listing["steers"] if s["state"] == "loaded"} == {"b", "c"}
    assert _all([core], "unload", name="nope")[0]["status"] == 404  # unknown: still a 404


def test_a_request_added_only_to_be_aborted_is_handed_to_vllm_unbound(tmp_path):
    """vLLM 0.33's paused engine finishes a rejected request with its own error, then re-adds
    the client's request with ``abort_immediately`` (its sampling params, steer included) so
    the KV connector frees what it holds: that request never runs. It reaches vLLM's
    ``add_request`` as it is: no steer loaded from --steer-dir for it, no refusal (which
    would skip the clean-up), no bound form written."""
    from types import SimpleNamespace

    from helpers.steers import random_steer

    from vllm_steer.format import save_steer
    from vllm_steer.integrations.engine import core as engine_hooks
    from vllm_steer.integrations.engine.state import engine_state
    from vllm_steer.request import BOUND_KEY, SteerRequest

    save_steer(tmp_path / "d.safetensors", random_steer(64, 4, "d"))
    core = _core(0, 2, steer_dir=str(tmp_path))
    sent = []
    core.output_queue = SimpleNamespace(put_nowait=sent.append)

    def request(rid, steers, abort):
        return SimpleNamespace(
            request_id=rid, client_index=0, abort_immediately=abort,
            sampling_params=SimpleNamespace(extra_args={
                "steer": SteerRequest.parse(steers, None, 10.0).to_wire()}))

    added = []
    for steers in ({"d": 1.0}, {"unknown": 1.0}):  # a first use, and a name it would refuse
        req = request("r", steers, abort=True)
        engine_hooks.add_request(lambda core_, r, wave: added.append(r), core, req)
        assert added[-1] is req and BOUND_KEY not in req.sampling_params.extra_args
    assert sent == [] and engine_state(core).registry.get("d") is None  # nothing loaded
    # the same request when it is to run: bound (its --steer-dir steer loaded on first use)
    req = request("r2", {"d": 1.0}, abort=False)
    engine_hooks.add_request(lambda core_, r, wave: added.append(r), core, req)
    assert added[-1] is req and BOUND_KEY in req.sampling_params.extra_args
