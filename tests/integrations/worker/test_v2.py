"""Model Runner V2 integration, driven through vLLM's own V2 interfaces with real objects.

The live V2 engine is tested in tests/e2e/test_vllm_v2.py (through the tests/v2shim harness);
this drives the pieces vLLM itself calls, one at a time: the V2 loader and params validator,
``add_request(slot, params)`` with slot reuse, ``apply_staged_writes()``, a step's real
``InputBatch`` whose ``expanded_idx_mapping`` the wrapped ``sample()`` scopes around the
LM-head call, stale slots of finished requests, and batch-sharded sampling (TP > 1) through
vLLM's real ``GPUModelRunner.sample`` and shard plan.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from helpers.engines import v2_runner_env
from helpers.v2_state import V2_FQCN, v2_request_state, v2_steer_config
from vllm_steer.reference import steer_reference, steered_logits_reference


@pytest.fixture(scope="module")
def vllm_config(tiny_model_dir, tmp_path_factory):
    return v2_steer_config(tiny_model_dir, tmp_path_factory.mktemp("v2"))


@pytest.fixture()
def processor(vllm_config):
    return v2_request_state(vllm_config)


def _params(steer=None):
    """A request's params as they reach the worker: the steers bound by the engine core to the
    fixture's runtime (steers a, b in slots 0, 1)."""
    from vllm import SamplingParams

    from helpers.engines import bound_extra

    return SamplingParams(extra_args=bound_extra(["a", "b"], steer) or None)


def test_v2_loader_accepts_the_processor_and_validator_rejects_bad_requests(vllm_config):
    from vllm.exceptions import VLLMValidationError
    from vllm.v1.worker.gpu.sample.logits_processor import (
        LogitsProcessor, build_custom_logits_processors_params_validator,
    )

    from vllm_steer.integrations.request_state_v2 import SteerRequestStateV2

    assert issubclass(SteerRequestStateV2, LogitsProcessor)
    validate = build_custom_logits_processors_params_validator([V2_FQCN])
    validate(_params({"a": 5, "b": -10}))
    validate(_params())
    with pytest.raises(VLLMValidationError, match="unknown steer 'c'"):
        validate(_params({"c": 1}))
    with pytest.raises(VLLMValidationError, match="exceeds the server's maximum"):
        validate(_params({"a": 11}))


def test_steered_requests_declare_logits_processing_only_where_a_greedy_fast_path_exists(
        vllm_config, monkeypatch):
    """vLLM 0.32 has no greedy fast path: declaring would cost an fp32 logits copy per step, so
    nothing is declared. A vLLM with one (the module exists) gets steered requests declared,
    unsteered ones not."""
    from vllm_steer.integrations import request_state_v2

    assert not request_state_v2.has_greedy_fast_path()
    monkeypatch.setattr(request_state_v2, "GREEDY_FAST_PATH_MODULE",
                        "vllm.v1.worker.gpu.sample.sampler")
    assert request_state_v2.has_greedy_fast_path()
    proc = v2_request_state(vllm_config)
    assert proc.add_request(1, _params({"a": 5})) is True
    assert proc.add_request(2, _params()) is False
    assert proc.add_request(1, _params()) is False  # the slot reused by an unsteered request


def test_slots_are_fully_reset_when_reused(processor):
    rt = processor.runtime
    assert processor.add_request(3, _params({"a": 5, "b": 2})) is False  # apply() not needed
    processor.apply_staged_writes()
    assert rt.slots.table[3, :2].tolist() == pytest.approx([5e-3, 2e-3])  # slots of a, b
    assert not rt.slots.table[3, 2:].any()
    assert rt.slots.num_active_slots
    processor.add_request(3, _params())  # a new request in the same slot, unsteered
    processor.apply_staged_writes()
    assert not rt.slots.table[3].any() and not rt.slots.num_active_slots


