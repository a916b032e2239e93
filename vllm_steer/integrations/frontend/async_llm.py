"""The API server's hooks on vLLM's ``AsyncLLM``: an engine-side steer refusal answered as
HTTP 400, and ``--steer-dir`` steers loaded before admission.

This module imports no torch (the frontend imports it).
"""

from __future__ import annotations

import os

from vllm_steer import REQUEST_FIELD
from vllm_steer.integrations.engine.registry import REFUSED_PREFIX, dir_path, name_problem
from vllm_steer.integrations.frontend import admission
from vllm_steer.integrations.frontend.engine_client import control
from vllm_steer.integrations.frontend.state import frontend_state
from vllm_steer.request import SteerRequest, SteerRequestError


async def generate(orig, self, *args, **kwargs):
    """``AsyncLLM.generate`` raises ``VLLMValidationError`` (HTTP 400, ``param: "steer"``; the
    error event of a stream) when the engine core refused the request's steer at admission
    (:func:`vllm_steer.integrations.engine.core.send_refusal`): a steer unloaded, or not yet
    loaded, in the engine while this API server's view of the names was a moment old."""
    agen = orig(self, *args, **kwargs)
    try:
        async for out in agen:
            for o in getattr(out, "outputs", None) or ():
                reason = getattr(o, "stop_reason", None)
                if isinstance(reason, str) and reason.startswith(REFUSED_PREFIX):
                    from vllm.exceptions import VLLMValidationError

                    raise VLLMValidationError(reason[len(REFUSED_PREFIX):],
                                              parameter=REQUEST_FIELD)
            yield out
    finally:
        await agen.aclose()


async def add_request(orig, self, request_id, prompt, params, *args, **kwargs):
    """``AsyncLLM.add_request`` loads a ``--steer-dir`` steer a request names before admitting
    it, so a refusal (bad file, capacity full) is an HTTP 400 with the reason. (The engine
    core binds, and loads on first use, anyway: this only surfaces the errors.)"""
    cfg = frontend_state().config
    if cfg is not None and cfg.steer_dir:
        await _preload_dir_steers(self, cfg, params)
    return await orig(self, request_id, prompt, params, *args, **kwargs)


async def _preload_dir_steers(engine, cfg, params) -> None:
    value = (getattr(params, "extra_args", None) or {}).get(REQUEST_FIELD)
    if value is None:
        return
    try:
        names = list(SteerRequest.from_value(value).strengths)
    except SteerRequestError:
        return  # validation refuses it with the reason
    st = frontend_state()
    loaded = st.loaded_names()
    for name in names:
        if name in loaded or name_problem(name):
            continue
        try:
            admission._check_unloaded(SteerRequest(((name, 1.0),)))  # name, file, header, size
            path = dir_path(cfg.steer_dir, name)
        except (SteerRequestError, ValueError):
            return  # validation refuses it with the reason
        if not os.path.isfile(path):
            return
        res = await control(engine, "load", name=name, path=path, source="steer-dir")
        if not res["ok"] and name not in st.loaded_names():
            from vllm.exceptions import VLLMValidationError

            raise VLLMValidationError(f"{REQUEST_FIELD}: {res['error']}",
                                      parameter=REQUEST_FIELD)
