"""The one dispatch point of the batched steer operation.

Semantics: see :mod:`vllm_steer.reference`. Backends:

- ``reference``: the pure-torch definition (slow, exact; a per-steer loop).
- ``torch``: the efficient CPU/GPU torch path of :mod:`vllm_steer.kernels` (rows grouped by
  steer, zero coefficients skipped).
- ``triton``: the fused Triton kernel (CUDA, or the interpreter with ``TRITON_INTERPRET=1``).

``auto`` (the default): on CUDA, when Triton imports, the backend of :data:`AUTO_CUDA` for the
bank's hidden size and largest steer rank (``torch`` for high-rank banks, ``triton`` else, and
always ``triton`` in vLLM's batch-invariant mode); ``torch`` on any other device.
``VLLM_STEER_BACKEND`` overrides the choice for the whole process.

Steering runs outside CUDA graphs: :func:`check_not_capturing` (one function, also called by
every public kernel wrapper) refuses a call made while a graph is being captured. The one
exception is :func:`steer_fixed`, the capture-safe op (the bank read in place in its fixed
layout, coefficients gathered on the device; on CUDA the rows grouped by slot on the device,
:mod:`vllm_steer.kernels.triton.grouped`): drafter heads inside vLLM's graphs run it, and on
CUDA the LM head replays it from its own graphs
(:class:`vllm_steer.kernels.graphs.SteerGraphs`).
"""

from __future__ import annotations

import os
from typing import Any, Callable, Literal, NamedTuple, Sequence

import torch

from vllm_steer.kernels import ENV_BACKEND, batch_invariant, staging
from vllm_steer.kernels import capture_safe as _capture_safe
from vllm_steer.kernels.staging import check_not_capturing, to_device  # noqa: F401  (re-exported)
from vllm_steer.reference import steer_reference

Backend = Literal["auto", "reference", "torch", "triton"]
BACKENDS: tuple[str, ...] = ("auto", "reference", "torch", "triton")

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


#: ``auto`` on CUDA: ``(hidden at least, largest steer rank at least, backend)``, the first row
#: that matches wins, ``triton`` when none does. Source: benchmarks/RESULTS.md "Kernels".
#: H100, bf16, 256 rows, 8 steers, d 4096: full rank, torch 539 us vs Triton 881 us of GPU time
#: (cuBLAS beats the fused kernel on big GEMMs); rank 64, Triton 34.5 us vs torch 155 us. H200,
#: one steer of rank 1024 or full, d 2048 and 4096: Triton at 0.81-1.31x the speed of the
#: per-steer loop (the same cuBLAS GEMMs plus a per-call fp32 up-cast), slower in 16 of 24
#: shapes; at d 576 it is 1.04-1.32x faster (both launch-bound). Rows are not a key: with them the
#: winner moved in no consistent direction (H200, d 4096 full rank: Triton ahead at 16 and 512 rows,
#: behind at 1, 64 and 256). Planned per-call times on an H200 (scripts/gpu_window.py, bf16): rank
#: 1024 at d 2048 (64 rows) Triton 83.8 us vs torch 119 us, at d 8192 (256 rows) 191 vs 224 us; full
#: rank at d 4096 (256 rows, 8 steers) 898 vs 554 us, at d 8192 (64 rows) 560 vs 416 us: the fused
#: kernel wins up to rank 1024, cuBLAS from full rank; 2048 is the boundary in between.
AUTO_CUDA: tuple[tuple[int, int, str], ...] = (
    (2048, 2048, "torch"),
)


def _auto_cuda(hidden: int | None, max_rank: int | None) -> str:
    """``auto``'s pick for CUDA tensors when Triton is available (see :data:`AUTO_CUDA`)."""
    if batch_invariant():  # Triton's rows do not depend on the batch by construction
        return "triton"
    if hidden is not None and max_rank is not None:
        for min_hidden, min_rank, name in AUTO_CUDA:
            if hidden >= min_hidden and max_rank >= min_rank and name in _REGISTRY:
                return name
    return "triton"


def max_rank_of(rank_offsets: Sequence[int] | torch.Tensor) -> int:
    """The largest steer rank of a bank layout (0 for no steers)."""
    offs = rank_offsets.tolist() if isinstance(rank_offsets, torch.Tensor) else rank_offsets
    return max((int(b) - int(a) for a, b in zip(offs, offs[1:], strict=False)), default=0)


