"""Start-up checks: what the plugin refuses before an engine serves, and installs when it
accepts.

When vLLM creates the engine config (``EngineArgs.create_engine_config``),
:func:`configure_engine` checks the steer files (safetensors only, no torch), the model family,
presets/defaults/floors, speculative decoding and data-parallel modes, then appends our
per-request logits processor for the active model runner (V1 or Model Runner V2) to
``model_config.logits_processors``. In each worker, vLLM's ``LogitsProcessor`` layer is
swapped for :class:`~vllm_steer.integrations.worker.head.SteeredLogitsProcessor` (``register_oot``),
and once the model is loaded its logits layer is checked to be that head. Speculative
decoding's runner hooks (:mod:`vllm_steer.integrations.worker.spec_decode`) are here too, next to the
check of the methods they support.

This module imports no torch at import time (the frontend imports it).
"""

from __future__ import annotations

from vllm_steer.config import SteerServerConfig
from vllm_steer.integrations.frontend.cli_args import check_policy_config
from vllm_steer.integrations.hooks import check_hooks
from vllm_steer.logs import get_logger

logger = get_logger()


def _hook_create_engine_config(engine_args_cls) -> None:
    orig_create = engine_args_cls.create_engine_config

    def create_engine_config(self, *a, **kw):
        vllm_config = orig_create(self, *a, **kw)
        configure_engine(vllm_config)
        return vllm_config

    engine_args_cls.create_engine_config = create_engine_config


def configure_engine(vllm_config) -> None:
    """Check the steers, refuse what we cannot steer, and install our logits processor."""
    from vllm_steer.integrations.frontend import admission as frontend

    cfg = SteerServerConfig.from_additional_config(vllm_config.additional_config)
    frontend.set_config(cfg)
    if cfg is None or not cfg.enabled:
        return
    check_hooks()
    from vllm_steer.integrations.families import check_model  # refuses what we cannot steer

    check_steers_fit(cfg, check_model(vllm_config.model_config), vllm_config.model_config.model)
    served = getattr(vllm_config.model_config, "served_model_name", None)
    check_policy_config(cfg, {str(n): "the served model name" for n in
                              ([served] if isinstance(served, str) else served or [])})
    check_speculative_config(vllm_config)
    check_runtime_steers_fit_parallelism(cfg, vllm_config)
    mc = vllm_config.model_config
    if getattr(mc, "runner_type", "generate") == "pooling":
        raise ValueError("vllm-steer: --steer needs a generative model; "
                         f"{mc.model} runs as a pooling model")
    fqcn = _processor_fqcn(vllm_config)
    procs = list(mc.logits_processors or [])
    if fqcn not in procs:
        procs.append(fqcn)
    mc.logits_processors = procs
    logger.info("vllm-steer: %d steer(s) %s, max |strength| %g, logits processor %s",
                len(cfg.steers), list(cfg.steers), cfg.max_strength, fqcn)


def check_speculative_config(vllm_config) -> None:
    """Speculative decoding: the V1 runner's verification rows (and a draft model's rows) are
    mapped to their requests by :mod:`vllm_steer.integrations.worker.spec_decode`, for the methods in
    its ``SUPPORTED_METHODS``; any other method, or Model Runner V2, is refused here."""
    spec = vllm_config.speculative_config
    if spec is None:
        return
    from vllm_steer.integrations.worker.spec_decode import SUPPORTED_METHODS

    method = getattr(spec, "method", None)
    fix = ("serve without --speculative-config, or with "
           + " or ".join(f'{{"method": "{m}"}}' for m in SUPPORTED_METHODS)
           + ", or without the --steer options")
    if getattr(vllm_config, "use_v2_model_runner", False):
        raise ValueError(f"vllm-steer: speculative decoding (method {method!r}) is not "
                         "supported with steers under Model Runner V2 (not tested there); set "
                         f"VLLM_USE_V2_MODEL_RUNNER=0, or {fix}")
    if method not in SUPPORTED_METHODS:
        raise ValueError(f"vllm-steer: speculative decoding method {method!r} is not supported "
                         f"with steers (supported: {', '.join(SUPPORTED_METHODS)}); its drafter "
                         "rows are not mapped to their requests (untested); " + fix)


