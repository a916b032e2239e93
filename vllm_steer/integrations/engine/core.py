"""The engine core's hooks: run-time steer management and admission.

``EngineCore.collective_rpc`` answers the management method
(:data:`~vllm_steer.integrations.protocol.MANAGEMENT_METHOD`: load / unload / list / presets,
:mod:`vllm_steer.integrations.engine.management`), and ``EngineCore.add_request`` binds each
request's steers to (bank slot, load) (:mod:`vllm_steer.integrations.engine.binding`); a
request refused there is finished at once with an error output (:func:`send_refusal`), which
the API server turns into HTTP 400 (:mod:`vllm_steer.integrations.frontend.async_llm`).

This module imports no torch.
"""

from __future__ import annotations

from vllm_steer.integrations.engine.binding import SteerAdmissionError, bind_request
from vllm_steer.integrations.engine.management import run_op
from vllm_steer.integrations.protocol import MANAGEMENT_METHOD, REFUSED_PREFIX
from vllm_steer.logs import get_logger

logger = get_logger()


def collective_rpc(orig, self, method, timeout=None, args=(), kwargs=None):
    """``EngineCore.collective_rpc`` answers :data:`~vllm_steer.integrations.protocol.
    MANAGEMENT_METHOD` in the engine core (load / unload / list / presets, forwarded to every
    worker by the executor's own collective_rpc)."""
    if method == MANAGEMENT_METHOD:
        return [run_op(self, *args)]
    return orig(self, method, timeout, args, kwargs)


def add_request(orig, self, request, request_wave: int = 0):
    """``EngineCore.add_request``: each steer bound to (bank slot, load)
    (:func:`~vllm_steer.integrations.engine.binding.bind_request`); a request refused there
    is finished at once with an error output (:func:`send_refusal`)."""
    try:
        bind_request(self, request)
    except SteerAdmissionError as e:
        if getattr(self, "output_queue", None) is None:  # engine core in this process
            raise  # (offline): the caller sees it
        logger.warning("vllm-steer: request %s refused: %s", request.request_id, e)
        send_refusal(self, request, str(e))
        return
    return orig(self, request, request_wave)


def send_refusal(core, request, message: str) -> None:
    """Finish ``request`` at once with vLLM's error output (as
    ``EngineCore._send_error_outputs_to_client`` does), its ``stop_reason`` carrying
    :data:`~vllm_steer.integrations.protocol.REFUSED_PREFIX` and ``message``: the API server's
    ``AsyncLLM.generate`` hook turns it into the client's HTTP 400 instead of vLLM's generic
    500."""
    from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs, FinishReason

    out = EngineCoreOutput(request.request_id, [], finish_reason=FinishReason.ERROR,
                           stop_reason=REFUSED_PREFIX + message)
    core.output_queue.put_nowait(
        (request.client_index, EngineCoreOutputs(finished_requests={request.request_id},
                                                 outputs=[out])))
