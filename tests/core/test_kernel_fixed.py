"""The capture-safe steer op (``ops.steer_fixed``, ``vllm_steer/kernels/fixed.py``) and the
LM head's CUDA graphs over it (``vllm_steer/kernels/graphs.py``), pinned on the CPU.

A CUDA graph replays the kernels it recorded, on the buffers it recorded, with no Python. So
the op is right in a graph when it computes the formula, launches the same ops with the same
shapes whatever the values, and reads nothing back to the host. The graph cache is right when
each row bucket is captured once, replayed after, and captured again when what it recorded
(the table's storage, the bank's layout, the fixed copy) changes. The graph backend is
replaced here by a stand-in that records its captures and, at each replay, re-runs the
captured function and checks that it launches exactly the ops it recorded."""

from __future__ import annotations

import logging
import os

import pytest
import torch
from helpers.capture import Record, StandIn

from helpers.rows import sampled_rows
from helpers.steers import random_steer
from vllm_steer import ops
from vllm_steer.bank import SlotBank
from vllm_steer.kernels import graphs as G
from vllm_steer.reference import steer_reference

DEVICE = torch.device(os.environ.get("VLLM_STEER_TEST_DEVICE", "cpu"))
if DEVICE.type == "cuda" and not torch.cuda.is_available():
    pytest.skip(f"VLLM_STEER_TEST_DEVICE={DEVICE} but CUDA is not available",
                allow_module_level=True)

# dtype -> (rtol, atol as a fraction of the largest |delta|). fp32: summation order. bf16: the
# GEMMs run in bf16 with fp32 accumulation, and their two results (the down-projection, then
# the scaled down-projection fed to the up-projection) are rounded to bf16 (2^-9 relative
# each), then the output itself (one bf16 ulp, 2^-8 relative).
TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2 ** -7, 2 ** -6)}


def fixed_layout(d, ranks, rank, dtype, seed=0):
    """Random steer factors of ``ranks`` (0: an empty column), packed two ways: concatenated
    (the reference's bank, ``rank_offsets``) and in the fixed layout (column k at
    ``[k * rank, ...)``), built here by hand."""
    g = torch.Generator().manual_seed(seed)
    f1 = [torch.randn(d, r, generator=g) / d ** 0.5 for r in ranks]
    f2 = [torch.randn(d, r, generator=g) / max(r, 1) ** 0.5 for r in ranks]
    offs = [0]
    for r in ranks:
        offs.append(offs[-1] + r)
    p1, p2 = torch.cat(f1, 1).to(dtype), torch.cat(f2, 1).to(dtype)
    q1 = torch.zeros(d, len(ranks) * rank, dtype=dtype)
    q2 = torch.zeros_like(q1)
    for k, (a, b) in enumerate(zip(f1, f2, strict=True)):
        q1[:, k * rank:k * rank + a.shape[1]] = a
        q2[:, k * rank:k * rank + b.shape[1]] = b
    return [t.to(DEVICE) for t in (p1, p2, q1, q2)], offs


def want(h, p1, p2, offs, table, index):
    rows = torch.stack([table[i] if i >= 0 else torch.zeros(table.shape[1]) for i in index])
    return steer_reference(h.cpu(), p1.cpu(), p2.cpu(), offs, rows.cpu())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d,ranks,rows", [(32, [4, 8, 0, 3], 5), (37, [5, 1, 7], 11),
                                          (64, [16, 0], 1)])
def test_the_op_computes_the_reference_and_leaves_padding_and_unsteered_rows_alone(
        dtype, d, ranks, rows):
    (p1, p2, q1, q2), offs = fixed_layout(d, ranks, max(ranks), dtype, seed=d)
    g = torch.Generator().manual_seed(rows)
    table = torch.randn(rows + 3, len(ranks), generator=g) * 2
    table[1] = 0.0  # an unsteered request
    index = torch.randint(0, rows + 3, (rows,), generator=g)
    if rows > 2:
        index[-1], index[1] = -1, 1  # a padding row, an unsteered row
    h = (torch.randn(rows, d, generator=g) * 3).to(dtype)
    out = ops.steer_fixed(h.to(DEVICE), q1, q2, max(ranks), table.to(DEVICE), index.to(DEVICE))
    ref = want(h, p1, p2, offs, table, index.tolist())
    rtol, atol = TOL[dtype]
    scale = (ref.float() - h.float()).abs().max().item()
    torch.testing.assert_close(out.cpu().float(), ref.float(), rtol=rtol, atol=atol * scale)
    assert out.dtype == dtype and out.shape == h.shape
    for i, j in enumerate(index.tolist()):
        if j < 0 or not table[j].any():
            assert torch.equal(out[i].cpu(), h[i]), i  # bit for bit
        else:
            assert not torch.equal(out[i].cpu(), h[i]), i


def test_the_op_launches_the_same_ops_and_shapes_whatever_the_values():
    (_, _, q1, q2), _ = fixed_layout(32, [4, 8, 0], 8, torch.float32)
    h = torch.randn(6, 32, device=DEVICE)
    recorded = []
    for table, index in ((torch.zeros(8, 3), [0, 1, 2, -1, -1, -1]),  # nothing steered
                         (torch.randn(8, 3), [7, 1, 1, 2, 0, -1]),
                         (torch.tensor([[0.0, 5.0, 0.0]] * 8), [-1] * 6)):
        with Record() as rec:
            ops.steer_fixed(h, q1, q2, 8, table.to(DEVICE), torch.tensor(index, device=DEVICE))
        recorded.append(rec.ops)
    assert recorded[0] == recorded[1] == recorded[2], recorded
    assert len(recorded[0]) > 5  # the op ran (an empty record would prove nothing)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_read_in_place_and_written_into_out_give_the_gathered_ops_result(dtype):
    (p1, p2, q1, q2), offs = fixed_layout(40, [6, 0, 3], 6, dtype, seed=3)
    g = torch.Generator().manual_seed(3)
    table = torch.randn(9, 3, generator=g) * 2
    table[2] = 0.0  # an unsteered request
    h = (torch.randn(7, 40, generator=g) * 3).to(dtype)
    hd, td = h.to(DEVICE), table.to(DEVICE)
    gathered = ops.steer_fixed(hd, q1, q2, 6, td, torch.arange(7, device=DEVICE))
    out = torch.full_like(hd, float("nan"))
    got = ops.steer_fixed(hd, q1, q2, 6, td, None, out=out)
    assert got.data_ptr() == out.data_ptr()
    assert torch.equal(out, gathered)  # the same bits
    assert torch.equal(out[2].cpu(), h[2])  # the unsteered row comes back as it was
    ref = want(h, p1, p2, offs, table, list(range(7)))
    rtol, atol = TOL[dtype]
    scale = (ref.float() - h.float()).abs().max().item()
    torch.testing.assert_close(out.cpu().float(), ref.float(), rtol=rtol, atol=atol * scale)


