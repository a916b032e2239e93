"""The steering playground: a browser page at ``/steer/`` on the vLLM server, and
``GET /v1/steer/info`` (what the server knows of its steers and presets) that the page reads.

Served by the lens's endpoint plugin (``vllm_steer_lens``, see
:mod:`vllm_steer.server.lens_route`), so it is opt-in the same way::

    VLLM_PLUGINS=vllm_steer,vllm_steer_lens vllm serve MODEL --steer detox=detox.safetensors
    # then open http://HOST:PORT/steer/

The page is a few static files shipped in ``vllm_steer/server/static/`` (no build step, no
external resources: the Content-Security-Policy sent with it allows this origin only). It
generates through the server's own ``/v1/completions`` or ``/v1/chat/completions`` with the
``steer`` field (streamed), highlights through ``/v1/steer/highlight``, and lists the steers
from ``GET /v1/steers`` when the server has it, else from ``GET /v1/steer/info``. Light: no
torch; steer metadata is read from the files' headers.
"""

from __future__ import annotations

import os
from importlib import resources
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, RedirectResponse, Response

from vllm_steer.integrations import vllm_access as va

router = APIRouter()

STATIC_FILES = {
    "": ("index.html", "text/html; charset=utf-8"),
    "index.html": ("index.html", "text/html; charset=utf-8"),
    "playground.js": ("playground.js", "text/javascript; charset=utf-8"),
    "playground.css": ("playground.css", "text/css; charset=utf-8"),
}
"""URL name under ``/steer/`` -> (file in ``static/``, content type). Nothing else is served."""

CSP = ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
       "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'self'")
"""Content-Security-Policy of the page: this origin only (nothing fetched from outside)."""

_META_CACHE: dict[tuple[str, float], dict[str, Any]] = {}


def static_text(name: str) -> str:
    """The text of one of the page's files (``index.html``, ``playground.js``, ...)."""
    return (resources.files("vllm_steer.server") / "static" / name).read_text("utf-8")


@router.get("/steer", include_in_schema=False)
async def playground_redirect():
    return RedirectResponse("/steer/", status_code=307)


@router.get("/steer/{name:path}", include_in_schema=False)
async def playground_file(name: str):
    if name not in STATIC_FILES:
        return JSONResponse({"error": {"message": f"no playground file {name!r}; the "
                                       "playground is at /steer/", "type": "NotFoundError",
                                       "code": 404}}, status_code=404)
    file, ctype = STATIC_FILES[name]
    return Response(static_text(file), media_type=ctype,
                    headers={"Content-Security-Policy": CSP, "Cache-Control": "no-cache",
                             "X-Content-Type-Options": "nosniff"})


@router.get("/v1/steer/info")
async def steer_info(raw: Request):
    """The served model, the maximum ``|strength|`` and each loaded steer's metadata."""
    engine = getattr(raw.app.state, "vllm_steer_engine", None)
    cfg = server_config(engine)
    return JSONResponse(info_dict(cfg, served_model_name(engine)))


def server_config(engine):
    """The steers and limits the server validates requests against (the frontend's view)."""
    from vllm_steer.config import SteerServerConfig
    from vllm_steer.integrations.frontend.state import frontend_state

    cfg = frontend_state().config
    if cfg is None and engine is not None:
        cfg = SteerServerConfig.from_additional_config(
            va.additional_config(va.engine_vllm_config(engine)))
    return cfg


def served_model_name(engine) -> str | None:
    model_config = va.engine_model_config(engine)
    if model_config is None:
        return None
    return va.served_model_name(model_config)


def info_dict(cfg, model: str | None) -> dict[str, Any]:
    """JSON of ``GET /v1/steer/info``: ``model``, ``max_strength``, ``steers`` (a list) and
    ``presets`` (``[{"name", "steer"}]``: the ``--steer-preset`` mixes, served as model names)."""
    from vllm_steer.config import DEFAULT_MAX_STRENGTH

    if cfg is None:
        return {"model": model, "max_strength": DEFAULT_MAX_STRENGTH, "steers": [],
                "presets": []}
    presets = getattr(cfg, "presets", None) or {}
    return {"model": model, "max_strength": cfg.max_strength,
            "steers": [steer_entry(name, path) for name, path in cfg.steers.items()],
            "presets": [{"name": n, "steer": dict(m)} for n, m in presets.items()]}


def steer_entry(name: str, path: str) -> dict[str, Any]:
    """One steer as the page shows it: its name on this server, file name and metadata
    (without the training data's file list, which names paths on the training machine)."""
    try:
        key = (os.path.abspath(path), os.path.getmtime(path))
    except OSError as e:
        return {"name": name, "file": os.path.basename(str(path)), "error": str(e)}
    if key not in _META_CACHE:
        import dataclasses

        from vllm_steer.kinds import read_any_metadata

        try:
            meta = dataclasses.asdict(read_any_metadata(path))
        except Exception as e:  # noqa: BLE001 - shown in the page, the server keeps serving
            return {"name": name, "file": os.path.basename(str(path)), "error": str(e)}
        meta.pop("extra", None)
        meta.pop("data", None)
        metrics = meta.get("metrics") or {}
        meta["metrics"] = {k: v for k, v in metrics.items()
                           if k in ("dev_loss", "dev_loss_initial", "train_loss", "steps",
                                    "recommended_strength_rule")}
        meta["name_in_file"] = meta.pop("name")
        _META_CACHE[key] = meta
    return {"name": name, "file": os.path.basename(str(path)), **_META_CACHE[key]}
