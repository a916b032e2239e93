"""Efficient pure-torch batched steer (the CPU path, and the CUDA fallback without Triton).

Semantics: see vllm_steer.reference (``steer_reference``).

Only the rows that carry a non-zero coefficient are touched, and zero coefficients are skipped.
Two strategies, picked per call from the sparsity pattern (``choose_strategy``):

- ``"concat"``: one down-projection of the active rows through the factors of the active
  steers concatenated (``[rows_a, d] @ [d, R_a]``), scaled by the coefficients expanded along
  rank, one up-projection. Few big GEMMs: best when most active rows use most active steers.
- ``"gather"``: per active steer, down-project, scale and up-project only the rows that use it
  (gathered once for all steers, scattered back with one ``index_add``; a steer used by every
  active row works on them in place). Work proportional to sum_k rows_k * rank_k: best when
  each row uses one steer of many.

Math in fp32 (16-bit factors are upcast per used steer, as the reference does), output in the
activation dtype; unsteered rows are copied bit for bit.

Host syncs: the active-row/steer sets are read on the host (``nonzero``/``tolist``), which on
CUDA costs a few device-to-host syncs per call; the Triton kernel is the sync-free CUDA path.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import torch


def _offsets(rank_offsets) -> list[int]:
    if isinstance(rank_offsets, torch.Tensor):
        return [int(o) for o in rank_offsets.tolist()]
    return [int(o) for o in rank_offsets]


# Cost model of choose_strategy, in microseconds, measured on the development CPU (AMD EPYC,
# 2 shared cores; see benchmarks/RESULTS.md "## Kernels"). Only the ratios matter.
US_PER_FLOP = 1 / 60e3  # fp32 GEMM at ~60 GFLOP/s
US_PER_GEMM = 8.0  # floor of one small GEMM
US_PER_OP = 4.0  # one small torch op (dispatch, allocation)
US_PER_GATHER_BYTE = 1e-4  # index_select + index_add of gathered rows (~10 GB/s)
US_PER_CAT_BYTE = (1e-4, 5e-4)  # concatenating factor columns: in cache / beyond 4 MB


def _gemm_pair_us(m: int, d: int, r: int) -> float:
    """Down- plus up-projection of m rows through a rank-r steer."""
    return 2 * max(2 * m * d * r * US_PER_FLOP, US_PER_GEMM)


def _cat_us(nbytes: int) -> float:
    return nbytes * US_PER_CAT_BYTE[nbytes > 4 * 2 ** 20]


class Plan(NamedTuple):
    strategy: str  # "concat" or "gather"
    rows: torch.Tensor | None  # active rows, None when every row is active
    steers: list[int]  # steers with a non-zero coefficient and a non-zero rank
    counts: list[int]  # rows per steer (all K)


def choose_strategy(nz: torch.Tensor, offs: list[int], hidden_size: int) -> Plan:
    """Pick ``"concat"`` or ``"gather"`` from the non-zero pattern ``nz`` ([rows, K] bool).

    The pick minimises a cost model: GEMM flops (with a floor per GEMM), a fixed cost per torch
    op, the bytes of gathered rows (``gather``) and of concatenated factor columns (``concat``
    over a subset of the steers).
    """
    num_rows, K = nz.shape
    d = hidden_size
    counts = nz.sum(dim=0).tolist()
    steers = [k for k, c in enumerate(counts) if c and offs[k + 1] > offs[k]]
    rows = None
    if not steers or max(counts) < num_rows:  # some row may be unsteered
        rows = nz.any(dim=1).nonzero().flatten()
        if rows.numel() == num_rows:
            rows = None
    if len(steers) <= 1:
        return Plan("concat", rows, steers, counts)
    n_active = num_rows if rows is None else rows.numel()
    ranks = {k: offs[k + 1] - offs[k] for k in steers}
    total = sum(ranks.values())
    subset = len(steers) < K
    concat = (_gemm_pair_us(n_active, d, total) + 6 * US_PER_OP
              + (_cat_us(2 * d * total * 4) + (2 * len(steers) + 4) * US_PER_OP if subset else 0))
    partial = [k for k in steers if counts[k] < n_active]
    pairs = sum(counts[k] for k in partial)
    gather = (sum(_gemm_pair_us(counts[k], d, ranks[k]) + 4 * US_PER_OP for k in steers)
              + (pairs * d * 4 * US_PER_GATHER_BYTE + 12 * US_PER_OP if partial else 0))
    return Plan("concat" if concat <= gather else "gather", rows, steers, counts)


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
    assert p1.shape == p2.shape == (d, offs[-1]), \
        f"p1 {tuple(p1.shape)} and p2 {tuple(p2.shape)} must be [hidden={d}, total_rank={offs[-1]}]"
    assert coefs.dtype == torch.float32 and coefs.shape == (num_rows, K), \
        f"coefs must be float32 [num_rows={num_rows}, K={K}], got {coefs.dtype} {tuple(coefs.shape)}"
    if out is not None:
        assert out.shape == hidden.shape and out.dtype == hidden.dtype, (out.shape, out.dtype)
    if num_rows == 0 or K == 0:
        return hidden.clone() if out is None else out.copy_(hidden)
    nz = coefs != 0
    auto, rows, steers, counts = choose_strategy(nz, offs, d)
    strategy = strategy or auto
    if strategy not in ("concat", "gather"):
        raise ValueError(f"unknown strategy {strategy!r}; choose 'concat' or 'gather'")
    if not steers:
        return hidden.clone() if out is None else out.copy_(hidden)
    if rows is None:  # every row is written below
        out = torch.empty_like(hidden) if out is None else out
        c = hidden.to(torch.float32, copy=True)  # [rows, d]
        co, local = coefs, nz
    else:  # unsteered rows: the input, bit for bit
        out = hidden.clone() if out is None else out.copy_(hidden)
        c = hidden.index_select(0, rows).float()  # [rows_a, d]
        co, local = coefs.index_select(0, rows), nz.index_select(0, rows)
    if strategy == "concat" or len(steers) == 1:
        if len(steers) == 1:
            k = steers[0]
            cols = lambda p: p[:, offs[k]:offs[k + 1]]  # noqa: E731
            scale = co[:, k:k + 1]
        else:
            if len(steers) == K:
                cols = lambda p: p  # noqa: E731  (no copy when the factors are fp32)
                scale = co
            else:
                cols = lambda p: torch.cat([p[:, offs[k]:offs[k + 1]] for k in steers], 1)  # noqa
                scale = co.index_select(1, torch.tensor(steers, device=co.device))
            ranks = [offs[k + 1] - offs[k] for k in steers]
            scale = torch.repeat_interleave(scale, torch.tensor(ranks, device=co.device), dim=1,
                                            output_size=sum(ranks))
        # One fp32 factor alive at a time: two fresh multi-MB copies at once make the CPU
        # allocator return fresh pages each call (page faults cost more than the GEMMs).
        down = c @ cols(p1).float()  # [rows_a, R_a]
        down.mul_(scale)
        c.addmm_(down, cols(p2).float().T)  # c + delta, fp32
    else:
        # Steers used by every active row: GEMMs on c itself. The others: all their
        # (row, steer) pairs gathered at once, grouped by steer, two GEMMs per steer on a
        # contiguous slice, one scatter-add back.
        n_active = c.shape[0]
        delta = torch.zeros_like(c)
        partial = [k for k in steers if counts[k] < n_active]
        for k in steers:
            if counts[k] == n_active:
                down = c @ p1[:, offs[k]:offs[k + 1]].float()
                down.mul_(co[:, k:k + 1])
                delta.addmm_(down, p2[:, offs[k]:offs[k + 1]].float().T)
        if partial:
            sel = torch.tensor(partial, device=c.device)
            pairs = local.index_select(1, sel).T.nonzero()  # [P, 2] (i, row), sorted by i
            pair_rows = pairs[:, 1].contiguous()
            pair_coef = co.index_select(1, sel).T[pairs[:, 0], pair_rows]  # [P]
            cp = c.index_select(0, pair_rows)  # [P, d]
            dp = torch.empty_like(cp)
            start = 0
            for k in partial:
                a, b, n = offs[k], offs[k + 1], counts[k]
                down = cp[start:start + n] @ p1[:, a:b].float()
                down.mul_(pair_coef[start:start + n, None])
                torch.mm(down, p2[:, a:b].float().T, out=dp[start:start + n])
                start += n
            delta.index_add_(0, pair_rows, dp)
        c.add_(delta)
    if rows is None:
        out.copy_(c)
    else:
        out.index_copy_(0, rows, c.to(hidden.dtype))
    return out
