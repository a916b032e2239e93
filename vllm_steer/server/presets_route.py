"""Presets, defaults and floors on the vLLM server (see :mod:`vllm_steer.policy`).

- Response headers on every request served with a steer: ``x-vllm-steer-applied:
  detox=2,sentiment=-3`` (what the request is served with, after preset, defaults and
  floors) and ``x-vllm-steer-floored: detox`` when a floor raised a steer. Set by an ASGI
  middleware from what the request's ``to_sampling_params`` recorded
  (:func:`vllm_steer.integrations.frontend.request_scope.record_applied`, called by the plugin), so streaming responses carry them too.
- ``GET /v1/steer-presets``: the presets (served as model names), defaults and floors.
- ``POST /v1/steer-presets`` ``{"name": "polite", "steer": {"detox": 4, "sentiment": -2}}``
  and ``DELETE /v1/steer-presets/{name}``: presets at run time, only with
  ``--enable-steer-updates`` (else HTTP 403 naming the flag). The table lives in the engine
  core, so every API server sees a change from the moment the call returns (design:
  :mod:`vllm_steer.integrations.engine.presets`).

The plugin adds this endpoint to vLLM's endpoint-plugin list itself
(:func:`vllm_steer.integrations.frontend.endpoints.load_endpoint_plugins`).
"""

from __future__ import annotations

import os
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from vllm_steer.integrations.frontend.engine_client import manage, refresh_presets
from vllm_steer.integrations.frontend.request_scope import close_scope, open_scope
from vllm_steer.integrations.frontend.state import frontend_state
from vllm_steer.server.errors import error_response as _error

router = APIRouter()

class SteerHeadersMiddleware:
    """Pure ASGI middleware adding the ``x-vllm-steer-*`` headers to the response."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope.get("type") != "http":
            return await self.app(scope, receive, send)
        box, token = open_scope()

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
            close_scope(token)


def _config():
    st = frontend_state()
    return st.config if st.enabled else None


_DISABLED = "steering is not enabled on this server"


@router.get("/v1/steer-presets")
async def list_presets(raw: Request):
    cfg = _config()
    if cfg is None:
        return _error(404, _DISABLED, "NotFoundError")
    knew = sorted(frontend_state().presets_view())  # this process's view, before reading
    runtime = await refresh_presets() if cfg.enable_updates else {}
    return JSONResponse({"object": "list",
                         "data": [{"name": n, "steer": dict(m), "source": "--steer-preset"}
                                  for n, m in cfg.presets.items()]
                         + [{"name": n, "steer": dict(m), "source": "api"}
                            for n, m in runtime.items()],
                         "defaults": dict(cfg.defaults), "floors": dict(cfg.floors),
                         "updates_enabled": cfg.enable_updates,
                         # which API-server process answered, and the run-time presets it
                         # knew before reading the engine core's table
                         "api_server": {"pid": os.getpid(), "knew": knew}})


def _updates_refused(cfg) -> JSONResponse | None:
    if cfg is None:
        return _error(404, _DISABLED, "NotFoundError")
    if not cfg.enable_updates:
        return _error(403, "preset updates are disabled on this server; start it with "
                      "--enable-steer-updates to add and delete presets over HTTP "
                      "(or set them at start-up with --steer-preset NAME=STEER:X,...)",
                      "PermissionError")
    return None


def _reserved(raw: Request, cfg) -> dict[str, str]:
    """Model names a new preset may not take, as this API server knows them."""
    out: dict[str, str] = {}
    models = getattr(raw.app.state, "openai_serving_models", None)
    for b in getattr(models, "base_model_paths", None) or ():
        out[b.name] = "the served model name"
    for n in getattr(models, "lora_requests", None) or {}:
        out[n] = "a LoRA adapter"
    out.update({n: "a preset set by --steer-preset" for n in cfg.presets})
    out.update({n: "a preset added at run time (DELETE /v1/steer-presets/"
                f"{n} first to replace it)" for n in frontend_state().presets_view()})
    return out


@router.post("/v1/steer-presets")
async def add_preset(raw: Request):
    import json
    import uuid

    from vllm_steer.policy import PolicyError, preset_from_body

    cfg = _config()
    refused = _updates_refused(cfg)
    if refused is not None:
        return refused
    try:
        body = await raw.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        return _error(400, f"the body is not JSON ({e}); send e.g. "
                      '{"name": "polite", "steer": {"detox": 4, "sentiment": -2}}')
    engine = frontend_state().engine
    if engine is None:
        return _error(503, "no engine behind this server")
    listing = await manage(engine, "list")  # the steers loaded now, and the current table
    steers = {s["name"] for s in listing.get("steers", []) if s["state"] != "draining"}
    if cfg.steer_dir and os.path.isdir(cfg.steer_dir):
        steers |= {f[:-len(".safetensors")] for f in os.listdir(cfg.steer_dir)
                   if f.endswith(".safetensors")}
    try:
        name, mix = preset_from_body(body, steers, cfg.max_strength, _reserved(raw, cfg))
    except PolicyError as e:
        return _error(400, str(e))
    res = await manage(engine, "preset_add", name=name, steer=mix, token=uuid.uuid4().hex)
    if not res.get("ok"):
        return _error(res.get("status", 400), res.get("error", "refused"))
    return JSONResponse({"object": "steer_preset", "name": name, "steer": mix,
                         "source": "api"})


@router.delete("/v1/steer-presets/{name}")
async def delete_preset(name: str, raw: Request):
    cfg = _config()
    refused = _updates_refused(cfg)
    if refused is not None:
        return refused
    engine = frontend_state().engine
    if engine is None:
        return _error(503, "no engine behind this server")
    res = await manage(engine, "preset_delete", name=name)
    if not res.get("ok"):
        return _error(res.get("status", 400), res.get("error", "refused"),
                      "NotFoundError" if res.get("status") == 404 else "BadRequestError")
    return JSONResponse({"object": "steer_preset", "deleted": True, **res["preset"],
                         "source": "api"})


class PresetsEndpoint:
    """vLLM endpoint plugin: the response headers and ``/v1/steer-presets`` (list; add and
    delete with ``--enable-steer-updates``)."""

    name = "vllm_steer_presets"
    required_tasks = ("generate",)

    def attach_router(self, app) -> None:
        app.include_router(router)
        app.add_middleware(SteerHeadersMiddleware)

    async def init_state(self, engine_client, state, args) -> None:
        if engine_client is not None:
            frontend_state().set_engine(engine_client)
