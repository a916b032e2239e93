"""The API server's hooks on vLLM's ``AsyncLLM``: an engine-side steer refusal answered as
HTTP 400, and ``--steer-dir`` steers loaded before admission (a full bank waited for, then
HTTP 429 with ``Retry-After``).

This module imports no torch (the frontend imports it).
"""

from __future__ import annotations

import asyncio
import os
import time

from vllm_steer import REQUEST_FIELD
from vllm_steer.integrations import guard, vllm_access
from vllm_steer.integrations.frontend import admission
from vllm_steer.integrations.frontend.engine_client import manage
from vllm_steer.integrations.frontend.request_scope import (mark_admitted, refuse_busy,
                                                             refuse_steer)
from vllm_steer.integrations.frontend.state import engine_scope, frontend_state
from vllm_steer.integrations.protocol import (BUSY_PREFIX, FAILED_PREFIX, OP_LOAD, REFUSED_PREFIX,
                                              SOURCE_STEER_DIR, name_problem)
from vllm_steer.logs import get_logger
from vllm_steer.request import SteerRequestError, admitted

logger = get_logger()


async def generate(orig, self, *args, **kwargs):
    """``AsyncLLM.generate`` raises ``VLLMValidationError`` (HTTP 400, ``param: "steer"``; the
    error event of a stream) when the engine core refused the request's steer at admission
    (:func:`vllm_steer.integrations.engine.core.send_refusal`): a steer unloaded, or not yet
    loaded, in the engine while this API server's view of the names was a moment old. When a
    steered request ends, the requests waiting for a steer slot are woken
    (:func:`_load_waiting_for_room`). The first output that passes marks the HTTP request admitted
    (:func:`~vllm_steer.integrations.frontend.request_scope.mark_admitted`: a streamed
    ``/v1/responses`` request's first events wait for it, :mod:`~vllm_steer.integrations.
    frontend.responses_stream`)."""
    agen = orig(self, *args, **kwargs)
    first = True
    try:
        async for out in agen:
            with guard.frontend("AsyncLLM.generate", vllm_access.request_id(out),
                                count=False):  # the engine core counted its refusal
                _raise_engine_refusal(out)
            if first:  # a held /v1/responses stream may begin (responses_stream)
                mark_admitted()
                first = False
            yield out
    except Exception as e:
        ours = guard.plugin_error_in(e)  # the plugin's 500 from add_request, with its message
        if ours is not None and ours is not e:
            raise ours from None
        raise
    finally:
        await agen.aclose()
        with engine_scope(vllm_access.engine_input_processor(self)):
            st = frontend_state()
        if st.slot_waiters and _steered(args, kwargs):  # its steers' slots may be free now
            st.slot_may_be_free()


def _steered(args: tuple, kwargs: dict) -> bool:
    """Whether the ``AsyncLLM.generate`` call with ``args`` / ``kwargs`` carries a steer (its
    sampling params: the second argument)."""
    params = kwargs.get("sampling_params", args[1] if len(args) > 1 else None)
    return REQUEST_FIELD in vllm_access.extra_args(params)


def _raise_engine_refusal(out) -> None:
    """Raise the client's answer if the engine core finished ``out``'s request with a
    refusal (HTTP 400, ``param: "steer"``), no room in the bank now (HTTP 429 with
    ``Retry-After``) or a fault of the plugin (HTTP 500)."""
    for reason in vllm_access.output_stop_reasons(out):
        if not isinstance(reason, str):
            continue
        if reason.startswith(REFUSED_PREFIX):
            from vllm.exceptions import VLLMValidationError

            message = reason[len(REFUSED_PREFIX):]
            refuse_steer(message)  # a stream that has not begun: a 400 (the middleware)
            raise VLLMValidationError(message, parameter=REQUEST_FIELD)
        if reason.startswith(BUSY_PREFIX):
            message = reason[len(BUSY_PREFIX):]
            refuse_busy(message, RETRY_AFTER_SECONDS)
            raise guard.busy_error(message)
        if reason.startswith(FAILED_PREFIX):
            raise guard.internal_error(reason[len(FAILED_PREFIX):])


