"""Every hook of the plugin's that runs inside vLLM's step is guarded
(vllm_steer/integrations/worker/step_faults.py): an exception of the plugin's code there, or
of the vLLM objects it reads, never leaves vLLM's step (it would end the engine core and fail
every request, steered or not). At each such point the callee is made to raise, and the
step goes on as vLLM's without the plugin: its rows get vLLM's plain output, bit for bit,
and the step's output names the steered request alone, with the plugin's message (where the
fault happened, the request, the error); the next step is served as before. Points: the V1
speculative step's verification rows (``_calc_spec_decode_metadata``), V2's batch-sharded
rows in ``sample()`` and ``BatchSharder.shard_sampler_inputs`` (a vLLM that returns another
layout included), the per-request state's copy of the slots to the device (V1 and V2, a
first steered request included), the prompt-logprob hooks of both runners and the model's
``compute_logits`` as they wrap it. A V2 step sampled without the head, and a V2 steady
step whose request ids cannot be read: test_v2.py.
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from helpers.fakes import VllmObject, v1_spec_runner_class
from helpers.steers import random_steer
from vllm_steer.format import save_steer
from vllm_steer.integrations import vllm_access
from vllm_steer.integrations.worker import spec_v1, v1, v2
from vllm_steer.integrations.worker.gates import GATES
from vllm_steer.integrations.worker.rows import NO_ROWS
from vllm_steer.integrations.worker.runtime import BINDINGS, V1RunnerBinding, get_runtime
from vllm_steer.kernels import staging

pytest.importorskip("vllm")

HIDDEN = 32
ROWS_FAULT = "vllm-steer: internal error in the step's row mapping while serving request "
STATE_FAULT = "vllm-steer: internal error in the per-request steer state while serving request "


def _broken(*_a, **_k):
    raise RuntimeError("the callee broke")


@pytest.fixture
def runtime(tmp_path):
    """A runtime with steer ``a`` (hidden 32) and 4 request slots, slot 1 steered (strength 4);
    every fault recorded must have been taken by the end."""
    path = str(tmp_path / "a.safetensors")
    save_steer(path, random_steer(HIDDEN, 4, "a", seed=3, scale=3.0))
    rt = get_runtime({"vllm_steer": {"steers": {"a": path}, "max_strength": 10}})
    rt.bank_state.load(HIDDEN, torch.device("cpu"), torch.float32)
    rt.ensure_slots(4, torch.device("cpu"))
    faults = GATES.worker_faults
    yield rt
    assert not rt.faults.pending and GATES.worker_faults == faults
    for slot in range(4):
        rt.set_slot(slot, None)
    rt.slots.flush()


def _steer(rt, slot: int, strength: float = 4e-3, prompt_logprobs: bool = False):
    row = np.zeros(rt.slots.num_columns, np.float32)
    row[0] = strength
    rt.set_slot(slot, row, prompt_logprobs=prompt_logprobs)
    rt.slots.flush()
    return row


def _failed(rt, req_ids, slots=None):
    """The step's output: ``{request id: message}`` of the requests that fail."""
    return rt.faults.take(req_ids, slots, rt.slots.steered)


# ---- V1: speculative decoding's verification rows ------------------------------------------

def test_a_fault_mapping_the_verification_rows_leaves_the_step_unsteered(runtime, monkeypatch):
    from vllm_steer.integrations.hooks import wrap_method

    rt = runtime
    _steer(rt, 0)  # slot 0 steered, slot 1 not

    Runner = v1_spec_runner_class()  # 2 requests, 2 and 0 draft tokens
    wrap_method(Runner, "_calc_spec_decode_metadata", spec_v1.calc_spec_decode_metadata)
    runner = Runner()
    binding = V1RunnerBinding(rt)
    BINDINGS.set(runner, binding)
    monkeypatch.setattr(GATES, "speculative_runtimes", GATES.speculative_runtimes + 1)
    assert v1.prepare_inputs(Runner._prepare_inputs, runner, None, np.array([3, 1])) == "meta"
    assert rt.step.sampled.slots.tolist() == [0, 0, 0, 1]  # mapped as ever
    monkeypatch.setattr(spec_v1, "v1_token_counts", _broken)
    assert v1.prepare_inputs(Runner._prepare_inputs, runner, None, np.array([3, 1])) == "meta"
    assert rt.step.sampled is NO_ROWS  # not the batch's rows: those are not the step's
    failed = _failed(rt, ["r0", "r1"])
    assert list(failed) == ["r0"]
    assert failed["r0"].startswith(ROWS_FAULT + "r0: RuntimeError: the callee broke"), failed


