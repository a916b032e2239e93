"""The vLLM general plugin (entry point ``vllm.general_plugins``: ``vllm_steer``).

vLLM calls :func:`register` in every process it starts (API server, engine core, workers),
and in ``vllm serve`` before the CLI parser is built. It

1. adds ``--steer NAME=PATH`` (repeatable) and ``--steer-max-strength`` to vLLM's engine
   arguments (so they show in ``vllm serve --help``) and carries them to the workers in
   ``additional_config["vllm_steer"]`` (the field vLLM reserves for plugins);
2. on engine config creation, checks the steer files (metadata only, no torch), refuses
   speculative decoding methods it cannot steer (``spec_decode.py`` maps the rows of the
   others), and appends our per-request logits processor for the active model
   runner (V1 or Model Runner V2) to ``model_config.logits_processors``;
3. swaps vLLM's ``LogitsProcessor`` layer for :class:`~vllm_steer.integrations.head.
   SteeredLogitsProcessor` (``register_oot``);
4. adds the top-level ``steer`` field to the OpenAI request models (completions, chat,
   responses), so it shows in the OpenAPI schema and reaches ``SamplingParams.extra_args``.

Offline, pass the same configuration yourself::

    LLM(model, additional_config={"vllm_steer": {"steers": {"detox": "detox.safetensors"}}})
    SamplingParams(extra_args={"steer": {"detox": 5}})

Every hook into vLLM is listed in :data:`HOOKS` (section 0), named after what it patches.
A hook vLLM moved or removed is reported at registration: start-up fails when steers are
configured (naming the vLLM version and the hook), and a warning is logged otherwise.

This module imports no torch at import time.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any, Callable

from vllm_steer import ADDITIONAL_CONFIG_KEY, REQUEST_FIELD
from vllm_steer.config import DEFAULT_MAX_STRENGTH, SteerServerConfig, parse_steer_arg
from vllm_steer.logs import get_logger

logger = get_logger()
_REGISTERED = False

STEER_HELP = (
    "Load a steer (LM-Steer, safetensors) that requests can apply with "
    '`"steer": {"NAME": strength}`. Repeatable. `--steer PATH` takes the name from the file. '
    "Strengths are in units of the steer's epsilon (the paper's 5*eps0 is 5)."
)


def register() -> None:
    """Entry point of the ``vllm.general_plugins`` group. Idempotent."""
    global _REGISTERED
    if _REGISTERED:
        return
    _REGISTERED = True
    install_hooks(HOOKS)


# ---- 0. every hook into vLLM, in one place -----------------------------------------------
# The list itself is HOOKS, at the end of this module (after the functions it names).
@dataclass(frozen=True)
class Hook:
    """One patch point in vLLM."""

    target: str
    """What is patched, ``module:Class.attribute`` (the module is imported to find it)."""
    purpose: str
    """Why the plugin needs it (shown when vLLM moved it)."""
    install: Callable[[Any], None] | None = None
    """Called with the owner of the attribute (``Class``) once the target is found; None:
    only checked here (patched lazily in the worker)."""


class MissingHookError(RuntimeError):
    """A vLLM attribute the plugin hooks into is missing (another vLLM version)."""


SUPPORTED_VLLM = ">=0.32,<0.34"
_MISSING: list[str] = []  # "target (purpose): error" of every hook not found at registration


def resolve(target: str) -> Any:
    """The object named by ``module:Qualified.name``; ImportError/AttributeError if absent."""
    import importlib

    module, _, qualname = target.partition(":")
    obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def install_hooks(hooks) -> list[str]:
    """Install every hook; record (and warn about) each one vLLM does not have."""
    import importlib

    missing = []
    for hook in hooks:
        try:
            resolve(hook.target)
            if hook.install is not None:
                module, _, qualname = hook.target.partition(":")
                hook.install(resolve(module + ":" + qualname.rpartition(".")[0])
                             if "." in qualname else importlib.import_module(module))
        except (ImportError, AttributeError) as e:
            missing.append(f"{hook.target} ({hook.purpose}): {type(e).__name__}: {e}")
    if missing:
        _MISSING.extend(missing)
        logger.warning("vllm-steer: vLLM %s lacks %d patch point(s) of this plugin (supported: "
                       "vllm%s); steering is unavailable and --steer will refuse to start: %s",
                       _vllm_version(), len(missing), SUPPORTED_VLLM, "; ".join(missing))
    return missing


def check_hooks() -> None:
    """Raise :class:`MissingHookError` if a patch point was missing (called when steers are
    configured: at config creation, in ``from_cli_args`` and in each worker)."""
    if _MISSING:
        raise MissingHookError(
            f"vllm-steer: cannot steer on vLLM {_vllm_version()}: it moved or removed "
            f"{len(_MISSING)} patch point(s) of the plugin: {'; '.join(_MISSING)}. This "
            f"vllm-steer supports vllm{SUPPORTED_VLLM}; install a supported vLLM, or serve "
            "without --steer")


def _vllm_version() -> str:
    try:
        from vllm import __version__

        return str(__version__)
    except Exception:  # pragma: no cover
        return "(unknown version)"


# ---- 1. CLI ------------------------------------------------------------------------------
def add_steer_args(parser) -> None:
    """Add our arguments to a vLLM (engine args) parser."""
    if any("--steer" in a.option_strings for a in parser._actions):
        return
    group = parser.add_argument_group(
        title="vllm-steer",
        description="Per-request LM-Steer steering (vllm-steer plugin). Requests send "
                    '`"steer": {"detox": 5}` (OpenAI extra_body), or '
                    '`vllm_xargs={"steer": "detox:5,sentiment:-3"}`.')
    group.add_argument("--steer", action="append", default=None, metavar="NAME=PATH",
                       help=STEER_HELP)
    group.add_argument("--steer-max-strength", type=float, default=DEFAULT_MAX_STRENGTH,
                       help="Largest |strength| a request may use.")
    group.add_argument("--steer-backend", default="auto",
                       choices=["auto", "reference", "torch", "triton"],
                       help="Implementation of the batched steer op.")
    group.add_argument("--max-steers", type=int, default=None, metavar="N",
                       help="Steers that may be loaded at once (slots sized up front). "
                            "Default: the number of --steer, at least 8.")
    group.add_argument("--max-steer-rank", type=int, default=None, metavar="R",
                       help="Refuse steers of a larger rank.")
    group.add_argument("--steer-dir", default=None, metavar="DIR",
                       help="A request naming a steer that is not loaded loads "
                            "DIR/NAME.safetensors on first use.")
    group.add_argument("--enable-steer-updates", action="store_true", default=False,
                       help="Allow POST /v1/steers and DELETE /v1/steers/NAME (load and "
                            "unload steers at run time).")
    group.add_argument("--no-steer-drafter", dest="steer_drafter", action="store_false",
                       default=True,
                       help="Speculative decoding: do not steer the draft model's proposals "
                            "(the output follows the steered target either way; steering the "
                            "drafter keeps acceptance up).")
    group.add_argument("--steer-updates-any-path", action="store_true", default=False,
                       help="With --enable-steer-updates: POST /v1/steers may load files "
                            "outside --steer-dir.")
    group.add_argument("--steer-preset", action="append", default=None,
                       metavar="NAME=STEER:X[,STEER:X...]",
                       help="Serve a steer mix as a model name: listed in /v1/models, and a "
                            'request with "model": NAME gets the mix (a steer field on the '
                            "request replaces the preset's value of each steer it names). "
                            "Repeatable.")
    group.add_argument("--steer-default", action="append", default=None,
                       metavar="STEER=X",
                       help="Strength applied to every request that names neither the steer "
                            "nor a preset naming it (a request may override it, also with 0). "
                            "Repeatable.")
    group.add_argument("--steer-floor", action="append", default=None, metavar="STEER=X",
                       help="Least (signed) strength a request is served with; a request "
                            "asking for less is served at X and the response header "
                            "x-vllm-steer-floored names the steer. Repeatable.")


def config_from_args(args: argparse.Namespace) -> SteerServerConfig | None:
    steers = getattr(args, "steer", None) or []
    policy = _policy_args(args)
    if not (steers or getattr(args, "steer_dir", None)
            or getattr(args, "enable_steer_updates", False)):
        if policy:
            raise ValueError(f"vllm-steer: --steer-{'/'.join(k.rstrip('s') for k in policy)} "
                             "given without any steer; load the steers they name with "
                             "--steer NAME=PATH (or --steer-dir DIR)")
        return None
    pairs = [parse_steer_arg(s) for s in steers]
    names = [n for n, _ in pairs]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"--steer: the name(s) {dup} are given more than once; use NAME=PATH "
                         "to give each steer its own name")
    cfg = SteerServerConfig(steers=dict(pairs),
                             max_strength=getattr(args, "steer_max_strength",
                                                  DEFAULT_MAX_STRENGTH),
                             backend=getattr(args, "steer_backend", "auto"),
                             steer_drafter=bool(getattr(args, "steer_drafter", True)),
                             **_runtime_args(args), **policy)
    if policy:
        check_policy_config(cfg, _reserved_model_names(args))
    return cfg


def _runtime_args(args: argparse.Namespace) -> dict:
    """Run-time steer management flags (issue 15) as SteerServerConfig fields."""
    steer_dir = getattr(args, "steer_dir", None)
    if steer_dir is not None:
        import os

        if not os.path.isdir(steer_dir):
            raise ValueError(f"--steer-dir {steer_dir!r}: not a directory")
        steer_dir = os.path.abspath(steer_dir)
    if getattr(args, "enable_steer_updates", False):
        logger.warning("vllm-steer: --enable-steer-updates is on: POST /v1/steers and "
                       "DELETE /v1/steers/NAME can load and unload steers at run time. Do not "
                       "expose this server to untrusted clients.")
    return dict(max_steers=getattr(args, "max_steers", None),
                max_steer_rank=getattr(args, "max_steer_rank", None), steer_dir=steer_dir,
                enable_updates=bool(getattr(args, "enable_steer_updates", False)),
                updates_any_path=bool(getattr(args, "steer_updates_any_path", False)))


def _policy_args(args: argparse.Namespace) -> dict:
    """``--steer-preset`` / ``--steer-default`` / ``--steer-floor`` as SteerServerConfig
    fields (only those given)."""
    from vllm_steer.policy import PolicyError, parse_preset_arg, parse_value_arg

    out: dict = {}
    presets: dict = {}
    for arg in getattr(args, "steer_preset", None) or []:
        name, mix = parse_preset_arg(arg)
        if name in presets:
            raise PolicyError(f"--steer-preset {name}: given twice; give each preset once")
        presets[name] = mix
    if presets:
        out["presets"] = presets
    for flag, key in (("--steer-default", "defaults"), ("--steer-floor", "floors")):
        values: dict = {}
        for arg in getattr(args, flag[2:].replace("-", "_"), None) or []:
            for name, v in parse_value_arg(arg, flag).items():
                if name in values:
                    raise PolicyError(f"{flag} {name}: given twice; give each steer once")
                values[name] = v
        if values:
            out[key] = values
    return out


def _reserved_model_names(args: argparse.Namespace) -> dict[str, str]:
    """Model names a preset may not take: the served model name(s) and the LoRA modules."""
    out: dict[str, str] = {}
    served = getattr(args, "served_model_name", None) or [getattr(args, "model", None)]
    for n in ([served] if isinstance(served, str) else served):
        if n:
            out[str(n)] = "the served model name"
    for m in getattr(args, "lora_modules", None) or []:
        name = getattr(m, "name", None) or (str(m).split("=", 1)[0] if m else None)
        if name:
            out[name] = "a LoRA module (--lora-modules)"
    return out


def check_policy_config(cfg: SteerServerConfig, reserved: dict[str, str] | None = None) -> None:
    """Start-up check of presets, defaults and floors (:func:`vllm_steer.policy.
    check_policy`): the steers they name are loaded (or files of ``--steer-dir``), the
    strengths within ``--steer-max-strength``, preset names clash with no model name."""
    import os

    from vllm_steer.policy import check_policy

    names = set(cfg.steers)
    if cfg.steer_dir and os.path.isdir(cfg.steer_dir):
        names |= {f[:-len(".safetensors")] for f in os.listdir(cfg.steer_dir)
                  if f.endswith(".safetensors")}
    check_policy(cfg.presets, cfg.defaults, cfg.floors, names, cfg.max_strength, reserved)


def _hook_add_cli_args(engine_args_cls) -> None:
    orig_add = engine_args_cls.add_cli_args

    def add_cli_args(parser, *a, **kw):
        parser = orig_add(parser, *a, **kw)
        add_steer_args(parser)
        return parser

    engine_args_cls.add_cli_args = staticmethod(add_cli_args)


def _hook_from_cli_args(engine_args_cls) -> None:
    orig_from = engine_args_cls.from_cli_args.__func__

    def from_cli_args(cls, args: argparse.Namespace):
        cfg = config_from_args(args)
        if cfg is not None:
            check_hooks()
            # Written back into the namespace: the API servers of --api-server-count N /
            # --data-parallel-size N are spawned with this namespace and build their engine
            # args from it *before* vLLM loads plugins there (so before this hook exists in
            # that process); vLLM's own from_cli_args then copies additional_config.
            extra = dict(getattr(args, "additional_config", None) or {})
            extra.update(cfg.to_additional_config())
            args.additional_config = extra
        engine_args = orig_from(cls, args)
        if cfg is not None:
            extra = dict(engine_args.additional_config or {})
            extra.update(cfg.to_additional_config())
            engine_args.additional_config = extra
        return engine_args

    engine_args_cls.from_cli_args = classmethod(from_cli_args)


def _hook_create_engine_config(engine_args_cls) -> None:
    orig_create = engine_args_cls.create_engine_config

    def create_engine_config(self, *a, **kw):
        vllm_config = orig_create(self, *a, **kw)
        configure_engine(vllm_config)
        return vllm_config

    engine_args_cls.create_engine_config = create_engine_config


def _hook_input_processor(input_processor_cls) -> None:
    """Every frontend process (also each of `--api-server-count N`) learns the steer names
    and limits from its own config, for ``validate_params`` at admission. Without our logits
    processor (no steers loaded), the steer field is still checked there: a request asking
    for a non-zero steer is refused, never served unsteered."""
    from vllm_steer.integrations import frontend

    orig = input_processor_cls.__init__

    def __init__(self, vllm_config, *a, **kw):
        frontend.set_config(SteerServerConfig.from_additional_config(
            vllm_config.additional_config))
        from vllm_steer.integrations.control import _head_input_size

        frontend.set_model_hidden_size(_head_input_size(vllm_config.model_config))
        orig(self, vllm_config, *a, **kw)
        procs = [str(p) for p in (vllm_config.model_config.logits_processors or [])]
        if _processor_fqcn(vllm_config) not in procs:
            inner = self.validate_logits_processors_params

            def validate(params):
                frontend.validate(params)
                inner(params)

            self.validate_logits_processors_params = validate

    input_processor_cls.__init__ = __init__


def configure_engine(vllm_config) -> None:
    """Check the steers, refuse what we cannot steer, and install our logits processor."""
    from vllm_steer.integrations import frontend

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
    mapped to their requests by :mod:`vllm_steer.integrations.spec_decode`, for the methods in
    its ``SUPPORTED_METHODS``; any other method, or Model Runner V2, is refused here."""
    spec = vllm_config.speculative_config
    if spec is None:
        return
    from vllm_steer.integrations.spec_decode import SUPPORTED_METHODS

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
        return "vllm_steer.integrations.v2:SteerLogitsProcessorV2"
    return "vllm_steer.integrations.v1:SteerLogitsProcessorV1"


