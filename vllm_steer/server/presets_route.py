"""Presets, defaults and floors on the vLLM server (see :mod:`vllm_steer.policy`).

- Response headers on every request served with a steer: ``x-vllm-steer-applied:
  detox=2,sentiment=-3`` (what the request is served with, after preset, defaults and
  floors) and ``x-vllm-steer-floored: detox`` when a floor raised a steer. Set by an ASGI
  middleware from what the request's ``to_sampling_params`` recorded
  (:func:`vllm_steer.integrations.frontend.request_scope.record_applied`, called by the plugin),
  so streaming responses carry them too.
- ``GET /v1/steer-presets``: the presets (served as model names, each with its source:
  ``--steer-preset``, ``file`` or ``api``), defaults and floors.
- ``POST /v1/steer-presets`` ``{"name": "polite", "steer": {"detox": 4, "sentiment": -2}}``
  (add; a taken name is refused), ``PUT /v1/steer-presets/{name}`` ``{"steer": {...}}`` (add,
  or replace a run-time preset in one step: no request sees it missing) and ``DELETE
  /v1/steer-presets/{name}``: presets at run time, only with ``--enable-steer-updates`` (else
  HTTP 403 naming the flag; with a steer admin key, ``--steer-admin-key``, only requests
  sending it: :mod:`vllm_steer.server.admin`). The table lives in the engine core, so every API
  server sees a change from the moment the call returns (design:
  :mod:`vllm_steer.integrations.engine.presets`).
- ``--steer-presets-file PATH``: each API server looks at the file every
  ``VLLM_STEER_PRESETS_FILE_POLL_SECONDS`` (2) seconds and sends a new version to the engine
  core's table; a version refused (a steer it names not on this replica's volume yet) is read
  again at every poll until one loads (:class:`PresetsFileWatcher`; the format:
  :mod:`vllm_steer.presets_file`). ``GET /v1/steer-presets`` shows the file's state
  (``presets_file_state``: the version serving, the one refused and why).

The plugin adds this endpoint to vLLM's endpoint-plugin list itself
(:func:`vllm_steer.integrations.frontend.endpoints.load_endpoint_plugins`).
"""

from __future__ import annotations

import asyncio
import json
import os
import time

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from vllm_steer.integrations import vllm_access
from vllm_steer.integrations.frontend.engine_client import manage
from vllm_steer.integrations.frontend import request_scope
from vllm_steer.integrations.frontend.request_scope import close_scope, open_scope
from vllm_steer.integrations.frontend.state import frontend_state
from vllm_steer.integrations.engine.presets import FILE_TAKES
from vllm_steer.integrations.protocol import steer_dir_names
from vllm_steer.logs import get_logger
from vllm_steer.server.admin import admin_refused
from vllm_steer.server.errors import error_response as _error
from vllm_steer.server.errors import error_type

logger = get_logger()
router = APIRouter()

