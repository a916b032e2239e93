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
    modules = ["vllm_steer.integrations." + m for m in (
        "plugin", "hooks", "cli_args", "startup_checks", "request_field", "engine_core",
        "frontend")] + ["vllm_steer.config", "vllm_steer.format"]
    code = f"import sys; import {', '.join(modules)}; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_every_hook_is_found_on_this_vllm(registered):
    from vllm_steer.integrations import hooks, plugin

    assert hooks._MISSING == []
    for hook in plugin.HOOKS:
        hooks.resolve(hook.target)
