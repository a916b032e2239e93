"""The LM-head hook: vLLM's ``LogitsProcessor`` layer, replaced out of tree by ours.

Semantics: see :mod:`vllm_steer.reference`. ``forward(lm_head, hidden_states)`` receives the
post-norm hidden states of exactly the rows being sampled; ``c' = c + sum_i eps_i W_i c`` is
applied to them before the one LM-head matmul of the original layer, with no extra
vocabulary-sized work. Registered by the plugin (:data:`vllm_steer.integrations.plugin.HOOKS`,
:func:`register_head`) through ``LogitsProcessor.register_oot`` (vLLM's PluggableLayer
mechanism).

The base class is called explicitly (``LogitsProcessor.forward(self, ...)``, never a
zero-argument ``super()``): vLLM's LoRA wrapper (``LogitsProcessorWithLoRA``) calls
``type(base_layer).forward(wrapper, ...)`` with itself as ``self``, and reads our public
attributes through its ``base_layer``.

A fault of the steer op is not the engine's end: the call computes vLLM's plain logits for
every row and the step's steered requests fail with HTTP 500 (:func:`step_fault`,
:mod:`~vllm_steer.integrations.worker.step_faults`).
"""

from __future__ import annotations

import torch
from vllm.model_executor.layers.logits_processor import LogitsProcessor

from vllm_steer.integrations import vllm_access
from vllm_steer.integrations.worker.gates import GATES
from vllm_steer.logs import get_logger
from vllm_steer.integrations.worker.runtime import SteerRuntime, get_runtime
from vllm_steer.integrations.worker.step_faults import HEAD, capturing


logger = get_logger()


class SteeredLogitsProcessor(LogitsProcessor):
    """vLLM's logits layer plus per-row steering of the hidden states it receives."""

    def __init__(self, *args, **kwargs) -> None:
        LogitsProcessor.__init__(self, *args, **kwargs)
        va = vllm_access
        vllm_config = va.current_vllm_config()
        self.steer_runtime = get_runtime(va.additional_config(vllm_config))
        if self.steer_runtime is not None and not va.logits_as_input(self):
            mc = va.model_config(vllm_config)
            dtype = va.head_dtype(self) or va.model_dtype(mc)
            device = torch.get_default_device()
            if device.type == "meta":  # loading on meta first: load steers where vLLM runs
                device = torch.device(va.platform_device_type())
            from vllm_steer.integrations.families import head_input_size  # OPT: != hidden

            # --enforce-eager: no CUDA graphs of vLLM's, nor of the head's op
            self.steer_runtime.bank_state.load(
                head_input_size(mc), device, dtype,
                model_ids=(str(va.model_name(mc)), *va.served_model_names(mc)),
                cuda_graphs=not va.enforce_eager(mc))

    @property
    def steer_runtime(self) -> SteerRuntime | None:
        """The worker's runtime this head steers with (None: it computes vLLM's plain logits,
        as a drafter's head left unsteered does)."""
        return self._steer_runtime

    @steer_runtime.setter
    def steer_runtime(self, rt: SteerRuntime | None) -> None:
        self._steer_runtime = rt
        #: what each call runs on the hidden states (the runtime's planner's ``steer_rows``:
        #: the step's sampled or prompt rows), bound here rather than looked up through the
        #: runtime at every step
        self.steer_rows = None if rt is None or vllm_access.logits_as_input(self) \
            else rt.planner.steer_rows
        #: a drafter's head recorded into CUDA graphs: it runs the op at every call, with or
        #: without a steered request (:meth:`steer_as_drafter`)
        self.steer_in_graphs = False

    def steer_as_drafter(self, in_graphs: bool = False) -> None:
        """Make this a drafter's head: its calls read the step's drafter rows
        (:meth:`~vllm_steer.integrations.worker.planner.StepPlanner.steer_draft_rows`).
        ``in_graphs``: its calls are recorded into CUDA graphs (V2's EAGLE / EAGLE-3 / MTP
        draft steps), so it records the op even before any request is steered."""
        rt = self._steer_runtime
        if rt is None or self.steer_rows is None:
            return
        self.steer_rows = rt.planner.steer_draft_rows
        self.steer_in_graphs = in_graphs

    def forward(self, lm_head, hidden_states: torch.Tensor, embedding_bias=None,
                skip_gather: bool = False):
        # `self` may be vLLM's LoRA wrapper (see the module docstring). No steered request in
        # the process and not a drafter's head in CUDA graphs: two reads, nothing else.
        if GATES.steered_slots or self.steer_in_graphs:
            steer_rows = self.steer_rows
            if steer_rows is not None:
                try:
                    hidden_states = steer_rows(hidden_states)
                except Exception as e:  # plain logits for every row; its requests fail
                    step_fault(self.steer_runtime, hidden_states, e)
        return LogitsProcessor.forward(self, lm_head, hidden_states, embedding_bias, skip_gather)

    def get_top_tokens(self, lm_head, hidden_states, embedding_bias=None):
        if GATES.steered_slots or self.steer_in_graphs:
            steer_rows = self.steer_rows
            if steer_rows is not None:
                try:
                    hidden_states = steer_rows(hidden_states)
                except Exception as e:
                    step_fault(self.steer_runtime, hidden_states, e)
        return LogitsProcessor.get_top_tokens(self, lm_head, hidden_states, embedding_bias)


