"""The host-side row mapping of speculative decoding (no engine; the engine tests are in
test_vllm_specdec.py)."""

from __future__ import annotations

from types import SimpleNamespace
from unittest import mock

import numpy as np
import pytest
import torch

from vllm_steer.integrations.worker.rows import NO_ROWS, SlotRows
from vllm_steer.integrations.worker.step_mapping import StepMapping
from vllm_steer.integrations.worker.spec_v1 import verification_rows
from helpers.fakes import VllmObject, v1_spec_runner_class


def _vllm_logits_indices(num_draft, cu_scheduled):
    """vLLM's own ``_calc_spec_decode_metadata`` on a stand-in runner: the token index of each
    verification row."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    fake = VllmObject(arange_np=np.arange(4096, dtype=np.int64),
                           _arange_scratch=np.zeros(4096, dtype=np.int64),
                           device=torch.device("cpu"),
                           input_ids=SimpleNamespace(gpu=torch.zeros(4096, dtype=torch.int32)))
    fake._get_cumsum_and_arange = GPUModelRunner._get_cumsum_and_arange.__get__(fake)
    meta = GPUModelRunner._calc_spec_decode_metadata(fake, num_draft, cu_scheduled)
    return meta.logits_indices.numpy()


def test_each_verification_row_maps_to_the_request_whose_tokens_it_reads():
    # vLLM's documented example: 5 requests, 3/0/2/0/1 draft tokens
    num_draft = np.array([3, 0, 2, 0, 1], dtype=np.int32)
    cu = np.array([4, 104, 107, 207, 209], dtype=np.int32)
    rows = _vllm_logits_indices(num_draft, cu)
    # request of each row, from vLLM's token indices: the request whose scheduled tokens
    # [cu[i-1], cu[i]) contain the row's token
    expected = np.searchsorted(cu, rows, side="right")
    slots, _ = verification_rows(num_draft, cu, np.zeros(5, np.int32), np.zeros(5, np.int32))
    assert slots.tolist() == expected.tolist()
    assert len(slots) == int((num_draft + 1).sum())


def test_positions_count_the_generated_tokens_each_row_samples():
    # r0: decoding, prompt 10, 2 tokens generated and computed, the 3rd (sampled last step)
    #     is the step's first input, plus 3 drafts -> rows sample generated tokens 3, 4, 5, 6
    # r1: the first prompt chunk of a 300-token prompt (100 of 300): its sample is dropped
    # r2: the last prompt chunk (200 computed + 100 = 300): samples generated token 0
    # r3: decoding with no draft, 7 generated -> samples token 7
    num_draft = np.array([3, 0, 0, 0])
    scheduled = np.array([4, 100, 100, 1])
    computed = np.array([12, 0, 200, 16])
    prompt = np.array([10, 300, 300, 10])
    slots, pos = verification_rows(num_draft, np.cumsum(scheduled), computed, prompt)
    assert slots.tolist() == [0, 0, 0, 0, 1, 2, 3]
    assert pos.tolist() == [3, 4, 5, 6, -1, 0, 7]


def _target_rows(h):  # the target's view of the step (StepPlanner.steer_rows)
    return h


def _draft_rows(h):  # the drafter's view (StepPlanner.steer_draft_rows)
    return h


def _runner_with_drafter(draft_hidden, steer_hidden, steer_drafter=True, method="draft_model",
                         v2=False):
    """A stand-in runner whose drafter model has two of our heads, each bound to a runtime
    whose steers have ``steer_hidden`` (what ``prepare_drafter`` reads, nothing more)."""
    from vllm_steer.integrations.worker.head import SteeredLogitsProcessor

    rt = SimpleNamespace(bank_state=SimpleNamespace(bank=SimpleNamespace(hidden_size=steer_hidden)),
                         config=SimpleNamespace(steer_drafter=steer_drafter),
                         planner=SimpleNamespace(steer_rows=_target_rows,
                                                 steer_draft_rows=_draft_rows))
    model = torch.nn.Module()
    for name in ("head", "mtp_head"):
        head = SteeredLogitsProcessor.__new__(SteeredLogitsProcessor)
        torch.nn.Module.__init__(head)
        head.logits_as_input = False
        head.steer_runtime = rt
        model.add_module(name, head)
    draft_mc = SimpleNamespace(architectures=["LlamaForCausalLM"],
                               hf_config=SimpleNamespace(architectures=["LlamaForCausalLM"]),
                               get_hidden_size=lambda: draft_hidden)
    spec = SimpleNamespace(method=method, draft_model_config=draft_mc)
    if v2:  # V2 keeps it in its speculator, of a class per method
        cls = "StandaloneARSpeculator" if method == "draft_model" else "EagleSpeculator"
        runner = VllmObject(speculator=type(cls, (), {"model": model})(),
                                 speculative_config=spec)
    else:
        runner = VllmObject(drafter=SimpleNamespace(model=model), speculative_config=spec)
    return runner, rt, [model.head, model.mtp_head]


@pytest.mark.parametrize("draft_hidden,steer_drafter,steered", [
    (64, True, True),     # the steers' hidden size: the drafter proposes steered tokens
    (128, True, False),   # another hidden size: its heads are detached (never a shape error)
    (64, False, False),   # --no-steer-drafter
])
def test_a_drafter_is_steered_only_when_its_hidden_size_fits(draft_hidden, steer_drafter,
                                                              steered):
    from vllm_steer.integrations.worker.spec_decode import prepare_drafter

    runner, rt, heads = _runner_with_drafter(draft_hidden, 64, steer_drafter)
    prepare_drafter(runner, rt)
    assert [h.steer_runtime is rt for h in heads] == [steered, steered]
    # a steered drafter's heads read the step's drafter rows, never the target's
    assert [h.steer_rows for h in heads] == [_draft_rows if steered else None] * 2


def _drafter_log(fn) -> list[str]:
    """The plugin's log lines about the drafter while ``fn()`` runs."""
    import logging

    from vllm_steer.logs import get_logger

    class Lines(logging.Handler):
        def __init__(self):
            super().__init__(logging.INFO)
            self.lines = []

        def emit(self, record):
            self.lines.append(record.getMessage())

    logger, handler = get_logger(), Lines()
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        fn()
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    return [m for m in handler.lines if "drafter" in m]


