"""The LM head's per-step mapping on the path its CUDA graphs replay (the graph stand-in, on the
CPU): a step whose rows changed writes each row's index into the head's table (and the
coefficients of its windowed rows), never the rows' dense coefficients; a flush copies only
the request slots that changed; the columns of decoder-layer (vector) steers are never in the
head's table. Every step's rows against plain torch: ``h + sum_k c_k W_k h`` from each steer
file's own factors."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers.capture import StandIn

from helpers.rows import sampled_rows
from helpers.steers import random_steer
from vllm_steer.config import SteerServerConfig
from vllm_steer.format import save_steer
from vllm_steer.integrations.worker.request_slots import RequestSlots
from vllm_steer.integrations.worker.rows import SlotRows
from vllm_steer.integrations.worker.runtime import SteerRuntime
from vllm_steer.integrations.worker.step_mapping import LayerVectors, TokenCoefs
from vllm_steer.kernels import graphs as G
from vllm_steer.kernels import staging
from vllm_steer.request import Window
from vllm_steer.vectors import make_vector_steer

HIDDEN = 32
CPU = torch.device("cpu")


def _runtime(tmp_path, slots: int = 8, capacity: int = 4) -> SteerRuntime:
    """A worker runtime with steers "a" (rank 4, bank slot 0) and "b" (rank 8, bank slot 1),
    its head's graphs through the stand-in, captured at start-up."""
    paths = {}
    for name, seed, rank in (("a", 1, 4), ("b", 2, 8)):
        paths[name] = str(tmp_path / f"{name}.safetensors")
        save_steer(paths[name], random_steer(HIDDEN, rank, name, seed=seed))
    rt = SteerRuntime(SteerServerConfig.from_additional_config(
        {"vllm_steer": {"steers": paths, "max_steers": capacity, "max_steer_rank": 8}}))
    rt.bank_state.graph_backend = StandIn()
    rt.ensure_slots(slots, CPU)
    rt.bank_state.load(HIDDEN, CPU, torch.float32)
    rt.model_loaded()
    assert rt.bank_state.bank.graphs.captures > 0
    return rt


def _with_vector_op(rt: SteerRuntime) -> LayerVectors:
    """The decoder blocks' op, as ``install_layers`` gives a model (one block here)."""
    layers = LayerVectors([0], 1, rt.config.capacity, HIDDEN, max_tokens=16, device=CPU)
    rt.layers, rt.step.tokens = layers, TokenCoefs(layers, rt.slots)
    rt.bank_state.bank.layers = layers
    rt.slots.use_layers(layers)
    return layers


def _eps(rt, bank_slot: int) -> float:
    return rt.bank_state.bank.steers[bank_slot].metadata.epsilon


def _row(rt, **strengths) -> np.ndarray:
    """A request's row: ``{bank slot as "s0", "s1", ...: strength}`` times each epsilon."""
    row = np.zeros(rt.slots.num_columns, np.float32)
    for key, s in strengths.items():
        j = int(key[1:])
        row[j] = s * _eps(rt, j)
    return row


def _want(rt, h: torch.Tensor, coefs: np.ndarray) -> torch.Tensor:
    """Plain torch, from each LM-Steer file's own factors (a vector steer adds nothing here)."""
    from vllm_steer.kinds import applied_in_layers

    bank = rt.bank_state.bank
    out = h.clone()
    for i in range(h.shape[0]):
        for k in range(bank.capacity):
            steer = bank.steers[k]
            if steer is not None and not applied_in_layers(steer) and coefs[i, k]:
                out[i] = out[i] + float(coefs[i, k]) * (steer.matrix() @ h[i])
    return out


def _check(rt, slots, want_coefs, positions=None, gen=None):
    """One step of rows ``slots`` through the head; its rows against plain torch, unsteered
    rows bit for bit."""
    slots = np.asarray(slots, dtype=np.int64)
    n = len(slots)
    h = torch.randn(n, HIDDEN, generator=gen)
    src = SlotRows(slots=slots, positions=None if positions is None
                   else np.asarray(positions, dtype=np.int64))
    with sampled_rows(rt.planner, src):
        out = rt.planner.steer_rows(h).clone()
    coefs = np.stack(want_coefs)
    torch.testing.assert_close(out, _want(rt, h, coefs), rtol=1e-5, atol=1e-5)
    for i in range(n):
        if not coefs[i].any():
            assert torch.equal(out[i], h[i])
    return out


