"""The hook machinery: how the plugin patches vLLM and reports what vLLM moved.

Each patch point is a :class:`Hook` (``module:Class.attribute``, why, how to install it, the
:class:`HookGroup` that needs it, and the private vLLM names its wrapper reads); the plugin's
one list of them is :data:`vllm_steer.integrations.plugin.HOOKS`, installed by
:func:`install_hooks` when vLLM calls the plugin's ``register()``. A hook vLLM moved or removed
is recorded there, and the groups it makes unavailable are logged. :func:`check_hooks`
(called wherever steers are configured) refuses to steer only when a group the configuration
uses (:func:`groups_used`) is unavailable, naming the vLLM version, the group and the hook;
for those groups it also checks, on the imported vLLM (:mod:`vllm_steer.integrations.surface`),
every name the wrappers read, the parameters they bind by name, and that the functions which
call a name the plugin patches where it is imported still call it through that name.

This module imports no torch (the frontend imports it).
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import Any, Callable

from vllm_steer.integrations.supported import SUPPORTED_VLLM
from vllm_steer.logs import get_logger

logger = get_logger()


@dataclass(frozen=True)
class HookGroup:
    """Hooks needed together: a configuration uses the whole group or none of it."""

    name: str
    """Short name, shown in messages (``v1``, ``v2-spec``, ...)."""
    needed_by: str
    """What needs the group, in a user's words (shown when it is unavailable)."""
    process: str
    """The process whose hooks these are: ``frontend`` (API server / ``LLM``), ``engine``
    (engine core) or ``worker`` (model runner)."""
    fix: str = ""
    """Besides installing a supported vLLM, how to serve without the group (or empty)."""


FRONTEND = HookGroup("frontend", "every steering configuration: the --steer flags, the steer "
                     "request field, presets and the management routes", "frontend")
ENGINE = HookGroup("engine", "every steering configuration: admission and run-time loads in "
                   "the engine core", "engine")
WORKER = HookGroup("worker", "every steering configuration: the steered LM head", "worker")
V1 = HookGroup("v1", "the V1 model runner (the CPU runner; the GPU runner with "
               "VLLM_USE_V2_MODEL_RUNNER=0)", "worker",
               "serve on Model Runner V2 (VLLM_USE_V2_MODEL_RUNNER=1), ")
V1_LENS = HookGroup("v1-lens", "steered prompt logprobs on the V1 model runner (any request "
                    "may ask for prompt_logprobs; the lens's highlight route does)", "worker",
                    "serve on Model Runner V2 (VLLM_USE_V2_MODEL_RUNNER=1), ")
V1_SPEC = HookGroup("v1-spec", "speculative decoding on the V1 model runner", "worker",
                    "serve without --speculative-config, or on Model Runner V2 "
                    "(VLLM_USE_V2_MODEL_RUNNER=1), ")
V2 = HookGroup("v2", "Model Runner V2 (the GPU default; VLLM_USE_V2_MODEL_RUNNER=1)", "worker",
               "serve on the V1 model runner (VLLM_USE_V2_MODEL_RUNNER=0), ")
V2_LENS = HookGroup("v2-lens", "steered prompt logprobs on Model Runner V2 (any request may "
                    "ask for prompt_logprobs; the lens's highlight route does)", "worker",
                    "serve on the V1 model runner (VLLM_USE_V2_MODEL_RUNNER=0), ")
V2_SPEC = HookGroup("v2-spec", "speculative decoding on Model Runner V2", "worker",
                    "serve without --speculative-config, or on the V1 model runner "
                    "(VLLM_USE_V2_MODEL_RUNNER=0), ")
#: Every group, in the order of the plugin's list.
GROUPS: tuple[HookGroup, ...] = (FRONTEND, ENGINE, WORKER, V1, V1_LENS, V1_SPEC, V2, V2_LENS,
                                 V2_SPEC)
#: The groups every steering configuration uses, whatever its runner.
ALWAYS: tuple[HookGroup, ...] = (FRONTEND, ENGINE, WORKER)


