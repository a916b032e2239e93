"""The engine core's hooks and their API-server halves: run-time steer management and
admission.

In the engine core, ``EngineCore.collective_rpc`` answers the steer-management method of
:mod:`vllm_steer.integrations.engine.control` (load / unload / list) and ``EngineCore.add_request``
applies defaults and floors and binds each request's steers to (slot, generation); a request
refused there is finished at once with an error output (:func:`send_refusal`). In the API
server, ``AsyncLLM.generate`` turns that refusal into HTTP 400, ``AsyncLLM.add_request`` loads
a ``--steer-dir`` steer before admission, and vLLM's endpoint-plugin loader serves
``/v1/steers`` (:mod:`vllm_steer.server.steers_route`).

This module imports no torch (the frontend imports it).
"""

from __future__ import annotations

from vllm_steer import REQUEST_FIELD
from vllm_steer.logs import get_logger

logger = get_logger()


def _hook_engine_core(engine_core_cls) -> None:
    """``EngineCore.collective_rpc`` answers :data:`registry.CONTROL_METHOD` in the engine core
    (load / unload / list, forwarded to every worker by the executor's own collective_rpc);
    ``EngineCore.add_request`` binds each request's steers to (slot, generation)."""
    EngineCore = engine_core_cls
    from vllm_steer.integrations.engine import control
    from vllm_steer.integrations.engine.registry import CONTROL_METHOD

    orig_rpc, orig_add = EngineCore.collective_rpc, EngineCore.add_request
    if getattr(orig_add, "_vllm_steer", False):
        return

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        if method == CONTROL_METHOD:
            return [control.handle(self, *args)]
        return orig_rpc(self, method, timeout, args, kwargs)

    def add_request(self, request, request_wave: int = 0):
        try:
            control.apply_policy(self, request)
            control.bind_request(self, request)
        except control.SteerAdmissionError as e:
            if getattr(self, "output_queue", None) is None:  # engine core in this process
                raise  # (offline): the caller sees it
            logger.warning("vllm-steer: request %s refused: %s", request.request_id, e)
            send_refusal(self, request, str(e))
            return
        return orig_add(self, request, request_wave)

    add_request._vllm_steer = True
    EngineCore.collective_rpc = collective_rpc
    EngineCore.add_request = add_request


def send_refusal(core, request, message: str) -> None:
    """Finish ``request`` at once with vLLM's error output (as
    ``EngineCore._send_error_outputs_to_client`` does), its ``stop_reason`` carrying
    :data:`registry.REFUSED_PREFIX` and ``message``: the API server's ``AsyncLLM.generate``
    hook turns it into the client's HTTP 400 instead of vLLM's generic 500."""
    from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs, FinishReason

    from vllm_steer.integrations.engine.registry import REFUSED_PREFIX

    out = EngineCoreOutput(request.request_id, [], finish_reason=FinishReason.ERROR,
                           stop_reason=REFUSED_PREFIX + message)
    core.output_queue.put_nowait(
        (request.client_index, EngineCoreOutputs(finished_requests={request.request_id},
                                                 outputs=[out])))


def _hook_async_llm_generate(async_llm_cls) -> None:
    """``AsyncLLM.generate`` (the API server) raises ``VLLMValidationError`` (HTTP 400,
    ``param: "steer"``; the error event of a stream) when the engine core refused the
    request's steer at admission (see :func:`send_refusal`): a steer unloaded, or not yet
    loaded, in the engine while this API server's view of the names was a moment old."""
    AsyncLLM = async_llm_cls
    orig = AsyncLLM.generate
    if getattr(orig, "_vllm_steer", False):
        return

    async def generate(self, *args, **kwargs):
        from vllm_steer.integrations.engine.registry import REFUSED_PREFIX

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

    generate._vllm_steer = True
    AsyncLLM.generate = generate


def _hook_async_llm(async_llm_cls) -> None:
    """``AsyncLLM.add_request`` (the API server) loads a ``--steer-dir`` steer a request names
    before admitting it, so a refusal (bad file, capacity full) is an HTTP 400 with the reason.
    (The engine core binds, and loads on first use, anyway: this only surfaces the errors.)"""
    AsyncLLM = async_llm_cls
    orig = AsyncLLM.add_request
    if getattr(orig, "_vllm_steer", False):
        return

    async def add_request(self, request_id, prompt, params, *args, **kwargs):
        from vllm_steer.integrations.frontend import admission as frontend

        cfg = frontend.get_config()
        if cfg is not None and cfg.steer_dir:
            await _preload_dir_steers(self, cfg, params)
        return await orig(self, request_id, prompt, params, *args, **kwargs)

    add_request._vllm_steer = True
    AsyncLLM.add_request = add_request


async def _preload_dir_steers(engine, cfg, params) -> None:
    import os

    from vllm_steer.config import SteerRequestError, parse_request_steer
    from vllm_steer.integrations.frontend import admission as frontend
    from vllm_steer.integrations.engine.registry import dir_path, name_problem

    value = (getattr(params, "extra_args", None) or {}).get(REQUEST_FIELD)
    if value is None:
        return
    try:
        names = [n for n, s in parse_request_steer(value, None, cfg.max_strength).items() if s]
    except SteerRequestError:
        return  # validation refuses it with the reason
    loaded = frontend.loaded_names()
    for name in names:
        if name in loaded or name_problem(name):
            continue
        try:
            frontend._check_unloaded({name: 1}, cfg)  # name, file, header, hidden size
            path = dir_path(cfg.steer_dir, name)
        except (SteerRequestError, ValueError):
            return  # validation refuses it with the reason
        if not os.path.isfile(path):
            return
        from vllm_steer.server.steers_route import control

        res = await control(engine, "load", name=name, path=path, source="steer-dir")
        if not res["ok"] and name not in frontend.loaded_names():
            from vllm.exceptions import VLLMValidationError

            raise VLLMValidationError(f"{REQUEST_FIELD}: {res['error']}",
                                      parameter=REQUEST_FIELD)