# ---- 3. the LM head ----------------------------------------------------------------------
def _hook_register_head(logits_processor_cls) -> None:
    from vllm.model_executor.custom_op import op_registry_oot

    from vllm_steer.integrations.head import SteeredLogitsProcessor

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
            from vllm_steer.integrations.head import check_head_installed

            check_hooks()
            check_head_installed(model)
        return model

    load_model._vllm_steer = True
    return load_model


def _hook_refuse_beam_search(request_cls) -> None:
    """vLLM's beam search builds its own per-step ``SamplingParams`` with no ``extra_args``:
    a steer would be dropped silently. Refuse a steered beam-search request (HTTP 400)."""
    orig = request_cls.to_beam_search_params
    if getattr(orig, "_vllm_steer", False):
        return

    def to_beam_search_params(self, *a, **kw):
        refuse_steered_beam_search(self)
        return orig(self, *a, **kw)

    to_beam_search_params._vllm_steer = True
    request_cls.to_beam_search_params = to_beam_search_params


def refuse_steered_beam_search(request) -> None:
    """Raise (HTTP 400) if a beam-search request carries a bad or non-zero steer."""
    from types import SimpleNamespace

    from vllm_steer.config import parse_request_steer
    from vllm_steer.integrations import frontend

    values = [getattr(request, REQUEST_FIELD, None),
              (getattr(request, "vllm_xargs", None) or {}).get(REQUEST_FIELD)]
    for value in values:
        if value is None:
            continue
        frontend.validate(SimpleNamespace(extra_args={REQUEST_FIELD: value}))  # bad: 400
        if parse_request_steer(value, None, float("inf")):
            msg = (f"{REQUEST_FIELD}: beam search (use_beam_search) cannot be steered: vLLM's "
                   "beam search runs its own per-step sampling without the request's steer, "
                   "so it would be silently dropped; send the request without use_beam_search "
                   "(or without the steer)")
            try:
                from vllm.exceptions import VLLMValidationError
            except ImportError:  # pragma: no cover
                raise ValueError(msg) from None
            raise VLLMValidationError(msg, parameter="use_beam_search")