def test_steps_whose_rows_change_replay_the_graphs_with_each_rows_own_coefficients(tmp_path):
    """Requests join and leave, a windowed request's coefficients move with its generated
    tokens, a request on a vector steer (applied in the decoder blocks, never by the head),
    shorter steps after longer ones: every step replays a graph (none captured), with the
    rows plain torch gives, the padding rows of its bucket at -1."""
    rt = _runtime(tmp_path)
    layers = _with_vector_op(rt)
    rt.put_steer(2, 9, "v", make_vector_steer({0: torch.ones(HIDDEN)}, "v"))
    assert layers.slot_is_vector.tolist() == [0, 0, 1, 0]
    graphs = rt.bank_state.bank.graphs
    captures = graphs.captures
    gen = torch.Generator().manual_seed(0)
    zero = np.zeros(rt.slots.num_columns, np.float32)
    a4, b_3 = _row(rt, s0=4), _row(rt, s1=-3)
    rt.set_slot(0, a4)
    rt.set_slot(2, b_3)
    rt.slots.flush()
    _check(rt, [0, 1, 2], [a4, zero, b_3], gen=gen)
    # a windowed request joins: b at strength 3 from its third generated token on
    rt.set_slot(5, _row(rt, s1=3), {1: Window(3.0, start=2, base=0.0)})
    rt.slots.flush()
    for t in range(4):
        b_t = _row(rt, s1=3) if t >= 2 else zero
        _check(rt, [0, 1, 2, 5], [a4, zero, b_3, b_t], positions=[t] * 4, gen=gen)
    # a request leaves (3 rows replay the 4-row bucket: its last row is padding)
    _check(rt, [5, 0, 2], [_row(rt, s1=3), a4, b_3], positions=[7, 7, 7], gen=gen)
    index = rt.planner.row_index
    assert index[3:].eq(-1).all()
    # a request on the vector steer and on a: the head applies a alone
    v_and_a = _row(rt, s0=2)
    v_and_a[2] = 1.5  # the vector steer's strength: the decoder blocks' column
    rt.set_slot(3, v_and_a)
    rt.slots.flush()
    assert rt.slots.host[3, 2] == 1.5 and rt.slots.table[3, 2] == 0  # never in the head's table
    _check(rt, [3, 0, 2, 5], [_row(rt, s0=2), a4, b_3, _row(rt, s1=3)], positions=[9] * 4,
           gen=gen)
    # a request replaced in its slot: the same rows, its new coefficients
    rt.set_slot(0, _row(rt, s1=5))
    rt.slots.flush()
    _check(rt, [3, 0, 2, 5], [_row(rt, s0=2), _row(rt, s1=5), b_3, _row(rt, s1=3)],
           positions=[10] * 4, gen=gen)
    _check(rt, [2], [b_3], gen=gen)  # one row: the rest padding
    assert index[1:].eq(-1).all()
    steps = 1 + 4 + 1 + 1 + 1 + 1
    assert graphs.captures == captures and graphs.replays == steps


