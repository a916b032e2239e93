"""Per-request steer state on vLLM's Model Runner V2 (the GPU default): where a request's
steers reach the worker.

:class:`SteerRequestStateV2` is a vLLM logits processor by type only: vLLM loads per-request
state into its workers through custom logits processors (named in
``model_config.logits_processors``), so it subclasses Model Runner V2's ``LogitsProcessor``; it
never changes logits (``apply`` is the identity; the LM head steers,
:mod:`vllm_steer.integrations.worker.head`). It straddles two processes, as vLLM's custom logits
processors do: ``validate_params`` runs in the frontend at admission
(:func:`vllm_steer.integrations.frontend.admission.validate`); an instance lives in each worker
and puts the coefficients of the request in each request-state slot into the worker's
request-slot table (:meth:`~vllm_steer.integrations.worker.runtime.SteerRuntime.set_slot`,
``flush``), where the LM-head hook reads them. Semantics: see :mod:`vllm_steer.reference`.

V2 writes request-state slots (``add_request(slot, params)``, then ``apply_staged_writes()``);
the row -> slot mapping of each step comes from the runner's ``sample()``
(:func:`vllm_steer.integrations.worker.v2.sample`).

This module imports Model Runner V2's ``vllm.v1.worker.gpu.sample.logits_processor`` and
nothing of the V1 runner (:mod:`vllm_steer.integrations.request_state_v1`): it keeps
working on a vLLM without the V1 runner. Named in ``model_config.logits_processors`` by
:func:`vllm_steer.integrations.frontend.startup_checks.processor_fqcn`.
"""

from __future__ import annotations

from vllm.v1.worker.gpu.sample.logits_processor import LogitsProcessor

from vllm_steer.integrations import vllm_access
from vllm_steer.integrations.frontend import admission
from vllm_steer.integrations.worker.rows import NO_ROWS
from vllm_steer.integrations.worker.runtime import get_runtime, max_step_rows
from vllm_steer.integrations.worker.step_faults import REQUEST_STATE

# A sampling path of newer vLLM that computes greedy logits straight from ``lm_head.weight``
# for batches where no request needs logits processing (not in vLLM 0.32 or 0.33). Where it
# exists, steered requests declare that they need processing, so their batches keep going
# through ``compute_logits``; where it does not, declaring would only cost an fp32 copy of the
# logits at every steered step. Any path that still skips the head fails the step's steered
# requests (:class:`vllm_steer.integrations.worker.v2.HeadBypassedError`, a step fault).
GREEDY_FAST_PATH_MODULE = "vllm.v1.worker.gpu.sample.screened_head"


def has_greedy_fast_path() -> bool:
    """Whether this vLLM has the greedy fast path (``GREEDY_FAST_PATH_MODULE``)."""
    import importlib.util

    try:
        return importlib.util.find_spec(GREEDY_FAST_PATH_MODULE) is not None
    except ModuleNotFoundError:
        return False


class SteerRequestStateV2(LogitsProcessor):
    """Model Runner V2 per-request steer state: each slot's coefficients for the LM-head hook."""

    @classmethod
    def validate_params(cls, sampling_params) -> None:
        admission.validate(sampling_params)

    def __init__(self, vllm_config, req_states) -> None:
        super().__init__(vllm_config, req_states)
        self.runtime = get_runtime(vllm_access.additional_config(vllm_config))
        self.slots = None if self.runtime is None else self.runtime.slots  # the request slots
        self.declare_steered = has_greedy_fast_path()  # see GREEDY_FAST_PATH_MODULE
        if self.runtime is not None:
            seqs, device = vllm_access.v2_request_states_size(req_states)
            self.runtime.ensure_slots(seqs, device, max_step_rows(vllm_config, seqs))
            # V2's sampled rows are known only inside sample() (warm-up: none)
            self.runtime.step.sampled = NO_ROWS

    def add_request(self, req_idx: int, sampling_params) -> bool:
        rt = self.runtime
        if rt is None:
            return False
        # decoded once, into its row and windows; a full reset of the slot (a fault of the
        # plugin's code there fails this request alone: worker/step_faults.py)
        coefs = rt.assign(req_idx, sampling_params)
        if coefs is None:
            return False
        # logits are steered in the head and apply() has nothing to do: "needs processing" is
        # declared only where a greedy fast path would otherwise skip the head
        return self.declare_steered and (coefs.windows is not None or bool(coefs.row.any()))

    def apply_staged_writes(self) -> None:
        slots = self.slots  # called at every step: one flag read while nothing changed
        if slots is not None and slots.dirty:
            # a fault of the device copy fails the step's steered requests, not the engine
            # (worker/step_faults.py)
            with self.runtime.faults.guard(REQUEST_STATE):
                slots.flush()

    def apply(self, logits, ctx):
        return logits
