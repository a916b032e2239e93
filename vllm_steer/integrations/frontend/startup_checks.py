"""Start-up checks: what the plugin refuses before an engine serves, and installs when it
accepts.

When vLLM creates the engine config (``EngineArgs.create_engine_config``),
:func:`configure_engine` checks the steer files (safetensors only, no torch), the model family,
presets/defaults/floors, speculative decoding and data-parallel modes, then appends our
per-request steer state for the active model runner (V1 or Model Runner V2) to
``model_config.logits_processors`` (a vLLM logits processor by type only: that is how vLLM
loads per-request state into its workers; :func:`processor_fqcn`). In each worker, vLLM's
``LogitsProcessor`` layer is swapped for
:class:`~vllm_steer.integrations.worker.head.SteeredLogitsProcessor` (``register_oot``), and
once the model is loaded its logits layer is checked to be that head
(:mod:`vllm_steer.integrations.worker.head`).

This module imports no torch at import time (the frontend imports it).
"""

from __future__ import annotations

from vllm_steer.config import SteerServerConfig
from vllm_steer.integrations.frontend.cli_args import check_policy_config
from vllm_steer.integrations import vllm_access as va
from vllm_steer.integrations.frontend.state import new_engine
from vllm_steer.integrations.hook_check import check_hooks
from vllm_steer.logs import get_logger

logger = get_logger()

#: ``speculative_config.method`` values whose rows are mapped to their requests, on the V1
#: runner and on Model Runner V2 (:mod:`vllm_steer.integrations.worker.spec_decode`).
SUPPORTED_SPEC_METHODS = ("ngram", "draft_model", "eagle", "eagle3", "mtp")

#: ``rejection_sample_method`` values that accept draft tokens the steered target would not
#: (refused): ``synthetic`` accepts at fixed rates (benchmarking), ``fly`` (vLLM 0.33) accepts a
#: rejected draft when the target's entropy is high. "standard" and "block" (block
#: verification) keep the target's distribution.
LOSSY_VERIFICATION = ("synthetic", "fly")


def create_engine_config(orig, self, *a, **kw):
    """``EngineArgs.create_engine_config``: the checks and our per-request steer state
    (:func:`configure_engine`) on every engine config vLLM creates."""
    vllm_config = orig(self, *a, **kw)
    configure_engine(vllm_config)
    return vllm_config


def configure_engine(vllm_config) -> None:
    """Check the steers, refuse what we cannot steer, and install our per-request steer state
    (as a logits processor)."""
    cfg = SteerServerConfig.from_additional_config(va.additional_config(vllm_config))
    new_engine(cfg)
    if cfg is None or not cfg.enabled:
        return
    check_hooks(vllm_config)  # the hook groups this configuration uses
    from vllm_steer.integrations.families import check_model  # refuses what we cannot steer

    mc = va.model_config(vllm_config)
    check_steers_fit(cfg, check_model(mc), va.model_name(mc), vllm_config)
    check_policy_config(cfg, {n: "the served model name" for n in va.served_model_names(mc)})
    check_speculative_config(vllm_config)
    check_decode_backend(vllm_config)
    check_runtime_steers_fit_parallelism(cfg, vllm_config)
    if va.is_pooling(mc):
        raise ValueError("vllm-steer: --steer needs a generative model; "
                         f"{va.model_name(mc)} runs as a pooling model")
    fqcn = processor_fqcn(vllm_config)
    procs = va.logits_processors(mc)
    if fqcn not in procs:
        procs.append(fqcn)
    va.set_logits_processors(mc, procs)
    logger.info("vllm-steer: %d steer(s) %s, max |strength| %g, logits processor %s",
                len(cfg.steers), list(cfg.steers), cfg.max_strength, fqcn)