class SteerHeadersMiddleware:
    """Pure ASGI middleware adding the ``x-vllm-steer-*`` headers to the response, and
    ``Retry-After`` to a request refused with HTTP 429 (every steer slot held by running
    requests, after the wait).

    A steered request (:func:`~vllm_steer.integrations.frontend.request_scope.mark_steered`)
    and one that may wait for a steer slot (:func:`~vllm_steer.integrations.frontend.
    request_scope.hold_start`) have their response's start held until its first body: a
    stream, whose HTTP 200 starlette sends before the first token, is then still answered
    with the 429 (JSON, vLLM's error format) when the wait ended with one, and with HTTP 400
    when the engine core refused its steer (:func:`~vllm_steer.integrations.frontend.
    request_scope.refuse_steer`: a steer unknown there), instead of an error event after a
    200. A stream is otherwise unchanged: its first body is its first token's."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope.get("type") != "http":
            return await self.app(scope, receive, send)
        box, token = open_scope()
        held: list = []  # the response's start, while held
        done = []  # set once our own 429 replaced the response

        async def send_with_headers(message):
            if done:
                return  # the rest of a stream answered with our 429
            kind = message.get("type")
            if kind == "http.response.start":
                message = _with_headers(message, box)
                if message.get("status") == 200 and (request_scope.held(box)
                                                     or request_scope.steered(box)):
                    held.append(message)
                    return
            elif kind == "http.response.body" and held:
                start = held.pop()
                answer = _refusal_response(box, scope.get("path", ""))
                if answer is not None:
                    done.append(True)
                    for m in answer:
                        await send(m)
                    return
                await send(start)
            await send(message)

        try:
            await self.app(scope, receive, send_with_headers)
            if held and not done:  # a response without a body
                await send(held.pop())
        finally:
            close_scope(token)


def _with_headers(start: dict, box: dict) -> dict:
    """The response's start with the ``x-vllm-steer-*`` headers (a response served: a refusal
    served no steer), and ``Retry-After`` on a 429 of a full steer bank."""
    extra = dict(box.get("headers") or {}) if start.get("status", 200) < 400 else {}
    refused = request_scope.busy(box)
    if refused is not None and start.get("status") == 429:
        extra["retry-after"] = str(refused[1])
    if not extra:
        return start
    headers = list(start.get("headers") or [])
    headers += [(k.encode("latin-1"), v.encode("latin-1", "replace")) for k, v in extra.items()]
    return {**start, "headers": headers}


def _refusal_response(box: dict, path: str = "") -> list[dict] | None:
    """The ASGI messages answering a held stream that had not begun, if the plugin refused
    its request meanwhile: HTTP 429 with ``Retry-After`` (a full bank), or HTTP 400 (the
    engine core refused its steer), with vLLM's error body for the route (``path``); the held
    start's ``x-vllm-steer-*`` headers dropped (nothing was served). None: not refused."""
    busy = request_scope.busy(box)
    if busy is not None:
        message, retry_after = busy
        return _error_messages(429, "Too Many Requests", message, None,
                               [(b"retry-after", str(retry_after).encode())], path)
    message = request_scope.refused(box)
    if message is not None:
        from vllm_steer import REQUEST_FIELD

        return _error_messages(400, error_type(400), message, REQUEST_FIELD, [], path)
    return None


#: The route whose errors vLLM gives in the Anthropic Messages API's form.
ANTHROPIC_MESSAGES = "/v1/messages"


def _error_messages(status: int, type_: str, message: str, param: str | None,
                    extra: list, path: str = "") -> list[dict]:
    """The ASGI messages of an HTTP ``status`` with vLLM's error body (on ``/v1/messages``,
    the Anthropic form vLLM answers there: ``{"type": "error", "error": {type, message}}``)."""
    if path.rstrip("/") == ANTHROPIC_MESSAGES:
        body = json.dumps({"type": "error", "error": {"type": type_,
                                                      "message": message}}).encode()
    else:
        body = json.dumps({"error": {"message": message, "type": type_, "param": param,
                                     "code": status}}).encode()
    headers = [(b"content-type", b"application/json"),
               (b"content-length", str(len(body)).encode()), *extra]
    return [{"type": "http.response.start", "status": status, "headers": headers},
            {"type": "http.response.body", "body": body, "more_body": False}]


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
    table: dict = {}
    engine = frontend_state().engine
    if cfg.presets_change and engine is not None:
        try:
            table = await manage(engine, "presets")
        except Exception as e:  # the engine is shutting down: the view as it is
            logger.debug("vllm-steer: reading the presets failed: %s", e)
    runtime = table.get("presets", frontend_state().presets_view() if cfg.presets_change
                        else {})
    from_file = set(table.get("from_file") or ())
    return JSONResponse({"object": "list",
                         "data": [{"name": n, "steer": dict(m), "source": "--steer-preset"}
                                  for n, m in cfg.presets.items()]
                         + [{"name": n, "steer": dict(m), "source": "file"}
                            for n, m in runtime.items() if n in from_file]
                         + [{"name": n, "steer": dict(m), "source": "api"}
                            for n, m in runtime.items() if n not in from_file],
                         "defaults": dict(cfg.defaults), "floors": dict(cfg.floors),
                         "updates_enabled": cfg.enable_updates,
                         **({"presets_file": cfg.presets_file,
                             "presets_file_state": _file_state(raw, cfg, table)}
                            if cfg.presets_file else {}),
                         # which API-server process answered, and the run-time presets it
                         # knew before reading the engine core's table
                         "api_server": {"pid": os.getpid(), "knew": knew}})


