"""Our per-request logits processors, one per vLLM model runner: where the request's steers
reach the worker. They straddle two processes, as vLLM's custom logits processors do:
``validate_params`` runs in the frontend at admission
(:func:`vllm_steer.integrations.frontend.admission.validate`); an instance lives in each worker
and keeps the coefficients of the request in each batch slot in the worker's
:class:`~vllm_steer.integrations.worker.runtime.SteerRuntime`, where the LM-head hook reads them.
Neither touches logits (``apply`` is the identity). Semantics: see :mod:`vllm_steer.reference`.

- V1 (the CPU runner and the V1 GPU runner): persistent-batch slots (``BatchUpdate``); V1
  samples one row per request in batch order, so row i is slot i.
- Model Runner V2 (the GPU default): request-state slots (``add_request(slot, params)``);
  the row -> slot mapping of each step comes from the runner's ``sample()``
  (:func:`vllm_steer.integrations.worker.v2.sample`).

Named in ``model_config.logits_processors`` by
:func:`vllm_steer.integrations.frontend.startup_checks.processor_fqcn`.
"""

from __future__ import annotations

import torch
from vllm.v1.sample.logits_processor import BatchUpdate, MoveDirectionality
from vllm.v1.sample.logits_processor import LogitsProcessor as V1LogitsProcessor
from vllm.v1.worker.gpu.sample.logits_processor import LogitsProcessor as V2LogitsProcessor

from vllm_steer.integrations.frontend import admission
from vllm_steer.integrations.worker.rows import NO_ROWS
from vllm_steer.integrations.worker.runtime import get_runtime


class SteerLogitsProcessorV1(V1LogitsProcessor):
    """V1 logits processor carrying per-request steers to the LM head."""

    # Read by worker.v1.input_batch_init: this processor never reads output token ids.
    needs_output_token_ids = False

    @classmethod
    def validate_params(cls, sampling_params) -> None:
        admission.validate(sampling_params)

    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool) -> None:
        self.runtime = get_runtime(vllm_config.additional_config)
        if self.runtime is not None:
            self.runtime.ensure_slots(vllm_config.scheduler_config.max_num_seqs, device)

    def is_argmax_invariant(self) -> bool:
        return True  # logits are steered in the head, not here

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        return logits

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        rt = self.runtime
        if rt is None or batch_update is None:
            return
        for slot in batch_update.removed:
            rt.set_slot(slot, None)
        for slot, params, _prompt, _out in batch_update.added:
            coefs = rt.decode(params)  # decoded once, into its row and windows
            rt.set_slot(slot, coefs.row, coefs.windows)
        for a, b, direction in batch_update.moved:
            rt.move_slot(a, b, swap=direction == MoveDirectionality.SWAP)
        rt.batch_size = batch_update.batch_size
        rt.flush()


# A sampling path of newer vLLM that computes greedy logits straight from ``lm_head.weight``
# for batches where no request needs logits processing (not in vLLM 0.32 or 0.33). Where it
# exists, steered requests declare that they need processing, so their batches keep going
# through ``compute_logits``; where it does not, declaring would only cost an fp32 copy of the
# logits at every steered step. Any path that still skips the head is refused at the step
# (:class:`vllm_steer.integrations.worker.v2.HeadBypassedError`).
GREEDY_FAST_PATH_MODULE = "vllm.v1.worker.gpu.sample.screened_head"


def has_greedy_fast_path() -> bool:
    """Whether this vLLM has the greedy fast path (``GREEDY_FAST_PATH_MODULE``)."""
    import importlib.util

    try:
        return importlib.util.find_spec(GREEDY_FAST_PATH_MODULE) is not None
    except ModuleNotFoundError:
        return False


class SteerLogitsProcessorV2(V2LogitsProcessor):
    """V2 logits processor: per-slot steer coefficients for the LM-head hook."""

    @classmethod
    def validate_params(cls, sampling_params) -> None:
        admission.validate(sampling_params)

    def __init__(self, vllm_config, req_states) -> None:
        super().__init__(vllm_config, req_states)
        self.runtime = get_runtime(vllm_config.additional_config)
        self.declare_steered = has_greedy_fast_path()  # see GREEDY_FAST_PATH_MODULE
        if self.runtime is not None:
            self.runtime.ensure_slots(req_states.max_num_reqs, req_states.device)
            # outside sample() (prompt logprobs, warm-up) rows have no known slot: unsteered
            self.runtime.row_source = NO_ROWS

    def add_request(self, req_idx: int, sampling_params) -> bool:
        rt = self.runtime
        if rt is None:
            return False
        coefs = rt.decode(sampling_params)  # decoded once, into its row and windows
        rt.set_slot(req_idx, coefs.row, coefs.windows)  # full reset of the slot
        # logits are steered in the head and apply() has nothing to do: "needs processing" is
        # declared only where a greedy fast path would otherwise skip the head
        return self.declare_steered and (coefs.windows is not None or bool(coefs.row.any()))

    def apply_staged_writes(self) -> None:
        if self.runtime is not None:
            self.runtime.flush()

    def apply(self, logits, ctx):
        return logits
