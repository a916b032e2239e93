"""Speculative decoding with steers: what the two runners share, the drafter's heads.

Semantics: see :mod:`vllm_steer.reference`. With rejection sampling the output follows the
target model's distribution whatever the drafter proposes, so steering the target's
*verification* rows gives exactly the steered distribution; steering the drafter as well
only keeps the acceptance rate up.

Each runner maps its own rows: :mod:`vllm_steer.integrations.worker.spec_v1` (the V1 runner:
verification rows, drafter rows) and :mod:`vllm_steer.integrations.worker.spec_v2` (Model
Runner V2: the eager draft model, EAGLE / EAGLE-3 / MTP drafters inside CUDA graphs). Here:
which drafter heads stay steered. A drafter is steered only when its head's input size equals
the steers' (and ``steer_drafter`` is on); under V2, an EAGLE / EAGLE-3 / MTP drafter only
when its speculator was prepared for CUDA graphs at load. Otherwise its heads are detached
from the runtime (computed unsteered, never a crash and never another request's steer).
n-gram has no drafter logits. Outputs are exactly the steered target's either way.

Which methods are accepted is decided at start-up
(:data:`vllm_steer.integrations.frontend.startup_checks.SUPPORTED_SPEC_METHODS`,
``startup_checks.check_speculative_config``).
"""

from __future__ import annotations

from vllm_steer.integrations import vllm_access as va
from vllm_steer.integrations.worker.runtime import BINDINGS


def drafter_heads(runner) -> list:
    """The steered logits layers of the runner's drafter model (none for n-gram)."""
    v2 = va.v2_speculator(runner) is not None
    return steered_heads(va.v2_drafter_model(runner) if v2 else va.v1_drafter_model(runner))


def steered_heads(model) -> list:
    """The steered logits layers of ``model`` (none without a model: no drafter, where vLLM's
    layers need not even be importable)."""
    if model is None:
        return []
    from vllm_steer.integrations.worker.head import SteeredLogitsProcessor

    return [m for _, m in model.named_modules() if isinstance(m, SteeredLogitsProcessor)]


#: why a V2 EAGLE / EAGLE-3 / MTP drafter whose speculator was not prepared when vLLM loaded
#: it proposes unsteered (logged once per worker)
V2_DRAFTER_REASON = ("Model Runner V2 runs the drafter's LM head inside CUDA-graph-captured "
                     "draft steps, and this drafter was not prepared for them when it loaded")
#: how a prepared V2 EAGLE / EAGLE-3 / MTP drafter is steered (logged with the decision)
V2_DRAFTER_CAPTURED = ("inside CUDA-graph-captured draft steps: slots gathered on the device, "
                       "the bank read in place")

def _v2_captured(runner) -> bool:
    """A V2 runner whose speculator may capture its drafter's head in CUDA graphs."""
    speculator = va.v2_speculator(runner)
    return speculator is not None and not va.v2_eager_speculator(speculator)


def drafter_fits(spec, rt) -> tuple[bool, int | None, int | None]:
    """Whether a drafter can be steered: ``steer_drafter`` on and its head's input size equal
    to the steers'; with both sizes."""
    draft_mc = va.draft_model_config(spec)
    hidden = None
    if draft_mc is not None:
        from vllm_steer.integrations.families import head_input_size

        try:
            hidden = head_input_size(draft_mc)
        except Exception:  # noqa: BLE001 - an unknown layout: leave the drafter unsteered
            hidden = None
    bank = rt.bank_state.bank
    steer_hidden = bank.hidden_size if bank is not None else None
    fits = bool(getattr(rt.config, "steer_drafter", True)) and hidden is not None \
        and hidden == steer_hidden
    return fits, hidden, steer_hidden


def _log_drafter(spec, steer: bool, hidden, steer_hidden, how: str) -> None:
    from vllm_steer.logs import get_logger

    get_logger().info(
        "vllm-steer: speculative decoding (%s): drafter %s (drafter hidden size %s, steers' "
        "%s%s)", va.spec_method(spec), "steered" if steer else "unsteered", hidden, steer_hidden,
        f"; {how}" if how else "")


def prepare_drafter(runner, rt) -> None:
    """Make the drafter's heads read the step's drafter rows
    (:meth:`~vllm_steer.integrations.worker.head.SteeredLogitsProcessor.steer_as_drafter`)
    when they can be steered: the same hidden size as the steers and ``steer_drafter`` on;
    under V2, an EAGLE / EAGLE-3 / MTP drafter only when its speculator was prepared for CUDA
    graphs at load (:func:`~vllm_steer.integrations.worker.spec_v2.speculator_load_model`).
    Otherwise detach them from the steers."""
    heads = drafter_heads(runner)
    if not heads:
        return
    spec = va.v2_runner_speculative_config(runner) if va.v2_speculator(runner) is not None \
        else va.v1_runner_speculative_config(runner)
    fits, hidden, steer_hidden = drafter_fits(spec, rt)
    how = ""
    if _v2_captured(runner):  # its heads were made drafter heads when it loaded
        speculator = BINDINGS.get(va.v2_speculator(runner))  # made by its load hook, if it ran
        prepared = speculator is not None and speculator.captured
        steer = fits and prepared
        how = V2_DRAFTER_CAPTURED if steer else (V2_DRAFTER_REASON if fits else "")
    else:
        steer = fits
        for head in heads if steer else ():
            head.steer_as_drafter()  # the step's drafter rows
    if not steer:
        for head in heads:
            head.steer_runtime = None
    _log_drafter(spec, steer, hidden, steer_hidden, how)


def prepare_drafter_once(runner, binding) -> None:
    """:func:`prepare_drafter` at a runner's first step (its drafter is loaded by then), with
    the runner's binding (:class:`~vllm_steer.integrations.worker.runtime.V1RunnerBinding` or
    :class:`~vllm_steer.integrations.worker.runtime.V2RunnerBinding`)."""
    if not binding.drafter_checked:
        prepare_drafter(runner, binding.runtime)
        binding.drafter_checked = True
