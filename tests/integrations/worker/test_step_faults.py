"""A fault of the plugin's worker code fails only the requests its step steered
(vllm_steer/integrations/worker/step_faults.py, the head's fallback, the per-request state's
guard, and the engine core's scheduler hook in vllm_steer/integrations/engine/worker_faults.py):

- the head whose steer op raises computes exactly the plain logits (vLLM's layer without the
  plugin) for every row, and the step's output names the steered request alone, with a
  message naming vllm-steer, the request and the error;
- a fault putting one request into its slot fails that request alone (wherever the V1 batch
  moves it), leaves its slot unsteered, and a request that asked for no steer is served;
- the list of failed requests survives the pickling that carries a step's output from a
  worker process to the engine core (vLLM's message queue pickles it);
- the scheduler hook finishes a failed request before vLLM reads the step (so none of the
  token sampled for it is served) and answers it with the plugin's error output.
"""

from __future__ import annotations

import pickle
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from helpers.fakes import fake_lm_head

from vllm_steer.integrations.protocol import FAILED_PREFIX, STEP_FAILED_ATTR


@pytest.fixture(scope="module")
def head_cls():
    from vllm.config import VllmConfig, set_current_vllm_config

    from vllm_steer.integrations import plugin

    plugin.register()
    from vllm_steer.integrations.worker.head import SteeredLogitsProcessor

    with set_current_vllm_config(VllmConfig()):
        yield SteeredLogitsProcessor


@pytest.fixture()
def runtime(tmp_path):
    from helpers.steers import random_steer

    from vllm_steer.config import SteerServerConfig
    from vllm_steer.format import save_steer
    from vllm_steer.integrations.worker.gates import GATES
    from vllm_steer.integrations.worker.runtime import SteerRuntime

    path = str(tmp_path / "a.safetensors")
    save_steer(path, random_steer(16, 4, "a", seed=3, scale=3.0))
    before = GATES.worker_faults
    rt = SteerRuntime(SteerServerConfig(steers={"a": path}))
    rt.bank_state.load(16, torch.device("cpu"), torch.float32)
    rt.ensure_slots(4, torch.device("cpu"))
    yield rt
    for slot in range(4):
        rt.set_slot(slot, None)
    rt.slots.flush()
    assert GATES.worker_faults == before  # every recorded fault was taken


def test_a_fault_of_the_steer_op_gives_plain_logits_and_fails_the_steered_request(
        head_cls, runtime):
    from vllm.model_executor.layers.logits_processor import LogitsProcessor

    from vllm_steer.integrations.worker.gates import GATES
    from vllm_steer.integrations.worker.rows import SlotRows

    rt = runtime
    head = head_cls(50)
    head.steer_runtime = rt
    g = torch.Generator().manual_seed(1)
    weight, hidden = torch.randn(50, 16, generator=g), torch.randn(3, 16, generator=g)
    row = np.zeros(rt.slots.num_columns, np.float32)
    row[0] = 5e-3
    rt.set_slot(1, row)  # slot 1 steered; slots 0 and 2 not
    rt.slots.flush()
    rt.step.sampled = SlotRows(slots=np.array([0, 1, 2]), positions=None)
    steered = head(fake_lm_head(weight), hidden)
    plain = LogitsProcessor.forward(head, fake_lm_head(weight), hidden)  # vLLM's layer, no plugin
    assert not torch.equal(steered[1], plain[1]) and torch.equal(steered[0], plain[0])

    def broken(h):
        raise RuntimeError("the op broke")

    head.steer_rows = broken
    gate = GATES.worker_faults
    got = head(fake_lm_head(weight), hidden)
    assert torch.equal(got, plain)  # every row: vLLM's plain logits, bit for bit
    assert GATES.worker_faults == gate + 1 and rt.faults.pending
    failed = rt.faults.take(["r0", "r1", "r2"], None, rt.slots.steered)
    assert list(failed) == ["r1"]
    msg = failed["r1"]
    assert msg.startswith("vllm-steer: internal error in the steered LM head while serving "
                          "request r1: RuntimeError: the op broke"), msg
    assert not rt.faults.pending and GATES.worker_faults == gate
    # the next step is steered again
    head.steer_runtime = rt
    assert torch.equal(head(fake_lm_head(weight), hidden), steered)
    assert not rt.faults.pending