def test_wrapped_sample_maps_rows_to_slots_through_expanded_idx_mapping(processor, vllm_config):
    from vllm.v1.worker.gpu.input_batch import InputBatch, InputBuffers

    from vllm_steer.integrations.hooks import wrap_method
    from vllm_steer.integrations.worker import v2

    rt = processor.runtime
    # resolved (kernels imported) at load, not in a request's step
    assert rt.bank_state.backend == "torch"
    processor.add_request(0, _params({"a": 4}))
    processor.add_request(5, _params({"b": -3}))
    processor.add_request(2, _params())
    processor.apply_staged_writes()

    batch = InputBatch.make_dummy(3, 3, InputBuffers(8, 64, torch.device("cpu")))
    batch.idx_mapping_np = np.array([5, 2, 0])  # the step's requests -> slots
    batch.expanded_idx_mapping = torch.tensor([5, 2, 0], dtype=torch.int32)  # rows -> slots

    class Runner:  # stands in for V2's GPUModelRunner: sample() calls the LM head
        def sample(self, hidden_states, input_batch, grammar_output):
            return rt.planner.steer_rows(hidden_states)

    Runner.vllm_config = vllm_config
    wrap_method(Runner, "sample", v2.sample)
    h = torch.randn(3, 64)
    out = Runner().sample(h, batch, None)
    coefs = torch.zeros(3, rt.slots.num_columns)  # one column per steer slot: a, b first
    coefs[:, :2] = torch.tensor([[0.0, -3e-3], [0.0, 0.0], [4e-3, 0.0]])
    want = steer_reference(h, *rt.bank_state.bank.factors, coefs)
    torch.testing.assert_close(out, want)
    assert torch.equal(out[1], h[1])
    # outside sample() (e.g. V2 prompt logprobs) rows have no slot: left unsteered
    assert torch.equal(rt.planner.steer_rows(h), h)



def test_sample_reads_input_batch_by_name_however_it_is_passed(processor, vllm_config):
    """``sample()``'s ``input_batch`` is found by name: at the position its signature gives
    (also behind a parameter a newer vLLM added before it), kept for the next steps, and by
    keyword when a call passes it so. Every step is steered with its own batch's rows."""
    from vllm.v1.worker.gpu.input_batch import InputBatch, InputBuffers

    from vllm_steer.integrations.hooks import wrap_method
    from vllm_steer.integrations.worker import v2

    rt = processor.runtime
    processor.add_request(1, _params({"a": 3}))
    processor.add_request(4, _params({"b": 5}))
    processor.apply_staged_writes()
    strengths = {1: (3e-3, 0.0), 4: (0.0, 5e-3)}

    class Runner:  # a vLLM whose sample() gained a parameter before input_batch
        def sample(self, hidden_states, new_param, input_batch, grammar_output=None):
            return rt.planner.steer_rows(hidden_states)

    Runner.vllm_config = vllm_config
    wrap_method(Runner, "sample", v2.sample)
    runner = Runner()

    def batch_of(slots):
        batch = InputBatch.make_dummy(len(slots), len(slots),
                                      InputBuffers(8, 64, torch.device("cpu")))
        batch.idx_mapping_np = np.array(slots, dtype=np.int32)
        batch.expanded_idx_mapping = torch.tensor(slots, dtype=torch.int32)
        return batch

    calls = [lambda h, b: runner.sample(h, None, b, None),  # positional: position found
             lambda h, b: runner.sample(h, None, b),  # positional again: position kept
             lambda h, b: runner.sample(h, None, input_batch=b),  # by keyword
             lambda h, b: runner.sample(hidden_states=h, new_param=None, input_batch=b),
             lambda h, b: runner.sample(h, None, b, None)]
    for call, slots in zip(calls, ([1, 4], [4, 1], [4], [1], [1, 4]), strict=True):
        h = torch.randn(len(slots), 64)
        out = call(h, batch_of(slots))
        coefs = torch.zeros(len(slots), rt.slots.num_columns)
        coefs[:, :2] = torch.tensor([strengths[s] for s in slots])
        torch.testing.assert_close(out, steer_reference(h, *rt.bank_state.bank.factors, coefs))
    assert v2._BINDINGS_BY_ID[id(runner)].sample_batch_at == 2  # h, new_param, input_batch