def check_speculative_config(vllm_config) -> None:
    """Speculative decoding: the target's verification rows, and the drafter's rows where it
    is steered, are mapped to their requests by
    :mod:`vllm_steer.integrations.worker.spec_decode` for the methods in
    ``SUPPORTED_SPEC_METHODS``, on both runners; any other method is refused here, and so is a
    verification that does not keep the steered model's distribution
    (:data:`LOSSY_VERIFICATION`)."""
    if va.speculative_config(vllm_config) is None:
        return
    method = va.speculative_method(vllm_config)
    if method not in SUPPORTED_SPEC_METHODS:
        fix = ("serve without --speculative-config, or with "
               + " or ".join(f'{{"method": "{m}"}}' for m in SUPPORTED_SPEC_METHODS)
               + ", or without the --steer options")
        raise ValueError(f"vllm-steer: speculative decoding method {method!r} is not supported "
                         f"with steers (supported: {', '.join(SUPPORTED_SPEC_METHODS)}); its "
                         "drafter rows are not mapped to their requests (untested); " + fix)
    verify = va.rejection_sample_method(vllm_config)
    if verify in LOSSY_VERIFICATION:
        raise ValueError(
            f"vllm-steer: speculative decoding with rejection_sample_method {verify!r} cannot be "
            "served with steers: it accepts draft tokens that the steered model's verification "
            "rejects, so a steered request would get tokens of the drafter (unsteered for "
            "n-gram, or a drafter left unsteered) instead of the steered model's. Use "
            '"rejection_sample_method": "standard" (or "block") in --speculative-config, or '
            "serve without the --steer options")
    if va.adaptive_verification(vllm_config):
        raise ValueError(
            "vllm-steer: speculative decoding with enable_adaptive_verification cannot be served "
            "with steers: Model Runner V2 then splits each step's drafts between the requests on "
            "the device, and the host's token and logits offsets, from which each token's and "
            "each verification row's request is mapped, are placeholders (vLLM refuses LoRA "
            "with it for the same reason). Set \"enable_adaptive_verification\": false in "
            "--speculative-config, or serve without the --steer options")


def check_decode_backend(vllm_config) -> None:
    """Refuse a model's own decode executor (vLLM 0.33, ``additional_config={"decode_backend":
    "latency_specialized"}``: DeepSeek-V4.1 and Kimi-K3). It is built after the model is
    loaded, so after the plugin checked the model's logits layer: it runs its decode steps
    through kernels prepared from the decoder blocks' weights, never through the blocks
    themselves (a vector steer's op is skipped), and DeepSeek-V4.1's replaces the model's
    logits layer with its own subclass, which the plugin does not steer."""
    backend = va.decode_backend(vllm_config)
    if backend != "auto":
        raise ValueError(
            f"vllm-steer: additional_config decode_backend={backend!r} cannot be served with "
            "steers: the model's specialized decode executor runs decode steps through its own "
            "kernels (not the decoder blocks the plugin steers) and may replace the model's "
            "logits layer after the plugin checked it, so steered requests would be served "
            "unsteered. Remove decode_backend (vLLM's decode: \"auto\"), or serve without "
            "the --steer options")


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
    dp = va.data_parallel_size(vllm_config)
    if dp <= 1 or not (cfg.steer_dir or cfg.enable_updates):
        return
    flags = " and ".join(f for f, on in (("--steer-dir", cfg.steer_dir),
                                         ("--enable-steer-updates", cfg.enable_updates)) if on)
    modes = va.data_parallel_modes(vllm_config)
    for attr, mode, why in (
            ("data_parallel_external_lb", "external load balancing "
             "(--data-parallel-external-lb / --data-parallel-rank)",
             "each API server manages its own rank's engine core only"),
            ("data_parallel_hybrid_lb", "hybrid load balancing (--data-parallel-hybrid-lb / "
             "--data-parallel-start-rank)", "each node's API servers manage that node's "
             "engine cores only"),
            ("enable_elastic_ep", "elastic expert parallelism (--enable-elastic-ep)",
             "an engine core added when scaling up would not have the run-time steers")):
        if modes.get(attr):
            raise ValueError(
                f"vllm-steer: {flags} cannot be used with --data-parallel-size {dp} in {mode}: "
                f"run-time steers are loaded into each engine core by a call from the API "
                f"server, and {why}, so a steer loaded through one API server would be "
                "unknown to the others' engines. Use vLLM's internal load balancing (the "
                "default of --data-parallel-size), or load every steer at start-up with "
                "--steer NAME=PATH (which works in every data-parallel mode)")


