"""Launching the fused steer (:func:`steer_triton`): the public wrappers of the shrink and
expand kernels (:mod:`.jit`), on CUDA or in Triton's CPU interpreter (``TRITON_INTERPRET=1``).

Semantics: see :mod:`vllm_steer.reference` (``steer_reference``).

Host syncs: none in the steady state when ``rank_offsets`` is a list or a CPU tensor (the
per-bank device tables are built once and cached, :mod:`.tables`). A CUDA ``rank_offsets``
tensor costs one ``.tolist()`` sync per call: pass a list. The grid depends only on shapes,
never on data.

The kernels are looked up in :mod:`.jit` (and :func:`_interpreting` here) at each call, so a
test's stand-in for one replaces it for every caller.
"""

from __future__ import annotations

from typing import Sequence

import torch
import triton

from vllm_steer.kernels import staging
from vllm_steer.kernels.layout import rank_offsets_list

from . import jit
from .plan import TritonPlan, prepare_triton
from .segments import segments
from .tiling import Tiles, kernel_params


def _interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(jit._steer_expand_kernel, InterpretedFunction)


def steer_triton(
    hidden: torch.Tensor,  # [num_rows, hidden] fp32/fp16/bf16, unit stride along hidden
    p1: torch.Tensor,  # [hidden, total_rank] contiguous, fp32 or the activation's 16-bit dtype
    p2: torch.Tensor,  # [hidden, total_rank] contiguous, same dtype as p1
    rank_offsets: Sequence[int] | torch.Tensor,  # K + 1 ints (list or CPU tensor: no sync)
    coefs: torch.Tensor,  # [num_rows, K] fp32 contiguous
    out: torch.Tensor | None = None,  # [num_rows, hidden] like hidden (allocated if None)
    tiles: Tiles | None = None,  # tile sizes (default: tiling.choose_tiles)
    prepared: TritonPlan | None = None,  # prepare_triton(p1, p2, rank_offsets, coefs): reused
) -> torch.Tensor:
    """Fused batched steer. Semantics: see vllm_steer.reference (``steer_reference``).

    Every element of ``out`` is written; rows whose coefficients are all zero are copied bit for
    bit. Host syncs: none when ``rank_offsets`` is a list / CPU tensor and the bank layout was
    seen before (see the module docstring). With ``prepared`` (made from these same factors and
    coefficients) the call skips the planning and launches the two GEMM kernels only.
    Refuses to run while a CUDA graph is being captured (steering runs outside CUDA graphs).
    """
    staging.check_not_capturing(hidden.device)
    offs = rank_offsets_list(rank_offsets)
    num_rows = hidden.shape[0]
    floats = (torch.float32, torch.float16, torch.bfloat16)
    assert hidden.dtype in floats, f"hidden dtype must be one of {floats}, got {hidden.dtype}"
    assert hidden.stride(1) == 1, f"hidden needs unit stride along hidden, got {hidden.stride()}"
    dev = hidden.device
    assert p1.device == dev and coefs.device == dev, (hidden.device, p1.device, coefs.device)
    interpret = _interpreting()
    if dev.type != "cuda" and not interpret:
        raise RuntimeError("the triton steer backend needs CUDA tensors (or TRITON_INTERPRET=1 "
                           "set before triton is imported); use backend='torch' on CPU")
    if out is None:
        out = torch.empty_like(hidden, memory_format=torch.contiguous_format)
    assert out.shape == hidden.shape and out.dtype == hidden.dtype and out.stride(1) == 1, \
        (out.shape, out.dtype, out.stride())
    if prepared is None:
        prepared = prepare_triton(p1, p2, offs, coefs, tiles)
    else:
        assert prepared.num_rows == num_rows, \
            f"plan prepared for {prepared.num_rows} rows, called with {num_rows}"
    if num_rows == 0:
        return out
    if prepared.segments is None:
        out.copy_(hidden)
        return out
    return _launch(prepared, hidden, p1, p2, offs, coefs, out, interpret)