def resolve_backend(backend: str | None, device: torch.device, hidden: int | None = None,
                    max_rank: int | None = None) -> str:
    """Name of the backend that will run for tensors on ``device``.

    ``hidden`` (the model's hidden size) and ``max_rank`` (the largest rank the bank holds or
    will hold, e.g. ``--max-steer-rank``) let ``auto`` pick by :data:`AUTO_CUDA` on CUDA;
    without them ``auto`` picks ``triton`` there, as it always did."""
    backend = backend or os.environ.get(ENV_BACKEND) or "auto"
    if backend not in BACKENDS:
        raise ValueError(f"unknown steer backend {backend!r}; choose one of {BACKENDS} "
                         f"(argument or ${ENV_BACKEND})")
    if backend in ("torch", "triton"):
        _load_kernels()
    if backend == "auto":
        _load_kernels()
        if device.type == "cuda" and "triton" in _REGISTRY:
            return _auto_cuda(hidden, max_rank)
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
    prepared: BackendPlan | None = None,  # from prepare_steers(..., same coefs, same backend)
) -> torch.Tensor:
    """Batched steer operation. Semantics: see :func:`vllm_steer.reference.steer_reference`.

    Refuses to run while a CUDA graph is being captured (:func:`check_not_capturing`)."""
    staging.check_not_capturing(hidden.device)
    name = resolve_backend(backend, hidden.device, p1.shape[0], max_rank_of(rank_offsets))
    fn = _REGISTRY[name]
    if prepared is not None and prepared.plan is not None:
        assert prepared.backend == name, f"plan made for backend {prepared.backend!r}"
        return fn(hidden, p1, p2, rank_offsets, coefs, prepared=prepared.plan)
    return fn(hidden, p1, p2, rank_offsets, coefs)


class BackendPlan(NamedTuple):
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
) -> BackendPlan:
    """Plan the steering of a batch once, for :func:`apply_steers` (``prepared=``) to reuse
    on every call while ``coefs`` stays the same (e.g. the decode steps of a batch).

    ``host``: a host (numpy) copy of ``coefs``; the plan is then made from it and never reads
    the device tensor (no device-to-host sync; the serving path passes it)."""
    staging.check_not_capturing(coefs.device)
    name = resolve_backend(backend, coefs.device, p1.shape[0], max_rank_of(rank_offsets))
    prep = _PREPARE.get(name)
    if prep is None:
        return BackendPlan(name, None)
    return BackendPlan(name, prep(p1, p2, rank_offsets, coefs) if host is None
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
    :func:`vllm_steer.kernels.triton.warmup.specializations` once; ``torch`` and ``reference``
    compile nothing (0). Call it again after the bank's layout changes."""
    name = resolve_backend(backend, p1.device, p1.shape[0], max_rank_of(rank_offsets))
    if name != "triton":
        return 0
    from vllm_steer.kernels.triton.warmup import warm_up as triton_warm_up

    return triton_warm_up(p1, p2, rank_offsets, max_rows, act_dtype)


def steer_fixed(
    hidden: torch.Tensor,  # [num_rows, hidden]
    p1: torch.Tensor,  # [hidden, columns * rank]: the bank in its fixed layout (SlotBank.p1)
    p2: torch.Tensor,  # [hidden, columns * rank]
    rank: int,  # columns of the bank per coefficient column (SlotBank.rank)
    table: torch.Tensor,  # [T, columns] float32 coefficient rows
    index: torch.Tensor | None,  # [num_rows] int: each row's row of ``table``; -1: a padding
    #                              row. None: row i's row is i (T >= num_rows)
    out: torch.Tensor | None = None,  # [num_rows, hidden] of hidden's dtype: written, returned
    scratch: Any = None,  # fixed_scratch(...) for these rows: nothing allocated per call
    max_per_row: int | None = None,  # the most non-zero coefficients a row has (default: all)
    widths: torch.Tensor | None = None,  # [columns] int32: each column's steer rank
    #                                      (SlotBank.widths: the grouped op reads no padding)
) -> torch.Tensor:
    """The capture-safe steer op: row ``i`` steered with ``table[index[i]]`` (zeros for -1).
    Semantics: see :func:`vllm_steer.reference.steer_reference`.

    Allowed inside a CUDA graph capture (the launches and their shapes depend on no value,
    and nothing is read back to the host). On CUDA with Triton, the grouped op
    (:func:`vllm_steer.kernels.triton.grouped.steer_grouped`: rows grouped by slot on the
    device, only the steers in use read); elsewhere the dense torch op
    (:mod:`vllm_steer.kernels.fixed`), both on the bank in place."""
    return _capture_safe.steer(hidden, p1, p2, rank, table, index, out, scratch, max_per_row,
                               widths)


def fixed_scratch(rows: int, columns: int, rank: int, hidden: int, device,
                  max_per_row: int | None = None) -> Any:
    """The buffers :func:`steer_fixed` reuses for ``rows`` rows on ``device`` (make them
    outside a capture; None where the op needs none: the torch op)."""
    return _capture_safe.scratch(rows, columns, rank, hidden, device, max_per_row)


def backend_fn(name: str) -> SteerFn:
    """The registered function of a resolved backend (the serving path calls it directly)."""
    return _REGISTRY[name]


def backend_prepare(name: str) -> Callable | None:
    """The planning function of a resolved backend (None: it plans nothing; see
    :func:`register_backend`)."""
    return _PREPARE.get(name)
