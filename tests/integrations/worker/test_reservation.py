"""The steer bank's device memory is taken at start-up, while vLLM loads the model (so vLLM
counts it before it sizes the KV cache), for its worst case: ``--max-steers`` steers of rank
``--max-steer-rank``, each with a domain component. A run-time load then allocates no device
memory; a steer over the reservation is refused with HTTP 400; a reservation the device cannot
hold is refused at start-up."""

from __future__ import annotations

import logging
import re
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from helpers.rows import sampled_rows
from helpers.steers import random_steer
from vllm_steer.config import SteerServerConfig
from vllm_steer.format import load_steer, make_steer, save_steer
from vllm_steer.integrations.worker.rows import SlotRows
from vllm_steer.integrations.worker.runtime import SteerRuntime
from vllm_steer.reference import steer_coefficients, steer_reference
from helpers.fakes import engine_core

HIDDEN = 48


def _steer(tmp_path, name, rank, seed, domain_rank=None):
    s = random_steer(HIDDEN, rank, name, seed=seed, scale=3.0)
    if domain_rank:
        g = torch.Generator().manual_seed(seed + 100)
        s = make_steer(s.p1, s.p2, name, labels={"positive": name}, domain="with_steer",
                       domain_p1=torch.randn(HIDDEN, domain_rank, generator=g),
                       domain_p2=torch.randn(HIDDEN, domain_rank, generator=g))
    path = str(tmp_path / f"{name}.safetensors")
    save_steer(path, s)
    return path


def _storage(rt):
    bank = rt.bank_state.bank
    return (bank.p1.untyped_storage().data_ptr(), bank.p2.untyped_storage().data_ptr())