def test_a_keyword_only_input_batch_is_read_by_name_at_every_step(processor, vllm_config):
    """A vLLM whose ``sample()`` takes ``input_batch`` keyword-only: each steered step reads
    it by name (never a positional argument in its place), steered as the reference says."""
    from vllm.v1.worker.gpu.input_batch import InputBatch, InputBuffers

    from vllm_steer.integrations.hooks import wrap_method
    from vllm_steer.integrations.worker import v2

    rt = processor.runtime
    processor.add_request(3, _params({"a": -2}))
    processor.add_request(6, _params({"b": 4}))
    processor.apply_staged_writes()
    strengths = {3: (-2e-3, 0.0), 6: (0.0, 4e-3)}

    class Runner:
        def sample(self, hidden_states, extra=None, *, input_batch, grammar_output=None):
            return rt.planner.steer_rows(hidden_states)

    Runner.vllm_config = vllm_config
    wrap_method(Runner, "sample", v2.sample)
    runner = Runner()
    for slots in ([3, 6], [6], [6, 3]):
        batch = InputBatch.make_dummy(len(slots), len(slots),
                                      InputBuffers(8, 64, torch.device("cpu")))
        batch.idx_mapping_np = np.array(slots, dtype=np.int32)
        batch.expanded_idx_mapping = torch.tensor(slots, dtype=torch.int32)
        h = torch.randn(len(slots), 64)
        out = runner.sample(h, "not the batch", input_batch=batch)
        coefs = torch.zeros(len(slots), rt.slots.num_columns)
        coefs[:, :2] = torch.tensor([strengths[s] for s in slots])
        torch.testing.assert_close(out, steer_reference(h, *rt.bank_state.bank.factors, coefs))
    assert v2._BINDINGS_BY_ID[id(runner)].sample_batch_at > 2  # past any call's arguments


