"""Speculative decoding with steers: the V1 runner (the CPU runner and V1 GPU runner) and
Model Runner V2.

Semantics: see :mod:`vllm_steer.reference`. With rejection sampling the output follows the
target model's distribution whatever the drafter proposes, so steering the target's
*verification* rows gives exactly the steered distribution; steering the drafter as well
only keeps the acceptance rate up.

- **Target rows (V1).** With a ``speculative_config`` every V1 step computes the logits of
  ``hidden_states[logits_indices]``: per request, in batch order, ``num_draft_tokens[i] + 1``
  rows (``_calc_spec_decode_metadata``, host-side ``num_draft_tokens``). The wrapper of that
  method scopes a host-side row -> slot mapping (:class:`RowSource` ``"slots"``, with the
  index of the generated token each row samples) to the rest of ``execute_model``, whose only
  ``compute_logits`` call is the verification one.
- **Drafter rows (V1).** Every drafter with logits (``draft_model``, ``eagle``, ``eagle3``,
  ``mtp``: vLLM's ``SpecDecodeBaseProposer`` family) computes, in
  ``propose_draft_token_ids``, one row per request of the batch, in batch order, per draft
  step (EAGLE: from the target's hidden state, then from its own): mapped to slots
  ``0..num_reqs-1``. It is steered only when its head's input size equals the steers' (and
  ``steer_drafter`` is on); otherwise its heads are detached from the runtime (computed
  unsteered, never a crash and never another request's steer). Rows the mapping does not
  cover (parallel drafting) are computed unsteered by the runtime.
- **Model Runner V2.** Its ``sample()`` maps every verification row through
  ``expanded_idx_mapping`` (:mod:`vllm_steer.integrations.worker.v2`). A draft model
  (``StandaloneARSpeculator``, which V2 runs eagerly: no CUDA graph) computes one row per
  request of the input batch per draft step: mapped to the batch's slots
  (``idx_mapping_np``, host) by :func:`propose_standalone_v2`, and steered as on V1. EAGLE,
  EAGLE-3 and MTP speculators run the drafter's LM head inside the draft steps that V2
  captures in CUDA graphs (forward, logits and sampling together, ``target_dependent_ar``),
  where host-planned per-step inputs would be frozen at capture: their rows are steered by
  the capture-safe op (:meth:`SteerRuntime.steer_fixed`: the slots gathered on the device
  from the speculator's own ``idx_mapping`` buffer, the bank's fixed-layout copy), scoped by
  :func:`sample_draft_v2` and prepared when vLLM loads the drafter
  (:func:`speculator_load_model`, before it sizes the KV cache). Outputs are exactly the
  steered target's either way.
- n-gram has no drafter logits.

Everything is planned from host data (numpy arrays the runner already has): no device read.
Which methods are accepted is decided at start-up
(:data:`vllm_steer.integrations.frontend.startup_checks.SUPPORTED_SPEC_METHODS`,
``startup_checks.check_speculative_config``).
"""

from __future__ import annotations

import numpy as np

#: Our V1 logits processor (:mod:`vllm_steer.integrations.processors`), loaded by name as vLLM
#: loads custom processors.
V1_PROCESSOR = "vllm_steer.integrations.processors:SteerLogitsProcessorV1"


def _runtime(runner):
    from vllm_steer.integrations.worker.runtime import get_runtime

    return get_runtime(runner.vllm_config.additional_config)


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


def execute_model(orig, self, *args, **kwargs):
    """``GPUModelRunner.execute_model`` (V1): the verification rows of a speculative step are
    mapped to their requests (by :func:`calc_spec_decode_metadata`) for this step only."""
    rt = _runtime(self) if self.speculative_config is not None else None
    if rt is None:
        return orig(self, *args, **kwargs)
    prev = rt.row_source
    self._vllm_steer_spec = rt  # the verification rows of this step are mapped
    try:
        return orig(self, *args, **kwargs)
    finally:
        self._vllm_steer_spec = None
        rt.row_source = prev


