"""The batched steer kernels (``vllm_steer.kernels``) against the reference.

Needs only torch (+ triton for the Triton cases): imports vllm_steer.reference / ops / kernels,
never vLLM. Device: ``VLLM_STEER_TEST_DEVICE`` (default ``cpu``; ``scripts/gpu_check.sh`` sets
``cuda``). On CPU the Triton kernel runs in Triton's interpreter, i.e. only when
``TRITON_INTERPRET=1`` was set before triton was imported (``make test`` does); the interpreter
is slow, so its cases are small.
"""

from __future__ import annotations

import os

import pytest
import torch

from vllm_steer.kernels import HAS_TRITON, steer_torch
from vllm_steer.kernels.torch_steer import STRATEGIES, choose_strategy
from vllm_steer.reference import steer_reference

DEVICE = torch.device(os.environ.get("VLLM_STEER_TEST_DEVICE", "cpu"))
if DEVICE.type == "cuda" and not torch.cuda.is_available():
    pytest.skip(f"VLLM_STEER_TEST_DEVICE={DEVICE} but CUDA is not available",
                allow_module_level=True)


def _triton_usable() -> str | None:
    """None when the Triton kernel can run on DEVICE, else why not."""
    if not HAS_TRITON:
        return "triton is not installed"
    from vllm_steer.kernels.triton.launch import _interpreting

    if DEVICE.type == "cpu" and not _interpreting():
        return "Triton on CPU needs TRITON_INTERPRET=1 set before import (make test sets it)"
    return None


TRITON_SKIP = _triton_usable()


def run_triton(*args, **kw):
    if TRITON_SKIP:
        pytest.skip(TRITON_SKIP)
    from vllm_steer.kernels import steer_triton

    return steer_triton(*args, **kw)


BACKENDS = {"torch": steer_torch, "triton": run_triton}

# (activation dtype, factor dtype) -> (rtol, atol as a fraction of the output's max |value|).
# 16-bit outputs: the kernel and the reference both round an fp32 result, so they may differ by
# one unit in the last place (2^-7 relative for bf16, 2^-10 for fp16). fp32: summation order,
# and on tensor cores tf32x3 (~2^-21 per product) or, against bf16 factors, the fp32 operand
# split into two bf16 halves (~2^-17 per product).
TOL = {
    (torch.float32, torch.float32): (1e-5, 3e-5),
    (torch.float32, torch.bfloat16): (1e-5, 1e-4),
    (torch.bfloat16, torch.bfloat16): (2 ** -7, 2 ** -9),
    (torch.bfloat16, torch.float32): (2 ** -7, 2 ** -9),
    (torch.float16, torch.float16): (2 ** -10, 2 ** -12),
}


def offsets(ranks):
    offs = [0]
    for r in ranks:
        offs.append(offs[-1] + r)
    return offs


def make_coefs(rows: int, K: int, pattern: str, gen: torch.Generator) -> torch.Tensor:
    """Coefficients [rows, K] fp32 with a named sparsity pattern (row 0 always unsteered
    except in "dense")."""
    size = 0.3 + torch.rand(rows, K, generator=gen)
    sign = torch.where(torch.rand(rows, K, generator=gen) < 0.5, -1.0, 1.0)
    co = size * sign
    if pattern == "all_zero":
        return torch.zeros(rows, K)
    if pattern == "dense":  # every row uses every steer
        return co
    if pattern == "negative":
        co = -size
    if pattern == "one_per_row":  # row r uses steer r % K only
        keep = torch.zeros(rows, K, dtype=torch.bool)
        keep[torch.arange(rows), torch.arange(rows) % K] = True
    elif pattern in ("mixed", "negative"):  # ~40% of entries, some rows none
        keep = torch.rand(rows, K, generator=gen) < 0.4
    else:
        raise ValueError(pattern)
    co = co * keep
    co[0] = 0.0
    return co


