"""``/v1/steers`` on the vLLM server: list, load and unload steers at run time.

- ``GET /v1/steers``: always on (when the server steers). Every loaded steer with its file,
  hidden size, rank, eps0, labels, recommended strength, base model, source, load time and
  requests served.
- ``POST /v1/steers`` ``{"name": "detox", "path": "/steers/detox.safetensors"}`` and
  ``DELETE /v1/steers/{name}``: only with ``--enable-steer-updates`` (else HTTP 403 naming the
  flag). ``path`` must lie inside ``--steer-dir`` unless ``--steer-updates-any-path``; without
  ``path`` the file is ``DIR/NAME.safetensors``. With a steer admin key
  (``--steer-admin-key``) only requests sending it (:mod:`vllm_steer.server.admin`).

Every call reaches the engine core through vLLM's ``collective_rpc`` utility call on the
engine client (see :mod:`vllm_steer.integrations.engine.management`), so every API-server process
(``--api-server-count``) and every worker sees the same set; with data parallelism every
engine core gets the call and their answers are merged
(:mod:`vllm_steer.integrations.frontend.engine_client`). Each API server also polls the engine's
list (once a second, ``VLLM_STEER_POLL_SECONDS``): it keeps the process's view of the names
(:class:`vllm_steer.integrations.frontend.state.FrontendState`) and the metrics
(:mod:`vllm_steer.metrics`) current. The view may be a poll old, so with
``--enable-steer-updates`` a name it lacks is left to the engine core, whose refusal the
client gets as HTTP 400 (:func:`vllm_steer.integrations.frontend.async_llm.generate`). The plugin
adds this endpoint to vLLM's endpoint-plugin list itself
(:func:`vllm_steer.integrations.frontend.endpoints.load_endpoint_plugins`).
"""

from __future__ import annotations

import asyncio
import os

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

from vllm_steer.integrations.frontend.engine_client import manage
from vllm_steer.integrations.frontend.state import frontend_state
from vllm_steer.server.admin import admin_refused
from vllm_steer.server.errors import error_response as _error
from vllm_steer.server.errors import error_type
from vllm_steer.logs import get_logger

logger = get_logger()
router = APIRouter()
#: Seconds between two refreshes of this API server's view (names admitted, metrics);
#: ``VLLM_STEER_POLL_SECONDS`` overrides it (tests make it long to keep a view stale).
POLL_SECONDS = float(os.environ.get("VLLM_STEER_POLL_SECONDS", "1.0"))


class LoadSteerRequest(BaseModel):
    """Body of ``POST /v1/steers``."""

    name: str = Field(..., description="Name requests will use (letters, digits, _ - .).")
    path: str | None = Field(None, description="The steer file (default: "
                             "--steer-dir/NAME.safetensors).")


def _engine(raw: Request):
    return getattr(raw.app.state, "vllm_steer_engine_client", None)


@router.get("/v1/steers")
async def list_steers(raw: Request):
    engine = _engine(raw)
    if engine is None:
        return _error(503, "no engine behind this server")
    # this process's admission view, before refresh
    admitted = sorted(frontend_state().loaded_names())
    res = await manage(engine, "list")
    if res.get("ok") is False:  # the engine core's list failed (its answer says why)
        return _error(int(res.get("status", 500)), str(res.get("error", "")))
    if not res.get("enabled"):
        return _error(404, "steering is not enabled on this server", "NotFoundError")
    data = [s for s in res["steers"] if s["state"] != "draining"]
    return JSONResponse({"object": "list", "data": data,
                         "draining": [s for s in res["steers"] if s["state"] == "draining"],
                         "max_steers": res["stats"]["capacity"],
                         "steer_dir": res.get("steer_dir"),
                         "updates_enabled": bool(res.get("enable_updates")),
                         # each worker's steer-op counters and the [bank_slot, load_id, name]
                         # it holds (every engine core's workers, with data parallelism)
                         "workers": res.get("workers") or [],
                         # which API-server process answered, and the names it admitted then
                         "api_server": {"pid": os.getpid(), "admits": admitted}})


def _updates_refused() -> JSONResponse | None:
    cfg = frontend_state().config
    if cfg is None or not cfg.enable_updates:
        return _error(403, "steer updates are disabled on this server; start it with "
                      "--enable-steer-updates to load and unload steers over HTTP",
                      "PermissionError")
    return None


@router.post("/v1/steers")
async def load_steer(body: LoadSteerRequest, raw: Request):
    from vllm_steer.integrations.engine.registry import (SteerNameError, check_name, dir_path,
                                                         path_inside)

    refused = admin_refused(raw, "load steers") or _updates_refused()
    if refused is not None:
        return refused
    engine = _engine(raw)
    if engine is None:
        return _error(503, "no engine behind this server")
    cfg = frontend_state().config
    try:
        check_name(body.name)
        path = body.path
        if path is None:
            if not cfg.steer_dir:
                return _error(400, "give \"path\" (this server has no --steer-dir)")
            path = dir_path(cfg.steer_dir, body.name)
    except SteerNameError as e:
        return _error(400, str(e))
    if not os.path.isabs(path) and cfg.steer_dir:  # a relative path is under --steer-dir
        path = os.path.join(cfg.steer_dir, path)
    path = os.path.abspath(path)  # the one path checked and loaded
    if not cfg.updates_any_path and not path_inside(path, cfg.steer_dir):
        where = (f"inside --steer-dir {cfg.steer_dir}" if cfg.steer_dir
                 else "in --steer-dir (this server has none)")
        return _error(403, f"path {body.path!r}: steer files must be {where}; start the server "
                      "with --steer-updates-any-path to allow any path", "PermissionError")
    res = await manage(engine, "load", name=body.name, path=path, source="api")
    if not res["ok"]:
        return _error(res["status"], res["error"], error_type(res["status"]))
    return JSONResponse({"object": "steer", **res["steer"], "evicted": res.get("evicted")})


@router.delete("/v1/steers/{name}")
async def unload_steer(name: str, raw: Request):
    refused = admin_refused(raw, "unload steers") or _updates_refused()
    if refused is not None:
        return refused
    engine = _engine(raw)
    if engine is None:
        return _error(503, "no engine behind this server")
    res = await manage(engine, "unload", name=name)
    if not res["ok"]:
        return _error(res["status"], res["error"], error_type(res["status"]))
    return JSONResponse({"object": "steer", "deleted": True, **res["steer"]})


async def _poll(engine) -> None:
    while True:
        try:
            await manage(engine, "list")
        except asyncio.CancelledError:
            raise
        except Exception as e:  # the engine is shutting down, or busy: try again
            logger.debug("vllm-steer: steer list poll failed: %s", e)
        await asyncio.sleep(POLL_SECONDS)


class SteerManagementEndpoint:
    """vLLM endpoint plugin serving ``/v1/steers`` (added by the general plugin)."""

    name = "vllm_steer_steers"
    required_tasks = ("generate",)

    def attach_router(self, app) -> None:
        app.include_router(router)

    async def init_state(self, engine_client, state, args) -> None:
        state.vllm_steer_engine_client = engine_client
        if engine_client is not None:
            state.vllm_steer_poll = asyncio.get_running_loop().create_task(_poll(engine_client))