def _load_v2_drafter(runner, rt):
    """``DraftModelSpeculator.load_model`` of the stand-in V2 runner's speculator (the drafter
    already there), through the plugin's wrapper; returns the fixed-copy allocations made."""
    from vllm_steer.integrations.worker.spec_v2 import speculator_load_model

    fixed = []
    rt.enable_fixed_drafter = lambda: fixed.append(True)
    runner.speculator.vllm_config = SimpleNamespace(
        additional_config=None, speculative_config=runner.speculative_config)
    with mock.patch("vllm_steer.integrations.worker.runtime.get_runtime", return_value=rt):
        speculator_load_model(lambda self, target: None, runner.speculator, None)
    return fixed


@pytest.mark.parametrize("method", ["eagle", "eagle3", "mtp"])
def test_a_model_runner_v2_drafter_is_prepared_for_cuda_graphs_when_it_loads(method):
    """V2 captures its EAGLE / EAGLE-3 / MTP drafters' LM heads in CUDA graphs with their
    sampling. When vLLM loads such a drafter (before it sizes the KV cache) its heads read the
    bank in place (nothing allocated) and stay steered, and the log says how; a
    drafter whose speculator was not prepared at load is detached and the log says why;
    another hidden size is detached at load. Its draft model runs eagerly and is steered as
    on V1."""
    from vllm_steer.integrations.worker.runtime import V2RunnerBinding
    from vllm_steer.integrations.worker.spec_decode import prepare_drafter_once

    def binding(runner, rt):  # the runner's binding, as its first steered step makes it
        runner.vllm_config = SimpleNamespace(additional_config=None)
        with mock.patch("vllm_steer.integrations.worker.runtime.get_runtime", return_value=rt):
            return V2RunnerBinding.of(runner)

    runner, rt, heads = _runner_with_drafter(64, 64, method=method, v2=True)
    assert _load_v2_drafter(runner, rt) == [True]
    lines = _drafter_log(lambda: (prepare_drafter_once(runner, binding(runner, rt)),
                                  prepare_drafter_once(runner, binding(runner, rt))))  # once
    assert [h.steer_runtime is rt for h in heads] == [True, True]
    assert len(lines) == 1 and f"({method}): drafter steered" in lines[0], lines
    assert "CUDA-graph-captured draft steps" in lines[0], lines

    runner, rt, heads = _runner_with_drafter(64, 64, method=method, v2=True)  # not prepared
    lines = _drafter_log(lambda: prepare_drafter_once(runner, binding(runner, rt)))
    assert [h.steer_runtime for h in heads] == [None, None]
    assert f"({method}): drafter unsteered" in lines[0] and "not prepared" in lines[0], lines

    runner, rt, heads = _runner_with_drafter(128, 64, method=method, v2=True)
    assert _load_v2_drafter(runner, rt) == []
    assert [h.steer_runtime for h in heads] == [None, None]

    runner, rt, heads = _runner_with_drafter(64, 64, method="draft_model", v2=True)
    assert _load_v2_drafter(runner, rt) == []  # runs eagerly: the host-mapped path
    prepare_drafter_once(runner, binding(runner, rt))
    assert [h.steer_runtime is rt for h in heads] == [True, True]


