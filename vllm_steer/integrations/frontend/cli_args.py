"""``--steer`` and its sibling flags of ``vllm serve``, and the steer configuration built
from them.

:func:`add_steer_args` adds the flags to vLLM's engine arguments (so they show in ``vllm serve
--help``); :func:`config_from_args` turns them into a :class:`~vllm_steer.config.
SteerServerConfig`, which the ``from_cli_args`` hook carries to every process in
``additional_config["vllm_steer"]`` (the field vLLM reserves for plugins). Offline, pass the
same configuration yourself::

    LLM(model, additional_config={"vllm_steer": {"steers": {"detox": "detox.safetensors"}}})

This module imports no torch (the frontend imports it).
"""

from __future__ import annotations

import argparse

from vllm_steer.config import (ADMIN_KEY_ENV, DEFAULT_MAX_STRENGTH, SecretKey,
                               SteerServerConfig, admin_key, parse_steer_arg)
from vllm_steer.integrations import vllm_access as va
from vllm_steer.integrations.hook_check import check_hooks
from vllm_steer.integrations.protocol import steer_dir_names
from vllm_steer.logs import get_logger

logger = get_logger()

STEER_HELP = (
    "Load steers (LM-Steer, safetensors) that requests can apply with "
    '`"steer": {"NAME": strength}`. Several may follow one flag: `--steer '
    'detox=detox.safetensors sentiment=sent.safetensors` (repeating the flag works too; put '
    "MODEL before it). `PATH` alone takes the name from the file. Strengths are in units of "
    "the steer's epsilon (the paper's 5*eps0 is 5)."
)


def add_steer_args(parser: argparse.ArgumentParser) -> None:
    """Add our arguments to a vLLM (engine args) parser (argparse's API)."""
    if any("--steer" in a.option_strings for a in parser._actions):
        return
    group = parser.add_argument_group(
        title="vllm-steer",
        description="Per-request LM-Steer steering (vllm-steer plugin). Requests send "
                    '`"steer": {"detox": 5}` (OpenAI extra_body), or '
                    '`vllm_xargs={"steer": "detox:5,sentiment:-3"}`.')
    group.add_argument("--steer", nargs="+", action="extend", default=None,
                       metavar="NAME=PATH", help=STEER_HELP)
    group.add_argument("--steer-max-strength", type=float, default=DEFAULT_MAX_STRENGTH,
                       help="Largest |strength| a request may use.")
    group.add_argument("--steer-backend", default="auto",
                       choices=["auto", "reference", "torch", "triton"],
                       help="Implementation of the batched steer op.")
    group.add_argument("--max-steers", type=int, default=None, metavar="N",
                       help="Steers that may be loaded at once (slots sized up front). "
                            "Default: the number of --steer, at least 8.")
    group.add_argument("--max-steers-per-request", type=int, default=None, metavar="N",
                       help="Most steers one request may be served with, presets, defaults "
                            "and floors counted (default 8; --max-steers bounds it too).")
    group.add_argument("--max-steer-rank", type=int, default=None, metavar="R",
                       help="Refuse steers of a larger rank.")
    group.add_argument("--steer-dir", default=None, metavar="DIR",
                       help="A request naming a steer that is not loaded loads "
                            "DIR/NAME.safetensors on first use.")
    group.add_argument("--enable-steer-updates", action="store_true", default=False,
                       help="Allow POST /v1/steers and DELETE /v1/steers/NAME (load and "
                            "unload steers at run time) and POST /v1/steer-presets, PUT and "
                            "DELETE /v1/steer-presets/NAME (add, replace and delete presets). "
                            "Off by default: only for servers whose clients you trust.")
    group.add_argument("--steer-admin-key", type=SecretKey, default=None, metavar="KEY",
                       help="With --enable-steer-updates: the routes that load and unload "
                            "steers and add, replace and delete presets need this key "
                            "(`Authorization: Bearer KEY`); the API keys of --api-key / "
                            "VLLM_API_KEY then serve requests only (HTTP 403 on those routes). "
                            f"Read from {ADMIN_KEY_ENV} when not given (prefer the variable: "
                            "a flag shows in the process list).")
    # no default shown: vLLM's help appends "(default: True)", which reads as if the flag
    # were on; unset, the drafter is steered (config_from_args)
    group.add_argument("--no-steer-drafter", dest="steer_drafter", action="store_false",
                       default=argparse.SUPPRESS,
                       help="Speculative decoding: do not steer the drafter's proposals "
                            "(draft model, EAGLE, EAGLE-3, MTP; the output follows the steered "
                            "target either way; steering the drafter keeps acceptance up). "
                            "Without this flag the drafter is steered.")
    group.add_argument("--steer-vectors", action="store_true", default=False,
                       help="Put the vector steers' op into the model's decoder layers so "
                            "that vector steers (control vectors: llama.cpp GGUF or the "
                            "vector kind of steer file) can be loaded at run time; on by "
                            "itself when a --steer file is a vector steer.")
    group.add_argument("--steer-updates-any-path", action="store_true", default=False,
                       help="With --enable-steer-updates: POST /v1/steers may load files "
                            "outside --steer-dir.")
    group.add_argument("--steer-preset", nargs="+", action="extend", default=None,
                       metavar="NAME=STEER:X[,STEER:X...]",
                       help="Serve a steer mix as a model name: listed in /v1/models, and a "
                            'request with "model": NAME gets the mix (a steer field on the '
                            "request replaces the preset's value of each steer it names). "
                            "Several may follow one flag: `--steer-preset polite=detox:4 "
                            "kind=detox:4,sentiment:2` (repeating the flag works too).")
    group.add_argument("--steer-presets-file", default=None, metavar="PATH",
                       help="Presets from a JSON or YAML file, {\"presets\": {\"polite\": "
                            "{\"detox\": 4}}}, served like --steer-preset; every API server "
                            "re-reads the file when it changes (a bad version is refused and "
                            "logged, the presets before it stay).")
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
        if getattr(args, "steer_presets_file", None):
            raise ValueError("vllm-steer: --steer-presets-file given without any steer; load "
                             "the steers its presets name with --steer NAME=PATH (or "
                             "--steer-dir DIR)")
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
    if cfg.presets_file:
        check_presets_file(cfg, _reserved_model_names(args))
    return cfg


