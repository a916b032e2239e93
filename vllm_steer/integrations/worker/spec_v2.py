"""Speculative decoding on Model Runner V2. Semantics: see :mod:`vllm_steer.reference`; what
steering the target and the drafter means: :mod:`vllm_steer.integrations.worker.spec_decode`.

- **Target rows.** V2's ``sample()`` maps every verification row through
  ``expanded_idx_mapping`` (:mod:`vllm_steer.integrations.worker.v2`); a generation window
  reads the true computed-token counts
  (:func:`~vllm_steer.integrations.vllm_access.v2_device_computed_tokens`).
- **A draft model** (``StandaloneARSpeculator``, which V2 runs eagerly: no CUDA graph)
  computes one row per request of the input batch per draft step: mapped to the batch's slots
  (``idx_mapping_np``, host): the step's drafter rows, written by
  :func:`propose_standalone_v2`, and steered as on V1.
- **EAGLE, EAGLE-3 and MTP** speculators run the drafter's LM head inside the draft steps that
  V2 captures in CUDA graphs (forward, logits and sampling together, ``target_dependent_ar``),
  where host-planned per-step inputs would be frozen at capture: their rows are steered by the
  capture-safe op (:meth:`~vllm_steer.integrations.worker.planner.StepPlanner.steer_fixed`: the
  slots gathered on the device from the speculator's own ``idx_mapping`` buffer, the bank read
  in place), the step's drafter rows written by :func:`sample_draft_v2`; the heads are
  prepared when vLLM loads the drafter (:func:`speculator_load_model`, before it sizes the KV
  cache and captures the draft steps).
"""

from __future__ import annotations


from vllm_steer.integrations import vllm_access as va
from vllm_steer.integrations.worker.arguments import Arg
from vllm_steer.integrations.worker.gates import GATES
from vllm_steer.integrations.worker.rows import NO_ROWS, CapturedRows, SlotRows
from vllm_steer.integrations.worker.runtime import SpeculatorBinding
from vllm_steer.integrations.worker.spec_decode import drafter_fits, steered_heads
from vllm_steer.integrations.worker.step_faults import ROWS

_INPUT_BATCH = Arg("input_batch")
_IDX_MAPPING = Arg("idx_mapping")


def propose_standalone_v2(orig, self, *args, **kwargs):
    """``StandaloneARSpeculator.propose``: each of its ``compute_logits`` calls has one row per
    request of the input batch, in batch order (``idx_mapping[:num_reqs]``): the step's
    drafter rows are those slots, from the host copy (``idx_mapping_np``); none while no
    request of the batch is steered, and none, with nothing read, while no request of the
    process is (:data:`~vllm_steer.integrations.worker.gates.GATES`)."""
    rt = SpeculatorBinding.of(self).runtime
    if rt is None:
        return orig(self, *args, **kwargs)
    if not GATES.steered_slots:
        rt.step.drafts = NO_ROWS
        return orig(self, *args, **kwargs)
    rt.step.drafts = NO_ROWS
    with rt.faults.guard(ROWS):  # a fault: the step's steered requests fail, vLLM goes on
        slots = va.v2_drafter_batch_slots(_INPUT_BATCH.get(orig, (self, *args), kwargs))
        rt.step.drafts = SlotRows(slots=slots, positions=None) \
            if len(slots) and rt.any_steered(slots) else NO_ROWS
    return orig(self, *args, **kwargs)


def speculator_load_model(orig, self, *args, **kwargs):
    """``DraftModelSpeculator.load_model``: once an EAGLE / EAGLE-3 / MTP drafter is loaded
    (before vLLM profiles memory and sizes the KV cache), prepare its steered heads for
    CUDA-graph-captured draft steps: they read the bank in place, whose layout never changes
    (:meth:`~vllm_steer.integrations.worker.runtime.SteerRuntime.enable_fixed_drafter`); its
    heads read the step's drafter rows and record the op in every captured draft step, and
    :func:`sample_draft_v2` gives them the speculator's ``idx_mapping``. A drafter that cannot
    be steered (another hidden size, ``--no-steer-drafter``) has its heads detached."""
    out = orig(self, *args, **kwargs)
    state = SpeculatorBinding.of(self)
    rt = state.runtime
    if rt is None or rt.bank_state.bank is None or va.v2_eager_speculator(self):
        return out
    heads = steered_heads(va.speculator_model(self))
    if not heads:
        return out
    fits, _, _ = drafter_fits(va.speculative_config(va.speculator_vllm_config(self)), rt)
    if fits:
        rt.enable_fixed_drafter()
        state.captured = True
        for head in heads:
            head.steer_as_drafter(in_graphs=True)
    else:
        for head in heads:
            head.steer_runtime = None
    return out


def sample_draft_v2(orig, self, *args, **kwargs):
    """``DraftModelSpeculator.sample_draft``: a prepared speculator's draft-step rows (one per
    request, ``idx_mapping[i]`` its slot, -1 for padding) are the step's drafter rows, steered
    by the capture-safe op, which reads the speculator's own ``idx_mapping`` buffer on the
    device (a view of it: the same storage at every step, so a captured graph reads each
    replay's)."""
    state = SpeculatorBinding.of(self)
    if state.captured:
        rt = state.runtime
        rt.step.drafts = NO_ROWS
        with rt.faults.guard(ROWS):  # a fault: the step's steered requests fail, vLLM goes on
            rt.step.drafts = CapturedRows(mapping=_IDX_MAPPING.get(orig, (self, *args), kwargs))
    return orig(self, *args, **kwargs)
