"""The sizing of docs/deploy.md against what the code allocates: the table is the sizing
function's output, the function's figures are the bytes of the tensors the bank and the head's
graphs really allocate (measured here on the CPU, with the stand-in graph backend), no size
turns the head's graphs off, and the Deployment's row is the Deployment's settings."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch
import yaml

from helpers.capture import StandIn
from helpers.steers import random_steer
from vllm_steer import sizing
from vllm_steer.bank import SlotBank
from vllm_steer.config import DEFAULT_RESERVED_RANK
from vllm_steer.integrations.engine.registry import DEFAULT_MAX_STEERS
from vllm_steer.kernels import graphs as G

ROOT = Path(__file__).resolve().parents[2]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _nbytes(*tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def test_the_docs_table_is_the_sizing_functions_output():
    text = (ROOT / "docs" / "deploy.md").read_text()
    m = re.search(r"<!-- SIZING:begin -->\n(.*?)\n<!-- SIZING:end -->", text, re.S)
    assert m, "docs/deploy.md has no SIZING block"
    assert m.group(1) == sizing.sizing_table(), "regenerate: vllm_steer.sizing.sizing_table()"


@pytest.mark.parametrize("max_steers, rank, hidden, dtype", [
    (3, 8, 32, "float32"), (4, 16, 48, "bfloat16"), (1, 4, 64, "float16")])
def test_the_figures_are_the_bytes_the_bank_allocates_and_it_never_moves(max_steers, rank,
                                                                        hidden, dtype):
    bank = SlotBank(max_steers, hidden, dtype=DTYPES[dtype], reserve_rank=rank)
    where = (bank.p1.data_ptr(), bank.p2.data_ptr())
    bank.put(0, 1, "a", random_steer(hidden, rank, "a", seed=1))
    # the factors are views of the storage reserved up front: its size is the bank's memory
    reserved = bank.p1.untyped_storage().nbytes() + bank.p2.untyped_storage().nbytes()
    assert reserved == sizing.bank_bytes(max_steers, rank, hidden, dtype)
    assert (bank.p1.data_ptr(), bank.p2.data_ptr()) == where  # a load writes in place


@pytest.mark.parametrize("rows, columns, max_per_row, rank, hidden", [
    (1, 4, 2, 8, 32), (16, 6, 16, 16, 48), (512, 16, 16, 64, 4096), (7, 3, 2, 100, 2048)])
def test_the_grouped_ops_buffers_are_what_the_sizing_says(rows, columns, max_per_row, rank,
                                                          hidden):
    from vllm_steer.kernels.triton.grouped import grouped_scratch

    scratch = grouped_scratch(rows, columns, max_per_row, rank, hidden, torch.device("cpu"))
    got = sum(_nbytes(t) for t in vars(scratch).values() if isinstance(t, torch.Tensor))
    assert got == sizing.grouped_scratch_bytes(rows, columns, max_per_row, rank, hidden)


def test_the_graph_rows_are_the_static_buffers_of_every_bucket_captured():
    """Every bucket up to 512 rows captured (the stand-in backend runs the op on the CPU):
    their static inputs and outputs take what :func:`graph_rows_bytes` says, and nothing of
    the bank is copied (the graphs read the bank's own tensors)."""
    hidden, max_steers, rank = 16, 2, 4
    bank = SlotBank(max_steers, hidden, dtype=torch.float32, reserve_rank=rank)
    bank.put(0, 1, "a", random_steer(hidden, rank, "a", seed=1))
    graphs = G.head_graphs(bank, graph_backend=StandIn())
    table = torch.zeros(sizing.MAX_GRAPH_ROWS, bank.num_columns)
    assert graphs.capture(sizing.MAX_GRAPH_ROWS, hidden, torch.float32, table) == 10
    rows = sum(_nbytes(entry[1], entry[2]) for entry in graphs._graphs.values())
    assert rows == sizing.graph_rows_bytes(hidden, "float32")
    assert graphs.p1.data_ptr() == bank.p1.data_ptr()
    assert graphs.p2.data_ptr() == bank.p2.data_ptr()
    assert sizing.head_graph_bytes(max_steers, rank, hidden, "float32") == \
        rows + sizing.graph_scratch_bytes(max_steers, rank, hidden)


def test_a_large_bank_keeps_the_heads_graphs():
    """No size turns the graphs off: a bank far larger than a small limit would allow (here
    64 slots) is replayed from graphs all the same."""
    b = SlotBank(64, 32, dtype=torch.float32, reserve_rank=8)
    b.put(0, 1, "a", random_steer(32, 4, "a", seed=1))
    graphs = G.head_graphs(b, graph_backend=StandIn())
    assert graphs is not None and graphs.p1.data_ptr() == b.p1.data_ptr()
    assert not hasattr(G, "MAX_GRAPH_BANK_BYTES") and not hasattr(sizing, "head_graphs_on")


def _flag(args: list[str], name: str) -> str | None:
    for i, a in enumerate(args):
        if a == name:
            return args[i + 1]
        if a.startswith(name + "="):
            return a.split("=", 1)[1]
    return None


def test_the_deployments_row_has_the_deployments_settings():
    doc = yaml.safe_load((ROOT / "deploy" / "kubernetes" / "deployment.yaml").read_text())
    args = doc["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "Llama-3.1-8B" in args[0]
    row = next(r for r in sizing.DOC_ROWS if "the Deployment" in r.note)
    assert row.max_steers == int(_flag(args, "--max-steers") or DEFAULT_MAX_STEERS)
    assert row.rank == int(_flag(args, "--max-steer-rank") or DEFAULT_RESERVED_RANK)
    assert row.dtype == _flag(args, "--dtype") == "bfloat16"
    assert row.hidden_size == 4096  # Llama-3.1-8B's hidden size
    # the figures the docs give for it
    text = (ROOT / "docs" / "deploy.md").read_text()
    mib = round(sizing.bank_bytes(row.max_steers, row.rank, 4096, "bfloat16") / 2**20)
    graphs = round(sizing.head_graph_bytes(row.max_steers, row.rank, 4096, "bfloat16") / 2**20)
    assert f"{mib} MiB of bank and {graphs} MiB of head graphs" in text
    assert f"take {mib + graphs} MiB" in text


def test_a_dtype_it_does_not_know_is_refused_by_name():
    with pytest.raises(ValueError, match="'int8'.*float32, bfloat16, float16"):
        sizing.bank_bytes(8, 64, 4096, "int8")
    assert sizing.dtype_bytes(torch.bfloat16) == 2


def test_the_vector_bank_s_size_is_what_the_step_mapping_allocates():
    import torch

    from vllm_steer.integrations.worker.step_mapping import LayerVectors
    from vllm_steer.sizing import vector_bank_bytes

    layers = LayerVectors([2, 3, 4], 8, capacity=5, hidden_size=48, max_tokens=40,
                          device=torch.device("cpu"))
    got = sum(t.numel() * t.element_size() for t in (layers.vectors, layers.token_coefs))
    assert vector_bank_bytes(5, 3, 48, 40) == got == layers.reserved_bytes
    # the 8B Deployment: 256 slots, 32 blocks, hidden 4096, 8192 tokens per step
    assert vector_bank_bytes(256, 32, 4096, 8192) == 136 * 2**20
    assert vector_bank_bytes(256, 32, 4096, 8192, "bfloat16") == 68 * 2**20


def test_the_request_slot_table_is_what_the_sizing_says():
    from vllm_steer.integrations.worker.request_slots import RequestSlots

    for seqs, cap, rows in ((4, 3, None), (16, 8, 32), (1024, 5, 4096)):
        slots = RequestSlots(cap)
        slots.ensure(seqs, torch.device("cpu"), min(max(rows or 0, seqs), sizing.MAX_GRAPH_ROWS))
        assert _nbytes(slots.device_rows, slots._scratch) == \
            sizing.request_table_bytes(seqs, cap, rows)
    text = (ROOT / "docs" / "deploy.md").read_text()
    mib = sizing.request_table_bytes(1024, 256, 1024) / 2**20
    assert f"{round(mib)} MiB at 256 slots and 1,024 sequences" in text


@pytest.mark.skipif(not torch.cuda.is_available() and
                    os.environ.get("TRITON_INTERPRET") != "1",
                    reason="the Triton backend on CPU needs TRITON_INTERPRET=1")
def test_the_eager_ops_scratch_is_what_the_sizing_says(tmp_path):
    """A step the head's graphs do not take runs the eager op, whose Triton plan holds
    ``[rows, 2 x max_steers x rank]`` fp32 whatever steers the step uses: measured through the
    worker's planner, and the figures deploy.md gives for it."""
    import numpy as np

    from helpers.rows import sampled_rows
    from vllm_steer.config import SteerServerConfig
    from vllm_steer.format import save_steer
    from vllm_steer.integrations.worker.rows import SlotRows
    from vllm_steer.integrations.worker.runtime import SteerRuntime

    hidden, cap, rank, rows = 32, 6, 8, 40
    path = str(tmp_path / "a.safetensors")
    save_steer(path, random_steer(hidden, 4, "a", seed=1))
    rt = SteerRuntime(SteerServerConfig(steers={"a": path}, backend="triton", max_steers=cap,
                                        max_steer_rank=rank))
    rt.bank_state.load(hidden, torch.device("cpu"), torch.float32)
    rt.ensure_slots(rows, torch.device("cpu"), rows)
    row = np.zeros(rt.slots.num_columns, np.float32)
    row[0] = 1e-3
    rt.set_slot(0, row)
    rt.slots.flush()
    with sampled_rows(rt.planner, SlotRows(slots=np.zeros(rows, dtype=np.int64))):
        rt.planner.steer_rows(torch.randn(rows, hidden))
    assert _nbytes(rt.planner._plan.buf) == sizing.eager_scratch_bytes(rows, cap, rank)
    text = (ROOT / "docs" / "deploy.md").read_text()
    for n, slots, figure in ((1024, 8, "4 MiB"), (1024, 256, "128 MiB"),
                             (8192, 256, "1 GiB")):
        b = sizing.eager_scratch_bytes(n, slots, 64)
        assert f"{b // 2**20} MiB" == figure or f"{b // 2**30} GiB" == figure
        assert figure in text