def test_a_changed_rows_step_writes_its_row_index_and_no_dense_coefficients(tmp_path,
                                                                           monkeypatch):
    """What a step costs on the graphs' path: a request replaced in its slot copies that
    slot's row at the flush and nothing at the head (the rows are the same); a request joining
    or leaving copies the row index (8 bytes a row, with -1 for a row a longer step left) and
    nothing else; no dense coefficients are gathered on the host."""
    rt = _runtime(tmp_path, slots=64, capacity=16)
    cols = rt.slots.num_columns
    copies = []
    real_copy = staging.StagedCopy.copy_

    def copy_(self, dst, src):
        storage = dst.untyped_storage().data_ptr()
        what = "table" if storage == rt.slots.device_rows.untyped_storage().data_ptr() else \
            "index" if storage == rt.planner.row_index.untyped_storage().data_ptr() else "other"
        copies.append((what, src.nbytes))
        return real_copy(self, dst, src)

    monkeypatch.setattr(staging.StagedCopy, "copy_", copy_)
    gathered = []
    real_rows = rt.slots.row_coefs
    monkeypatch.setattr(rt.slots, "row_coefs", lambda *a: gathered.append(1) or real_rows(*a))
    rng = np.random.default_rng(0)
    rows = {s: _row(rt, s0=float(rng.uniform(-5, 5)), s1=float(rng.uniform(-5, 5)))
            for s in range(48)}
    for s, row in rows.items():
        rt.set_slot(s, row)
    rt.slots.flush()
    batch = list(rng.permutation(48))
    gen = torch.Generator().manual_seed(1)
    _check(rt, batch, [rows[s] for s in batch], gen=gen)
    copies.clear()

    rows[5] = _row(rt, s1=2)  # a request replaced in its slot
    rt.set_slot(5, rows[5])
    rt.slots.flush()
    assert copies == [("table", 4 * cols)]  # its row, not the table
    _check(rt, batch, [rows[s] for s in batch], gen=gen)
    assert copies == [("table", 4 * cols)]  # the same rows: the index as it is

    copies.clear()
    rows[50] = _row(rt, s0=3)  # a request joins
    rt.set_slot(50, rows[50])
    rt.slots.flush()
    batch.insert(7, 50)
    _check(rt, batch, [rows[s] for s in batch], gen=gen)
    assert copies == [("table", 4 * cols), ("index", 8 * 49)]

    copies.clear()
    batch.remove(30)  # a request leaves: its slot zeroed, one row fewer
    rt.set_slot(30, None)
    rows[3], rows[40] = _row(rt, s0=1), _row(rt, s1=-1)  # two scattered slots change
    rt.set_slot(3, rows[3])
    rt.set_slot(40, rows[40])
    rt.slots.flush()
    assert copies == [("other", 3 * (4 * cols + 8))]  # three rows and their indices, once
    _check(rt, batch, [rows[s] for s in batch], gen=gen)
    assert copies[1:] == [("index", 8 * 49)]  # 48 rows and the row the longer step left
    assert rt.planner.row_index[48] == -1
    assert gathered == [] and rt.planner.coef_buffer is None  # no dense coefficients
    assert torch.equal(rt.slots.table, torch.from_numpy(rt.slots.host))


def test_windowed_rows_past_the_tables_spare_rows_run_eagerly_with_the_same_rows(tmp_path):
    """A step with more windowed rows than the head's table has spare rows for launches the
    eager op (its own dense coefficients) with the rows plain torch gives; the next step that
    fits replays again."""
    rt = _runtime(tmp_path)
    graphs = rt.bank_state.bank.graphs
    win = {0: Window(4.0, start=1, base=1.0)}
    for s in (1, 2, 3):
        rt.set_slot(s, _row(rt, s0=4), win)
    rt.slots.flush()
    rt.slots.extra_rows = 2
    gen = torch.Generator().manual_seed(2)
    replays = graphs.replays
    at = {0: _row(rt, s0=1), 3: _row(rt, s0=4)}
    _check(rt, [1, 2, 3], [at[0], at[3], at[3]], positions=[0, 3, 3], gen=gen)
    assert graphs.replays == replays and rt.planner.coef_buffer is not None  # eager
    _check(rt, [1, 2], [at[3], at[0]], positions=[3, 0], gen=gen)
    assert graphs.replays == replays + 1


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
    """One slot: its row; neighbours: their rows in one copy; two runs of neighbours (a
    move): a copy each; more scattered slots: their rows and indices in one copy; more than
    half the table: the whole table. After each flush the device table equals the host
    table."""
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
    assert put(3, 12, 13) == [row_bytes, 2 * row_bytes]
    assert put(1, 9, 14) == [3 * (row_bytes + 8)]
    assert put(*range(9)) == [16 * row_bytes]  # most of the table: whole
    slots.move(2, 11, swap=True)
    slots.flush()
    assert sizes == [row_bytes, row_bytes]  # two runs: a copy each
    assert torch.equal(slots.table, torch.from_numpy(slots.host))
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_graphs_read_each_rows_table_row_through_the_index_in_place(dtype):
    """``SteerGraphs.run(hidden, table, index)``: row i takes ``table[index[i]]``, -1 a
    padding row (no steer); a replay reads the index and the table as they are then (the
    caller rewrites them in place), and another index buffer is captured again."""
    from vllm_steer.bank import SlotBank

    bank = SlotBank(3, HIDDEN, dtype=torch.float32, reserve_rank=8)
    bank.put(0, 1, "a", random_steer(HIDDEN, 4, "a", seed=1))
    bank.put(1, 2, "b", random_steer(HIDDEN, 8, "b", seed=2))
    graphs = G.head_graphs(bank, graph_backend=StandIn())
    gen = torch.Generator().manual_seed(4)
    table = torch.zeros(10, bank.num_columns)
    index = torch.full((16,), -1, dtype=torch.int64)
    for rows in ([3, 9, 0], [9, 9, 2, 7, 1], [4]):
        table[:, :2] = torch.randn(10, 2, generator=gen)
        table[0] = 0.0  # an unsteered slot
        index[:len(rows)] = torch.tensor(rows)
        index[len(rows):] = -1
        h = torch.randn(len(rows), HIDDEN, generator=gen).to(dtype)
        out = graphs.run(h, table, index)
        coefs = table[rows].numpy()
        want = torch.stack([h[i].float() + sum(
            float(coefs[i, k]) * (bank.steers[k].matrix() @ h[i].float()) for k in (0, 1))
            for i in range(len(rows))])
        tol = 1e-5 if dtype == torch.float32 else 2 ** -6
        torch.testing.assert_close(out.float(), want, rtol=tol, atol=tol * want.abs().max())
        for i, r in enumerate(rows):
            if r == 0:
                assert torch.equal(out[i], h[i])
    assert graphs.captures == 3  # buckets 4, 8, 1
    graphs.run(torch.randn(2, HIDDEN), table, index.clone())  # another index: anew
    assert graphs.backend.resets == 1 and graphs.captures == 4