# ---- V2: sample() -----------------------------------------------------------------------------

class _Sharder:
    """V2's ``BatchSharder`` as the hook sees it: its rows sorted by owner (here reversed)."""

    def __init__(self, layout: int = 4):
        self.layout = layout

    def shard_sampler_inputs(self, input_batch):
        order = torch.arange(input_batch.num_reqs - 1, -1, -1)
        return (input_batch, order, None, None)[: self.layout]


def _v2_runner(rt, sharder=None):
    """V2's runner: ``sample()`` computes the logits (here: the head's output) of its rows,
    owner-sorted through the sharder under batch-sharded sampling."""
    from vllm_steer.integrations.hooks import wrap_method

    class Runner:
        vllm_config = None
        batch_sharder = sharder

        def sample(self, hidden_states, input_batch, grammar_output):
            if self.batch_sharder is not None:
                out = self.batch_sharder.shard_sampler_inputs(input_batch)
                hidden_states = hidden_states[torch.arange(input_batch.num_reqs - 1, -1, -1)]
                del out
            return rt.planner.steer_rows(hidden_states).clone()

    wrap_method(Runner, "sample", v2.sample)
    if sharder is not None:
        wrap_method(type(sharder), "shard_sampler_inputs", v2.shard_sampler_inputs)
    runner = Runner()
    from vllm_steer.integrations.worker.runtime import V2RunnerBinding

    BINDINGS.set(runner, V2RunnerBinding(rt))
    return runner


def _v2_batch(slots):
    n = len(slots)
    return SimpleNamespace(num_reqs=n, idx_mapping_np=np.asarray(slots),
                           expanded_idx_mapping=torch.tensor(slots),
                           query_start_loc_np=np.arange(n + 1),
                           cu_num_logits_np=np.arange(n + 1), req_ids=[f"r{s}" for s in slots])


@pytest.mark.parametrize("where", ["sample", "layout", "index"])
def test_a_fault_mapping_batch_sharded_rows_leaves_the_step_unsteered(runtime, monkeypatch,
                                                                      where):
    rt = runtime
    _steer(rt, 1)
    sharder = _Sharder()
    runner = _v2_runner(rt, sharder)
    batch = _v2_batch([1, 2])
    h = torch.randn(2, HIDDEN, generator=torch.Generator().manual_seed(0))
    plain = h.flip(0)  # the sorted rows: slot 2's, then slot 1's
    steered = runner.sample(h, batch, None)
    assert torch.equal(steered[0], plain[0]) and not torch.equal(steered[1], plain[1])
    if where == "sample":  # the step's token slots, read in sample()
        monkeypatch.setattr(vllm_access, "v2_token_slots", _broken)
    elif where == "layout":  # a vLLM whose sharder returns another layout
        sharder.layout = 3
    else:  # each token's table row, written to the device
        monkeypatch.setattr(rt.planner, "sharded_index", _broken)
    got = runner.sample(h, batch, None)
    assert torch.equal(got, plain)  # every row: vLLM's plain output
    assert not v2._SHARDING
    failed = _failed(rt, ["r1", "r2"], [1, 2])
    assert list(failed) == ["r1"], failed
    assert failed["r1"].startswith(ROWS_FAULT + "r1: RuntimeError: "), failed
    if where == "layout":  # the message says what moved and what to do
        assert "no longer returns (batch, sorted_logits_indices" in failed["r1"]
        assert "--enable-batch-sharded-sampling" in failed["r1"]
    monkeypatch.undo()
    sharder.layout = 4
    assert torch.equal(runner.sample(h, batch, None), steered)  # the next step is steered
    assert not rt.faults.pending


# ---- the per-request state's copy to the device ----------------------------------------------

@contextlib.contextmanager
def _alone_in_the_process():
    """No other steered slot counted in the process while the block runs (as in a server
    whose first steered request arrives)."""
    base = GATES.steered_slots
    GATES.steered_slots -= base
    try:
        yield
    finally:
        GATES.steered_slots += base