def _runtime_args(args: argparse.Namespace) -> dict:
    """Run-time steer management flags (issue 15) as SteerServerConfig fields."""
    import os

    steer_dir = getattr(args, "steer_dir", None)
    if steer_dir is not None:
        if not os.path.isdir(steer_dir):
            raise ValueError(f"--steer-dir {steer_dir!r}: not a directory")
        steer_dir = os.path.abspath(steer_dir)
    if getattr(args, "enable_steer_updates", False):
        logger.warning("vllm-steer: --enable-steer-updates is on: POST /v1/steers and "
                       "DELETE /v1/steers/NAME can load and unload steers, and POST "
                       "/v1/steer-presets, PUT and DELETE /v1/steer-presets/NAME can add, "
                       "replace and delete presets, at run time. %s",
                       "Only requests with the steer admin key may." if admin_key(args) else
                       "Any client that may send requests may (set --steer-admin-key or "
                       f"{ADMIN_KEY_ENV} to keep them to holders of that key); do not expose "
                       "this server to untrusted clients.")
    elif admin_key(args):
        logger.warning("vllm-steer: a steer admin key is set but --enable-steer-updates is "
                       "off: no route changes steers or presets, the key guards nothing")
    presets_file = getattr(args, "steer_presets_file", None)
    return dict(presets_file=os.path.abspath(presets_file) if presets_file else None,
                max_steers=getattr(args, "max_steers", None),
                max_steers_per_request=getattr(args, "max_steers_per_request", None),
                max_steer_rank=getattr(args, "max_steer_rank", None), steer_dir=steer_dir,
                enable_updates=bool(getattr(args, "enable_steer_updates", False)),
                updates_any_path=bool(getattr(args, "steer_updates_any_path", False)),
                steer_vectors=bool(getattr(args, "steer_vectors", False)))


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
    for flag, key, given in (("--steer-default", "defaults", getattr(args, "steer_default", None)),
                             ("--steer-floor", "floors", getattr(args, "steer_floor", None))):
        values: dict = {}
        for arg in given or []:
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
    served = va.cli_served_model_names(args)
    for n in ([served] if isinstance(served, str) else served):
        if n:
            out[str(n)] = "the served model name"
    for name in va.cli_lora_module_names(args):
        if name:
            out[name] = "a LoRA module (--lora-modules)"
    return out


