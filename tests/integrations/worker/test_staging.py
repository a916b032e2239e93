"""Host-to-device copies of a steered step on a GPU: the host never waits behind the running
forward, and every copy comes from pinned memory (a copy from pageable memory syncs the stream).

CPU tests with a recording fake of CUDA: ``torch.cuda.Event`` is an event that completes only
when the fake device finishes its step (a ``synchronize()`` before that is a host wait behind
the forward, counted), pinned allocations are registered (``torch.empty(pin_memory=True)``,
``Tensor.pin_memory``), and the runtime's staged copies take their CUDA path.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from helpers.steers import random_steer
from vllm_steer.format import save_steer
from vllm_steer.kernels import staging
from vllm_steer.integrations.worker import v2
from vllm_steer.integrations.worker.runtime import get_runtime
from vllm_steer.reference import steer_coefficients, steer_reference

HIDDEN = 32


class FakeDevice:
    """What the device has finished: events recorded during a step complete at its end."""

    def __init__(self):
        self.pending: list = []
        self.waits_on_running = 0  # host waits on an event the device has not reached
        self.pinned: set[int] = set()  # storage addresses of pinned host memory
        self.copies: list[tuple[str, bool]] = []  # (what, source pinned) of each H2D copy

    def finish_step(self):
        for e in self.pending:
            e.done = True
        self.pending.clear()

    def is_pinned(self, t: torch.Tensor) -> bool:
        return t.untyped_storage().data_ptr() in self.pinned


@pytest.fixture()
def fake_cuda(monkeypatch):
    dev = FakeDevice()

    class FakeEvent:
        def __init__(self, *a, **k):
            self.done = True

        def record(self, stream=None):
            self.done = False
            dev.pending.append(self)

        def query(self):
            return self.done

        def synchronize(self):
            if not self.done:
                dev.waits_on_running += 1
            self.done = True

    real_empty, real_pin, real_to = torch.empty, torch.Tensor.pin_memory, torch.Tensor.to

    def empty(*a, pin_memory=False, **k):
        t = real_empty(*a, **k)
        if pin_memory:
            dev.pinned.add(t.untyped_storage().data_ptr())
        return t

    def pin_memory(t, *a, **k):
        p = t.clone()
        dev.pinned.add(p.untyped_storage().data_ptr())
        return p

    def to(t, *a, **k):
        out = real_to(t, *a, **k)
        if t.device.type == "cpu" and out.device.type != "cpu":
            dev.copies.append((f"to({out.device})", dev.is_pinned(t)))
        return out

    class OnCuda(staging.StagedCopy):  # the staged copies take their CUDA path
        def __init__(self, device):
            super().__init__(device)
            self.cuda = True

    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch, "empty", empty)
    monkeypatch.setattr(torch.Tensor, "pin_memory", pin_memory)
    monkeypatch.setattr(torch.Tensor, "to", to)
    monkeypatch.setattr(staging, "StagedCopy", OnCuda)
    del real_pin
    return dev


def _runtime(tmp_path):
    steers = {}
    for name, seed in (("a", 1), ("b", 2), ("c", 3)):
        steers[name] = str(tmp_path / f"{name}.safetensors")
        save_steer(steers[name], random_steer(HIDDEN, 4, name, seed=seed, scale=3.0))
    rt = get_runtime({"vllm_steer": {"steers": steers, "backend": "torch"}})
    rt.bank_state.load(HIDDEN, torch.device("cpu"), torch.float32)
    rt.ensure_slots(8, torch.device("cpu"))
    return rt


def _row(rt, name, s):
    row = np.zeros(rt.slots.num_columns, dtype=np.float32)
    j = rt.bank_state.names.index(name)
    row[j], row[rt.bank_state.capacity + j] = steer_coefficients(
        s, rt.bank_state.bank.steers[j].metadata.epsilon, None)
    return row


def _record_device_copies(monkeypatch, dev, rt):
    """Record every copy into the runtime's device buffers (slot table, step coefficients)."""
    real_copy = torch.Tensor.copy_

    def copy_(dst, src, non_blocking=False):
        bufs = [b for b in (rt.slots.device_rows, rt.planner.coef_buffer, rt.planner.row_index)
                if b is not None]
        if any(dst.untyped_storage().data_ptr() == b.untyped_storage().data_ptr() for b in bufs):
            dev.copies.append(("coefficients", dev.is_pinned(src)))
        return real_copy(dst, src, non_blocking=non_blocking)

    monkeypatch.setattr(torch.Tensor, "copy_", copy_)


