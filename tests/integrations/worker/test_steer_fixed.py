"""The capture-safe steer of drafter rows (``StepPlanner.steer_fixed``: Model Runner V2's EAGLE /
EAGLE-3 / MTP drafters, whose LM head runs inside CUDA-graph-captured draft steps).

A CUDA graph replays the kernels it recorded, on the buffers it recorded, with no Python. So
the op is right in a graph when (1) it computes the formula, (2) the kernels it launches and
their shapes do not depend on any value (a capture records them once), (3) it reads no value
back to the host (a capture refuses, a replay would skip it) and (4) every buffer it reads
keeps its storage while steers and requests come and go. Each is pinned here, on the CPU,
against the plain-torch reference and vLLM's own slot table updates."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers.capture import Record

from helpers.steers import random_steer
from vllm_steer.format import save_steer
from vllm_steer.integrations.worker.runtime import get_runtime
from vllm_steer.reference import steer_coefficients, steer_reference

HIDDEN = 32


def _runtime(tmp_path, dtype=torch.float32):
    steers = {}
    for name, seed, rank in (("a", 1, 4), ("b", 2, 8)):
        steers[name] = str(tmp_path / f"{name}.safetensors")
        save_steer(steers[name], random_steer(HIDDEN, rank, name, seed=seed, scale=2.0))
    rt = get_runtime({"vllm_steer": {"steers": steers, "backend": "torch", "max_steers": 3,
                                     "max_steer_rank": 8}})
    rt.bank_state.load(HIDDEN, torch.device("cpu"), dtype)
    rt.ensure_slots(8, torch.device("cpu"))
    rt.enable_fixed_drafter()
    return rt


def _row(rt, **strengths):
    row = np.zeros(rt.slots.num_columns, dtype=np.float32)
    for name, s in strengths.items():
        j = rt.bank_state.bank.names.index(name)
        row[j], row[rt.bank_state.capacity + j] = steer_coefficients(
            s, rt.bank_state.bank.steers[j].metadata.epsilon, None)
    return row


def _set(rt, rows: dict):
    for slot, row in rows.items():
        rt.set_slot(slot, row)
    rt.slots.flush()


def _want(rt, h, mapping, rows):
    coefs = np.stack([rows.get(int(s), np.zeros(rt.slots.num_columns, np.float32)) if s >= 0
                      else np.zeros(rt.slots.num_columns, np.float32) for s in mapping])
    return steer_reference(h, *rt.bank_state.bank.factors,
                           torch.from_numpy(coefs))


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_rows_get_their_slots_steers_and_padding_rows_are_left_alone(tmp_path, dtype, tol):
    rt = _runtime(tmp_path, dtype)
    rows = {0: _row(rt, a=5), 3: _row(rt, a=-2, b=4), 5: _row(rt)}
    _set(rt, rows)
    mapping = torch.tensor([3, 5, 0, -1, -1], dtype=torch.int32)  # V2 pads with -1
    h = torch.randn(5, HIDDEN, generator=torch.Generator().manual_seed(0)).to(dtype)
    out = rt.planner.steer_fixed(h, mapping)
    torch.testing.assert_close(out, _want(rt, h, mapping.numpy(), rows), atol=tol, rtol=tol)
    assert torch.equal(out[1], h[1]) and torch.equal(out[3:], h[3:])  # unsteered, padding
    assert not torch.equal(out[0], h[0]) and not torch.equal(out[2], h[2])


def test_the_op_records_the_same_kernels_whatever_the_values_and_reads_nothing_back(tmp_path):
    """What a capture records (ops and shapes) is the same for any coefficients and mapping,
    including a batch with no steered row, and nothing goes back to the host."""
    rt = _runtime(tmp_path)
    h = torch.randn(6, HIDDEN)
    recorded = []
    for rows, mapping in (({0: _row(rt, a=5), 2: _row(rt, b=-3)}, [0, 2, 1, -1, -1, -1]),
                          ({1: _row(rt, a=1, b=1)}, [4, 1, 1, 2, 0, -1]),
                          ({0: _row(rt, a=0.5), 1: _row(rt), 2: _row(rt)}, [2, 1, 0, 5, 6, 7])):
        _set(rt, rows)
        m = torch.tensor(mapping, dtype=torch.int32)
        with Record() as rec:
            rt.planner.steer_fixed(h, m)
        recorded.append(rec.ops)
    assert recorded[0] == recorded[1] == recorded[2], recorded
    assert len(recorded[0]) > 5  # the op ran (an empty record would prove nothing)


def test_buffers_keep_their_storage_while_steers_and_requests_change(tmp_path):
    """A graph captured before a run-time load reads, at replay, the steers loaded since: the
    slot table and the bank keep their storage and shape, and the op's result
    follows the new steer (here: a steer put into the free third slot, then the first dropped)."""
    rt = _runtime(tmp_path)
    ptrs = [t.data_ptr() for t in (rt.slots.table, rt.bank_state.bank.p1,
                                   rt.bank_state.bank.p2)]
    shapes = [t.shape for t in (rt.bank_state.bank.p1, rt.bank_state.bank.p2)]
    rt.put_steer(2, 7, "c", random_steer(HIDDEN, 6, "c", seed=3, scale=2.0))
    rt.drop_slots([0])
    rows = {1: _row(rt, c=4), 4: _row(rt, b=-5, c=2)}
    _set(rt, rows)
    assert [t.data_ptr() for t in (rt.slots.table, rt.bank_state.bank.p1,
                                   rt.bank_state.bank.p2)] == ptrs
    assert [t.shape for t in (rt.bank_state.bank.p1, rt.bank_state.bank.p2)] == shapes
    mapping = torch.tensor([4, 1, 0], dtype=torch.int32)
    h = torch.randn(3, HIDDEN)
    torch.testing.assert_close(rt.planner.steer_fixed(h, mapping),
                               _want(rt, h, mapping.numpy(), rows), atol=1e-5, rtol=1e-5)


def test_a_steer_wider_than_an_unbounded_banks_rank_grows_it_and_the_drafter_applies_it(
        tmp_path):
    import logging

    from vllm_steer.logs import get_logger

    rt = _runtime(tmp_path)
    # a run-time load above the reservation (no --max-steer-rank)
    rt.bank_state.bank.max_rank = None
    lines = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: lines.append(record.getMessage())
    get_logger().addHandler(handler)
    try:
        rt.put_steer(2, 7, "wide", random_steer(HIDDEN, 12, "wide", seed=4, scale=2.0))
    finally:
        get_logger().removeHandler(handler)
    assert rt.bank_state.bank.rank == 12
    assert any("the steer bank grows from rank 8 to 12 per steer" in line
               for line in lines), lines
    rows = {0: _row(rt, wide=4, a=1)}
    _set(rt, rows)
    h, mapping = torch.randn(1, HIDDEN), torch.tensor([0])
    torch.testing.assert_close(rt.planner.steer_fixed(h, mapping),
                               _want(rt, h, mapping.numpy(), rows), atol=1e-5, rtol=1e-5)


def test_outside_a_capture_a_worker_with_no_steered_slot_skips_the_op(tmp_path):
    rt = _runtime(tmp_path)
    _set(rt, {0: _row(rt)})
    h, m = torch.randn(2, HIDDEN), torch.tensor([0, -1])
    with Record() as rec:
        out = rt.planner.steer_fixed(h, m)
    assert out is h and rec.ops == []
