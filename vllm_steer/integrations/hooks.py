"""The hook machinery: how the plugin patches vLLM and reports what vLLM moved.

Each patch point is a :class:`Hook` (``module:Class.attribute``, why, and how to install it);
the plugin's one list of them is :data:`vllm_steer.integrations.plugin.HOOKS`, installed by
:func:`install_hooks` when vLLM calls the plugin's ``register()``. A hook vLLM moved or removed
is recorded and logged there; :func:`check_hooks` then refuses to steer (called wherever
steers are configured), naming the vLLM version and the hook.

This module imports no torch (the frontend imports it).
"""

from __future__ import annotations

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