def test_the_heads_graph_reads_the_table_in_place_and_writes_its_output_directly():
    """In a graph each kernel costs the GPU microseconds however little it does: the head's
    graph launches the two GEMMs, the scaling, the add and the unsteered rows' select, and no
    gather of the coefficient rows, fp32 copy or copy of the result. A table with fewer rows
    than a bucket is gathered (the bucket's last rows are padding), with the same result."""
    (p1, p2, q1, q2), offs = fixed_layout(24, [4, 6], 6, torch.bfloat16)
    g = torch.Generator().manual_seed(1)
    for table_rows, n, gathers in ((16, 5, False), (6, 5, True)):
        back = StandIn()
        graphs = G.SteerGraphs(q1, q2, 6, back, max_rows=16)
        table = (torch.randn(table_rows, 2, generator=g) * 3).to(DEVICE)
        h = (torch.randn(n, 24, generator=g) * 3).to(torch.bfloat16).to(DEVICE)
        out = graphs.run(h, table)
        ref = want(h, p1, p2, offs, table.cpu(), list(range(n)))
        scale = (ref.float() - h.cpu().float()).abs().max().item()
        torch.testing.assert_close(out.cpu().float(), ref.float(), rtol=TOL[torch.bfloat16][0],
                                   atol=TOL[torch.bfloat16][1] * scale)
        (_, recorded), = back.captured
        names = [name for name, _ in recorded]
        assert names.count("mm") == 2, names
        assert not {"clone", "copy_", "_to_copy", "repeat_interleave"} & set(names), names
        assert ("index_select" in names) == gathers, names


def test_graphs_capture_each_row_bucket_once_and_follow_the_tables_values():
    (p1, p2, q1, q2), offs = fixed_layout(24, [4, 6], 6, torch.float32)
    back = StandIn()
    graphs = G.SteerGraphs(q1, q2, 6, back, max_rows=16)
    table = torch.zeros(16, 2, device=DEVICE)
    g = torch.Generator().manual_seed(0)
    for _step, n in enumerate([3, 4, 1, 3, 9, 16, 2, 5]):
        table[:n] = torch.randn(n, 2, generator=g).to(DEVICE)  # the step's coefficients
        h = torch.randn(n, 24, generator=g).to(DEVICE)
        out = graphs.run(h, table)
        ref = want(h, p1, p2, offs, table.cpu(), list(range(n)))
        torch.testing.assert_close(out.cpu(), ref, rtol=1e-5, atol=1e-5)
    assert graphs.buckets == [1, 2, 4, 8, 16] and graphs.captures == 5
    assert back.replayed == graphs.replays == 8
    assert graphs.run(torch.randn(17, 24, device=DEVICE), torch.zeros(17, 2)) is None  # eager
    graphs.failed = "a reason"  # a failed capture: the eager op from now on
    assert graphs.run(torch.randn(2, 24, device=DEVICE), table) is None


def test_capture_records_every_missing_bucket_up_to_the_rows_asked_and_no_more():
    (p1, p2, q1, q2), offs = fixed_layout(24, [4, 6], 6, torch.float32)
    graphs = G.SteerGraphs(q1, q2, 6, StandIn(), max_rows=16)
    table = torch.zeros(16, 2, device=DEVICE)
    assert graphs.capture(5, 24, torch.float32, table) == 4  # 1, 2, 4, 8
    assert graphs.buckets == [1, 2, 4, 8]
    assert graphs.capture(8, 24, torch.float32, table) == 0  # captured already
    assert graphs.capture(100, 24, torch.float32, table) == 1  # up to max_rows: 16
    assert graphs.buckets == [1, 2, 4, 8, 16] and graphs.captures == 5
    table[:9] = torch.randn(9, 2).to(DEVICE)
    h = torch.randn(9, 24).to(DEVICE)
    out = graphs.run(h, table)  # replayed, not captured, with the table's values now
    assert graphs.captures == 5 and graphs.replays == 1
    torch.testing.assert_close(out.cpu(), want(h, p1, p2, offs, table.cpu(), list(range(9))),
                               rtol=1e-5, atol=1e-5)
    assert graphs.capture(4, 24, torch.bfloat16, table) == 3  # other activations: anew
    assert graphs.buckets == [1, 2, 4] and graphs.backend.resets == 1
    graphs.failed = "a reason"
    graphs.invalidate()
    assert graphs.capture(4, 24, torch.float32, table) == 0 and graphs.buckets == []


def test_a_new_table_storage_or_dtype_is_captured_again():
    (_, _, q1, q2), _ = fixed_layout(16, [4], 4, torch.float32)
    graphs = G.SteerGraphs(q1, q2, 4, StandIn())
    table = torch.ones(4, 1, device=DEVICE)
    h = torch.randn(3, 16, device=DEVICE)
    graphs.run(h, table), graphs.run(h, table)
    assert graphs.captures == 1 and graphs.backend.resets == 0
    bigger = torch.ones(8, 1, device=DEVICE)  # the caller's buffer grew: new storage
    graphs.run(h, bigger)
    # the old graphs are dropped and the backend told so (a CUDA pool is not reused)
    assert graphs.captures == 2 and graphs.backend.resets == 1
    graphs.run(h.to(torch.bfloat16), bigger)
    assert graphs.captures == 3 and graphs.buckets == [4]


