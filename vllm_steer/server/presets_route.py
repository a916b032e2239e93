"""Presets, defaults and floors on the vLLM server (see :mod:`vllm_steer.policy`).

- Response headers on every request served with a steer: ``x-vllm-steer-applied:
  detox=2,sentiment=-3`` (what the request is served with, after preset, defaults and
  floors) and ``x-vllm-steer-floored: detox`` when a floor raised a steer. Set by an ASGI
  middleware from what the request's ``to_sampling_params`` recorded
  (:func:`record_applied`, called by the plugin), so streaming responses carry them too.
- ``GET /v1/steer-presets``: the presets (served as model names), defaults and floors.

The plugin adds this endpoint to vLLM's endpoint-plugin list itself
(:func:`vllm_steer.integrations.plugin._hook_endpoint_presets`).
"""

from __future__ import annotations

from contextvars import ContextVar
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

router = APIRouter()

# One mutable box per HTTP request, set by the middleware; mutated (never re-set) by
# record_applied, so it is seen across the context copies of tasks and threads.
_BOX: ContextVar[dict | None] = ContextVar("vllm_steer_applied", default=None)


def record_applied(values: dict[str, Any], floored: list[str]) -> None:
    """Remember the steers this HTTP request is served with (no-op outside a request)."""
    box = _BOX.get()
    if box is None:
        return
    from vllm_steer.policy import APPLIED_HEADER, header_values

    headers = header_values(values, floored)
    if headers.get(APPLIED_HEADER) or len(headers) > 1:
        box["headers"] = headers


class SteerHeadersMiddleware:
    """Pure ASGI middleware adding the ``x-vllm-steer-*`` headers to the response."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope.get("type") != "http":
            return await self.app(scope, receive, send)
        box: dict = {}
        token = _BOX.set(box)

        async def send_with_headers(message):
            if message.get("type") == "http.response.start" and box.get("headers"):
                headers = list(message.get("headers") or [])
                headers += [(k.encode("latin-1"), v.encode("latin-1", "replace"))
                            for k, v in box["headers"].items()]
                message = {**message, "headers": headers}
            await send(message)

        try:
            await self.app(scope, receive, send_with_headers)
        finally:
            _BOX.reset(token)


@router.get("/v1/steer-presets")
async def list_presets(raw: Request):
    from vllm_steer.integrations import frontend

    cfg = frontend.get_config()
    if cfg is None or not cfg.enabled:
        return JSONResponse({"error": {"message": "steering is not enabled on this server",
                                       "type": "NotFoundError", "param": None, "code": 404}},
                            status_code=404)
    return JSONResponse({"object": "list",
                         "data": [{"name": n, "steer": dict(m)} for n, m in cfg.presets.items()],
                         "defaults": dict(cfg.defaults), "floors": dict(cfg.floors)})


class PresetsEndpoint:
    """vLLM endpoint plugin: the response headers and ``/v1/steer-presets``."""

    name = "vllm_steer_presets"
    required_tasks = ("generate",)

    def attach_router(self, app) -> None:
        app.include_router(router)
        app.add_middleware(SteerHeadersMiddleware)

    async def init_state(self, engine_client, state, args) -> None:
        return None
