"""``vllm_steer:head_eager``'s source: the worker's ``stats`` answer says whether the LM head
launches its steer op eagerly where it should replay it from CUDA graphs (a stand-in graph
backend on the CPU, as the head's other graph tests use), and says nothing where no graphs are
used by choice."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from helpers.capture import StandIn
from helpers.fakes import VllmObject
from helpers.steers import random_steer
from vllm_steer.format import save_steer
from vllm_steer.integrations.worker.management import worker_op
from vllm_steer.integrations.worker.runtime import get_runtime
from vllm_steer.kernels import graphs as G

HIDDEN = 16


class FailingStandIn(StandIn):
    """A graph backend whose capture fails (as a CUDA capture may)."""

    def capture(self, fn):
        raise RuntimeError("capture refused")


def _runtime(tmp_path, backend, max_rank=None, cuda_graphs=True, steer_backend=None,
             max_steers=None):
    """A worker's runtime with start-up steer ``a`` (rank 4) loaded and its request slots
    sized, as vLLM's load leaves it; ``(runtime, the worker object worker_op takes)``."""
    path = str(tmp_path / "a.safetensors")
    save_steer(path, random_steer(HIDDEN, 4, "a", seed=1))
    cfg = {"steers": {"a": path}}
    if max_rank is not None:
        cfg["max_steer_rank"] = max_rank
    if steer_backend is not None:
        cfg["backend"] = steer_backend
    if max_steers is not None:
        cfg["max_steers"] = max_steers
    extra = {"vllm_steer": cfg}
    rt = get_runtime(extra)
    rt.bank_state.graph_backend = backend
    rt.bank_state.load(HIDDEN, torch.device("cpu"), torch.float32, cuda_graphs=cuda_graphs)
    rt.ensure_slots(4, torch.device("cpu"))
    rt.bank_state.model_loaded = True
    rt.planner.capture_graphs()
    return rt, VllmObject(vllm_config=SimpleNamespace(additional_config=extra))


def _eager(worker) -> int:
    return worker_op(worker, "stats")["head_eager"]


def test_replayed_graphs_report_0(tmp_path):
    rt, worker = _runtime(tmp_path, StandIn())
    graphs = rt.bank_state.bank.graphs
    assert graphs is not None and graphs.buckets
    assert _eager(worker) == 0


def test_a_failed_capture_reports_1(tmp_path):
    rt, worker = _runtime(tmp_path, FailingStandIn())
    assert rt.bank_state.bank.graphs.failed is not None
    assert _eager(worker) == 1


def test_a_large_bank_replays_and_reports_0(tmp_path):
    """The bank is read in place: no size of it turns the graphs off (64 slots here)."""
    rt, worker = _runtime(tmp_path, StandIn(), max_rank=4, max_steers=64)
    assert rt.bank_state.bank.graphs is not None
    assert _eager(worker) == 0


@pytest.mark.parametrize("how", ["cpu", "enforce_eager", "named_backend", "env"])
def test_no_graphs_by_choice_report_0(tmp_path, monkeypatch, how):
    """On a CPU (no graph backend), with --enforce-eager, a named --steer-backend or
    VLLM_STEER_CUDA_GRAPHS=0 the op is eager as configured: nothing to alert on."""
    if how == "env":
        monkeypatch.setenv(G.ENV_GRAPHS, "0")
    rt, worker = _runtime(tmp_path, None if how == "cpu" else StandIn(),
                          cuda_graphs=how != "enforce_eager",
                          steer_backend="torch" if how == "named_backend" else None)
    assert rt.bank_state.bank.graphs is None
    assert _eager(worker) == 0
