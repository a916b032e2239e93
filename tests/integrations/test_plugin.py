"""The plugin's entry point and its one list of hooks (vllm_steer.integrations.plugin):
every hook is found on this vLLM, and what the frontend imports stays light."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.fixture(scope="module")
def registered():
    """The plugin registered in this process (its hooks installed into vLLM)."""
    from vllm_steer.integrations import plugin

    plugin.register()


def test_modules_the_frontend_imports_do_not_import_torch():
    """Every module of the frontend and engine-core packages, the plugin's own modules and
    the core modules they use: importing them all loads no torch (the API server stays
    light). The packages are walked, so a new module is checked without editing this list."""
    import pkgutil

    from vllm_steer.integrations import engine, frontend

    modules = [m.name for pkg in (frontend, engine)
               for m in pkgutil.iter_modules(pkg.__path__, pkg.__name__ + ".")]
    assert len(modules) >= 8, modules
    modules += ["vllm_steer.integrations." + m for m in ("plugin", "hooks", "hook_check",
                                                            "families", "surface", "manifest",
                                                            "supported")]
    modules += ["vllm_steer.config", "vllm_steer.format", "vllm_steer.policy"]
    code = f"import sys; import {', '.join(modules)}; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_every_hook_is_found_on_this_vllm(registered):
    from vllm_steer.integrations import hooks
    from vllm_steer.integrations import plugin

    from vllm_steer.integrations.manifest import installed_version

    assert hooks._MISSING == []
    for hook in plugin.HOOKS:
        hooks.resolve(hook.target_for(installed_version()))


def test_every_hook_group_passes_the_start_up_check_on_this_vllm(registered):
    """Every configuration's groups: targets, declared reads, parameters bound by name and
    calls through patched imported names all found on the installed vLLM."""
    from types import SimpleNamespace

    from vllm_steer.integrations import hook_check, hooks

    for group in hooks.GROUPS:
        assert hook_check.check_surface(group) == [], group.name
    for v2 in (False, True):
        for spec in (None, SimpleNamespace(method="ngram")):
            config = SimpleNamespace(use_v2_model_runner=v2, speculative_config=spec)
            used = [g.name for g in hook_check.groups_used(config)]
            assert used == ["frontend", "engine", "worker",
                            *(["v2", "v2-lens"] if v2 else ["v1", "v1-lens"]),
                            *([("v2-spec" if v2 else "v1-spec")] if spec else [])]
            hook_check.check_hooks(config)


def test_the_test_recorder_notes_a_hook_on_its_first_call_only():
    """The hook-coverage tests' recorder (tests/v2shim/hook_recorder.py, not product code):
    a recording hook notes its target once, and wraps as the plugin's wrapper does."""
    from helpers.engines import hook_recorder

    from vllm_steer.integrations import hooks

    rec = hook_recorder()

    class Owner:
        def method(self, x):
            return x + 1

    seen = []
    hook = hooks.Hook("test:Owner.method", "test",
                      lambda orig, self, x: seen.append(x) or orig(self, x))
    hooks.wrap_method(Owner, "method", rec.recording(hook, "test:Owner.method").wrapper)
    assert "test:Owner.method" not in rec.CALLED
    assert Owner().method(1) == 2 and Owner().method(2) == 3 and seen == [1, 2]
    assert "test:Owner.method" in rec.CALLED


def test_a_lazily_imported_worker_wrapper_is_imported_once_then_called_directly():
    """A worker hook imports its module at its first call, and every later call reaches the
    imported function from the patched method itself (no shim frame per step)."""
    import sys

    from vllm_steer.integrations import hooks, plugin

    class Runner:
        def prepare(self, x):
            return x * 2

    calls = []
    shim = plugin._worker("runtime", "steer_stats")  # a real worker module, resolved lazily
    real_target = getattr(shim, hooks.RESOLVE_ATTR)

    def target():
        calls.append("resolved")
        return lambda orig, self, x: orig(self, x) + 1

    setattr(shim, hooks.RESOLVE_ATTR, target)
    hooks.wrap_method(Runner, "prepare", shim)
    assert [Runner().prepare(i) for i in range(4)] == [1, 3, 5, 7]
    assert calls == ["resolved"]  # imported once, then called directly
    assert real_target().__module__ == "vllm_steer.integrations.worker.runtime"
    assert "vllm_steer.integrations.worker.runtime" in sys.modules


def test_a_hook_installed_again_under_another_hook_of_the_method_wraps_it_once():
    """Hooks installed in another order (a subset first, then the whole plugin) leave each
    wrapper once around a method: the second install of a wrapper that sits under another
    changes nothing (a request's steer was parsed twice, and refused as given twice)."""
    import functools

    from vllm_steer.integrations.hooks import wrap_method

    calls = []

    class Owner:
        def method(self, x):
            calls.append("vllm")
            return x

    def first(orig, self, x):
        calls.append("first")
        return orig(self, x) + 1

    def second(orig, self, x):
        calls.append("second")
        return orig(self, x) * 10

    def recording(wrapper):  # a test's recording wrapper around the plugin's (functools)
        def rec(*args, **kwargs):
            calls.append("recorded")
            return wrapper(*args, **kwargs)
        return functools.update_wrapper(rec, wrapper)

    wrap_method(Owner, "method", first)
    wrap_method(Owner, "method", second)
    wrap_method(Owner, "method", first)  # already there, under `second`
    wrap_method(Owner, "method", second)
    wrap_method(Owner, "method", recording(first))  # `first`, recorded: there already
    assert Owner().method(1) == 20 and calls == ["second", "first", "vllm"]