# ---- 4. request field --------------------------------------------------------------------
REQUEST_CLASSES = (
    ("vllm.entrypoints.openai.completion.protocol", "CompletionRequest"),
    ("vllm.entrypoints.openai.chat_completion.protocol", "ChatCompletionRequest"),
    ("vllm.entrypoints.openai.responses.protocol", "ResponsesRequest"),
)
FIELD_DESCRIPTION = (
    "vllm-steer: steers to apply to this request, as a mapping from steer name (as loaded with "
    "`vllm serve --steer NAME=PATH`) to strength in units of the steer's epsilon, e.g. "
    '{"detox": 5, "sentiment": -3}. Negative strengths steer the other way; omitted or 0 '
    "means unsteered. Equivalent: vllm_xargs={\"steer\": \"detox:5,sentiment:-3\"}."
)


def add_request_field(cls) -> None:
    """Add the ``steer`` field to a pydantic request model, check it (and
    ``vllm_xargs["steer"]``) when the request body is parsed, and carry it to SamplingParams.

    The check is a pydantic model validator, so a bad value is a validation error (HTTP 400,
    ``param: "steer"``) before any endpoint runs, streaming or not.
    """
    from typing import Any, Optional, Union

    from pydantic import Field
    from pydantic._internal._decorators import Decorator, ModelValidatorDecoratorInfo
    from pydantic.fields import FieldInfo

    from vllm_steer.integrations import frontend

    if REQUEST_FIELD in cls.model_fields:
        return
    ann = Optional[dict[str, Union[float, int, str, Any]]]
    cls.__pydantic_fields__[REQUEST_FIELD] = FieldInfo.from_annotated_attribute(
        ann, Field(default=None, description=FIELD_DESCRIPTION,
                   examples=[{"detox": 5}, {"detox": 5, "sentiment": -3}]))
    cls.__annotations__[REQUEST_FIELD] = ann
    if hasattr(cls, "field_names"):
        cls.field_names = None

    def _vllm_steer_check(self):
        frontend.check_request_fields(getattr(self, REQUEST_FIELD, None),
                                      getattr(self, "vllm_xargs", None))
        return self

    setattr(cls, _VALIDATOR_NAME, _vllm_steer_check)
    cls.__pydantic_decorators__.model_validators[_VALIDATOR_NAME] = Decorator.build(
        cls, cls_var_name=_VALIDATOR_NAME, shim=None,
        info=ModelValidatorDecoratorInfo(mode="after"))
    cls.model_rebuild(force=True)

    orig = cls.to_sampling_params

    def to_sampling_params(self, *a, **kw):
        params = orig(self, *a, **kw)
        value = getattr(self, REQUEST_FIELD, None)
        if value is not None:
            extra = dict(params.extra_args or {})
            if REQUEST_FIELD in extra:  # also refused when the request was parsed
                raise frontend.field_error(f"{REQUEST_FIELD}: given both as a top-level field "
                                           "and in vllm_xargs; use one")
            extra[REQUEST_FIELD] = value
            params.extra_args = extra
        return params

    cls.to_sampling_params = to_sampling_params