def test_a_v2_draft_model_step_maps_its_rows_to_the_batch_slots(monkeypatch):
    """V2's draft model computes one row per request of the input batch: the rows get the
    slots of ``idx_mapping_np`` only while a slot of the batch is steered, and are none,
    the batch unread, while no request of the process is steered."""
    from vllm_steer.integrations.worker.gates import GATES
    from vllm_steer.integrations.worker.spec_v2 import propose_standalone_v2

    monkeypatch.setattr(GATES, "steered_slots", 1)  # a steered request in the process

    seen = []
    step = mapping = StepMapping()

    from vllm_steer.integrations.worker.step_faults import StepFaults

    class Runtime:
        planner = SimpleNamespace(step=mapping)
        step = mapping
        faults = StepFaults()

        def any_steered(self, slots):
            return bool((slots == 5).any())

    rt = Runtime()
    spec = VllmObject(vllm_config=SimpleNamespace(additional_config={}))
    batch = SimpleNamespace(num_reqs=3, idx_mapping_np=np.array([5, 0, 2, 7]))
    def orig(self, input_batch, *a, **kw):  # what the drafter's heads would read
        seen.append(step.drafts)
        return "proposed"

    with mock.patch("vllm_steer.integrations.worker.runtime.get_runtime", lambda cfg: rt):
        assert propose_standalone_v2(orig, spec, batch, 1, x=2) == "proposed"
        assert [s.slots.tolist() for s in seen] == [[5, 0, 2]]
        assert isinstance(seen[0], SlotRows) and seen[0].positions is None
        batch.idx_mapping_np = np.array([1, 0, 2, 5])  # slot 5 not among the batch's three
        propose_standalone_v2(orig, spec, batch)
        assert seen[1] is NO_ROWS  # the drafter's rows: none steered
        batch.idx_mapping_np = np.array([5, 0, 2, 7])
        step.drafts = SlotRows(slots=np.array([5]), positions=None)  # the last step's
        GATES.steered_slots = 0  # no steered request left in the process
        propose_standalone_v2(orig, spec, SimpleNamespace())  # a batch with nothing to read
        assert seen[2] is NO_ROWS
        # a batch the plugin cannot read while a request is steered: the drafts go unsteered,
        # the fault is recorded for the step (its steered requests fail), vLLM's method runs
        GATES.steered_slots = 1
        step.drafts = SlotRows(slots=np.array([5]), positions=None)
        unreadable = SimpleNamespace(num_reqs=2, idx_mapping_np=object())
        assert propose_standalone_v2(orig, spec, unreadable) == "proposed"
        assert seen[3] is NO_ROWS and rt.faults.pending


