"""The hook machinery: how the plugin patches vLLM.

Each patch point is a :class:`Hook` (``module:Class.attribute``, with :class:`Alternative`
names for the vLLM releases that renamed it, why, how to install it, the :class:`HookGroup`
that needs it, and the private names its wrapper reads); the plugin's one list of them is
:data:`vllm_steer.integrations.plugin.HOOKS`, installed by :func:`install_hooks` when vLLM
calls the plugin's ``register()``, each through :func:`wrap_method` or its install function.
A hook the installed vLLM lacks is recorded there, and the groups it makes unavailable are
logged; :mod:`vllm_steer.integrations.hook_check` refuses the configurations that use one.

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


def reads_of(owner: str, *names: str) -> tuple[str, ...]:
    """``owner.name`` for each name: what a hook or an accessor reads of one vLLM class
    (``owner`` as ``module:Class``)."""
    return tuple(f"{owner}.{n}" for n in names)


#: Every group, in the order of the plugin's list.
GROUPS: tuple[HookGroup, ...] = (FRONTEND, ENGINE, WORKER, V1, V1_LENS, V1_SPEC, V2, V2_LENS,
                                 V2_SPEC)
#: The groups every steering configuration uses, whatever its runner.
ALWAYS: tuple[HookGroup, ...] = (FRONTEND, ENGINE, WORKER)


@dataclass(frozen=True)
class Alternative:
    """A name of a hook's target in some vLLM releases (a method vLLM renamed)."""

    target: str
    """``module:Class.attribute`` in those releases."""
    versions: str
    """The releases where it has this name, a pip version specifier (``">=0.34"``); empty:
    every release."""

    def holds(self, version: str) -> bool:
        """Whether vLLM ``version`` is one of :attr:`versions` (a local build tag such as
        ``+cpu`` and pre-releases count as their release)."""
        if not self.versions:
            return True
        from packaging.specifiers import SpecifierSet
        from packaging.version import InvalidVersion, Version

        try:
            v = Version(version)
        except InvalidVersion:
            return False
        return SpecifierSet(self.versions).contains(Version(v.base_version), prereleases=True)


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
    """Private names the hook's module uses itself besides the target and the accessors
    (:mod:`~vllm_steer.integrations.vllm_access`, where every read of a vLLM object is
    declared): a class it imports, its base class's own methods,
    ``module:Class.name``: class attributes, methods, fields, or instance attributes assigned
    in a method of the class (each checked in the source). Names of other packages than vLLM
    (pydantic) are checked in that package's installed source."""
    params: tuple[str, ...] = ()
    """Parameters of the target the wrapper binds by name (checked in its signature)."""
    called_by: tuple[str, ...] = ()
    """For a name patched where it is imported (``module:function``): the functions that must
    still call it through that name at call time (a global of that module, or a function-local
    ``from module import function``), else the patch would silently never run."""
    versions: str = ""
    """The vLLM releases where :attr:`target` has this name (a pip specifier; empty: all)."""
    alternatives: tuple[Alternative, ...] = ()
    """The same attribute under other names, each in the releases that have it: the first
    of :attr:`targets` whose releases hold the installed vLLM is the one patched
    (:meth:`target_for`), so one plugin serves the releases before and after a rename."""
    gates: tuple[str, ...] = ()
    """A per-step worker hook with nothing to do in most steps: the process gates
    (:class:`~vllm_steer.integrations.worker.gates.ProcessGates`' counts) while all of which
    are zero the patched method calls vLLM's own at once, never the wrapper
    (:func:`set_gate`). Empty: the wrapper is called at every call. Only for a wrapper that
    does nothing while they are zero, and whose vLLM method never changes them (else
    :attr:`after`)."""
    after: bool = False
    """The wrapper runs after vLLM's method, as ``wrapper(orig, self, out)`` returning the
    call's result, and only when one of :attr:`gates` is open as vLLM's method returns (a
    count it opened during that call included): for a hook that only looks at the outcome of
    vLLM's step."""

    @property
    def process(self) -> str:
        """The process whose hook this is (:attr:`HookGroup.process`)."""
        return self.group.process

    @property
    def targets(self) -> tuple[Alternative, ...]:
        """Every name of the target with its releases, :attr:`target` first."""
        return (Alternative(self.target, self.versions), *self.alternatives)

    def target_for(self, version: str) -> str | None:
        """The target's name in vLLM ``version`` (None: no name declared for it)."""
        return next((t.target for t in self.targets if t.holds(version)), None)