_VALIDATOR_NAME = "_vllm_steer_check"


# ---- 5. run-time steer management (vllm_steer.integrations.control) ----------------------
def _hook_engine_core(engine_core_cls) -> None:
    """``EngineCore.collective_rpc`` answers :data:`registry.CONTROL_METHOD` in the engine core
    (load / unload / list, forwarded to every worker by the executor's own collective_rpc);
    ``EngineCore.add_request`` binds each request's steers to (slot, generation)."""
    EngineCore = engine_core_cls
    from vllm_steer.integrations import control
    from vllm_steer.integrations.registry import CONTROL_METHOD

    orig_rpc, orig_add = EngineCore.collective_rpc, EngineCore.add_request
    if getattr(orig_add, "_vllm_steer", False):
        return

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        if method == CONTROL_METHOD:
            return [control.handle(self, *args)]
        return orig_rpc(self, method, timeout, args, kwargs)

    def add_request(self, request, request_wave: int = 0):
        try:
            control.apply_policy(self, request)
            control.bind_request(self, request)
        except control.SteerAdmissionError as e:
            if getattr(self, "output_queue", None) is None:  # engine core in this process
                raise  # (offline): the caller sees it
            logger.warning("vllm-steer: request %s refused: %s", request.request_id, e)
            send_refusal(self, request, str(e))
            return
        return orig_add(self, request, request_wave)

    add_request._vllm_steer = True
    EngineCore.collective_rpc = collective_rpc
    EngineCore.add_request = add_request


