"""The request slots' device table: a flush copies only the request slots that changed, and
the columns of decoder-layer (vector) steers are never in it (the LM head's graphs and the
drafters read it in place; the decoder blocks read the host table)."""

from __future__ import annotations

import numpy as np
import torch

from vllm_steer.integrations.worker.request_slots import RequestSlots
from vllm_steer.integrations.worker.step_mapping import LayerVectors
from vllm_steer.kernels import staging
from vllm_steer.vectors import make_vector_steer

HIDDEN = 32
CPU = torch.device("cpu")


def _recorded_copies(monkeypatch) -> list[int]:
    sizes = []
    real_copy = staging.StagedCopy.copy_

    def copy_(self, dst, src):
        sizes.append(src.nbytes)
        return real_copy(self, dst, src)

    monkeypatch.setattr(staging.StagedCopy, "copy_", copy_)
    return sizes


def test_a_flush_copies_the_slots_that_changed_and_the_device_table_is_the_host_one(
        monkeypatch):
    """One slot: its row; neighbours: their rows in one copy; scattered slots: their rows and
    indices in one copy; more than half the table, or a move: as many rows as changed, up to
    the whole table. After each flush the device table equals the host table."""
    slots = RequestSlots(8)  # 16 columns
    slots.ensure(16, CPU)
    row_bytes = 4 * slots.num_columns
    sizes = _recorded_copies(monkeypatch)
    rng = np.random.default_rng(3)

    def put(*which):
        for s in which:
            slots.set(s, rng.standard_normal(slots.num_columns).astype(np.float32), None, None)
        slots.flush()
        assert torch.equal(slots.table, torch.from_numpy(slots.host))
        got = list(sizes)
        sizes.clear()
        return got

    assert put(4) == [row_bytes]
    assert put(6, 7, 8) == [3 * row_bytes]
    assert put(1, 9, 14) == [3 * (row_bytes + 8)]
    assert put(*range(9)) == [16 * row_bytes]  # most of the table: whole
    slots.move(2, 11, swap=True)
    slots.flush()
    assert sizes == [2 * (row_bytes + 8)] and torch.equal(slots.table,
                                                          torch.from_numpy(slots.host))
    sizes.clear()
    version = slots.version
    slots.flush()  # nothing changed: nothing copied, the version kept
    assert sizes == [] and slots.version == version


def test_the_head_table_leaves_the_vector_slots_columns_out_and_follows_their_changes(
        monkeypatch):
    """A vector steer's column (applied in the decoder blocks, from the host table) is zero in
    the device table that the head's graphs and the drafters read; when the vector bank's
    slots change (a load or an unload), the whole table is copied again with the new mask."""
    slots = RequestSlots(4)  # 8 columns
    slots.ensure(6, CPU)
    layers = LayerVectors([0], 1, 4, HIDDEN, max_tokens=4, device=CPU)
    slots.use_layers(layers)
    layers.put(1, make_vector_steer({0: torch.ones(HIDDEN)}, "v"))
    row = np.arange(1, 9, dtype=np.float32)
    slots.set(2, row, None, None)
    slots.flush()
    want = row.copy()
    want[1] = 0.0
    assert torch.equal(slots.table[2], torch.from_numpy(want))
    assert slots.host[2, 1] == 2.0  # the decoder blocks' column, kept on the host
    sizes = _recorded_copies(monkeypatch)
    layers.drop(1)  # the vector steer unloaded: the next flush copies the whole table
    slots.flush()
    assert sizes == [6 * 4 * slots.num_columns]
    assert torch.equal(slots.table[2], torch.from_numpy(row))
    layers.put(3, make_vector_steer({0: torch.ones(HIDDEN)}, "w"))
    slots.use_layers(layers)  # what the runtime calls after a load: copied now
    want = row.copy()
    want[3] = 0.0
    assert torch.equal(slots.table[2], torch.from_numpy(want))
