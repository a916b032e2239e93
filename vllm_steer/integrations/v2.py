"""Per-request steer state for vLLM's Model Runner V2 (the GPU default).

Semantics: see :mod:`vllm_steer.reference`. Thin by design: V2 keeps request state in slots
(``add_request(slot, params)``) and tells, per step, which slot each logits row belongs to
(``expanded_idx_mapping``). That mapping is needed *before* ``compute_logits``, so the runner's
``sample()`` is wrapped to scope it (:meth:`SteerRuntime.rows`) around the LM-head call.
Prompt logprobs under V2 are computed unsteered (the V2 prompt-logprob worker batches rows of
several requests through ``compute_logits`` without a row mapping).
"""

from __future__ import annotations

from vllm.v1.worker.gpu.sample.logits_processor import LogitsProcessor

from vllm_steer.integrations import frontend
from vllm_steer.integrations.runtime import RowSource, get_runtime

FQCN = "vllm_steer.integrations.v2:SteerLogitsProcessorV2"


class SteerLogitsProcessorV2(LogitsProcessor):
    """V2 logits processor: per-slot steer coefficients for the LM-head hook."""

    @classmethod
    def validate_params(cls, sampling_params) -> None:
        frontend.validate(sampling_params)

    def __init__(self, vllm_config, req_states) -> None:
        super().__init__(vllm_config, req_states)
        self.runtime = get_runtime(vllm_config.additional_config)
        if self.runtime is not None:
            self.runtime.ensure_slots(req_states.max_num_reqs, req_states.device)
            # outside sample() (prompt logprobs, warm-up) rows have no known slot: unsteered
            self.runtime.row_source = RowSource("none")
            from vllm.v1.worker.gpu.model_runner import GPUModelRunner

            wrap_sample(GPUModelRunner)

    def add_request(self, req_idx: int, sampling_params) -> bool:
        rt = self.runtime
        if rt is None:
            return False
        row = rt.coef_row(sampling_params)
        rt.set_slot(req_idx, row)  # full reset of a reused slot
        return False  # logits are steered in the head; apply() has nothing to do

    def apply_staged_writes(self) -> None:
        if self.runtime is not None:
            self.runtime.flush()

    def apply(self, logits, ctx):
        return logits


def wrap_sample(runner_cls) -> None:
    """Scope the step's row -> slot mapping around V2's ``sample()`` (which calls the head)."""
    orig = runner_cls.sample
    if getattr(orig, "_vllm_steer", False):
        return

    def sample(self, hidden_states, input_batch, grammar_output):
        rt = get_runtime(self.vllm_config.additional_config)
        if rt is None or not rt.active:
            return orig(self, hidden_states, input_batch, grammar_output)
        with rt.rows(RowSource("mapping", mapping=input_batch.expanded_idx_mapping)):
            return orig(self, hidden_states, input_batch, grammar_output)

    sample._vllm_steer = True
    runner_cls.sample = sample