def check_policy_config(cfg: SteerServerConfig, reserved: dict[str, str] | None = None) -> None:
    """Start-up check of presets, defaults and floors (:func:`vllm_steer.policy.
    check_policy`): the steers they name are loaded (or files of ``--steer-dir``), the
    strengths within ``--steer-max-strength``, preset names clash with no model name."""
    from vllm_steer.policy import check_policy

    names = set(cfg.steers)
    names |= steer_dir_names(cfg.steer_dir)
    check_policy(cfg.presets, cfg.defaults, cfg.floors, names, cfg.max_strength, reserved)


def check_presets_file(cfg: SteerServerConfig, reserved: dict[str, str] | None = None) -> None:
    """Start-up check of ``--steer-presets-file`` (:mod:`vllm_steer.presets_file`): the file
    reads and every preset passes the ``--steer-preset`` checks, else the server does not
    start."""
    from vllm_steer import presets_file

    names = set(cfg.steers)
    names |= steer_dir_names(cfg.steer_dir)
    taken = dict(reserved or {})
    taken.update({n: "a preset set by --steer-preset" for n in cfg.presets})
    presets, _ = presets_file.load(cfg.presets_file, names, cfg.max_strength, taken)
    logger.info("vllm-steer: presets file %s: %d preset(s)%s", cfg.presets_file, len(presets),
                f" ({', '.join(sorted(presets))})" if presets else "")


def admit_admin_key(args: argparse.Namespace) -> None:
    """The steer admin key among the keys vLLM's own check accepts on ``/v1`` routes.

    vLLM's ``--api-key`` check (``AuthenticationMiddleware``) answers 401 to any ``/v1``
    request without one of its keys; the management routes are ``/v1`` routes, so when an API
    key is set (``--api-key``, or ``VLLM_API_KEY`` without it) the admin key is added to that
    list (``args.api_key``, as vLLM's precedence reads it). The admin key may then also send
    requests; the API keys may not change steers (:mod:`vllm_steer.server.admin`). Without an
    API key vLLM checks nothing and the list is left unset. An admin key equal to an API key
    is refused: it would make every inference client an admin."""
    import os

    key = admin_key(args)
    if not key or not va.api_key_arg(args):
        return
    api_keys = va.api_keys(args)
    if any(isinstance(k, SecretKey) for k in api_keys or ()):
        return  # admitted already (engine arguments built twice from one namespace)
    keys = [k for k in (api_keys or [os.environ.get("VLLM_API_KEY")]) if k]
    if key in keys:
        raise ValueError(f"vllm-steer: the steer admin key (--steer-admin-key / "
                         f"{ADMIN_KEY_ENV}) is one of the API keys (--api-key / VLLM_API_KEY): "
                         "every client could then change steers and presets; give the admin "
                         "key a value of its own")
    if keys:
        va.set_api_keys(args, [*keys, SecretKey(key)])


def add_cli_args(orig, parser, *a, **kw):
    """``EngineArgs.add_cli_args``: vLLM's flags, then ours (:func:`add_steer_args`)."""
    parser = orig(parser, *a, **kw)
    add_steer_args(parser)
    return parser


def from_cli_args(orig, cls, args: argparse.Namespace):
    """``EngineArgs.from_cli_args``: the ``--steer`` flags carried in ``additional_config``."""
    cfg = config_from_args(args)
    if cfg is not None:
        admit_admin_key(args)
        check_hooks()
        # Written back into the namespace: the API servers of --api-server-count N /
        # --data-parallel-size N are spawned with this namespace and build their engine
        # args from it *before* vLLM loads plugins there (so before this hook exists in
        # that process); vLLM's own from_cli_args then copies additional_config.
        extra = dict(va.additional_config(args) or {})
        extra.update(cfg.to_additional_config())
        va.set_additional_config(args, extra)
    engine_args = orig(cls, args)
    if cfg is not None:
        extra = dict(va.additional_config(engine_args) or {})
        extra.update(cfg.to_additional_config())
        va.set_additional_config(engine_args, extra)
    return engine_args