def send_refusal(core, request, message: str) -> None:
    """Finish ``request`` at once with vLLM's error output (as
    ``EngineCore._send_error_outputs_to_client`` does), its ``stop_reason`` carrying
    :data:`registry.REFUSED_PREFIX` and ``message``: the API server's ``AsyncLLM.generate``
    hook turns it into the client's HTTP 400 instead of vLLM's generic 500."""
    from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs, FinishReason

    from vllm_steer.integrations.registry import REFUSED_PREFIX

    out = EngineCoreOutput(request.request_id, [], finish_reason=FinishReason.ERROR,
                           stop_reason=REFUSED_PREFIX + message)
    core.output_queue.put_nowait(
        (request.client_index, EngineCoreOutputs(finished_requests={request.request_id},
                                                 outputs=[out])))


def _hook_async_llm_generate(async_llm_cls) -> None:
    """``AsyncLLM.generate`` (the API server) raises ``VLLMValidationError`` (HTTP 400,
    ``param: "steer"``; the error event of a stream) when the engine core refused the
    request's steer at admission (see :func:`send_refusal`): a steer unloaded, or not yet
    loaded, in the engine while this API server's view of the names was a moment old."""
    AsyncLLM = async_llm_cls
    orig = AsyncLLM.generate
    if getattr(orig, "_vllm_steer", False):
        return

    async def generate(self, *args, **kwargs):
        from vllm_steer.integrations.registry import REFUSED_PREFIX

        agen = orig(self, *args, **kwargs)
        try:
            async for out in agen:
                for o in getattr(out, "outputs", None) or ():
                    reason = getattr(o, "stop_reason", None)
                    if isinstance(reason, str) and reason.startswith(REFUSED_PREFIX):
                        from vllm.exceptions import VLLMValidationError

                        raise VLLMValidationError(reason[len(REFUSED_PREFIX):],
                                                  parameter=REQUEST_FIELD)
                yield out
        finally:
            await agen.aclose()

    generate._vllm_steer = True
    AsyncLLM.generate = generate


def _hook_endpoint_plugins(plugins) -> None:
    """Serve ``/v1/steers`` (vllm_steer.server.steers_route) on every API server that steers:
    vLLM's endpoint-plugin loader also returns our plugin, whatever ``VLLM_PLUGINS`` says (the
    write routes stay off without ``--enable-steer-updates``)."""
    orig = plugins.load_endpoint_plugins
    if getattr(orig, "_vllm_steer", False):
        return

    def load_endpoint_plugins(supported_tasks=None):
        found = list(orig(supported_tasks))
        from vllm_steer.integrations import frontend

        cfg = frontend.get_config()
        if cfg is not None and cfg.enabled and not any(
                getattr(p, "name", None) == "vllm_steer_steers" for p in found):
            from vllm_steer.server.steers_route import SteerManagementEndpoint

            found.append(SteerManagementEndpoint())
        return found

    load_endpoint_plugins._vllm_steer = True
    plugins.load_endpoint_plugins = load_endpoint_plugins