async def add_request(orig, self, request_id, prompt, params, *args, **kwargs):
    """``AsyncLLM.add_request`` loads a ``--steer-dir`` steer a request is served with before
    admitting it, so a refusal (bad file, more steers than the bank) is an HTTP 400 with the
    reason, and a bank still full after the wait an HTTP 429 with ``Retry-After``. (The
    engine core binds, and loads on first use, anyway: this only surfaces the errors.) A
    request the frontend has not admitted yet (a caller of ``AsyncLLM`` with a steer value of
    its own) is admitted here first (:func:`~vllm_steer.integrations.frontend.admission.
    validate`), so its value is parsed once."""
    with engine_scope(vllm_access.engine_input_processor(self)):  # this engine's steers
        cfg = frontend_state().config
        if cfg is not None and cfg.steer_dir and vllm_access.has_extra_args(params):
            with guard.frontend("AsyncLLM.add_request", request_id):
                admission.validate(params)
                await _preload_dir_steers(self, cfg, params)
    return await orig(self, request_id, prompt, params, *args, **kwargs)


async def _preload_dir_steers(engine, cfg, params) -> None:
    request = admitted(vllm_access.extra_args(params).get(REQUEST_FIELD))
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
        if not res["ok"] and res.get("status") == 507:
            message = (f"{REQUEST_FIELD}: {res['error']}; no steer slot freed in the "
                       f"{first_use_wait_seconds():g} s this request waited "
                       "(VLLM_STEER_FIRST_USE_WAIT_SECONDS): retry after "
                       f"{RETRY_AFTER_SECONDS} s")
            refuse_busy(message, RETRY_AFTER_SECONDS)
            raise guard.busy_error(message)
        if not res["ok"] and res.get("status", 400) >= 500 and name not in st.loaded_names():
            raise guard.internal_error(res["error"])  # the load failed in the plugin: a 500
        if not res["ok"] and name not in st.loaded_names():
            message = f"{REQUEST_FIELD}: {res['error']}"
            refuse_steer(message)  # a stream that has not begun: a 400 (the middleware)
            raise admission.field_error(message, res.get("reason", "bad_file"))


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


#: A request waiting for a steer slot asks the engine core again when a steered request of
#: this API server finishes, and at least this often (requests finishing on another API
#: server, or offline, wake no one here), seconds.
FIRST_USE_POLL_SECONDS = 1.0
#: The least time between two asks of one waiting request, seconds (many steered requests
#: finishing at once wake it once).
FIRST_USE_MIN_GAP_SECONDS = 0.1
#: ``Retry-After`` of a request that got no steer slot in time (HTTP 429), seconds.
RETRY_AFTER_SECONDS = 1


async def _load_waiting_for_room(engine, name: str, path: str, names: list) -> dict:
    """Load the ``--steer-dir`` steer ``name`` for a request naming ``names`` (never evicting
    one of them: ``protect``). The engine core checks capacity before it reads the file
    (:func:`vllm_steer.integrations.engine.management.load_steer_file`): a full bank (every
    slot held by steers running requests use) answers 507 at once, read nothing, counted as
    contention. The request then waits, up to :func:`first_use_wait_seconds`, for a steered
    request of this API server to finish (or :data:`FIRST_USE_POLL_SECONDS`) and asks once
    more: one cheap call per wake-up, none on a timer of its own, and the file is read once,
    when a slot is there. Counted once in ``vllm_steer:bank_full_waits_total``; a 507 that
    stands is the caller's HTTP 429."""
    st = frontend_state()
    loop = asyncio.get_running_loop()
    deadline = time.monotonic() + first_use_wait_seconds()
    waited = False
    while True:
        woken = loop.create_future()
        st.slot_waiters.add(woken)  # before asking: a request ending meanwhile still wakes it
        try:
            asked = time.monotonic()
            res = await manage(engine, OP_LOAD, name=name, path=path, source=SOURCE_STEER_DIR,
                               protect=names)
            left = deadline - time.monotonic()
            if res["ok"] or res.get("status") != 507 or left <= 0:
                break
            waited = True
            try:
                await asyncio.wait_for(woken, min(left, FIRST_USE_POLL_SECONDS))
            except asyncio.TimeoutError:
                pass
            gap = asked + FIRST_USE_MIN_GAP_SECONDS - time.monotonic()
            if gap > 0:
                await asyncio.sleep(min(gap, max(0.0, deadline - time.monotonic())))
        finally:
            st.slot_waiters.discard(woken)
    if waited or res.get("status") == 507:
        _count_wait("loaded" if res["ok"] else "retry_after" if res.get("status") == 507
                    else None)
    return res


def _count_wait(outcome: str | None) -> None:
    if outcome is None:
        return
    try:
        from vllm_steer.metrics import get_metrics

        get_metrics().bank_full_wait(outcome)
    except Exception:  # metrics never break serving
        logger.exception("vllm-steer: metrics update failed")
