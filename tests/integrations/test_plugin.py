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
    modules += ["vllm_steer.integrations." + m for m in ("plugin", "hooks", "families")]
    modules += ["vllm_steer.config", "vllm_steer.format", "vllm_steer.policy"]
    code = f"import sys; import {', '.join(modules)}; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_every_hook_is_found_on_this_vllm(registered):
    from vllm_steer.integrations import hooks
    from vllm_steer.integrations import plugin

    assert hooks._MISSING == []
    for hook in plugin.HOOKS:
        hooks.resolve(hook.target)
