"""Test harness: which of the plugin's wrapped hooks ran, in every process of an engine.

Installed before the plugin registers (``tests/conftest.py`` in the test process; with
``STEER_TEST_HOOKS_RECORD=DIR``, ``sitecustomize`` in every process the engine starts), it
wraps the ``install_hooks`` the plugin's ``register()`` calls so that each hook is installed
with a wrapper that notes the hook's target on its first call (the name installed for this
vLLM release: an alternative target where one applies); a gated hook
(``Hook.gates``: while its gates are closed vLLM's method runs without calling the wrapper)
is noted when vLLM calls the patched method. The notes go to :data:`CALLED`, and,
with ``STEER_TEST_HOOKS_RECORD=DIR``, one line each to ``DIR/hooks-<pid>.txt``. The plugin's
own wrappers are untouched: nothing of this is product code.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import os

#: Environment variable naming the directory every process appends its notes to.
RECORD_ENV = "STEER_TEST_HOOKS_RECORD"
#: Targets of the hooks that ran in this process.
CALLED: set[str] = set()
# A process forked from this one (an engine's processes: tests/conftest.py) notes its own.
os.register_at_fork(after_in_child=CALLED.clear)


def note(target: str) -> None:
    if target in CALLED:
        return
    CALLED.add(target)
    directory = os.environ.get(RECORD_ENV)
    if directory:
        with open(os.path.join(directory, f"hooks-{os.getpid()}.txt"), "a",
                  encoding="utf-8") as f:
            f.write(target + "\n")


def recording(hook, target: str):
    """``hook`` with a wrapper that notes ``target`` when it first runs, then does what the
    plugin's wrapper does (a lazily imported one is still resolved once, then called
    directly)."""
    from vllm_steer.integrations.hooks import RESOLVE_ATTR, same_kind

    wrapper = hook.wrapper

    def noting(*args, **kwargs):
        note(target)
        return wrapper(*args, **kwargs)

    rec = same_kind(wrapper, noting)
    functools.update_wrapper(rec, wrapper)
    resolve = getattr(wrapper, RESOLVE_ATTR, None)
    if resolve is not None:  # wrap_method calls this at the first call only
        setattr(rec, RESOLVE_ATTR, lambda: (note(target), resolve())[1])
    return dataclasses.replace(hook, wrapper=rec)


def install(plugin) -> None:
    """Make ``plugin.register()`` install recording wrappers. Idempotent."""
    orig = plugin.install_hooks
    if getattr(orig, "_steer_records", False):
        return

    def install_hooks(hooks):
        from vllm_steer.integrations import hooks as machinery
        from vllm_steer.integrations.manifest import installed_version

        version = installed_version()
        pairs = [(h, recording(h, h.target_for(version) or h.target))
                 for h in hooks if h.wrapper is not None]
        out = orig([dict((id(h), r) for h, r in pairs).get(id(h), h) for h in hooks])
        for h, r in pairs:  # the patched method names the plugin's own wrapper, as without
            _own(machinery, h.target_for(version), r.wrapper, h.wrapper)  # the recorder
            if getattr(h, "gates", ()):
                _note_calls(machinery, h.target_for(version), h.wrapper)
        return out

    install_hooks._steer_records = True
    plugin.install_hooks = install_hooks


def _patched(machinery, target):
    """``(owner, name, attribute as stored)`` of the method patched at ``target``
    (``module:Class.name``); None where the installed vLLM has no such name."""
    module, _, qual = (target or "").partition(":")
    name = qual.rpartition(".")[2]
    try:
        owner = machinery.resolve(module + ":" + qual.rpartition(".")[0])
        return owner, name, inspect.getattr_static(owner, name)
    except (ImportError, AttributeError):
        return None


def _own(machinery, target, recording_wrapper, wrapper) -> None:
    """Make the method patched at ``target`` name ``wrapper`` (``WRAPPER_ATTR``), so that
    installing the same hook again (a test installing some of ``HOOKS`` by hand) changes
    nothing, as it would without the recorder."""
    found = _patched(machinery, target)
    if found is None:
        return
    raw = found[2]
    fn = getattr(raw, "__func__", raw)
    if getattr(fn, machinery.WRAPPER_ATTR, None) is recording_wrapper:
        setattr(fn, machinery.WRAPPER_ATTR, wrapper)


def _note_calls(machinery, target, wrapper) -> None:
    """Note ``target`` when vLLM calls its patched method (a gated hook: its wrapper runs only
    while one of its gates is open), then run the patched method as installed."""
    found = _patched(machinery, target)
    if found is None:
        return
    owner, name, patched = found
    if not inspect.isfunction(patched) or getattr(patched, "_steer_notes", False):
        return

    def noting(*args, **kwargs):
        note(target)
        return patched(*args, **kwargs)

    functools.update_wrapper(noting, patched)
    noting._steer_notes = True
    setattr(noting, machinery.WRAPPER_ATTR, wrapper)
    setattr(owner, name, noting)


def recorded(directory: str) -> set[str]:
    """The targets every process noted under ``directory``."""
    out: set[str] = set()
    for name in os.listdir(directory):
        if name.startswith("hooks-") and name.endswith(".txt"):
            with open(os.path.join(directory, name), encoding="utf-8") as f:
                out.update(line.strip() for line in f if line.strip())
    return out


def wrapped_targets(hooks, groups, version: str | None = None) -> set[str]:
    """The targets, in vLLM ``version`` (default: the installed one), of ``hooks`` of
    ``groups`` (names) that wrap a vLLM function (those whose calls are noted)."""
    from vllm_steer.integrations.manifest import installed_version

    version = version or installed_version()
    return {h.target_for(version) for h in hooks
            if h.wrapper is not None and h.group.name in set(groups)}
