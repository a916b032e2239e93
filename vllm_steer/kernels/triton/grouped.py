"""The capture-safe steer op that reads only the steers in use (:func:`steer_grouped`), over the
bank in place. Semantics: see :mod:`vllm_steer.reference`.

Row ``i`` is steered with coefficient row ``table[index[i]]`` (``table[i]`` without an index;
``-1``: a padding row, left as it is) of a table ``[T, C]`` fp32, column ``c`` multiplying the
bank's factors at columns ``[c * rank, (c + 1) * rank)`` of ``p1`` / ``p2`` (``[hidden, C *
rank]``: :class:`vllm_steer.bank.SlotBank`'s storage, whose addresses never change). The rows
are grouped by slot on the device with fixed grids (the kernels: :mod:`.grouped_jit`), so the
op can be recorded in a CUDA graph: its launches and their grids depend on shapes only, it
reads nothing back to the host, and with a :class:`GroupedScratch` it allocates nothing. A
recorded op reads, at each replay, whatever the table, the index and the bank hold then.

``max_per_row`` (``S``): the most non-zero coefficients a row may have (two per steer: the
steer and its domain component; the engine core refuses requests with more steers than
``--max-steers-per-request``). Columns past the ``S``-th non-zero one of a row are not
applied: the caller's bound must hold.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from . import grouped_jit
from .tiling import FP32_PRECISION, _mode, _pow2_at_least

#: Rows per tile of the shrink and the expand: fixed, never chosen from the row count (so a
#: row's result does not depend on its batch: batch invariant by construction).
BLOCK_M = 16
#: Hidden elements per step of the shrink's loop, and per program of the expand.
SHRINK_D = 64
EXPAND_D = 64
#: Warps of the shrink and the expand: with 4 the expand spills at rank 64 on bf16 factors
#: (255 registers and 48 bytes of stack for sm_90, ``aot_check``), with 8 it does not (146-150).
SHRINK_WARPS = 4
EXPAND_WARPS = 8


def split_d(hidden: int) -> int:
    """The shrink's slices of hidden (partial sums added in a fixed order by the expand): more
    programs per steer when few steers are used. A function of ``hidden`` only."""
    return max(1, min(4, hidden // 1024))


@dataclass
class GroupedScratch:
    """The op's device buffers for one row count: made once (outside a capture), reused by
    every call, so a recorded call allocates nothing."""

    #: ``[rows, S]`` int32: each row's slots (non-zero columns), ascending; -1 past the last.
    slots: torch.Tensor
    #: ``[rows, S]`` fp32: their coefficients.
    vals: torch.Tensor
    #: ``[C, rows]`` int32: per slot, its entries ``r * S + s`` in row order.
    seg: torch.Tensor
    #: ``[C]`` int32: entries per slot.
    counts: torch.Tensor
    #: ``[rows]`` int32: the rows sorted by first slot (unsteered last).
    perm: torch.Tensor
    #: ``[split_d, rows * S, block_r]`` fp32: the shrink's partial down-projections.
    buf: torch.Tensor


def grouped_scratch(rows: int, columns: int, max_per_row: int, rank: int, hidden: int,
                    device) -> GroupedScratch:
    """The buffers :func:`steer_grouped` needs for ``rows`` rows, a bank of ``columns``
    coefficient columns of ``rank``, at most ``max_per_row`` non-zero coefficients a row."""
    s = max(1, min(int(max_per_row), int(columns)))
    br = max(16, _pow2_at_least(int(rank)))
    i32 = dict(dtype=torch.int32, device=device)
    return GroupedScratch(
        slots=torch.empty((rows, s), **i32),
        vals=torch.empty((rows, s), dtype=torch.float32, device=device),
        seg=torch.empty((columns, rows), **i32), counts=torch.empty((columns,), **i32),
        perm=torch.empty((rows,), **i32),
        buf=torch.empty((split_d(hidden), rows * s, br), dtype=torch.float32, device=device))


def _interpreting() -> bool:
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(grouped_jit._grouped_expand_kernel, InterpretedFunction)


def steer_grouped(
    hidden: torch.Tensor,  # [rows, hidden] fp32/fp16/bf16, unit stride along hidden
    p1: torch.Tensor,  # [hidden, C * rank], unit stride along columns: the bank, fixed layout
    p2: torch.Tensor,  # [hidden, C * rank], same dtype and strides as p1
    rank: int,  # columns of the bank per coefficient column
    table: torch.Tensor,  # [T, C] fp32 contiguous: coefficient rows (strength * epsilon)
    index: torch.Tensor | None,  # [rows] int32/int64: row i's table row, -1 padding; None: i
    out: torch.Tensor | None = None,  # [rows, hidden] like hidden, unit stride: written
    scratch: GroupedScratch | None = None,  # grouped_scratch(rows, C, S, rank, hidden)
    max_per_row: int | None = None,  # S (default: C); ignored with scratch (its S)
    widths: torch.Tensor | None = None,  # [C] int32: each column's steer rank (<= rank);
    #                                      None: every column ``rank`` wide
) -> torch.Tensor:
    """Steer ``hidden`` with ``table[index]``. Semantics: see vllm_steer.reference.

    Capture-safe: four launches whose grids depend on shapes only, no host read, nothing
    allocated when ``out`` and ``scratch`` are given. Each used steer's factors are read once
    per tile of its rows (with ``widths``, only their first ``widths[c]`` columns: a narrower
    steer's zero padding is never read); rows with no steer (and padding rows) come back bit for
    bit."""
    floats = (torch.float32, torch.float16, torch.bfloat16)
    rows, d = hidden.shape
    assert hidden.dtype in floats, f"hidden dtype must be one of {floats}, got {hidden.dtype}"
    assert hidden.stride(1) == 1, f"hidden needs unit stride along hidden, got {hidden.stride()}"
    assert p1.dtype == p2.dtype and p1.dtype in floats, (p1.dtype, p2.dtype)
    assert p1.shape == p2.shape and p1.shape[0] == d and p1.stride() == p2.stride() \
        and p1.stride(1) == 1, (tuple(p1.shape), tuple(p2.shape), p1.stride(), d)
    assert table.dtype == torch.float32 and table.dim() == 2 and table.is_contiguous(), \
        f"table must be float32 [T, C] contiguous, got {table.dtype} {tuple(table.shape)}"
    C = table.shape[1]
    rank = int(rank)
    assert p1.shape[1] == C * rank, \
        f"p1 has {p1.shape[1]} columns; the table's {C} columns of rank {rank} need {C * rank}"
    if index is None:
        assert table.shape[0] >= rows, (tuple(table.shape), rows)
    else:
        assert index.shape == (rows,) and index.dtype in (torch.int32, torch.int64), \
            (tuple(index.shape), index.dtype)
    if widths is not None:
        assert widths.shape == (C,) and widths.dtype == torch.int32, \
            f"widths must be int32 [{C}], got {widths.dtype} {tuple(widths.shape)}"
    if out is None:
        out = torch.empty_like(hidden, memory_format=torch.contiguous_format)
    assert out.shape == hidden.shape and out.dtype == hidden.dtype and out.stride(1) == 1, \
        (out.shape, out.dtype, out.stride())
    if scratch is None:
        scratch = grouped_scratch(rows, C, max_per_row or C, rank, d, hidden.device)
    S = scratch.slots.shape[1]
    assert scratch.slots.shape[0] == rows and scratch.seg.shape == (C, rows), \
        "the scratch was made for another row count or bank"
    assert scratch.buf.shape[0] == split_d(d) and scratch.buf.shape[1] == rows * S \
        and scratch.buf.shape[2] >= rank, \
        (f"the scratch was made for another hidden size or a lower rank: buf "
         f"{tuple(scratch.buf.shape)}, needs [{split_d(d)}, {rows * S}, >= {rank}]")
    if rows == 0:
        return out
    interpret = _interpreting()
    if hidden.device.type != "cuda" and not interpret:
        raise RuntimeError("the grouped steer op needs CUDA tensors (or TRITON_INTERPRET=1 "
                           "set before triton is imported); use ops.steer_fixed on the CPU")
    split = scratch.buf.shape[0]
    br = scratch.buf.shape[2]
    s_pad = max(2, _pow2_at_least(S))
    common = dict(FP32_PREC=FP32_PRECISION, INTERPRET=interpret)
    even_r = br == rank and widths is None
    w = widths if widths is not None else scratch.counts  # a pointer the kernels never read
    shrink_warps = {} if interpret else dict(num_warps=SHRINK_WARPS)
    expand_warps = {} if interpret else dict(num_warps=EXPAND_WARPS)
    grouped_jit._grouped_rows_kernel[(triton.cdiv(rows, BLOCK_M),)](
        table, index if index is not None else table, scratch.slots, scratch.vals,
        rows, table.shape[0], C, HAS_INDEX=index is not None, S=S, S_PAD=s_pad,
        BLOCK_M=BLOCK_M, C_CHUNK=max(16, min(128, _pow2_at_least(C))))
    grouped_jit._grouped_segments_kernel[(C + 1,)](
        scratch.slots, scratch.seg, scratch.counts, scratch.perm, rows, C,
        S=S, S_PAD=s_pad, CHUNK=max(16, min(256, _pow2_at_least(rows))))
    grouped_jit._grouped_shrink_kernel[(triton.cdiv(rows, BLOCK_M), C, split)](
        hidden, p1, scratch.seg, scratch.counts, w, scratch.buf,
        hidden.stride(0), p1.stride(0), rows, d, rank,
        S=S, BLOCK_M=BLOCK_M, BLOCK_R=br, BLOCK_D=SHRINK_D, SPLIT=split,
        HAS_WIDTHS=widths is not None, EVEN_R=even_r,
        EVEN_D=d % (SHRINK_D * split) == 0, MODE=_mode(hidden.dtype, p1.dtype), **common,
        **shrink_warps)
    grouped_jit._grouped_expand_kernel[(triton.cdiv(rows, BLOCK_M), triton.cdiv(d, EXPAND_D))](
        hidden, p2, scratch.slots, scratch.vals, scratch.perm, w, scratch.buf, out,
        hidden.stride(0), out.stride(0), p2.stride(0), rows, d, rank, C,
        S=S, S_PAD=s_pad, BLOCK_M=BLOCK_M, BLOCK_D=EXPAND_D, BLOCK_R=br, SPLIT=split,
        HAS_WIDTHS=widths is not None, EVEN_R=even_r, EVEN_D=d % EXPAND_D == 0,
        MODE=_mode(torch.float32, p1.dtype),
        **common, **expand_warps)
    return out


__all__ = ["GroupedScratch", "grouped_scratch", "steer_grouped", "split_d", "BLOCK_M"]
