"""Test harness: fault injection into the plugin's code, in every process of a server.

A server started with this folder on ``PYTHONPATH`` and ``STEER_TEST_FAULTS=DIR`` (no
``VLLM_`` prefix: vLLM warns about unknown ``VLLM_*`` variables) replaces each function of
:data:`TARGETS` (the plugin's code that one hook of the ``frontend`` or ``engine`` group runs
inside the plugin's guard, and steps inside the management ops that write) and of
:data:`WORKER_TARGETS` (the worker's per-step code) by one that raises ``RuntimeError`` on its
next call after the test creates the file ``DIR/<module>:<name>``: the call that takes the
file (``os.remove``, one process wins) raises, every other call runs the real function. So one
request meets the fault and the next one does not (tests/e2e/test_vllm_faults.py). A target
``module:Class.method`` is a method of a class.

Python imports ``sitecustomize`` at start-up from ``sys.path``, so every process vLLM spawns
(API servers, engine core) patches the modules before vLLM registers the plugin (the plugin's
wrappers look these functions up in their modules at call time). This is a test harness, not
product code.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import os

#: ``module:function`` the fault test can make raise (the plugin's code at each hook).
TARGETS = (
    "vllm_steer.integrations.frontend.preset_models:apply_preset",
    "vllm_steer.integrations.frontend.request_field:refuse_steered_beam_search",
    "vllm_steer.integrations.frontend.request_field:carry_steer",
    "vllm_steer.integrations.frontend.preset_models:pinned_preset",
    "vllm_steer.integrations.frontend.preset_models:presets",
    "vllm_steer.integrations.frontend.preset_models:_runtime_presets_on",
    "vllm_steer.integrations.frontend.async_llm:_preload_dir_steers",
    "vllm_steer.integrations.frontend.async_llm:_raise_engine_refusal",
    "vllm_steer.integrations.frontend.responses_stream:held_box",
    "vllm_steer.integrations.engine.core:bind_request",
    "vllm_steer.integrations.engine.core:run_op",
    # inside the management ops that write: after every worker's put and before the
    # registry's commit; a worker's drop after the unload; the preset table's changes
    "vllm_steer.integrations.engine.registry:SteerRegistry.commit",
    "vllm_steer.integrations.worker.management:worker_op",
    "vllm_steer.integrations.engine.presets:PresetTable.add",
    "vllm_steer.integrations.engine.presets:PresetTable.delete",
)
#: The same for the plugin's per-step worker code (``module:Class.method`` for a method): the
#: steer op and the step planner behind the head, the V1 runner's row positions, V2's row
#: mapping, one request put into its request slot.
WORKER_TARGETS = (
    "vllm_steer.integrations.worker.planner:StepPlanner.steer_rows",
    "vllm_steer.integrations.worker.v1:v1_batch_positions",
    "vllm_steer.integrations.worker.v2:_batch_rows",
    "vllm_steer.bank:SlotBank.coef_row",
)
MESSAGE = "fault injected by the test"


def _armed(directory: str, target: str) -> bool:
    try:
        os.remove(os.path.join(directory, target))
        return True
    except FileNotFoundError:
        return False


def _faulty(directory: str, target: str, fn):
    if inspect.iscoroutinefunction(fn):
        @functools.wraps(fn)
        async def afaulty(*args, **kwargs):
            if _armed(directory, target):
                raise RuntimeError(f"{MESSAGE} ({target})")
            return await fn(*args, **kwargs)
        return afaulty

    @functools.wraps(fn)
    def faulty(*args, **kwargs):
        if _armed(directory, target):
            raise RuntimeError(f"{MESSAGE} ({target})")
        return fn(*args, **kwargs)
    return faulty


def _install(directory: str) -> None:
    for target in TARGETS:
        module, _, name = target.partition(":")
        owner = importlib.import_module(module)
        *classes, name = name.split(".")  # ``module:Class.method``: a method of a class
        for cls in classes:
            owner = getattr(owner, cls)
        setattr(owner, name, _faulty(directory, target, getattr(owner, name)))
    # the worker's modules import torch: patched when vLLM (and so torch) is imported anyway
    for target in WORKER_TARGETS:
        module, _, name = target.partition(":")
        mod = importlib.import_module(module)
        owner, _, attr = name.rpartition(".")
        owner = getattr(mod, owner) if owner else mod
        setattr(owner, attr, _faulty(directory, target, getattr(owner, attr)))


if os.environ.get("STEER_TEST_FAULTS"):
    _install(os.environ["STEER_TEST_FAULTS"])
