"""Per-request steer state on vLLM's V1 model runner (the CPU runner and the V1 GPU runner):
where a request's steers reach the worker.

:class:`SteerRequestStateV1` is a vLLM logits processor by type only: vLLM loads per-request
state into its workers through custom logits processors (named in
``model_config.logits_processors``), so it subclasses V1's ``LogitsProcessor``; it never
changes logits (``apply`` is the identity; the LM head steers,
:mod:`vllm_steer.integrations.worker.head`). It straddles two processes, as vLLM's custom logits
processors do: ``validate_params`` runs in the frontend at admission
(:func:`vllm_steer.integrations.frontend.admission.validate`); an instance lives in each worker
and puts the coefficients of the request in each batch slot into the worker's request-slot
table (:meth:`~vllm_steer.integrations.worker.runtime.SteerRuntime.set_slot`, ``slots.flush``),
where the LM-head hook reads them. Semantics: see :mod:`vllm_steer.reference`.

V1 keeps a persistent batch: ``update_state(BatchUpdate)`` reports added, removed and moved
slots; V1 samples one row per request in batch order, so row i is slot i.

This module imports V1's ``vllm.v1.sample.logits_processor`` and nothing of Model Runner V2
(:mod:`vllm_steer.integrations.request_state_v2`): a vLLM without the V1 runner never
imports it. Named in ``model_config.logits_processors`` by
:func:`vllm_steer.integrations.frontend.startup_checks.processor_fqcn`.
"""

from __future__ import annotations

import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor

from vllm_steer.integrations import vllm_access

from vllm_steer.integrations.frontend import admission
from vllm_steer.integrations.worker.runtime import get_runtime, max_step_rows
from vllm_steer.integrations.worker.step_faults import REQUEST_STATE


class SteerRequestStateV1(LogitsProcessor):
    """V1 per-request steer state: each batch slot's coefficients for the LM-head hook."""

    # Read by worker.v1.input_batch_init: this processor never reads output token ids.
    needs_output_token_ids = False

    @classmethod
    def validate_params(cls, sampling_params) -> None:
        admission.validate(sampling_params)

    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool) -> None:
        self.runtime = get_runtime(vllm_access.additional_config(vllm_config))
        if self.runtime is not None:
            if vllm_access.speculative_config(vllm_config) is not None:
                self.runtime.mark_speculative()  # the runner's _prepare_inputs hook asks then
            seqs = vllm_access.max_num_seqs(vllm_config)
            self.runtime.ensure_slots(seqs, device, max_step_rows(vllm_config, seqs))

    def is_argmax_invariant(self) -> bool:
        return True  # logits are steered in the head, not here

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        return logits

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        rt = self.runtime
        if rt is None or batch_update is None:
            return
        # a fault of the plugin's code fails the requests it concerns (HTTP 500), not the
        # engine (worker/step_faults.py): one request's, in assign; the batch's steered
        # requests, for the rest
        with rt.faults.guard(REQUEST_STATE):
            for slot in batch_update.removed:
                rt.set_slot(slot, None)
            for slot, params, _prompt, _out in batch_update.added:
                rt.assign(slot, params)  # decoded once, into its row and windows
            for a, b, direction in batch_update.moved:
                swap = vllm_access.is_swap(direction)
                rt.slots.move(a, b, swap=swap)
                if rt.faults.slots:
                    rt.faults.move(a, b, swap)
        rt.step.batch_size = batch_update.batch_size
        with rt.faults.guard(REQUEST_STATE):  # the device copy of the changed slots
            rt.slots.flush()
