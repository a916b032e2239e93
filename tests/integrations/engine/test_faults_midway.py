"""Faults inside the engine core's state-changing operations, at each step between their first
and last write: a load (after one worker's put; after every put and before the registry's
commit), a replacement, an unload (a worker that fails to empty the slot), the presets-file
swap, and the data-parallel roll-back (one engine core applied the op, the other failed).

The real engine-core code runs (the management hook, the registry, the preset table, the
data-parallel client of the API server); the workers are two fakes (tensor parallelism), each
keeping its copy of the bank from the ``put`` / ``drop`` calls it gets, and failing on
command. After each fault: the answer is an error naming vllm-steer (or, for an unload whose
slot a worker failed to empty, the unload's success), the registry and every worker's bank
agree (no name is bound to a slot whose bank holds another load), the state is the one before
the op or the one after it, and the next op succeeds.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from helpers.engine_cores import HIDDEN, DPClient, management_core, op
from helpers.steers import random_steer
from vllm_steer.format import save_steer
from vllm_steer.integrations.engine import core as hooks
from vllm_steer.integrations.engine.registry import SteerRegistry
from vllm_steer.request import BOUND_KEY, BoundSteer, SteerRequest


@pytest.fixture
def files(tmp_path):
    for i, n in enumerate(("a", "b", "c", "d")):
        save_steer(tmp_path / f"{n}.safetensors", random_steer(HIDDEN, 2, n, seed=i))
    return lambda n: str(tmp_path / f"{n}.safetensors")


def state(core) -> dict:
    """What a user can see: the listing (name, state, source, bank slot, load id) and the
    counters but the failures (a failed load counts one) and the file reads (a load that
    fails after reading its file read it)."""
    answer = op(core, "list")
    counters = dict(answer["stats"]["counters"])
    counters.pop("failures")
    counters.pop("file_reads")
    return {"steers": sorted((s["name"], s["state"], s["source"], s["bank_slot"], s["load_id"])
                             for s in answer["steers"]), "counters": counters}


def agree(core, stale_ok: bool = False) -> None:
    """Every worker's bank holds the loads the registry lists, in their slots; and no other
    (``stale_ok``: a slot a worker failed to empty may keep factors no name is bound to)."""
    listing = {s["bank_slot"]: (s["load_id"], s["name"]) for s in op(core, "list")["steers"]}
    for bank in core.model_executor.banks:
        assert {s: bank.get(s) for s in listing} == listing, (bank, listing)
        assert stale_ok or set(bank) == set(listing), (bank, listing)


def admit(core, rid, steers: dict) -> list[BoundSteer]:
    """One request through the engine core's admission hook; its bound steers."""
    request = SimpleNamespace(request_id=rid, client_index=0, sampling_params=SimpleNamespace(
        extra_args={"steer": SteerRequest.parse(steers, None, 10.0).to_wire()}))
    admitted = []
    hooks.add_request(lambda c, r, w: admitted.append(r), core, request)
    assert admitted, rid
    core.scheduler.requests[rid] = request
    return BoundSteer.from_wire(request.sampling_params.extra_args[BOUND_KEY])


# ---- a load --------------------------------------------------------------------------------
@pytest.mark.parametrize("where", ["worker 0's put", "worker 1's put (worker 0 wrote)",
                                   "the commit (both workers wrote)"])
def test_a_load_into_a_free_slot_that_fails_half_way_changes_nothing(files, where,
                                                                      monkeypatch):
    core = management_core()
    assert op(core, "load", name="a", path=files("a"))["ok"]
    before = state(core)
    if where.startswith("the commit"):
        def commit(self, *a, **kw):
            raise RuntimeError("fault injected before the commit")
        monkeypatch.setattr(SteerRegistry, "commit", commit)
    else:
        core.model_executor.fail("put", int(where[7]))
    answer = op(core, "load", name="b", path=files("b"))
    monkeypatch.undo()
    assert answer["ok"] is False and answer["status"] == 500, answer
    assert answer["error"].startswith("vllm-steer") and "fault injected" in answer["error"]
    assert state(core) == before  # as before: 'a' only, nothing half-loaded
    agree(core)
    assert op(core, "load", name="b", path=files("b"))["ok"]  # the next op succeeds
    agree(core)
    assert {b.name: b.load_id for b in admit(core, "r1", {"a": 1, "b": 2})} == {
        s[0]: s[4] for s in state(core)["steers"]}


