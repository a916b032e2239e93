"""What every kernel module reads the same way: a bank's rank layout as host integers, and the
row buckets compiled kernels and captured graphs are made for. Semantics: see
:mod:`vllm_steer.reference`."""

from __future__ import annotations

import torch


def rank_offsets_list(rank_offsets) -> list[int]:
    """A bank's ``rank_offsets`` (``K + 1`` column offsets of its factors) as Python integers.
    A CUDA tensor syncs here: the serving path passes a list."""
    if isinstance(rank_offsets, torch.Tensor):
        return [int(o) for o in rank_offsets.tolist()]
    return [int(o) for o in rank_offsets]


def row_bucket(num_rows: int) -> int:
    """The row count whose tiles (and CUDA graph) serve ``num_rows`` rows: the next power of
    two (1, 2, 4, ...). Compiled kernels and captured graphs change only between buckets: 9
    buckets cover 1..256 rows."""
    return 1 << max(int(num_rows) - 1, 0).bit_length()


def row_buckets(max_rows: int) -> list[int]:
    """Every :func:`row_bucket` of 1..max_rows rows (``[1, 2, 4, ..., row_bucket(max_rows)]``)."""
    if max_rows < 1:
        return []
    return [1 << i for i in range(row_bucket(max_rows).bit_length())]


__all__ = ["rank_offsets_list", "row_bucket", "row_buckets"]