@pytest.fixture
def log_lines():
    """The messages the package logs during the test (INFO and above)."""
    from vllm_steer.logs import get_logger

    lines, logger = [], get_logger()
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: lines.append(record.getMessage())
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield lines
    logger.removeHandler(handler)
    logger.setLevel(level)


def _bank(rank=8, **kw):
    bank = SlotBank(3, 32, device=DEVICE, dtype=torch.float32, reserve_rank=rank, **kw)
    bank.put(0, 1, "a", random_steer(32, 4, "a", seed=1))
    bank.put(1, 2, "b", random_steer(32, 8, "b", seed=2))
    return bank


def _coefs(bank, rows, gen):
    table = torch.zeros(rows, bank.num_columns, device=DEVICE)
    for k in range(bank.capacity):
        if bank.steers[k] is not None:
            table[:, k] = torch.randn(rows, generator=gen).to(DEVICE)
    return table


def test_the_heads_graphs_read_the_bank_in_place_and_loads_keep_every_graph(log_lines):
    bank = _bank()
    storage = (bank.p1.data_ptr(), bank.p2.data_ptr())
    graphs = G.head_graphs(bank, graph_backend=StandIn())
    assert graphs is G.head_graphs(bank) and bank.p1 is graphs.p1  # the bank itself, no copy
    assert any("replays from CUDA graphs" in line and "over the bank in place (6 columns x "
               "rank 8 x hidden 32)" in line for line in log_lines), log_lines
    assert bank.p1.shape == (32, 2 * 3 * 8) and bank.rank_offsets == [8 * k for k in range(7)]
    gen = torch.Generator().manual_seed(0)
    table = torch.zeros(8, bank.num_columns, device=DEVICE)  # the caller's persistent buffer

    def step(n=3):
        table[:n] = _coefs(bank, n, gen)
        h = torch.randn(n, 32, generator=gen).to(DEVICE)
        out = graphs.run(h, table)
        ref = torch.stack([h[i].cpu() + sum(
            table[i, k].item() * (bank.steers[k].matrix() @ h[i].cpu())
            for k in range(bank.capacity) if bank.steers[k] is not None)
            for i in range(n)])  # c + sum eps W c, from each steer file's own factors
        torch.testing.assert_close(out.cpu(), ref, rtol=1e-5, atol=1e-5)

    step()
    assert graphs.captures == 1
    bank.put(2, 3, "c", random_steer(32, 8, "c", seed=3))  # a new steer, written in place
    bank.drop(0)
    bank.put(0, 4, "d", random_steer(32, 5, "d", seed=4))  # another rank, the same columns
    step()  # no capture: the replay reads the bank rewritten in place, and "c", "d" count
    step()
    assert graphs.captures == 1 and graphs.replays == 3
    assert (bank.p1.data_ptr(), bank.p2.data_ptr()) == storage


def test_a_steer_wider_than_an_unbounded_banks_rank_grows_it_and_the_graphs_record_again():
    bank = _bank()  # rank 8 reserved, no --max-steer-rank: the bank may grow (logged)
    graphs = G.head_graphs(bank, graph_backend=StandIn())
    table = torch.zeros(2, 6, device=DEVICE)
    table[:, 2] = 0.5
    h = torch.randn(2, 32, device=DEVICE)
    graphs.run(h, table)
    wide = random_steer(32, 12, "wide", seed=6)
    bank.put(2, 3, "wide", wide)
    assert bank.rank == 12 and graphs.p1 is bank.p1 and graphs.buckets == []
    out = graphs.run(h, table)
    assert graphs.captures == 2
    want_rows = h.cpu() + 0.5 * h.cpu() @ wide.matrix().T
    torch.testing.assert_close(out.cpu(), want_rows, rtol=1e-5, atol=1e-5)


def test_the_head_keeps_the_eager_op_where_graphs_do_not_apply(monkeypatch, log_lines):
    if DEVICE.type != "cuda":
        assert G.head_graphs(_bank()) is None  # no CUDA (the stand-in lifts this rule)
    assert G.head_graphs(_bank(), "torch", graph_backend=StandIn()) is None  # a named backend
    monkeypatch.setenv("VLLM_STEER_BACKEND", "triton")
    assert G.head_graphs(_bank(), graph_backend=StandIn()) is None
    monkeypatch.delenv("VLLM_STEER_BACKEND")
    monkeypatch.setenv("VLLM_STEER_CUDA_GRAPHS", "0")
    assert G.head_graphs(_bank(), graph_backend=StandIn()) is None
    monkeypatch.setenv("VLLM_STEER_CUDA_GRAPHS", "yes")
    with pytest.raises(ValueError, match=r"VLLM_STEER_CUDA_GRAPHS='yes' is not an integer: "
                                         r"set it to 1 .* or 0"):
        G.head_graphs(_bank(), graph_backend=StandIn())
    monkeypatch.delenv("VLLM_STEER_CUDA_GRAPHS")
    bank = SlotBank(3, 32, device=DEVICE, dtype=torch.float32)  # no reserved rank
    assert G.head_graphs(bank, graph_backend=StandIn()) is None and bank.graphs is None
    assert any("the bank reserved no rank (set --max-steer-rank" in line
               for line in log_lines), log_lines
    # a bank of any size replays from graphs: no copy, so no size limit
    big = SlotBank(3, 32, device=DEVICE, dtype=torch.float32, reserve_rank=512)
    assert G.head_graphs(big, graph_backend=StandIn()) is not None