def test_a_prompt_logprob_step_never_waits_behind_the_forward(tmp_path, fake_cuda, monkeypatch):
    """V2 prompt logprobs: three requests of 5, 3 and 6 prompt tokens computed in chunks of 4
    rows (as ``compute_prompt_logprobs_with_chunking`` does with 1024), a coefficient copy per
    chunk, all while the step's forward runs: no host wait on the device, every copy from
    pinned memory, each row steered with its own request's steer (against the reference), and
    the next step reuses the staging (no new pinned buffer)."""
    dev = fake_cuda
    rt = _runtime(tmp_path)
    _record_device_copies(monkeypatch, dev, rt)
    rows = {2: _row(rt, "a", 4), 0: _row(rt, "b", -3), 1: _row(rt, "c", 5)}
    lens = [5, 3, 6]  # the requests in batch order: slots 2, 0, 1
    batch = SimpleNamespace(num_reqs=3, idx_mapping_np=np.array([2, 0, 1]),
                            query_start_loc_np=np.array([0, 5, 8, 14]))
    h = torch.randn(14, HIDDEN, generator=torch.Generator().manual_seed(0))
    want = steer_reference(h, *rt.bank_state.bank.factors, torch.tensor(
        np.repeat(np.stack([rows[2], rows[0], rows[1]]), lens, axis=0)))

    def compute_prompt_logprobs(self, logits_fn, hidden_states, input_batch):  # vLLM's chunks
        return torch.cat([logits_fn(hidden_states[a:a + 4]) for a in range(0, 14, 4)])

    grown = []
    for _step in range(2):
        for slot, row in rows.items():  # the requests join (first step) or stay
            rt.set_slot(slot, row, prompt_logprobs=True)
        rt.slots.flush()
        worker = SimpleNamespace(in_progress_prompt_logprobs={f"r{i}": [] for i in range(3)})
        out = v2.prompt_logprobs(compute_prompt_logprobs, worker, rt.planner.steer_rows, h, batch)
        torch.testing.assert_close(out, want)
        grown.append(len(dev.pinned))  # pinned buffers allocated so far
        dev.finish_step()

    assert dev.waits_on_running == 0, (
        f"the host waited {dev.waits_on_running} time(s) for a copy the device had not run")
    copies = [c for c in dev.copies if c[0] == "coefficients"]
    assert len(copies) == 2 * (1 + 4)  # per step: the slot table, then one per chunk
    assert all(pinned for _, pinned in copies), copies
    assert grown[1] == grown[0], f"the second step allocated pinned staging: {grown}"