def _file_state(raw: Request, cfg, table: dict) -> dict:
    watcher = getattr(raw.app.state, "vllm_steer_presets_watcher", None)
    if watcher is None:  # not read by this process (yet)
        watcher = PresetsFileWatcher(cfg.presets_file)
    return watcher.state(table)


def _updates_refused(cfg) -> JSONResponse | None:
    if cfg is None:
        return _error(404, _DISABLED, "NotFoundError")
    if not cfg.enable_updates:
        return _error(403, "preset updates are disabled on this server; start it with "
                      "--enable-steer-updates to add, replace and delete presets over HTTP "
                      "(or set them at start-up with --steer-preset NAME=STEER:X,..., or in "
                      "a file with --steer-presets-file PATH)",
                      "PermissionError")
    return None


def _model_names(state, cfg) -> dict[str, str]:
    """Model names no run-time or file preset may take, as this API server knows them: the
    served model, LoRA adapters, ``--steer-preset`` presets."""
    out: dict[str, str] = {}
    models = vllm_access.app_state_serving_models(state)
    if models is not None:
        base, lora = vllm_access.registry_model_names(models)
        out.update({n: "the served model name" for n in base})
        out.update({n: "a LoRA adapter" for n in lora})
    out.update({n: "a preset set by --steer-preset" for n in cfg.presets})
    return out


def _reserved(raw: Request, cfg) -> dict[str, str]:
    """Model names a new preset (POST) may not take, as this API server knows them."""
    out = _model_names(raw.app.state, cfg)
    view = frontend_state()
    out.update({n: FILE_TAKES if n in view.presets_from_file else
                f"a preset added at run time (PUT /v1/steer-presets/{n} replaces it)"
                for n in view.presets_view()})
    return out


async def _known_steers(engine, cfg) -> set[str]:
    """The steers a preset may name: loaded now (not draining), and ``--steer-dir``'s files."""
    listing = await manage(engine, "list")  # the steers loaded now, and the current table
    steers = {s["name"] for s in listing.get("steers", []) if s["state"] != "draining"}
    return steers | steer_dir_names(cfg.steer_dir)


async def _set_preset(raw: Request, name: str | None, replace: bool):
    """``POST /v1/steer-presets`` (``name`` None: from the body; a taken name is refused) and
    ``PUT /v1/steer-presets/{name}`` (``replace``: a run-time preset of that name gets the new
    mix in one step, a new name is added)."""
    import json
    import uuid

    from vllm_steer.policy import PolicyError, preset_from_body

    cfg = _config()
    refused = (admin_refused(raw, "replace presets" if replace else "add presets")
               or _updates_refused(cfg))
    if refused is not None:
        return refused
    try:
        body = await raw.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        example = ('{"steer": {"detox": 4, "sentiment": -2}}' if replace else
                   '{"name": "polite", "steer": {"detox": 4, "sentiment": -2}}')
        return _error(400, f"the body is not JSON ({e}); send e.g. {example}")
    if replace:
        if not isinstance(body, dict):
            return _error(400, "expected a JSON object, e.g. "
                          '{"steer": {"detox": 4, "sentiment": -2}}')
        if body.get("name", name) != name:
            return _error(400, f"\"name\" {body['name']!r} differs from the name in the path "
                          f"{name!r}; PUT /v1/steer-presets/NAME sets the preset NAME (leave "
                          "\"name\" out)")
        if name in cfg.presets:
            return _error(400, f"preset {name!r} is set by --steer-preset at start-up and "
                          "cannot be replaced at run time; restart the server without it, or "
                          "give the run-time preset another name")
        body = {**body, "name": name}
    engine = frontend_state().engine
    if engine is None:
        return _error(503, "no engine behind this server")
    steers = await _known_steers(engine, cfg)
    reserved = _model_names(raw.app.state, cfg) if replace else _reserved(raw, cfg)
    try:
        name, mix = preset_from_body(body, steers, cfg.max_strength, reserved)
    except PolicyError as e:
        return _error(400, str(e))
    res = await manage(engine, "preset_add", name=name, steer=mix, token=uuid.uuid4().hex,
                       replace=replace)
    if not res.get("ok"):
        return _error(res.get("status", 400), res.get("error", "refused"),
                      error_type(res.get("status", 400)))
    out = {"object": "steer_preset", "name": name, "steer": mix, "source": "api"}
    if replace:
        out["replaced"] = res.get("replaced")
    return JSONResponse(out)