def test_the_serving_head_replays_the_graph_with_the_eager_ops_result_windows_included(
        tmp_path, log_lines):
    """The worker's head (``StepPlanner.steer_rows``) with graphs (the stand-in) gives the
    reference's rows, including a windowed request whose coefficients move with its
    generated tokens, and replays without capturing once its buckets are known."""
    import numpy as np

    from vllm_steer.format import save_steer
    from vllm_steer.integrations.worker.rows import SlotRows
    from vllm_steer.integrations.worker.runtime import SteerRuntime, get_runtime
    from vllm_steer.request import Window

    paths = {}
    for name, seed, rank in (("a", 1, 4), ("b", 2, 8)):
        paths[name] = str(tmp_path / f"{name}.safetensors")
        save_steer(paths[name], random_steer(32, rank, name, seed=seed))
    config = {"vllm_steer": {"steers": paths, "max_steers": 3, "max_steer_rank": 8}}
    rt = get_runtime(config)
    rt.bank_state.load(32, DEVICE, torch.float32)
    # CPU: the eager op, as before
    assert (rt.bank_state.bank.graphs is None) == (DEVICE.type != "cuda")
    rt = SteerRuntime(rt.config)  # another worker's, with the stand-in graph backend
    rt.bank_state.graph_backend = StandIn()
    rt.ensure_slots(8, DEVICE)
    rt.bank_state.load(32, DEVICE, torch.float32)
    rt.model_loaded()
    # captured once the model is loaded, up to 8 rows
    assert rt.bank_state.bank.graphs.buckets == [1, 2, 4, 8]
    bank_p1 = rt.bank_state.bank.p1
    # a drafter reads the same bank, in place
    assert rt.enable_fixed_drafter() == 0.0 and rt.bank_state.bank.p1 is bank_p1
    assert any("the drafter's steers, inside CUDA graphs, read the bank in place (rank 8 per "
               "steer): no more memory" in line for line in log_lines), log_lines
    eps = {n: rt.bank_state.bank.steers[j].metadata.epsilon
           for j, n in enumerate(rt.bank_state.names)}
    rows = {0: {0: 5 * eps["a"]}, 2: {1: -4 * eps["b"]}}
    for slot, cols in rows.items():
        row = np.zeros(rt.slots.num_columns, np.float32)
        for k, v in cols.items():
            row[k] = v
        rt.set_slot(slot, row)
    rt.set_slot(5, np.array([0, 3 * eps["b"], 0, 0, 0, 0], np.float32),
                {1: Window(3.0, start=2, base=0.0)})  # b from its third generated token on
    rt.slots.flush()
    gen = torch.Generator().manual_seed(0)
    for step in range(4):
        slots, pos = np.array([2, 5, 7, 0]), np.array([step, step, step, step])
        h = torch.randn(4, 32, generator=gen).to(DEVICE)
        with sampled_rows(rt.planner, SlotRows(slots=slots, positions=pos)):
            out = rt.planner.steer_rows(h)
        coefs = torch.zeros(4, rt.slots.num_columns)
        coefs[0, 1] = -4 * eps["b"]
        coefs[1, 1] = 3 * eps["b"] if step >= 2 else 0.0
        coefs[3, 0] = 5 * eps["a"]
        ref = steer_reference(h.cpu(), rt.bank_state.bank.p1.cpu(), rt.bank_state.bank.p2.cpu(),
                              rt.bank_state.bank.rank_offsets, coefs)
        torch.testing.assert_close(out.cpu(), ref, rtol=1e-5, atol=1e-5)
        assert torch.equal(out[2].cpu(), h[2].cpu())  # an unsteered slot, bit for bit
    # no step captured: the 4-row bucket's graph, captured at load, replayed 4 times
    assert (rt.bank_state.bank.graphs.captures == 4 and rt.bank_state.bank.graphs.replays == 4
            and rt.planner.stats.calls == 4)


def _one_steer_runtime(tmp_path, slots: int, seed: int, load_first: bool = True,
                       max_rows: int | None = None):
    """A worker runtime with one random rank-4 steer at hidden 32, ``slots`` request slots and
    the head's graphs through the stand-in (the model loaded before the request slots are
    sized, as Model Runner V2 may, or after, as V1 does)."""
    from vllm_steer.format import save_steer
    from vllm_steer.integrations.worker.runtime import get_runtime

    tmp_path.mkdir(parents=True, exist_ok=True)
    path = str(tmp_path / "a.safetensors")
    save_steer(path, random_steer(32, 4, "a", seed=seed))
    rt = get_runtime({"vllm_steer": {"steers": {"a": path}, "max_steers": 2,
                                     "max_steer_rank": 8}})
    rt.bank_state.graph_backend = StandIn()
    if load_first:
        rt.bank_state.load(32, DEVICE, torch.float32)  # the head, built with the model
        rt.model_loaded()  # vLLM's loader done
        # max_num_seqs not known yet: nothing captured
        assert rt.bank_state.bank.graphs.captures == 0
        rt.ensure_slots(slots, DEVICE, max_rows)
    else:
        rt.ensure_slots(slots, DEVICE, max_rows)  # no bank yet: nothing to capture
        rt.bank_state.load(32, DEVICE, torch.float32)
        # the weights are not loaded yet: nothing captured
        assert rt.bank_state.bank.graphs.captures == 0
        rt.model_loaded()
    return rt


@pytest.mark.parametrize("load_first", [True, False])
def test_the_heads_graphs_are_captured_at_start_up_and_no_step_captures(tmp_path, load_first):
    """Every row bucket up to ``max_num_seqs`` is captured once the model is loaded and the
    request slots are sized, whichever comes first, so that no serving step stalls on a
    capture: a batch that grows from one request to the most the runner schedules, and
    shrinks again, only replays (the coefficient buffer, which the graphs read, holds every
    bucket's rows from the start), with the reference's rows."""
    import numpy as np

    from vllm_steer.integrations.worker.rows import SlotRows

    rt = _one_steer_runtime(tmp_path, slots=8, seed=1, load_first=load_first)
    assert (rt.bank_state.bank.graphs.buckets == [1, 2, 4, 8]
            and rt.bank_state.bank.graphs.captures == 4)
    row = np.zeros(rt.slots.num_columns, np.float32)
    row[0] = 4 * rt.bank_state.bank.steers[0].metadata.epsilon
    for slot in range(8):
        rt.set_slot(slot, row if slot % 2 == 0 else None)
    rt.slots.flush()
    gen = torch.Generator().manual_seed(0)
    for n in (*range(1, 9), *range(7, 0, -1)):
        h = torch.randn(n, 32, generator=gen).to(DEVICE)
        with sampled_rows(rt.planner, SlotRows(slots=np.arange(n))):
            out = rt.planner.steer_rows(h)
        coefs = torch.tensor(np.stack([row if i % 2 == 0 else 0 * row for i in range(n)]))
        ref = steer_reference(h.cpu(), rt.bank_state.bank.p1.cpu(), rt.bank_state.bank.p2.cpu(),
                              rt.bank_state.bank.rank_offsets, coefs)
        torch.testing.assert_close(out.cpu(), ref, rtol=1e-5, atol=1e-5)
    assert rt.bank_state.bank.graphs.buckets == [1, 2, 4, 8]
    assert rt.bank_state.bank.graphs.captures == 4 and rt.bank_state.bank.graphs.replays == 15
    rt.ensure_slots(4, DEVICE)  # sized already: nothing to capture
    assert rt.bank_state.bank.graphs.captures == 4


