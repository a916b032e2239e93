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

Planning (:func:`prepare_torch`) reads the active-row/steer sets on the host
(``nonzero``/``tolist``: a few device-to-host syncs on CUDA) and slices/up-casts the factors;
its result is reusable while the coefficients do not change, which is how the serving path
calls it (re-planned only when the batch's steering changes, so a decode step of an unchanged
batch runs the GEMMs alone). The Triton kernel is the sync-free CUDA path.
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


class Prepared(NamedTuple):
    """Everything :func:`steer_torch` derives from the coefficients and the factors alone.

    Made by :func:`prepare_torch`; reusable for as long as the coefficients do not change (the
    decode steps of an unchanged batch), so a step pays only for the GEMMs: no planning, no
    host reads of the coefficients, no factor slicing (and, with ``upcast``, no up-casting).
    Factors are those of the bank (views, or concatenated columns), up-cast to fp32 when the
    plan was made with ``upcast=True``, else at use.
    """

    num_rows: int
    rows: torch.Tensor | None  # active rows, None when every row is active
    empty: bool  # no steer to apply (every coefficient zero, or zero-rank steers only)
    # concat: one down- and one up-projection through the active steers' factors
    down: torch.Tensor | None  # [hidden, R_a]
    up: torch.Tensor | None  # [hidden, R_a]
    scale: torch.Tensor | None  # [rows_a, R_a] fp32: coefficients expanded along rank
    # gather: steers used by every active row work on them in place; the others on the
    # gathered (row, steer) pairs, grouped by steer
    full: list  # [(down [d, r], up [d, r], coef [rows_a, 1])]
    pair_rows: torch.Tensor | None  # [P] active-row index of each pair, grouped by steer
    groups: list  # [(start, n, down [d, r], up [d, r], coef [n, 1])]


