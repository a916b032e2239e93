"""Speculative decoding on the V1 runner (the CPU runner and the V1 GPU runner). Semantics: see
:mod:`vllm_steer.reference`; what steering the target and the drafter means:
:mod:`vllm_steer.integrations.worker.spec_decode`.

The adapter of a speculative V1 step writes the step's views of its rows
(:class:`~vllm_steer.integrations.worker.step_mapping.StepMapping`) once per step:

- **Target rows.** With a ``speculative_config`` every V1 step computes the logits of
  ``hidden_states[logits_indices]``: per request, in batch order, ``num_draft_tokens[i] + 1``
  rows (``_calc_spec_decode_metadata``, host-side ``num_draft_tokens``, called inside
  ``_prepare_inputs``). The step starts with its sampled rows as the persistent batch
  (:func:`start_step`, from the runner's ``_prepare_inputs`` hook while a request is steered:
  a step with no draft tokens samples one row per request); the wrapper of
  ``_calc_spec_decode_metadata`` makes them the verification rows
  (:class:`~vllm_steer.integrations.worker.rows.SlotRows`, with the index of the generated
  token each row samples).
- **Drafter rows.** Every drafter with logits (``draft_model``, ``eagle``, ``eagle3``,
  ``mtp``: vLLM's ``SpecDecodeBaseProposer`` family) computes, in
  ``propose_draft_token_ids``, one row per request of the batch, in batch order, per draft
  step (EAGLE: from the target's hidden state, then from its own): the drafter's heads read
  the drafter view, row i slot i (:data:`~vllm_steer.integrations.worker.rows.
  DRAFT_BATCH_ROWS`). Rows past the batch's requests (parallel drafting) are computed
  unsteered by the runtime.

Everything is planned from host data (numpy arrays the runner already has): no device read.
"""

from __future__ import annotations

import numpy as np

from vllm_steer.integrations.worker.arguments import Arg
from vllm_steer.integrations.worker.rows import (BATCH_ROWS, DRAFT_BATCH_ROWS, NO_ROWS,
                                                 SlotRows)
from vllm_steer.integrations.worker.runtime import BINDINGS, V1RunnerBinding
from vllm_steer.integrations.worker.spec_decode import prepare_drafter_once
from vllm_steer.integrations.worker.step_faults import ROWS
from vllm_steer.integrations.vllm_access import (speculative_config, v1_add_logits_processor,
                                                  v1_corrected_computed_tokens, v1_input_batch,
                                                  v1_token_counts)

#: Our V1 per-request steer state (:mod:`vllm_steer.integrations.request_state_v1`),
#: loaded by name as vLLM loads custom logits processors.
V1_REQUEST_STATE = "vllm_steer.integrations.request_state_v1:SteerRequestStateV1"

_NUM_DRAFT = Arg("num_draft_tokens")
_CU_SCHEDULED = Arg("cu_num_scheduled_tokens")


def verification_rows(num_draft_tokens: np.ndarray, cu_num_scheduled: np.ndarray,
                      num_computed: np.ndarray, num_prompt: np.ndarray
                      ) -> tuple[np.ndarray, np.ndarray]:
    """Slot and generated-token index of each verification row (host arrays, batch order).

    Request ``i`` has ``num_draft_tokens[i] + 1`` rows; row ``j`` samples the request's
    generated token ``g_i + j``, where ``g_i`` is its generated-token count before this step
    (computed tokens + scheduled tokens - draft tokens - prompt tokens). A request still in
    its prompt (a partial prefill chunk, whose sample is dropped) gets -1."""
    num_draft_tokens = np.asarray(num_draft_tokens, dtype=np.int64)
    n = num_draft_tokens.shape[0]
    sampled = num_draft_tokens + 1
    scheduled = np.diff(np.asarray(cu_num_scheduled[:n], dtype=np.int64), prepend=0)
    gen = (np.asarray(num_computed[:n], dtype=np.int64) + scheduled - num_draft_tokens
           - np.asarray(num_prompt[:n], dtype=np.int64))
    slots = np.repeat(np.arange(n, dtype=np.int64), sampled)
    starts = np.cumsum(sampled) - sampled
    offsets = np.arange(slots.shape[0], dtype=np.int64) - np.repeat(starts, sampled)
    positions = np.repeat(gen, sampled) + offsets
    positions[np.repeat(gen < 0, sampled)] = -1
    return slots, positions