@dataclass(frozen=True)
class Hook:
    """One patch point in vLLM."""

    target: str
    """What is patched, ``module:Class.attribute`` (the module is imported to find it)."""
    purpose: str
    """Why the plugin needs it (shown when vLLM moved it)."""
    wrapper: Callable | None = None
    """``wrapper(orig, *args, **kwargs)`` replaces the attribute (:func:`wrap_method`)."""
    install: Callable[[Any], None] | None = None
    """Instead of a wrapper: called with the owner of the attribute (``Class``, or the module)
    to install something else (a field, a registration)."""
    group: HookGroup = FRONTEND
    """What needs it (:data:`GROUPS`). Every hook is installed in every process vLLM starts
    (the plugin does not know which one it is in); hooks of other processes are never called
    there."""
    reads: tuple[str, ...] = ()
    """Private vLLM names the wrapper reads besides the target, ``module:Class.name``: class
    attributes, methods, fields, or instance attributes assigned in a method of the class
    (each checked in vLLM's source)."""
    params: tuple[str, ...] = ()
    """Parameters of the target the wrapper binds by name (checked in its signature)."""
    called_by: tuple[str, ...] = ()
    """For a name patched where it is imported (``module:function``): the functions that must
    still call it through that name at call time (a global of that module, or a function-local
    ``from module import function``), else the patch would silently never run."""

    @property
    def process(self) -> str:
        """The process whose hook this is (:attr:`HookGroup.process`)."""
        return self.group.process


#: Attribute set on every function :func:`wrap_method` installs: the wrapper it calls.
WRAPPER_ATTR = "_vllm_steer"
#: Targets of the hooks whose patched function ran in this process at least once (recorded on
#: each one's first call only); read by the hook-coverage tests through :func:`hooks_called`.
_CALLED: set[str] = set()
#: Environment variable naming a directory: every process then also appends the target of
#: each hook, on its first call, to ``<dir>/hooks-<pid>.txt`` (:func:`hooks_recorded` reads
#: them back: which hooks an engine's processes ran).
RECORD_ENV = "VLLM_STEER_HOOKS_RECORD"


def hooks_called() -> list[str]:
    """The targets (``module:Class.attribute``) of the hooks that ran in this process."""
    return sorted(_CALLED)


def hooks_recorded(directory: str) -> set[str]:
    """The targets every process recorded under ``directory`` (:data:`RECORD_ENV`)."""
    import os

    out: set[str] = set()
    for name in os.listdir(directory):
        if name.startswith("hooks-") and name.endswith(".txt"):
            with open(os.path.join(directory, name), encoding="utf-8") as f:
                out.update(line.strip() for line in f if line.strip())
    return out


def wrapped_targets(hooks, groups) -> set[str]:
    """The targets of ``hooks`` of ``groups`` (names or :class:`HookGroup`) that wrap a vLLM
    function (those whose calls are recorded)."""
    names = {g if isinstance(g, str) else g.name for g in groups}
    return {h.target for h in hooks if h.wrapper is not None and h.group.name in names}


def _record(target: str) -> None:
    """A hook's first call in this process (:func:`wrap_method`)."""
    import os

    _CALLED.add(target)
    directory = os.environ.get(RECORD_ENV)
    if directory:
        with open(os.path.join(directory, f"hooks-{os.getpid()}.txt"), "a",
                  encoding="utf-8") as f:
            f.write(target + "\n")


#: On a wrapper that imports what it calls at its first call (the worker's wrappers, which
#: import torch): a function returning that callable, which :func:`wrap_method` then calls
#: directly.
RESOLVE_ATTR = "vllm_steer_resolve"


