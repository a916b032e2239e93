"""What a serving run needs of the Triton steer kernel besides its values: no compile after
start-up (``warm_up``), rows whose results do not depend on their batch in vLLM's
batch-invariant mode, and a clear refusal to run inside a CUDA graph capture.

Needs only torch and triton (no vLLM, no GPU). The compile checks replace the kernels by
recorders that log what Triton would compile for each launch and launch nothing, so they run
with or without ``TRITON_INTERPRET``; on a GPU ``scripts/gpu_window.sh`` counts the real
Triton cache entries. The other checks launch the kernels on ``VLLM_STEER_TEST_DEVICE``
(default cpu: Triton's interpreter, ``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import inspect
import os
from collections import Counter

import pytest
import torch

from vllm_steer import ops
from vllm_steer.kernels import HAS_TRITON

needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
DEVICE = torch.device(os.environ.get("VLLM_STEER_TEST_DEVICE", "cpu"))


def triton_device() -> torch.device:
    """DEVICE, where the Triton kernels can run there (else the test is skipped)."""
    if not HAS_TRITON:
        pytest.skip("triton is not installed")
    from vllm_steer.kernels.triton.launch import _interpreting

    if DEVICE.type == "cuda" and not torch.cuda.is_available():
        pytest.skip("VLLM_STEER_TEST_DEVICE=cuda but CUDA is not available")
    if DEVICE.type == "cpu" and not _interpreting():
        pytest.skip("Triton on CPU needs TRITON_INTERPRET=1 set before import")
    return DEVICE


class Recorder:
    """Stands in for a Triton kernel: logs the key Triton compiles a binary for (the constexpr
    values and launch options; for each integer argument it specialises, whether it is 1 and
    whether it is a multiple of 16; for each tensor, whether its address is 16-byte aligned)
    and launches nothing."""

    def __init__(self, name: str, kernel, log: list):
        self.name, self.log = name, log
        self.arg_names = list(inspect.signature(kernel.fn).parameters)
        if hasattr(kernel, "params"):  # a JITFunction
            dns = [p.name for p in kernel.params if p.do_not_specialize]
        else:  # the interpreter's InterpretedFunction keeps the jit arguments
            dns = kernel.kwargs.get("do_not_specialize") or []
        self.unspecialized = {self.arg_names[i] if isinstance(i, int) else i for i in dns}

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            named = list(zip(self.arg_names, args, strict=False))
            ints = tuple((n, a == 1, a % 16 == 0) for n, a in named
                         if isinstance(a, int) and n not in self.unspecialized)
            ptrs = tuple((n, a.data_ptr() % 16 == 0) for n, a in named
                         if isinstance(a, torch.Tensor))
            self.log.append((self.name, ints + ptrs, tuple(sorted(kwargs.items()))))
        return launch


@pytest.fixture
def recorded(monkeypatch):
    """The kernels replaced by recorders; the tiles chosen for a 132-SM GPU (H100, H200), where
    they vary with the row count (the interpreter's one 'SM' would hide that)."""
    from vllm_steer.kernels.triton import jit, launch, tiling

    # each name where every caller looks it up at call time: launch._interpreting (launch,
    # warmup), tiling._num_sms (plan, warmup), the kernels in jit (segments, launch)
    log: list = []
    monkeypatch.setattr(launch, "_interpreting", lambda: True)  # CPU tensors accepted; no run
    monkeypatch.setattr(tiling, "_num_sms", lambda device: 132)
    for name in ("segments", "shrink", "expand"):
        attr = f"_steer_{name}_kernel"
        monkeypatch.setattr(jit, attr, Recorder(name, getattr(jit, attr), log))
    return log


def bank(d: int, ranks: list[int], dtype=torch.bfloat16):
    offs = [0]
    for r in ranks:
        offs.append(offs[-1] + r)
    gen = torch.Generator().manual_seed(d)
    p1 = torch.randn(d, offs[-1], generator=gen).to(dtype)
    p2 = torch.randn(d, offs[-1], generator=gen).to(dtype)
    return p1, p2, offs


def coefs_for(rows: int, K: int) -> torch.Tensor:
    co = torch.zeros(rows, K)
    co[torch.arange(rows), torch.arange(rows) % K] = 0.5  # row r on steer r % K
    co[::3] = 0.0  # and some unsteered rows
    return co


# The shapes of the H200 probe (7 and 13 first-call compiles over rows 1..256, in the middle of
# serving). Expected now: the distinct compiled kernels over rows 1..256, every one warmed at
# start-up: 3 + 3 and 3 + 4 (shrink + expand), plus 5 of the segments kernel (CHUNK 16..256;
# it runs only for calls planned without host coefficients).
PROBE_SHAPES = {"d576-r16": (576, [16], 11), "d4096-r16-16-64": (4096, [16, 16, 64], 12)}


@needs_triton
@pytest.mark.parametrize("shape", list(PROBE_SHAPES))
def test_warm_up_leaves_nothing_to_compile_for_1_to_256_rows(recorded, shape):
    from vllm_steer.kernels.triton.launch import steer_triton
    from vllm_steer.kernels.triton.plan import prepare_triton
    from vllm_steer.kernels.triton.warmup import specializations

    d, ranks, expected = PROBE_SHAPES[shape]
    p1, p2, offs = bank(d, ranks)
    warmed_count = ops.warm_up("triton", p1, p2, offs, 256, torch.bfloat16)
    warmed = set(recorded)
    recorded.clear()
    for rows in range(1, 257):
        hidden, coefs = torch.zeros(rows, d, dtype=torch.bfloat16), coefs_for(rows, len(ranks))
        steer_triton(hidden, p1, p2, offs, coefs)  # planned per call: the segments kernel too
        plan = prepare_triton(p1, p2, offs, coefs, host=coefs.numpy())  # the serving path
        steer_triton(hidden, p1, p2, offs, coefs, prepared=plan)
    launched = set(recorded)
    assert launched <= warmed, f"compiled after warm_up: {sorted(launched - warmed)}"
    # the bound: at most one compiled kernel per kernel and power-of-two bucket of rows
    # (1, 2, 4, ..., 256: 9); these shapes need fewer, as the buckets share tiles
    per_kernel = Counter(name for name, _, _ in launched)
    assert max(per_kernel.values()) <= 9, per_kernel
    assert len(launched) == expected, sorted(launched)
    # specializations() names them exactly, and warm_up reports that many
    listed = specializations(256, d, offs, torch.bfloat16, torch.bfloat16, "cpu")
    assert {(s.kernel, s.params) for s in listed} == {(n, kw) for n, _, kw in launched}
    assert warmed_count == len(listed) == len(warmed)


@needs_triton
def test_the_row_count_is_never_a_compile_time_fact(recorded):
    """Rows of one bucket (here 33..64) launch the same kernels: the row count is neither a
    tile input (only its bucket is) nor specialised by Triton (1, multiple of 16)."""
    from vllm_steer.kernels.triton.launch import steer_triton

    p1, p2, offs = bank(4096, [16, 16, 64])
    keys = set()
    for rows in range(33, 65):
        recorded.clear()
        steer_triton(torch.zeros(rows, 4096, dtype=torch.bfloat16), p1, p2, offs,
                     coefs_for(rows, 3))
        keys.add(tuple(recorded))
    assert len(keys) == 1, f"{len(keys)} different kernel sets for rows 33..64"


def test_warm_up_runs_the_kernels_and_torch_warms_nothing():
    """The real launches (under the interpreter on CPU): warm_up returns the number it
    compiled, and leaves the kernels' results unchanged."""
    from vllm_steer.kernels.triton.warmup import specializations
    from vllm_steer.reference import steer_reference

    dev = triton_device()
    p1, p2, offs = bank(64, [16, 0, 32], torch.float32)
    p1, p2 = p1.to(dev), p2.to(dev)
    n = ops.warm_up("triton", p1, p2, offs, 5, torch.float32)
    assert n == len(specializations(5, 64, offs, torch.float32, torch.float32, dev)) >= 3
    assert ops.warm_up("torch", p1, p2, offs, 5, torch.float32) == 0
    hidden = torch.randn(5, 64, device=dev)
    coefs = coefs_for(5, 3).to(dev)
    torch.testing.assert_close(ops.apply_steers(hidden, p1, p2, offs, coefs, backend="triton"),
                               steer_reference(hidden, p1, p2, offs, coefs),
                               rtol=1e-5, atol=1e-4)


# ---- batch-invariant mode (VLLM_BATCH_INVARIANT=1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batch_invariant_mode_rows_do_not_depend_on_the_batch(monkeypatch, dtype):
    """A row's output is bit for bit the same at 1, 7, 64 and 256 rows. The shape is one where,
    on a 16-SM GPU, the tiles otherwise change with the batch (the shrink split along hidden,
    with atomics, up to 64 rows; not at 256), which changes last bits in fp32 and bf16."""
    from vllm_steer.kernels.triton import tiling
    from vllm_steer.kernels.triton.launch import steer_triton
    from vllm_steer.reference import steer_reference

    dev = triton_device()
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    monkeypatch.setattr(tiling, "_num_sms", lambda device: 16)  # looked up there by the plan
    d, rank = 512, 64
    gen = torch.Generator().manual_seed(11)
    p1 = (torch.randn(d, rank, generator=gen) / d ** 0.5).to(dev, dtype)
    p2 = (torch.randn(d, rank, generator=gen) / rank ** 0.5).to(dev, dtype)
    hidden = torch.randn(256, d, generator=gen).to(dev, dtype)
    coefs = torch.randn(256, 1, generator=gen).to(dev)
    outs = {n: steer_triton(hidden[:n], p1, p2, [0, rank], coefs[:n].contiguous())
            for n in (1, 7, 64, 256)}
    for small, big in [(1, 7), (7, 64), (64, 256)]:
        diff = (outs[small].float() - outs[big][:small].float()).abs().max().item()
        assert torch.equal(outs[small], outs[big][:small]), \
            f"the first {small} rows differ between batches of {small} and {big} rows ({diff:.3g})"
    ref = steer_reference(hidden, p1, p2, [0, rank], coefs)
    tol = 1e-4 if dtype == torch.float32 else 2 ** -7
    torch.testing.assert_close(outs[256].float(), ref.float(), rtol=tol, atol=tol * 4)


def test_batch_invariant_tiles_ignore_the_row_count(monkeypatch):
    if not HAS_TRITON:
        pytest.skip("triton is not installed")
    from vllm_steer.kernels.triton.tiling import choose_tiles

    offs = [0, 16, 16, 80]
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    tiles = {choose_tiles(rows, 4096, offs, num_sms=132) for rows in range(1, 513)}
    assert len(tiles) == 1 and tiles.pop().split_d == 1  # no atomics
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "0")
    assert len({choose_tiles(rows, 4096, offs, num_sms=132) for rows in range(1, 513)}) > 1


