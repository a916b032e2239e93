"""The step's sampled rows for a block of direct calls into the head's planner, as a runner
adapter writes them (:class:`vllm_steer.integrations.worker.step_mapping.StepMapping`)."""

from __future__ import annotations

import contextlib


@contextlib.contextmanager
def sampled_rows(planner, source):
    """``planner.step.sampled = source`` (the worker's step mapping, as the planner reads it)
    inside the block; the previous rows after it."""
    step = planner.step
    prev, step.sampled = step.sampled, source
    try:
        yield
    finally:
        step.sampled = prev
