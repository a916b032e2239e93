"""Host-to-device copies the kernels' planning makes, with no device sync."""

from __future__ import annotations

import torch


def to_device(array, device: torch.device) -> torch.Tensor:
    """A host (numpy) array as a tensor on ``device``, with no device sync.

    CUDA: staged in pinned memory and copied ``non_blocking`` (a copy from pageable memory
    synchronises the stream). PyTorch's caching host allocator keeps the pinned block until
    the copy has run, so the staging is never rewritten early. Other devices: the array's own
    memory (the caller hands over a fresh array)."""
    import numpy as np

    t = torch.from_numpy(np.ascontiguousarray(array))
    if device.type != "cuda":
        return t if device.type == "cpu" else t.to(device)
    return t.pin_memory().to(device, non_blocking=True)
