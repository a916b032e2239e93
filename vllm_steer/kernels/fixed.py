"""The dense capture-safe steer op, in torch: rows whose coefficients are gathered on the
device from a table, applied with the bank read in place in its fixed layout. The op
:mod:`.capture_safe` runs off CUDA (the CPU; on CUDA it runs the grouped Triton op,
:mod:`.triton.grouped`, which reads only the steers in use). Semantics: see
:mod:`vllm_steer.reference`.

The fixed layout (:class:`vllm_steer.bank.SlotBank`): coefficient column ``k`` multiplies the
factors at columns ``[k * rank, (k + 1) * rank)`` of ``p1`` / ``p2`` (``[hidden, columns *
rank]``), a narrower steer padded with zero columns. Row ``i`` takes its coefficients from row
``index[i]`` of ``table`` (``[T, columns]`` fp32); ``index[i] = -1`` (a padding row) means all
zeros, and such a row, like every row whose coefficients are all zero, comes back bit for bit.

Why it can be recorded in a CUDA graph and replayed: the ops it launches and their shapes
depend only on the number of rows and the buffers' shapes, never on a value (no data-dependent
branch, no compaction of the active rows), and nothing is read back to the host. A graph that
recorded it reads, at each replay, whatever the table, the index and the factors hold then.

What that costs: every column of the bank is multiplied for every row, whether a row uses it
or not (two GEMMs of ``[rows, hidden] x [hidden, columns * rank]``).

Inside a graph each kernel still costs the GPU a few microseconds, however small its work, so
the op launches few: the two GEMMs, one scaling (the down-projection times each row's
coefficients, computed in fp32 and rounded once to the factors' dtype, with no repeated
coefficient row and no fp32 copy), one residual add (in fp32, rounded once to ``hidden``'s
dtype), and the test and the select that keep unsteered rows bit for bit. With ``index=None``
(row ``i`` takes table row ``i``) there is no gather either; with an index (the drafters' and
the LM head's graphs: each row's request slot) one gather of the rows' coefficients. With
``out`` the result is written where the graph's caller reads it, with no copy.
"""

from __future__ import annotations

import torch


def steer_fixed(
    hidden: torch.Tensor,  # [rows, hidden]
    p1: torch.Tensor,  # [hidden, columns * rank]: the bank's first factors, fixed layout
    p2: torch.Tensor,  # [hidden, columns * rank]
    rank: int,  # columns of the bank per coefficient column
    table: torch.Tensor,  # [T, columns] fp32: coefficient rows (strength * epsilon)
    index: torch.Tensor | None,  # [rows] int: row i's row of the table; -1: a padding row.
    #                              None: row i's row is i (T >= rows)
    out: torch.Tensor | None = None,  # [rows, hidden] of hidden's dtype: written, returned
) -> torch.Tensor:
    """Steer ``hidden`` with the coefficients ``table[index]``. Semantics: see reference.

    Capture-safe: no host read, ops and shapes independent of every value. The GEMMs run in
    the factors' dtype (fp32 accumulation inside), the scaling and the residual add in fp32,
    the result in ``hidden``'s dtype."""
    rows = hidden.shape[0]
    if index is None:
        assert table.shape[0] >= rows, (tuple(table.shape), rows)
        coefs = table[:rows]
    else:
        idx = index.long()
        coefs = table.index_select(0, idx.clamp(min=0)) * (idx >= 0).unsqueeze(1)
    columns = coefs.shape[1]
    assert p1.shape[1] == columns * rank, (tuple(p1.shape), columns, rank)
    down = hidden.to(p1.dtype) @ p1  # [rows, columns * rank]
    scaled = torch.empty_like(down)  # down * each column's coefficient, in fp32, rounded once
    torch.mul(down.view(rows, columns, rank), coefs.unsqueeze(2),
              out=scaled.view(rows, columns, rank))
    steered = torch.empty_like(hidden)  # hidden + the up-projection, in fp32, rounded once
    torch.add(hidden, scaled @ p2.T, out=steered)
    unsteered = (coefs == 0).all(dim=1, keepdim=True)
    if out is None:
        return torch.where(unsteered, hidden, steered)
    return torch.where(unsteered, hidden, steered, out=out)