def wrap_method(owner: Any, name: str, wrapper: Callable, record: str | None = None) -> None:
    """Replace ``owner.name`` (a method, static or class method of a class, or a module's
    function) by one that calls ``wrapper(orig, *args, **kwargs)``: the one way this plugin
    patches vLLM. Idempotent (a second call with the same wrapper changes nothing); a
    coroutine (async generator) wrapper makes a coroutine (async generator) method. With
    ``record``, its first call records ``record`` (:func:`hooks_called`, :data:`RECORD_ENV`);
    every later call costs one flag test."""
    raw = inspect.getattr_static(owner, name)
    kind = type(raw) if isinstance(raw, (staticmethod, classmethod)) else None
    orig = raw.__func__ if kind else raw
    if getattr(orig, WRAPPER_ATTR, None) is wrapper:
        return
    first = [record is not None]  # a one-element cell: the cheapest test on every call

    if inspect.isasyncgenfunction(wrapper):
        async def patched(*args, **kwargs):
            if first[0]:
                first[0] = False
                _record(record)
            agen = wrapper(orig, *args, **kwargs)
            try:
                async for item in agen:
                    yield item
            finally:
                await agen.aclose()
    elif inspect.iscoroutinefunction(wrapper):
        async def patched(*args, **kwargs):
            if first[0]:
                first[0] = False
                _record(record)
            return await wrapper(orig, *args, **kwargs)
    else:
        # a lazily imported wrapper (RESOLVE_ATTR) is replaced by what it calls at the first
        # call: every later call goes straight to it (one flag test, no extra frame)
        resolve = getattr(wrapper, RESOLVE_ATTR, None)
        call = [wrapper]
        first[0] = first[0] or resolve is not None

        def patched(*args, **kwargs):
            if first[0]:
                first[0] = False
                if record is not None:
                    _record(record)
                if resolve is not None:
                    call[0] = resolve()
            return call[0](orig, *args, **kwargs)
    functools.update_wrapper(patched, orig)
    setattr(patched, WRAPPER_ATTR, wrapper)
    setattr(owner, name, kind(patched) if kind else patched)


class MissingHookError(RuntimeError):
    """A vLLM attribute the plugin hooks into is missing (another vLLM version)."""


_MISSING: list[str] = []  # "target (purpose): error" of every hook not found at registration
_MISSING_BY_GROUP: dict[str, list[str]] = {}  # the same, per group name
_INSTALLED: list[Hook] = []  # the hooks install_hooks was given in this process
_SURFACE: dict[str, list[str]] = {}  # group name -> what check_surface found wrong (cached)


def resolve(target: str) -> Any:
    """The object named by ``module:Qualified.name``; ImportError/AttributeError if absent."""
    import importlib

    module, _, qualname = target.partition(":")
    obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def install_hooks(hooks) -> list[str]:
    """Install every hook; record each one vLLM does not have, and log the groups that are
    unavailable because of them (start-up refuses only the configurations that use one)."""
    import importlib

    missing = []
    for hook in hooks:
        _INSTALLED.append(hook)
        try:
            resolve(hook.target)
            module, _, qualname = hook.target.partition(":")
            owner = (resolve(module + ":" + qualname.rpartition(".")[0]) if "." in qualname
                     else importlib.import_module(module))
            if hook.wrapper is not None:
                wrap_method(owner, qualname.rpartition(".")[2], hook.wrapper,
                            record=hook.target)
            if hook.install is not None:
                hook.install(owner)
        except (ImportError, AttributeError) as e:
            line = f"{hook.target} ({hook.purpose}): {type(e).__name__}: {e}"
            missing.append(line)
            _MISSING_BY_GROUP.setdefault(hook.group.name, []).append(line)
    if missing:
        _MISSING.extend(missing)
        groups = [g for g in GROUPS if g.name in _MISSING_BY_GROUP]
        logger.warning("vllm-steer: vLLM %s lacks %d patch point(s) of this plugin (supported: "
                       "vllm%s); unavailable: %s; a configuration that uses one of these "
                       "refuses --steer at start-up: %s", _vllm_version(), len(missing),
                       SUPPORTED_VLLM, ", ".join(f"{g.name} ({g.needed_by})" for g in groups),
                       "; ".join(missing))
    return missing