def test_steady_steps_reuse_their_rows_and_every_change_maps_them_again(processor, vllm_config,
                                                                         monkeypatch):
    """Decode steps of an unchanged batch map their rows once (V2 gives a new ``InputBatch``
    each step; the same request ids in the same order, with no request added since, say it is
    the same batch). A request that takes a slot, a batch of other requests, a batch with no
    steered request, the same batch back, and a new request under a finished one's id in
    another slot are each served with their own coefficients (against the reference)."""
    from vllm.v1.worker.gpu.input_batch import InputBatch, InputBuffers

    from vllm_steer.integrations.hooks import wrap_method
    from vllm_steer.integrations.worker import v2

    rt = processor.runtime
    processor.add_request(0, _params({"a": 4}))
    processor.add_request(5, _params({"b": -3}))
    processor.add_request(2, _params())
    processor.apply_staged_writes()
    mapped = []
    host_rows = v2._host_rows
    monkeypatch.setattr(v2, "_host_rows", lambda *a: mapped.append(1) or host_rows(*a))

    class Runner:
        def sample(self, hidden_states, input_batch, grammar_output):
            return rt.planner.steer_rows(hidden_states)

    Runner.vllm_config = vllm_config
    wrap_method(Runner, "sample", v2.sample)
    runner = Runner()
    strengths = {0: (4e-3, 0.0), 5: (0.0, -3e-3), 2: (0.0, 0.0)}

    ids = {0: "r0", 5: "r5", 2: "r2"}  # each slot's request id

    def step(slots):
        batch = InputBatch.make_dummy(len(slots), len(slots),
                                      InputBuffers(8, 64, torch.device("cpu")))
        batch.idx_mapping_np = np.array(slots, dtype=np.int32)
        batch.expanded_idx_mapping = torch.tensor(slots, dtype=torch.int32)
        batch.req_ids = [ids[s] for s in slots]  # a new list of the same ids, as V2 makes it
        h = torch.randn(len(slots), 64)
        out = runner.sample(h, batch, None)
        coefs = torch.zeros(len(slots), rt.slots.num_columns)
        coefs[:, :2] = torch.tensor([strengths[s] for s in slots])
        torch.testing.assert_close(out, steer_reference(h, *rt.bank_state.bank.factors, coefs))
        n, mapped[:] = len(mapped), []
        return n

    assert [step([5, 2, 0]) for _ in range(3)] == [1, 0, 0]
    processor.add_request(5, _params({"a": 2}))  # a new request takes slot 5
    processor.apply_staged_writes()
    strengths[5] = (2e-3, 0.0)
    ids[5] = "r5b"
    assert [step([5, 2, 0]) for _ in range(2)] == [1, 0]
    assert [step([2, 0]) for _ in range(2)] == [1, 0]  # the request in slot 5 finished
    assert step([2]) == 0  # no steered request in the batch: nothing mapped, nothing steered
    assert [step([2, 0]) for _ in range(2)] == [1, 0]
    # the steered request "r0" finishes; a plain request under the same id takes slot 7 at once,
    # in the same place in the batch: same ids, other slots (its slot 0 keeps its steer)
    processor.add_request(7, _params())
    processor.apply_staged_writes()
    ids[7], strengths[7] = "r0", (0.0, 0.0)
    assert [step([2, 7]) for _ in range(2)] == [0, 0]  # no steered request in the batch
    processor.add_request(7, _params({"b": 1}))  # and once more, steered, into the same slot
    processor.apply_staged_writes()
    strengths[7] = (0.0, 1e-3)
    assert [step([2, 7]) for _ in range(2)] == [1, 0]

    # a steady step whose request ids cannot be read (a vLLM object unlike the declared one)
    # is mapped again, under the fault guard: nothing escapes vLLM's step, every row gets the
    # plain hidden states, the steered request alone fails; the next step is served again
    class Unreadable(InputBatch):
        @property
        def req_ids(self):
            raise RuntimeError("the callee broke")

    batch = InputBatch.make_dummy(2, 2, InputBuffers(8, 64, torch.device("cpu")))
    batch.idx_mapping_np = np.array([2, 7], dtype=np.int32)
    batch.expanded_idx_mapping = torch.tensor([2, 7], dtype=torch.int32)
    batch.__class__ = Unreadable
    h = torch.randn(2, 64)
    assert torch.equal(runner.sample(h, batch, None), h)
    failed = rt.faults.take(["r2", "r7"], [2, 7], rt.slots.steered)
    assert list(failed) == ["r7"] and "RuntimeError: the callee broke" in failed["r7"]
    mapped[:] = []
    assert [step([2, 7]) for _ in range(2)] == [1, 0]


def test_a_finished_requests_stale_slot_costs_no_steer_work(processor, vllm_config):
    """V2 never tells a request left: its slot keeps its steer until reused. A step whose batch
    does not contain that slot must not run the steer op."""
    from vllm.v1.worker.gpu.input_batch import InputBatch, InputBuffers

    from vllm_steer.integrations.hooks import wrap_method
    from vllm_steer.integrations.worker import v2

    rt = processor.runtime
    processor.add_request(6, _params({"a": 4}))  # finished; slot 6 not reused yet
    processor.add_request(1, _params())
    processor.apply_staged_writes()
    batch = InputBatch.make_dummy(1, 1, InputBuffers(8, 64, torch.device("cpu")))
    batch.idx_mapping_np = np.array([1])
    batch.expanded_idx_mapping = torch.tensor([1])

    class Runner:
        def sample(self, hidden_states, input_batch, grammar_output):
            assert not rt.planner.active  # the head's check: nothing to do for these rows
            return rt.planner.steer_rows(hidden_states)

    Runner.vllm_config = vllm_config
    wrap_method(Runner, "sample", v2.sample)
    calls = rt.planner.stats.calls
    h = torch.randn(1, 64)
    assert torch.equal(Runner().sample(h, batch, None), h)
    assert rt.planner.stats.calls == calls
    batch.idx_mapping_np = np.array([1, 6])  # the steered slot is in the step again: steered
    batch.expanded_idx_mapping = torch.tensor([1, 6])
    Runner.sample = lambda self, hidden_states, input_batch, grammar_output: rt.planner.steer_rows(
        hidden_states)
    wrap_method(Runner, "sample", v2.sample)
    h = torch.randn(2, 64)
    out = Runner().sample(h, batch, None)
    assert (rt.planner.stats.calls == calls + 1 and torch.equal(out[0], h[0])
            and not torch.equal(out[1], h[1]))

