"""Planning one batch's steering for the fused kernels (:func:`prepare_triton`): checks of the
factors and coefficients, the tiles, the bank's tables, the segments and the scratch.

All of it depends only on the coefficients' non-zero pattern and the shapes, so the serving path
plans once per change of the batch's steering and each decode step pays for the two GEMM
launches alone (host time per call on an H100: about 160-360 us planned per call, the
launches' own cost once planned; benchmarks/RESULTS.md). The serving path passes a host copy
of the coefficients (``host=``): the segments are then computed in numpy
(:func:`.segments.segments_host`) and copied in one pinned non-blocking copy instead of the
segments launch.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import torch

from vllm_steer.kernels import batch_invariant, staging
from vllm_steer.kernels.layout import rank_offsets_list

from . import tiling
from .segments import segments, segments_host
from .tables import _bank_tables
from .tiling import ENV_TILES, Tiles, _with_overrides, choose_tiles


class TritonPlan(NamedTuple):
    """One batch's steering planned for :func:`.launch.steer_triton` (made by
    :func:`prepare_triton`).

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
    """Assert the factors' and the coefficients' dtypes, shapes and layout, and the offsets'."""
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
    assert offs[0] == 0 and all(b >= a for a, b in zip(offs, offs[1:], strict=False)), \
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
    :func:`.launch.steer_triton` (``prepared=``) on every step while ``coefs`` stays the same.

    The plan depends on the coefficients' non-zero pattern only (the kernels read the values
    from ``coefs`` at run time): it stays valid while the values change and the pattern not."""
    dev = p1.device
    staging.check_not_capturing(dev)
    offs = rank_offsets_list(rank_offsets)
    K, total_rank = len(offs) - 1, offs[-1]
    num_rows, d = coefs.shape[0], p1.shape[0]
    _check_factors(d, p1, p2, offs, coefs, num_rows)
    t = tiles or _with_overrides(choose_tiles(num_rows, d, offs, tiling._num_sms(dev)))
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