def calc_spec_decode_metadata(orig, self, num_draft_tokens, cu_num_scheduled_tokens):
    """``GPUModelRunner._calc_spec_decode_metadata`` (V1): each verification row's slot and
    generated-token index (:func:`verification_rows`)."""
    out = orig(self, num_draft_tokens, cu_num_scheduled_tokens)
    rt = getattr(self, "_vllm_steer_spec", None)
    if rt is not None:
        from vllm_steer.integrations.worker.runtime import RowSource

        ib = self.input_batch
        computed = ib.num_computed_tokens_cpu
        if rt.num_window_slots and rt.any_windowed(np.arange(len(num_draft_tokens))):
            computed = real_computed_tokens(self, len(num_draft_tokens))
        slots, positions = verification_rows(num_draft_tokens, cu_num_scheduled_tokens,
                                             computed, ib.num_prompt_tokens)
        rt.row_source = RowSource("slots", slots=slots, positions=positions)
    return out


def real_computed_tokens(runner, n: int) -> np.ndarray:
    """The computed-token counts of the batch's first ``n`` requests, corrected for the drafts
    the previous step rejected.

    Under async scheduling with speculative decoding, the engine core schedules a step before
    the previous one's accepted-draft count is back, and the V1 runner counts every draft of
    the previous step as accepted (``prev_num_draft_tokens``: the optimistic count per
    previous batch index) until it corrects ``num_computed_tokens_cpu`` after this step's
    forward is launched (``correct_spec_decode_token_counts``). A generation window needs the
    real count now: read the previous step's valid-token counts
    (``_get_valid_sampled_token_count``, the runner's own read, which waits for the previous
    step's sampling) and apply vLLM's correction, ``optimistic - (valid - 1)``, to a copy.
    Only steps with a windowed request pay that wait; without async scheduling, or when no
    request carries an optimistic count, the counts are returned as they are."""
    computed = np.asarray(runner.input_batch.num_computed_tokens_cpu[:n], dtype=np.int64)
    if not getattr(runner, "use_async_spec_decode", False):
        return computed
    ib = runner.input_batch
    prev_index = getattr(ib, "prev_req_id_to_index", None) or {}
    optimistic = runner.prev_num_draft_tokens.np
    pairs = [(i, prev_index.get(req_id)) for i, req_id in enumerate(ib.req_ids[:n])]
    pairs = [(i, j) for i, j in pairs if j is not None and optimistic[j] > 0]
    if not pairs:
        return computed
    valid = runner._get_valid_sampled_token_count()
    computed = computed.copy()
    for i, j in pairs:
        if j < len(valid):
            computed[i] -= int(optimistic[j]) - (int(valid[j]) - 1)
    return computed


def propose_draft_token_ids(orig, self, *args, **kwargs):
    """``GPUModelRunner.propose_draft_token_ids`` (V1): the drafter's rows (one per request,
    batch order) mapped to their requests; the drafter's heads checked once
    (:func:`prepare_drafter`)."""
    rt = _runtime(self)
    if rt is None:
        return orig(self, *args, **kwargs)
    prepare_drafter_once(self, rt)
    from vllm_steer.integrations.worker.runtime import RowSource

    slots = np.arange(self.input_batch.num_reqs, dtype=np.int64)
    with rt.rows(RowSource("slots", slots=slots, positions=None)):
        return orig(self, *args, **kwargs)


def propose_standalone_v2(orig, self, input_batch, *args, **kwargs):
    """``StandaloneARSpeculator.propose`` (V2 draft model, run eagerly): each of its
    ``compute_logits`` calls has one row per request of the input batch, in batch order
    (``idx_mapping[:num_reqs]``): mapped to those slots from the host copy
    (``idx_mapping_np``)."""
    from vllm_steer.integrations.worker.runtime import RowSource, get_runtime

    rt = get_runtime(self.vllm_config.additional_config)
    num_reqs = getattr(input_batch, "num_reqs", 0)
    slots = getattr(input_batch, "idx_mapping_np", None)
    if rt is None or not num_reqs or slots is None or not rt.any_steered(slots[:num_reqs]):
        return orig(self, input_batch, *args, **kwargs)
    rows = RowSource("slots", slots=np.asarray(slots[:num_reqs], dtype=np.int64),
                     positions=None)
    with rt.rows(rows):
        return orig(self, input_batch, *args, **kwargs)