def _listed(core) -> dict:
    """The loaded steers as ``GET /v1/steers`` lists them: name -> (file, load id)."""
    return {s["name"]: (s["file"], s["load_id"]) for s in op(core, "list")["steers"]
            if s["state"] == "loaded"}


def test_a_replacement_in_its_own_slot_that_fails_half_way_keeps_the_previous_file(files):
    """The bank is full and the name's slot is the only one: the second worker fails after
    the first wrote the new factors over the old ones. The previous file is read again into
    that slot: the name keeps serving it (a new load id), the error says so, nothing else
    changes; loading the new file again succeeds."""
    core = management_core(capacity=2)
    assert op(core, "load", name="a", path=files("a"))["ok"]
    assert op(core, "load", name="b", path=files("b"))["ok"]
    before = _listed(core)
    counters = state(core)["counters"]
    core.model_executor.fail("put", 1)
    answer = op(core, "load", name="a", path=files("c"))
    assert answer["ok"] is False and answer["status"] == 500, answer
    assert answer["error"].startswith("vllm-steer") and "fault injected" in answer["error"]
    assert "nothing was changed" not in answer["error"], answer
    assert f"steer 'a' serves its previous file {files('a')} again" in answer["error"], answer
    after = _listed(core)
    assert after["b"] == before["b"] and after["a"][0] == files("a"), after
    assert after["a"][1] > before["a"][1]  # read again: a new load
    assert state(core)["counters"] == counters  # the put back is no load anyone asked for
    agree(core)
    (bound,) = admit(core, "r1", {"a": 1})
    assert (bound.load_id, core.model_executor.banks[1][bound.bank_slot]) == (
        after["a"][1], (after["a"][1], "a"))
    core.scheduler.requests.clear()  # r1 finished: the name's slot is free to replace
    assert op(core, "load", name="a", path=files("c"))["ok"]  # the next op succeeds
    agree(core)


@pytest.mark.parametrize("why", ["its file is gone", "its put fails too"])
def test_a_replacement_in_its_own_slot_whose_previous_file_cannot_come_back_says_unloaded(
        files, why):
    """As above, but the previous file cannot be put back: the name is unloaded, and the
    error says so (never "nothing was changed"), naming the preset that names it."""
    import os

    core = management_core(capacity=2)
    assert op(core, "load", name="a", path=files("a"))["ok"]
    assert op(core, "load", name="b", path=files("b"))["ok"]
    assert op(core, "preset_add", name="p", steer={"a": 1.0}, token="t")["ok"]
    core.model_executor.fail("put", 1)
    if why == "its file is gone":
        os.remove(files("a"))
    else:
        core.model_executor.fail("put", 0)
    answer = op(core, "load", name="a", path=files("c"))
    assert answer["ok"] is False and answer["status"] == 500, answer
    assert "nothing was changed" not in answer["error"], answer
    assert "steer 'a' is unloaded" in answer["error"], answer
    assert "the preset 'p'" in answer["error"], answer
    assert set(_listed(core)) == {"b"}
    agree(core)
    assert op(core, "load", name="a", path=files("c"))["ok"]
    agree(core)


def test_a_replacement_that_fails_keeps_the_old_file_for_running_and_new_requests(files):
    """A replacement with a free slot whose put fails in the second worker: the old load
    stays bound (new requests get it) and the request running on it keeps its slot."""
    core = management_core(capacity=3)
    assert op(core, "load", name="a", path=files("a"))["ok"]
    (running,) = admit(core, "r1", {"a": 1})
    before = state(core)
    core.model_executor.fail("put", 1)
    assert op(core, "load", name="a", path=files("b"))["status"] == 500
    assert state(core) == before
    agree(core)
    (again,) = admit(core, "r2", {"a": 2})
    assert (again.bank_slot, again.load_id) == (running.bank_slot, running.load_id)
    new = op(core, "load", name="a", path=files("b"))  # the next replacement succeeds
    assert new["ok"] and new["steer"]["bank_slot"] != running.bank_slot
    assert {s[1] for s in state(core)["steers"] if s[0] == "a"} == {"loaded", "draining"}
    agree(core)


