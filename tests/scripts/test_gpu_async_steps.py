"""scripts/gpu_async_steps.py, the GPU window's one-step-ahead check, rehearsed on the CPU:
the plugin's worker code passes it (every row steered with its own request's coefficients of
that step, plain rows bit for bit), and the check catches a row given another request's
coefficients or the previous step's; the drafter's captured steer (run eagerly here) passes
its replays with requests, the mapping buffer and a steer changing, and the check catches
rows mapped to the wrong slots."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
import gpu_async_steps  # noqa: E402

SMALL = dict(device="cpu", steps=8, batch=16, hidden=128, layers=2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_worker_code_passes_the_one_step_ahead_check(dtype):
    r = gpu_async_steps.run(dtype=dtype, **SMALL)
    assert r["ok"], r["lines"]
    assert r["plain_diff"] == 0 and r["effect"] > 5 * gpu_async_steps.TOLERANCE[dtype]
    assert "PASS" in r["lines"][0] and "forward eager" in r["lines"][0]
    # the head's op ran from its graphs (eager stand-in: static buffers, as on a GPU) at every
    # sampled step and prompt chunk
    assert r["head_replays"] >= SMALL["steps"] * 2, r["lines"][0]


def _hook(shift):
    def hook(rt):
        if shift == "neighbour":  # each row gets the next row's request's coefficients
            real_plan = rt.planner.plan_step

            def plan_step(n, slots, positions):
                return real_plan(n, None if slots is None else np.roll(slots, 1), positions)

            rt.planner.plan_step = plan_step
            return
        # the slot table reaches the device a step late (a staging buffer reused too early):
        # each flush copies the rows the slots had at the flush before
        real_flush, last = rt.slots.flush, []

        def flush():
            now = rt.slots.host.copy()
            if last:
                rt.slots.host[...] = last[-1]
            last.append(now)
            real_flush()
            rt.slots.host[...] = now

        rt.slots.flush = flush
    return hook


@pytest.mark.parametrize("shift", ["neighbour", "previous step"])
def test_the_check_catches_rows_with_the_wrong_coefficients(shift):
    r = gpu_async_steps.run(dtype=torch.float32, runtime_hook=_hook(shift), **SMALL)
    assert not r["ok"]
    assert "FAIL" in r["lines"][0] and any("max |error|" in line for line in r["lines"][1:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_drafter_steer_passes_its_replay_check(dtype):
    r = gpu_async_steps.run_drafter(device="cpu", dtype=dtype, steps=6, batch=16, hidden=128)
    assert r["ok"], r["lines"]
    assert "eager" in r["lines"][0] and "PASS" in r["lines"][0]


def test_the_drafter_check_catches_rows_mapped_to_the_wrong_slots(monkeypatch):
    from vllm_steer.integrations.worker.planner import StepPlanner

    real = StepPlanner.steer_fixed
    monkeypatch.setattr(StepPlanner, "steer_fixed",
                        lambda self, h, m: real(self, h, m.flip(0)))  # rows get others' slots
    r = gpu_async_steps.run_drafter(device="cpu", dtype=torch.float32, steps=4, batch=16,
                                    hidden=128)
    assert not r["ok"] and "FAIL" in r["lines"][0]