def test_a_fault_copying_v1_slots_to_the_device_fails_the_steered_request(runtime,
                                                                           monkeypatch):
    from helpers.engines import bound_extra

    from vllm_steer.integrations.request_state_v1 import SteerRequestStateV1

    rt = runtime
    proc = object.__new__(SteerRequestStateV1)
    proc.runtime = rt
    steered = SimpleNamespace(extra_args=bound_extra(["a"], {"a": 4}))
    plain = SimpleNamespace(extra_args=None)
    update = SimpleNamespace(batch_size=2, removed=[], moved=[],
                             added=[(0, steered, None, None), (1, plain, None, None)])
    with _alone_in_the_process():  # the first steered request of the server
        monkeypatch.setattr(staging.StagedCopy, "copy_", _broken)
        proc.update_state(update)  # no exception leaves vLLM's step
        assert GATES.steered_slots == 1
        failed = _failed(rt, ["r0", "r1"])
        assert list(failed) == ["r0"], failed
        assert failed["r0"].startswith(STATE_FAULT + "r0: RuntimeError: the callee broke")
        monkeypatch.undo()
        proc.update_state(SimpleNamespace(batch_size=2, removed=[0], added=[], moved=[]))
        assert not rt.faults.pending and not rt.slots.table.any()  # copied at the next step
        assert GATES.steered_slots == 0


def test_a_fault_copying_v2_slots_to_the_device_fails_the_steered_request(runtime,
                                                                           monkeypatch):
    from helpers.engines import bound_extra
    from vllm import SamplingParams

    from vllm_steer.integrations.request_state_v2 import SteerRequestStateV2

    rt = runtime
    proc = object.__new__(SteerRequestStateV2)
    proc.runtime, proc.slots, proc.declare_steered = rt, rt.slots, False
    with _alone_in_the_process():
        proc.add_request(2, SamplingParams(extra_args=bound_extra(["a"], {"a": 4})))
        proc.add_request(3, SamplingParams())
        monkeypatch.setattr(staging.StagedCopy, "copy_", _broken)
        proc.apply_staged_writes()  # no exception leaves vLLM's step
        failed = _failed(rt, ["r3", "r2"], [3, 2])
        assert list(failed) == ["r2"], failed
        assert failed["r2"].startswith(STATE_FAULT + "r2: RuntimeError: the callee broke")
        monkeypatch.undo()
        proc.apply_staged_writes()  # the next step copies it
        assert rt.slots.table[2, 0] == pytest.approx(4e-3) and not rt.faults.pending
        proc.add_request(2, SamplingParams())
        proc.apply_staged_writes()


# ---- prompt logprobs --------------------------------------------------------------------------

class _Model:
    def __init__(self, rt):
        self.rt = rt

    def compute_logits(self, hidden):
        return self.rt.planner.steer_rows(hidden).clone()


@pytest.mark.parametrize("where", ["rows", "model"])
def test_a_fault_preparing_v1_prompt_rows_leaves_them_unsteered(runtime, monkeypatch, where):
    rt = runtime
    _steer(rt, 0, prompt_logprobs=True)
    rt.step.batch_size = 2
    qsl = [0, 3, 5]
    runner = VllmObject(num_prompt_logprobs={"r0": 1}, input_batch=VllmObject(num_reqs=2),
                        query_start_loc=VllmObject(np=np.asarray(qsl)), model=_Model(rt))
    BINDINGS.set(runner, V1RunnerBinding(rt))
    h = torch.randn(5, HIDDEN, generator=torch.Generator().manual_seed(3))
    seen = []

    def orig(self, hidden_states, num_scheduled_tokens):  # vLLM's: one call per request
        seen.append(rt.step.prompt)
        return [self.model.compute_logits(hidden_states[a:b]) for a, b in ((0, 3), (3, 5))]

    steered = v1.get_prompt_logprobs_dict(orig, runner, h, {"r0": 3, "r1": 2})
    assert not torch.equal(steered[0], h[:3]) and torch.equal(steered[1], h[3:])
    if where == "rows":
        monkeypatch.setattr(v1, "v1_query_start_loc", _broken)
    else:  # the model's compute_logits cannot be replaced
        @contextlib.contextmanager
        def unreplaceable(runner, wrap):
            raise RuntimeError("the callee broke")
            yield

        monkeypatch.setattr(v1, "v1_model_compute_logits", unreplaceable)
    got = v1.get_prompt_logprobs_dict(orig, runner, h, {"r0": 3, "r1": 2})
    assert torch.equal(got[0], h[:3]) and torch.equal(got[1], h[3:])  # vLLM's own
    # vLLM's call with no prompt row steered: never read as the batch's sampled rows
    assert seen[-1] is NO_ROWS and rt.step.prompt is None
    failed = _failed(rt, ["r0", "r1"])
    assert list(failed) == ["r0"]
    assert failed["r0"].startswith(ROWS_FAULT + "r0: RuntimeError: the callee broke")


