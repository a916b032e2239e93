"""Efficient pure-torch batched steer (the CPU path, and the CUDA fallback without Triton).

Semantics: see vllm_steer.reference (``steer_reference``).

Only the rows that carry a non-zero coefficient are touched, and zero coefficients are skipped.
Two strategies, picked per call from the sparsity pattern (``choose_strategy``):

- ``"concat"``: one down-projection of the active rows through the factors of the active
  steers concatenated (``[rows_a, d] @ [d, R_a]``), scaled by the coefficients expanded along
  rank, one up-projection. Few big GEMMs: best when most active rows use most active steers.
- ``"gather"``: per active steer, gather its rows, down-project, scale, up-project, and
  ``index_add`` into the fp32 delta. Work proportional to sum_k rows_k * rank_k: best when each
  row uses one steer of many.

Math in fp32 (16-bit factors are upcast per used steer, as the reference does), output in the
activation dtype; unsteered rows are copied bit for bit.

Host syncs: the active-row/steer sets are read on the host (``nonzero``/``tolist``), which on
CUDA is one device-to-host sync per call; the Triton kernel is the sync-free CUDA path.
"""

from __future__ import annotations

from typing import Sequence

import torch

#: "concat" is chosen when its multiply-adds are at most this many times those of "gather"
#: (one GEMM amortises better than K small ones plus gathers); measured on CPU, see
#: benchmarks/RESULTS.md ("## Kernels").
CONCAT_WASTE_LIMIT = 1.5
#: ... and always when the per-steer loop would run at most this many steers.
GATHER_MIN_STEERS = 2


def _offsets(rank_offsets) -> list[int]:
    if isinstance(rank_offsets, torch.Tensor):
        return [int(o) for o in rank_offsets.tolist()]
    return [int(o) for o in rank_offsets]


def choose_strategy(nz: torch.Tensor, offs: list[int]) -> tuple[str, torch.Tensor, list[int]]:
    """Pick ``"concat"`` or ``"gather"`` from the non-zero pattern ``nz`` ([rows, K] bool).

    Returns ``(strategy, active_rows, active_steers)``.
    """
    row_any = nz.any(dim=1)
    rows = row_any.nonzero().flatten()
    counts = nz.sum(dim=0).tolist()
    steers = [k for k, c in enumerate(counts) if c and offs[k + 1] > offs[k]]
    if len(steers) < GATHER_MIN_STEERS:
        return "concat", rows, steers
    concat_work = rows.numel() * sum(offs[k + 1] - offs[k] for k in steers)
    gather_work = sum(counts[k] * (offs[k + 1] - offs[k]) for k in steers)
    strategy = "concat" if concat_work <= CONCAT_WASTE_LIMIT * gather_work else "gather"
    return strategy, rows, steers


def steer_torch(
    hidden: torch.Tensor,  # [num_rows, hidden] fp32/fp16/bf16
    p1: torch.Tensor,  # [hidden, total_rank]
    p2: torch.Tensor,  # [hidden, total_rank]
    rank_offsets: Sequence[int] | torch.Tensor,  # K + 1 ints
    coefs: torch.Tensor,  # [num_rows, K] fp32
    out: torch.Tensor | None = None,  # [num_rows, hidden] like hidden (allocated if None)
    strategy: str | None = None,  # "concat" / "gather" to force one (benchmarks, tests)
) -> torch.Tensor:
    """Batched steer in torch. Semantics: see vllm_steer.reference (``steer_reference``)."""
    offs = _offsets(rank_offsets)
    K = len(offs) - 1
    num_rows, d = hidden.shape
    assert hidden.dtype in (torch.float32, torch.float16, torch.bfloat16), hidden.dtype
    assert p1.shape == p2.shape == (d, offs[-1]), (p1.shape, p2.shape, d, offs[-1])
    assert coefs.dtype == torch.float32 and coefs.shape == (num_rows, K), (coefs.dtype, coefs.shape)
    if out is not None:
        assert out.shape == hidden.shape and out.dtype == hidden.dtype, (out.shape, out.dtype)
    if num_rows == 0 or K == 0:
        return hidden.clone() if out is None else out.copy_(hidden)
    nz = coefs != 0
    auto, rows, steers = choose_strategy(nz, offs)
    strategy = strategy or auto
    if not steers:
        return hidden.clone() if out is None else out.copy_(hidden)
    all_rows = rows.numel() == num_rows
    if all_rows:  # every row is written below
        out = torch.empty_like(hidden) if out is None else out
        c = hidden.to(torch.float32, copy=True)  # [rows, d]
    else:  # unsteered rows: the input, bit for bit
        out = hidden.clone() if out is None else out.copy_(hidden)
        c = hidden.index_select(0, rows).float()  # [rows_a, d]
    if strategy == "concat":
        if len(steers) == K:
            w1, w2 = p1.float(), p2.float()  # no copy when the factors are fp32
            scale = coefs if all_rows else coefs.index_select(0, rows)
            ranks = torch.tensor([offs[k + 1] - offs[k] for k in range(K)], device=coefs.device)
        else:
            cols = [slice(offs[k], offs[k + 1]) for k in steers]
            w1 = torch.cat([p1[:, s] for s in cols], dim=1).float()
            w2 = torch.cat([p2[:, s] for s in cols], dim=1).float()
            idx = torch.tensor(steers, device=coefs.device)
            scale = coefs.index_select(1, idx)
            scale = scale if all_rows else scale.index_select(0, rows)
            ranks = torch.tensor([offs[k + 1] - offs[k] for k in steers], device=coefs.device)
        down = c @ w1  # [rows_a, R_a]
        down.mul_(torch.repeat_interleave(scale, ranks, dim=1, output_size=down.shape[1]))
        c.addmm_(down, w2.T)  # c + delta, fp32
    elif strategy == "gather":
        delta = torch.zeros_like(c)
        local = nz if all_rows else nz.index_select(0, rows)
        co = coefs if all_rows else coefs.index_select(0, rows)
        for k in steers:
            a, b = offs[k], offs[k + 1]
            idx = local[:, k].nonzero().flatten()
            if idx.numel() == c.shape[0]:
                down = c @ p1[:, a:b].float()
                down.mul_(co[:, k : k + 1])
                delta.addmm_(down, p2[:, a:b].float().T)
            else:
                down = c.index_select(0, idx) @ p1[:, a:b].float()
                down.mul_(co.index_select(0, idx)[:, k : k + 1])
                delta.index_add_(0, idx, down @ p2[:, a:b].float().T)
        c.add_(delta)
    else:
        raise ValueError(f"unknown strategy {strategy!r}; choose 'concat' or 'gather'")
    if all_rows:
        out.copy_(c)
    else:
        out.index_copy_(0, rows, c.to(hidden.dtype))
    return out
