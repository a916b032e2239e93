"""Batched steer kernels, installed as ``vllm_steer.kernels`` (setup.py ``package_dir``).

Semantics: see vllm_steer.reference. Importing this package registers the backends with the
one dispatch point :mod:`vllm_steer.ops`:

- ``"torch"``: :func:`.torch_steer.steer_torch` (CPU path, CUDA fallback), always;
- ``"triton"``: :func:`.triton_steer.steer_triton` (fused CUDA kernel; the CPU interpreter with
  ``TRITON_INTERPRET=1``), only when ``import triton`` works.
"""

from __future__ import annotations

from vllm_steer.ops import register_backend

from .torch_steer import prepare_torch, steer_torch

register_backend("torch", steer_torch, prepare=prepare_torch)

try:
    import triton  # noqa: F401
except ImportError:  # no Triton: the torch path serves every device
    steer_triton = None
    HAS_TRITON = False
else:
    from .triton_steer import prepare_triton, steer_triton

    register_backend("triton", steer_triton, prepare=prepare_triton)
    HAS_TRITON = True

__all__ = ["steer_torch", "steer_triton", "HAS_TRITON"]
