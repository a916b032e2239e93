"""Batched steer kernels. Semantics: see :mod:`vllm_steer.reference`.

The backends the one dispatch point :mod:`vllm_steer.ops` serves (it imports this package;
this package never imports it):

- ``"torch"``: :func:`.torch_steer.steer_torch` (CPU path, CUDA fallback), always;
- ``"triton"``: :func:`.triton_steer.steer_triton` (fused CUDA kernel; the CPU interpreter with
  ``TRITON_INTERPRET=1``), only when ``import triton`` works.

Importing the package is light: the kernel modules (torch, Triton) load on first use of a
name below (``__getattr__``, as peft loads its optional backends).
"""

from __future__ import annotations

import importlib
from typing import Any, Callable

__all__ = ["steer_torch", "prepare_torch", "steer_triton", "prepare_triton", "HAS_TRITON",
           "backends"]

_FROM = {"steer_torch": ".torch_steer", "prepare_torch": ".torch_steer",
         "steer_triton": ".triton_steer", "prepare_triton": ".triton_steer"}


def _has_triton() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:  # no Triton: the torch path serves every device
        return False
    return True


def __getattr__(name: str) -> Any:
    if name == "HAS_TRITON":
        value = _has_triton()
    elif name in _FROM:
        if _FROM[name] == ".triton_steer" and not _has_triton():
            value = None
        else:
            value = getattr(importlib.import_module(_FROM[name], __name__), name)
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def backends() -> dict[str, tuple[Callable, Callable | None]]:
    """Backend name -> ``(steer function, prepare function)`` of every backend available here."""
    from .torch_steer import prepare_torch, steer_torch

    out = {"torch": (steer_torch, prepare_torch)}
    if _has_triton():
        from .triton_steer import prepare_triton, steer_triton

        out["triton"] = (steer_triton, prepare_triton)
    return out