def test_a_fault_while_no_request_is_steered_fails_none_then_or_later(head_cls, runtime,
                                                                       monkeypatch):
    """A drafter's head recorded into CUDA graphs runs its op with no steered request: a
    fault there is logged, and nothing waits for a step output (whose hooks are gated off
    while nothing is steered); a later steered step's requests are not failed for it."""
    from vllm.model_executor.layers.logits_processor import LogitsProcessor

    from vllm_steer.integrations.worker.gates import GATES
    from vllm_steer.integrations.worker.rows import SlotRows

    rt = runtime
    monkeypatch.setattr(GATES, "steered_slots", 0)  # no steered request in the process
    head = head_cls(50)
    head.steer_runtime = rt
    head.steer_in_graphs = True  # as a drafter's head in graphs: the op runs all the same
    g = torch.Generator().manual_seed(2)
    weight, hidden = torch.randn(50, 16, generator=g), torch.randn(2, 16, generator=g)

    def broken(h):
        raise RuntimeError("the op broke")

    head.steer_rows = broken
    gate = GATES.worker_faults
    got = head(fake_lm_head(weight), hidden)
    assert torch.equal(got, LogitsProcessor.forward(head, fake_lm_head(weight), hidden))
    assert not rt.faults.pending and GATES.worker_faults == gate
    monkeypatch.undo()
    row = np.zeros(rt.slots.num_columns, np.float32)
    row[0] = 5e-3
    rt.set_slot(0, row)  # the next step steers slot 0
    rt.slots.flush()
    rt.step.sampled = SlotRows(slots=np.array([0, 1]), positions=None)
    assert rt.faults.take(["r0", "r1"], None, rt.slots.steered) == {}


def test_a_fault_putting_one_request_in_its_slot_fails_that_request_alone(runtime, monkeypatch):
    from helpers.engines import bound_extra

    rt = runtime
    steered = SimpleNamespace(extra_args=bound_extra(["a"], {"a": 4}))
    plain = SimpleNamespace(extra_args=None)
    assert rt.assign(0, steered) is not None and rt.slots.steered[0]

    def broken(*a, **k):
        raise RuntimeError("coefficients broke")

    monkeypatch.setattr(rt.bank_state.bank, "coef_row", broken)
    assert rt.assign(0, steered) is None  # the slot is reset: it keeps nothing steered
    rt.slots.flush()
    assert not rt.slots.steered[0] and not rt.slots.host[0].any()
    assert rt.assign(2, plain) is not None  # asked for no steer: nothing to fail
    rt.faults.move(0, 3, swap=False)  # V1's batch moved the failed request to row 3
    failed = rt.faults.take(["x", "y", "z", "w"], None, rt.slots.steered)
    assert list(failed) == ["w"], failed
    assert "the per-request steer state while serving request w: RuntimeError: " \
           "coefficients broke" in failed["w"]
    # V2: requests in any order, each with its own slot
    assert rt.assign(1, steered) is None
    failed = rt.faults.take(["p", "q"], [3, 1], rt.slots.steered)
    assert list(failed) == ["q"]


def test_a_fault_half_way_into_a_fresh_slot_leaves_nothing_for_the_next_request(runtime,
                                                                              monkeypatch):
    """A fault after the slot's row was written but before it was marked steered (here: its
    generation window): the slot is reset all the same, so the next request put into it,
    one asking for no steer, gets plain logits from the head (plain torch: ``h`` itself)."""
    from helpers.engines import bound_extra
    from helpers.rows import sampled_rows

    from vllm_steer.integrations.worker.request_slots import RequestSlots
    from vllm_steer.integrations.worker.rows import SlotRows

    rt = runtime
    windowed = SimpleNamespace(extra_args=bound_extra(["a"], {"a": {"strength": 5, "start": 0,
                                                                   "end": 4}}))

    def broken(*a, **k):
        raise RuntimeError("window broke")

    with monkeypatch.context() as m:
        m.setattr(RequestSlots, "_set_windows", broken)
        assert rt.assign(3, windowed) is None
    assert "window broke" in rt.faults.take(["w0", "w1", "w2", "w3"], None,
                                            rt.slots.steered)["w3"]
    assert rt.assign(3, SimpleNamespace(extra_args=None)) is not None  # asks for no steer
    rt.slots.flush()
    assert not rt.slots.host[3].any() and not rt.slots.table[3].any()
    assert rt.assign(0, SimpleNamespace(extra_args=bound_extra(["a"], {"a": 4}))) is not None
    rt.slots.flush()  # another request steered in the step: the op runs
    h = torch.randn(2, 16, generator=torch.Generator().manual_seed(0))
    with sampled_rows(rt.planner, SlotRows(slots=np.array([3, 0]))):
        out = rt.planner.steer_rows(h)
    assert torch.equal(out[0], h[0]) and not torch.equal(out[1], h[1])