def test_a_first_use_load_that_fails_half_way_unbinds_the_steer_it_was_evicting(files,
                                                                                tmp_path):
    """A first use from --steer-dir evicts the idle least-recently-used steer-dir steer: the
    put fails in the second worker after the first wrote over it. The request fails (500),
    the evicted steer is unbound (read again on its next use), nothing else changes."""
    core = management_core(capacity=2, steer_dir=str(tmp_path))
    admit(core, "r1", {"a": 1})
    admit(core, "r2", {"b": 1})
    core.scheduler.requests.clear()  # both finished; 'a' is the least recently used
    before = state(core)
    core.model_executor.fail("put", 1)
    outputs = []
    core.output_queue = SimpleNamespace(put_nowait=outputs.append)
    request = SimpleNamespace(request_id="r3", client_index=0, sampling_params=SimpleNamespace(
        extra_args={"steer": SteerRequest.parse({"c": 1}, None, 10.0).to_wire()}))
    hooks.add_request(lambda c, r, w: pytest.fail("admitted"), core, request)
    (_, out), = outputs
    assert out.outputs[0].stop_reason.startswith("vllm-steer failed: ")
    after = state(core)
    assert [s for s in after["steers"]] == [s for s in before["steers"] if s[0] != "a"]
    assert after["counters"]["evictions"] == before["counters"]["evictions"] + 1
    agree(core)
    assert [b.name for b in admit(core, "r4", {"c": 1})] == ["c"]  # the next one is served
    assert [b.name for b in admit(core, "r5", {"a": 1})] == ["a"]  # read again
    agree(core)


# ---- an unload -----------------------------------------------------------------------------
def test_an_unload_whose_slot_a_worker_fails_to_empty_is_done_and_says_so(files):
    core = management_core(capacity=1)
    assert op(core, "load", name="a", path=files("a"))["ok"]
    core.model_executor.fail("drop", 1)
    answer = op(core, "unload", name="a")
    assert answer["ok"] is True, answer  # the name is unbound: what the caller asked for
    assert state(core)["steers"] == []
    res = op(core, "load", name="b", path=files("b"))  # the slot is free: overwritten
    assert res["ok"] and res["steer"]["bank_slot"] == 0
    agree(core)


def test_a_drain_whose_slot_a_worker_fails_to_empty_frees_it_and_serves_on(files):
    core = management_core(capacity=1)
    assert op(core, "load", name="a", path=files("a"))["ok"]
    admit(core, "r1", {"a": 1})
    assert op(core, "unload", name="a")["ok"]
    core.scheduler.requests.clear()
    core.model_executor.fail("drop", 1)
    assert op(core, "list")["steers"] == []  # reaped: freed even though one drop failed
    assert op(core, "load", name="b", path=files("b"))["ok"]
    agree(core)


# ---- presets -------------------------------------------------------------------------------
def _presets(core):
    return {k: v for k, v in op(core, "presets").items() if k != "engine"}


def test_a_presets_file_swap_that_fails_half_way_changes_nothing(files):
    """The file's second preset cannot be read, after the first one would take a run-time
    name over: the run-time preset stays, the file's presets and the version are as before;
    the next version loads."""
    core = management_core()
    assert op(core, "load", name="a", path=files("a"))["ok"]
    assert op(core, "preset_add", name="p1", steer={"a": 1.0}, token="t1")["ok"]
    assert op(core, "preset_file", presets={"f": {"a": 2.0}}, stamp=(1, "v1"))["ok"]
    before = _presets(core)
    bad = op(core, "preset_file", presets={"p1": {"a": 3.0}, "p9": {"a": "x"}}, stamp=(2, "v2"))
    assert bad["ok"] is False, bad
    assert _presets(core) == before
    good = op(core, "preset_file", presets={"p1": {"a": 3.0}}, stamp=(2, "v2"))
    assert good["ok"] and good["took_over"] == ["p1"] and good["removed"] == ["f"]
    assert _presets(core)["presets"] == {"p1": {"a": 3.0}}


def test_a_preset_add_or_replace_with_a_bad_mix_changes_nothing(files):
    core = management_core()
    assert op(core, "load", name="a", path=files("a"))["ok"]
    assert op(core, "preset_add", name="p1", steer={"a": 1.0}, token="t1")["ok"]
    before = _presets(core)
    for replace in (False, True):
        res = op(core, "preset_add", name="p2" if not replace else "p1",
                 steer={"a": 1.0, "b": "x"}, token="t2", replace=replace)
        assert res["ok"] is False, res
        assert _presets(core) == before


