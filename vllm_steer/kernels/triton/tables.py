"""The bank layout's device tables the shrink and the expand read (:mod:`.jit`), cached per
layout: built once, copied from pinned memory, so the steady state copies nothing to the device.

Host syncs: none, even the first time a layout is seen, when ``rank_offsets`` is a list or a
CPU tensor (:func:`vllm_steer.kernels.layout.rank_offsets_list`).
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import torch

from vllm_steer.kernels.staging import to_device

_TABLES: "OrderedDict[tuple, tuple[torch.Tensor, ...]]" = OrderedDict()
#: How many layouts (rank offsets, rank tile, device) the cache keeps, least recently used out.
_TABLES_MAX = 64


def _bank_tables(offs: list[int], block_r: int, device: torch.device):
    """Device tables of a bank layout, ``(steer_t, col_t, end_t, offs_t)`` int32: for each
    rank block of ``block_r`` columns its steer, its first column and its steer's end column,
    and the rank offsets (cached: no host-to-device copy in the steady state)."""
    key = (tuple(offs), block_r, str(device))
    hit = _TABLES.get(key)
    if hit is not None:
        _TABLES.move_to_end(key)
        return hit
    steer, col, end = [], [], []
    for k in range(len(offs) - 1):
        for c0 in range(offs[k], offs[k + 1], block_r):
            steer.append(k), col.append(c0), end.append(offs[k + 1])
    # host-built and copied from pinned memory (no sync, even the first time a layout is seen)
    as_t = lambda v: to_device(np.asarray(v, dtype=np.int32), device)  # noqa: E731
    tables = (as_t(steer), as_t(col), as_t(end), as_t(offs))
    _TABLES[key] = tables
    if len(_TABLES) > _TABLES_MAX:
        _TABLES.popitem(last=False)
    return tables