def check_steers_fit(cfg: SteerServerConfig, hidden_size: int, model: str,
                     vllm_config=None) -> None:
    """Load each steer file once (any kind: :mod:`vllm_steer.kinds`) and check it fits the
    model; an engine with decoder-layer steers (vector steers) is checked to be one they can
    be served on (:func:`check_layer_steering`).

    Raises :class:`~vllm_steer.format.SteerFileError` naming each refused file and every
    reason (missing, truncated, pickle, NaN/inf, wrong shape, hidden size mismatch; for a
    vector steer, the model's hidden size, decoder blocks, architecture and name, each
    naming both sides).
    """
    from vllm_steer.format import SteerFileError
    from vllm_steer.kinds import applied_in_layers, load_any

    errors: list[SteerFileError] = []
    if vllm_config is not None and cfg.layers_enabled():
        check_layer_steering(vllm_config)
    for name, path in cfg.steers.items():
        try:
            steer = load_any(path)
        except SteerFileError as e:
            errors.append(e)
            continue
        if applied_in_layers(steer):
            if vllm_config is not None:
                from vllm_steer.integrations.families import model_identity
                from vllm_steer.vectors import model_fit_problems

                reasons = model_fit_problems(steer.metadata,
                                             **model_identity(va.model_config(vllm_config)))
                if reasons:
                    errors.append(SteerFileError(path, [f"steer {name!r}: {r}"
                                                        for r in reasons]))
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


def check_layer_steering(vllm_config) -> None:
    """Refuse, before anything is loaded, the configuration decoder-layer steers (vector
    steers) cannot be served in: sequence parallelism (it splits the residual stream by token
    across the tensor-parallel ranks, and the per-token coefficients are the whole step's),
    micro-batching and prefill context parallelism (the blocks run on a slice or a reordered
    share of the step's tokens), and ``--monokernel`` (decode steps through fused layers).
    Pipeline parallelism is served: each stage holds its own blocks' vectors."""
    if va.sequence_parallelism(vllm_config):
        raise ValueError(
            "vllm-steer: vector steers cannot be served with sequence parallelism "
            "(compilation pass enable_sp): it splits the residual stream by token across the "
            "tensor-parallel ranks, and each step's per-token strengths are the whole step's. "
            "Turn sequence parallelism off, or serve without vector steers")
    if va.monokernel(vllm_config):
        raise ValueError(
            "vllm-steer: vector steers cannot be served with --monokernel: the fused decode "
            "layers it enables (vLLM 0.33, e.g. MiniMax-M3 on ROCm) run decode steps without "
            "the decoder blocks' forward, where a vector steer is added. Serve without "
            "--monokernel, or without vector steers (LM-Steer steers act on the LM head)")
    split = [mode for mode, on in va.token_splitting(vllm_config).items() if on]
    if split:
        raise ValueError(
            f"vllm-steer: vector steers cannot be served with {' and '.join(split)}: the "
            "decoder blocks then run on a slice (or a reordered share) of each step's tokens, "
            "and each step's per-token strengths are the whole step's. Turn it off, or serve "
            "without vector steers (LM-Steer steers act after the blocks, on the whole step)")


#: Our per-request steer state per model runner, ``module:Class`` as vLLM loads custom logits
#: processors (:mod:`vllm_steer.integrations.request_state_v1`, ``request_state_v2``).
REQUEST_STATE_V1 = "vllm_steer.integrations.request_state_v1:SteerRequestStateV1"
REQUEST_STATE_V2 = "vllm_steer.integrations.request_state_v2:SteerRequestStateV2"


def processor_fqcn(vllm_config) -> str:
    """The per-request steer state of the active model runner, as the logits processor vLLM
    loads (named, not imported: no torch; each runner's module imports only its runner's
    logits-processor interface)."""
    if va.uses_v2_runner(vllm_config):
        return REQUEST_STATE_V2
    return REQUEST_STATE_V1
