"""The hook machinery: how the plugin patches vLLM and reports what vLLM moved.

Each patch point is a :class:`Hook` (``module:Class.attribute``, why, and how to install it);
the plugin's one list of them is :data:`vllm_steer.integrations.plugin.HOOKS`, installed by
:func:`install_hooks` when vLLM calls the plugin's ``register()``. A hook vLLM moved or removed
is recorded and logged there; :func:`check_hooks` then refuses to steer (called wherever
steers are configured), naming the vLLM version and the hook.

This module imports no torch (the frontend imports it).
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import Any, Callable

from vllm_steer.logs import get_logger

logger = get_logger()


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
    process: str = "frontend"
    """Which process needs it: ``frontend`` (API server / ``LLM``), ``engine`` (engine core) or
    ``worker``. Every hook is installed in every process vLLM starts (the plugin does not know
    which one it is in); hooks of other processes are never called there."""


#: Attribute set on every function :func:`wrap_method` installs: the wrapper it calls.
WRAPPER_ATTR = "_vllm_steer"


def wrap_method(owner: Any, name: str, wrapper: Callable) -> None:
    """Replace ``owner.name`` (a method, static or class method of a class, or a module's
    function) by one that calls ``wrapper(orig, *args, **kwargs)``: the one way this plugin
    patches vLLM. Idempotent (a second call with the same wrapper changes nothing); a
    coroutine (async generator) wrapper makes a coroutine (async generator) method."""
    raw = inspect.getattr_static(owner, name)
    kind = type(raw) if isinstance(raw, (staticmethod, classmethod)) else None
    orig = raw.__func__ if kind else raw
    if getattr(orig, WRAPPER_ATTR, None) is wrapper:
        return
    if inspect.isasyncgenfunction(wrapper):
        async def patched(*args, **kwargs):
            agen = wrapper(orig, *args, **kwargs)
            try:
                async for item in agen:
                    yield item
            finally:
                await agen.aclose()
    elif inspect.iscoroutinefunction(wrapper):
        async def patched(*args, **kwargs):
            return await wrapper(orig, *args, **kwargs)
    else:
        def patched(*args, **kwargs):
            return wrapper(orig, *args, **kwargs)
    functools.update_wrapper(patched, orig)
    setattr(patched, WRAPPER_ATTR, wrapper)
    setattr(owner, name, kind(patched) if kind else patched)


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
            module, _, qualname = hook.target.partition(":")
            owner = (resolve(module + ":" + qualname.rpartition(".")[0]) if "." in qualname
                     else importlib.import_module(module))
            if hook.wrapper is not None:
                wrap_method(owner, qualname.rpartition(".")[2], hook.wrapper)
            if hook.install is not None:
                hook.install(owner)
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
