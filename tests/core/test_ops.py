"""The one dispatch point ``vllm_steer.ops``: backends, ``auto``, the environment override and
the errors a user sees. Needs only torch (no vLLM)."""

from __future__ import annotations

import pytest
import torch

from vllm_steer import ops
from vllm_steer.ops import ENV_BACKEND, apply_steers, resolve_backend
from vllm_steer.reference import steer_reference

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def _no_env_override(monkeypatch):
    monkeypatch.delenv(ENV_BACKEND, raising=False)


def inputs(rows=6, d=32, ranks=(8, 32), seed=0):
    gen = torch.Generator().manual_seed(seed)
    offs = [0]
    for r in ranks:
        offs.append(offs[-1] + r)
    hidden = torch.randn(rows, d, generator=gen)
    p1 = torch.randn(d, offs[-1], generator=gen) / d ** 0.5
    p2 = torch.randn(d, offs[-1], generator=gen) / 4
    coefs = torch.randn(rows, len(ranks), generator=gen)
    coefs[0] = 0
    coefs[1, 0] = 0
    return hidden, p1, p2, offs, coefs


def test_auto_picks_torch_on_cpu_and_triton_on_cuda():
    from vllm_steer.kernels import HAS_TRITON

    assert resolve_backend(None, CPU) == "torch"
    assert resolve_backend("auto", CPU) == "torch"
    # Only the device type matters for the choice: no GPU needed to check it.
    assert resolve_backend(None, torch.device("cuda")) == ("triton" if HAS_TRITON else "torch")


def test_auto_on_cuda_picks_by_hidden_size_and_rank(monkeypatch):
    """The rule of ops.AUTO_CUDA (measured on H100/H200, benchmarks/RESULTS.md "Kernels"); only
    the device type and the two facts matter, so no GPU is needed to check it."""
    from vllm_steer.kernels import HAS_TRITON

    if not HAS_TRITON:
        pytest.skip("triton is not installed: auto is torch everywhere")
    monkeypatch.delenv("VLLM_BATCH_INVARIANT", raising=False)
    cuda = torch.device("cuda")
    # high rank at d >= 2048: cuBLAS (H100, d 4096 full rank: torch 539 us vs Triton 881 us)
    assert resolve_backend("auto", cuda, hidden=4096, max_rank=4096) == "torch"
    assert resolve_backend(None, cuda, hidden=2048, max_rank=2048) == "torch"
    assert resolve_backend(None, cuda, hidden=8192, max_rank=8192) == "torch"
    # low rank, or a small model: the fused kernel (H100 rank 64: 34.5 us vs 155 us)
    assert resolve_backend(None, cuda, hidden=4096, max_rank=512) == "triton"
    # rank 1024: the fused kernel (H200, planned: d 2048 83.8 us vs 119 us; d 8192 191 vs 224)
    assert resolve_backend(None, cuda, hidden=2048, max_rank=1024) == "triton"
    assert resolve_backend(None, cuda, hidden=8192, max_rank=1024) == "triton"
    assert resolve_backend(None, cuda, hidden=576, max_rank=576) == "triton"
    assert resolve_backend(None, cuda, hidden=1024, max_rank=1024) == "triton"
    # calls without the facts keep their old answer; explicit choices win
    assert resolve_backend(None, cuda) == "triton"
    assert resolve_backend("triton", cuda, hidden=4096, max_rank=4096) == "triton"
    monkeypatch.setenv(ENV_BACKEND, "triton")
    assert resolve_backend(None, cuda, hidden=4096, max_rank=4096) == "triton"
    monkeypatch.delenv(ENV_BACKEND)
    # batch-invariant mode: only the Triton kernel is invariant by construction
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    assert resolve_backend(None, cuda, hidden=4096, max_rank=4096) == "triton"
    # other devices: torch, whatever the bank
    assert resolve_backend(None, CPU, hidden=576, max_rank=16) == "torch"


def test_apply_and_prepare_give_auto_the_bank_facts(monkeypatch):
    seen = []
    real = ops.resolve_backend

    def spy(backend, device, hidden=None, max_rank=None):
        seen.append((hidden, max_rank))
        return real(backend, device, hidden, max_rank)

    monkeypatch.setattr(ops, "resolve_backend", spy)
    hidden, p1, p2, offs, coefs = inputs(d=32, ranks=(8, 24))
    ops.prepare_steers(p1, p2, offs, coefs)
    apply_steers(hidden, p1, p2, offs, coefs)
    ops.warm_up(None, p1, p2, offs, 4, torch.float32)
    assert seen == [(32, 24)] * 3


