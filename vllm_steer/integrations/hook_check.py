"""The start-up check: which hook groups a configuration uses, and whether the installed vLLM
still has everything those groups need.

:func:`check_hooks` (called wherever steers are configured) refuses to steer only when a
group the configuration uses (:func:`groups_used`) is unavailable, naming the vLLM version,
the group and the hook: a target :func:`~vllm_steer.integrations.hooks.install_hooks` did not
find, or, on the installed vLLM's surface
(:func:`~vllm_steer.integrations.manifest.installed_surface`: its committed manifest, else the
``ast`` reader on its source), a name the wrappers read, a parameter they bind by name, or a
call through a patched imported name that is gone. Before any of that, a vLLM outside the
supported range is refused, whatever resolves (:func:`check_version`; the override
``VLLM_STEER_ALLOW_UNTESTED_VLLM=1`` serves with a loud warning). This module imports no
torch.
"""

from __future__ import annotations

import os

from vllm_steer.integrations import vllm_access
from vllm_steer.integrations.hooks import (_INSTALLED, _MISSING_BY_GROUP, ALWAYS, ENGINE,
                                           FRONTEND, V1, V1_LENS, V1_SPEC, V2, V2_LENS, V2_SPEC,
                                           Hook, HookGroup)
from vllm_steer.integrations.supported import (ALLOW_UNTESTED_ENV, SUPPORTED_VLLM,
                                               version_problem)
from vllm_steer.logs import get_logger

logger = get_logger()


class MissingHookError(RuntimeError):
    """A vLLM attribute the plugin hooks into is missing (another vLLM version)."""


class UnsupportedVllmError(RuntimeError):
    """The installed vLLM is outside the supported range (and the override is not set)."""


_WARNED: list[str] = []  # the untested versions this process has warned about


def check_version() -> None:
    """Refuse to steer on a vLLM outside :data:`~vllm_steer.integrations.supported.
    SUPPORTED_VLLM` (:class:`UnsupportedVllmError`, naming the range, the version found and
    the override), even when every hook still resolves: its behaviour is untested. With
    ``VLLM_STEER_ALLOW_UNTESTED_VLLM=1`` it serves, with a loud warning, once per process."""
    from vllm_steer.integrations.manifest import installed_version

    version = installed_version()
    problem = version_problem(version)
    if problem is None:
        return
    if os.environ.get(ALLOW_UNTESTED_ENV, "").strip() != "1":
        raise UnsupportedVllmError(problem)
    if version not in _WARNED:
        _WARNED.append(version)
        logger.warning("vllm-steer: UNTESTED vLLM %s (supported: vllm%s); serving steers "
                       "anyway because %s=1. Steered outputs may be wrong: check them against "
                       "a supported vLLM before relying on them", version, SUPPORTED_VLLM,
                       ALLOW_UNTESTED_ENV)


_SURFACE: dict[str, list[str]] = {}  # group name -> what check_surface found wrong (cached)


def groups_used(vllm_config=None) -> tuple[HookGroup, ...]:
    """The hook groups a configuration uses: the frontend, engine and worker groups, its model
    runner's (vLLM's ``use_v2_model_runner``, decided by ``VLLM_USE_V2_MODEL_RUNNER`` and the
    platform) with its steered prompt logprobs, and that runner's speculative decoding when a
    ``speculative_config`` is set. Without a config (the CLI, before vLLM builds it): the
    frontend and engine groups; the rest is checked when vLLM creates the engine config."""
    if vllm_config is None:
        return (FRONTEND, ENGINE)
    v2 = vllm_access.uses_v2_runner(vllm_config)
    used = [*ALWAYS, *((V2, V2_LENS) if v2 else (V1, V1_LENS))]
    if vllm_access.speculative_config(vllm_config) is not None:
        used.append(V2_SPEC if v2 else V1_SPEC)
    return tuple(used)


def check_hooks(vllm_config=None) -> None:
    """Raise :class:`MissingHookError` if a hook group this configuration uses
    (:func:`groups_used`) lacks a patch point, a name its wrappers read, a parameter they
    bind by name, or a call through a patched imported name (called when steers are
    configured: at config creation, in ``from_cli_args`` and in each worker). The other
    groups may be unavailable: nothing that runs needs them. First, a vLLM outside the
    supported range is refused (:func:`check_version`)."""
    from vllm_steer.integrations.manifest import installed_version

    check_version()
    for group in groups_used(vllm_config):
        problems = list(_MISSING_BY_GROUP.get(group.name, ())) or check_surface(group)
        if problems:
            raise MissingHookError(
                f"vllm-steer: cannot steer on vLLM {installed_version()}: it moved or removed "
                f"{len(problems)} patch point(s) of the plugin that this configuration needs "
                f"(hook group {group.name!r}, for {group.needed_by}): {'; '.join(problems)}. "
                f"This vllm-steer supports vllm{SUPPORTED_VLLM}; {group.fix}install a supported "
                "vLLM, or serve without --steer")


def check_surface(group: HookGroup) -> list[str]:
    """What the installed vLLM lacks of the installed hooks of ``group``
    (:func:`surface_problems` on :func:`~vllm_steer.integrations.manifest.installed_surface`)
    and of the group's accesses
    (:func:`~vllm_steer.integrations.vllm_access.access_problems`). Checked once per process
    and group."""
    if group.name not in _SURFACE:
        from vllm_steer.integrations.manifest import installed_surface

        accesses = vllm_access.ACCESSES
        surface = installed_surface((*_INSTALLED, *accesses))
        _SURFACE[group.name] = [p for h in _INSTALLED if h.group is group
                                for p in surface_problems(h, surface)] + \
            [p for a in accesses if a.group is group
             for p in vllm_access.access_problems(a, surface)]
    return _SURFACE[group.name]


def surface_problems(hook: Hook, surface) -> list[str]:
    """What ``surface`` (a vLLM release's: its committed manifest,
    :class:`~vllm_steer.integrations.manifest.ManifestSurface`, or the ``ast`` reader on its
    source) lacks of ``hook``, at the target's name in that release (:meth:`Hook.target_for`)."""
    from vllm_steer.integrations.surface import OUTSIDE, bindable

    target = hook.target_for(surface.version)
    if target is None:
        return [f"{hook.target} ({hook.purpose}): no name declared for vLLM {surface.version} "
                f"(declared: {'; '.join(f'{t.target} in {t.versions}' for t in hook.targets)})"]
    out = []
    where = f"{target} ({hook.purpose})"
    entry = surface.lookup(target)
    if entry is None:
        return [f"{where}: not found"]
    if hook.params:
        signature = entry.get("params")
        if signature is None and entry.get("kind") != OUTSIDE:
            out.append(f"{where}: no signature to bind {', '.join(hook.params)} by name")
        elif signature is not None:
            lost = [p for p in hook.params if p not in bindable(signature)]
            if lost:
                out.append(f"{where}: its signature ({', '.join(signature)}) has no parameter "
                           f"{', '.join(lost)}, which the plugin binds by name")
    for name in hook.reads:
        if surface.lookup(name) is None:
            pkg = "vLLM" if name.partition(":")[0].partition(".")[0] == "vllm" else \
                f"installed {name.partition('.')[0]}"
            out.append(f"{where}: reads {name}, which this {pkg} does not have")
    for caller in hook.called_by:
        if surface.calls_by_name(caller, target) is None:
            out.append(f"{where}: {caller} no longer calls it through the name the plugin "
                       "patches, so the patch would never run")
    return out
