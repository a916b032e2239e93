"""Speculative decoding with steers (V1 runner: the CPU runner and V1 GPU runner).

Semantics: see :mod:`vllm_steer.reference`. With rejection sampling the output follows the
target model's distribution whatever the drafter proposes, so steering the target's
*verification* rows gives exactly the steered distribution; steering the drafter as well
only keeps the acceptance rate up.

- **Target rows.** With a ``speculative_config`` every V1 step computes the logits of
  ``hidden_states[logits_indices]``: per request, in batch order, ``num_draft_tokens[i] + 1``
  rows (``_calc_spec_decode_metadata``, host-side ``num_draft_tokens``). The wrapper of that
  method scopes a host-side row -> slot mapping (:class:`RowSource` ``"slots"``, with the
  index of the generated token each row samples) to the rest of ``execute_model``, whose only
  ``compute_logits`` call is the verification one.
- **Drafter rows.** A draft model (``method: "draft_model"``) has its own logits layer (our
  head too). Its ``compute_logits`` calls, in ``propose_draft_token_ids``, have one row per
  request of the batch, in batch order, per draft step: mapped to slots ``0..num_reqs-1``.
  It is steered only when its hidden size equals the steers' (and ``steer_drafter`` is on);
  otherwise its heads are detached from the runtime (computed unsteered, never a crash and
  never another request's steer). Rows the mapping does not cover (parallel drafting) are
  computed unsteered by the runtime.
- n-gram has no drafter logits.

Everything is planned from host data (numpy arrays the runner already has): no device read.
Which methods are accepted is decided at start-up (:data:`SUPPORTED_METHODS`,
``startup_checks.check_speculative_config``).
"""

from __future__ import annotations

import numpy as np

#: ``speculative_config.method`` values steered correctly by this module (V1 runner).
SUPPORTED_METHODS = ("ngram", "draft_model")


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


def wrap_runner(runner_cls) -> None:
    """Wrap ``execute_model``, ``_calc_spec_decode_metadata`` and
    ``propose_draft_token_ids`` of V1's ``GPUModelRunner`` (also the CPU runner's base)."""
    if getattr(runner_cls.execute_model, "_vllm_steer", False):
        return
    orig_exec = runner_cls.execute_model
    orig_calc = runner_cls._calc_spec_decode_metadata
    orig_propose = runner_cls.propose_draft_token_ids

    def execute_model(self, *args, **kwargs):
        rt = _runtime(self) if self.speculative_config is not None else None
        if rt is None:
            return orig_exec(self, *args, **kwargs)
        prev = rt.row_source
        self._vllm_steer_spec = rt  # the verification rows of this step are mapped
        try:
            return orig_exec(self, *args, **kwargs)
        finally:
            self._vllm_steer_spec = None
            rt.row_source = prev

    def _calc_spec_decode_metadata(self, num_draft_tokens, cu_num_scheduled_tokens):
        out = orig_calc(self, num_draft_tokens, cu_num_scheduled_tokens)
        rt = getattr(self, "_vllm_steer_spec", None)
        if rt is not None:
            from vllm_steer.integrations.worker.runtime import RowSource

            ib = self.input_batch
            slots, positions = verification_rows(num_draft_tokens, cu_num_scheduled_tokens,
                                                 ib.num_computed_tokens_cpu,
                                                 ib.num_prompt_tokens)
            rt.row_source = RowSource("slots", slots=slots, positions=positions)
        return out

    def propose_draft_token_ids(self, *args, **kwargs):
        rt = _runtime(self)
        if rt is None:
            return orig_propose(self, *args, **kwargs)
        if not getattr(self, "_vllm_steer_drafter_checked", False):
            prepare_drafter(self, rt)
            self._vllm_steer_drafter_checked = True
        from vllm_steer.integrations.worker.runtime import RowSource

        slots = np.arange(self.input_batch.num_reqs, dtype=np.int64)
        with rt.rows(RowSource("slots", slots=slots, positions=None)):
            return orig_propose(self, *args, **kwargs)

    execute_model._vllm_steer = True
    runner_cls.execute_model = execute_model
    runner_cls._calc_spec_decode_metadata = _calc_spec_decode_metadata
    runner_cls.propose_draft_token_ids = propose_draft_token_ids


def drafter_heads(runner) -> list:
    """The steered logits layers of the runner's drafter model (none for n-gram)."""
    from vllm_steer.integrations.worker.head import SteeredLogitsProcessor

    model = getattr(getattr(runner, "drafter", None), "model", None)
    if model is None or not hasattr(model, "named_modules"):
        return []
    return [m for _, m in model.named_modules() if isinstance(m, SteeredLogitsProcessor)]


def prepare_drafter(runner, rt) -> None:
    """Detach the drafter's heads from the steers unless they can be steered: same hidden
    size as the steers, and ``steer_drafter`` on."""
    from vllm_steer.logs import get_logger

    heads = drafter_heads(runner)
    if not heads:
        return
    spec = runner.speculative_config
    draft_mc = getattr(spec, "draft_model_config", None)
    hidden = None
    if draft_mc is not None:
        from vllm_steer.integrations.families import head_input_size

        try:
            hidden = head_input_size(draft_mc)
        except Exception:  # noqa: BLE001 - an unknown layout: leave the drafter unsteered
            hidden = None
    steer_hidden = rt.bank.hidden_size if rt.bank is not None else None
    steer = bool(getattr(rt.config, "steer_drafter", True)) and hidden is not None \
        and hidden == steer_hidden
    if not steer:
        for head in heads:
            head.steer_runtime = None
    get_logger().info(
        "vllm-steer: speculative decoding (%s): drafter %s (drafter hidden size %s, steers' "
        "%s)", spec.method, "steered" if steer else "unsteered", hidden, steer_hidden)


def allow_steer_processor(runner_module) -> None:
    """V1 refuses every custom logits processor under speculative decoding (they would see
    one row per request). Ours never touches logits (``apply`` is the identity; the head
    steers, with the rows mapped here): build vLLM's own processors as without it, then add
    ours for its per-slot bookkeeping. Any other custom processor is still refused by vLLM."""
    orig = runner_module.build_logitsprocs
    if getattr(orig, "_vllm_steer", False):
        return

    def build_logitsprocs(vllm_config, device, is_pin_memory, is_pooling_model,
                          custom_logitsprocs=()):
        from vllm_steer.integrations.worker.v1 import FQCN

        custom = list(custom_logitsprocs or ())
        ours = [p for p in custom if p == FQCN or getattr(p, "__qualname__", None)
                == "SteerLogitsProcessorV1"]
        if vllm_config.speculative_config is None or is_pooling_model or not ours \
                or len(ours) != len(custom):
            return orig(vllm_config, device, is_pin_memory, is_pooling_model, custom_logitsprocs)
        procs = orig(vllm_config, device, is_pin_memory, is_pooling_model, ())
        from vllm_steer.integrations.worker.v1 import SteerLogitsProcessorV1

        proc = SteerLogitsProcessorV1(vllm_config, device, is_pin_memory)
        (procs.argmax_invariant if proc.is_argmax_invariant()
         else procs.non_argmax_invariant).append(proc)
        return procs

    build_logitsprocs._vllm_steer = True
    runner_module.build_logitsprocs = build_logitsprocs