def test_the_failed_requests_survive_the_outputs_trip_between_processes():
    from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, ModelRunnerOutput

    from vllm_steer.integrations.worker.step_faults import attach

    out = ModelRunnerOutput(req_ids=["a", "b"], req_id_to_index={"a": 0, "b": 1},
                            sampled_token_ids=[[1], [2]])
    attach(out, {"b": "vllm-steer: ..."})
    back = pickle.loads(pickle.dumps(out, protocol=pickle.HIGHEST_PROTOCOL))
    assert getattr(back, STEP_FAILED_ATTR) == {"b": "vllm-steer: ..."}
    attach(EMPTY_MODEL_RUNNER_OUTPUT, {"b": "x"})  # vLLM's shared empty output: never
    assert not hasattr(EMPTY_MODEL_RUNNER_OUTPUT, STEP_FAILED_ATTR)


class _Scheduler:
    """What the hook reads of vLLM's Scheduler: its requests, ``finish_requests``."""

    def __init__(self, requests):
        self.requests = requests
        self.finished = []

    def finish_requests(self, ids, status):
        for rid in ids:
            self.requests[rid].status = status
            self.finished.append(rid)


class _Request(SimpleNamespace):
    def is_finished(self):
        from vllm.v1.request import RequestStatus

        return self.status > RequestStatus.PREEMPTED


def test_the_scheduler_finishes_a_failed_request_before_reading_the_step():
    from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs, FinishReason
    from vllm.v1.request import RequestStatus

    from vllm_steer.integrations.engine.worker_faults import update_from_output

    reqs = {rid: _Request(request_id=rid, client_index=ci, status=RequestStatus.RUNNING)
            for rid, ci in (("a", 0), ("b", 0), ("c", 1))}
    sched = _Scheduler(reqs)
    seen = {}

    def orig(self, so, mro):  # vLLM's: serves a token to every request still running
        seen.update({rid: r.is_finished() for rid, r in self.requests.items()})
        return {0: EngineCoreOutputs(outputs=[EngineCoreOutput(r, [7]) for r in ("a", "b")
                                              if not self.requests[r].is_finished()])}

    out = SimpleNamespace(req_ids=["a", "b", "c"])
    plain = update_from_output(orig, sched, None, out)  # no fault: vLLM's answer as it is
    assert [o.request_id for o in plain[0].outputs] == ["a", "b"] and sched.finished == []
    setattr(out, STEP_FAILED_ATTR, {"b": "vllm-steer: internal error (b)",
                                    "c": "vllm-steer: internal error (c)"})
    got = update_from_output(orig, sched, None, out)
    assert seen == {"a": False, "b": True, "c": True}  # finished before vLLM read the step
    assert sched.finished == ["b", "c"]
    assert reqs["b"].status == RequestStatus.FINISHED_ERROR
    by_id = {o.request_id: o for eco in got.values() for o in eco.outputs}
    assert by_id["a"].new_token_ids == [7]
    for rid, client in (("b", 0), ("c", 1)):
        o = by_id[rid]
        assert o in got[client].outputs and o.new_token_ids == []
        assert o.finish_reason == FinishReason.ERROR
        assert o.stop_reason == f"{FAILED_PREFIX}vllm-steer: internal error ({rid})"