@router.post("/v1/steer-presets")
async def add_preset(raw: Request):
    return await _set_preset(raw, None, replace=False)


@router.put("/v1/steer-presets/{name}")
async def put_preset(name: str, raw: Request):
    return await _set_preset(raw, name, replace=True)


@router.delete("/v1/steer-presets/{name}")
async def delete_preset(name: str, raw: Request):
    cfg = _config()
    refused = admin_refused(raw, "delete presets") or _updates_refused(cfg)
    if refused is not None:
        return refused
    engine = frontend_state().engine
    if engine is None:
        return _error(503, "no engine behind this server")
    res = await manage(engine, "preset_delete", name=name)
    if not res.get("ok"):
        return _error(res.get("status", 400), res.get("error", "refused"),
                      error_type(res.get("status", 400)))
    return JSONResponse({"object": "steer_preset", "deleted": True, **res["preset"],
                         "source": "api"})


# ---- the presets file (--steer-presets-file) -----------------------------------------------
def _iso(t: float | None) -> str | None:
    import datetime

    return None if t is None else datetime.datetime.fromtimestamp(
        t, datetime.timezone.utc).isoformat(timespec="seconds")


class PresetsFileWatcher:
    """One API server's reader of the presets file: a cheap ``stat`` per poll, and on a change
    the file read, checked and sent to the engine core (``preset_file``).

    A version that cannot be served is logged once, and retried at every poll until a version
    is served: a steer it names may reach this replica's volume after the presets file does
    (shared storage that shows files late, a copy still in flight), a name it takes may be
    freed. Meanwhile the presets loaded before stay in force. :meth:`state` says which version
    serves and what was refused, and why (``GET /v1/steer-presets``); the metrics
    ``vllm_steer:presets_file_*`` count both (:meth:`vllm_steer.metrics.SteerMetrics.presets_file`).
    """

    def __init__(self, path: str):
        self.path = path
        self.key: tuple | None | bool = False  # stat key last seen (False: none yet)
        self.loaded: str | None = None  # sha256 of the version in force
        self.loaded_at: float | None = None  # when this API server saw it served (time.time)
        self.refused: str | None = None  # what is refused now (a digest or a message)
        self.reason: str | None = None  # why, as logged
        self.refused_digest: str | None = None  # its sha256 (None: missing or unreadable)
        self.refused_since: float | None = None
        self.tries = 0  # reads of the refused version so far (the first included)
        self.reloads = 0  # versions this API server loaded (its read changed the table)
        self.refusals = 0  # versions this API server refused

    async def check(self, engine, cfg, state=None) -> dict | None:
        """Read the file if its stat changed, or again while a version is refused; returns the
        engine core's answer if it sent one, or the refusal."""
        from vllm_steer import presets_file as pf

        key = await asyncio.to_thread(pf.stat_key, self.path)
        if key == self.key and self.refused is None:
            return None
        self.key = key
        digest = None
        try:
            if key is None:
                raise pf.PresetsFileError(f"presets file {self.path} is missing; write it "
                                          f"back (e.g. {pf.FILE_EXAMPLE}, or "
                                          '{"presets": {}} for none)')
            text, stamp = await asyncio.to_thread(pf.read_file, self.path)
            digest = stamp[1]
            if digest == self.loaded:  # touched, not changed (or a refused one undone)
                self._serving(None, digest)
                return None
            raw = pf.parse(text, self.path)
            presets = pf.check(raw, self.path, await _known_steers(engine, cfg),
                               cfg.max_strength, _model_names(state, cfg))
        except pf.PresetsFileError as e:
            return self._refuse(str(e), digest)
        res = await manage(engine, "preset_file", presets=presets, stamp=list(stamp),
                            path=self.path)
        if not res.get("ok"):
            return self._refuse(f"presets file {self.path}: {res.get('error')}", stamp[1], res)
        self._serving(res, stamp[1])
        return res

    def _serving(self, res: dict | None, digest: str) -> None:
        """The version of ``digest`` serves (``res``: the engine core's answer to sending it)."""
        if self.refused is not None:
            if digest != self.loaded:
                logger.info("vllm-steer: presets file %s: version %s loaded after %d read(s) "
                            "refused since %s (%s)", self.path, digest[:12], self.tries,
                            _iso(self.refused_since), self.reason)
            else:
                logger.info("vllm-steer: presets file %s: back to the version in force (%s); "
                            "the refused one is gone", self.path, digest[:12])
        reloaded = bool(res and res.get("changed"))
        if digest != self.loaded:
            self.loaded, self.loaded_at = digest, time.time()
        self.refused = self.reason = self.refused_digest = self.refused_since = None
        self.tries = 0
        self.reloads += reloaded
        _file_metrics(reloaded=reloaded, refused=False)

    def _refuse(self, message: str, digest: str | None, res: dict | None = None) -> dict:
        mark = digest or message
        new = mark != self.refused
        if new:
            view = sorted(frontend_state().presets_view())
            logger.error("vllm-steer: %s. The file was not loaded: the presets in force before "
                         "stay (%s); it is read again every %g s until a version loads",
                         message, ", ".join(view) or "none", FILE_POLL_SECONDS)
            self.refused, self.refused_digest = mark, digest
            self.refused_since, self.tries = time.time(), 0
            self.refusals += 1
        elif message != self.reason:
            logger.info("vllm-steer: %s (still refused)", message)
        self.reason = message
        self.tries += 1
        _file_metrics(refused_new=new, refused=True)
        return res or {"ok": False, "status": 400, "error": message}

    def state(self, table: dict | None = None) -> dict:
        """The file's state for ``GET /v1/steer-presets``: the version serving (from the
        engine core's ``table`` when given: the version every API server serves) and the one
        refused now, if any, with its reason."""
        stamp = (table or {}).get("file_stamp")
        digest = stamp[1] if stamp else self.loaded
        serving = None if digest is None else {
            "sha256": digest, **({"mtime": _iso(stamp[0] / 1e9)} if stamp else {}),
            **({"loaded_at": _iso(self.loaded_at)} if digest == self.loaded else {})}
        refused = None if self.refused is None else {
            "sha256": self.refused_digest, "reason": self.reason,
            "since": _iso(self.refused_since), "reads": self.tries}
        return {"path": self.path, "poll_seconds": FILE_POLL_SECONDS, "serving": serving,
                "refused": refused, "reloads": self.reloads, "refusals": self.refusals}