def drafter_model(runner):
    """The runner's drafter model: V1 ``runner.drafter.model``, V2 ``runner.speculator.model``
    (None for n-gram)."""
    for owner in ("drafter", "speculator"):
        model = getattr(getattr(runner, owner, None), "model", None)
        if model is not None and hasattr(model, "named_modules"):
            return model
    return None


def drafter_heads(runner) -> list:
    """The steered logits layers of the runner's drafter model (none for n-gram)."""
    return _steered_heads(drafter_model(runner))


def _steered_heads(model) -> list:
    from vllm_steer.integrations.worker.head import SteeredLogitsProcessor

    if model is None:
        return []
    return [m for _, m in model.named_modules() if isinstance(m, SteeredLogitsProcessor)]


#: why a V2 EAGLE / EAGLE-3 / MTP drafter whose speculator was not prepared when vLLM loaded
#: it proposes unsteered (logged once per worker)
V2_DRAFTER_REASON = ("Model Runner V2 runs the drafter's LM head inside CUDA-graph-captured "
                     "draft steps, and this drafter was not prepared for them when it loaded")
#: how a prepared V2 EAGLE / EAGLE-3 / MTP drafter is steered (logged with the decision)
V2_DRAFTER_CAPTURED = ("inside CUDA-graph-captured draft steps: slots gathered on the device, "
                       "the bank's fixed-layout copy")
#: the V2 speculator that runs its drafter eagerly (its rows mapped by propose_standalone_v2)
V2_EAGER_SPECULATOR = "StandaloneARSpeculator"


def _v2_captured(runner) -> bool:
    """A V2 runner whose speculator may capture its drafter's head in CUDA graphs."""
    speculator = getattr(runner, "speculator", None)
    return speculator is not None and type(speculator).__name__ != V2_EAGER_SPECULATOR


def _drafter_fits(spec, rt) -> tuple[bool, int | None, int | None]:
    """Whether a drafter can be steered: ``steer_drafter`` on and its head's input size equal
    to the steers'; with both sizes."""
    draft_mc = getattr(spec, "draft_model_config", None)
    hidden = None
    if draft_mc is not None:
        from vllm_steer.integrations.families import head_input_size

        try:
            hidden = head_input_size(draft_mc)
        except Exception:  # noqa: BLE001 - an unknown layout: leave the drafter unsteered
            hidden = None
    steer_hidden = rt.bank.hidden_size if rt.bank is not None else None
    fits = bool(getattr(rt.config, "steer_drafter", True)) and hidden is not None \
        and hidden == steer_hidden
    return fits, hidden, steer_hidden


def _log_drafter(spec, steer: bool, hidden, steer_hidden, how: str) -> None:
    from vllm_steer.logs import get_logger

    get_logger().info(
        "vllm-steer: speculative decoding (%s): drafter %s (drafter hidden size %s, steers' "
        "%s%s)", spec.method, "steered" if steer else "unsteered", hidden, steer_hidden,
        f"; {how}" if how else "")


def prepare_drafter(runner, rt) -> None:
    """Detach the drafter's heads from the steers unless they can be steered: the same hidden
    size as the steers and ``steer_drafter`` on; under V2, an EAGLE / EAGLE-3 / MTP drafter
    only when its speculator was prepared for CUDA graphs at load
    (:func:`speculator_load_model`)."""
    heads = drafter_heads(runner)
    if not heads:
        return
    spec = runner.speculative_config
    fits, hidden, steer_hidden = _drafter_fits(spec, rt)
    how = ""
    if _v2_captured(runner):
        prepared = bool(getattr(runner.speculator, "_vllm_steer_captured", False))
        steer = fits and prepared
        how = V2_DRAFTER_CAPTURED if steer else (V2_DRAFTER_REASON if fits else "")
    else:
        steer = fits
    if not steer:
        for head in heads:
            head.steer_runtime = None
    _log_drafter(spec, steer, hidden, steer_hidden, how)