def test_a_preset_naming_a_steer_unloaded_after_its_check_is_a_409_and_changes_nothing(
        files, tmp_path):
    """The API server checks a new preset's steers with a ``list``, then sends the add; an
    unload of one of them in between (the preset did not name it yet, so the unload was not
    refused) must not leave a preset every request of which would be refused: the add is a
    409 naming the steer, the table as before. A steer ``--steer-dir`` could load again at a
    first use is no conflict."""
    core = management_core()
    assert op(core, "load", name="a", path=files("a"))["ok"]
    assert op(core, "load", name="b", path=files("b"))["ok"]
    assert {s["name"] for s in op(core, "list")["steers"]} == {"a", "b"}  # the route's check
    assert op(core, "unload", name="a")["ok"]  # another caller, between check and add
    before = _presets(core)
    res = op(core, "preset_add", name="p1", steer={"a": 1.0, "b": 2.0}, token="t1")
    assert res["ok"] is False and res["status"] == 409, res
    assert "'a'" in res["error"] and "'b'" not in res["error"], res
    assert _presets(core) == before
    assert op(core, "preset_add", name="p1", steer={"b": 2.0}, token="t2")["ok"]

    steer_dir = tmp_path / "dir"
    steer_dir.mkdir()
    save_steer(steer_dir / "c.safetensors", random_steer(HIDDEN, 2, "c", seed=7))
    core = management_core(steer_dir=str(steer_dir))
    assert op(core, "preset_add", name="p1", steer={"c": 1.0}, token="t1")["ok"]  # first use


@pytest.mark.parametrize("op_name,kw", [
    ("preset_add", {"name": "p1", "steer": "detox"}),
    ("preset_add", {"name": "p1", "steer": {"a": "4"}}),
    ("preset_add", {"name": "p1", "steer": {"a": True}}),
    ("preset_add", {"name": "p1", "steer": {"a": float("nan")}}),
    ("preset_file", {"presets": {"p1": {"a": float("inf")}}, "stamp": (1, "v1")}),
    ("preset_file", {"presets": ["p1"], "stamp": (1, "v1")}),
    ("preset_file", {"presets": {"p1": {"a": "x"}}, "stamp": (1, "v1")}),
    ("preset_file", {"presets": {"p1": {"a": 1.0}}, "stamp": "v1"}),
    ("preset_file", {"presets": {"p1": {"a": 1.0}}}),
])
def test_a_preset_op_with_arguments_of_another_shape_is_a_400_naming_them(files, op_name,
                                                                          kw):
    """A direct caller of the management op (the API server sends them right): a 400 naming
    the argument, not an internal error, and nothing changed."""
    core = management_core()
    assert op(core, "load", name="a", path=files("a"))["ok"]
    before = _presets(core)
    res = op(core, op_name, **kw)
    assert res["ok"] is False and res["status"] == 400, res
    assert ('"steer"' if op_name == "preset_add" else '"presets"' if not isinstance(
        kw.get("presets"), dict) or kw["presets"]["p1"] != {"a": 1.0} else '"stamp"'
            ) in res["error"], res
    assert _presets(core) == before


# ---- data parallelism: one engine core applied it, the other failed ----------------------
def _manage(cores, op_name, /, **kw):
    from vllm_steer.integrations.frontend.engine_client import manage
    from vllm_steer.integrations.frontend.state import frontend_state

    try:
        return asyncio.run(manage(SimpleNamespace(engine_core=DPClient(cores)), op_name,
                                  **kw))
    finally:
        frontend_state().reset(None)


def test_a_dp_load_that_fails_half_way_on_one_engine_core_is_rolled_back_on_the_other(files):
    cores = [management_core(0), management_core(1)]
    assert _manage(cores, "load", name="a", path=files("a"))["ok"]
    before = [state(c) for c in cores]
    cores[1].model_executor.fail("put", 1)  # engine core 0 loads it; engine core 1 half-way
    res = _manage(cores, "load", name="b", path=files("b"))
    assert res["ok"] is False and res["status"] == 500 and "rolled back" not in res, res
    assert res["error"].endswith("(data parallelism: refused by engine core 1; undone on "
                                 "engine core 0)"), res
    after = [state(c) for c in cores]
    for b, a in zip(before, after, strict=True):
        assert a["steers"] == b["steers"]
    for c in cores:
        agree(c)
    assert _manage(cores, "load", name="b", path=files("b"))["ok"]  # the next op succeeds
    assert [sorted(s[0] for s in state(c)["steers"]) for c in cores] == [["a", "b"]] * 2


