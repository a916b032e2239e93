"""Warm-up: every compiled kernel a serving run can need, compiled before the first request.

Triton compiles one binary per set of compile-time parameters (the ``constexpr`` tile sizes
and flags, and the "== 1" / "multiple of 16" facts of integer arguments). The row count changes
every step, so it is never one of them: ``num_rows`` is ``do_not_specialize`` (:mod:`.jit`)
and :func:`.tiling.choose_tiles` picks the tiles of the row count's power-of-two bucket
(:func:`~vllm_steer.kernels.layout.row_bucket`). The binaries reachable for 1..max_rows rows
are the few of :func:`specializations`, and :func:`warm_up` compiles them all at start-up.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import torch

from vllm_steer.kernels.layout import rank_offsets_list, row_buckets

from . import launch, tiling
from .segments import segments_params
from .tiling import _with_overrides, choose_tiles, kernel_params


class Specialization(NamedTuple):
    """One compiled kernel: which kernel, and its compile-time parameters (``constexpr``
    values and launch options, as ``(name, value)`` pairs sorted by name)."""

    kernel: str  # "segments", "shrink" or "expand"
    params: tuple


def _launch_specs(num_rows: int, hidden: int, offs: list[int], act_dtype: torch.dtype,
                  fac_dtype: torch.dtype, num_sms: int, interpret: bool) -> list[Specialization]:
    """The kernels :func:`.launch.steer_triton` compiles for a call on ``num_rows`` rows (its
    segments launch included: a call without a plan or host coefficients makes one)."""
    K = len(offs) - 1
    if num_rows == 0 or K == 0 or offs[-1] == 0:
        return []  # nothing is launched
    t = _with_overrides(choose_tiles(num_rows, hidden, offs, num_sms))
    shrink, expand = kernel_params(t, hidden, offs, act_dtype, fac_dtype, interpret)
    return [Specialization("segments", tuple(sorted(segments_params(num_rows, K).items()))),
            Specialization("shrink", tuple(sorted(shrink.items()))),
            Specialization("expand", tuple(sorted(expand.items())))]


def specializations(
    max_rows: int,  # the most rows one call steers (vLLM's max_num_seqs)
    hidden: int,  # the model's hidden size
    rank_offsets: Sequence[int] | torch.Tensor,  # K + 1 ints: the bank's layout
    act_dtype: torch.dtype,  # the activations' dtype (the model's)
    fac_dtype: torch.dtype,  # the factors' dtype (the bank's)
    device: torch.device | str | None = None,  # its SM count shapes the tiles (default: cuda:0)
) -> list[Specialization]:
    """Every compiled kernel that :func:`.launch.steer_triton` can launch for 1..max_rows rows
    of this bank and these dtypes: at most one per kernel and row bucket (3 kernels x 9 buckets
    for 256 rows), usually fewer (buckets often share tiles).

    Assumes what the serving path passes: activations and output of ``hidden`` contiguous
    columns (a row stride of another "multiple of 16" class compiles anew) and fresh (16-byte
    aligned) tensors. A new bank layout (a steer of another rank loaded) has its own set."""
    offs = rank_offsets_list(rank_offsets)
    if device is None:
        device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    num_sms = tiling._num_sms(torch.device(device))
    found: dict[Specialization, None] = {}
    for rows in row_buckets(max_rows):
        for spec in _launch_specs(min(rows, max_rows), hidden, offs, act_dtype, fac_dtype,
                                  num_sms, launch._interpreting()):
            found.setdefault(spec)
    return list(found)


def warm_up(
    p1: torch.Tensor,  # [hidden, total_rank] contiguous: the bank's factors
    p2: torch.Tensor,  # [hidden, total_rank] contiguous, same dtype as p1
    rank_offsets: Sequence[int] | torch.Tensor,  # K + 1 ints
    max_rows: int,  # the most rows one call steers (vLLM's max_num_seqs)
    act_dtype: torch.dtype,  # the activations' dtype
) -> int:
    """Compile every kernel of :func:`specializations` by launching it once (on zero
    activations, one steer per row), so that no later call for 1..max_rows rows of this bank
    compiles: a compile stalls its step for 0.2-2.8 s (measured on an H200). Also builds the
    bank's cached device tables. Returns the number of specialisations warmed.

    Call it at start-up and again after the bank's layout changes."""
    offs = rank_offsets_list(rank_offsets)
    K, d = len(offs) - 1, p1.shape[0]
    dev = p1.device
    specs = specializations(max_rows, d, offs, act_dtype, p1.dtype, dev)
    num_sms, interpret = tiling._num_sms(dev), launch._interpreting()
    warmed: set[Specialization] = set()
    for rows in row_buckets(max_rows) if specs else []:
        rows = min(rows, max_rows)
        need = set(_launch_specs(rows, d, offs, act_dtype, p1.dtype, num_sms, interpret))
        if need <= warmed:
            continue
        coefs = torch.zeros((rows, K), dtype=torch.float32, device=dev)
        coefs[torch.arange(rows, device=dev), torch.arange(rows, device=dev) % K] = 1.0
        hidden = torch.zeros((rows, d), dtype=act_dtype, device=dev)
        launch.steer_triton(hidden, p1, p2, offs, coefs)  # no plan: the segments kernel runs too
        warmed |= need
    assert warmed == set(specs), "warm_up missed a specialisation of specializations()"
    return len(specs)
