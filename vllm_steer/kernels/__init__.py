"""Batched steer kernels. Semantics: see :mod:`vllm_steer.reference`.

The backends the one dispatch point :mod:`vllm_steer.ops` serves (it imports this package;
this package never imports it):

- ``"torch"``: :func:`.torch_steer.steer_torch` (CPU path, CUDA fallback), always;
- ``"triton"``: :func:`.triton.launch.steer_triton` (fused CUDA kernel; the CPU interpreter
  with ``TRITON_INTERPRET=1``; the subpackage :mod:`.triton`, a module per concept), only when
  ``import triton`` works.

Beside them, outside the dispatch: :mod:`.capture_safe`, the capture-safe op over the bank in
place, coefficients gathered on the device (:func:`vllm_steer.ops.steer_fixed`; on CUDA the
grouped Triton op :mod:`.triton.grouped`, elsewhere the dense torch op :mod:`.fixed`), and
:mod:`.graphs`,
the LM head's CUDA graphs of it, one per row bucket.

Importing the package is light: the kernel modules (torch, Triton) load on first use of a
name below (``__getattr__``, as peft loads its optional backends).

:func:`batch_invariant` reads vLLM's batch-invariant switch (``VLLM_BATCH_INVARIANT``) without
importing vLLM; the Triton kernel then chooses its tiles without looking at the row count.
"""

from __future__ import annotations

import importlib
import os
from typing import Any, Callable

__all__ = ["steer_torch", "prepare_torch", "steer_triton", "prepare_triton", "HAS_TRITON",
           "backends", "batch_invariant", "ENV_BATCH_INVARIANT", "ENV_BACKEND"]

#: The steer backend for the whole process (``auto``, ``reference``, ``torch``, ``triton``),
#: over the configured one: :func:`vllm_steer.ops.resolve_backend`.
ENV_BACKEND = "VLLM_STEER_BACKEND"
#: vLLM's switch for batch-invariant results (an integer; non-zero is on), read as vLLM reads it.
ENV_BATCH_INVARIANT = "VLLM_BATCH_INVARIANT"

_FROM = {"steer_torch": ".torch_steer", "prepare_torch": ".torch_steer",
         "steer_triton": ".triton.launch", "prepare_triton": ".triton.plan"}


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
        if _FROM[name].startswith(".triton.") and not _has_triton():
            value = None
        else:
            value = getattr(importlib.import_module(_FROM[name], __name__), name)
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def batch_invariant() -> bool:
    """True when vLLM's batch-invariant mode is on (``VLLM_BATCH_INVARIANT=1``).

    Read from the environment at each call (no vLLM import): a row's steered output must then
    not depend on the other rows of its batch, so the Triton kernel uses fixed tiles."""
    value = os.environ.get(ENV_BATCH_INVARIANT, "").strip()
    if not value:
        return False
    try:
        return int(value) != 0
    except ValueError:
        raise ValueError(f"${ENV_BATCH_INVARIANT}={value!r} is not an integer; vLLM reads it "
                         f"as one: set it to 1 (on) or 0 (off)") from None


def backends() -> dict[str, tuple[Callable, Callable | None]]:
    """Backend name -> ``(steer function, prepare function)`` of every backend available here."""
    from .torch_steer import prepare_torch, steer_torch

    out = {"torch": (steer_torch, prepare_torch)}
    if _has_triton():
        from .triton.launch import steer_triton
        from .triton.plan import prepare_triton

        out["triton"] = (steer_triton, prepare_triton)
    return out