def test_an_ngram_runner_has_no_drafter_heads():
    from vllm_steer.integrations.worker.spec_decode import drafter_heads, prepare_drafter

    runner = VllmObject(drafter=SimpleNamespace(), speculative_config=SimpleNamespace(
        method="ngram"))
    assert drafter_heads(runner) == []
    prepare_drafter(runner, SimpleNamespace(bank_state=SimpleNamespace(bank=None),
                                            config=None))  # nothing to detach


def test_async_counts_are_corrected_for_the_drafts_the_previous_step_rejected():
    """Async scheduling: the runner's counts assume every previous draft accepted; the real
    count subtracts ``optimistic - (valid - 1)`` per request, found through its previous batch
    index (vLLM's own ``correct_spec_decode_token_counts`` rule)."""
    from vllm_steer.integrations.vllm_access import (
        v1_corrected_computed_tokens as corrected_computed_tokens)

    calls = []
    ib = SimpleNamespace(num_computed_tokens_cpu=np.array([20, 31, 12, 7]),
                         req_ids=["a", "b", "c", "new"],
                         prev_req_id_to_index={"a": 2, "b": 0, "c": 1})
    runner = VllmObject(
        use_async_spec_decode=True, input_batch=ib,
        prev_num_draft_tokens=SimpleNamespace(np=np.array([3, 0, 3, 0])),
        _get_valid_sampled_token_count=lambda: calls.append(1) or [2, 4, 4])
    # a: prev index 2, 3 optimistic, 4 valid (3 accepted): no change; b: prev 0, 3 optimistic,
    # 2 valid (1 accepted): -2; c: no optimistic count; new: not in the previous batch
    assert corrected_computed_tokens(runner, 4).tolist() == [20, 29, 12, 7]
    assert ib.num_computed_tokens_cpu.tolist() == [20, 31, 12, 7]  # vLLM's own counts kept
    runner.use_async_spec_decode = False
    assert corrected_computed_tokens(runner, 4).tolist() == [20, 31, 12, 7]
    assert len(calls) == 1  # the wait only where a count is optimistic


def _speculative_v1_runtime(monkeypatch, steered: int, windowed: int):
    """The process's gates (an engine that speculates, ``steered`` steered and ``windowed``
    windowed slots, no decoder-layer steer) and a runtime stand-in: its step mapping, its
    faults and a slot table with ``windowed`` slots that have a window."""
    from vllm_steer.integrations.worker.gates import GATES
    from vllm_steer.integrations.worker.step_faults import StepFaults

    for gate, value in (("steered_slots", steered), ("speculative_runtimes", 1),
                        ("windowed_slots", windowed), ("layer_mappings", 0)):
        monkeypatch.setattr(GATES, gate, value)
    step = StepMapping()
    return step, SimpleNamespace(step=step, faults=StepFaults(), slots=SimpleNamespace(
        num_window_slots=windowed, any_windowed=lambda s: bool(windowed)))