def test_a_step_sampled_without_the_head_is_refused_not_served_unsteered(processor, vllm_config):
    """A sampling path that computes logits straight from the LM-head weight (a greedy fast
    path of a newer vLLM) would skip the steer: a steered step through it is served vLLM's
    tokens for its unsteered requests and fails its steered ones with the cause (a fault of
    the head: never an exception out of vLLM's step, which would end the engine core); an
    unsteered step through it is left alone, and so is the next step."""
    from vllm.v1.worker.gpu.input_batch import InputBatch, InputBuffers

    from vllm_steer.integrations.hooks import wrap_method
    from vllm_steer.integrations.worker import v2

    processor.add_request(0, _params({"a": 4}))
    processor.add_request(1, _params())
    processor.apply_staged_writes()
    weight = torch.randn(100, 64)

    class Runner:  # a sample() that never calls the model's logits layer
        def sample(self, hidden_states, input_batch, grammar_output):
            return (hidden_states @ weight.T).argmax(-1)

    Runner.vllm_config = vllm_config
    wrap_method(Runner, "sample", v2.sample)
    batch = InputBatch.make_dummy(1, 1, InputBuffers(8, 64, torch.device("cpu")))
    batch.idx_mapping_np = np.array([1])
    batch.expanded_idx_mapping = torch.tensor([1])
    h = torch.randn(1, 64)
    assert torch.equal(Runner().sample(h, batch, None), (h @ weight.T).argmax(-1))
    batch.idx_mapping_np = np.array([0])
    batch.expanded_idx_mapping = torch.tensor([0])
    rt = processor.runtime
    assert torch.equal(Runner().sample(h, batch, None), (h @ weight.T).argmax(-1))
    failed = rt.faults.take(["r0"], [0], rt.slots.steered)
    assert list(failed) == ["r0"]
    assert failed["r0"].startswith("vllm-steer: internal error in the steered LM head while "
                                   "serving request r0: HeadBypassedError: " + v2.HEAD_BYPASSED)
    assert "without calling the model's logits layer" in failed["r0"] and "--steer" in failed["r0"]
    batch.idx_mapping_np = np.array([1])
    batch.expanded_idx_mapping = torch.tensor([1])
    assert torch.equal(Runner().sample(h, batch, None), (h @ weight.T).argmax(-1))
    assert not rt.faults.pending