def make_inputs(rows, d, ranks, pattern, act_dtype, fac_dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    offs = offsets(ranks)
    hidden = torch.randn(rows, d, generator=gen)
    # P1 ~ 1/sqrt(d), P2 ~ 1/sqrt(rank): the steer's delta is about as large as c itself, so an
    # error in the delta shows in the output.
    p1 = torch.randn(d, offs[-1], generator=gen) / d ** 0.5
    p2 = torch.cat([torch.randn(d, r, generator=gen) / max(r, 1) ** 0.5 for r in ranks], dim=1)
    coefs = make_coefs(rows, len(ranks), pattern, gen)
    to = lambda t, dt: t.to(device=DEVICE, dtype=dt).contiguous()  # noqa: E731
    return (to(hidden, act_dtype), to(p1, fac_dtype), to(p2, fac_dtype), offs,
            coefs.to(DEVICE).contiguous())


def check(out, hidden, p1, p2, offs, coefs):
    """What a user would check: the values, every element written, unsteered rows untouched."""
    ref = steer_reference(hidden, p1, p2, offs, coefs)
    assert out.shape == ref.shape and out.dtype == hidden.dtype
    assert not torch.isnan(out).any(), "some output elements were not written (NaN sentinel)"
    rtol, atol = TOL[(hidden.dtype, p1.dtype)]
    scale = ref.float().abs().max().item() or 1.0
    err = (out.float() - ref.float()).abs()
    bound = atol * scale + rtol * ref.float().abs()
    worst = (err - bound).argmax()
    assert (err <= bound).all(), (
        f"max error {err.max().item():.3g} (bound at worst element {bound.flatten()[worst]:.3g}, "
        f"out {out.flatten()[worst].item():.6g} vs reference {ref.flatten()[worst].item():.6g})")
    zero = (coefs == 0).all(dim=1)
    assert torch.equal(out[zero], hidden[zero]), "unsteered rows must be bit-identical"


def run_case(backend, rows, d, ranks, pattern, act_dtype, fac_dtype, seed=0):
    hidden, p1, p2, offs, coefs = make_inputs(rows, d, ranks, pattern, act_dtype, fac_dtype, seed)
    before = hidden.clone()
    out = torch.full_like(hidden, float("nan"))
    res = BACKENDS[backend](hidden, p1, p2, offs, coefs, out=out)
    assert res is out
    assert torch.equal(hidden, before), "the input must not be modified"
    check(out, hidden, p1, p2, offs, coefs)
    return out


# Small cases (the Triton interpreter runs them too): odd sizes, several K, ranks and patterns.
SMALL = [
    # rows, hidden, ranks, pattern, activation dtype, factor dtype
    (1, 64, [64], "dense", torch.float32, torch.float32),  # one row, full rank, K=1
    (3, 64, [64, 64], "one_per_row", torch.float32, torch.float32),  # row 0 unsteered
    (37, 96, [3, 96, 17], "mixed", torch.bfloat16, torch.bfloat16),
    (70, 80, [80, 5], "one_per_row", torch.float16, torch.float16),
    (20, 64, [8, 8, 8, 8], "negative", torch.float32, torch.bfloat16),
    (9, 128, [16, 128], "dense", torch.bfloat16, torch.float32),
    (33, 72, [1, 0, 7, 72, 13, 30], "one_per_row", torch.bfloat16, torch.bfloat16),
    (300, 64, [64, 32], "mixed", torch.float32, torch.float32),  # rows ~300
    (17, 576, [64], "mixed", torch.bfloat16, torch.bfloat16),  # the served model's hidden
    (12, 64, [64, 64, 64], "all_zero", torch.float32, torch.float32),
]
IDS = [f"r{c[0]}-d{c[1]}-K{len(c[2])}-{c[3]}-{str(c[4])[6:]}-{str(c[5])[6:]}" for c in SMALL]


@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize("case", SMALL, ids=IDS)
def test_matches_reference_small(backend, case):
    run_case(backend, *case)


# Real sizes for the torch path (and the Triton kernel on CUDA; too slow for the interpreter).
LARGE = [
    (256, 576, [576] * 8, "one_per_row", torch.float32, torch.float32),
    (96, 576, [576] * 8, "mixed", torch.bfloat16, torch.bfloat16),
    (128, 576, [64] * 16, "dense", torch.float32, torch.float32),
    (200, 1000, [1000, 64, 333], "mixed", torch.float16, torch.float16),
]


@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize("case", LARGE, ids=[f"r{c[0]}-d{c[1]}-K{len(c[2])}-{c[3]}-"
                                             f"{str(c[4])[6:]}" for c in LARGE])
def test_matches_reference_large(backend, case):
    if backend == "triton" and DEVICE.type != "cuda":
        pytest.skip("large Triton cases run on CUDA only (the interpreter is too slow)")
    run_case(backend, *case)


# a zero-rank steer that rows use; all ranks distinct; steers sharing ranks (bmm stacks them)
RANKS = {"distinct": [96, 0, 8, 40], "shared": [8, 40, 8, 0, 8, 40, 96]}


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("pattern", ["one_per_row", "mixed", "dense", "all_zero"])
@pytest.mark.parametrize("ranks", list(RANKS))
def test_torch_strategies_agree(strategy, pattern, ranks):
    hidden, p1, p2, offs, coefs = make_inputs(45, 96, RANKS[ranks], pattern,
                                              torch.float32, torch.float32, seed=3)
    out = steer_torch(hidden, p1, p2, offs, coefs, strategy=strategy)
    check(out, hidden, p1, p2, offs, coefs)


def test_bmm_padding_leaves_other_rows_alone():
    # 3 rows on steer 0, 1 row on steer 1 (same rank): steer 1's group is padded with two
    # dummy entries; a huge unsteered-by-it row must not leak into anything
    hidden, p1, p2, offs, coefs = make_inputs(6, 64, [16, 16], "mixed", torch.float32,
                                              torch.float32, seed=7)
    coefs.zero_()
    coefs[1:4, 0] = 2.0
    coefs[4, 1] = -1.5
    hidden[5] = 1e30  # unsteered
    hidden[1] *= 1e3  # steered, by steer 0 only
    out = steer_torch(hidden, p1, p2, offs, coefs, strategy="bmm")
    check(out, hidden, p1, p2, offs, coefs)
    assert torch.isfinite(out[:5]).all()


def test_torch_strategy_choice_follows_sparsity():
    offs = offsets([64] * 8)
    one_each = torch.zeros(64, 8)
    one_each[torch.arange(64), torch.arange(64) % 8] = 1.0
    strategy, rows, steers, _ = choose_strategy(one_each != 0, offs, 576)
    assert (strategy, rows, steers) == ("bmm", None, list(range(8)))  # None: all rows
    # planned for one call, stacking the factors would not pay off
    assert choose_strategy(one_each != 0, offs, 576, reuse=False)[0] == "gather"
    # one steer takes most rows: padding every group to its size would cost more
    skewed = torch.zeros(512, 8)
    skewed[:, 0] = 1.0
    skewed[torch.arange(7) * 73, torch.arange(1, 8)] = 1.0
    skewed[torch.arange(7) * 73, 0] = 0.0
    assert choose_strategy(skewed != 0, offs, 576)[0] == "gather"
    # each row on one steer of eight, all of different ranks: nothing to stack
    mixed_ranks = offsets([8, 16, 24, 32, 40, 48, 56, 64])
    assert choose_strategy(one_each != 0, mixed_ranks, 576)[0] == "gather"
    strategy, rows, steers, _ = choose_strategy(torch.ones(64, 8, dtype=torch.bool), offs, 576)
    assert strategy == "concat"
    half = one_each.clone()
    half[32:] = 0
    half[:, 5] = 0
    strategy, rows, steers, _ = choose_strategy(half != 0, offs, 576)
    assert rows.tolist() == [r for r in range(32) if r % 8 != 5]
    assert steers == [0, 1, 2, 3, 4, 6, 7]


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_rank_offsets_as_list_tuple_or_tensor(backend):
    hidden, p1, p2, offs, coefs = make_inputs(10, 64, [16, 48], "mixed",
                                              torch.float32, torch.float32, seed=4)
    outs = [BACKENDS[backend](hidden, p1, p2, o, coefs)
            for o in (offs, tuple(offs), torch.tensor(offs))]
    check(outs[0], hidden, p1, p2, offs, coefs)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_edge_shapes(backend):
    fn = BACKENDS[backend]
    hidden, p1, p2, offs, coefs = make_inputs(5, 64, [32], "mixed", torch.float32, torch.float32)
    empty = fn(hidden[:0], p1, p2, offs, coefs[:0])
    assert empty.shape == (0, 64)
    no_steers = fn(hidden, p1[:, :0], p2[:, :0], [0], coefs[:, :0].contiguous())
    assert torch.equal(no_steers, hidden)
    zero_rank = fn(hidden, p1[:, :0], p2[:, :0], [0, 0], torch.ones(5, 1, device=DEVICE))
    assert torch.equal(zero_rank.float(), hidden.float())


def test_triton_strided_rows():
    """Rows of a wider buffer (unit stride along hidden, larger row stride)."""
    hidden, p1, p2, offs, coefs = make_inputs(13, 64, [64, 16], "mixed",
                                              torch.bfloat16, torch.bfloat16, seed=5)
    wide = torch.zeros(13, 100, dtype=hidden.dtype, device=DEVICE)
    wide[:, 10:74] = hidden
    view = wide[:, 10:74]
    assert not view.is_contiguous()
    out = run_triton(view, p1, p2, offs, coefs)
    check(out, hidden, p1, p2, offs, coefs)


def test_triton_segments_group_rows_by_steer():
    if TRITON_SKIP:
        pytest.skip(TRITON_SKIP)
    from vllm_steer.kernels.triton.segments import segments

    coefs = torch.tensor([[0.0, 1.0, 0.0],
                          [0.0, 0.0, 0.0],
                          [2.0, -1.0, 0.0],
                          [0.0, 3.0, 0.0],
                          [5.0, 0.0, 0.0]], device=DEVICE)
    seg_rows, seg_counts, perm = segments(coefs)
    assert seg_counts.tolist() == [2, 3, 0]
    assert seg_rows[0, :2].tolist() == [2, 4]
    assert seg_rows[1, :3].tolist() == [0, 2, 3]
    assert perm.tolist() == [2, 4, 0, 3, 1]  # by first steer, unsteered last


@pytest.mark.parametrize("rows,K", [(150, 40), (1, 1), (129, 3)])
def test_triton_segments_match_torch_sorting(rows, K):
    """Several chunks of rows (running offsets), K past a power of two, single row."""
    if TRITON_SKIP:
        pytest.skip(TRITON_SKIP)
    from vllm_steer.kernels.triton.segments import segments

    gen = torch.Generator().manual_seed(rows + K)
    coefs = torch.randn(rows, K, generator=gen) * (torch.rand(rows, K, generator=gen) < 0.05)
    coefs[: rows // 3] = 0
    seg_rows, seg_counts, perm = segments(coefs.to(DEVICE))
    nz = coefs != 0
    assert seg_counts.tolist() == nz.sum(dim=0).tolist()
    for k in range(K):
        assert seg_rows[k, : int(nz[:, k].sum())].tolist() == nz[:, k].nonzero().flatten().tolist()
    first = torch.where(nz.any(dim=1), nz.to(torch.uint8).argmax(dim=1), K)
    assert perm.tolist() == torch.argsort(first, stable=True).tolist()


@pytest.mark.parametrize("rows,K", [(1, 1), (5, 3), (37, 40)])
def test_triton_host_segments_match_the_device_kernel(rows, K):
    """The serving path plans from host coefficients (segments_host): the same tables as the
    segments kernel, each 16-byte aligned (else Triton compiles the kernels anew for them)."""
    if TRITON_SKIP:
        pytest.skip(TRITON_SKIP)
    from vllm_steer.kernels.triton.segments import segments, segments_host

    gen = torch.Generator().manual_seed(rows * K)
    coefs = torch.randn(rows, K, generator=gen) * (torch.rand(rows, K, generator=gen) < 0.3)
    dev_rows, dev_counts, dev_perm = segments(coefs.to(DEVICE))
    host_rows, host_counts, host_perm = segments_host(coefs.numpy() != 0, DEVICE)
    assert host_counts.tolist() == dev_counts.tolist()
    for k, n in enumerate(dev_counts.tolist()):
        assert host_rows[k, :n].tolist() == dev_rows[k, :n].tolist()
    assert host_perm.tolist() == dev_perm.tolist()
    for t in (host_rows, host_counts, host_perm):
        assert t.data_ptr() % 16 == 0


def test_triton_rejects_bad_input_clearly():
    hidden, p1, p2, offs, coefs = make_inputs(4, 64, [16], "mixed", torch.float32, torch.float32)
    with pytest.raises(AssertionError, match="coefs must be float32"):
        run_triton(hidden, p1, p2, offs, coefs.double())
    with pytest.raises(AssertionError, match="contiguous"):
        run_triton(hidden, p1.T.contiguous().T, p2, offs, coefs)


def test_triton_segments_and_replayable_op_check_dtypes_before_launching():
    """The two wrappers that launch without planning first (the segments, the replayable op)
    assert their operands' dtypes themselves."""
    if TRITON_SKIP:
        pytest.skip(TRITON_SKIP)
    from vllm_steer.kernels.triton.launch import steer_triton_replayable
    from vllm_steer.kernels.triton.plan import prepare_triton
    from vllm_steer.kernels.triton.segments import segments

    hidden, p1, p2, offs, coefs = make_inputs(4, 64, [16], "mixed", torch.float32, torch.float32)
    with pytest.raises(AssertionError, match="coefs must be float32"):
        segments(coefs.double())
    with pytest.raises(AssertionError, match="contiguous"):
        segments(torch.zeros(1, 4, device=DEVICE).expand(4, 4))
    plan = prepare_triton(p1, p2, offs, coefs)
    with pytest.raises(AssertionError, match="hidden dtype"):
        steer_triton_replayable(hidden.double(), p1, p2, offs, coefs, hidden.double(), plan)


@pytest.mark.parametrize("tiles", [
    dict(shrink_m=16, shrink_r=16, shrink_d=16, expand_m=16, expand_d=16, expand_r=16),
    dict(shrink_m=32, shrink_r=32, split_d=2, expand_m=32, expand_d=32, expand_r=32),
    dict(shrink_m=16, shrink_r=128, split_d=4, expand_m=64, expand_d=128),
], ids=["all16", "split2", "split4-wide"])
def test_triton_tile_variants(tiles):
    """Every tiling (and the hidden split with fp32 atomics) computes the same function."""
    from vllm_steer.kernels.triton.tiling import Tiles

    hidden, p1, p2, offs, coefs = make_inputs(13, 48, [48, 9, 20], "mixed",
                                              torch.bfloat16, torch.bfloat16, seed=6)
    out = run_triton(hidden, p1, p2, offs, coefs, out=torch.full_like(hidden, float("nan")),
                     tiles=Tiles(**tiles))
    check(out, hidden, p1, p2, offs, coefs)


def test_triton_tile_overrides_from_the_environment(monkeypatch):
    if not HAS_TRITON:
        pytest.skip("triton is not installed")
    from vllm_steer.kernels.triton.tiling import ENV_TILES, Tiles, _with_overrides

    monkeypatch.setenv(ENV_TILES, "expand_r=64, num_stages=2")
    assert _with_overrides(Tiles()) == Tiles(expand_r=64, num_stages=2)
    monkeypatch.setenv(ENV_TILES, "expand_q=64")
    with pytest.raises(ValueError, match="bad item 'expand_q=64'.*expand_r"):
        _with_overrides(Tiles())


def test_triton_tiles_follow_the_shape():
    if not HAS_TRITON:
        pytest.skip("triton is not installed")
    from vllm_steer.kernels.triton.tiling import choose_tiles

    decode = choose_tiles(1, 4096, [0, 64], num_sms=132)  # one row, one rank-64 steer
    assert decode.split_d > 1 and decode.shrink_r == 16 and decode.expand_d == 32
    big = choose_tiles(256, 4096, [4096 * k for k in range(9)], num_sms=132)
    assert big.split_d == 1 and big.shrink_r == 128 and big.expand_m == 64


def test_triton_no_host_sync_in_steady_state():
    """The decode hot path: after the first call (compilation, cached bank tables) a call
    issues no device-to-host synchronisation."""
    if DEVICE.type != "cuda":
        pytest.skip("host syncs exist on CUDA only")
    hidden, p1, p2, offs, coefs = make_inputs(64, 256, [64, 256, 32], "mixed",
                                              torch.bfloat16, torch.bfloat16, seed=7)
    run_triton(hidden, p1, p2, offs, coefs)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = run_triton(hidden, p1, p2, offs, coefs)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    check(out, hidden, p1, p2, offs, coefs)


def test_triton_kernels_compile_for_sm90_without_a_gpu():
    """Triton's real code generator (not the interpreter) lowers the kernels for Hopper: the
    check that catches type and layout errors the interpreter lets through."""
    if not HAS_TRITON:
        pytest.skip("triton is not installed")
    import subprocess
    import sys
    from pathlib import Path

    import triton

    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists():
        pytest.skip("this triton has no bundled ptxas")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-m", "vllm_steer.kernels.aot_check", "--quick"],
                         capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "shrink 32x128" in run.stdout and "FAILED" not in run.stdout


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("pattern", ["one_per_row", "mixed", "dense", "all_zero"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prepared_plan_reused_over_steps_gives_the_per_call_result(strategy, pattern, dtype):
    # The serving path plans once per change of the batch's steering and reuses the plan on
    # every decode step: each step (new hidden states, same coefficients) must equal a
    # freshly planned call, bit for bit on CPU. On CUDA the two plans hand cuBLAS differently
    # laid-out (copied vs viewed) fp32 factors, and cuBLAS picks its GEMM kernel, hence its
    # summation order, by layout and alignment: there they agree to fp32 rounding.
    from vllm_steer.kernels.torch_steer import prepare_torch

    _, p1, p2, offs, coefs = make_inputs(37, 96, RANKS["shared"], pattern, dtype, dtype, seed=5)
    plan = prepare_torch(p1, p2, offs, coefs, strategy)
    gen = torch.Generator().manual_seed(6)
    for _step in range(3):
        hidden = torch.randn(37, 96, generator=gen).to(DEVICE, dtype)
        out = steer_torch(hidden, p1, p2, offs, coefs, prepared=plan)
        fresh = steer_torch(hidden, p1, p2, offs, coefs, strategy=strategy)
        if DEVICE.type == "cpu":
            assert torch.equal(out, fresh)
        else:
            rtol, atol = TOL[(dtype, dtype)]
            torch.testing.assert_close(out, fresh, rtol=rtol,
                                       atol=atol * fresh.float().abs().max().item())
        check(out, hidden, p1, p2, offs, coefs)


def test_prepared_plan_for_another_batch_size_is_refused():
    from vllm_steer.kernels.torch_steer import prepare_torch

    hidden, p1, p2, offs, coefs = make_inputs(8, 32, [4, 4], "mixed", torch.float32,
                                              torch.float32)
    plan = prepare_torch(p1, p2, offs, coefs)
    with pytest.raises(AssertionError, match="prepared for 8 rows"):
        steer_torch(hidden[:5], p1, p2, offs, coefs[:5], prepared=plan)


@pytest.mark.parametrize("pattern", ["one_per_row", "mixed", "all_zero"])
def test_triton_plan_reused_over_steps_gives_the_per_call_result(pattern):
    # The serving path plans the Triton op once per change of the batch's steering (segments,
    # tiles, tables, scratch) and reuses it on every decode step: each step must equal a freshly
    # planned call, and the reference.
    if TRITON_SKIP:
        pytest.skip(TRITON_SKIP)
    from vllm_steer.kernels.triton.launch import steer_triton
    from vllm_steer.kernels.triton.plan import prepare_triton

    _, p1, p2, offs, coefs = make_inputs(21, 64, [16, 32, 16], pattern, torch.float32,
                                         torch.float32, seed=7)
    plan = prepare_triton(p1, p2, offs, coefs)
    gen = torch.Generator().manual_seed(8)
    for _step in range(2):
        hidden = torch.randn(21, 64, generator=gen).to(DEVICE)
        out = steer_triton(hidden, p1, p2, offs, coefs, prepared=plan)
        fresh = steer_triton(hidden, p1, p2, offs, coefs)
        if plan.tiles.split_d == 1:  # no atomics: deterministic
            assert torch.equal(out, fresh)
        check(out, hidden, p1, p2, offs, coefs)
    with pytest.raises(AssertionError, match="prepared for 21 rows"):
        steer_triton(hidden[:5], p1, p2, offs, coefs[:5], prepared=plan)


@pytest.mark.parametrize("act_dtype,fac_dtype", [(torch.float32, torch.float32),
                                                   (torch.bfloat16, torch.bfloat16)])
def test_triton_replayable_op_follows_coefficients_whose_pattern_changed_after_its_plan(
        act_dtype, fac_dtype):
    # What a CUDA graph of the fused op replays: a plan made once, then calls that read new
    # values from the same coefficient buffer, with other rows steered by other steers (and
    # some by none) than when it was planned. Each call must give the reference's rows for
    # the values the buffer holds then.
    if TRITON_SKIP:
        pytest.skip(TRITON_SKIP)
    from vllm_steer.kernels.triton.launch import steer_triton_replayable
    from vllm_steer.kernels.triton.plan import prepare_triton

    hidden, p1, p2, offs, coefs = make_inputs(19, 64, [16, 16, 16, 16], "one_per_row",
                                              act_dtype, fac_dtype, seed=11)
    buf = coefs.clone()  # the graph's coefficient buffer
    plan = prepare_triton(p1, p2, offs, buf)
    gen = torch.Generator().manual_seed(12)
    out = torch.empty_like(hidden)
    for pattern in ("one_per_row", "mixed", "all_zero", "dense", "negative"):
        buf.copy_(make_coefs(19, 4, pattern, gen).to(DEVICE))
        out.fill_(float("nan"))
        assert steer_triton_replayable(hidden, p1, p2, offs, buf, out, plan) is out
        check(out, hidden, p1, p2, offs, buf)
    with pytest.raises(AssertionError, match="prepared for 19 rows"):
        steer_triton_replayable(hidden[:5], p1, p2, offs, buf[:5], out[:5], plan)


def test_bmm_stacked_factors_follow_bank_changes_and_subsets():
    """The per-bank stacked factors of 'bmm' (cached) never serve a previous bank's factors."""
    from vllm_steer.kernels.torch_steer import prepare_torch, steer_torch
    from vllm_steer.reference import steer_reference

    g = torch.Generator().manual_seed(0)
    d = 32
    offs = [0, 4, 4, 8, 12, 20, 24]  # an empty slot, a rank-8 steer among rank-4 ones
    coefs = torch.zeros(6, 6)
    coefs[[0, 1, 2, 3, 4, 5], [0, 2, 3, 0, 2, 5]] = 5e-3  # a subset of the rank-4 steers
    h = torch.randn(6, d, generator=g)
    for _ in range(2):  # a new bank (new tensors, as after a load) is stacked anew
        p1, p2 = torch.randn(d, 24, generator=g), torch.randn(d, 24, generator=g)
        plan = prepare_torch(p1, p2, offs, coefs, strategy="bmm")
        assert plan.stacks
        torch.testing.assert_close(steer_torch(h, p1, p2, offs, coefs, prepared=plan),
                                   steer_reference(h, p1, p2, offs, coefs))
    p1.mul_(2)  # changed in place: the cache key (tensor version) changes too
    plan = prepare_torch(p1, p2, offs, coefs, strategy="bmm")
    torch.testing.assert_close(steer_torch(h, p1, p2, offs, coefs, prepared=plan),
                               steer_reference(h, p1, p2, offs, coefs))


def test_bmm_keeps_one_set_of_stacks_per_bank_when_it_is_rewritten_in_place():
    """A serving bank is rewritten in place at every load or unload (same tensors, a new
    version): its stale fp32 stacks (a copy of every column of that rank, twice a 16-bit
    bank) are replaced, not kept beside the new ones, so the backend's own device memory
    stays at one copy of the bank, not two."""
    from vllm_steer.kernels import torch_steer
    from vllm_steer.kernels.torch_steer import prepare_torch

    torch_steer._STACKS.clear()
    g = torch.Generator().manual_seed(0)
    d, rank, K = 32, 4, 8
    offs = [k * rank for k in range(K + 1)]  # the serving layout: every column one rank
    coefs = torch.zeros(6, K)
    coefs[range(6), [0, 1, 2, 0, 1, 2]] = 5e-3
    p1 = torch.randn(d, K * rank, generator=g, dtype=torch.bfloat16)
    p2 = torch.randn(d, K * rank, generator=g, dtype=torch.bfloat16)
    bank = 2 * p1.numel() * p1.element_size()

    def held() -> int:
        return sum(t.numel() * t.element_size() for _, per_rank in torch_steer._STACKS.values()
                   for _, down, up in per_rank.values() for t in (down, up))

    assert prepare_torch(p1, p2, offs, coefs, strategy="bmm").stacks
    assert held() == 2 * bank  # fp32 stacks of a bf16 bank
    p1[:, 3 * rank:4 * rank] = 1.0  # a load into slot 3, in place
    assert prepare_torch(p1, p2, offs, coefs, strategy="bmm").stacks
    assert len(torch_steer._STACKS) == 1 and held() == 2 * bank
    other = torch.randn(d, K * rank, generator=g, dtype=torch.bfloat16)  # another bank
    prepare_torch(other, p2, offs, coefs, strategy="bmm")
    assert len(torch_steer._STACKS) == 2  # the last two banks are kept
    torch_steer._STACKS.clear()
