"""The grouped capture-safe steer's Triton kernels (private: the wrapper is
:func:`.grouped.steer_grouped`). Semantics: see :mod:`vllm_steer.reference`.

The bank is read in place in its fixed layout (:class:`vllm_steer.bank.SlotBank`): column
``c`` of the coefficient table multiplies the factors at columns ``[c * R, (c + 1) * R)`` of
``p1`` / ``p2`` (``[hidden, C * R]``, row stride ``ld_p``). Four launches, every grid a
function of shapes only (what a CUDA graph records), nothing read back to the host:

1. **Rows** ``_grouped_rows_kernel``, grid ``(row tiles,)``: each row's coefficient row
   (``table[index[r]]``, or ``table[r]``) compacted to its non-zero columns in ascending order,
   ``slots[r, :S]`` (``-1`` past the last) and ``vals[r, :S]``. ``S``: the most steers a row
   may use (the caller's bound); an entry is ``e = r * S + s``.
2. **Segments** ``_grouped_segments_kernel``, grid ``(C + 1,)``: program ``c`` lists the
   entries whose slot is ``c`` (``seg[c, :counts[c]]``, in row order) and writes the rows
   whose first slot is ``c`` to ``perm`` after those whose first is lower (unsteered rows
   last): a device-side sort of the rows by slot, as ``LoRAKernelMeta`` prepares for
   ``lora_shrink`` / ``lora_expand``.
3. **Shrink** ``_grouped_shrink_kernel``, grid ``(row tiles, C, SPLIT)``: program ``(m, c, s)``
   exits at once when ``m * BLOCK_M >= counts[c]`` (slot unused, or fewer rows); otherwise it
   reads ``P1_c``'s ``s``-th slice of hidden once for its ``BLOCK_M`` entries and writes the
   partial down-projection ``buf[s, e, :R]`` (fp32, no atomics: the expand adds the ``SPLIT``
   partials in a fixed order, so the result never depends on timing).
4. **Expand** ``_grouped_expand_kernel``, grid ``(row tiles of perm, hidden tiles)``: for each
   distinct slot of its rows (ascending; rows sorted by first slot share slots), the scaled
   down-projections of the rows using it times ``P2_c``'s tile, accumulated in fp32; then the
   residual, every element of ``out`` written once, rows with no steer copied bit for bit.
   A row's steers are added in ascending slot order whatever the other rows: the tiles do
   not depend on the row count, so the result is batch invariant.

Each used steer's factor tile is read once per tile of its rows; unused slots cost one
early-exiting program each.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .jit import _load_tile, _mma


@triton.jit(do_not_specialize=["num_rows", "table_rows"])
def _grouped_rows_kernel(
    table_ptr,  # [table_rows, C] fp32 contiguous: coefficient rows
    index_ptr,  # [num_rows] int: row r's table row (-1: padding); unused without HAS_INDEX
    slots_ptr,  # [num_rows, S] int32 out: the row's non-zero columns, ascending, then -1
    vals_ptr,  # [num_rows, S] fp32 out: their coefficients
    num_rows, table_rows, C,
    HAS_INDEX: tl.constexpr, S: tl.constexpr, S_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr, C_CHUNK: tl.constexpr,
):
    pid = tl.program_id(0)
    offs_m = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = offs_m < num_rows
    if HAS_INDEX:
        trow = tl.load(index_ptr + offs_m, mask=m_mask, other=-1).to(tl.int64)
    else:
        trow = offs_m.to(tl.int64)
    valid = m_mask & (trow >= 0) & (trow < table_rows)
    trow = tl.where(valid, trow, 0)
    base = offs_m.to(tl.int64) * S
    count = tl.zeros((BLOCK_M,), dtype=tl.int32)
    for c0 in range(0, C, C_CHUNK):
        cc = c0 + tl.arange(0, C_CHUNK)
        x = tl.load(table_ptr + trow[:, None] * C + cc[None, :],
                    mask=valid[:, None] & (cc < C)[None, :], other=0.0)
        nz = (x != 0.0).to(tl.int32)
        pos = count[:, None] + tl.cumsum(nz, axis=1) - 1
        keep = (nz != 0) & (pos < S)
        tl.store(slots_ptr + base[:, None] + pos, cc[None, :] + pos * 0, mask=keep)
        tl.store(vals_ptr + base[:, None] + pos, x, mask=keep)
        count += tl.sum(nz, axis=1)
    # the rest of each row: no steer (disjoint from the positions written above)
    ss = tl.arange(0, S_PAD)
    rest = m_mask[:, None] & (ss[None, :] >= count[:, None]) & (ss[None, :] < S)
    tl.store(slots_ptr + base[:, None] + ss[None, :], ss[None, :] * 0 - 1, mask=rest)
    tl.store(vals_ptr + base[:, None] + ss[None, :], tl.zeros((BLOCK_M, S_PAD), tl.float32),
             mask=rest)


@triton.jit(do_not_specialize=["num_rows"])
def _grouped_segments_kernel(
    slots_ptr,  # [num_rows, S] int32: each row's slots, ascending, -1 past the last
    seg_ptr,  # [C, num_rows] int32 out: entries (r * S + s) whose slot is c, in row order
    counts_ptr,  # [C] int32 out
    perm_ptr,  # [num_rows] int32 out: rows stably sorted by first slot (none: last)
    num_rows, C,
    S: tl.constexpr, S_PAD: tl.constexpr, CHUNK: tl.constexpr,
):
    c = tl.program_id(0)
    ss = tl.arange(0, S_PAD)
    zero = c * 0
    before = zero
    for r0 in range(0, num_rows, CHUNK):
        offs = r0 + tl.arange(0, CHUNK)
        valid = offs < num_rows
        first = tl.load(slots_ptr + offs.to(tl.int64) * S, mask=valid, other=-1)
        first = tl.where(first < 0, C, first)
        before += tl.sum((valid & (first < c)).to(tl.int32), axis=0)
    n_seg = zero
    n_first = zero
    for r0 in range(0, num_rows, CHUNK):
        offs = r0 + tl.arange(0, CHUNK)
        valid = offs < num_rows
        tile = tl.load(slots_ptr + offs.to(tl.int64)[:, None] * S + ss[None, :],
                       mask=valid[:, None] & (ss < S)[None, :], other=-1)
        first = tl.min(tl.where(tile < 0, C, tile), axis=1)
        is_first = (valid & (first == c)).to(tl.int32)
        pos = before + n_first + tl.cumsum(is_first, axis=0) - 1
        tl.store(perm_ptr + pos, offs, mask=is_first != 0)
        n_first += tl.sum(is_first, axis=0)
        match = tile == c  # at most one entry per row
        uses = (tl.sum(match.to(tl.int32), axis=1) > 0) & valid
        sidx = tl.sum(tl.where(match, ss[None, :], 0), axis=1)
        uses_i = uses.to(tl.int32)
        pos = n_seg + tl.cumsum(uses_i, axis=0) - 1
        tl.store(seg_ptr + c.to(tl.int64) * num_rows + pos, offs * S + sidx, mask=uses)
        n_seg += tl.sum(uses_i, axis=0)
    if c < C:
        tl.store(counts_ptr + c, n_seg)


@triton.jit(do_not_specialize=["num_rows"])
def _grouped_shrink_kernel(
    hidden_ptr,  # [num_rows, hidden], row stride stride_h
    p1_ptr,  # [hidden, C * R] (row stride ld_p): the bank's first factors, fixed layout
    seg_ptr,  # [C, num_rows] int32
    counts_ptr,  # [C] int32
    widths_ptr,  # [C] int32: each column's steer rank (<= R); unused without HAS_WIDTHS
    buf_ptr,  # [SPLIT, num_rows * S, BLOCK_R] fp32 out: partial down-projections
    stride_h, ld_p, num_rows, hidden, R,
    S: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
    SPLIT: tl.constexpr, HAS_WIDTHS: tl.constexpr, EVEN_R: tl.constexpr, EVEN_D: tl.constexpr,
    MODE: tl.constexpr, FP32_PREC: tl.constexpr, INTERPRET: tl.constexpr,
):
    # EVEN_R: R == BLOCK_R and no widths (no mask along the rank); EVEN_D: hidden %
    # (BLOCK_D * SPLIT) == 0. With widths, only a column's first widths[c] factor columns are
    # read (a narrower steer's zero padding is never loaded).
    pid_m = tl.program_id(0)
    c = tl.program_id(1)
    pid_s = tl.program_id(2)
    count = tl.load(counts_ptr + c)
    start = pid_m * BLOCK_M
    if start < count:  # else: slot c unused, or no entry in this tile (early exit)
        offs_m = start + tl.arange(0, BLOCK_M)
        m_mask = offs_m < count
        ent = tl.load(seg_ptr + c.to(tl.int64) * num_rows + offs_m, mask=m_mask,
                      other=0).to(tl.int64)
        rows = ent // S
        offs_r = tl.arange(0, BLOCK_R)
        if HAS_WIDTHS:
            r_mask = offs_r < tl.load(widths_ptr + c)
        else:
            r_mask = offs_r < R
        cols = c.to(tl.int64) * R + offs_r
        d_chunk = tl.cdiv(tl.cdiv(hidden, SPLIT), BLOCK_D) * BLOCK_D
        d_lo = pid_s * d_chunk
        d_hi = tl.minimum(d_lo + d_chunk, hidden)
        acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        for d0 in range(d_lo, d_hi, BLOCK_D):
            offs_d = d0 + tl.arange(0, BLOCK_D)
            d_mask = offs_d < d_hi
            x = _load_tile(hidden_ptr + rows[:, None] * stride_h + offs_d[None, :],
                           m_mask, d_mask, True, not EVEN_D)
            p = _load_tile(p1_ptr + offs_d.to(tl.int64)[:, None] * ld_p + cols[None, :],
                           d_mask, r_mask, not EVEN_D, not EVEN_R)
            acc = _mma(acc, x, p, MODE, FP32_PREC, INTERPRET)
        at = (pid_s * num_rows * S + ent) * BLOCK_R
        tl.store(buf_ptr + at[:, None] + offs_r[None, :], acc, mask=m_mask[:, None])


@triton.jit(do_not_specialize=["num_rows"])
def _grouped_expand_kernel(
    hidden_ptr,  # [num_rows, hidden], row stride stride_h
    p2_ptr,  # [hidden, C * R] (row stride ld_p): the bank's second factors, fixed layout
    slots_ptr,  # [num_rows, S] int32
    vals_ptr,  # [num_rows, S] fp32
    perm_ptr,  # [num_rows] int32
    widths_ptr,  # [C] int32: each column's steer rank (<= R); unused without HAS_WIDTHS
    buf_ptr,  # [SPLIT, num_rows * S, BLOCK_R] fp32
    out_ptr,  # [num_rows, hidden], row stride stride_o
    stride_h, stride_o, ld_p, num_rows, hidden, R, C,
    S: tl.constexpr, S_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_R: tl.constexpr, SPLIT: tl.constexpr, HAS_WIDTHS: tl.constexpr,
    EVEN_R: tl.constexpr, EVEN_D: tl.constexpr,
    MODE: tl.constexpr, FP32_PREC: tl.constexpr, INTERPRET: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_d = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = offs_m < num_rows
    rows = tl.load(perm_ptr + offs_m, mask=m_mask, other=0).to(tl.int64)
    offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    d_mask = offs_d < hidden
    ss = tl.arange(0, S_PAD)
    keys = tl.load(slots_ptr + rows[:, None] * S + ss[None, :],
                   mask=m_mask[:, None] & (ss < S)[None, :], other=-1)
    vals = tl.load(vals_ptr + rows[:, None] * S + ss[None, :],
                   mask=m_mask[:, None] & (ss < S)[None, :], other=0.0)
    keys = tl.where(keys < 0, C, keys)
    steered = tl.min(keys, axis=1) < C
    offs_r = tl.arange(0, BLOCK_R)
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    cur = tl.min(tl.min(keys, axis=1), axis=0)
    while cur < C:  # each distinct slot of the tile's rows, ascending
        if HAS_WIDTHS:
            r_mask = offs_r < tl.load(widths_ptr + cur)
        else:
            r_mask = offs_r < R
        match = keys == cur
        has = tl.sum(match.to(tl.int32), axis=1) > 0
        sidx = tl.sum(tl.where(match, ss[None, :], 0), axis=1)
        coef = tl.sum(tl.where(match, vals, 0.0), axis=1)
        at = (rows * S + sidx) * BLOCK_R
        down = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        for sp in tl.static_range(SPLIT):
            down += tl.load(buf_ptr + sp * num_rows * S * BLOCK_R + at[:, None] + offs_r[None, :],
                            mask=has[:, None] & r_mask[None, :], other=0.0)
        down = down * coef[:, None]
        cols = cur.to(tl.int64) * R + offs_r
        p = _load_tile(p2_ptr + offs_d.to(tl.int64)[None, :] * ld_p + cols[:, None],
                       r_mask, d_mask, not EVEN_R, not EVEN_D)  # [BLOCK_R, BLOCK_D]
        acc = _mma(acc, down, p, MODE, FP32_PREC, INTERPRET)
        keys = tl.where(match, C, keys)
        cur = tl.min(tl.min(keys, axis=1), axis=0)
    x = _load_tile(hidden_ptr + rows[:, None] * stride_h + offs_d[None, :],
                   m_mask, d_mask, True, not EVEN_D)
    res = (x.to(tl.float32) + acc).to(x.dtype)
    res = tl.where(steered[:, None], res, x)  # rows with no steer: the input, bit for bit
    if EVEN_D:
        io_mask = m_mask[:, None]
    else:
        io_mask = m_mask[:, None] & d_mask[None, :]
    tl.store(out_ptr + rows[:, None] * stride_o + offs_d[None, :], res, mask=io_mask)


__all__: list[str] = []
_ = triton  # the decorators above