def steer_triton_replayable(
    hidden: torch.Tensor,  # [num_rows, hidden], unit stride along hidden
    p1: torch.Tensor,  # [hidden, total_rank] contiguous
    p2: torch.Tensor,  # [hidden, total_rank] contiguous, same dtype as p1
    rank_offsets: Sequence[int],  # K + 1 ints (a list: no sync)
    coefs: torch.Tensor,  # [num_rows, K] fp32 contiguous: read at each call
    out: torch.Tensor,  # [num_rows, hidden] like hidden: written
    prepared: TritonPlan,  # prepare_triton(p1, p2, rank_offsets, coefs), made outside a capture
) -> torch.Tensor:
    """The fused op as a CUDA graph can record it. Semantics: see vllm_steer.reference.

    The rows' grouping by steer (the segments) is computed on the device from the values
    ``coefs`` holds at each call, into ``prepared``'s tables, so a recorded call follows
    coefficients whose pattern changed since the plan; then the shrink and the expand. Three
    launches (four with ``split_d > 1``), nothing allocated, no host read, and no refusal while
    a capture runs. ``prepared`` fixes the tiles, the bank's tables and the scratch; make it,
    and make one call (which compiles), before the capture.

    Serving does not call it: the CUDA graphs of the LM head and of the drafters record the
    grouped capture-safe op over the bank in place (:mod:`.grouped`,
    :mod:`vllm_steer.kernels.graphs`), which takes a table and an index instead of a planned
    batch. ``scripts/gpu_window.py`` (its ``replay`` check) records this one in a CUDA graph
    and times it beside the head's graphs, and ``tests/core/test_kernels.py`` checks it against
    the reference."""
    floats = (torch.float32, torch.float16, torch.bfloat16)
    assert hidden.dtype in floats, f"hidden dtype must be one of {floats}, got {hidden.dtype}"
    num_rows = coefs.shape[0]
    offs = rank_offsets_list(rank_offsets)
    assert prepared.num_rows == num_rows and prepared.segments is not None, \
        f"plan prepared for {prepared.num_rows} rows with steers, called with {num_rows}"
    assert out.shape == hidden.shape and out.dtype == hidden.dtype and out.stride(1) == 1, \
        (out.shape, out.dtype, out.stride())
    segments(coefs, into=prepared.segments)
    return _launch(prepared, hidden, p1, p2, offs, coefs, out, _interpreting())


def _launch(prepared: TritonPlan, hidden, p1, p2, offs: list[int], coefs, out,
            interpret: bool) -> torch.Tensor:
    """The shrink and the expand of a plan with steered rows."""
    num_rows, d = hidden.shape
    K, total_rank = len(offs) - 1, offs[-1]
    t = prepared.tiles
    steer_t, col_t, end_t, offs_t = prepared.tables
    seg_rows, seg_counts, perm = prepared.segments
    buf = prepared.buf
    if t.split_d > 1:
        buf.zero_()  # the split shrink adds its partial sums with atomics
    params = prepared.params.get(hidden.dtype)
    if params is None:
        params = prepared.params[hidden.dtype] = kernel_params(t, d, offs, hidden.dtype,
                                                               p1.dtype, interpret)
    shrink_kw, expand_kw = params
    jit._steer_shrink_kernel[(triton.cdiv(num_rows, t.shrink_m), steer_t.numel(), t.split_d)](
        hidden, p1, coefs, seg_rows, seg_counts, steer_t, col_t, end_t, buf,
        hidden.stride(0), num_rows, d, total_rank, K, **shrink_kw)
    jit._steer_expand_kernel[(triton.cdiv(num_rows, t.expand_m), triton.cdiv(d, t.expand_d))](
        hidden, p2, coefs, perm, offs_t, buf, out,
        hidden.stride(0), out.stride(0), num_rows, d, total_rank, K, **expand_kw)
    return out