def test_enforce_eager_keeps_the_head_on_the_eager_op(tmp_path, log_lines):
    """vLLM's ``--enforce-eager`` (no CUDA graphs) holds for the head's op too: no graph is
    made or captured, the log says why, and the eager op gives the reference's rows."""
    import numpy as np

    from vllm_steer.config import SteerServerConfig
    from vllm_steer.format import save_steer
    from vllm_steer.integrations.worker.rows import SlotRows
    from vllm_steer.integrations.worker.runtime import SteerRuntime

    path = str(tmp_path / "a.safetensors")
    save_steer(path, random_steer(32, 4, "a", seed=5))
    rt = SteerRuntime(SteerServerConfig.from_additional_config(
        {"vllm_steer": {"steers": {"a": path}, "max_steer_rank": 4}}))
    rt.bank_state.graph_backend = back = StandIn()
    rt.ensure_slots(4, DEVICE)
    rt.bank_state.load(32, DEVICE, torch.float32, cuda_graphs=False)
    rt.model_loaded(torch.float32)
    assert rt.bank_state.bank.graphs is None and back.captured == []
    assert any("launched eagerly: vLLM runs with --enforce-eager" in line
               for line in log_lines), log_lines
    row = np.zeros(rt.slots.num_columns, np.float32)
    row[0] = 5 * rt.bank_state.bank.steers[0].metadata.epsilon
    rt.set_slot(1, row)
    rt.slots.flush()
    h = torch.randn(3, 32, generator=torch.Generator().manual_seed(0)).to(DEVICE)
    with sampled_rows(rt.planner, SlotRows(slots=np.arange(3))):
        out = rt.planner.steer_rows(h)
    coefs = torch.zeros(3, rt.slots.num_columns)
    coefs[1] = torch.from_numpy(row)
    ref = steer_reference(h.cpu(), rt.bank_state.bank.p1.cpu(), rt.bank_state.bank.p2.cpu(),
                          rt.bank_state.bank.rank_offsets, coefs)
    torch.testing.assert_close(out.cpu(), ref, rtol=1e-5, atol=1e-5)
    assert back.captured == [] and back.replayed == 0


def test_with_speculative_decoding_the_buckets_cover_every_verification_row(tmp_path):
    """A step verifies up to max_num_seqs x (1 + num_speculative_tokens) rows: the graphs are
    captured for that many at start-up (the kernels compiled for as many), so a full
    verification step replays without a capture."""
    from types import SimpleNamespace

    import numpy as np

    from vllm_steer.integrations.worker.rows import SlotRows
    from vllm_steer.integrations.worker.runtime import max_step_rows

    spec = SimpleNamespace(speculative_config=SimpleNamespace(num_speculative_tokens=3))
    assert max_step_rows(spec, 4) == 16
    assert max_step_rows(SimpleNamespace(speculative_config=None), 4) == 4
    assert max_step_rows(object(), 4) == 4
    rt = _one_steer_runtime(tmp_path, slots=4, seed=9)
    assert rt.bank_state.bank.graphs.buckets == [1, 2, 4]
    rt = _one_steer_runtime(tmp_path / "spec", slots=4, seed=9, max_rows=16)
    assert rt.bank_state.bank.graphs.buckets == [1, 2, 4, 8, 16] and rt.bank_state.max_rows == 16
    row = np.zeros(rt.slots.num_columns, np.float32)
    row[0] = 4 * rt.bank_state.bank.steers[0].metadata.epsilon
    for slot in range(4):
        rt.set_slot(slot, row if slot != 2 else None)
    rt.slots.flush()
    slots = np.repeat(np.arange(4), 4)  # each request's 3 draft tokens and its bonus token
    h = torch.randn(16, 32, generator=torch.Generator().manual_seed(0)).to(DEVICE)
    with sampled_rows(rt.planner, SlotRows(slots=slots)):
        out = rt.planner.steer_rows(h)
    coefs = torch.from_numpy(np.stack([0 * row if s == 2 else row for s in slots]))
    ref = steer_reference(h.cpu(), rt.bank_state.bank.p1.cpu(), rt.bank_state.bank.p2.cpu(),
                          rt.bank_state.bank.rank_offsets, coefs)
    torch.testing.assert_close(out.cpu(), ref, rtol=1e-5, atol=1e-5)
    assert rt.bank_state.bank.graphs.captures == 5 and rt.bank_state.bank.graphs.replays == 1


def test_an_fp32_head_captures_its_graphs_for_the_models_hidden_states(tmp_path):
    """With an fp32 LM head (vLLM's ``head_dtype``) the bank is fp32 and the hidden states keep
    the model's bf16: the graphs are captured for bf16 rows, so the steps replay them."""
    import numpy as np

    from vllm_steer.format import save_steer
    from vllm_steer.integrations.worker.rows import SlotRows
    from vllm_steer.integrations.worker.runtime import SteerRuntime
    from vllm_steer.config import SteerServerConfig

    path = str(tmp_path / "a.safetensors")
    save_steer(path, random_steer(32, 4, "a", seed=4))
    rt = SteerRuntime(SteerServerConfig.from_additional_config(
        {"vllm_steer": {"steers": {"a": path}, "max_steer_rank": 4}}))
    rt.bank_state.graph_backend = StandIn()
    rt.ensure_slots(4, DEVICE)
    rt.bank_state.load(32, DEVICE, torch.float32)  # the head's dtype
    rt.model_loaded(torch.bfloat16)  # the model's
    assert rt.bank_state.bank.graphs.captures == 3
    row = np.zeros(rt.slots.num_columns, np.float32)
    row[0] = 5 * rt.bank_state.bank.steers[0].metadata.epsilon
    rt.set_slot(0, row)
    rt.slots.flush()
    h = torch.randn(2, 32, generator=torch.Generator().manual_seed(0)).to(DEVICE, torch.bfloat16)
    with sampled_rows(rt.planner, SlotRows(slots=np.arange(2))):
        out = rt.planner.steer_rows(h)
    assert (rt.bank_state.bank.graphs.captures == 3 and rt.bank_state.bank.graphs.replays == 1
            and out.dtype == torch.bfloat16)
    coefs = torch.zeros(2, rt.slots.num_columns)
    coefs[0] = torch.from_numpy(row)
    ref = steer_reference(h.cpu(), rt.bank_state.bank.p1.cpu(), rt.bank_state.bank.p2.cpu(),
                          rt.bank_state.bank.rank_offsets, coefs)
    torch.testing.assert_close(out.cpu().float(), ref.float(), rtol=2 ** -7, atol=2 ** -7)


