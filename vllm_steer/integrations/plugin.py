"""The vLLM general plugin (entry point ``vllm.general_plugins``: ``vllm_steer``).

vLLM calls :func:`register` in every process it starts (API server, engine core, workers),
and in ``vllm serve`` before the CLI parser is built. It

1. adds ``--steer NAME=PATH`` (repeatable) and ``--steer-max-strength`` to vLLM's engine
   arguments (so they show in ``vllm serve --help``) and carries them to the workers in
   ``additional_config["vllm_steer"]`` (the field vLLM reserves for plugins);
2. on engine config creation, checks the steer files (metadata only, no torch), refuses
   speculative decoding, and appends our per-request logits processor for the active model
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
    group.add_argument("--steer-updates-any-path", action="store_true", default=False,
                       help="With --enable-steer-updates: POST /v1/steers may load files "
                            "outside --steer-dir.")


def config_from_args(args: argparse.Namespace) -> SteerServerConfig | None:
    steers = getattr(args, "steer", None) or []
    if not (steers or getattr(args, "steer_dir", None)
            or getattr(args, "enable_steer_updates", False)):
        return None
    pairs = [parse_steer_arg(s) for s in steers]
    names = [n for n, _ in pairs]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"--steer: the name(s) {dup} are given more than once; use NAME=PATH "
                         "to give each steer its own name")
    return SteerServerConfig(steers=dict(pairs),
                             max_strength=getattr(args, "steer_max_strength",
                                                  DEFAULT_MAX_STRENGTH),
                             backend=getattr(args, "steer_backend", "auto"),
                             **_runtime_args(args))


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
    if vllm_config.speculative_config is not None:
        raise ValueError("vllm-steer: speculative decoding is not supported with --steer (draft "
                         "tokens would be proposed unsteered and verified with several rows per "
                         "request); remove --speculative-config or the --steer options")
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


def check_runtime_steers_fit_parallelism(cfg: SteerServerConfig, vllm_config) -> None:
    """Run-time steers (``--steer-dir``, ``--enable-steer-updates``) are kept by one engine
    core; with several (data parallelism) a load would reach one of them, and requests routed
    to another would be refused or unsteered. Refused at start-up until that is covered."""
    dp = getattr(getattr(vllm_config, "parallel_config", None), "data_parallel_size", 1) or 1
    if dp > 1 and (cfg.steer_dir or cfg.enable_updates):
        flags = [f for f, on in (("--steer-dir", cfg.steer_dir),
                                 ("--enable-steer-updates", cfg.enable_updates)) if on]
        raise ValueError(f"vllm-steer: {' and '.join(flags)} cannot be used with "
                         f"--data-parallel-size {dp}: run-time steers are loaded into one engine "
                         "core, and requests routed to the others would not see them. Serve "
                         "with --data-parallel-size 1, or load every steer at start-up with "
                         "--steer NAME=PATH (data parallelism works with those)")


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
            control.bind_request(self, request)
        except control.SteerAdmissionError as e:
            send = getattr(self, "_send_error_outputs_to_client", None)
            if send is None:  # engine core in this process (offline): the caller sees it
                raise
            logger.warning("vllm-steer: request %s refused: %s", request.request_id, e)
            send([request.request_id], request.client_index)
            return
        return orig_add(self, request, request_wave)

    add_request._vllm_steer = True
    EngineCore.collective_rpc = collective_rpc
    EngineCore.add_request = add_request


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


# ---- the hook list (section 0) -----------------------------------------------------------
# Patched lazily in the worker (v1.py, v2.py) but checked here, in every process.
_WORKER_HOOKS = (
    ("vllm.v1.sample.logits_processor:LogitsProcessor", "V1 per-request steer state"),
    ("vllm.v1.sample.logits_processor:BatchUpdate", "V1 per-request steer state"),
    ("vllm.v1.worker.gpu_model_runner:GPUModelRunner._get_prompt_logprobs_dict",
     "steered prompt logprobs (V1)"),
    ("vllm.v1.worker.gpu_input_batch:InputBatch.__init__",
     "no output-token tracking for our processor (V1)"),
    ("vllm.v1.worker.gpu.sample.logits_processor:LogitsProcessor",
     "V2 per-request steer state"),
    ("vllm.v1.worker.gpu.model_runner:GPUModelRunner.sample",
     "the step's row -> request mapping (V2)"),
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
    Hook("vllm.v1.engine.async_llm:AsyncLLM.add_request",
         "--steer-dir steers loaded before admission (HTTP 400 with the reason)",
         _hook_async_llm),
)