# Batch-sharded sampling (--enable-batch-sharded-sampling, TP > 1) runs vLLM's Triton shard-plan
# kernel, so it is driven in a process with the test shim (tests/v2shim, Triton interpreter).
# What both batch-sharded scripts share: imports, rank 0 of TP=2 built without a process group
# (the only thing __init__ asks it for), and the steered sample() run up to the head's call
# (``SHARDED_RUN``, after the script set ``cfg``, ``rt``, ``sharder``, ``batch`` and
# ``runner_attrs``).
SHARDED_HEAD = r"""
import json, sys, types
import numpy as np, torch
from vllm import SamplingParams
from vllm.v1.worker.gpu.input_batch import InputBatch, InputBuffers
from vllm.v1.worker.gpu.model_runner import GPUModelRunner
from vllm.v1.worker.gpu.sample.batch_shard import BatchSharder
from vllm_steer.integrations.worker.rows import NoRows
from vllm_steer.integrations.worker.runtime import get_runtime
from vllm_steer.integrations.hooks import wrap_method  # noqa: E402
from vllm_steer.integrations.worker import v2  # noqa: E402


def make_sharder(logits_per_req):
    sharder = object.__new__(BatchSharder)
    sharder.tp_rank, sharder.tp_size, sharder.device = 0, 2, torch.device("cpu")
    sharder._padded_num_reqs, sharder._padded_num_logits_per_req = 8, logits_per_req
    sharder._num_warps = 1
    return sharder


def steered_runtime(steers):
    cfg = types.SimpleNamespace(additional_config={"vllm_steer": {"steers": {
        "a": steers[0], "b": steers[1]}}})
    rt = get_runtime(cfg.additional_config)
    rt.bank_state.load(64, torch.device("cpu"), torch.float32)
    rt.ensure_slots(8, torch.device("cpu"))
    rt.step.sampled = NoRows()  # as the V2 processor sets it
    return cfg, rt
"""

SHARDED_RUN = r"""
class Stop(Exception):
    pass

class Model:
    def compute_logits_local(self, hidden):
        torch.save({"rows": hidden.clone(), "steered": rt.planner.steer_rows(hidden)}, out_path)
        raise Stop

runner = object.__new__(GPUModelRunner)
runner.vllm_config, runner.batch_sharder, runner.model = cfg, sharder, Model()
for name, value in runner_attrs.items():
    setattr(runner, name, value)
wrap_method(GPUModelRunner, "sample", v2.sample)
wrap_method(BatchSharder, "shard_sampler_inputs", v2.shard_sampler_inputs)
hidden = torch.randn(10, 64, generator=torch.Generator().manual_seed(0))
try:
    GPUModelRunner.sample(runner, hidden, batch, None)
except Stop:
    pass
saved = torch.load(out_path)
saved["hidden"] = hidden
saved["stats"] = rt.planner.stats.as_dict()
torch.save(saved, out_path)
print("DONE")
"""

SHARDED = SHARDED_HEAD + r"""
steers, out_path = sys.argv[1].split(","), sys.argv[2]
cfg, rt = steered_runtime(steers)
coefs = {1: [4e-3, 0], 2: [0, -3e-3], 3: [0, 5e-3], 4: [-2e-3, 1e-3]}  # slots 0, 5: unsteered
for slot, row in coefs.items():
    full = np.zeros(rt.slots.num_columns, dtype=np.float32)  # the first two steers' columns
    full[:2] = row
    rt.set_slot(slot, full)
rt.slots.flush()
sharder = make_sharder(1)

# 5 requests, 2 tokens each, in batch order -> slots 3, 0, 4, 1, 5 (owner = slot % 2)
batch = InputBatch.make_dummy(5, 10, InputBuffers(8, 64, torch.device("cpu")))
slots = np.array([3, 0, 4, 1, 5])
batch.idx_mapping_np = slots
batch.idx_mapping = torch.from_numpy(slots).to(torch.int64)
batch.expanded_idx_mapping = batch.idx_mapping.clone()
runner_attrs = {}
""" + SHARDED_RUN


def _script_env() -> dict:
    """The environment of a script run with the test shim: this checkout's ``vllm_steer``
    first on its path (the script's own folder comes first otherwise, then an installed one)."""
    import os
    from pathlib import Path

    env = dict(os.environ, **v2_runner_env())
    root = str(Path(__file__).resolve().parents[3])
    env["PYTHONPATH"] = os.pathsep.join([root, env["PYTHONPATH"]])
    return env