def test_a_steered_speculative_v1_step_starts_its_rows_in_prepare_inputs(monkeypatch):
    """V1's ``_prepare_inputs`` hook starts a steered speculative step's rows: the sampled rows
    are the batch (one per request) until vLLM's ``_calc_spec_decode_metadata``, called inside
    it, maps the verification rows (slot and generated-token index of each); that method
    called outside a step (a dummy run) maps nothing; with no steered request in the process
    the rows are left as they are (no head reads them)."""
    from vllm_steer.integrations.hooks import wrap_method
    from vllm_steer.integrations.worker import spec_v1, v1
    from vllm_steer.integrations.worker.gates import GATES
    from vllm_steer.integrations.worker.rows import BATCH_ROWS, DRAFT_BATCH_ROWS
    from vllm_steer.integrations.worker.runtime import BINDINGS, V1RunnerBinding

    step, rt = _speculative_v1_runtime(monkeypatch, steered=1, windowed=0)
    seen = []

    class Runner(v1_spec_runner_class()):  # 2 requests, 2 and 0 draft tokens
        def _prepare_inputs(self, scheduler_output, num_scheduled_tokens):
            seen.append((step.sampled, step.drafts))  # the step's rows as it starts
            return super()._prepare_inputs(scheduler_output, num_scheduled_tokens)

    wrap_method(Runner, "_calc_spec_decode_metadata", spec_v1.calc_spec_decode_metadata)
    wrap_method(Runner, "_prepare_inputs", v1.prepare_inputs)
    runner = Runner()
    BINDINGS.set(runner, V1RunnerBinding(rt))
    step.sampled = SlotRows(slots=np.array([9]))  # the previous step's verification rows
    assert runner._prepare_inputs(None, np.array([3, 1])) == "meta"
    assert seen == [(BATCH_ROWS, DRAFT_BATCH_ROWS)]
    # request 0: 3 rows (2 drafts + 1), generated tokens 5 + 3 - 2 - 3 = 3 on; request 1: 7 + 1
    # - 0 - 3 = 5
    assert step.sampled.slots.tolist() == [0, 0, 0, 1]
    assert step.sampled.positions.tolist() == [3, 4, 5, 5]
    mapped = step.sampled
    runner._calc_spec_decode_metadata(np.array([1, 1]), np.array([2, 4]))  # outside a step
    assert step.sampled is mapped
    monkeypatch.setattr(GATES, "steered_slots", 0)
    runner._prepare_inputs(None, np.array([3, 1]))
    assert seen[-1] == (mapped, DRAFT_BATCH_ROWS) and step.sampled is mapped


def test_a_step_without_drafts_reads_windows_at_the_true_generated_token(monkeypatch):
    """Async scheduling with speculative decoding, a step in which no request has draft
    tokens (an n-gram drafter that found nothing): the head's rows stay the batch, and a
    windowed row's generated-token index must come from the corrected count, as the
    verification rows' and the decoder layers' do. Request: a 10-token prompt, 2 tokens
    generated, the previous step's 3 drafts all rejected (the host counts them accepted)."""
    from vllm_steer.integrations.hooks import wrap_method
    from vllm_steer.integrations.worker import v1
    from vllm_steer.integrations.worker.runtime import BINDINGS, V1RunnerBinding

    step, rt = _speculative_v1_runtime(monkeypatch, steered=0, windowed=1)
    ib = SimpleNamespace(num_reqs=1, num_computed_tokens_cpu=np.array([14]),
                         num_prompt_tokens=np.array([10]), req_ids=["r0"],
                         prev_req_id_to_index={"r0": 0})

    class Runner(VllmObject):
        def _prepare_inputs(self, scheduler_output, num_scheduled_tokens):
            return "out"

    wrap_method(Runner, "_prepare_inputs", v1.prepare_inputs)
    runner = Runner(input_batch=ib, use_async_spec_decode=True,
                    prev_num_draft_tokens=SimpleNamespace(np=np.array([3])),
                    _get_valid_sampled_token_count=lambda: np.array([1]))
    BINDINGS.set(runner, V1RunnerBinding(rt))
    assert runner._prepare_inputs(None, np.array([1])) == "out"
    # computed 14 - (3 - (1 - 1)) = 11; the row samples generated token 11 + 1 - 10 = 2
    assert step.batch_positions.tolist() == [2]
    runner.use_async_spec_decode = False  # synchronous: the host counts are true
    ib.num_computed_tokens_cpu = np.array([11])
    runner._prepare_inputs(None, np.array([1]))
    assert step.batch_positions.tolist() == [2]