def speculator_load_model(orig, self, *args, **kwargs):
    """``DraftModelSpeculator.load_model`` (V2): once an EAGLE / EAGLE-3 / MTP drafter is
    loaded (before vLLM profiles memory and sizes the KV cache), prepare its steered heads for
    CUDA-graph-captured draft steps: the bank's fixed-layout copy is allocated now
    (:meth:`SteerRuntime.enable_fixed_drafter`) and :func:`sample_draft_v2` scopes the
    speculator's ``idx_mapping`` around each draft step's head. A drafter that cannot be
    steered (another hidden size, ``--no-steer-drafter``) has its heads detached."""
    out = orig(self, *args, **kwargs)
    from vllm_steer.integrations.worker.runtime import get_runtime

    rt = get_runtime(self.vllm_config.additional_config)
    if rt is None or rt.bank is None or type(self).__name__ == V2_EAGER_SPECULATOR:
        return out
    heads = _steered_heads(getattr(self, "model", None))
    if not heads:
        return out
    fits, _, _ = _drafter_fits(self.vllm_config.speculative_config, rt)
    if fits:
        rt.enable_fixed_drafter()
        self._vllm_steer_captured = True
    else:
        for head in heads:
            head.steer_runtime = None
    return out


def sample_draft_v2(orig, self, *args, **kwargs):
    """``DraftModelSpeculator.sample_draft`` (V2): a prepared speculator's draft-step rows
    (one per request, ``idx_mapping[i]`` its slot, -1 for padding) are steered by the
    capture-safe op, which reads the speculator's own ``idx_mapping`` buffer on the device."""
    if not getattr(self, "_vllm_steer_captured", False):
        return orig(self, *args, **kwargs)
    from vllm_steer.integrations.worker.runtime import RowSource, get_runtime

    rt = get_runtime(self.vllm_config.additional_config)
    mapping = kwargs["idx_mapping"] if "idx_mapping" in kwargs else args[2]
    with rt.rows(RowSource("captured", mapping=mapping)):
        return orig(self, *args, **kwargs)


def prepare_drafter_once(runner, rt) -> None:
    """:func:`prepare_drafter` at a runner's first step (its drafter is loaded by then)."""
    if not getattr(runner, "_vllm_steer_drafter_checked", False):
        prepare_drafter(runner, rt)
        runner._vllm_steer_drafter_checked = True


def build_logitsprocs(orig, vllm_config, device, is_pin_memory, is_pooling_model,
                      custom_logitsprocs=()):
    """``gpu_model_runner.build_logitsprocs`` (V1): V1 refuses every custom logits processor under speculative decoding (they would see
    one row per request). Ours never touches logits (``apply`` is the identity; the head
    steers, with the rows mapped here): build vLLM's own processors as without it, then add
    ours for its per-slot bookkeeping. Any other custom processor is still refused by vLLM."""
    import importlib

    custom = list(custom_logitsprocs or ())
    ours = [p for p in custom if p == V1_PROCESSOR or getattr(p, "__qualname__", None)
            == "SteerLogitsProcessorV1"]
    if vllm_config.speculative_config is None or is_pooling_model or not ours \
            or len(ours) != len(custom):
        return orig(vllm_config, device, is_pin_memory, is_pooling_model, custom_logitsprocs)
    procs = orig(vllm_config, device, is_pin_memory, is_pooling_model, ())
    module, _, name = V1_PROCESSOR.partition(":")
    proc = getattr(importlib.import_module(module), name)(vllm_config, device, is_pin_memory)
    (procs.argmax_invariant if proc.is_argmax_invariant()
     else procs.non_argmax_invariant).append(proc)
    return procs