def test_batch_sharded_sampling_rows_get_their_own_requests_steer(tmp_path, vllm_config):
    """Under batch-sharded sampling the head sees ``hidden_states[sorted_logits_indices]``
    (rows sorted by owner rank), not batch order: each row must get its own request's steer."""
    import subprocess
    import sys

    steers = vllm_config.additional_config["vllm_steer"]["steers"]
    script, out = tmp_path / "sharded.py", tmp_path / "out.pt"
    script.write_text(SHARDED)
    env = _script_env()
    res = subprocess.run([sys.executable, str(script), f"{steers['a']},{steers['b']}", str(out)],
                         env=env, capture_output=True, text=True, timeout=600)
    assert "DONE" in res.stdout, res.stderr[-3000:]
    saved = torch.load(out)
    hidden, rows, steered = saved["hidden"], saved["rows"], saved["steered"]
    # batch order: slots 3, 0, 4, 1, 5; one logit row per request (its last token);
    # owner-sorted (slot % 2): rank 0's requests 0, 4 (batch 1, 2), then rank 1's 3, 1, 5
    last = [1, 3, 5, 7, 9]
    order = [1, 2, 0, 3, 4]
    assert torch.equal(rows, hidden[[last[i] for i in order]])
    slot_coefs = {0: [0, 0], 1: [4e-3, 0], 2: [0, -3e-3], 3: [0, 5e-3], 4: [-2e-3, 1e-3],
                  5: [0, 0]}
    slots = [3, 0, 4, 1, 5]
    coefs = torch.tensor([slot_coefs[slots[i]] for i in order], dtype=torch.float32)
    from vllm_steer.format import load_steer

    a, b = load_steer(steers["a"]), load_steer(steers["b"])
    want = steer_reference(rows, torch.cat([a.p1, b.p1], 1), torch.cat([a.p2, b.p2], 1),
                           [0, a.p1.shape[1], a.p1.shape[1] + b.p1.shape[1]], coefs)
    torch.testing.assert_close(steered, want)
    assert saved["stats"] == {"calls": 1, "rows": 5}


# The same, with generation windows: two rows per request (as a step that verifies one draft
# token per request), so that one request's rows straddle its window's start.
SHARDED_WINDOWS = SHARDED_HEAD + r"""
steers, out_path, tests_dir, spec = sys.argv[1].split(","), sys.argv[2], sys.argv[3], \
    json.loads(sys.argv[4])
sys.path.insert(0, tests_dir)
from helpers.engines import bound_extra  # noqa: E402

cfg, rt = steered_runtime(steers)
for slot, steer in spec["requests"].items():  # each request as the engine core bound it
    rt.assign(int(slot), SamplingParams(extra_args=bound_extra(["a", "b"], steer)))
rt.slots.flush()
sharder = make_sharder(2)

# 5 requests of 2 tokens in batch order, both tokens sampled (a draft token verified)
batch = InputBatch.make_dummy(5, 10, InputBuffers(8, 64, torch.device("cpu")))
slots = np.array(spec["slots"])
batch.idx_mapping_np = slots
batch.idx_mapping = torch.from_numpy(slots).to(torch.int64)
batch.expanded_idx_mapping = batch.idx_mapping.repeat_interleave(2)
batch.cu_num_logits_np = np.arange(0, 11, 2, dtype=np.int32)
batch.cu_num_logits = torch.from_numpy(batch.cu_num_logits_np)
batch.num_computed_tokens_np = np.array(spec["computed"], dtype=np.int32)
runner_attrs = {"req_states": types.SimpleNamespace(
    prompt_len=types.SimpleNamespace(np=np.full(8, spec["prompt_len"], dtype=np.int32)))}
""" + SHARDED_RUN


