"""The engine core's side of a fault of the plugin's worker code: the requests it failed are
finished with the plugin's HTTP 500, and the engine goes on serving.

The worker names them on the step's ``ModelRunnerOutput``
(:data:`~vllm_steer.integrations.protocol.STEP_FAILED_ATTR`: ``{request id: message}``,
:mod:`vllm_steer.integrations.worker.step_faults`). ``Scheduler.update_from_output`` finishes
each first (``FINISHED_ERROR``, as vLLM aborts a request), so vLLM serves none of the token it
sampled for it in that step, then adds its error output, as the engine core's guard answers a
request whose admission failed
(:func:`~vllm_steer.integrations.engine.core.send_refusal`): ``finish_reason`` ``error``, its
``stop_reason`` :data:`~vllm_steer.integrations.protocol.FAILED_PREFIX` and the message, which
the API server answers with HTTP 500 naming vllm-steer and the request.

This module imports no torch.
"""

from __future__ import annotations

from vllm_steer.integrations import vllm_access as va
from vllm_steer.integrations.protocol import FAILED_PREFIX
from vllm_steer.logs import get_logger

logger = get_logger()


def update_from_output(orig, self, scheduler_output, model_runner_output):
    """``Scheduler.update_from_output``: the requests the step's worker code failed
    (:data:`~vllm_steer.integrations.protocol.STEP_FAILED_ATTR` of ``model_runner_output``)
    are finished with an error output naming vllm-steer; vLLM updates every other request
    from the step as it would. One attribute read per step when there is none."""
    failed = va.step_failures(model_runner_output)
    if not failed:
        return orig(self, scheduler_output, model_runner_output)
    running = va.fail_running_requests(self, failed)
    outputs = orig(self, scheduler_output, model_runner_output)
    for rid, client in running:
        logger.warning("vllm-steer: request %s failed in the worker (HTTP 500): %s", rid,
                       failed[rid])
        va.add_error_output(outputs, client, rid, FAILED_PREFIX + failed[rid])
    return outputs