def start_step(orig, runner, args, kwargs):
    """``orig`` (V1's ``GPUModelRunner._prepare_inputs``) of a speculative runner's step while a
    request of the process is steered (:func:`~vllm_steer.integrations.worker.v1.
    prepare_inputs` asks), with the step's views started: the sampled rows are the persistent
    batch until :func:`calc_spec_decode_metadata`, which ``_prepare_inputs`` calls, maps this
    step's verification rows; the drafter's rows are the batch's requests in order.

    While no request is steered the views are left as they are: the heads read none then, and
    the first steered step's ``_prepare_inputs`` (after vLLM put its requests into the batch)
    starts them."""
    state = V1RunnerBinding.of(runner)
    rt = state.runtime
    if rt is None:
        return orig(runner, *args, **kwargs)
    step = rt.step
    step.sampled, step.drafts = BATCH_ROWS, DRAFT_BATCH_ROWS
    state.spec_step = True  # the verification rows of this step are mapped
    try:
        return orig(runner, *args, **kwargs)
    finally:
        state.spec_step = False


def calc_spec_decode_metadata(orig, self, *args, **kwargs):
    """``GPUModelRunner._calc_spec_decode_metadata``: each verification row's slot and
    generated-token index (:func:`verification_rows`). A fault here leaves every row of the
    step unsteered and fails the step's steered requests (:mod:`~vllm_steer.integrations.
    worker.step_faults`)."""
    out = orig(self, *args, **kwargs)
    state = BINDINGS.get(self)  # made by start_step, which starts the step
    if state is not None and state.spec_step and state.runtime is not None:
        rt = state.runtime
        rows = NO_ROWS  # a fault: no row is steered (the batch's rows are not the step's)
        with rt.faults.guard(ROWS):  # a fault: the step's steered requests fail
            call = (self, *args)
            num_draft_tokens = _NUM_DRAFT.get(orig, call, kwargs)
            cu_num_scheduled_tokens = _CU_SCHEDULED.get(orig, call, kwargs)
            computed, prompt = v1_token_counts(v1_input_batch(self))
            if rt.slots.any_windowed(slice(len(num_draft_tokens))):
                computed = v1_corrected_computed_tokens(self, len(num_draft_tokens))
            slots, positions = verification_rows(num_draft_tokens, cu_num_scheduled_tokens,
                                                 computed, prompt)
            rows = SlotRows(slots=slots, positions=positions)
        rt.step.sampled = rows
    return out


def propose_draft_token_ids(orig, self, *args, **kwargs):
    """``GPUModelRunner.propose_draft_token_ids``: the drafter's heads are checked once, before
    the drafter's first proposal (:func:`~vllm_steer.integrations.worker.spec_decode.
    prepare_drafter`: steered ones read the step's drafter rows, the others are detached)."""
    state = V1RunnerBinding.of(self)
    if state.runtime is not None:
        prepare_drafter_once(self, state)
    return orig(self, *args, **kwargs)


def build_logitsprocs(orig, vllm_config, device, is_pin_memory, is_pooling_model,
                      custom_logitsprocs=()):
    """``gpu_model_runner.build_logitsprocs``: V1 refuses every custom logits processor under
    speculative decoding (they would see one row per request). Ours never touches logits
    (``apply`` is the identity; the head steers, with the rows mapped here): build vLLM's own
    processors as without it, then add ours for its per-slot bookkeeping. Any other custom
    processor is still refused by vLLM."""
    import importlib

    custom = list(custom_logitsprocs or ())
    ours = [p for p in custom if p == V1_REQUEST_STATE or getattr(p, "__qualname__", None)
            == "SteerRequestStateV1"]
    if speculative_config(vllm_config) is None or is_pooling_model or not ours \
            or len(ours) != len(custom):
        return orig(vllm_config, device, is_pin_memory, is_pooling_model, custom_logitsprocs)
    procs = orig(vllm_config, device, is_pin_memory, is_pooling_model, ())
    module, _, name = V1_REQUEST_STATE.partition(":")
    proc = getattr(importlib.import_module(module), name)(vllm_config, device, is_pin_memory)
    v1_add_logits_processor(procs, proc, proc.is_argmax_invariant())
    return procs