def check_runtime_steers_fit_parallelism(cfg: SteerServerConfig, vllm_config) -> None:
    """Run-time steers (``--steer-dir``, ``--enable-steer-updates``) under data parallelism:
    each engine core keeps its own registry, and a management call must reach every one.
    vLLM's internal load balancing (the default of ``--data-parallel-size N``, also with
    ``--headless`` engine nodes) sends each utility call to every engine core
    (``DPLBAsyncMPClient.call_utility_async``; how ``add_lora`` reaches them all), and the
    steers route collects every answer. Refused at start-up, naming the mode: external and
    hybrid load balancing (each API server talks to its own rank's / node's engine cores only,
    so a load through one would not reach the others) and elastic expert parallelism (an
    engine core added later would not have the run-time steers)."""
    pc = getattr(vllm_config, "parallel_config", None)
    dp = getattr(pc, "data_parallel_size", 1) or 1
    if dp <= 1 or not (cfg.steer_dir or cfg.enable_updates):
        return
    flags = " and ".join(f for f, on in (("--steer-dir", cfg.steer_dir),
                                         ("--enable-steer-updates", cfg.enable_updates)) if on)
    for attr, mode, why in (
            ("data_parallel_external_lb", "external load balancing "
             "(--data-parallel-external-lb / --data-parallel-rank)",
             "each API server manages its own rank's engine core only"),
            ("data_parallel_hybrid_lb", "hybrid load balancing (--data-parallel-hybrid-lb / "
             "--data-parallel-start-rank)", "each node's API servers manage that node's "
             "engine cores only"),
            ("enable_elastic_ep", "elastic expert parallelism (--enable-elastic-ep)",
             "an engine core added when scaling up would not have the run-time steers")):
        if getattr(pc, attr, False):
            raise ValueError(
                f"vllm-steer: {flags} cannot be used with --data-parallel-size {dp} in {mode}: "
                f"run-time steers are loaded into each engine core by a call from the API "
                f"server, and {why}, so a steer loaded through one API server would be "
                "unknown to the others' engines. Use vLLM's internal load balancing (the "
                "default of --data-parallel-size), or load every steer at start-up with "
                "--steer NAME=PATH (which works in every data-parallel mode)")


def check_steers_fit(cfg: SteerServerConfig, hidden_size: int, model: str) -> None:
    """Load each steer file once (safetensors only) and check it fits the model.

    Raises :class:`~vllm_steer.format.SteerFileError` naming each refused file and every
    reason (missing, truncated, pickle, NaN/inf, wrong shape, hidden size mismatch).
    """
    from vllm_steer.format import SteerFileError, load_steer

    errors: list[SteerFileError] = []
    for name, path in cfg.steers.items():
        try:
            steer = load_steer(path)
        except SteerFileError as e:
            errors.append(e)
            continue
        if steer.hidden_size != hidden_size:
            errors.append(SteerFileError(path, [
                f"steer {name!r} has hidden size {steer.hidden_size} but the model {model} has "
                f"{hidden_size}; train or transfer the steer for this model "
                "(vllm-steer train / vllm-steer transfer)"]))
    if len(errors) == 1:
        raise errors[0]
    if errors:
        raise SteerFileError(", ".join(e.path for e in errors),
                             [f"{e.path}: {r}" for e in errors for r in e.reasons])


def _processor_fqcn(vllm_config) -> str:
    if getattr(vllm_config, "use_v2_model_runner", False):
        return "vllm_steer.integrations.worker.v2:SteerLogitsProcessorV2"
    return "vllm_steer.integrations.worker.v1:SteerLogitsProcessorV1"


# ---- the LM head --------------------------------------------------------------------------
def _hook_register_head(logits_processor_cls) -> None:
    from vllm.model_executor.custom_op import op_registry_oot

    from vllm_steer.integrations.worker.head import SteeredLogitsProcessor

    if "LogitsProcessor" not in op_registry_oot:
        logits_processor_cls.register_oot(SteeredLogitsProcessor)


def _hook_model_loaders(base_loader_cls) -> None:
    """Once a worker has built the model, check that our head replaced its logits layer
    (when steers are configured): a model-specific subclass is not replaced, and would serve
    every request unsteered. Wraps ``load_model`` of vLLM's loader base class and of each
    loader that overrides it."""
    import vllm.model_executor.model_loader  # noqa: F401  (imports every built-in loader)

    def subclasses(c):
        for sub in c.__subclasses__():
            yield sub
            yield from subclasses(sub)

    for cls in (base_loader_cls, *subclasses(base_loader_cls)):
        orig = cls.__dict__.get("load_model")
        if orig is None or getattr(orig, "_vllm_steer", False):
            continue
        cls.load_model = _checked_load_model(orig)


def _has_lm_head() -> bool:
    """Whether this worker's model has the LM head: with pipeline parallelism only the last
    stage does (the others have vLLM's ``PPMissingLayer`` and no logits layer to steer)."""
    try:
        from vllm.distributed import get_pp_group

        return get_pp_group().is_last_rank
    except (ImportError, AssertionError):  # no pipeline group (a model built outside vLLM)
        return True


def _checked_load_model(orig):
    def load_model(self, vllm_config, *a, **kw):
        model = orig(self, vllm_config, *a, **kw)
        cfg = SteerServerConfig.from_additional_config(vllm_config.additional_config)
        if cfg is not None and cfg.enabled and _has_lm_head() and \
                getattr(vllm_config.model_config, "runner_type", "generate") != "pooling":
            from vllm_steer.integrations.worker.head import check_head_installed

            check_hooks()
            check_head_installed(model)
        return model

    load_model._vllm_steer = True
    return load_model


# ---- speculative decoding (vllm_steer.integrations.worker.spec_decode) ---------------------------
def _hook_spec_decode(runner_cls) -> None:
    """V1 runner: map the verification rows (and a draft model's rows) to their requests."""
    from vllm_steer.integrations.worker.spec_decode import wrap_runner

    wrap_runner(runner_cls)


def _hook_spec_decode_logitsprocs(runner_module) -> None:
    """V1 runner: build our (logits-neutral) processor under speculative decoding too."""
    from vllm_steer.integrations.worker.spec_decode import allow_steer_processor

    allow_steer_processor(runner_module)