def test_kernels_register_both_backends():
    from vllm_steer import kernels

    assert ops._REGISTRY["torch"] is kernels.steer_torch
    if kernels.HAS_TRITON:
        assert ops._REGISTRY["triton"] is kernels.steer_triton
    else:
        assert "triton" not in ops._REGISTRY


@pytest.mark.parametrize("backend", ["reference", "torch", "auto", None])
def test_apply_steers_matches_reference(backend):
    hidden, p1, p2, offs, coefs = inputs()
    out = apply_steers(hidden, p1, p2, offs, coefs, backend=backend)
    ref = steer_reference(hidden, p1, p2, offs, coefs)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(out[0], hidden[0])
    assert not torch.equal(out[2], hidden[2])


def test_env_var_overrides_auto(monkeypatch):
    calls = []
    hidden, p1, p2, offs, coefs = inputs()

    def spy(*args):
        calls.append(args)
        return steer_reference(*args)

    monkeypatch.setitem(ops._REGISTRY, "reference", spy)
    monkeypatch.setenv(ENV_BACKEND, "reference")
    assert resolve_backend(None, CPU) == "reference"
    apply_steers(hidden, p1, p2, offs, coefs)
    assert len(calls) == 1
    # An explicit argument wins over the environment.
    assert resolve_backend("torch", CPU) == "torch"
    apply_steers(hidden, p1, p2, offs, coefs, backend="torch")
    assert len(calls) == 1


def test_unknown_backend_is_a_clear_error(monkeypatch):
    hidden, p1, p2, offs, coefs = inputs()
    with pytest.raises(ValueError, match=r"unknown steer backend 'cutlass'.*choose one of"):
        apply_steers(hidden, p1, p2, offs, coefs, backend="cutlass")
    monkeypatch.setenv(ENV_BACKEND, "fast")
    with pytest.raises(ValueError, match=r"unknown steer backend 'fast'.*VLLM_STEER_BACKEND"):
        apply_steers(hidden, p1, p2, offs, coefs)


def test_unregistered_backend_is_a_clear_error(monkeypatch):
    monkeypatch.delitem(ops._REGISTRY, "triton", raising=False)
    monkeypatch.setattr(ops, "_load_kernels", lambda: None)  # as if triton did not import
    with pytest.raises(ValueError, match=r"'triton' is not available here \(registered: "):
        resolve_backend("triton", CPU)
    # auto falls back to the torch path when triton is missing, even for CUDA tensors
    assert resolve_backend("auto", torch.device("cuda")) == "torch"


def test_triton_on_cpu_tensors_without_interpreter_says_what_to_do():
    from vllm_steer.kernels import HAS_TRITON

    if not HAS_TRITON:
        pytest.skip("triton is not installed")
    from vllm_steer.kernels.triton.launch import _interpreting

    hidden, p1, p2, offs, coefs = inputs()
    if _interpreting():
        out = apply_steers(hidden, p1, p2, offs, coefs, backend="triton")
        torch.testing.assert_close(out, steer_reference(hidden, p1, p2, offs, coefs),
                                   rtol=1e-5, atol=1e-4)
    else:
        with pytest.raises(RuntimeError, match="needs CUDA tensors.*TRITON_INTERPRET=1.*torch"):
            apply_steers(hidden, p1, p2, offs, coefs, backend="triton")


@pytest.mark.parametrize("backend", ["reference", "torch"])
def test_prepared_steers_match_unprepared(backend):
    # backends with a planner (torch) reuse the plan; those without (reference) ignore it
    hidden, p1, p2, offs, coefs = inputs(rows=9)
    prepared = ops.prepare_steers(p1, p2, offs, coefs, backend=backend)
    assert prepared.backend == backend and (prepared.plan is None) == (backend == "reference")
    out = apply_steers(hidden, p1, p2, offs, coefs, backend=backend, prepared=prepared)
    torch.testing.assert_close(out, steer_reference(hidden, p1, p2, offs, coefs),
                               rtol=1e-5, atol=1e-5)


def test_plan_of_one_backend_is_not_run_by_another():
    hidden, p1, p2, offs, coefs = inputs()
    prepared = ops.prepare_steers(p1, p2, offs, coefs, backend="torch")
    with pytest.raises(AssertionError, match="plan made for backend 'torch'"):
        apply_steers(hidden, p1, p2, offs, coefs, backend="reference", prepared=prepared)