def _file_metrics(**kw) -> None:
    try:
        from vllm_steer.metrics import get_metrics

        get_metrics().presets_file(**kw)
    except Exception:  # metrics never break serving
        logger.exception("vllm-steer: metrics update failed")


#: Seconds between two looks (a ``stat``) at the presets file by each API server;
#: ``VLLM_STEER_PRESETS_FILE_POLL_SECONDS`` overrides it.
FILE_POLL_SECONDS = float(os.environ.get("VLLM_STEER_PRESETS_FILE_POLL_SECONDS", "2.0"))


async def watch_presets_file(watcher: PresetsFileWatcher, engine, cfg, state) -> None:
    """Every :data:`FILE_POLL_SECONDS`, :meth:`PresetsFileWatcher.check` (off the event
    loop: the ``stat`` and the read run in a thread)."""
    while True:
        await asyncio.sleep(FILE_POLL_SECONDS)
        try:
            await watcher.check(engine, cfg, state)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # the engine is shutting down, or busy: try again
            watcher.key = False
            logger.debug("vllm-steer: presets file poll failed: %s", e)


class PresetsEndpoint:
    """vLLM endpoint plugin: the response headers and ``/v1/steer-presets`` (list; add,
    replace and delete with ``--enable-steer-updates``), and the presets file's reader."""

    name = "vllm_steer_presets"
    required_tasks = ("generate",)

    def attach_router(self, app) -> None:
        app.include_router(router)
        app.add_middleware(SteerHeadersMiddleware)

    async def init_state(self, engine_client, state, args) -> None:
        if engine_client is not None:
            frontend_state().set_engine(engine_client)
            cfg = _config()
            if cfg is not None and cfg.presets_file:  # read before the server takes requests
                watcher = PresetsFileWatcher(cfg.presets_file)
                state.vllm_steer_presets_watcher = watcher  # its state: GET /v1/steer-presets
                await watcher.check(engine_client, cfg, state)
                state.vllm_steer_presets_file = asyncio.get_running_loop().create_task(
                    watch_presets_file(watcher, engine_client, cfg, state))