@pytest.mark.parametrize("room_on_0", [1, 2])
def test_a_dp_replacement_refused_on_one_engine_core_keeps_the_name_on_every_one(files,
                                                                                room_on_0):
    """A name loaded again with another file: engine core 1 is full and a running request
    holds the name's slot (507), engine core 0 replaces it (in the name's own slot, or in an
    empty one). The call fails and changes nothing a user sees: both engine cores serve the
    name, from its first file (read again where it was replaced), never half the engine
    cores answering "unknown steer"."""
    cores = [management_core(0, capacity=room_on_0), management_core(1, capacity=1)]
    assert _manage(cores, "load", name="a", path=files("a"))["ok"]
    admit(cores[1], "r1", {"a": 1.0})  # engine core 1's only slot is in use
    res = _manage(cores, "load", name="a", path=files("b"))
    assert res["ok"] is False and res["status"] == 507, res
    assert "undone on engine core 0: 'a' serves its previous file there again" in res["error"]
    for c in cores:
        listing = {s["name"]: s for s in op(c, "list")["steers"] if s["state"] == "loaded"}
        assert set(listing) == {"a"} and listing["a"]["file"] == files("a"), listing
        agree(c, stale_ok=True)
    # a request on either engine core is admitted with the name
    assert admit(cores[0], "r2", {"a": 1.0}) and admit(cores[1], "r3", {"a": 1.0})

def test_a_dp_roll_back_whose_drop_fails_still_unbinds(files):
    cores = [management_core(0), management_core(1, capacity=1)]
    assert _manage(cores, "load", name="a", path=files("a"))["ok"] is True
    cores[0].model_executor.fail("drop", 0)  # engine core 1 is full: 507, then roll back
    res = _manage(cores, "load", name="b", path=files("b"))
    assert res["ok"] is False and res["status"] == 507, res
    assert [sorted(s[0] for s in state(c)["steers"]) for c in cores] == [["a"], ["a"]]
    assert _manage(cores, "unload", name="a")["ok"]
    assert _manage(cores, "load", name="b", path=files("b"))["ok"]
    for c in cores:
        agree(c, stale_ok=True)


def test_a_dp_preset_add_that_fails_on_one_engine_core_is_rolled_back_on_the_other(
        monkeypatch, files):
    from vllm_steer.integrations.engine.state import engine_state

    cores = [management_core(0), management_core(1)]
    assert _manage(cores, "load", name="a", path=files("a"))["ok"]
    assert _manage(cores, "preset_add", name="p1", steer={"a": 1.0}, token="t1")["ok"]
    before = [_presets(c) for c in cores]
    table = engine_state(cores[1]).presets

    def add(*a, **kw):
        raise RuntimeError("fault injected in engine core 1's preset table")
    monkeypatch.setattr(table, "add", add)
    res = _manage(cores, "preset_add", name="p1", steer={"a": 5.0}, token="t2", replace=True)
    monkeypatch.undo()
    assert res["ok"] is False and res["status"] == 500, res
    assert [_presets(c)["presets"] for c in cores] == [b["presets"] for b in before]
    assert _manage(cores, "preset_add", name="p1", steer={"a": 5.0}, token="t3",
                   replace=True)["ok"]
    assert [_presets(c)["presets"] for c in cores] == [{"p1": {"a": 5.0}}] * 2


def test_a_dp_unload_that_fails_on_one_engine_core_says_so_and_a_retry_finishes_it(
        files, monkeypatch):
    """One engine core unloads the name, the other fails: it still serves the name, so the
    call answers the failure (not the first engine core's success), and sending it again
    unloads it there."""
    cores = [management_core(0), management_core(1)]
    assert _manage(cores, "load", name="a", path=files("a"))["ok"]
    registry = engine_state_of(cores[1]).registry

    def unload(*a, **kw):
        raise RuntimeError("fault injected in engine core 1's unload")
    monkeypatch.setattr(registry, "unload", unload)
    res = _manage(cores, "unload", name="a")
    monkeypatch.undo()
    assert res["ok"] is False and res["status"] == 500, res
    assert "unloaded by engine core(s) 0 only" in res["error"], res
    assert [[s[0] for s in state(c)["steers"]] for c in cores] == [[], ["a"]]
    assert _manage(cores, "unload", name="a")["ok"]  # the retry finishes it
    assert [state(c)["steers"] for c in cores] == [[], []]
    for c in cores:
        agree(c)


