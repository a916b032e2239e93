"""Per-request steer state for vLLM's V1 model runner (the CPU runner and V1 GPU runner).

Semantics: see :mod:`vllm_steer.reference`. The processor does not touch logits itself
(``apply`` is the identity): it keeps the steer coefficients of each persistent-batch slot in
the worker's :class:`~vllm_steer.integrations.worker.runtime.SteerRuntime`, where the LM-head hook
reads them. V1 samples one row per request in batch order, so row i is slot i.
"""

from __future__ import annotations

import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality

from vllm_steer.integrations.frontend import admission as frontend
from vllm_steer.integrations.worker.runtime import RowSource, get_runtime

FQCN = "vllm_steer.integrations.worker.v1:SteerLogitsProcessorV1"


class SteerLogitsProcessorV1(LogitsProcessor):
    """V1 logits processor carrying per-request steers to the LM head."""

    # Read by relax_output_token_ids: this processor never reads output token ids.
    needs_output_token_ids = False

    @classmethod
    def validate_params(cls, sampling_params) -> None:
        frontend.validate(sampling_params)

    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool) -> None:
        self.runtime = get_runtime(vllm_config.additional_config)
        if self.runtime is not None:
            self.runtime.ensure_slots(vllm_config.scheduler_config.max_num_seqs, device)
            from vllm.v1.worker.gpu_model_runner import GPUModelRunner  # the CPU runner's base

            from vllm.v1.worker.gpu_input_batch import InputBatch

            wrap_prompt_logprobs(GPUModelRunner)
            wrap_prepare_inputs(GPUModelRunner)
            relax_output_token_ids(InputBatch)  # before the runner builds its InputBatch

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
            rt.set_slot(slot, rt.coef_row(params), rt.coef_windows(params))
        for a, b, direction in batch_update.moved:
            rt.move_slot(a, b, swap=direction == MoveDirectionality.SWAP)
        rt.batch_size = batch_update.batch_size
        rt.flush()


def wrap_prepare_inputs(runner_cls) -> None:
    """Give the runtime the index of the generated token each batch row samples, while some
    slot has a generation window (host arrays only, one vectorised expression per step).

    Row i (request i of the persistent batch) samples the token after its scheduled ones:
    generated index ``num_computed_tokens + num_scheduled_tokens - num_prompt_tokens`` (0: the
    first generated token; a preempted request resumes with its outputs counted as computed;
    the sample of a non-final prefill chunk is discarded by vLLM, whatever its index).
    """
    orig = runner_cls._prepare_inputs
    if getattr(orig, "_vllm_steer", False):
        return

    def _prepare_inputs(self, scheduler_output, num_scheduled_tokens, *args, **kwargs):
        out = orig(self, scheduler_output, num_scheduled_tokens, *args, **kwargs)
        rt = get_runtime(self.vllm_config.additional_config)
        if rt is not None:
            if rt.num_window_slots:
                b = self.input_batch
                n = b.num_reqs
                rt.batch_positions = (b.num_computed_tokens_cpu[:n] + num_scheduled_tokens[:n]
                                      - b.num_prompt_tokens[:n]).astype("int64")
            else:
                rt.batch_positions = None
        return out

    _prepare_inputs._vllm_steer = True
    runner_cls._prepare_inputs = _prepare_inputs


def relax_output_token_ids(batch_cls) -> None:
    """Do not make V1 track output token ids for this plugin's sake.

    V1 cannot know whether a custom logits processor reads the requests' output token ids, so
    it tracks them whenever one is loaded; under async scheduling (GPU) that is a wait for the
    previous step's sampled tokens and a Python loop over the batch at every step. When every
    custom processor of the batch declares ``needs_output_token_ids = False`` (this plugin's
    does), the tracking is left off; penalties, bad words and thinking budgets still turn it
    on per batch, as in vLLM.
    """
    orig = batch_cls.__init__
    if getattr(orig, "_vllm_steer", False):
        return

    def __init__(self, *args, **kwargs):
        orig(self, *args, **kwargs)
        procs = self.logitsprocs
        if not self.logitsprocs_need_output_token_ids or procs is None:
            return
        from vllm.v1.sample.logits_processor import BUILTIN_LOGITS_PROCESSORS

        custom = [lp for lp in procs.all if type(lp) not in BUILTIN_LOGITS_PROCESSORS]
        if custom and all(getattr(lp, "needs_output_token_ids", True) is False for lp in custom):
            self.logitsprocs_need_output_token_ids = False

    __init__._vllm_steer = True
    batch_cls.__init__ = __init__


def wrap_prompt_logprobs(runner_cls) -> None:
    """Steer prompt logprobs of a steered request like its sampled tokens.

    ``_get_prompt_logprobs_dict`` calls ``compute_logits`` once per request on a slice of the
    step's hidden states; the runtime maps that slice back to the request's batch slot.
    """
    orig = runner_cls._get_prompt_logprobs_dict
    if getattr(orig, "_vllm_steer", False):
        return

    def _get_prompt_logprobs_dict(self, hidden_states, num_scheduled_tokens):
        rt = get_runtime(self.vllm_config.additional_config)
        if rt is None or not rt.active or not self.num_prompt_logprobs:
            return orig(self, hidden_states, num_scheduled_tokens)
        n = self.input_batch.num_reqs
        qsl = self.query_start_loc.np[: n + 1].copy()
        with rt.rows(RowSource("prompt", base=hidden_states, query_start_loc=qsl)):
            return orig(self, hidden_states, num_scheduled_tokens)

    _get_prompt_logprobs_dict._vllm_steer = True
    runner_cls._get_prompt_logprobs_dict = _get_prompt_logprobs_dict