#: Attribute set on every function :func:`wrap_method` installs: the wrapper it calls.
WRAPPER_ATTR = "_vllm_steer"
#: On a wrapper that imports what it calls at its first call (the worker's wrappers, which
#: import torch): a function returning that callable, which :func:`wrap_method` then calls
#: directly.
RESOLVE_ATTR = "vllm_steer_resolve"


def same_kind(like: Callable, call: Callable) -> Callable:
    """A function of the kind of ``like`` (plain, coroutine or async generator function) whose
    calls return, await or yield from ``call(*args, **kwargs)``."""
    if inspect.isasyncgenfunction(like):
        async def forward(*args, **kwargs):
            agen = call(*args, **kwargs)
            try:
                async for item in agen:
                    yield item
            finally:
                await agen.aclose()
    elif inspect.iscoroutinefunction(like):
        async def forward(*args, **kwargs):
            return await call(*args, **kwargs)
    else:
        def forward(*args, **kwargs):
            return call(*args, **kwargs)
    return forward


#: Whether each process gate is open (its count is not zero), as :func:`set_gate` was told.
_GATE_OPEN: dict[str, bool] = {}
#: The gated hooks' routes, by gate name (:class:`_Route`).
_ROUTES: dict[str, list[_Route]] = {}
#: A patched method's state (``state[0]``): call the wrapper (0), import it first, or call
#: vLLM's own method (its gates are closed).
_CALL, _RESOLVE, _CLOSED = 0, 1, 2


class _Route:
    """Where a gated hook's patched method goes: its wrapper while one of its gates is open,
    vLLM's own method otherwise (its one state cell, read at every call anyway)."""

    __slots__ = ("gates", "state", "resolved")

    def __init__(self, gates: tuple[str, ...], state: list, resolved: bool) -> None:
        self.gates = gates
        self.state = state
        self.resolved = resolved

    def update(self) -> None:
        if not any(_GATE_OPEN.get(g, False) for g in self.gates):
            self.state[0] = _CLOSED
        else:
            self.state[0] = _CALL if self.resolved else _RESOLVE


def set_gate(name: str, is_open: bool) -> None:
    """Gate ``name`` opened or closed (called by the worker's process gates when a count
    leaves or reaches zero): the hooks gated by it (:attr:`Hook.gates`) call their wrapper,
    or vLLM's own method."""
    if _GATE_OPEN.get(name, False) == is_open:
        return
    _GATE_OPEN[name] = is_open
    for route in _ROUTES.get(name, ()):
        route.update()


def wrap_method(owner: Any, name: str, wrapper: Callable, gates: tuple[str, ...] = (),
                after: bool = False) -> None:
    """Replace ``owner.name`` (a method, static or class method of a class, or a module's
    function) by one that calls ``wrapper(orig, *args, **kwargs)``: the one way this plugin
    patches vLLM. Idempotent (a second call with the same wrapper changes nothing); a
    coroutine (async generator) wrapper makes a coroutine (async generator) method. A
    wrapper with :data:`RESOLVE_ATTR` is replaced at the first call by what that returns:
    every later call costs one flag test. With ``gates`` (:attr:`Hook.gates`), while every
    one of them is closed (:func:`set_gate`) the method calls ``orig`` itself, testing the
    same flag: no call of the wrapper, no frame of the plugin's. With ``after``
    (:attr:`Hook.after`, gated), vLLM's method runs first, and the wrapper is called as
    ``wrapper(orig, self, out)`` only if a gate is open when it returns."""
    raw = inspect.getattr_static(owner, name)
    kind = type(raw) if isinstance(raw, (staticmethod, classmethod)) else None
    orig = raw.__func__ if kind else raw
    if _wrapped_by(orig, wrapper):
        return

    if inspect.isasyncgenfunction(wrapper) or inspect.iscoroutinefunction(wrapper):
        patched = same_kind(wrapper, functools.partial(wrapper, orig))
    else:
        # a lazily imported wrapper (RESOLVE_ATTR) is replaced by what it calls at the first
        # call: every later call goes straight to it (one flag test, no extra frame)
        resolve = getattr(wrapper, RESOLVE_ATTR, None)
        call, state = [wrapper], [_CALL if resolve is None else _RESOLVE]  # one-element cells
        route = None
        if gates:
            route = _Route(tuple(gates), state, resolved=resolve is None)
            for g in route.gates:
                _ROUTES.setdefault(g, []).append(route)
            route.update()

        if after and route is None:
            raise ValueError(f"{name}: a hook run after vLLM's method needs gates")

        def resolved():  # the lazily imported wrapper, at its first call with a gate open
            call[0] = resolve()
            state[0] = _CALL
            if route is not None:
                route.resolved = True

        if not after:
            def patched(*args, **kwargs):
                if state[0]:
                    if state[0] == _CLOSED:  # nothing for the wrapper to do: vLLM's method
                        return orig(*args, **kwargs)
                    resolved()
                return call[0](orig, *args, **kwargs)
        else:
            def patched(*args, **kwargs):
                out = orig(*args, **kwargs)
                if state[0]:  # the gates as vLLM's method returns
                    if state[0] == _CLOSED:
                        return out
                    resolved()
                return call[0](orig, args[0], out)
    functools.update_wrapper(patched, orig)
    setattr(patched, WRAPPER_ATTR, wrapper)
    setattr(owner, name, kind(patched) if kind else patched)


