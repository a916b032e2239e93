"""The capture-safe steer op, one choice per device: on CUDA with Triton the grouped op
(:func:`vllm_steer.kernels.triton.grouped.steer_grouped`: rows grouped by slot on the device,
only the steers in use read), elsewhere the dense torch op (:func:`.fixed.steer_fixed`), both
over the bank in place in its fixed layout. Semantics: see :mod:`vllm_steer.reference`.

Public as :func:`vllm_steer.ops.steer_fixed`; the LM head's graphs (:mod:`.graphs`) record it.
"""

from __future__ import annotations

from typing import Any

import torch

from . import fixed


def grouped_on(device: torch.device) -> bool:
    """Whether :func:`steer` runs the grouped Triton op on ``device`` (CUDA with Triton)."""
    from . import _has_triton

    return torch.device(device).type == "cuda" and _has_triton()


def scratch(rows: int, columns: int, rank: int, hidden: int, device,
            max_per_row: int | None = None) -> Any:
    """The buffers :func:`steer` reuses for ``rows`` rows on ``device`` (make them outside a
    capture); None where the op needs none (the torch op)."""
    if not grouped_on(device):
        return None
    from .triton.grouped import grouped_scratch

    return grouped_scratch(rows, columns, max_per_row or columns, rank, hidden,
                           torch.device(device))


def steer(hidden: torch.Tensor, p1: torch.Tensor, p2: torch.Tensor, rank: int,
          table: torch.Tensor, index: torch.Tensor | None, out: torch.Tensor | None = None,
          buffers: Any = None, max_per_row: int | None = None,
          widths: torch.Tensor | None = None) -> torch.Tensor:
    """Row ``i`` steered with ``table[index[i]]`` (see :func:`vllm_steer.ops.steer_fixed`)."""
    if grouped_on(hidden.device):
        from .triton.grouped import steer_grouped

        return steer_grouped(hidden, p1, p2, rank, table, index, out, buffers, max_per_row,
                             widths)
    return fixed.steer_fixed(hidden, p1, p2, rank, table, index, out)


__all__ = ["grouped_on", "scratch", "steer"]