def _f32(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.float32 else t.float()


def prepare_torch(
    p1: torch.Tensor,  # [hidden, total_rank]
    p2: torch.Tensor,  # [hidden, total_rank]
    rank_offsets: Sequence[int] | torch.Tensor,  # K + 1 ints
    coefs: torch.Tensor,  # [num_rows, K] fp32
    strategy: str | None = None,  # "concat" / "gather" to force one (benchmarks, tests)
    upcast: bool = True,  # keep fp32 copies of 16-bit factors in the plan (for reuse)
) -> Prepared:
    """Plan one batch's steering for :func:`steer_torch` (see :class:`Prepared`).

    ``upcast=False`` (a plan used once, by :func:`steer_torch` itself) leaves the up-casting
    to the run, one factor at a time: several fresh multi-MB fp32 copies alive at once make
    the CPU allocator fault in new pages on every call, which costs more than the GEMMs.
    """
    f32 = _f32 if upcast else (lambda t: t)
    offs = _offsets(rank_offsets)
    K = len(offs) - 1
    num_rows = coefs.shape[0]
    d = p1.shape[0]
    assert p1.shape == p2.shape == (d, offs[-1]), \
        f"p1 {tuple(p1.shape)} and p2 {tuple(p2.shape)} must be [hidden, total_rank={offs[-1]}]"
    assert coefs.dtype == torch.float32 and coefs.dim() == 2 and coefs.shape[1] == K, \
        f"coefs must be float32 [num_rows, K={K}], got {coefs.dtype} {tuple(coefs.shape)}"
    none = Prepared(num_rows, None, True, None, None, None, [], None, [])
    if num_rows == 0 or K == 0:
        return none
    nz = coefs != 0
    auto, rows, steers, counts = choose_strategy(nz, offs, d)
    strategy = strategy or auto
    if strategy not in ("concat", "gather"):
        raise ValueError(f"unknown strategy {strategy!r}; choose 'concat' or 'gather'")
    if not steers:
        return none
    co, local = (coefs, nz) if rows is None else (coefs.index_select(0, rows),
                                                  nz.index_select(0, rows))
    if strategy == "concat" or len(steers) == 1:
        if len(steers) == 1:
            a, b = offs[steers[0]], offs[steers[0] + 1]
            down, up = p1[:, a:b], p2[:, a:b]
            scale = co[:, steers[0]:steers[0] + 1].contiguous()
        else:
            if len(steers) == K:
                down, up, scale = p1, p2, co
            else:
                down = torch.cat([p1[:, offs[k]:offs[k + 1]] for k in steers], 1)
                up = torch.cat([p2[:, offs[k]:offs[k + 1]] for k in steers], 1)
                scale = co.index_select(1, torch.tensor(steers, device=co.device))
            ranks = [offs[k + 1] - offs[k] for k in steers]
            scale = torch.repeat_interleave(scale, torch.tensor(ranks, device=co.device), dim=1,
                                            output_size=sum(ranks))
        return Prepared(num_rows, rows, False, f32(down), f32(up), scale.contiguous(), [], None,
                        [])
    n_active = co.shape[0]
    full, groups = [], []
    partial = [k for k in steers if counts[k] < n_active]
    for k in steers:
        if counts[k] == n_active:
            a, b = offs[k], offs[k + 1]
            full.append((f32(p1[:, a:b]), f32(p2[:, a:b]), co[:, k:k + 1].contiguous()))
    pair_rows = None
    if partial:
        sel = torch.tensor(partial, device=co.device)
        pairs = local.index_select(1, sel).T.nonzero()  # [P, 2] (i, row), sorted by i
        pair_rows = pairs[:, 1].contiguous()
        pair_coef = co.index_select(1, sel).T[pairs[:, 0], pair_rows]  # [P]
        start = 0
        for k in partial:
            a, b, n = offs[k], offs[k + 1], counts[k]
            groups.append((start, n, f32(p1[:, a:b]), f32(p2[:, a:b]),
                           pair_coef[start:start + n, None].contiguous()))
            start += n
    return Prepared(num_rows, rows, False, None, None, None, full, pair_rows, groups)


def steer_torch(
    hidden: torch.Tensor,  # [num_rows, hidden] fp32/fp16/bf16
    p1: torch.Tensor,  # [hidden, total_rank]
    p2: torch.Tensor,  # [hidden, total_rank]
    rank_offsets: Sequence[int] | torch.Tensor,  # K + 1 ints
    coefs: torch.Tensor,  # [num_rows, K] fp32
    out: torch.Tensor | None = None,  # [num_rows, hidden] like hidden (allocated if None)
    strategy: str | None = None,  # "concat" / "gather" to force one (benchmarks, tests)
    prepared: Prepared | None = None,  # from prepare_torch on these factors and coefs
) -> torch.Tensor:
    """Batched steer in torch. Semantics: see vllm_steer.reference (``steer_reference``).

    ``prepared`` (from :func:`prepare_torch` with the same factors and coefficients) skips
    the planning: the caller promises the coefficients did not change since.
    """
    num_rows, d = hidden.shape
    assert hidden.dtype in (torch.float32, torch.float16, torch.bfloat16), hidden.dtype
    if prepared is None:
        prepared = prepare_torch(p1, p2, rank_offsets, coefs, strategy, upcast=False)
    assert prepared.num_rows == num_rows and p1.shape[0] == d, \
        f"prepared for {prepared.num_rows} rows of hidden {p1.shape[0]}, got {tuple(hidden.shape)}"
    if out is not None:
        assert out.shape == hidden.shape and out.dtype == hidden.dtype, (out.shape, out.dtype)
    if prepared.empty:
        return hidden.clone() if out is None else out.copy_(hidden)
    rows = prepared.rows
    if rows is None:  # every row is written below
        out = torch.empty_like(hidden) if out is None else out
        c = hidden.to(torch.float32, copy=True)  # [rows, d]
    else:  # unsteered rows: the input, bit for bit
        out = hidden.clone() if out is None else out.copy_(hidden)
        c = hidden.index_select(0, rows).float()  # [rows_a, d]
    # _f32: a no-op on an up-cast plan's factors, else one fp32 factor alive at a time
    if prepared.down is not None:  # concat
        down = c @ _f32(prepared.down)  # [rows_a, R_a]
        down.mul_(prepared.scale)
        c.addmm_(down, _f32(prepared.up).T)  # c + delta, fp32
    else:  # gather
        delta = torch.zeros_like(c) if prepared.full else None
        for w1, w2, coef in prepared.full:
            down = c @ _f32(w1)
            down.mul_(coef)
            delta.addmm_(down, _f32(w2).T)
        if prepared.groups:
            cp = c.index_select(0, prepared.pair_rows)  # [P, d]
            dp = torch.empty_like(cp)
            for start, n, w1, w2, coef in prepared.groups:
                down = cp[start:start + n] @ _f32(w1)
                down.mul_(coef)
                torch.mm(down, _f32(w2).T, out=dp[start:start + n])
            c.index_add_(0, prepared.pair_rows, dp)
        if delta is not None:
            c.add_(delta)
    if rows is None:
        out.copy_(c)
    else:
        out.index_copy_(0, rows, c.to(hidden.dtype))
    return out
