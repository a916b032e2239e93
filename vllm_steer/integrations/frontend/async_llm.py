"""The API server's hooks on vLLM's ``AsyncLLM``: an engine-side steer refusal answered as
HTTP 400, and ``--steer-dir`` steers loaded before admission.

This module imports no torch (the frontend imports it).
"""

from __future__ import annotations

import asyncio
import os
import time

from vllm_steer import REQUEST_FIELD
from vllm_steer.integrations import guard
from vllm_steer.integrations.frontend import admission
from vllm_steer.integrations.frontend.engine_client import manage
from vllm_steer.integrations.frontend.state import frontend_state
from vllm_steer.integrations.protocol import (FAILED_PREFIX, OP_LOAD, REFUSED_PREFIX,
                                              SOURCE_STEER_DIR, name_problem)
from vllm_steer.request import SteerRequestError, admitted


async def generate(orig, self, *args, **kwargs):
    """``AsyncLLM.generate`` raises ``VLLMValidationError`` (HTTP 400, ``param: "steer"``; the
    error event of a stream) when the engine core refused the request's steer at admission
    (:func:`vllm_steer.integrations.engine.core.send_refusal`): a steer unloaded, or not yet
    loaded, in the engine while this API server's view of the names was a moment old."""
    agen = orig(self, *args, **kwargs)
    try:
        async for out in agen:
            with guard.frontend("AsyncLLM.generate", getattr(out, "request_id", None),
                                count=False):  # the engine core counted its refusal
                _raise_engine_refusal(out)
            yield out
    except Exception as e:
        ours = guard.plugin_error_in(e)  # the plugin's 500 from add_request, with its message
        if ours is not None and ours is not e:
            raise ours from None
        raise
    finally:
        await agen.aclose()


def _raise_engine_refusal(out) -> None:
    """Raise the client's answer if the engine core finished ``out``'s request with a
    refusal (HTTP 400, ``param: "steer"``) or a fault of the plugin (HTTP 500)."""
    for o in getattr(out, "outputs", None) or ():
        reason = getattr(o, "stop_reason", None)
        if not isinstance(reason, str):
            continue
        if reason.startswith(REFUSED_PREFIX):
            from vllm.exceptions import VLLMValidationError

            raise VLLMValidationError(reason[len(REFUSED_PREFIX):], parameter=REQUEST_FIELD)
        if reason.startswith(FAILED_PREFIX):
            raise guard.internal_error(reason[len(FAILED_PREFIX):])


async def add_request(orig, self, request_id, prompt, params, *args, **kwargs):
    """``AsyncLLM.add_request`` loads a ``--steer-dir`` steer a request is served with before
    admitting it, so a refusal (bad file, capacity full) is an HTTP 400 with the reason. (The
    engine core binds, and loads on first use, anyway: this only surfaces the errors.) A
    request the frontend has not admitted yet (a caller of ``AsyncLLM`` with a steer value of
    its own) is admitted here first (:func:`~vllm_steer.integrations.frontend.admission.
    validate`), so its value is parsed once."""
    cfg = frontend_state().config
    if cfg is not None and cfg.steer_dir and hasattr(params, "extra_args"):
        with guard.frontend("AsyncLLM.add_request", request_id):
            admission.validate(params)
            await _preload_dir_steers(self, cfg, params)
    return await orig(self, request_id, prompt, params, *args, **kwargs)


async def _preload_dir_steers(engine, cfg, params) -> None:
    request = admitted((params.extra_args or {}).get(REQUEST_FIELD))
    if request is None:
        return
    st = frontend_state()
    loaded = st.loaded_names()
    names = list(request.strengths)
    for name in names:
        if name in loaded or name_problem(name):
            continue
        try:  # file, header, size: the admission's own check of a --steer-dir steer
            path = admission.dir_steer_file(name, loaded)
        except SteerRequestError:
            return  # the engine core refuses it with the reason
        res = await _load_waiting_for_room(engine, name, path, names)
        if not res["ok"] and name not in st.loaded_names():
            raise admission.field_error(f"{REQUEST_FIELD}: {res['error']}",
                                        "bank_full" if res.get("status") == 507 else "bad_file")


def first_use_wait_seconds() -> float:
    """How long a request waits for a steer slot when every slot is held by steers that
    running requests use (``VLLM_STEER_FIRST_USE_WAIT_SECONDS``, default
    :data:`FIRST_USE_WAIT_SECONDS`), as vLLM's ``--max-loras`` makes a request wait."""
    try:
        return max(0.0, float(os.environ.get("VLLM_STEER_FIRST_USE_WAIT_SECONDS",
                                             FIRST_USE_WAIT_SECONDS)))
    except ValueError:
        return FIRST_USE_WAIT_SECONDS


#: Default of :func:`first_use_wait_seconds`.
FIRST_USE_WAIT_SECONDS = 10.0


async def _load_waiting_for_room(engine, name: str, path: str, names: list) -> dict:
    """Load the ``--steer-dir`` steer ``name`` for a request naming ``names`` (never evicting
    one of them: ``protect``). When the bank is full of steers running requests use (507), wait
    for one of them to finish, retrying with a growing pause, up to
    :func:`first_use_wait_seconds`; then the refusal stands (HTTP 400 naming the limit)."""
    deadline = time.monotonic() + first_use_wait_seconds()
    pause = 0.05
    while True:
        res = await manage(engine, OP_LOAD, name=name, path=path, source=SOURCE_STEER_DIR,
                           protect=names)
        if res["ok"] or res.get("status") != 507 or time.monotonic() + pause > deadline:
            return res
        await asyncio.sleep(pause)
        pause = min(pause * 2, 0.5)