def _hook_async_llm(async_llm_cls) -> None:
    """``AsyncLLM.add_request`` (the API server) loads a ``--steer-dir`` steer a request names
    before admitting it, so a refusal (bad file, capacity full) is an HTTP 400 with the reason.
    (The engine core binds, and loads on first use, anyway: this only surfaces the errors.)"""
    AsyncLLM = async_llm_cls
    orig = AsyncLLM.add_request
    if getattr(orig, "_vllm_steer", False):
        return

    async def add_request(self, request_id, prompt, params, *args, **kwargs):
        from vllm_steer.integrations import frontend

        cfg = frontend.get_config()
        if cfg is not None and cfg.steer_dir:
            await _preload_dir_steers(self, cfg, params)
        return await orig(self, request_id, prompt, params, *args, **kwargs)

    add_request._vllm_steer = True
    AsyncLLM.add_request = add_request


async def _preload_dir_steers(engine, cfg, params) -> None:
    import os

    from vllm_steer.config import SteerRequestError, parse_request_steer
    from vllm_steer.integrations import frontend
    from vllm_steer.integrations.registry import dir_path, name_problem

    value = (getattr(params, "extra_args", None) or {}).get(REQUEST_FIELD)
    if value is None:
        return
    try:
        names = [n for n, s in parse_request_steer(value, None, cfg.max_strength).items() if s]
    except SteerRequestError:
        return  # validation refuses it with the reason
    loaded = frontend.loaded_names()
    for name in names:
        if name in loaded or name_problem(name):
            continue
        try:
            frontend._check_unloaded({name: 1}, cfg)  # name, file, header, hidden size
            path = dir_path(cfg.steer_dir, name)
        except (SteerRequestError, ValueError):
            return  # validation refuses it with the reason
        if not os.path.isfile(path):
            return
        from vllm_steer.server.steers_route import control

        res = await control(engine, "load", name=name, path=path, source="steer-dir")
        if not res["ok"] and name not in frontend.loaded_names():
            from vllm.exceptions import VLLMValidationError

            raise VLLMValidationError(f"{REQUEST_FIELD}: {res['error']}",
                                      parameter=REQUEST_FIELD)


# ---- 6. speculative decoding (vllm_steer.integrations.spec_decode) ------------------------
def _hook_spec_decode(runner_cls) -> None:
    """V1 runner: map the verification rows (and a draft model's rows) to their requests."""
    from vllm_steer.integrations.spec_decode import wrap_runner

    wrap_runner(runner_cls)


def _hook_spec_decode_logitsprocs(runner_module) -> None:
    """V1 runner: build our (logits-neutral) processor under speculative decoding too."""
    from vllm_steer.integrations.spec_decode import allow_steer_processor

    allow_steer_processor(runner_module)


# ---- 7. presets as model names, defaults and floors (vllm_steer.policy) --------------------
def presets() -> dict[str, dict[str, float]]:
    """The presets this process serves as model names: its ``--steer-preset`` ones and the
    run-time ones as it last read them (:mod:`vllm_steer.integrations.presets`)."""
    from vllm_steer.integrations import frontend
    from vllm_steer.integrations import presets as runtime

    cfg = frontend.get_config()
    if cfg is None or not cfg.enabled:
        return {}
    return {**cfg.presets, **runtime.view()} if cfg.enable_updates else dict(cfg.presets)


def _runtime_presets_on() -> bool:
    from vllm_steer.integrations import frontend

    cfg = frontend.get_config()
    return cfg is not None and cfg.enabled and cfg.enable_updates


def _hook_check_model(serving_cls) -> None:
    """``BaseServing._check_model`` (every OpenAI route's model check): with
    ``--enable-steer-updates``, a ``model`` that is not the served model, a ``--steer-preset``
    preset or a LoRA adapter may be a preset added (or deleted) at run time through any API
    server: read the engine core's table first (one utility call), and pin the mix read for
    this request's ``to_sampling_params``."""
    orig = serving_cls._check_model
    if getattr(orig, "_vllm_steer", False):
        return

    async def _check_model(self, request, *a, **kw):
        name = getattr(request, "model", None)
        if isinstance(name, str) and name and _runtime_presets_on():
            from vllm_steer.integrations import frontend
            from vllm_steer.integrations import presets as runtime
            from vllm_steer.server.presets_route import pin_preset

            models = self.models
            static = (name in frontend.get_config().presets
                      or any(b.name == name for b in models.base_model_paths)
                      or name in (getattr(models, "lora_requests", None) or {}))
            if not static:
                pin_preset(name, (await runtime.refresh()).get(name))
        return await orig(self, request, *a, **kw)

    _check_model._vllm_steer = True
    serving_cls._check_model = _check_model