class FailingStandIn(StandIn):
    """The stand-in, whose capture number ``fail_at`` (counted from 1) raises as CUDA would."""

    def __init__(self, fail_at: int):
        super().__init__()
        self.fail_at, self.tries = fail_at, 0

    def capture(self, fn):
        self.tries += 1
        if self.tries == self.fail_at:
            raise RuntimeError("CUDA error: operation not permitted when stream is capturing\n"
                               "CUDA kernel errors might be asynchronously reported")
        return super().capture(fn)


@pytest.mark.parametrize("when", ["start-up", "step"])
def test_a_capture_that_fails_leaves_the_head_on_the_eager_op_and_serving(tmp_path, log_lines,
                                                                          when):
    """CUDA graphs are an optimisation: a capture that fails, while the engine starts or in a
    step, is logged once, and the head serves every later step with the eager op (the
    reference's rows), never trying to capture again (not after a load either)."""
    import numpy as np

    from vllm_steer.format import save_steer
    from vllm_steer.integrations.worker.rows import SlotRows
    from vllm_steer.integrations.worker.runtime import SteerRuntime
    from vllm_steer.config import SteerServerConfig

    path = str(tmp_path / "a.safetensors")
    save_steer(path, random_steer(32, 4, "a", seed=2))
    rt = SteerRuntime(SteerServerConfig.from_additional_config(
        {"vllm_steer": {"steers": {"a": path}, "max_steers": 2, "max_steer_rank": 8}}))
    rt.bank_state.graph_backend = back = FailingStandIn(fail_at=3 if when == "start-up" else 1)
    rt.ensure_slots(8, DEVICE)
    rt.bank_state.load(32, DEVICE, torch.float32)
    if when == "start-up":
        rt.model_loaded()  # buckets 1 and 2 captured, then 4 fails: nothing raised
        assert back.tries == 3
    eps = rt.bank_state.bank.steers[0].metadata.epsilon
    gen = torch.Generator().manual_seed(0)
    for n in (3, 3, 6):
        row = np.zeros(rt.slots.num_columns, np.float32)
        row[0] = 4 * eps
        for slot in range(n):
            rt.set_slot(slot, row if slot != 1 else None)
        rt.slots.flush()
        h = torch.randn(n, 32, generator=gen).to(DEVICE)
        with sampled_rows(rt.planner, SlotRows(slots=np.arange(n))):
            out = rt.planner.steer_rows(h)
        coefs = torch.zeros(n, rt.slots.num_columns)
        coefs[:, 0] = 4 * eps
        coefs[1] = 0
        ref = steer_reference(h.cpu(), rt.bank_state.bank.p1.cpu(), rt.bank_state.bank.p2.cpu(),
                              rt.bank_state.bank.rank_offsets, coefs)
        torch.testing.assert_close(out.cpu(), ref, rtol=1e-5, atol=1e-5)
    rt.put_steer(1, 5, "b", random_steer(32, 8, "b", seed=3))  # a new layout: no new try
    tries = back.tries
    assert tries == (3 if when == "start-up" else 1) and rt.bank_state.bank.graphs.buckets == []
    assert (rt.bank_state.bank.graphs.replays == 0
            and "operation not permitted" in rt.bank_state.bank.graphs.failed)
    warned = [line for line in log_lines if "launched eagerly from now on" in line]
    assert len(warned) == 1 and "RuntimeError: CUDA error: operation not permitted when " \
        "stream is capturing" in warned[0] and "asynchronously" not in warned[0], warned


def test_run_time_loads_and_unloads_keep_every_graph_and_the_replays_read_the_new_steers(
        tmp_path):
    """The bank never moves: a run-time load or unload rewrites its slot in place, the head's
    graphs are kept (nothing captured), and the steps after it replay them with the new
    steer's rows."""
    import numpy as np

    from vllm_steer.integrations.worker.rows import SlotRows

    rt = _one_steer_runtime(tmp_path, slots=4, seed=5)
    assert rt.bank_state.bank.graphs.captures == 3  # buckets 1, 2, 4
    gen = torch.Generator().manual_seed(0)

    def step(strengths):
        for slot, (col, s) in enumerate(strengths):
            row = np.zeros(rt.slots.num_columns, np.float32)
            if s:
                row[col] = s * rt.bank_state.bank.steers[col].metadata.epsilon
            rt.set_slot(slot, row if s else None)
        rt.slots.flush()
        n = len(strengths)
        h = torch.randn(n, 32, generator=gen).to(DEVICE)
        with sampled_rows(rt.planner, SlotRows(slots=np.arange(n))):
            out = rt.planner.steer_rows(h)
        coefs = torch.zeros(n, rt.slots.num_columns)
        for i, (col, s) in enumerate(strengths):
            if s:
                coefs[i, col] = s * rt.bank_state.bank.steers[col].metadata.epsilon
        ref = steer_reference(h.cpu(), rt.bank_state.bank.p1.cpu(), rt.bank_state.bank.p2.cpu(),
                              rt.bank_state.bank.rank_offsets, coefs)
        torch.testing.assert_close(out.cpu(), ref, rtol=1e-5, atol=1e-5)

    step([(0, 4), (0, 0), (0, -2)])
    rt.put_steer(1, 7, "b", random_steer(32, 8, "b", seed=6))  # a new steer, another rank
    assert (rt.bank_state.bank.graphs.buckets == [1, 2, 4]
            and rt.bank_state.bank.graphs.captures == 3)  # nothing captured
    step([(0, 4), (1, 3), (1, -2), (0, 0)])
    step([(1, 5)])
    rt.drop_slots([1])
    step([(0, 3), (0, 0)])
    rt.put_steer(1, 8, "b2", random_steer(32, 3, "b2", seed=7))
    step([(1, 4), (0, 2)])
    assert rt.bank_state.bank.graphs.captures == 3 and rt.bank_state.bank.graphs.replays == 5