class Lines(logging.Handler):
    """What the plugin logs (its logger is vLLM's child, which may not propagate)."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def test_the_bank_is_reserved_at_start_up_and_run_time_loads_allocate_nothing(tmp_path):
    a = _steer(tmp_path, "a", 4, 1)
    rt = SteerRuntime(SteerServerConfig(steers={"a": a}, backend="torch", max_steers=4,
                                        max_steer_rank=8))
    from vllm_steer.logs import get_logger

    logger, lines = get_logger(), Lines()
    level = logger.level
    logger.addHandler(lines)
    logger.setLevel(logging.INFO)
    try:
        rt.bank_state.load(HIDDEN, torch.device("cpu"), torch.bfloat16)
    finally:
        logger.removeHandler(lines)
        logger.setLevel(level)
    text = "\n".join(lines.lines)
    rt.ensure_slots(4, torch.device("cpu"))
    # 2 factors x [hidden, 4 steers x rank 8 x (steer + domain)] in bfloat16 (2 bytes)
    want_mib = 2 * HIDDEN * (4 * 8 * 2) * 2 / 2**20
    m = re.search(r"steer bank reserves ([0-9.]+) MiB \((.*)\)", text)
    assert m, text
    assert float(m.group(1)) == pytest.approx(want_mib, abs=0.05)
    assert "4 max steers x rank 8 x hidden 48 x bfloat16" in m.group(2)
    start = _storage(rt)

    files = {"b": _steer(tmp_path, "b", 8, 2, domain_rank=8), "c": _steer(tmp_path, "c", 2, 3),
             "d": _steer(tmp_path, "d", 8, 4, domain_rank=3)}
    loaded = {0: "a"}
    for op, slot, name in (("put", 1, "b"), ("put", 2, "c"), ("drop", 0, None),
                           ("put", 3, "d"), ("put", 0, "c")):
        if op == "put":
            rt.put_steer(slot, slot + 10, name, load_steer(files[name]))
            loaded[slot] = name
        else:
            rt.drop_slots([slot])
            loaded.pop(slot)
        assert _storage(rt) == start, f"{op} {name or slot} allocated new bank storage"
    assert rt.bank_state.bank.reserved_bytes == 2 * HIDDEN * 64 * 2

    # and the repacked bank steers as the files say (each slot's steer, domain included)
    h = torch.randn(3, HIDDEN, generator=torch.Generator().manual_seed(0))
    rows = {0: ("c", 2.0), 1: ("b", -3.0), 3: ("d", 4.0)}
    cols = np.zeros((3, rt.slots.num_columns), dtype=np.float32)
    for i, (slot, (name, s)) in enumerate(rows.items()):
        meta = load_steer(files[name]).metadata
        served = meta.domain == "with_steer"
        cols[i, slot], cols[i, rt.bank_state.capacity + slot] = steer_coefficients(
            s, meta.epsilon, meta.domain_strength if served else None)
        rt.set_slot(slot, cols[i])
    rt.slots.flush()
    p1, p2, offs = [], [], [0]
    for part in ("steer", "domain"):  # the reference packing: slots in order, then domains
        for slot in range(4):
            st = load_steer(files[loaded[slot]]) if slot in loaded else None
            f = None if st is None else ((st.p1, st.p2) if part == "steer" else
                                         (st.domain_p1, st.domain_p2))
            if f is not None and f[0] is not None:
                p1.append(f[0]), p2.append(f[1])
            offs.append(offs[-1] + (0 if f is None or f[0] is None else f[0].shape[1]))
    want = steer_reference(h.float(), torch.cat(p1, 1).to(torch.bfloat16).float(),
                           torch.cat(p2, 1).to(torch.bfloat16).float(), offs,
                           torch.from_numpy(cols))
    with sampled_rows(rt.planner, SlotRows(slots=np.array(list(rows)))):
        got = rt.planner.steer_rows(h.to(torch.bfloat16))
    torch.testing.assert_close(got.float(), want, atol=0.1, rtol=0.02)


def test_a_steer_over_the_reservation_is_refused_by_the_bank(tmp_path):
    rt = SteerRuntime(SteerServerConfig(steers={"a": _steer(tmp_path, "a", 4, 1)},
                                        backend="torch", max_steers=2, max_steer_rank=4))
    rt.bank_state.load(HIDDEN, torch.device("cpu"), torch.float32)
    with pytest.raises(ValueError, match=r"domain rank 5 over --max-steer-rank=4"):
        rt.put_steer(1, 5, "x", load_steer(_steer(tmp_path, "x", 4, 2, domain_rank=5)))


@pytest.mark.parametrize("rank,domain_rank,what", [(6, None, "rank 6"),
                                                   (4, 6, "domain rank 6")])
def test_a_run_time_load_over_the_reservation_is_http_400(tmp_path, rank, domain_rank, what):
    """``POST /v1/steers`` (the engine core's load op) answers 400 naming the rank, the limit
    and the fix, before any worker is asked."""
    from vllm_steer.integrations.engine import management
    from vllm_steer.integrations.engine.registry import SteerRegistry
    from vllm_steer.integrations.engine.state import EngineSteerState

    cfg = SteerServerConfig(steers={}, max_steers=2, max_steer_rank=4, enable_updates=True)
    core = engine_core(
        steer_state=EngineSteerState(cfg, SteerRegistry(cfg.capacity), HIDDEN),
        vllm_config=SimpleNamespace(model_config=SimpleNamespace(model="m")),
        scheduler=SimpleNamespace(requests={}))  # no request holds a slot
    path = _steer(tmp_path, "big", rank, 7, domain_rank=domain_rank)
    out = management.load_steer_file(core, "big", path, "api")
    assert out["ok"] is False and out["status"] == 400, out
    assert f"{what}, over --max-steer-rank=4" in out["error"]
    assert "larger --max-steer-rank" in out["error"]


def test_without_max_steer_rank_the_bank_reserves_64_and_refuses_more(tmp_path):
    """No ``--max-steer-rank``: the bank reserves rank 64 per steer (or the largest
    ``--steer`` file's, if larger); a run-time load of rank 65 is refused with a 400, one of
    rank 64 fits the reservation (no device memory outside it)."""
    from vllm_steer.config import DEFAULT_RESERVED_RANK
    from vllm_steer.integrations.engine import management
    from vllm_steer.integrations.engine.registry import SteerRegistry
    from vllm_steer.integrations.engine.state import EngineSteerState

    assert DEFAULT_RESERVED_RANK == 64
    cfg = SteerServerConfig(steers={}, max_steers=2, enable_updates=True)
    core = engine_core(
        steer_state=EngineSteerState(cfg, SteerRegistry(cfg.capacity), HIDDEN),
        vllm_config=SimpleNamespace(model_config=SimpleNamespace(model="m")),
        model_executor=SimpleNamespace(collective_rpc=lambda fn, args=(): [True]),
        scheduler=SimpleNamespace(requests={}))
    out = management.load_steer_file(core, "big", _steer(tmp_path, "big", 65, 7), "api")
    assert out["ok"] is False and out["status"] == 400, out
    assert "rank 65, over --max-steer-rank=64" in out["error"]
    ok = management.load_steer_file(core, "fits", _steer(tmp_path, "fits", 64, 8), "api")
    assert ok["ok"] is True, ok
    rt = SteerRuntime(SteerServerConfig(steers={"a": _steer(tmp_path, "a", 4, 1)},
                                        backend="torch", max_steers=2))
    rt.bank_state.load(HIDDEN, torch.device("cpu"), torch.float32)
    assert rt.bank_state.bank.reserved_rank == 64


def test_a_reservation_the_device_cannot_hold_is_refused_at_start_up(tmp_path, monkeypatch):
    from vllm_steer import bank

    def out_of_memory(self, total_rank):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 4.00 GiB")

    monkeypatch.setattr(bank.SlotBank, "_allocate", out_of_memory)
    rt = SteerRuntime(SteerServerConfig(steers={"a": _steer(tmp_path, "a", 4, 1)},
                                        max_steers=64, max_steer_rank=1024))
    with pytest.raises(RuntimeError) as e:
        rt.bank_state.load(HIDDEN, torch.device("cpu"), torch.float16)
    want_mib = 2 * HIDDEN * (64 * 1024 * 2) * 2 / 2**20
    msg = str(e.value)
    assert f"needs {want_mib:.1f} MiB" in msg and "CUDA out of memory" in msg
    assert "--max-steers (now 64)" in msg and "--max-steer-rank (now 1024)" in msg


def test_the_engine_core_refuses_by_the_rank_the_workers_reserved_for_a_domain_component(
        tmp_path):
    """A ``--steer`` file of rank 8 whose domain component has rank 96 makes the workers
    reserve rank 96: the engine core, which checks run-time loads, holds the same limit, so a
    file like it loads at run time (and one of rank 97 is refused naming 96)."""
    from vllm_steer.integrations.engine import management
    from vllm_steer.integrations.engine.state import engine_state

    start = _steer(tmp_path, "start", 8, 1, domain_rank=96)
    cfg = {"steers": {"start": start}, "max_steers": 3, "enable_updates": True}
    model = SimpleNamespace(model="m", architectures=["LlamaForCausalLM"],
                            get_hidden_size=lambda: HIDDEN)
    core = engine_core(
        vllm_config=SimpleNamespace(additional_config={"vllm_steer": cfg}, model_config=model),
        model_executor=SimpleNamespace(collective_rpc=lambda fn, args=(): [True]),
        scheduler=SimpleNamespace(requests={}))
    rt = SteerRuntime(SteerServerConfig(steers={"start": start}, backend="torch", max_steers=3))
    rt.bank_state.load(HIDDEN, torch.device("cpu"), torch.float32)
    assert rt.bank_state.bank.reserved_rank == 96
    assert engine_state(core).reserved_rank == 96
    ok = management.load_steer_file(core, "alike", _steer(tmp_path, "alike", 8, 2, 96), "api")
    assert ok["ok"] is True, ok
    out = management.load_steer_file(core, "over", _steer(tmp_path, "over", 8, 3, 97), "api")
    assert out["ok"] is False and out["status"] == 400, out
    assert "domain rank 97, over --max-steer-rank=96" in out["error"]


def test_a_vector_bank_the_device_cannot_hold_is_refused_at_start_up(tmp_path, monkeypatch):
    """The vector bank (``--steer-vectors``) is allocated when the model is loaded, like the
    steer bank: one the device cannot hold is refused with its figure and the flags that size
    it, not a bare CUDA out-of-memory error (a pipeline stage without the LM head allocates
    nothing else of the plugin's)."""
    from vllm_steer.integrations.worker import decoder_layers, runtime

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 18.00 GiB")

    monkeypatch.setattr(runtime, "LayerVectors", out_of_memory)
    monkeypatch.setattr(decoder_layers, "local_blocks", lambda model, n: list(range(n // 2)))
    rt = SteerRuntime(SteerServerConfig(steer_vectors=True, max_steers=65536))
    with pytest.raises(RuntimeError) as e:
        rt.install_layers(torch.nn.Module(), 32, 4096, 8192, torch.device("cpu"),
                          torch.bfloat16)
    want_mib = 4 * 65536 * (16 * 4096 + 8192) / 2**20  # fp32 off CUDA
    msg = str(e.value)
    assert f"vector bank needs {want_mib:.1f} MiB" in msg and "CUDA out of memory" in msg
    assert "65536 max steers x (16 blocks x hidden 4096 + 8192 step tokens) x float32" in msg
    assert "--max-steers (now 65536)" in msg and "--max-num-batched-tokens (now 8192)" in msg


def test_a_bank_the_device_cannot_hold_is_refused_with_the_flags_that_size_it(tmp_path,
                                                                              monkeypatch):
    """The bank is allocated with the weights, before vLLM sizes the KV cache: a bank the
    device cannot hold names its figure and the flags that shrink it, and does not send the
    user to --gpu-memory-utilization, which changes nothing at that point."""
    from vllm_steer.integrations.worker import bank_state as bank_state_mod

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")

    monkeypatch.setattr(bank_state_mod, "SlotBank", out_of_memory)
    rt = SteerRuntime(SteerServerConfig(steers={"a": _steer(tmp_path, "a", 4, 1)},
                                        max_steers=4096, max_steer_rank=256))
    with pytest.raises(RuntimeError) as e:
        rt.bank_state.load(HIDDEN, torch.device("cpu"), torch.bfloat16)
    msg = str(e.value)
    assert "4096 max steers x rank 256 x hidden 48 x bfloat16" in msg
    assert "--max-steers (now 4096)" in msg and "--max-steer-rank (now 256)" in msg
    assert "CUDA out of memory" in msg and "--tensor-parallel-size" in msg
    assert "--gpu-memory-utilization does not change it" in msg