def _hook_model_registry(registry_cls) -> None:
    """``OpenAIModelRegistry`` (behind ``OpenAIServingModels``): a preset name is a served
    model name (``is_base_model``, so every route's model check admits it) and is listed in
    ``/v1/models`` as its own card (parent: the base model; its mix in a ``steer`` field),
    like vLLM lists ``--lora-modules``."""
    orig_is_base, orig_show = registry_cls.is_base_model, registry_cls.show_available_models
    if getattr(orig_is_base, "_vllm_steer", False):
        return

    def is_base_model(self, model_name):
        if orig_is_base(self, model_name):
            return True
        if not isinstance(model_name, str):
            return False
        from vllm_steer.server.presets_route import pinned_preset

        pinned, mix = pinned_preset(model_name)  # what this request's model check read
        return bool(mix) if pinned else model_name in presets()

    async def show_available_models(self):
        from vllm.entrypoints.serve.engine.protocol import ModelCard, ModelPermission

        if _runtime_presets_on():  # run-time presets: the engine core's table as of now
            from vllm_steer.integrations import presets as runtime

            await runtime.refresh()
        models = await orig_show(self)
        base = self.base_model_paths[0]
        models.data.extend(ModelCard(id=name, root=base.model_path, parent=base.name,
                                     max_model_len=self.model_config.max_model_len,
                                     permission=[ModelPermission()], steer=dict(mix))
                           for name, mix in presets().items())
        return models

    is_base_model._vllm_steer = True
    registry_cls.is_base_model = is_base_model
    registry_cls.show_available_models = show_available_models


def _hook_preset_request(cls) -> None:
    """``to_sampling_params`` of an OpenAI request model: a request whose ``model`` is a preset
    gets the preset's mix under its own ``steer`` (precedence: :mod:`vllm_steer.policy`), and
    the response headers (:mod:`vllm_steer.server.presets_route`) learn what is applied after
    defaults and floors. (The engine core applies defaults and floors itself:
    :func:`vllm_steer.integrations.control.apply_policy`.)"""
    orig = cls.to_sampling_params
    if getattr(orig, "_vllm_steer_preset", False):
        return

    def to_sampling_params(self, *a, **kw):
        params = orig(self, *a, **kw)
        apply_preset(params, getattr(self, "model", None))
        return params

    to_sampling_params._vllm_steer_preset = True
    cls.to_sampling_params = to_sampling_params


def apply_preset(params, model: str | None) -> None:
    """Write ``model``'s preset (if it is one) under the request's steer, and record the
    applied steers for the response headers."""
    from vllm_steer import policy
    from vllm_steer.integrations import frontend

    cfg = frontend.get_config()
    if cfg is None or not cfg.enabled:
        return
    extra = dict(params.extra_args or {})
    value = extra.get(REQUEST_FIELD)
    preset = None
    if isinstance(model, str):
        from vllm_steer.server.presets_route import pinned_preset

        pinned, preset = pinned_preset(model)  # what this request's model check read
        if not pinned:
            preset = presets().get(model)
    if preset:
        value = policy.with_preset(value, preset)
        extra[REQUEST_FIELD] = value
        params.extra_args = extra
    from vllm_steer.server.presets_route import record_applied

    record_applied(*policy.resolve(value, None, cfg.defaults, cfg.floors))


def _hook_endpoint_presets(plugins) -> None:
    """The response headers (a middleware) and ``GET /v1/steer-presets``
    (vllm_steer.server.presets_route) on every API server that steers."""
    orig = plugins.load_endpoint_plugins
    if getattr(orig, "_vllm_steer_presets", False):
        return

    def load_endpoint_plugins(supported_tasks=None):
        found = list(orig(supported_tasks))
        from vllm_steer.integrations import frontend

        cfg = frontend.get_config()
        if cfg is not None and cfg.enabled and not any(
                getattr(p, "name", None) == "vllm_steer_presets" for p in found):
            from vllm_steer.server.presets_route import PresetsEndpoint

            found.append(PresetsEndpoint())
        return found

    load_endpoint_plugins._vllm_steer_presets = True
    plugins.load_endpoint_plugins = load_endpoint_plugins


