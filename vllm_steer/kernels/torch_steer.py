"""Efficient pure-torch batched steer (the CPU path, and the CUDA fallback without Triton).

Semantics: see vllm_steer.reference (``steer_reference``).

Only the rows that carry a non-zero coefficient are touched, and zero coefficients are skipped.
Three strategies, picked per call from the sparsity pattern (``choose_strategy``):

- ``"concat"``: one down-projection of the active rows through the factors of the active
  steers concatenated (``[rows_a, d] @ [d, R_a]``), scaled by the coefficients expanded along
  rank, one up-projection. Few big GEMMs: best when most active rows use most active steers.
- ``"gather"``: per active steer, down-project, scale and up-project only the rows that use it
  (gathered once for all steers, scattered back with one ``index_add``; a steer used by every
  active row works on them in place). Work proportional to sum_k rows_k * rank_k: best when
  each row uses one steer of many.
- ``"bmm"``: ``gather`` with the steers of equal rank stacked: one batched down- and
  up-projection per rank for all of them, their rows padded to the largest group (padding
  reads a zero row and adds nothing). About 6 ops per rank instead of 3 per steer: best when
  many steers of one rank each take a few rows (the serving case: K steers over a batch).

Math in fp32 (16-bit factors are upcast per used steer, as the reference does), output in the
activation dtype; unsteered rows are copied bit for bit.

Planning (:func:`prepare_torch`) decides on the host from a numpy copy of the coefficients
(the serving path passes its host mirror: no device read, no sync; without one the tensor is
read once) and slices/up-casts the factors; index tensors go to the device from pinned memory.
Its result is reusable while the coefficients do not change, which is how the serving path
calls it (re-planned only when the batch's steering changes, so a decode step of an unchanged
batch runs the GEMMs alone).
"""

from __future__ import annotations

import itertools
from typing import NamedTuple, Sequence

import numpy as np
import torch

from vllm_steer.kernels import staging
from vllm_steer.kernels.layout import rank_offsets_list
from vllm_steer.kernels.staging import to_device


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


STRATEGIES = ("concat", "gather", "bmm")


def _stacked_us(ns: list[int], d: int, r: int) -> float:
    """The steers of one rank (``ns`` rows each) in one batched pair of GEMMs, rows padded."""
    return 2 * max(2 * len(ns) * max(ns) * d * r * US_PER_FLOP, US_PER_GEMM) + 6 * US_PER_OP


def _by_rank(steers: list[int], ranks: dict[int, int]) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for k in steers:
        out.setdefault(ranks[k], []).append(k)
    return out


class Plan(NamedTuple):
    strategy: str  # one of STRATEGIES
    rows: np.ndarray | None  # active rows (host, int64), None when every row is active
    steers: list[int]  # steers with a non-zero coefficient and a non-zero rank
    counts: list[int]  # rows per steer (all K)


def _host_bool(nz) -> np.ndarray:
    """A non-zero pattern as a host numpy array (a torch tensor is read: on CUDA, a sync)."""
    if isinstance(nz, np.ndarray):
        return nz.astype(bool, copy=False)
    return nz.detach().cpu().numpy().astype(bool, copy=False)


def choose_strategy(nz, offs: list[int], hidden_size: int,
                    reuse: bool = True) -> Plan:
    """Pick one of :data:`STRATEGIES` from the non-zero pattern ``nz`` ([rows, K] bool; a
    numpy array, as the serving path gives it from its host mirror, or a tensor, read once).

    ``bmm`` only for a plan that will be reused: stacking the factors copies them, which one
    call does not pay back (measured up to 9x slower than ``gather`` when planned per call).

    The pick minimises a cost model: GEMM flops (with a floor per GEMM, padded rows counted for
    ``bmm``), a fixed cost per torch op, the bytes of gathered rows (``gather``, ``bmm``) and of
    concatenated factor columns (``concat`` over a subset of the steers).
    """
    nz = _host_bool(nz)
    num_rows, K = nz.shape
    d = hidden_size
    counts = nz.sum(axis=0).tolist()
    steers = [k for k, c in enumerate(counts) if c and offs[k + 1] > offs[k]]
    rows = None
    if not steers or max(counts) < num_rows:  # some row may be unsteered
        rows = np.flatnonzero(nz.any(axis=1))
        if rows.size == num_rows:
            rows = None
    if len(steers) <= 1:
        return Plan("concat", rows, steers, counts)
    n_active = num_rows if rows is None else rows.size
    ranks = {k: offs[k + 1] - offs[k] for k in steers}
    total = sum(ranks.values())
    subset = len(steers) < K
    concat = (_gemm_pair_us(n_active, d, total) + 6 * US_PER_OP
              + (_cat_us(2 * d * total * 4) + (2 * len(steers) + 4) * US_PER_OP if subset else 0))
    partial = [k for k in steers if counts[k] < n_active]
    pairs = sum(counts[k] for k in partial)
    loop = {k: _gemm_pair_us(counts[k], d, ranks[k]) + 4 * US_PER_OP for k in steers}
    moved = pairs * d * 4 * US_PER_GATHER_BYTE + 12 * US_PER_OP if partial else 0
    gather = sum(loop.values()) + moved
    # bmm stacks every rank shared by several partial steers: what that saves over the loop
    saved = sum(sum(loop[k] for k in ks) - _stacked_us([counts[k] for k in ks], d, r)
                for r, ks in _by_rank(partial, ranks).items() if len(ks) > 1)
    bmm = gather - saved
    if not reuse:
        saved, bmm = 0.0, gather
    best = "concat" if concat <= min(gather, bmm) else "bmm" if saved > 0 else "gather"
    return Plan(best, rows, steers, counts)