def test_a_dp_replacement_that_fails_in_its_own_slot_on_one_engine_core_keeps_the_name(
        files):
    """Engine core 1 replaces the name in its own slot (its bank is full) and a worker's put
    fails; engine core 0 replaced it in another slot. Both serve the previous file afterwards,
    and the error says so for each."""
    cores = [management_core(0, capacity=3), management_core(1, capacity=2)]
    assert _manage(cores, "load", name="a", path=files("a"))["ok"]
    assert _manage(cores, "load", name="b", path=files("b"))["ok"]
    cores[1].model_executor.fail("put", 1)
    res = _manage(cores, "load", name="a", path=files("c"))
    assert res["ok"] is False and res["status"] == 500, res
    assert "refused by engine core 1" in res["error"], res
    assert f"steer 'a' serves its previous file {files('a')} again" in res["error"], res
    assert "undone on engine core 0: 'a' serves its previous file there again" in res["error"]
    for c in cores:
        assert {n: f for n, (f, _) in _listed(c).items()} == {"a": files("a"),
                                                              "b": files("b")}
        agree(c, stale_ok=True)
    assert admit(cores[0], "r1", {"a": 1.0}) and admit(cores[1], "r2", {"a": 1.0})


def test_a_dp_roll_back_whose_put_back_fails_unloads_and_says_so(files):
    """Engine core 0 replaced the name (another slot), engine core 1 refused (507): the
    roll-back on engine core 0 reads the previous file again into an empty slot, and a
    worker's put fails there. The new file must not stay bound: the name is unloaded on
    engine core 0, and the error says so (engine core 1 serves the previous file)."""
    cores = [management_core(0, capacity=2), management_core(1, capacity=1)]
    assert _manage(cores, "load", name="a", path=files("a"))["ok"]
    admit(cores[1], "r1", {"a": 1.0})  # engine core 1's only slot is in use
    # the new load's put succeeds; the roll-back's put (the second) fails in worker 1
    real = cores[0].model_executor.collective_rpc
    puts = []

    def collective_rpc(fn, args=()):
        if args[0] == "put":
            puts.append(args[1])
            if len(puts) == 2:
                cores[0].model_executor.fail("put", 1)
        return real(fn, args)
    cores[0].model_executor.collective_rpc = collective_rpc
    res_load = _manage(cores, "load", name="a", path=files("b"))
    assert len(puts) == 2, puts
    assert res_load["ok"] is False and res_load["status"] == 507, res_load
    assert "'a' is unloaded there" in res_load["error"], res_load
    assert "fault injected" in res_load["error"], res_load
    assert "serves its previous file" not in res_load["error"]
    assert _listed(cores[0]) == {}  # not the new file
    assert {n: f for n, (f, _) in _listed(cores[1]).items()} == {"a": files("a")}
    for c in cores:
        agree(c, stale_ok=True)


def test_a_dp_roll_back_that_fails_says_which_engine_core_kept_the_load(files, monkeypatch):
    """The roll-back itself fails on engine core 0 (its unload raises): the answer must not
    claim the load was undone there; it names engine core 0, which keeps the new steer."""
    cores = [management_core(0), management_core(1, capacity=1)]
    assert _manage(cores, "load", name="a", path=files("a"))["ok"]
    registry = engine_state_of(cores[0]).registry

    def unload(*a, **kw):
        raise RuntimeError("fault injected in engine core 0's unload")
    monkeypatch.setattr(registry, "unload", unload)
    res = _manage(cores, "load", name="b", path=files("b"))  # engine core 1 is full: 507
    monkeypatch.undo()
    assert res["ok"] is False and res["status"] == 507, res
    assert "engine core 0 could not undo it" in res["error"], res
    assert "undone on" not in res["error"], res
    assert res["rollback_failed"] == ["0"], res
    assert sorted(_listed(cores[0])) == ["a", "b"] and sorted(_listed(cores[1])) == ["a"]
    listing = _manage(cores, "list")
    assert {s["name"]: s["state"] for s in listing["steers"]} == {"a": "loaded",
                                                                   "b": "partial"}