def _wrapped_by(func: Any, wrapper: Callable) -> bool:
    """Whether ``wrapper`` is among the plugin's wrappers around ``func`` (the outermost, or
    one under another of the plugin's wrappers of the same method: hooks installed in
    another order, or a second time, must not wrap a method twice). A wrapper made with
    ``functools.wraps`` around another (a recording or timing one) counts as the one it
    wraps."""
    def innermost(f):
        while getattr(f, "__wrapped__", None) is not None:
            f = f.__wrapped__
        return f

    wrapper = innermost(wrapper)
    while getattr(func, WRAPPER_ATTR, None) is not None:
        if innermost(getattr(func, WRAPPER_ATTR)) is wrapper:
            return True
        func = getattr(func, "__wrapped__", None)
    return False


_MISSING: list[str] = []  # "target (purpose): error" of every hook not found at registration
_MISSING_BY_GROUP: dict[str, list[str]] = {}  # the same, per group name
_INSTALLED: list[Hook] = []  # the hooks install_hooks was given in this process


def resolve(target: str) -> Any:
    """The object named by ``module:Qualified.name`` (the one resolver); ImportError /
    AttributeError if absent."""
    import importlib

    module, _, qualname = target.partition(":")
    obj = importlib.import_module(module)
    for part in qualname.split(".") if qualname else ():
        obj = getattr(obj, part)
    return obj


def install_hooks(hooks) -> list[str]:
    """Install every hook, each at its target's name in the installed vLLM
    (:meth:`Hook.target_for`); record each one vLLM does not have, and log the groups that are
    unavailable because of them (start-up refuses only the configurations that use one)."""
    from vllm_steer.integrations import manifest

    version = manifest.installed_version()
    missing = []
    for hook in hooks:
        _INSTALLED.append(hook)
        target = hook.target_for(version)
        try:
            if target is None:
                raise AttributeError("no name declared for this vLLM release (declared: " + \
                                     "; ".join(f"{t.target} in {t.versions or 'any'}"
                                               for t in hook.targets) + ")")
            resolve(target)
            module, _, qualname = target.partition(":")
            owner = resolve(module + ":" + qualname.rpartition(".")[0])
            if hook.wrapper is not None:
                wrap_method(owner, qualname.rpartition(".")[2], hook.wrapper, hook.gates,
                            hook.after)
            if hook.install is not None:
                hook.install(owner)
        except (ImportError, AttributeError) as e:
            line = f"{target or hook.target} ({hook.purpose}): {type(e).__name__}: {e}"
            missing.append(line)
            _MISSING_BY_GROUP.setdefault(hook.group.name, []).append(line)
    if missing:
        _MISSING.extend(missing)
        groups = [g for g in GROUPS if g.name in _MISSING_BY_GROUP]
        logger.warning("vllm-steer: vLLM %s lacks %d patch point(s) of this plugin (supported: "
                       "vllm%s); unavailable: %s; a configuration that uses one of these "
                       "refuses --steer at start-up: %s", version, len(missing),
                       SUPPORTED_VLLM, ", ".join(f"{g.name} ({g.needed_by})" for g in groups),
                       "; ".join(missing))
    return missing
