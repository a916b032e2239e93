"""Fused batched steer kernel in Triton (CUDA; CPU through ``TRITON_INTERPRET=1``).

Semantics: see :mod:`vllm_steer.reference` (``steer_reference``).

Design (details in ``docs/kernels.md``). Three launches, segments, shrink, expand (punica-style):

1. **Segments** ``_steer_segments_kernel``, grid ``(K + 1,)``, on the device (no host sync):
   ``seg_rows[k]`` lists the rows with ``coefs[r, k] != 0`` (stable order), ``seg_counts[k]``
   how many; ``perm`` orders all rows by their first active steer (unsteered rows last).
2. **Shrink** ``_steer_shrink_kernel``, grid ``(row-blocks, rank-blocks of the bank, d-splits)``:
   program ``(m, j)`` takes rank block ``j`` (steer ``k``, columns ``col0:col0+BLOCK_R``) and the
   ``m``-th block of ``seg_rows[k]``; it exits at once when ``m * BLOCK_M >= seg_counts[k]``, so
   the work scales with the rows that use each steer and each factor tile is read once per
   block of such rows. It writes ``buf[r, cols] = coefs[r, k] * (c[r] @ P1[:, cols])`` (fp32;
   the scaling is fused here). Entries of ``buf`` for zero coefficients are never written or read.
3. **Expand** ``_steer_expand_kernel``, grid ``(row-blocks of perm, hidden-blocks)``: loops over
   the K steers, skips a steer when no row of the block uses it, accumulates
   ``buf[rows, a_k:b_k] @ P2_k[dblock]^T`` in fp32, then adds the residual and writes every
   element of ``out`` once: ``out = c + delta`` for steered rows, ``out = c`` bit for bit for
   rows whose coefficients are all zero. The expand uses no atomics. The shrink does only when
   ``choose_tiles`` splits it along hidden (``split_d > 1``: a few rows of low-rank steers, too
   few programs to fill the GPU): partial sums are then added into a zeroed ``buf`` with fp32
   atomics, so the summation order, and the last bits of the result, may vary from run to run.
   With ``split_d == 1`` the kernel is deterministic.

Batch invariance: in vLLM's batch-invariant mode (``VLLM_BATCH_INVARIANT=1``, read by
:func:`vllm_steer.kernels.batch_invariant`) :func:`choose_tiles` ignores the row count (the
tiles of :data:`INVARIANT_ROWS` rows, ``split_d == 1``: no atomics), so every row goes through
the same reductions in the same order whatever the batch: its output is bit for bit the same at
any batch size and next to any other rows. Outside that mode the tiles follow the row count's
bucket and a row's last bits may depend on the batch (fp32: 1 ulp measured on an H200).

Planning (:func:`prepare_triton`): the segments, the tile choice, the bank tables, the
kernel parameters and the ``buf`` allocation depend only on the coefficients' non-zero pattern
and the shapes, so the serving path computes them once per change of the batch's steering and
each decode step pays for the two GEMM launches alone (host time per call on an H100: about
160-360 us planned per call, the launches' own cost once planned; benchmarks/RESULTS.md). The
serving path passes a host copy of the coefficients (``host=``): the segments are then
computed in numpy (:func:`segments_host`) and copied in one pinned non-blocking copy instead
of the segments launch.

Precision: products are exact and sums fp32. Operands in the same 16-bit dtype go to the tensor
cores as they are; a fp32 operand against bf16 factors is split into ``hi + lo`` bf16 halves
(two exact-product dots, ~2^-17 relative error); other mixes run in fp32 with
``input_precision=FP32_PRECISION`` ("tf32x3" on CUDA: about fp32 accuracy on tensor cores).

Compiles: Triton compiles one binary per set of compile-time parameters (the ``constexpr``
tile sizes and flags, and the "== 1" / "multiple of 16" facts of integer arguments). The row
count changes every step, so it is never one of them: ``num_rows`` is ``do_not_specialize``
and :func:`choose_tiles` picks the tiles of the row count's power-of-two bucket
(:func:`row_bucket`). The binaries reachable for 1..max_rows rows are the few of
:func:`specializations`, and :func:`warm_up` compiles them all at start-up.

Host syncs: none in the steady state when ``rank_offsets`` is a list or a CPU tensor (the
per-bank device tables are built once and cached; building them copies a few ints host to
device the first time a bank shape is seen). A CUDA ``rank_offsets`` tensor costs one
``.tolist()`` sync per call: pass a list. The grid depends only on shapes, never on data, so the
launch is CUDA-graph friendly once the tables are cached.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import NamedTuple, Sequence

import torch
import triton
import triton.language as tl

from vllm_steer.kernels import batch_invariant, staging
from vllm_steer.kernels.layout import rank_offsets_list, row_bucket, row_buckets  # noqa: F401

#: fp32 x fp32 dot precision on CUDA ("tf32x3" ~ fp32 accuracy on tensor cores, or "ieee").
FP32_PRECISION = os.environ.get("VLLM_STEER_FP32_PRECISION", "tf32x3")
#: Tuning on a GPU: "field=value,..." of :class:`Tiles` applied over ``choose_tiles``
#: (e.g. ``VLLM_STEER_TILES=expand_r=64,num_stages=4``; benchmarks/kernel_bench.py --tiles).
ENV_TILES = "VLLM_STEER_TILES"

# Operand modes of a dot (see _mma).
_NATIVE, _SPLIT_BF16, _FP32 = 0, 1, 2


def _interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(_steer_expand_kernel, InterpretedFunction)


@triton.jit
def _mma(acc, a, b, MODE: tl.constexpr, FP32_PREC: tl.constexpr, INTERPRET: tl.constexpr):
    """``acc += a @ b`` with exact products and fp32 sums (see the module docstring)."""
    if MODE == 0:  # a and b share one 16-bit dtype
        if INTERPRET:  # the interpreter's dot mishandles bf16 (raw uint16): same math in fp32
            acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
    elif MODE == 1:  # b is bf16, a is wider: a = hi + lo, both bf16
        a32 = a.to(tl.float32)
        hi = a32.to(tl.bfloat16)
        lo = (a32 - hi.to(tl.float32)).to(tl.bfloat16)
        if INTERPRET:
            b32 = b.to(tl.float32)
            acc = tl.dot(hi.to(tl.float32), b32, acc, input_precision="ieee")
            acc = tl.dot(lo.to(tl.float32), b32, acc, input_precision="ieee")
        else:
            acc = tl.dot(hi, b, acc)
            acc = tl.dot(lo, b, acc)
    else:
        acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision=FP32_PREC)
    return acc


@triton.jit
def _load_tile(ptrs, mask_rows, mask_cols, MASK_ROWS: tl.constexpr, MASK_COLS: tl.constexpr):
    """A 2-D masked load whose masks exist only where the shapes need them: an all-true mask
    of unknown constancy would stop Triton from vectorising the loads."""
    if MASK_ROWS:
        if MASK_COLS:
            x = tl.load(ptrs, mask=mask_rows[:, None] & mask_cols[None, :], other=0.0)
        else:
            x = tl.load(ptrs, mask=mask_rows[:, None], other=0.0)
    else:
        if MASK_COLS:
            x = tl.load(ptrs, mask=mask_cols[None, :], other=0.0)
        else:
            x = tl.load(ptrs)
    return x


@triton.jit(do_not_specialize=["num_rows"])
def _steer_segments_kernel(
    coefs_ptr,  # [num_rows, K] fp32 contiguous
    seg_rows_ptr,  # [K, num_rows] int32 out: rows with coefs[:, k] != 0, in order
    seg_counts_ptr,  # [K] int32 out
    perm_ptr,  # [num_rows] int32 out: rows stably sorted by first active steer (none: last)
    num_rows, K,
    CHUNK: tl.constexpr, K_PAD: tl.constexpr,
):
    """Program k (0..K): compacts steer k's rows into seg_rows[k], and writes the rows whose
    first active steer is k (k == K: no steer) to perm, after the rows whose first is < k."""
    k = tl.program_id(0)
    kk = tl.arange(0, K_PAD)
    zero = k * 0  # an int32 scalar tensor: loop-carried counters must keep one type
    # Pass 1: how many rows come before this program's rows in perm.
    before = zero
    for r0 in range(0, num_rows, CHUNK):
        offs = r0 + tl.arange(0, CHUNK)
        valid = offs < num_rows
        tile = tl.load(coefs_ptr + offs.to(tl.int64)[:, None] * K + kk[None, :],
                       mask=valid[:, None] & (kk[None, :] < K), other=0.0)
        first = tl.min(tl.where(tile != 0.0, kk[None, :], K), axis=1)
        before += tl.sum((valid & (first < k)).to(tl.int32), axis=0)
    # Pass 2: compaction (stable: a prefix sum over each chunk plus a running count).
    n_seg = zero
    n_first = zero
    for r0 in range(0, num_rows, CHUNK):
        offs = r0 + tl.arange(0, CHUNK)
        valid = offs < num_rows
        tile = tl.load(coefs_ptr + offs.to(tl.int64)[:, None] * K + kk[None, :],
                       mask=valid[:, None] & (kk[None, :] < K), other=0.0)
        nzt = tile != 0.0
        first = tl.min(tl.where(nzt, kk[None, :], K), axis=1)
        is_first = (valid & (first == k)).to(tl.int32)
        pos = before + n_first + tl.cumsum(is_first, axis=0) - 1
        tl.store(perm_ptr + pos, offs, mask=is_first != 0)
        n_first += tl.sum(is_first, axis=0)
        uses = (tl.sum((nzt & (kk[None, :] == k)).to(tl.int32), axis=1) > 0) & valid
        uses_i = uses.to(tl.int32)
        pos = n_seg + tl.cumsum(uses_i, axis=0) - 1
        # (program K: no column matches, nothing is stored)
        tl.store(seg_rows_ptr + k.to(tl.int64) * num_rows + pos, offs, mask=uses)
        n_seg += tl.sum(uses_i, axis=0)
    if k < K:
        tl.store(seg_counts_ptr + k, n_seg)


@triton.jit(do_not_specialize=["num_rows"])
def _steer_shrink_kernel(
    hidden_ptr,  # [num_rows, hidden], row stride stride_h
    p1_ptr,  # [hidden, total_rank] contiguous
    coefs_ptr,  # [num_rows, K] fp32 contiguous
    seg_rows_ptr,  # [K, num_rows] int32: rows with coefs[:, k] != 0 first
    seg_counts_ptr,  # [K] int32: number of such rows
    blk_steer_ptr,  # [num_rank_blocks] int32: steer of each rank block
    blk_col_ptr,  # [num_rank_blocks] int32: first bank column of the block
    blk_end_ptr,  # [num_rank_blocks] int32: end column of that steer (exclusive)
    buf_ptr,  # [num_rows, total_rank] fp32: coefs[r, k] * (c[r] @ P1_k)
    stride_h, num_rows, hidden, total_rank, K,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
    SPLIT_D: tl.constexpr, EVEN_R: tl.constexpr, EVEN_D: tl.constexpr,
    MODE: tl.constexpr, FP32_PREC: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    # EVEN_R: every rank offset is a multiple of BLOCK_R (rank tiles need no mask and are
    # aligned); EVEN_D: hidden is a multiple of BLOCK_D * SPLIT_D (no mask along hidden).
    pid_m = tl.program_id(0)
    pid_rb = tl.program_id(1)
    pid_s = tl.program_id(2)
    k = tl.load(blk_steer_ptr + pid_rb)
    count = tl.load(seg_counts_ptr + k)
    start = pid_m * BLOCK_M
    if start < count:  # else: no row of this block uses steer k (early exit)
        offs_m = start + tl.arange(0, BLOCK_M)
        m_mask = offs_m < count
        rows = tl.load(seg_rows_ptr + k * num_rows + offs_m, mask=m_mask, other=0).to(tl.int64)
        col0 = tl.load(blk_col_ptr + pid_rb)
        if EVEN_R:
            col0 = tl.multiple_of(col0, BLOCK_R)
        col_end = tl.load(blk_end_ptr + pid_rb)
        offs_r = col0 + tl.arange(0, BLOCK_R)
        r_mask = offs_r < col_end
        d_chunk = tl.cdiv(tl.cdiv(hidden, SPLIT_D), BLOCK_D) * BLOCK_D
        d_lo = pid_s * d_chunk
        d_hi = tl.minimum(d_lo + d_chunk, hidden)
        acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        for d0 in range(d_lo, d_hi, BLOCK_D):
            d0 = tl.multiple_of(d0, BLOCK_D)
            offs_d = d0 + tl.arange(0, BLOCK_D)
            d_mask = offs_d < d_hi
            c = _load_tile(hidden_ptr + rows[:, None] * stride_h + offs_d[None, :],
                           m_mask, d_mask, True, not EVEN_D)
            p = _load_tile(p1_ptr + offs_d.to(tl.int64)[:, None] * total_rank + offs_r[None, :],
                           d_mask, r_mask, not EVEN_D, not EVEN_R)
            acc = _mma(acc, c, p, MODE, FP32_PREC, INTERPRET)
        coef = tl.load(coefs_ptr + rows * K + k, mask=m_mask, other=0.0)
        acc = acc * coef[:, None]
        ptrs = buf_ptr + rows[:, None] * total_rank + offs_r[None, :]
        if EVEN_R:
            mask = m_mask[:, None]
        else:
            mask = m_mask[:, None] & r_mask[None, :]
        if SPLIT_D == 1:
            tl.store(ptrs, acc, mask=mask)
        else:  # partial sums over hidden slices (buf zeroed by the wrapper)
            tl.atomic_add(ptrs, acc, mask=mask)


@triton.jit(do_not_specialize=["num_rows"])
def _steer_expand_kernel(
    hidden_ptr,  # [num_rows, hidden], row stride stride_h
    p2_ptr,  # [hidden, total_rank] contiguous
    coefs_ptr,  # [num_rows, K] fp32 contiguous
    perm_ptr,  # [num_rows] int32: rows ordered by their first active steer
    rank_offsets_ptr,  # [K + 1] int32
    buf_ptr,  # [num_rows, total_rank] fp32 from the shrink
    out_ptr,  # [num_rows, hidden], row stride stride_o
    stride_h, stride_o, num_rows, hidden, total_rank, K,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr,
    EVEN_R: tl.constexpr, EVEN_D: tl.constexpr,
    MODE: tl.constexpr, FP32_PREC: tl.constexpr, INTERPRET: tl.constexpr,
):
    # EVEN_R: every rank offset is a multiple of BLOCK_R; EVEN_D: hidden % BLOCK_D == 0.
    pid_m = tl.program_id(0)
    pid_d = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = offs_m < num_rows
    rows = tl.load(perm_ptr + offs_m, mask=m_mask, other=0).to(tl.int64)
    offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    d_mask = offs_d < hidden
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    steered = tl.zeros((BLOCK_M,), dtype=tl.int32)
    for k in range(0, K):
        coef = tl.load(coefs_ptr + rows * K + k, mask=m_mask, other=0.0)
        nz = coef != 0.0
        steered = steered | nz.to(tl.int32)
        if tl.max(nz.to(tl.int32), axis=0) > 0:  # skip steers no row of this block uses
            a = tl.load(rank_offsets_ptr + k)
            b = tl.load(rank_offsets_ptr + k + 1)
            for r0 in range(a, b, BLOCK_R):
                if EVEN_R:
                    r0 = tl.multiple_of(r0, BLOCK_R)
                offs_r = r0 + tl.arange(0, BLOCK_R)
                r_mask = offs_r < b
                down = _load_tile(buf_ptr + rows[:, None] * total_rank + offs_r[None, :],
                                  nz, r_mask, True, not EVEN_R)  # [BLOCK_M, BLOCK_R]
                p = _load_tile(p2_ptr + offs_d.to(tl.int64)[None, :] * total_rank
                               + offs_r[:, None], r_mask, d_mask,
                               not EVEN_R, not EVEN_D)  # [BLOCK_R, BLOCK_D]
                acc = _mma(acc, down, p, MODE, FP32_PREC, INTERPRET)
    c = _load_tile(hidden_ptr + rows[:, None] * stride_h + offs_d[None, :],
                   m_mask, d_mask, True, not EVEN_D)
    res = (c.to(tl.float32) + acc).to(c.dtype)
    res = tl.where(steered[:, None] != 0, res, c)  # unsteered rows: the input, bit for bit
    if EVEN_D:
        io_mask = m_mask[:, None]
    else:
        io_mask = m_mask[:, None] & d_mask[None, :]
    tl.store(out_ptr + rows[:, None] * stride_o + offs_d[None, :], res, mask=io_mask)


# ---------------------------------------------------------------------------------------------
# Host side

_TABLES: "OrderedDict[tuple, tuple[torch.Tensor, ...]]" = OrderedDict()
_TABLES_MAX = 64
_NUM_SMS: dict[int, int] = {}


def _bank_tables(offs: list[int], block_r: int, device: torch.device):
    """Device tables of a bank layout (cached: no host-to-device copy in the steady state)."""
    key = (tuple(offs), block_r, str(device))
    hit = _TABLES.get(key)
    if hit is not None:
        _TABLES.move_to_end(key)
        return hit
    steer, col, end = [], [], []
    for k in range(len(offs) - 1):
        for c0 in range(offs[k], offs[k + 1], block_r):
            steer.append(k), col.append(c0), end.append(offs[k + 1])
    import numpy as np

    from vllm_steer.kernels.staging import to_device

    # host-built and copied from pinned memory (no sync, even the first time a layout is seen)
    as_t = lambda v: to_device(np.asarray(v, dtype=np.int32), device)  # noqa: E731
    tables = (as_t(steer), as_t(col), as_t(end), as_t(offs))
    _TABLES[key] = tables
    if len(_TABLES) > _TABLES_MAX:
        _TABLES.popitem(last=False)
    return tables


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":  # the interpreter: fewest, largest programs
        return 1
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _NUM_SMS:
        _NUM_SMS[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _NUM_SMS[idx]


def _mode(a_dtype: torch.dtype, b_dtype: torch.dtype) -> int:
    if a_dtype == b_dtype and a_dtype in (torch.float16, torch.bfloat16):
        return _NATIVE
    if b_dtype == torch.bfloat16:
        return _SPLIT_BF16
    return _FP32


@dataclass(frozen=True)
class Tiles:
    """Tile sizes and launch options of the two kernels (tiles: powers of two, >= 16)."""

    shrink_m: int = 64  # rows of a steer's segment per shrink program
    shrink_r: int = 64  # bank columns (rank) per shrink program
    shrink_d: int = 64  # hidden slice per step of the shrink's reduction loop
    split_d: int = 1  # shrink programs per rank block along hidden (>1: fp32 atomics)
    expand_m: int = 64  # rows (in perm order) per expand program
    expand_d: int = 64  # output columns per expand program
    expand_r: int = 32  # rank per step of the expand's reduction loop
    shrink_warps: int = 4
    expand_warps: int = 4
    num_stages: int = 4


def _divides(block: int, offs: list[int]) -> bool:
    return all(o % block == 0 for o in offs)


def _pow2_at_least(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()




#: The row count the tiles are chosen for in batch-invariant mode, whatever the batch (a
#: typical decode batch: the tiles of 1 row would starve large batches, those of 256 rows
#: waste work on small ones).
INVARIANT_ROWS = 64


def choose_tiles(num_rows: int, hidden: int, offs: list[int], num_sms: int,
                 invariant: bool | None = None) -> Tiles:
    """Tiles from shapes only (no data, so no sync and a CUDA-graph-stable launch).

    The row count enters through its bucket (:func:`row_bucket`) only, so that the compiled
    kernels reachable from 1..max_rows rows are a handful (:func:`specializations`).
    ``invariant`` (default: :func:`vllm_steer.kernels.batch_invariant`): the row count does
    not enter at all (tiles of :data:`INVARIANT_ROWS` rows) and the hidden split is off, so a
    row's result does not depend on its batch.

    The largest tiles (fewest re-reads of the activations and of ``buf``) whose grid still
    gives every SM a program, preferring tiles that divide the rank offsets and hidden (no
    masks: vectorised, aligned loads); a split of the shrink along hidden when even 16-wide rank
    tiles leave SMs idle (a few rows, low rank). Warps: enough that no tile spills registers
    (checked with cuobjdump -res-usage on sm_90 builds of every mode).
    """
    K = len(offs) - 1
    ranks = [offs[k + 1] - offs[k] for k in range(K)]
    if invariant is None:
        invariant = batch_invariant()
    num_rows = INVARIANT_ROWS if invariant else row_bucket(num_rows)

    def even(block, fallback):  # the largest power of two <= block dividing all offsets
        b = block
        while b >= 16 and not _divides(b, offs):
            b //= 2
        return b if b >= 16 else fallback

    # Rows per steer when each row uses about one steer: the shrink's segments.
    per_steer = max(1, num_rows // max(K, 1))
    shrink_m = min(64, max(16, _pow2_at_least(per_steer)))
    seg_blocks = max(1, -(-per_steer // shrink_m))
    shrink_r = 16
    for r in (128, 64, 32):
        if sum(-(-rk // r) for rk in ranks) * seg_blocks >= num_sms:
            shrink_r = r
            break
    shrink_r = even(shrink_r, shrink_r)
    while sum(-(-rk // shrink_r) for rk in ranks) > 65535 and shrink_r < 128:
        shrink_r *= 2  # grid axis 1 holds the rank blocks (CUDA limit 65535)
    shrink_d = next((b for b in (64, 32, 16) if hidden % b == 0), 64)
    programs = sum(-(-rk // shrink_r) for rk in ranks) * seg_blocks
    split_d = 1
    while (not invariant and programs * split_d < num_sms and hidden // (split_d * 2) >= 256
           and hidden % (shrink_d * split_d * 2) == 0):
        split_d *= 2
    expand_m = min(64, max(16, _pow2_at_least(num_rows)))
    row_blocks = -(-num_rows // expand_m)
    expand_d = 32
    for dd in (128, 64):
        if row_blocks * -(-hidden // dd) >= num_sms:
            expand_d = dd
            break
    while expand_d > 16 and hidden % expand_d:
        expand_d //= 2
    return Tiles(shrink_m=shrink_m, shrink_r=shrink_r, shrink_d=shrink_d, split_d=split_d,
                 expand_m=expand_m, expand_d=expand_d, expand_r=even(32, 32),
                 shrink_warps=8 if shrink_m * shrink_r >= 2048 else 4,
                 expand_warps=8 if expand_m * expand_d >= 4096 else 4)


def _with_overrides(t: Tiles) -> Tiles:
    spec = os.environ.get(ENV_TILES, "").strip()
    if not spec:
        return t
    fields = set(Tiles.__dataclass_fields__)
    over = {}
    for item in spec.split(","):
        name, _, value = item.partition("=")
        name = name.strip()
        if name not in fields or not value.strip().isdigit():
            raise ValueError(f"${ENV_TILES}: bad item {item!r}; use name=int with name one of "
                             f"{sorted(fields)}")
        over[name] = int(value)
    return replace(t, **over)


def kernel_params(t: Tiles, hidden: int, offs: list[int], act_dtype: torch.dtype,
                  fac_dtype: torch.dtype, interpret: bool = False) -> tuple[dict, dict]:
    """Compile-time parameters (and launch options) of the shrink and expand kernels."""
    common = dict(FP32_PREC=FP32_PRECISION, INTERPRET=interpret)
    shrink = dict(BLOCK_M=t.shrink_m, BLOCK_R=t.shrink_r, BLOCK_D=t.shrink_d,
                  SPLIT_D=t.split_d, EVEN_R=_divides(t.shrink_r, offs),
                  EVEN_D=hidden % (t.shrink_d * t.split_d) == 0,
                  MODE=_mode(act_dtype, fac_dtype), **common)
    expand = dict(BLOCK_M=t.expand_m, BLOCK_D=t.expand_d, BLOCK_R=t.expand_r,
                  EVEN_R=_divides(t.expand_r, offs), EVEN_D=hidden % t.expand_d == 0,
                  MODE=_mode(torch.float32, fac_dtype), **common)
    if not interpret:
        shrink.update(num_warps=t.shrink_warps, num_stages=t.num_stages)
        expand.update(num_warps=t.expand_warps, num_stages=t.num_stages)
    return shrink, expand


def segments(coefs: torch.Tensor, into: tuple | None = None):
    """Rows grouped by steer, on the device in one launch (no host sync).

    Returns ``(seg_rows [K, rows] int32, seg_counts [K] int32, perm [rows] int32)``: row
    ``seg_rows[k, i]`` for ``i < seg_counts[k]`` uses steer ``k`` (rows in order; entries past
    the count are unspecified); ``perm`` orders the rows by their first active steer, stably
    (rows with no steer last). ``into``: those three tables to write instead of new ones.
    """
    num_rows, K = coefs.shape
    if into is None:
        seg_rows = torch.empty((K, num_rows), dtype=torch.int32, device=coefs.device)
        seg_counts = torch.empty((K,), dtype=torch.int32, device=coefs.device)
        perm = torch.empty((num_rows,), dtype=torch.int32, device=coefs.device)
    else:
        seg_rows, seg_counts, perm = into
        assert seg_rows.shape == (K, num_rows) and seg_counts.shape == (K,) \
            and perm.shape == (num_rows,), "the tables were made for other coefficients' shape"
    _steer_segments_kernel[(K + 1,)](coefs, seg_rows, seg_counts, perm, num_rows, K,
                                     **segments_params(num_rows, K))
    return seg_rows, seg_counts, perm


def segments_params(num_rows: int, K: int) -> dict:
    """Compile-time parameters of the segments kernel (one set per row bucket)."""
    k_pad = max(16, _pow2_at_least(K))
    return dict(CHUNK=max(16, min(1024, row_bucket(num_rows), 8192 // k_pad)), K_PAD=k_pad)


def segments_host(nz, device: torch.device):
    """:func:`segments` computed on the host from a numpy non-zero pattern ([rows, K] bool)
    and copied to ``device`` in one pinned, non-blocking copy: the same tables, no launch and
    no device read (the serving path plans from its host mirror of the coefficients).

    The three tables share one buffer, each starting 64-byte aligned: Triton compiles anew
    for a pointer that is not 16-byte aligned, which would defeat :func:`warm_up`."""
    import numpy as np

    from vllm_steer.kernels.staging import to_device

    num_rows, K = nz.shape
    at_counts = _aligned(K * num_rows)
    at_perm = at_counts + _aligned(K)
    table = np.zeros(at_perm + num_rows, dtype=np.int32)
    seg_rows = table[:K * num_rows].reshape(K, num_rows)
    ks, rows = np.nonzero(nz.T)  # sorted by steer, rows in order
    counts = np.bincount(ks, minlength=K)
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]]) if K else counts
    seg_rows[ks, np.arange(ks.size) - starts[ks]] = rows
    table[at_counts:at_counts + K] = counts
    first = np.where(nz.any(axis=1), nz.argmax(axis=1), K)
    table[at_perm:] = np.argsort(first, kind="stable")
    dev = to_device(table, device)
    return (dev[:K * num_rows].view(K, num_rows), dev[at_counts:at_counts + K], dev[at_perm:])


def _aligned(n: int, elements: int = 16) -> int:
    """``n`` rounded up to a multiple of ``elements`` int32 (64 bytes)."""
    return -(-n // elements) * elements


class TritonPlan(NamedTuple):
    """One batch's steering planned for :func:`steer_triton` (made by :func:`prepare_triton`).

    Reusable for as long as the coefficients do not change (the decode steps of an unchanged
    batch): a call then launches the shrink and expand kernels and nothing else.
    """

    num_rows: int
    tiles: Tiles
    tables: tuple  # (steer_t, col_t, end_t, offs_t): the bank layout's device tables
    segments: tuple | None  # (seg_rows, seg_counts, perm) from the coefficients; None: K == 0
    buf: torch.Tensor | None  # [num_rows, total_rank] fp32 scratch, reused by every call
    params: dict  # activation dtype -> (shrink kwargs, expand kwargs)


def _check_factors(d: int, p1: torch.Tensor, p2: torch.Tensor, offs: list[int],
                   coefs: torch.Tensor, num_rows: int) -> None:
    K, total_rank = len(offs) - 1, offs[-1]
    floats = (torch.float32, torch.float16, torch.bfloat16)
    assert p1.dtype == p2.dtype and p1.dtype in floats, \
        f"p1 and p2 need one dtype of {floats}, got {p1.dtype} and {p2.dtype}"
    assert p1.shape == p2.shape == (d, total_rank), \
        (f"p1 {tuple(p1.shape)} and p2 {tuple(p2.shape)} must be "
         f"[hidden={d}, total_rank={total_rank}]")
    assert p1.is_contiguous() and p2.is_contiguous(), "p1 and p2 must be contiguous"
    assert coefs.dtype == torch.float32 and coefs.shape == (num_rows, K), \
        (f"coefs must be float32 [num_rows={num_rows}, K={K}], "
         f"got {coefs.dtype} {tuple(coefs.shape)}")
    assert coefs.is_contiguous(), "coefs must be contiguous"
    assert offs[0] == 0 and all(b >= a for a, b in zip(offs, offs[1:])), \
        f"rank_offsets must start at 0 and not decrease, got {offs}"


def prepare_triton(
    p1: torch.Tensor,  # [hidden, total_rank] contiguous
    p2: torch.Tensor,  # [hidden, total_rank] contiguous, same dtype as p1
    rank_offsets: Sequence[int] | torch.Tensor,  # K + 1 ints
    coefs: torch.Tensor,  # [num_rows, K] fp32 contiguous, on the factors' device
    tiles: "Tiles | None" = None,  # tile sizes (default: choose_tiles)
    host=None,  # numpy [num_rows, K]: ``coefs`` on the host (segments made there, no launch)
) -> TritonPlan:
    """Plan one batch's steering once (segments, tiles, tables, scratch) for reuse by
    :func:`steer_triton` (``prepared=``) on every step while ``coefs`` stays the same.

    The plan depends on the coefficients' non-zero pattern only (the kernels read the values
    from ``coefs`` at run time): it stays valid while the values change and the pattern not."""
    dev = p1.device
    staging.check_not_capturing(dev)
    offs = rank_offsets_list(rank_offsets)
    K, total_rank = len(offs) - 1, offs[-1]
    num_rows, d = coefs.shape[0], p1.shape[0]
    _check_factors(d, p1, p2, offs, coefs, num_rows)
    t = tiles or _with_overrides(choose_tiles(num_rows, d, offs, _num_sms(dev)))
    for name in ("shrink_m", "shrink_r", "shrink_d", "expand_m", "expand_d", "expand_r"):
        v = getattr(t, name)
        assert v >= 16 and v & (v - 1) == 0, f"Tiles.{name} must be a power of two >= 16, got {v}"
    if t.split_d > 1 and batch_invariant():
        raise ValueError(f"Tiles.split_d={t.split_d} adds partial sums with atomics, in an order "
                         f"that varies from run to run, but VLLM_BATCH_INVARIANT=1 asks for "
                         f"results that do not depend on the batch: use split_d=1 (check "
                         f"${ENV_TILES} and the tiles= argument)")
    if num_rows == 0 or K == 0 or total_rank == 0:
        return TritonPlan(num_rows, t, (), None, None, {})
    tables = _bank_tables(offs, t.shrink_r, dev)
    if tables[0].numel() > 65535:
        raise ValueError(f"the bank has {tables[0].numel()} rank blocks of {t.shrink_r} columns, "
                         f"over CUDA's grid limit 65535 (total rank {total_rank}); use fewer or "
                         f"lower-rank steers per bank, or Tiles(shrink_r=128)")
    buf = torch.empty((num_rows, total_rank), dtype=torch.float32, device=dev)
    segs = segments(coefs) if host is None else segments_host(host != 0, dev)
    return TritonPlan(num_rows, t, tables, segs, buf, {})


def steer_triton(
    hidden: torch.Tensor,  # [num_rows, hidden] fp32/fp16/bf16, unit stride along hidden
    p1: torch.Tensor,  # [hidden, total_rank] contiguous, fp32 or the activation's 16-bit dtype
    p2: torch.Tensor,  # [hidden, total_rank] contiguous, same dtype as p1
    rank_offsets: Sequence[int] | torch.Tensor,  # K + 1 ints (list or CPU tensor: no sync)
    coefs: torch.Tensor,  # [num_rows, K] fp32 contiguous
    out: torch.Tensor | None = None,  # [num_rows, hidden] like hidden (allocated if None)
    tiles: "Tiles | None" = None,  # tile sizes (default: choose_tiles)
    prepared: TritonPlan | None = None,  # prepare_triton(p1, p2, rank_offsets, coefs): reused
) -> torch.Tensor:
    """Fused batched steer. Semantics: see vllm_steer.reference (``steer_reference``).

    Every element of ``out`` is written; rows whose coefficients are all zero are copied bit for
    bit. Host syncs: none when ``rank_offsets`` is a list / CPU tensor and the bank layout was
    seen before (see the module docstring). With ``prepared`` (made from these same factors and
    coefficients) the call skips the planning and launches the two GEMM kernels only.
    Refuses to run while a CUDA graph is being captured (steering runs outside CUDA graphs).
    """
    staging.check_not_capturing(hidden.device)
    offs = rank_offsets_list(rank_offsets)
    num_rows = hidden.shape[0]
    floats = (torch.float32, torch.float16, torch.bfloat16)
    assert hidden.dtype in floats, f"hidden dtype must be one of {floats}, got {hidden.dtype}"
    assert hidden.stride(1) == 1, f"hidden needs unit stride along hidden, got {hidden.stride()}"
    dev = hidden.device
    assert p1.device == dev and coefs.device == dev, (hidden.device, p1.device, coefs.device)
    interpret = _interpreting()
    if dev.type != "cuda" and not interpret:
        raise RuntimeError("the triton steer backend needs CUDA tensors (or TRITON_INTERPRET=1 "
                           "set before triton is imported); use backend='torch' on CPU")
    if out is None:
        out = torch.empty_like(hidden, memory_format=torch.contiguous_format)
    assert out.shape == hidden.shape and out.dtype == hidden.dtype and out.stride(1) == 1, \
        (out.shape, out.dtype, out.stride())
    if prepared is None:
        prepared = prepare_triton(p1, p2, offs, coefs, tiles)
    else:
        assert prepared.num_rows == num_rows, \
            f"plan prepared for {prepared.num_rows} rows, called with {num_rows}"
    if num_rows == 0:
        return out
    if prepared.segments is None:
        out.copy_(hidden)
        return out
    return _launch(prepared, hidden, p1, p2, offs, coefs, out, interpret)


def steer_triton_replayable(
    hidden: torch.Tensor,  # [num_rows, hidden], unit stride along hidden
    p1: torch.Tensor,  # [hidden, total_rank] contiguous
    p2: torch.Tensor,  # [hidden, total_rank] contiguous, same dtype as p1
    rank_offsets: Sequence[int],  # K + 1 ints (a list: no sync)
    coefs: torch.Tensor,  # [num_rows, K] fp32 contiguous: read at each call
    out: torch.Tensor,  # [num_rows, hidden] like hidden: written
    prepared: TritonPlan,  # prepare_triton(p1, p2, rank_offsets, coefs), made outside a capture
) -> torch.Tensor:
    """The fused op as a CUDA graph can record it. Semantics: see reference.

    The rows' grouping by steer (the segments) is computed on the device from the values
    ``coefs`` holds at each call, into ``prepared``'s tables, so a recorded call follows
    coefficients whose pattern changed since the plan; then the shrink and the expand. Three
    launches (four with ``split_d > 1``), nothing allocated, no host read, and no refusal while
    a capture runs. ``prepared`` fixes the tiles, the bank's tables and the scratch; make it,
    and make one call (which compiles), before the capture."""
    num_rows = coefs.shape[0]
    offs = rank_offsets_list(rank_offsets)
    assert prepared.num_rows == num_rows and prepared.segments is not None, \
        f"plan prepared for {prepared.num_rows} rows with steers, called with {num_rows}"
    assert out.shape == hidden.shape and out.dtype == hidden.dtype and out.stride(1) == 1, \
        (out.shape, out.dtype, out.stride())
    segments(coefs, into=prepared.segments)
    return _launch(prepared, hidden, p1, p2, offs, coefs, out, _interpreting())


def _launch(prepared: TritonPlan, hidden, p1, p2, offs: list[int], coefs, out,
            interpret: bool) -> torch.Tensor:
    """The shrink and the expand of a plan with steered rows."""
    num_rows, d = hidden.shape
    K, total_rank = len(offs) - 1, offs[-1]
    t = prepared.tiles
    steer_t, col_t, end_t, offs_t = prepared.tables
    seg_rows, seg_counts, perm = prepared.segments
    buf = prepared.buf
    if t.split_d > 1:
        buf.zero_()  # the split shrink adds its partial sums with atomics
    params = prepared.params.get(hidden.dtype)
    if params is None:
        params = prepared.params[hidden.dtype] = kernel_params(t, d, offs, hidden.dtype,
                                                               p1.dtype, interpret)
    shrink_kw, expand_kw = params
    _steer_shrink_kernel[(triton.cdiv(num_rows, t.shrink_m), steer_t.numel(), t.split_d)](
        hidden, p1, coefs, seg_rows, seg_counts, steer_t, col_t, end_t, buf,
        hidden.stride(0), num_rows, d, total_rank, K, **shrink_kw)
    _steer_expand_kernel[(triton.cdiv(num_rows, t.expand_m), triton.cdiv(d, t.expand_d))](
        hidden, p2, coefs, perm, offs_t, buf, out,
        hidden.stride(0), out.stride(0), num_rows, d, total_rank, K, **expand_kw)
    return out


# ---------------------------------------------------------------------------------------------
# Start-up: every compiled kernel a serving run can need, compiled before the first request


class Specialization(NamedTuple):
    """One compiled kernel: which kernel, and its compile-time parameters (``constexpr``
    values and launch options, as ``(name, value)`` pairs sorted by name)."""

    kernel: str  # "segments", "shrink" or "expand"
    params: tuple


def _launch_specs(num_rows: int, hidden: int, offs: list[int], act_dtype: torch.dtype,
                  fac_dtype: torch.dtype, num_sms: int, interpret: bool) -> list[Specialization]:
    """The kernels :func:`steer_triton` compiles for a call on ``num_rows`` rows (its
    segments launch included: a call without a plan or host coefficients makes one)."""
    K = len(offs) - 1
    if num_rows == 0 or K == 0 or offs[-1] == 0:
        return []  # nothing is launched
    t = _with_overrides(choose_tiles(num_rows, hidden, offs, num_sms))
    shrink, expand = kernel_params(t, hidden, offs, act_dtype, fac_dtype, interpret)
    return [Specialization("segments", tuple(sorted(segments_params(num_rows, K).items()))),
            Specialization("shrink", tuple(sorted(shrink.items()))),
            Specialization("expand", tuple(sorted(expand.items())))]


def specializations(
    max_rows: int,  # the most rows one call steers (vLLM's max_num_seqs)
    hidden: int,  # the model's hidden size
    rank_offsets: Sequence[int] | torch.Tensor,  # K + 1 ints: the bank's layout
    act_dtype: torch.dtype,  # the activations' dtype (the model's)
    fac_dtype: torch.dtype,  # the factors' dtype (the bank's)
    device: torch.device | str | None = None,  # its SM count shapes the tiles (default: cuda:0)
) -> list[Specialization]:
    """Every compiled kernel that :func:`steer_triton` can launch for 1..max_rows rows of this
    bank and these dtypes: at most one per kernel and row bucket (3 kernels x 9 buckets for
    256 rows), usually fewer (buckets often share tiles).

    Assumes what the serving path passes: activations and output of ``hidden`` contiguous
    columns (a row stride of another "multiple of 16" class compiles anew) and fresh (16-byte
    aligned) tensors. A new bank layout (a steer of another rank loaded) has its own set."""
    offs = rank_offsets_list(rank_offsets)
    if device is None:
        device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    num_sms = _num_sms(torch.device(device))
    found: dict[Specialization, None] = {}
    for rows in row_buckets(max_rows):
        for spec in _launch_specs(min(rows, max_rows), hidden, offs, act_dtype, fac_dtype,
                                  num_sms, _interpreting()):
            found.setdefault(spec)
    return list(found)


def warm_up(
    p1: torch.Tensor,  # [hidden, total_rank] contiguous: the bank's factors
    p2: torch.Tensor,  # [hidden, total_rank] contiguous, same dtype as p1
    rank_offsets: Sequence[int] | torch.Tensor,  # K + 1 ints
    max_rows: int,  # the most rows one call steers (vLLM's max_num_seqs)
    act_dtype: torch.dtype,  # the activations' dtype
) -> int:
    """Compile every kernel of :func:`specializations` by launching it once (on zero
    activations, one steer per row), so that no later call for 1..max_rows rows of this bank
    compiles: a compile stalls its step for 0.2-2.8 s (measured on an H200). Also builds the
    bank's cached device tables. Returns the number of specialisations warmed.

    Call it at start-up and again after the bank's layout changes."""
    offs = rank_offsets_list(rank_offsets)
    K, d = len(offs) - 1, p1.shape[0]
    dev = p1.device
    specs = specializations(max_rows, d, offs, act_dtype, p1.dtype, dev)
    num_sms, interpret = _num_sms(dev), _interpreting()
    warmed: set[Specialization] = set()
    for rows in row_buckets(max_rows) if specs else []:
        rows = min(rows, max_rows)
        need = set(_launch_specs(rows, d, offs, act_dtype, p1.dtype, num_sms, interpret))
        if need <= warmed:
            continue
        coefs = torch.zeros((rows, K), dtype=torch.float32, device=dev)
        coefs[torch.arange(rows, device=dev), torch.arange(rows, device=dev) % K] = 1.0
        hidden = torch.zeros((rows, d), dtype=act_dtype, device=dev)
        steer_triton(hidden, p1, p2, offs, coefs)  # no plan: the segments kernel runs too
        warmed |= need
    assert warmed == set(specs), "warm_up missed a specialisation of specializations()"
    return len(specs)