def test_batch_sharded_sampling_rows_follow_their_generation_windows(tmp_path, vllm_config,
                                                                    tiny_model_dir):
    """Batch-sharded sampling with generation windows: each owner-sorted row gets its own
    request's strength at the generated token it samples. A windowed request's rows outside
    its window give the plain model's logits (hidden @ head weights) bit for bit, inside the
    reference's on the model's own weights; beside them a steered request with no window, a
    ramp, and an unsteered request."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    from safetensors.torch import load_file

    from vllm_steer.format import load_steer

    steers = vllm_config.additional_config["vllm_steer"]["steers"]
    # batch order: slots 3, 0, 4, 1, 5; each request's two rows sample generated tokens
    # last - 1 and last, last = computed + 2 scheduled - 10 prompt tokens
    spec = {"slots": [3, 0, 4, 1, 5], "computed": [15, 11, 18, 11, 11], "prompt_len": 10,
            "requests": {"3": {"a": {"strength": 6, "start": 7}},  # t 6, 7: out, in
                         "0": None,  # unsteered
                         "4": {"a": 5, "b": {"strength": -4, "end": 10}},  # t 9, 10
                         "1": {"a": 3, "b": 2},  # no window
                         "5": {"b": {"strength": 4, "start": 2, "ramp": 4}}}}  # t 2, 3
    script, out = tmp_path / "sharded_windows.py", tmp_path / "out.pt"
    script.write_text(SHARDED_WINDOWS)
    tests_dir = str(Path(__file__).resolve().parents[2])
    env = _script_env()
    res = subprocess.run([sys.executable, str(script), f"{steers['a']},{steers['b']}", str(out),
                          tests_dir, json.dumps(spec)],
                         env=env, capture_output=True, text=True, timeout=600)
    assert "DONE" in res.stdout, res.stderr[-3000:]
    saved = torch.load(out)
    hidden, rows, steered = saved["hidden"], saved["rows"], saved["steered"]
    # owner-sorted (slot % 2): rank 0's requests (batch 1, 2), then rank 1's (batch 0, 3, 4),
    # each request's two rows (tokens 2i, 2i + 1) in order
    order = [2, 3, 4, 5, 0, 1, 6, 7, 8, 9]
    assert torch.equal(rows, hidden[order])
    strengths = [[0, 0], [0, 0],  # batch 1, slot 0: unsteered
                 [5, -4], [5, 0],  # batch 2, slot 4: t 9 (b inside), 10 (b ended)
                 [0, 0], [6, 0],  # batch 0, slot 3: t 6 (before the window), 7 (inside)
                 [3, 2], [3, 2],  # batch 3, slot 1: no window
                 [0, 1], [0, 2]]  # batch 4, slot 5: t 2, 3 of a ramp of 4 from t 2
    a, b = load_steer(steers["a"]), load_steer(steers["b"])
    eps = torch.tensor([a.metadata.epsilon, b.metadata.epsilon], dtype=torch.float32)
    coefs = torch.tensor(strengths, dtype=torch.float32) * eps
    weights = load_file(str(Path(tiny_model_dir) / "model.safetensors"))["lm_head.weight"]
    weights = weights.float()
    plain = rows @ weights.T
    logits = steered @ weights.T
    want = steered_logits_reference(rows, weights, torch.cat([a.p1, b.p1], 1),
                                    torch.cat([a.p2, b.p2], 1),
                                    [0, a.p1.shape[1], a.p1.shape[1] + b.p1.shape[1]], coefs)
    unsteered = [i for i, s in enumerate(strengths) if s == [0, 0]]
    assert unsteered == [0, 1, 4]
    for i in unsteered:  # outside the window (row 4) as the unsteered request: the plain model
        assert torch.equal(steered[i], rows[i]), f"row {i} was steered"
        assert torch.equal(logits[i], plain[i]), f"row {i}'s logits differ from the plain model"
    inside = [i for i in range(10) if i not in unsteered]
    torch.testing.assert_close(logits[inside], want[inside], atol=1e-4, rtol=1e-4)
    for i in inside:  # and each one is steered (the strengths differ from row to row)
        assert not torch.equal(logits[i], plain[i]), f"row {i} was left unsteered"