def _v2_prompt_step(rt):
    """A V2 prompt-logprob step: ``(worker, hidden states, input batch)``, two requests of 3
    and 2 tokens in slots 1 (steered, asking for prompt logprobs as ``r1``) and 0."""
    _steer(rt, 1, prompt_logprobs=True)
    batch = SimpleNamespace(num_reqs=2, idx_mapping_np=np.array([1, 0]),
                            query_start_loc_np=np.array([0, 3, 5]))
    worker = SimpleNamespace(in_progress_prompt_logprobs={"r1": []})
    h = torch.randn(5, HIDDEN, generator=torch.Generator().manual_seed(4))
    return worker, h, batch


def test_a_fault_finding_a_prompt_calls_rows_fails_the_steered_request_not_the_step(
        runtime, monkeypatch):
    """The model's ``compute_logits`` as the prompt-logprob hooks wrap it finds the call's rows
    by their address before vLLM's own call: a fault there (a tensor without a readable
    storage) does not escape vLLM's call. The head meets it again, under its guard: every row
    gets vLLM's plain logits and the steered request alone fails, naming the head."""
    from vllm_steer.integrations.worker import head, rows

    rt = runtime
    worker, h, batch = _v2_prompt_step(rt)

    def orig(self, logits_fn, hidden_states, input_batch):
        return torch.cat([logits_fn(hidden_states[a:a + 2]) for a in range(0, 5, 2)])

    def logits_fn(x):  # the model's compute_logits: the head steers, under its guard
        try:
            return rt.planner.steer_rows(x).clone()
        except Exception as e:
            head.step_fault(rt, x, e)
            return x.clone()

    with monkeypatch.context() as m:
        m.setattr(v2, "current_runtime", lambda: rt)
        steered = v2.prompt_logprobs(orig, worker, logits_fn, h, batch)
        assert not torch.equal(steered[:3], h[:3]) and torch.equal(steered[3:], h[3:])
        m.setattr(rows.PromptRows, "offset_of", _broken)
        got = v2.prompt_logprobs(orig, worker, logits_fn, h, batch)
    assert torch.equal(got, h)  # vLLM's own
    failed = _failed(rt, ["r1", "r0"], [1, 0])
    assert list(failed) == ["r1"]
    assert failed["r1"].startswith("vllm-steer: internal error in the steered LM head while "
                                   "serving request r1: RuntimeError: the callee broke")
    assert torch.equal(v2.prompt_logprobs(orig, worker, logits_fn, h, batch), steered)


def test_a_fault_preparing_v2_prompt_rows_leaves_them_unsteered(runtime, monkeypatch):
    rt = runtime
    worker, h, batch = _v2_prompt_step(rt)
    seen = []

    def orig(self, logits_fn, hidden_states, input_batch):
        seen.append(rt.step.prompt)
        return logits_fn(hidden_states)

    def logits_fn(x):
        return rt.planner.steer_rows(x).clone()

    with monkeypatch.context() as m:
        m.setattr(v2, "current_runtime", lambda: rt)
        steered = v2.prompt_logprobs(orig, worker, logits_fn, h, batch)
        assert not torch.equal(steered[:3], h[:3]) and torch.equal(steered[3:], h[3:])
        m.setattr(vllm_access, "v2_token_slots", _broken)
        got = v2.prompt_logprobs(orig, worker, logits_fn, h, batch)
    assert torch.equal(got, h)  # vLLM's own
    assert seen[-1] is NO_ROWS and rt.step.prompt is None
    failed = _failed(rt, ["r1", "r0"], [1, 0])
    assert list(failed) == ["r1"]
    assert failed["r1"].startswith(ROWS_FAULT + "r1: RuntimeError: the callee broke")