# ---- the hook list (section 0) -----------------------------------------------------------
# Patched lazily in the worker (v1.py, v2.py) but checked here, in every process.
_WORKER_HOOKS = (
    ("vllm.v1.sample.logits_processor:LogitsProcessor", "V1 per-request steer state"),
    ("vllm.v1.sample.logits_processor:BatchUpdate", "V1 per-request steer state"),
    ("vllm.v1.worker.gpu_model_runner:GPUModelRunner._get_prompt_logprobs_dict",
     "steered prompt logprobs (V1)"),
    ("vllm.v1.worker.gpu_model_runner:GPUModelRunner._prepare_inputs",
     "generated-token positions of the batch rows for generation windows (V1)"),
    ("vllm.v1.worker.gpu_input_batch:InputBatch.__init__",
     "no output-token tracking for our processor (V1)"),
    ("vllm.v1.worker.gpu.sample.logits_processor:LogitsProcessor",
     "V2 per-request steer state"),
    ("vllm.v1.worker.gpu.model_runner:GPUModelRunner.sample",
     "the step's row -> request mapping (V2)"),
    ("vllm.v1.worker.gpu.sample.prompt_logprob:PromptLogprobsWorker.compute_prompt_logprobs",
     "steered prompt logprobs (V2)"),
    ("vllm.v1.worker.gpu.sample.prompt_logprob:PromptLogprobsWorker."
     "compute_prompt_token_id_logprobs", "steered prompt logprobs (V2, prompt_logprob_token_ids)"),
    ("vllm.v1.worker.gpu.sample.batch_shard:BatchSharder.shard_sampler_inputs",
     "rows of batch-sharded sampling (V2, --enable-batch-sharded-sampling)"),
)

HOOKS: tuple[Hook, ...] = (
    Hook("vllm.engine.arg_utils:EngineArgs.add_cli_args", "--steer flags in vllm serve",
         _hook_add_cli_args),
    Hook("vllm.engine.arg_utils:EngineArgs.from_cli_args",
         "--steer carried in additional_config", _hook_from_cli_args),
    Hook("vllm.engine.arg_utils:EngineArgs.create_engine_config",
         "start-up checks and our logits processor", _hook_create_engine_config),
    Hook("vllm.v1.engine.input_processor:InputProcessor.__init__",
         "refusing bad steers at admission (HTTP 400)", _hook_input_processor),
    Hook("vllm.v1.engine.input_processor:InputProcessor._build_logits_processors_params_"
         "validator", "refusing bad steers at admission (HTTP 400)"),
    Hook("vllm.model_executor.layers.logits_processor:LogitsProcessor.register_oot",
         "the steered LM head", _hook_register_head),
    Hook("vllm.model_executor.model_loader.base_loader:BaseModelLoader.load_model",
         "checking the model's logits layer is the steered head", _hook_model_loaders),
    *(Hook(f"{module}:{name}.to_sampling_params", "the `steer` request field",
           add_request_field)
      for module, name in REQUEST_CLASSES),
    *(Hook(f"{module}:{name}.to_beam_search_params", "refusing steered beam search",
           _hook_refuse_beam_search)
      for module, name in REQUEST_CLASSES if name != "ResponsesRequest"),
    *(Hook(target, purpose) for target, purpose in _WORKER_HOOKS),
    # steers at run time (section 5)
    Hook("vllm.v1.engine.core:EngineCore.collective_rpc",
         "loading/unloading steers in the engine core (collective_rpc)", _hook_engine_core),
    Hook("vllm.v1.engine.core:EngineCore.add_request",
         "binding a request's steers to (slot, generation) at admission"),
    Hook("vllm.plugins:load_endpoint_plugins", "the /v1/steers routes",
         _hook_endpoint_plugins),
    # speculative decoding (section 6)
    Hook("vllm.v1.worker.gpu_model_runner:GPUModelRunner.execute_model",
         "speculative decoding: the step's verification rows -> requests (V1)",
         _hook_spec_decode),
    Hook("vllm.v1.worker.gpu_model_runner:build_logitsprocs",
         "speculative decoding: our per-request steer state (V1 refuses custom processors)",
         _hook_spec_decode_logitsprocs),
    Hook("vllm.v1.worker.gpu_model_runner:GPUModelRunner._calc_spec_decode_metadata",
         "speculative decoding: draft-token counts per request (V1)"),
    Hook("vllm.v1.worker.gpu_model_runner:GPUModelRunner.propose_draft_token_ids",
         "speculative decoding: the drafter's rows -> requests (V1)"),
    Hook("vllm.v1.engine.async_llm:AsyncLLM.add_request",
         "--steer-dir steers loaded before admission (HTTP 400 with the reason)",
         _hook_async_llm),
    Hook("vllm.v1.engine.async_llm:AsyncLLM.generate",
         "an engine-side steer refusal answered as HTTP 400, not 500", _hook_async_llm_generate),
    Hook("vllm.v1.engine:EngineCoreOutput.stop_reason",
         "the engine-side steer refusal's message (error output's stop_reason)"),
    # presets, defaults and floors (section 7)
    Hook("vllm.entrypoints.openai.models.serving:OpenAIModelRegistry.is_base_model",
         "presets served as model names", _hook_model_registry),
    Hook("vllm.entrypoints.openai.models.serving:OpenAIModelRegistry.show_available_models",
         "presets listed in /v1/models"),
    *(Hook(f"{module}:{name}.to_sampling_params", "a preset's mix for its model name",
           _hook_preset_request)
      for module, name in REQUEST_CLASSES),
    Hook("vllm.plugins:load_endpoint_plugins", "the x-vllm-steer-applied response headers",
         _hook_endpoint_presets),
    Hook("vllm.entrypoints.serve.engine.serving:BaseServing._check_model",
         "presets added or deleted at run time, seen by every API server", _hook_check_model),
)