def test_steps_replayed_from_graphs_plan_nothing_and_an_eager_step_plans_its_own(tmp_path):
    """The eager op's plan is made for the first eager launch of a step's coefficients, never
    for a step its graph replays; the eager launch then gives the reference's rows."""
    import numpy as np

    from vllm_steer.integrations.worker.rows import SlotRows

    rt = _one_steer_runtime(tmp_path, slots=4, seed=3)
    planned = []
    prepare = rt.bank_state.prepare
    assert prepare is not None  # the auto backend plans its launches

    def counted(*args, **kwargs):
        planned.append(1)
        return prepare(*args, **kwargs)

    rt.bank_state.prepare = counted
    eps = rt.bank_state.bank.steers[0].metadata.epsilon
    gen = torch.Generator().manual_seed(0)

    def step(strengths):
        for slot, s in enumerate(strengths):
            row = np.zeros(rt.slots.num_columns, np.float32)
            row[0] = s * eps
            rt.set_slot(slot, row if s else None)
        rt.slots.flush()
        h = torch.randn(4, 32, generator=gen).to(DEVICE)
        with sampled_rows(rt.planner, SlotRows(slots=np.arange(4))):
            out = rt.planner.steer_rows(h)
        coefs = torch.zeros(4, rt.slots.num_columns)
        coefs[:, 0] = torch.tensor(strengths, dtype=torch.float32) * eps
        ref = steer_reference(h.cpu(), rt.bank_state.bank.p1.cpu(), rt.bank_state.bank.p2.cpu(),
                              rt.bank_state.bank.rank_offsets, coefs)
        torch.testing.assert_close(out.cpu(), ref, rtol=1e-5, atol=1e-5)

    for strengths in ([4, 0, 2, 0], [4, 1, 2, 0], [4, 1, 2, 0]):  # replayed
        step(strengths)
    assert rt.bank_state.bank.graphs.replays == 3 and planned == []
    rt.bank_state.bank.graphs.failed = "a failed capture"  # the eager op from now on
    step([4, 1, 2, 0])
    step([4, 1, 2, 0])
    assert len(planned) == 1  # planned at its first eager launch, then kept
    step([0, 3, 2, 5])
    assert len(planned) == 2 and rt.bank_state.bank.graphs.replays == 3


@pytest.mark.skipif(DEVICE.type != "cuda", reason="real CUDA graphs (scripts/gpu_window.sh runs "
                                                  "this file with VLLM_STEER_TEST_DEVICE=cuda)")
def test_real_cuda_graphs_replay_the_tables_and_the_copys_current_values():
    """On a GPU: the captured graph (no stand-in) follows new coefficients written into the
    table and a steer rewritten into the fixed copy, and matches the reference."""
    bank = _bank()
    graphs = G.head_graphs(bank)
    assert isinstance(graphs.backend, G.CudaGraphBackend)
    table = torch.zeros(8, bank.num_columns, device=DEVICE)
    gen = torch.Generator().manual_seed(0)
    for step in range(4):
        if step == 2:
            bank.put(1, 9, "b2", random_steer(32, 8, "b2", seed=9))  # same layout: no capture
        table[:5] = _coefs(bank, 5, gen)
        h = torch.randn(5, 32, generator=gen).to(DEVICE)
        out = graphs.run(h, table).clone()
        ref = steer_reference(h.cpu(), bank.p1.cpu(), bank.p2.cpu(), bank.rank_offsets,
                              table[:5].cpu())
        torch.testing.assert_close(out.cpu(), ref, rtol=1e-4, atol=1e-4)
    assert graphs.captures == 1 and graphs.replays == 4


@pytest.mark.skipif(DEVICE.type != "cuda", reason="real CUDA graphs (scripts/gpu_window.sh runs "
                                                  "this file with VLLM_STEER_TEST_DEVICE=cuda)")
def test_real_cuda_graphs_are_captured_again_after_every_graph_was_dropped():
    """On a GPU: a new coefficient table and a load that changes the bank's layout each drop
    every graph; the next captures (into a new memory pool: capturing into the dropped graphs'
    pool fails an assertion inside PyTorch) replay the reference."""
    bank = _bank()
    graphs = G.head_graphs(bank)
    gen = torch.Generator().manual_seed(1)
    for step in range(3):
        if step == 2:
            bank.put(2, 7, "c", random_steer(32, 2, "c", seed=7))  # a new layout
        table = _coefs(bank, 4, gen)  # a new buffer each step
        h = torch.randn(4, 32, generator=gen).to(DEVICE)
        out = graphs.run(h, table).clone()
        ref = steer_reference(h.cpu(), bank.p1.cpu(), bank.p2.cpu(), bank.rank_offsets,
                              table.cpu())
        torch.testing.assert_close(out.cpu(), ref, rtol=1e-4, atol=1e-4)
    assert graphs.captures == 3


@pytest.mark.skipif(DEVICE.type != "cuda", reason="real CUDA graphs (scripts/gpu_window.sh runs "
                                                  "this file with VLLM_STEER_TEST_DEVICE=cuda)")
