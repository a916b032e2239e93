"""Segments: the batch's rows grouped by steer, the tables the shrink and the expand
(:mod:`.jit`) read. Made on the device by the segments kernel (:func:`segments`, no host sync;
what a CUDA graph can record) or on the host from a copy of the coefficients
(:func:`segments_host`, no launch; what the serving path plans with).
"""

from __future__ import annotations

import numpy as np
import torch

from vllm_steer.kernels.layout import row_bucket
from vllm_steer.kernels.staging import to_device

from . import jit
from .tiling import _pow2_at_least


def segments(
    coefs: torch.Tensor,  # [num_rows, K] fp32 contiguous, on the device
    into: tuple | None = None,  # (seg_rows, seg_counts, perm) to write instead of new ones
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows grouped by steer, on the device in one launch (no host sync).

    Returns ``(seg_rows [K, rows] int32, seg_counts [K] int32, perm [rows] int32)``: row
    ``seg_rows[k, i]`` for ``i < seg_counts[k]`` uses steer ``k`` (rows in order; entries past
    the count are unspecified); ``perm`` orders the rows by their first active steer, stably
    (rows with no steer last). ``into``: those three tables to write instead of new ones.
    """
    assert coefs.dtype == torch.float32 and coefs.dim() == 2 and coefs.is_contiguous(), \
        f"coefs must be float32 [num_rows, K] contiguous, got {coefs.dtype} {tuple(coefs.shape)}"
    num_rows, K = coefs.shape
    if into is None:
        seg_rows = torch.empty((K, num_rows), dtype=torch.int32, device=coefs.device)
        seg_counts = torch.empty((K,), dtype=torch.int32, device=coefs.device)
        perm = torch.empty((num_rows,), dtype=torch.int32, device=coefs.device)
    else:
        seg_rows, seg_counts, perm = into
        assert seg_rows.shape == (K, num_rows) and seg_counts.shape == (K,) \
            and perm.shape == (num_rows,), "the tables were made for other coefficients' shape"
    # looked up in jit at each call (a test's stand-in for the kernel replaces it there)
    jit._steer_segments_kernel[(K + 1,)](coefs, seg_rows, seg_counts, perm, num_rows, K,
                                         **segments_params(num_rows, K))
    return seg_rows, seg_counts, perm


def segments_params(num_rows: int, K: int) -> dict:
    """Compile-time parameters of the segments kernel (one set per row bucket)."""
    k_pad = max(16, _pow2_at_least(K))
    return dict(CHUNK=max(16, min(1024, row_bucket(num_rows), 8192 // k_pad)), K_PAD=k_pad)


def segments_host(
    nz,  # numpy [num_rows, K] bool: which coefficients are non-zero
    device: torch.device,  # where the tables go
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`segments` computed on the host from a numpy non-zero pattern ([rows, K] bool)
    and copied to ``device`` in one pinned, non-blocking copy: the same tables, no launch and
    no device read (the serving path plans from its host mirror of the coefficients).

    The three tables share one buffer, each starting 64-byte aligned: Triton compiles anew
    for a pointer that is not 16-byte aligned, which would defeat :func:`.warmup.warm_up`."""
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