class TorchPlan(NamedTuple):
    """Everything :func:`steer_torch` derives from the coefficients and the factors alone.

    Made by :func:`prepare_torch`; reusable for as long as the coefficients do not change (the
    decode steps of an unchanged batch), so a step pays only for the GEMMs: no planning, no
    host reads of the coefficients, no factor slicing (and, for reuse, no up-casting).
    Factors are those of the bank (views, or concatenated columns), up-cast to fp32 when the
    plan was made for reuse, else at use.
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
    # bmm: steers of one rank stacked, their rows padded to the largest group with the index
    # rows_a, a zero row appended to the active rows
    stacks: tuple = ()  # [(rows [G * n_max], down [G, d, r], up_t [G, r, d], coef [G, n_max, 1])]


def _f32(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.float32 else t.float()


def prepare_torch(
    p1: torch.Tensor,  # [hidden, total_rank]
    p2: torch.Tensor,  # [hidden, total_rank]
    rank_offsets: Sequence[int] | torch.Tensor,  # K + 1 ints
    coefs: torch.Tensor,  # [num_rows, K] fp32
    strategy: str | None = None,  # one of STRATEGIES to force it (benchmarks, tests)
    reuse: bool = True,  # the plan will run many times (the serving path)
    host: np.ndarray | None = None,  # [num_rows, K]: ``coefs`` on the host (no device read)
) -> TorchPlan:
    """Plan one batch's steering for :func:`steer_torch` (see :class:`TorchPlan`).

    A plan for reuse keeps fp32 copies of 16-bit factors and may stack factors for ``bmm``:
    copies made once and paid back over the steps. ``reuse=False`` (a plan used once, by
    :func:`steer_torch` itself) makes no such copies: the up-casting is left to the run, one
    factor at a time (several fresh multi-MB fp32 copies alive at once make the CPU allocator
    fault in new pages on every call, which costs more than the GEMMs), and ``bmm`` is only
    used when forced.

    Every decision (active rows, steers, counts, strategy, gathered pairs) is made on the host
    from ``host`` (a numpy copy of ``coefs``; without it ``coefs`` is read once, which on CUDA
    is a sync); index tensors are built on the host and copied to the device from pinned
    memory (:func:`vllm_steer.kernels.staging.to_device`). The device ops of a plan only
    gather and scale.
    """
    staging.check_not_capturing(coefs.device)
    f32 = _f32 if reuse else (lambda t: t)
    offs = rank_offsets_list(rank_offsets)
    K = len(offs) - 1
    num_rows = coefs.shape[0]
    d = p1.shape[0]
    dev = coefs.device
    assert p1.shape == p2.shape == (d, offs[-1]), \
        f"p1 {tuple(p1.shape)} and p2 {tuple(p2.shape)} must be [hidden, total_rank={offs[-1]}]"
    assert coefs.dtype == torch.float32 and coefs.dim() == 2 and coefs.shape[1] == K, \
        f"coefs must be float32 [num_rows, K={K}], got {coefs.dtype} {tuple(coefs.shape)}"
    none = TorchPlan(num_rows, None, True, None, None, None, [], None, [])
    if num_rows == 0 or K == 0:
        return none
    nz = _host_bool(host != 0 if host is not None else coefs != 0)
    assert nz.shape == (num_rows, K), f"host coefficients {nz.shape} for coefs {tuple(coefs.shape)}"
    auto, rows_h, steers, counts = choose_strategy(nz, offs, d, reuse)
    strategy = strategy or auto
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; choose one of {STRATEGIES}")
    if not steers:
        return none
    if rows_h is None:
        rows, co, local = None, coefs, nz
    else:
        rows = to_device(rows_h, dev)
        co, local = coefs.index_select(0, rows), nz[rows_h]
    if strategy == "concat" or len(steers) == 1:
        if len(steers) == 1:
            a, b = offs[steers[0]], offs[steers[0] + 1]
            down, up = p1[:, a:b], p2[:, a:b]
            scale = co[:, steers[0]:steers[0] + 1].contiguous()
        else:
            ranks = [offs[k + 1] - offs[k] for k in steers]
            if len(steers) == K:
                down, up = p1, p2
            else:
                down = torch.cat([p1[:, offs[k]:offs[k + 1]] for k in steers], 1)
                up = torch.cat([p2[:, offs[k]:offs[k + 1]] for k in steers], 1)
            # coefficients expanded along rank: one gather through a host-built column index
            cols = np.repeat(np.asarray(steers, dtype=np.int64), ranks)
            scale = co.index_select(1, to_device(cols, dev))
        return TorchPlan(num_rows, rows, False, f32(down), f32(up), scale.contiguous(), [], None,
                        [])
    n_active = co.shape[0]
    full, groups = [], []
    partial = [k for k in steers if counts[k] < n_active]
    for k in steers:
        if counts[k] == n_active:
            a, b = offs[k], offs[k + 1]
            full.append((f32(p1[:, a:b]), f32(p2[:, a:b]), co[:, k:k + 1].contiguous()))
    pair_rows, stacks = None, []
    if partial:
        sel = np.asarray(partial, dtype=np.int64)
        pi, pr = np.nonzero(local[:, sel].T)  # pairs (i, row), sorted by i, rows in order
        # the pairs' coefficients: one gather from the flattened active rows
        all_coef = co.reshape(-1).index_select(0, to_device(pr * K + sel[pi], dev))  # [P]
        seg, start = {}, 0
        for k in partial:
            seg[k] = slice(start, start + counts[k])
            start += counts[k]
        looped = partial
        if strategy == "bmm":
            looped = []
            for ks in _by_rank(partial, {k: offs[k + 1] - offs[k] for k in partial}).values():
                if len(ks) == 1:
                    looped += ks
                    continue
                n_max = max(counts[k] for k in ks)
                # padding: the row index n_active (a zero row) and the pair index P (a zero)
                idx = np.full((len(ks), n_max), n_active, dtype=np.int64)
                pick = np.full((len(ks), n_max), pr.size, dtype=np.int64)
                for g, k in enumerate(ks):
                    idx[g, :counts[k]] = pr[seg[k]]
                    pick[g, :counts[k]] = np.arange(seg[k].start, seg[k].stop)
                padded = torch.cat([all_coef, all_coef.new_zeros(1)])
                coef = padded.index_select(0, to_device(pick.ravel(), dev)).view(
                    len(ks), n_max, 1)
                down, up_t = _stacked_factors(p1, p2, offs, ks, f32)  # [G, d, r], [G, r, d]
                stacks.append((to_device(idx.ravel(), dev), down, up_t, coef))
        if looped:
            pair_rows = to_device(np.concatenate([pr[seg[k]] for k in looped]), dev)
            start = 0
            for k in looped:
                a, b, n = offs[k], offs[k + 1], counts[k]
                groups.append((start, n, f32(p1[:, a:b]), f32(p2[:, a:b]),
                               all_coef[seg[k], None].contiguous()))
                start += n
    return TorchPlan(num_rows, rows, False, None, None, None, full, pair_rows, groups,
                    tuple(stacks))


# The factors of a bank, stacked per rank ([G, d, r] and [G, r, d]), for the 'bmm' strategy:
# made once per bank (a bank changes only when steers are loaded or unloaded) instead of
# slicing and stacking the steers of a batch at every re-plan (K slices of strided columns:
# 0.3 s at K = 256, rank 64, d = 576 on the development CPU). The last two banks are kept, one
# entry per bank: a bank rewritten in place (a load or an unload: same tensors, new version)
# replaces its stale stacks, an fp32 copy of every column of that rank (twice a 16-bit bank),
# rather than keeping them beside the new ones.
_STACKS: dict = {}


def _stacked_factors(p1, p2, offs: list[int], ks: list[int], f32) -> tuple:
    """``(down [G, d, r], up_t [G, r, d])`` of steers ``ks`` (one rank ``r``) of this bank."""
    r = offs[ks[0] + 1] - offs[ks[0]]
    key = (id(p1), id(p2), p1._version, p2._version, p1.shape, tuple(offs), f32 is _f32)
    entry = _STACKS.get(key)
    if entry is None or entry[0]() is not p1:
        import weakref

        for stale in [k for k, (ref, _) in _STACKS.items() if ref() is p1]:
            del _STACKS[stale]  # this bank's stacks before it was rewritten
        while len(_STACKS) >= 2:
            _STACKS.pop(next(iter(_STACKS)))
        entry = _STACKS[key] = (weakref.ref(p1), {})
    per_rank = entry[1]
    if r not in per_rank:
        same = [k for k in range(len(offs) - 1) if offs[k + 1] - offs[k] == r]
        d = p1.shape[0]
        if all(offs[a + 1] == offs[b] for a, b in itertools.pairwise(same)):  # adjacent columns
            a, b = offs[same[0]], offs[same[-1] + 1]
            down = p1[:, a:b].reshape(d, len(same), r).permute(1, 0, 2)
            up_t = p2[:, a:b].reshape(d, len(same), r).permute(1, 2, 0)
        else:
            down = torch.stack([p1[:, offs[k]:offs[k + 1]] for k in same])
            up_t = torch.stack([p2[:, offs[k]:offs[k + 1]].T for k in same])
        per_rank[r] = ({k: i for i, k in enumerate(same)}, f32(down).contiguous(),
                       f32(up_t).contiguous())
    pos, down_all, up_all = per_rank[r]
    if len(ks) == len(pos):
        return down_all, up_all
    sel = to_device(np.asarray([pos[k] for k in ks], dtype=np.int64), down_all.device)
    return down_all.index_select(0, sel), up_all.index_select(0, sel)


def steer_torch(
    hidden: torch.Tensor,  # [num_rows, hidden] fp32/fp16/bf16
    p1: torch.Tensor,  # [hidden, total_rank]
    p2: torch.Tensor,  # [hidden, total_rank]
    rank_offsets: Sequence[int] | torch.Tensor,  # K + 1 ints
    coefs: torch.Tensor,  # [num_rows, K] fp32
    out: torch.Tensor | None = None,  # [num_rows, hidden] like hidden (allocated if None)
    strategy: str | None = None,  # one of STRATEGIES to force it (benchmarks, tests)
    prepared: TorchPlan | None = None,  # from prepare_torch on these factors and coefs
) -> torch.Tensor:
    """Batched steer in torch. Semantics: see vllm_steer.reference (``steer_reference``).

    ``prepared`` (from :func:`prepare_torch` with the same factors and coefficients) skips
    the planning: the caller promises the coefficients did not change since. Refuses to run
    while a CUDA graph is being captured (steering runs outside CUDA graphs).
    """
    staging.check_not_capturing(hidden.device)
    num_rows, d = hidden.shape
    assert hidden.dtype in (torch.float32, torch.float16, torch.bfloat16), hidden.dtype
    if prepared is None:
        prepared = prepare_torch(p1, p2, rank_offsets, coefs, strategy, reuse=False)
    assert prepared.num_rows == num_rows and p1.shape[0] == d, \
        f"prepared for {prepared.num_rows} rows of hidden {p1.shape[0]}, got {tuple(hidden.shape)}"
    if out is not None:
        assert out.shape == hidden.shape and out.dtype == hidden.dtype, (out.shape, out.dtype)
    if prepared.empty:
        return hidden.clone() if out is None else out.copy_(hidden)
    rows = prepared.rows
    n_active = num_rows if rows is None else rows.numel()  # a device tensor's size: no sync
    # bmm pads its groups with the index n_active: a zero row after the active ones
    c_pad = hidden.new_empty(n_active + bool(prepared.stacks), d, dtype=torch.float32)
    c = c_pad[:n_active]  # [rows_a, d]
    if prepared.stacks:
        c_pad[n_active].zero_()
    if rows is None:  # every row is written below
        out = torch.empty_like(hidden) if out is None else out
        c.copy_(hidden)
    else:  # unsteered rows: the input, bit for bit
        out = hidden.clone() if out is None else out.copy_(hidden)
        c.copy_(hidden.index_select(0, rows))
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
        stacked = []  # every read of c comes before the first index_add into it
        for idx, w1, w2t, coef in prepared.stacks:
            x = c_pad.index_select(0, idx).view(coef.shape[0], coef.shape[1], d)
            down = torch.bmm(x, _f32(w1))  # [G, n_max, r]
            down.mul_(coef)
            stacked.append((idx, torch.bmm(down, _f32(w2t)).view(-1, d)))
        if prepared.groups:
            cp = c.index_select(0, prepared.pair_rows)  # [P, d]
            dp = torch.empty_like(cp)
            for start, n, w1, w2, coef in prepared.groups:
                down = cp[start:start + n] @ _f32(w1)
                down.mul_(coef)
                torch.mm(down, _f32(w2).T, out=dp[start:start + n])
            c.index_add_(0, prepared.pair_rows, dp)
        for idx, dx in stacked:  # padding rows add into the zero row, which is dropped
            c_pad.index_add_(0, idx, dx)
        if delta is not None:
            c.add_(delta)
    if rows is None:
        out.copy_(c)
    else:
        out.index_copy_(0, rows, c.to(hidden.dtype))
    return out
