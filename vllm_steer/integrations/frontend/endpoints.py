"""Our HTTP endpoints on every API server that steers, whatever ``VLLM_PLUGINS`` says.

vLLM's endpoint-plugin loader (``vllm.plugins.load_endpoint_plugins``) is wrapped once
(:func:`load_endpoint_plugins`, in :data:`vllm_steer.integrations.plugin.HOOKS`) to add,
unless the entry points already brought them:

- ``/v1/steers`` (:class:`vllm_steer.server.steers_route.SteerManagementEndpoint`; its write
  routes stay off without ``--enable-steer-updates``);
- ``/v1/steer-presets`` and the ``x-vllm-steer-*`` response headers
  (:class:`vllm_steer.server.presets_route.PresetsEndpoint`).

The lens and the playground stay opt-in (``VLLM_PLUGINS``), like every vLLM endpoint plugin.
No torch, no FastAPI at import time.
"""

from __future__ import annotations

from vllm_steer.integrations.frontend.state import frontend_state


#: Our endpoint plugins, named as entry points are (``vllm.endpoint_plugins``) and loaded as
#: vLLM loads those: the HTTP layer (:mod:`vllm_steer.server`) sits above this package, which
#: never imports it.
ENDPOINTS = {
    "vllm_steer_steers": "vllm_steer.server.steers_route:SteerManagementEndpoint",
    "vllm_steer_presets": "vllm_steer.server.presets_route:PresetsEndpoint",
}


def _ours() -> list:
    """The endpoint classes every steering API server serves."""
    from importlib.metadata import EntryPoint

    return [EntryPoint(name, value, "vllm.endpoint_plugins").load()
            for name, value in ENDPOINTS.items()]


def load_endpoint_plugins(orig, supported_tasks=None):
    """``vllm.plugins.load_endpoint_plugins``: what vLLM found, plus our endpoints it did not."""
    found = list(orig(supported_tasks))
    if frontend_state().enabled:
        names = {getattr(p, "name", None) for p in found}
        found += [cls() for cls in _ours() if cls.name not in names]
    return found
