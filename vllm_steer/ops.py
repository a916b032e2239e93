"""The one dispatch point of the batched steer operation.

Semantics: see :mod:`vllm_steer.reference`. Backends:

- ``reference``: the pure-torch definition (slow, exact; a per-steer loop).
- ``torch``: the efficient CPU/GPU torch path of :mod:`vllm_steer.kernels` (rows grouped by
  steer, zero coefficients skipped).
- ``triton``: the fused Triton kernel (CUDA, or the interpreter with ``TRITON_INTERPRET=1``).

``auto`` (the default) picks ``triton`` for CUDA tensors when Triton imports, else ``torch``.
``VLLM_STEER_BACKEND`` overrides the choice for the whole process.

Steering runs outside CUDA graphs: :func:`check_not_capturing` (one function, also called by
every public kernel wrapper) refuses a call made while a graph is being captured.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Literal, NamedTuple, Sequence

import torch

from vllm_steer.kernels import staging
from vllm_steer.kernels.staging import check_not_capturing, to_device  # noqa: F401  (re-exported)
from vllm_steer.reference import steer_reference

Backend = Literal["auto", "reference", "torch", "triton"]
BACKENDS: tuple[str, ...] = ("auto", "reference", "torch", "triton")
ENV_BACKEND = "VLLM_STEER_BACKEND"

SteerFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, Sequence[int], torch.Tensor],
                   torch.Tensor]
_REGISTRY: dict[str, SteerFn] = {"reference": steer_reference}
# Optional per-backend planning: ``prepare(p1, p2, rank_offsets, coefs) -> plan``, the plan then
# passed as ``fn(..., prepared=plan)`` for as long as the coefficients do not change.
_PREPARE: dict[str, Callable] = {}


def register_backend(name: str, fn: SteerFn, prepare: Callable | None = None) -> None:
    """Register (or replace) a backend under ``name`` (benchmarks and tests plug in here; the
    kernels' own backends are registered by :func:`_load_kernels`).

    ``prepare`` (optional) plans a batch once from the factors and coefficients; the backend
    then accepts the plan as ``prepared=`` and skips the planning (see :func:`prepare_steers`).
    """
    _load_kernels()  # the kernels' defaults first, so that they do not replace this one
    _REGISTRY[name] = fn
    if prepare is None:
        _PREPARE.pop(name, None)
    else:
        _PREPARE[name] = prepare


def _load_kernels() -> None:
    """Register the kernels' backends (``torch``; ``triton`` where Triton imports). Lazy:
    importing Triton takes about half a second, paid by the first call that needs a kernel."""
    if "torch" in _REGISTRY:
        return
    from vllm_steer import kernels

    for name, (fn, prepare) in kernels.backends().items():
        _REGISTRY.setdefault(name, fn)
        if prepare is not None and name not in _PREPARE:
            _PREPARE[name] = prepare


def resolve_backend(backend: str | None, device: torch.device) -> str:
    """Name of the backend that will run for tensors on ``device``."""
    backend = backend or os.environ.get(ENV_BACKEND) or "auto"
    if backend not in BACKENDS:
        raise ValueError(f"unknown steer backend {backend!r}; choose one of {BACKENDS} "
                         f"(argument or ${ENV_BACKEND})")
    if backend in ("torch", "triton"):
        _load_kernels()
    if backend == "auto":
        _load_kernels()
        if device.type == "cuda" and "triton" in _REGISTRY:
            return "triton"
        return "torch" if "torch" in _REGISTRY else "reference"
    if backend not in _REGISTRY:
        raise ValueError(f"steer backend {backend!r} is not available here "
                         f"(registered: {sorted(_REGISTRY)})")
    return backend


def apply_steers(
    hidden: torch.Tensor,  # [num_rows, hidden]
    p1: torch.Tensor,  # [hidden, total_rank]
    p2: torch.Tensor,  # [hidden, total_rank]
    rank_offsets: Sequence[int],  # K + 1
    coefs: torch.Tensor,  # [num_rows, K] float32 (strength * epsilon)
    backend: str | None = None,
    prepared: Prepared | None = None,  # from prepare_steers(..., same coefs, same backend)
) -> torch.Tensor:
    """Batched steer operation. Semantics: see :func:`vllm_steer.reference.steer_reference`.

    Refuses to run while a CUDA graph is being captured (:func:`check_not_capturing`)."""
    staging.check_not_capturing(hidden.device)
    name = resolve_backend(backend, hidden.device)
    fn = _REGISTRY[name]
    if prepared is not None and prepared.plan is not None:
        assert prepared.backend == name, f"plan made for backend {prepared.backend!r}"
        return fn(hidden, p1, p2, rank_offsets, coefs, prepared=prepared.plan)
    return fn(hidden, p1, p2, rank_offsets, coefs)


class Prepared(NamedTuple):
    """A backend's plan for one set of coefficients (``plan`` None: the backend plans per call)."""

    backend: str
    plan: Any


def prepare_steers(
    p1: torch.Tensor,  # [hidden, total_rank]
    p2: torch.Tensor,  # [hidden, total_rank]
    rank_offsets: Sequence[int],  # K + 1
    coefs: torch.Tensor,  # [num_rows, K] float32
    backend: str | None = None,
    host=None,  # numpy [num_rows, K]: the same coefficients on the host (plan with no sync)
) -> Prepared:
    """Plan the steering of a batch once, for :func:`apply_steers` (``prepared=``) to reuse
    on every call while ``coefs`` stays the same (e.g. the decode steps of a batch).

    ``host``: a host (numpy) copy of ``coefs``; the plan is then made from it and never reads
    the device tensor (no device-to-host sync; the serving path passes it)."""
    staging.check_not_capturing(coefs.device)
    name = resolve_backend(backend, coefs.device)
    prep = _PREPARE.get(name)
    if prep is None:
        return Prepared(name, None)
    return Prepared(name, prep(p1, p2, rank_offsets, coefs) if host is None
                    else prep(p1, p2, rank_offsets, coefs, host=host))


def warm_up(
    backend: str | None,  # as for apply_steers (None: $VLLM_STEER_BACKEND or auto)
    p1: torch.Tensor,  # [hidden, total_rank]: the bank's factors, on the serving device
    p2: torch.Tensor,  # [hidden, total_rank]
    rank_offsets: Sequence[int],  # K + 1: the bank's layout
    max_rows: int,  # the most rows one call steers (vLLM's max_num_seqs)
    act_dtype: torch.dtype,  # the activations' dtype (the model's)
) -> int:
    """Compile at start-up every kernel the backend can launch for 1..max_rows rows of this
    bank, so that no serving step stalls on a compile. Returns the number of kernel
    specialisations warmed: ``triton`` launches each of
    :func:`vllm_steer.kernels.triton_steer.specializations` once; ``torch`` and ``reference``
    compile nothing (0). Call it again after the bank's layout changes."""
    name = resolve_backend(backend, p1.device)
    if name != "triton":
        return 0
    from vllm_steer.kernels.triton_steer import warm_up as triton_warm_up

    return triton_warm_up(p1, p2, rank_offsets, max_rows, act_dtype)


def backend_fn(name: str) -> SteerFn:
    """The registered function of a resolved backend (the serving path calls it directly)."""
    return _REGISTRY[name]
