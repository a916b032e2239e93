"""The fused steer's Triton kernels (private: the wrappers are :func:`.launch.steer_triton`
and :func:`.segments.segments`). Semantics: see :mod:`vllm_steer.reference`.

Three launches, segments, shrink, expand (punica-style; details in ``docs/kernels.md``):

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
   :func:`.tiling.choose_tiles` splits it along hidden (``SPLIT_D > 1``): partial sums are then
   added into a zeroed ``buf`` with fp32 atomics, so the summation order, and the last bits of
   the result, may vary from run to run. With ``SPLIT_D == 1`` the kernels are deterministic.

Precision (:func:`_mma`): products are exact and sums fp32. ``MODE`` (:func:`.tiling._mode`):
0, operands in the same 16-bit dtype go to the tensor cores as they are; 1, a wider operand
against bf16 factors is split into ``hi + lo`` bf16 halves (two exact-product dots, ~2^-17
relative error); 2, fp32 with ``input_precision=FP32_PREC`` ("tf32x3" on CUDA: about fp32
accuracy on tensor cores).

The row count changes every step, so it is never a compile-time fact: ``num_rows`` is
``do_not_specialize`` in every kernel (:mod:`.warmup`).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _mma(acc, a, b, MODE: tl.constexpr, FP32_PREC: tl.constexpr, INTERPRET: tl.constexpr):
    """``acc += a @ b`` with exact products and fp32 sums (``MODE``: the module docstring)."""
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