def groups_used(vllm_config=None) -> tuple[HookGroup, ...]:
    """The hook groups a configuration uses: :data:`ALWAYS`, its model runner's (vLLM's
    ``use_v2_model_runner``, decided by ``VLLM_USE_V2_MODEL_RUNNER`` and the platform) with
    its steered prompt logprobs, and that runner's speculative decoding when a
    ``speculative_config`` is set. Without a config (the CLI, before vLLM builds it): the
    frontend and engine groups; the rest is checked when vLLM creates the engine config."""
    if vllm_config is None:
        return (FRONTEND, ENGINE)
    v2 = bool(getattr(vllm_config, "use_v2_model_runner", False))
    used = [*ALWAYS, *((V2, V2_LENS) if v2 else (V1, V1_LENS))]
    if getattr(vllm_config, "speculative_config", None) is not None:
        used.append(V2_SPEC if v2 else V1_SPEC)
    return tuple(used)


def check_hooks(vllm_config=None) -> None:
    """Raise :class:`MissingHookError` if a hook group this configuration uses
    (:func:`groups_used`) lacks a patch point, a name its wrappers read, a parameter they
    bind by name, or a call through a patched imported name (called when steers are
    configured: at config creation, in ``from_cli_args`` and in each worker). The other
    groups may be unavailable: nothing that runs needs them."""
    for group in groups_used(vllm_config):
        problems = list(_MISSING_BY_GROUP.get(group.name, ()))
        if not problems:
            problems = check_surface(group)
        if problems:
            raise MissingHookError(
                f"vllm-steer: cannot steer on vLLM {_vllm_version()}: it moved or removed "
                f"{len(problems)} patch point(s) of the plugin that this configuration needs "
                f"(hook group {group.name!r}, for {group.needed_by}): {'; '.join(problems)}. "
                f"This vllm-steer supports vllm{SUPPORTED_VLLM}; {group.fix}install a supported "
                "vLLM, or serve without --steer")


def check_surface(group: HookGroup) -> list[str]:
    """What the imported vLLM lacks of the installed hooks of ``group``: each declared read,
    each parameter bound by name, each call through a patched imported name
    (:func:`surface_problems` on a :class:`~vllm_steer.integrations.surface.LiveSurface`).
    Checked once per process and group."""
    if group.name not in _SURFACE:
        from vllm_steer.integrations.surface import LiveSurface

        surface = LiveSurface()
        _SURFACE[group.name] = [p for h in _INSTALLED if h.group is group
                                for p in surface_problems(h, surface)]
    return _SURFACE[group.name]


def surface_problems(hook: Hook, surface) -> list[str]:
    """What ``surface`` lacks of ``hook``: a :class:`~vllm_steer.integrations.surface.Surface`
    on vLLM's source, or a committed manifest
    (:class:`~vllm_steer.integrations.surface.ManifestSurface`)."""
    from vllm_steer.integrations.surface import bindable

    out = []
    where = f"{hook.target} ({hook.purpose})"
    entry = surface.lookup(hook.target)
    if entry is None:
        return [f"{where}: not found"]
    if hook.params:
        params = entry.get("params")
        if params is None and entry.get("kind") != "outside vLLM":
            out.append(f"{where}: no signature to bind {', '.join(hook.params)} by name")
        elif params is not None:
            lost = [p for p in hook.params if p not in bindable(params)]
            if lost:
                out.append(f"{where}: its signature ({', '.join(params)}) has no parameter "
                           f"{', '.join(lost)}, which the plugin binds by name")
    for name in hook.reads:
        if surface.lookup(name) is None:
            out.append(f"{where}: reads {name}, which this vLLM does not have")
    for caller in hook.called_by:
        if surface.calls_by_name(caller, hook.target) is None:
            out.append(f"{where}: {caller} no longer calls it through the name the plugin "
                       "patches, so the patch would never run")
    return out


def _vllm_version() -> str:
    try:
        from vllm import __version__

        return str(__version__)
    except Exception:  # pragma: no cover
        return "(unknown version)"
