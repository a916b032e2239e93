"""What a fault of the plugin's worker code must leave in one ``LLM.generate`` call's outputs:
the steered request ended with an error naming vllm-steer and the fault, every other request
exactly plain greedy decoding (the engine tests of TP, PP and async scheduling use it)."""

from __future__ import annotations

from typing import Callable, Sequence

#: The step planner's per-step rows: the worker function those tests make fail once.
STEP_ROWS = "vllm_steer.integrations.worker.planner:StepPlanner._step_rows"


def check_only_the_steered_request_failed(outs: Sequence, steered: int, target: str,
                                          greedy: Callable[[int, list[int]], list[int]]) -> None:
    """``outs[steered]`` failed with the plugin's error for ``target`` at its first step, with
    no token; every other output's tokens are ``greedy(i, its prompt's token ids)`` (plain
    torch on the model's weights)."""
    from vllm_steer.integrations.protocol import FAILED_PREFIX

    bad = outs[steered].outputs[0]
    assert bad.finish_reason == "error", bad
    assert bad.stop_reason.startswith(FAILED_PREFIX + "vllm-steer: internal error in the "
                                      "steered LM head while serving request "), bad
    assert f"fault injected by the test ({target})" in bad.stop_reason
    # the fault came at the request's first step: nothing of that step was served
    assert list(bad.token_ids) == [], bad.token_ids
    for i, o in enumerate(outs):
        if i != steered:
            assert list(o.outputs[0].token_ids) == greedy(i, list(o.prompt_token_ids)), i


def step_rows_fault() -> Callable:
    """A function for ``LLM.collective_rpc``: in each worker, the next call of
    :data:`STEP_ROWS` raises, once. (Defined inside a function, so vLLM's cloudpickle sends
    it by value: the worker processes need not import this module.)"""
    target = STEP_ROWS

    def arm(worker):
        from vllm_steer.integrations.worker.planner import StepPlanner

        real = StepPlanner.__dict__["_step_rows"]

        def once(*args, **kwargs):
            StepPlanner._step_rows = real
            raise RuntimeError(f"fault injected by the test ({target})")

        StepPlanner._step_rows = once
        return True

    return arm