def step_fault(rt, hidden_states: torch.Tensor, exc: Exception) -> None:
    """A fault of the steer op (or of the step planner behind it) on one call: recorded for
    the step's output (the step's steered requests fail with HTTP 500,
    :mod:`~vllm_steer.integrations.worker.step_faults`), and the call goes on with the hidden
    states as they came, so every row gets vLLM's plain logits. ``rt``: the head's runtime
    (None: raised again). Raised again while a CUDA graph is being captured (a graph without
    the op would serve unsteered at every replay)."""
    if rt is None or capturing(hidden_states):
        raise exc
    rt.faults.record(HEAD, exc)


class HeadNotInstalledError(RuntimeError):
    """Steers are configured but the model's logits layer is not our head."""


def check_head_installed(model: torch.nn.Module) -> None:
    """Raise :class:`HeadNotInstalledError` unless every vLLM logits layer of ``model`` is a
    :class:`SteeredLogitsProcessor` (called in each worker once the model is built, when
    steers are configured). A model-specific subclass of ``LogitsProcessor`` is not replaced
    by ``register_oot`` (vLLM looks the class up by name), so its requests would be served
    unsteered: refuse instead."""
    name = type(model).__name__
    found, foreign = 0, []
    for path, module in model.named_modules():
        if isinstance(module, SteeredLogitsProcessor):
            found += 1
        elif isinstance(module, LogitsProcessor):
            foreign.append(f"{path or '<model>'} ({type(module).__module__}."
                           f"{type(module).__qualname__})")
    if foreign:
        raise HeadNotInstalledError(
            f"vllm-steer: the model class {name} uses its own logits layer "
            f"{', '.join(foreign)}, a subclass of vLLM's LogitsProcessor that the plugin does not "
            "replace, so steers would be silently ignored; this model is not supported with "
            "--steer (serve it without --steer)")
    if not found:
        raise HeadNotInstalledError(
            f"vllm-steer: the model class {name} has no vLLM LogitsProcessor layer for the "
            "plugin to steer (an unknown model layout), so steers would be silently ignored; "
            "this model is not supported with --steer (serve it without --steer)")


# ---- installing the head (from vllm_steer.integrations.plugin.HOOKS) ---------------------
def register_head(logits_processor_cls) -> None:
    """``LogitsProcessor.register_oot``: vLLM builds :class:`SteeredLogitsProcessor` wherever
    a model asks for its logits layer."""
    from vllm.model_executor.custom_op import op_registry_oot

    if "LogitsProcessor" not in op_registry_oot:
        logits_processor_cls.register_oot(SteeredLogitsProcessor)


def install_loader_checks(base_loader_cls) -> None:
    """Once a worker has built the model, check that our head replaced its logits layer
    (when steers are configured): a model-specific subclass is not replaced, and would serve
    every request unsteered. Wraps ``load_model`` (:func:`load_model`) of vLLM's loader base
    class and of each loader that overrides it."""
    import vllm.model_executor.model_loader  # noqa: F401  (imports every built-in loader)

    from vllm_steer.integrations.hooks import wrap_method

    def subclasses(c):
        for sub in c.__subclasses__():
            yield sub
            yield from subclasses(sub)

    for cls in (base_loader_cls, *subclasses(base_loader_cls)):
        if "load_model" in cls.__dict__:
            wrap_method(cls, "load_model", load_model)


def _has_lm_head() -> bool:
    """Whether this worker's model has the LM head: with pipeline parallelism only the last
    stage does (the others have vLLM's ``PPMissingLayer`` and no logits layer to steer)."""
    return vllm_access.is_last_pp_rank()


def load_model(orig, self, vllm_config, *a, **kw):
    """``BaseModelLoader.load_model`` (and overrides): the built model's logits layer is
    checked to be the steered head (:func:`check_head_installed`), then the head's CUDA graphs
    are captured (:meth:`SteerRuntime.model_loaded`), before vLLM sizes the KV cache."""
    from vllm_steer.config import SteerServerConfig
    from vllm_steer.integrations.hook_check import check_hooks

    va = vllm_access
    model = orig(self, vllm_config, *a, **kw)
    cfg = SteerServerConfig.from_additional_config(va.additional_config(vllm_config))
    mc = va.model_config(vllm_config)
    if cfg is not None and cfg.enabled and _has_lm_head() and not va.is_pooling(mc):
        check_hooks(vllm_config)  # the hook groups of this runner and configuration
        check_head_installed(model)
        rt = get_runtime(va.additional_config(vllm_config))
        if rt is not None:
            rt.model_loaded(va.model_dtype(mc))  # hidden states
    if cfg is not None and cfg.enabled and cfg.layers_enabled() and not va.is_pooling(mc):
        install_layers(model, vllm_config)
    return model


def install_layers(model, vllm_config) -> None:
    """The op of decoder-layer steers in the model's blocks
    (:meth:`SteerRuntime.install_layers`), once per worker: the first model this worker
    loads is the target (a drafter is loaded after it and keeps its blocks as they are)."""
    rt = get_runtime(vllm_access.additional_config(vllm_config))
    if rt is None or rt.layers is not None:
        return
    va = vllm_access
    mc = va.model_config(vllm_config)
    max_tokens = va.max_step_tokens(vllm_config)
    device = next(model.parameters()).device
    n = rt.install_layers(model, va.num_hidden_layers(mc), int(va.hidden_size(mc)),
                          max_tokens, device, next(model.parameters()).dtype)
    logger.info("vllm-steer: vector steers' op in %d decoder block(s) (%d bank slots, up to "
                "%d tokens per step)", n, rt.config.capacity, max_tokens)