def test_real_cuda_graphs_captured_at_start_up_replay_and_are_captured_again_in_a_load(tmp_path):
    """On a GPU: the worker's runtime captures every bucket once the model is loaded (no
    stand-in); steps of 1..8 rows replay them with the reference's rows and capture nothing; a
    load that changes the layout captures them again before it returns, and the steps after it
    apply the new steer."""
    import numpy as np

    from vllm_steer.format import save_steer
    from vllm_steer.integrations.worker.rows import SlotRows
    from vllm_steer.integrations.worker.runtime import get_runtime

    path = str(tmp_path / "a.safetensors")
    save_steer(path, random_steer(32, 4, "a", seed=11))
    rt = get_runtime({"vllm_steer": {"steers": {"a": path}, "max_steers": 2,
                                     "max_steer_rank": 8}})
    rt.ensure_slots(8, DEVICE)
    rt.bank_state.load(32, DEVICE, torch.float32)
    rt.model_loaded(torch.float32)
    assert isinstance(rt.bank_state.bank.graphs.backend, G.CudaGraphBackend)
    assert (rt.bank_state.bank.graphs.buckets == [1, 2, 4, 8]
            and rt.bank_state.bank.graphs.captures == 4)
    gen = torch.Generator().manual_seed(0)

    def step(n, col):
        row = np.zeros(rt.slots.num_columns, np.float32)
        row[col] = 4 * rt.bank_state.bank.steers[col].metadata.epsilon
        for slot in range(n):
            rt.set_slot(slot, row if slot % 2 == 0 else None)
        rt.slots.flush()
        h = torch.randn(n, 32, generator=gen).to(DEVICE)
        with sampled_rows(rt.planner, SlotRows(slots=np.arange(n))):
            out = rt.planner.steer_rows(h).clone()
        coefs = torch.from_numpy(np.stack([row if i % 2 == 0 else 0 * row for i in range(n)]))
        ref = steer_reference(h.cpu(), rt.bank_state.bank.p1.cpu(), rt.bank_state.bank.p2.cpu(),
                              rt.bank_state.bank.rank_offsets, coefs)
        torch.testing.assert_close(out.cpu(), ref, rtol=1e-4, atol=1e-4)

    for n in (1, 3, 8, 5):
        step(n, 0)
    assert rt.bank_state.bank.graphs.captures == 4 and rt.bank_state.bank.graphs.replays == 4
    rt.put_steer(1, 7, "b", random_steer(32, 8, "b", seed=12))  # a new layout
    assert rt.bank_state.bank.graphs.captures == 8
    for n in (2, 7):
        step(n, 1)
    assert rt.bank_state.bank.graphs.captures == 8 and rt.bank_state.bank.graphs.replays == 6


def test_a_prompt_logprob_chunk_past_the_graphs_rows_keeps_their_buffer_and_graphs(tmp_path):
    """A call with more rows than the largest graph (Model Runner V2 computes prompt logprobs
    1024 rows at a time) runs eagerly on a buffer of its own: the table and the row index the
    graphs read are never replaced, so no serving step after it drops or captures a graph;
    every call's rows are the reference's."""
    import numpy as np

    from vllm_steer.integrations.worker.rows import PromptRows, SlotRows

    rt = _one_steer_runtime(tmp_path, slots=8, seed=3)
    graphs, planner = rt.bank_state.bank.graphs, rt.planner
    table, index = planner.head_table, planner.row_index
    assert graphs.captures == 4 and index.shape == (graphs.max_rows,)
    row = np.zeros(rt.slots.num_columns, np.float32)
    row[0] = 4 * rt.bank_state.bank.steers[0].metadata.epsilon
    for slot in range(8):
        rt.set_slot(slot, row if slot % 2 == 0 else None)
    rt.slots.flush()
    p1, p2 = rt.bank_state.bank.p1.cpu(), rt.bank_state.bank.p2.cpu()
    offs = rt.bank_state.bank.rank_offsets

    def ref(h, slots):
        coefs = torch.tensor(np.stack([row if s % 2 == 0 else 0 * row for s in slots]))
        return steer_reference(h.cpu(), p1, p2, offs, coefs)

    gen = torch.Generator().manual_seed(0)
    for rows in (graphs.max_rows + 10, 2 * graphs.max_rows + 1, 4):  # eager, eager, replayed
        base = torch.randn(rows, 32, generator=gen).to(DEVICE)
        token_slots = np.arange(rows) % 8
        with rt.step.prompts(PromptRows(base=base, token_slots=token_slots)):
            out = planner.steer_rows(base)
        torch.testing.assert_close(out.cpu(), ref(base, token_slots), rtol=1e-5, atol=1e-5)
        for n in (3, 8, 1):
            h = torch.randn(n, 32, generator=gen).to(DEVICE)
            with sampled_rows(planner, SlotRows(slots=np.arange(n))):
                out = planner.steer_rows(h)
            torch.testing.assert_close(out.cpu(), ref(h, range(n)), rtol=1e-5, atol=1e-5)
    # the buffers the graphs read, never replaced; the eager op's own grew past them
    assert planner.head_table is table and planner.row_index is index
    assert planner.coef_buffer.shape[0] >= 2 * graphs.max_rows + 1
    # replayed: the nine sampled steps and the 4-row prompt call
    assert graphs.captures == 4 and graphs.backend.resets == 0 and graphs.replays == 10


def test_a_step_with_fewer_rows_leaves_no_steer_in_its_buckets_padding_rows(tmp_path):
    """A graph's bucket reads its padding rows too (a 5-row step replays the 8-row graph): the
    rows a larger step left in the row index are set to -1 (no steer) with the smaller step's
    copy, so the op never reads a steer no row of the step uses."""
    import numpy as np

    from vllm_steer.integrations.worker.rows import SlotRows

    rt = _one_steer_runtime(tmp_path, slots=8, seed=4)
    row = np.zeros(rt.slots.num_columns, np.float32)
    row[0] = 3 * rt.bank_state.bank.steers[0].metadata.epsilon
    for slot in range(8):
        rt.set_slot(slot, row if slot >= 5 else None)
    rt.slots.flush()
    for n in (8, 5, 8, 6):
        slots = np.arange(n)[::-1].copy()
        with sampled_rows(rt.planner, SlotRows(slots=slots)):
            rt.planner.steer_rows(torch.randn(n, 32).to(DEVICE))
        index = rt.planner.row_index.cpu()
        assert index[:n].tolist() == slots.tolist() and (index[n:] == -1).all()
