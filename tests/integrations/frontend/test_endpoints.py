"""vllm_steer.integrations.frontend.endpoints: the one wrapper of vLLM's endpoint-plugin loader."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from vllm_steer.config import SteerServerConfig
from vllm_steer.integrations.frontend import endpoints
from vllm_steer.integrations.hooks import wrap_method
from vllm_steer.integrations.frontend.state import frontend_state


class _Lens:  # an endpoint the entry points found (stands for the lens plugin)
    name = "vllm_steer_lens"


@pytest.fixture
def loader():
    calls = []

    def load_endpoint_plugins(supported_tasks=None):
        calls.append(supported_tasks)
        return [_Lens()]

    plugins = SimpleNamespace(load_endpoint_plugins=load_endpoint_plugins)
    wrap_method(plugins, "load_endpoint_plugins", endpoints.load_endpoint_plugins)
    old = frontend_state().config
    yield plugins, calls
    frontend_state().reset(old)


def _names(found):
    return [p.name for p in found]


def test_a_steering_server_gets_the_steers_and_presets_routes_once(loader):
    plugins, calls = loader
    frontend_state().reset(SteerServerConfig(steers={"detox": "d"}))
    assert _names(plugins.load_endpoint_plugins(("generate",))) == [
        "vllm_steer_lens", "vllm_steer_steers", "vllm_steer_presets"]
    assert calls == [("generate",)]  # vLLM's own loader ran, with the tasks
    # installing twice wraps once
    wrap_method(plugins, "load_endpoint_plugins", endpoints.load_endpoint_plugins)
    assert len(plugins.load_endpoint_plugins()) == 3


def test_a_server_without_steers_gets_only_what_vllm_found(loader):
    plugins, _ = loader
    for cfg in (None, SteerServerConfig()):
        frontend_state().reset(cfg)
        assert _names(plugins.load_endpoint_plugins()) == ["vllm_steer_lens"]


def test_an_endpoint_the_entry_points_already_brought_is_not_added_again(loader):  # noqa: ARG001
    from vllm_steer.server.presets_route import PresetsEndpoint

    plugins2 = SimpleNamespace(load_endpoint_plugins=lambda supported_tasks=None: [
        PresetsEndpoint()])
    wrap_method(plugins2, "load_endpoint_plugins", endpoints.load_endpoint_plugins)
    frontend_state().reset(SteerServerConfig(steers={"detox": "d"}))
    assert _names(plugins2.load_endpoint_plugins()) == ["vllm_steer_presets", "vllm_steer_steers"]