def test_batch_invariant_mode_refuses_atomics_and_bad_values(monkeypatch):
    if not HAS_TRITON:
        pytest.skip("triton is not installed")
    from vllm_steer.kernels import batch_invariant
    from vllm_steer.kernels.triton.plan import prepare_triton
    from vllm_steer.kernels.triton.tiling import ENV_TILES

    p1, p2, offs = bank(64, [16], torch.float32)
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    monkeypatch.setenv(ENV_TILES, "split_d=2")
    with pytest.raises(ValueError,
                       match=r"split_d=2 adds partial sums with atomics.*use split_d=1"):
        prepare_triton(p1, p2, offs, torch.ones(3, 1))
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "yes")
    with pytest.raises(ValueError, match=r"VLLM_BATCH_INVARIANT='yes' is not an integer.*1 \(on\)"):
        batch_invariant()


# ---- CUDA graph capture


def test_capture_guard_says_steering_runs_outside_cuda_graphs(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(RuntimeError, match=r"while a CUDA graph is being captured on cuda:0; "
                       r"steering runs outside CUDA graphs.*--compilation-config "
                       r"'\{\"cudagraph_mode\": \"PIECEWISE\"\}'.*--enforce-eager"):
        ops.check_not_capturing(torch.device("cuda", 0))

    def no_cuda_query():
        raise AssertionError("the guard queried CUDA for a CPU tensor")

    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", no_cuda_query)
    ops.check_not_capturing(torch.device("cpu"))  # one comparison, no CUDA call


def test_every_steer_entry_point_runs_the_capture_guard(monkeypatch):
    """apply_steers, prepare_steers and every public kernel wrapper refuse to run while a graph
    is captured: the serving path calls the wrappers directly, not apply_steers."""
    from vllm_steer.kernels import staging, torch_steer

    seen = []

    def capturing(device):
        seen.append(device)
        raise RuntimeError(f"capturing on {device}")

    monkeypatch.setattr(staging, "check_not_capturing", capturing)
    p1, p2, offs = bank(32, [8, 8], torch.float32)
    hidden, coefs = torch.randn(3, 32), coefs_for(3, 2)
    calls = {
        "apply_steers(reference)": lambda: ops.apply_steers(hidden, p1, p2, offs, coefs,
                                                            backend="reference"),
        "apply_steers(torch)": lambda: ops.apply_steers(hidden, p1, p2, offs, coefs,
                                                        backend="torch"),
        "prepare_steers": lambda: ops.prepare_steers(p1, p2, offs, coefs, backend="torch"),
        "steer_torch": lambda: torch_steer.steer_torch(hidden, p1, p2, offs, coefs),
        "prepare_torch": lambda: torch_steer.prepare_torch(p1, p2, offs, coefs),
    }
    if HAS_TRITON:
        from vllm_steer.kernels.triton.launch import steer_triton
        from vllm_steer.kernels.triton.plan import prepare_triton

        calls["steer_triton"] = lambda: steer_triton(hidden, p1, p2, offs, coefs)
        calls["prepare_triton"] = lambda: prepare_triton(p1, p2, offs, coefs)
    for _name, call in calls.items():
        with pytest.raises(RuntimeError, match="capturing on cpu"):
            call()
    assert len(seen) == len(calls)
