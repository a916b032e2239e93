"""What the kernels do on the host around CUDA: host-to-device copies with no device sync, and
the guard that keeps the steer op out of CUDA graph capture."""

from __future__ import annotations

import torch


def to_device(array, device: torch.device) -> torch.Tensor:
    """A host (numpy) array as a tensor on ``device``, with no device sync.

    Any device but the CPU: staged in pinned memory and copied ``non_blocking`` (a copy from
    pageable memory synchronises the stream). PyTorch's caching host allocator keeps the
    pinned block until the copy has run, so the staging is never rewritten early. CPU: the
    array's own memory (the caller hands over a fresh array)."""
    import numpy as np

    t = torch.from_numpy(np.ascontiguousarray(array))
    device = torch.device(device)
    if device.type == "cpu":
        return t
    return t.pin_memory().to(device, non_blocking=True)


#: What a captured steer op would do wrong, and the vLLM options that keep it out of graphs.
CAPTURE_ERROR = (
    "the steer op was called while a CUDA graph is being captured on {device}; steering runs "
    "outside CUDA graphs (each batch's plan and coefficients change between steps, and a "
    "replayed graph would keep the ones of its capture). Run vLLM with piecewise CUDA graphs, "
    "--compilation-config '{{\"cudagraph_mode\": \"PIECEWISE\"}}', or without CUDA graphs, "
    "--enforce-eager")


def check_not_capturing(device: torch.device) -> None:
    """Raise if a CUDA graph is being captured on the current stream (tensors on CUDA only:
    for any other device this is one comparison). Called by :func:`vllm_steer.ops.apply_steers`
    and by every public kernel wrapper (steer and prepare functions)."""
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(CAPTURE_ERROR.format(device=device))