def test_batch_sharded_sampling_copies_its_row_slots_from_pinned_memory(tmp_path, fake_cuda,
                                                                         monkeypatch):
    """Batch-sharded sampling (V2, TP > 1): each token's table row goes to the device from
    pinned staging (a pageable copy syncs) into a persistent buffer, picked there by the
    sharder's sorted indices; a second step of the same batch copies nothing and allocates no
    pinned memory; a windowed step's coefficients come the same way."""
    dev = fake_cuda
    rt = _runtime(tmp_path)
    rt.set_slot(1, _row(rt, "a", 4))
    rt.slots.flush()
    batch = SimpleNamespace(num_reqs=3, idx_mapping_np=np.array([4, 1, 6]),
                            query_start_loc_np=np.array([0, 2, 3, 5]),
                            cu_num_logits_np=np.array([0, 1, 2, 3]))
    sorted_idx = torch.tensor([4, 1, 2])  # the requests' last tokens, owner-sorted
    runner = SimpleNamespace()

    class Sharder:
        def shard_sampler_inputs(self, b, grammar_output):
            return b, sorted_idx, grammar_output, None

    from vllm_steer.integrations.hooks import wrap_method
    from vllm_steer.integrations.worker.rows import NO_ROWS
    from vllm_steer.request import Window

    wrap_method(Sharder, "shard_sampler_inputs", v2.shard_sampler_inputs)  # as HOOKS does
    sharder = Sharder()
    real_copy = torch.Tensor.copy_

    def copy_(dst, src, non_blocking=False):  # every copy into a device buffer (not pinned)
        if not dev.is_pinned(dst):
            dev.copies.append(("copy_", dev.is_pinned(src)))
        return real_copy(dst, src, non_blocking=non_blocking)

    monkeypatch.setattr(torch.Tensor, "copy_", copy_)
    seen, pinned = [], []
    for _step in range(2):
        dev.copies.clear()
        rt.step.sampled = NO_ROWS
        with v2._sorted_rows(sharder, batch, rt, runner):
            sharder.shard_sampler_inputs(batch, None)
        source = rt.step.sampled  # the step's sampled rows: the sharder's order, on the device
        seen.append((source.mapping.tolist(), list(dev.copies)))
        pinned.append(len(dev.pinned))
        dev.finish_step()
    assert seen[0][0] == seen[1][0] == [6, 4, 1]  # slots of tokens 4, 1, 2
    assert seen[0][1] and all(p for _, p in seen[0][1]), f"(what, pinned): {seen[0][1]}"
    assert seen[1][1] == [] and pinned[1] == pinned[0], "an unchanged batch copied again"
    rt.set_slot(6, _row(rt, "b", 2), {1: Window(2.0, start=3)})
    rt.slots.flush()
    dev.copies.clear()
    with v2._sorted_rows(sharder, batch, rt, runner):  # no positions known: the base strength
        sharder.shard_sampler_inputs(batch, None)
    assert rt.step.sampled.table is not None and dev.copies
    assert all(p for _, p in dev.copies), f"(what, pinned): {dev.copies}"


def test_staged_rows_copy_only_what_changed_and_grow_without_losing_it(monkeypatch):
    """A persistent buffer the planner writes each step's rows into: the same rows again cost
    no copy, changed rows one; a step with more rows gets a buffer twice as large, written
    whole; a copy that fails leaves the rows unknown, so the next write copies them."""
    rows = staging.StagedRows(torch.float32, min_rows=4)
    copies = []
    real = staging.StagedCopy.copy_

    def counted(self, dst, src):
        copies.append(len(src))
        return real(self, dst, src)
    monkeypatch.setattr(staging.StagedCopy, "copy_", counted)
    a = np.arange(6, dtype=np.float32).reshape(3, 2)
    out = rows.write(a, torch.device("cpu"))
    assert torch.equal(out, torch.from_numpy(a)) and rows.buffer.shape == (4, 2)
    first = rows.buffer
    rows.write(a.copy(), torch.device("cpu"))
    assert copies == [3] and rows.buffer is first  # the same rows: no copy
    b = a + 1
    assert torch.equal(rows.write(b, torch.device("cpu")), torch.from_numpy(b))
    assert copies == [3, 3] and rows.buffer is first
    c = np.ones((5, 2), dtype=np.float32)  # more rows than the buffer: twice as many
    assert torch.equal(rows.write(c, torch.device("cpu")), torch.from_numpy(c))
    assert rows.buffer.shape == (8, 2) and copies == [3, 3, 5]

    def broken(self, dst, src):
        raise RuntimeError("copy failed")
    monkeypatch.setattr(staging.StagedCopy, "copy_", broken)
    with pytest.raises(RuntimeError):
        rows.write(a, torch.device("cpu"))
    monkeypatch.setattr(staging.StagedCopy, "copy_", counted)
    assert torch.equal(rows.write(c, torch.device("cpu")), torch.from_numpy(c))
    assert copies[-1] == 5  # written again, though it held these rows before the failure
    index = staging.StagedRows(torch.int64)  # a vector
    assert torch.equal(index.write(np.array([2, -1, 0]), torch.device("cpu")),
                       torch.tensor([2, -1, 0]))
    assert index.buffer.shape == (64,)