# ---- a draining slot freed by an admission -------------------------------------------------
def test_a_draining_slot_freed_by_a_first_use_is_emptied_in_the_workers(files, tmp_path):
    """A steer unloaded while a request used it drains; the request finishes; the next
    admission's first-use load frees the draining slot (and takes another, empty one): the
    freed slot is emptied in every worker, not left holding factors no name is bound to."""
    core = management_core(capacity=3, steer_dir=str(tmp_path))
    assert op(core, "load", name="x", path=files("d"))["ok"]  # slot 0
    assert op(core, "load", name="y", path=files("d"))["ok"]  # slot 1
    admit(core, "r1", {"y": 1})
    assert op(core, "unload", name="y")["ok"]  # draining: r1 uses it
    assert op(core, "unload", name="x")["ok"]  # slot 0: freed at once
    core.scheduler.requests.clear()  # r1 finished
    (bound,) = admit(core, "r2", {"c": 1})  # first use: frees slot 1, takes slot 0
    assert bound.bank_slot == 0
    for bank in core.model_executor.banks:
        assert set(bank) == {0}, bank  # slot 1 emptied
    agree(core)


def engine_state_of(core):
    from vllm_steer.integrations.engine.state import engine_state

    return engine_state(core)


def test_a_dp_roll_back_never_reads_a_previous_file_changed_on_disk_since(files):
    """Engine core 0 replaced the name, engine core 1 refused (507): the roll-back would read
    the previous file again, but it was rewritten on disk since it was loaded (same path,
    another steer). Reading it would serve a steer nobody loaded under the name; it is not
    read, the name is unloaded on engine core 0, and the error says why."""
    cores = [management_core(0, capacity=2), management_core(1, capacity=1)]
    assert _manage(cores, "load", name="a", path=files("a"))["ok"]
    admit(cores[1], "r1", {"a": 1.0})  # engine core 1's only slot is in use
    save_steer(files("a"), random_steer(HIDDEN, 2, "a", seed=99))  # rewritten in place
    reads = [op(c, "list")["stats"]["counters"]["file_reads"] for c in cores]
    res = _manage(cores, "load", name="a", path=files("b"))
    assert res["ok"] is False and res["status"] == 507, res
    assert "'a' is unloaded there" in res["error"], res
    assert "was changed on disk since it was loaded" in res["error"], res
    assert _listed(cores[0]) == {}
    assert {n: f for n, (f, _) in _listed(cores[1]).items()} == {"a": files("a")}
    assert [op(c, "list")["stats"]["counters"]["file_reads"] for c in cores] == [
        reads[0] + 1, reads[1]]  # engine core 0 read only the new file
    for c in cores:
        agree(c, stale_ok=True)


def test_a_dp_first_use_loaded_where_there_is_room_is_kept_not_undone(files, tmp_path):
    """Data parallelism, ``--steer-dir``: engine core 1's bank is full of first-use steers its
    running requests use, engine core 0 has room. The request's first use loads the steer on
    engine core 0 and keeps it there (``partial``), read once, instead of undoing it and
    answering 429 after the wait on every try; engine core 1 loads it at its own first use."""
    cores = [management_core(i, capacity=2, steer_dir=str(tmp_path)) for i in (0, 1)]
    for n in ("c", "d"):
        a = op(cores[1], "load", name=n, path=files(n), source="steer-dir")
        cores[1].scheduler.requests[n] = SimpleNamespace(sampling_params=SimpleNamespace(
            extra_args={BOUND_KEY: [[n, a["steer"]["bank_slot"], a["steer"]["load_id"], 1.0]]}))
    for _ in range(3):  # the waiting request asks again
        res = _manage(cores, "load", name="a", path=files("a"), source="steer-dir",
                      protect=["a"])
        assert res["ok"] is True and res["steer"]["name"] == "a", res
    zero = op(cores[0], "list")
    assert [s["name"] for s in zero["steers"]] == ["a"]
    assert zero["stats"]["counters"]["file_reads"] == 1  # read once, never undone
    assert {s["name"] for s in op(cores[1], "list")["steers"]} == {"c", "d"}
    listing = _manage(cores, "list")
    assert {s["name"]: s["state"] for s in listing["steers"]}["a"] == "partial"
    for c in cores:
        agree(c)