def test_batch_invariant_rows_do_not_depend_on_whether_the_graphs_took_their_step(
        tmp_path, monkeypatch):
    """``VLLM_BATCH_INVARIANT=1``: a step with more rows than the graphs' largest bucket runs
    the graphs' op launched eagerly, so a request's steered row is the same bits in a step of
    2 rows (replayed) and of 10 (launched). The backend's eager op (the fused Triton op in
    this mode) sums hidden in one slice, the graphs' grouped op in two at hidden 2048."""
    from vllm_steer import ops
    from vllm_steer.kernels import capture_safe

    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    # the graphs' op as on CUDA: the grouped Triton op (in the interpreter)
    monkeypatch.setattr(capture_safe, "grouped_on", lambda device: True)
    hidden = 2048
    path = str(tmp_path / "a.safetensors")
    save_steer(path, random_steer(hidden, 4, "a", seed=1))
    rt = SteerRuntime(SteerServerConfig.from_additional_config(
        {"vllm_steer": {"steers": {"a": path}, "max_steers": 2, "max_steer_rank": 4}}))
    rt.bank_state.graph_backend = StandIn()
    rt.ensure_slots(4, CPU)
    rt.bank_state.load(hidden, CPU, torch.float32)
    # the eager op ``auto`` picks on CUDA in this mode (the torch op on the CPU)
    assert ops.resolve_backend("auto", torch.device("cuda"), hidden, 4) == "triton"
    bs = rt.bank_state
    bs.backend, bs.fn, bs.prepare = "triton", ops.backend_fn("triton"), ops.backend_prepare(
        "triton")
    rt.model_loaded()
    graphs = rt.bank_state.bank.graphs
    monkeypatch.setattr(graphs, "max_rows", 8)  # (512 when serving: a smaller step here)
    row = np.zeros(rt.slots.num_columns, np.float32)
    row[0] = 4 * rt.bank_state.bank.steers[0].metadata.epsilon
    rt.set_slot(0, row)
    rt.slots.flush()

    def step(slots, h):
        with sampled_rows(rt.planner, SlotRows(slots=np.asarray(slots, dtype=np.int64))):
            return rt.planner.steer_rows(h).clone()

    h = torch.randn(10, hidden, generator=torch.Generator().manual_seed(3))
    small = step([0, 1], h[:2])
    replays = graphs.replays
    big = step([0, 1] + [1] * 8, h)
    assert graphs.replays == replays  # launched, not replayed
    assert torch.equal(big[:2], small) and torch.equal(big[1:], h[1:])
    want = h[0] + float(row[0]) * (rt.bank_state.bank.steers[0].matrix() @ h[0])
    torch.testing.assert_close(big[0], want, rtol=1e-5, atol=1e-5)
