"""Tile policy of the fused steer: which tiles, launch options and compile-time parameters its
kernels (:mod:`.jit`) get, from shapes only (no data: no sync, a CUDA-graph-stable launch).

Compiles: Triton compiles one binary per set of compile-time parameters (the ``constexpr``
tile sizes and flags, and the "== 1" / "multiple of 16" facts of integer arguments). The row
count changes every step, so :func:`choose_tiles` sees only its power-of-two bucket
(:func:`vllm_steer.kernels.layout.row_bucket`): the binaries reachable for 1..max_rows rows are
the few of :func:`.warmup.specializations`.

Batch invariance: in vLLM's batch-invariant mode (``VLLM_BATCH_INVARIANT=1``, read by
:func:`vllm_steer.kernels.batch_invariant`) :func:`choose_tiles` ignores the row count (the
tiles of :data:`INVARIANT_ROWS` rows, ``split_d == 1``: no atomics), so every row goes through
the same reductions in the same order whatever the batch: its output is bit for bit the same at
any batch size and next to any other rows. Outside that mode the tiles follow the row count's
bucket and a row's last bits may depend on the batch (fp32: 1 ulp measured on an H200).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

import torch

from vllm_steer.kernels import batch_invariant
from vllm_steer.kernels.layout import row_bucket

#: fp32 x fp32 dot precision on CUDA ("tf32x3" ~ fp32 accuracy on tensor cores, or "ieee").
FP32_PRECISION = os.environ.get("VLLM_STEER_FP32_PRECISION", "tf32x3")
#: Tuning on a GPU: "field=value,..." of :class:`Tiles` applied over ``choose_tiles``
#: (e.g. ``VLLM_STEER_TILES=expand_r=64,num_stages=4``; benchmarks/kernel_bench.py --tiles).
ENV_TILES = "VLLM_STEER_TILES"

# Operand modes of a dot (the MODE of jit._mma).
_NATIVE, _SPLIT_BF16, _FP32 = 0, 1, 2

_NUM_SMS: dict[int, int] = {}


def _num_sms(device: torch.device) -> int:
    """The SM count the tiles are chosen for (cached per CUDA device; 1 on the CPU)."""
    if device.type != "cuda":  # the interpreter: fewest, largest programs
        return 1
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _NUM_SMS:
        _NUM_SMS[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _NUM_SMS[idx]


def _mode(a_dtype: torch.dtype, b_dtype: torch.dtype) -> int:
    """The operand mode of a dot of ``a_dtype`` by ``b_dtype`` operands."""
    if a_dtype == b_dtype and a_dtype in (torch.float16, torch.bfloat16):
        return _NATIVE
    if b_dtype == torch.bfloat16:
        return _SPLIT_BF16
    return _FP32


@dataclass(frozen=True)
class Tiles:
    """Tile sizes and launch options of the two kernels (tiles: powers of two, >= 16)."""

    shrink_m: int = 64  # rows of a steer's segment per shrink program
    shrink_r: int = 64  # bank columns (rank) per shrink program
    shrink_d: int = 64  # hidden slice per step of the shrink's reduction loop
    split_d: int = 1  # shrink programs per rank block along hidden (>1: fp32 atomics)
    expand_m: int = 64  # rows (in perm order) per expand program
    expand_d: int = 64  # output columns per expand program
    expand_r: int = 32  # rank per step of the expand's reduction loop
    shrink_warps: int = 4
    expand_warps: int = 4
    num_stages: int = 4


def _divides(block: int, offs: list[int]) -> bool:
    return all(o % block == 0 for o in offs)


def _pow2_at_least(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


#: The row count the tiles are chosen for in batch-invariant mode, whatever the batch (a
#: typical decode batch: the tiles of 1 row would starve large batches, those of 256 rows
#: waste work on small ones).
INVARIANT_ROWS = 64


def choose_tiles(num_rows: int, hidden: int, offs: list[int], num_sms: int,
                 invariant: bool | None = None) -> Tiles:
    """Tiles from shapes only (no data, so no sync and a CUDA-graph-stable launch).

    The row count enters through its bucket (:func:`~vllm_steer.kernels.layout.row_bucket`)
    only, so that the compiled kernels reachable from 1..max_rows rows are a handful
    (:func:`.warmup.specializations`).
    ``invariant`` (default: :func:`vllm_steer.kernels.batch_invariant`): the row count does
    not enter at all (tiles of :data:`INVARIANT_ROWS` rows) and the hidden split is off, so a
    row's result does not depend on its batch.

    The largest tiles (fewest re-reads of the activations and of ``buf``) whose grid still
    gives every SM a program, preferring tiles that divide the rank offsets and hidden (no
    masks: vectorised, aligned loads); a split of the shrink along hidden when even 16-wide rank
    tiles leave SMs idle (a few rows, low rank). Warps: enough that no tile spills registers
    (checked with cuobjdump -res-usage on sm_90 builds of every mode).
    """
    K = len(offs) - 1
    ranks = [offs[k + 1] - offs[k] for k in range(K)]
    if invariant is None:
        invariant = batch_invariant()
    num_rows = INVARIANT_ROWS if invariant else row_bucket(num_rows)

    def even(block, fallback):  # the largest power of two <= block dividing all offsets
        b = block
        while b >= 16 and not _divides(b, offs):
            b //= 2
        return b if b >= 16 else fallback

    # Rows per steer when each row uses about one steer: the shrink's segments.
    per_steer = max(1, num_rows // max(K, 1))
    shrink_m = min(64, max(16, _pow2_at_least(per_steer)))
    seg_blocks = max(1, -(-per_steer // shrink_m))
    shrink_r = 16
    for r in (128, 64, 32):
        if sum(-(-rk // r) for rk in ranks) * seg_blocks >= num_sms:
            shrink_r = r
            break
    shrink_r = even(shrink_r, shrink_r)
    while sum(-(-rk // shrink_r) for rk in ranks) > 65535 and shrink_r < 128:
        shrink_r *= 2  # grid axis 1 holds the rank blocks (CUDA limit 65535)
    shrink_d = next((b for b in (64, 32, 16) if hidden % b == 0), 64)
    programs = sum(-(-rk // shrink_r) for rk in ranks) * seg_blocks
    split_d = 1
    while (not invariant and programs * split_d < num_sms and hidden // (split_d * 2) >= 256
           and hidden % (shrink_d * split_d * 2) == 0):
        split_d *= 2
    expand_m = min(64, max(16, _pow2_at_least(num_rows)))
    row_blocks = -(-num_rows // expand_m)
    expand_d = 32
    for dd in (128, 64):
        if row_blocks * -(-hidden // dd) >= num_sms:
            expand_d = dd
            break
    while expand_d > 16 and hidden % expand_d:
        expand_d //= 2
    return Tiles(shrink_m=shrink_m, shrink_r=shrink_r, shrink_d=shrink_d, split_d=split_d,
                 expand_m=expand_m, expand_d=expand_d, expand_r=even(32, 32),
                 shrink_warps=8 if shrink_m * shrink_r >= 2048 else 4,
                 expand_warps=8 if expand_m * expand_d >= 4096 else 4)


def _with_overrides(t: Tiles) -> Tiles:
    """``t`` with the fields ``$VLLM_STEER_TILES`` sets (:data:`ENV_TILES`) over it."""
    spec = os.environ.get(ENV_TILES, "").strip()
    if not spec:
        return t
    fields = set(Tiles.__dataclass_fields__)
    over = {}
    for item in spec.split(","):
        name, _, value = item.partition("=")
        name = name.strip()
        if name not in fields or not value.strip().isdigit():
            raise ValueError(f"${ENV_TILES}: bad item {item!r}; use name=int with name one of "
                             f"{sorted(fields)}")
        over[name] = int(value)
    return replace(t, **over)


def kernel_params(t: Tiles, hidden: int, offs: list[int], act_dtype: torch.dtype,
                  fac_dtype: torch.dtype, interpret: bool = False) -> tuple[dict, dict]:
    """Compile-time parameters (and launch options) of the shrink and expand kernels."""
    common = dict(FP32_PREC=FP32_PRECISION, INTERPRET=interpret)
    shrink = dict(BLOCK_M=t.shrink_m, BLOCK_R=t.shrink_r, BLOCK_D=t.shrink_d,
                  SPLIT_D=t.split_d, EVEN_R=_divides(t.shrink_r, offs),
                  EVEN_D=hidden % (t.shrink_d * t.split_d) == 0,
                  MODE=_mode(act_dtype, fac_dtype), **common)
    expand = dict(BLOCK_M=t.expand_m, BLOCK_D=t.expand_d, BLOCK_R=t.expand_r,
                  EVEN_R=_divides(t.expand_r, offs), EVEN_D=hidden % t.expand_d == 0,
                  MODE=_mode(torch.float32, fac_dtype), **common)
    if not interpret:
        shrink.update(num_warps=t.shrink_warps, num_stages=t.num_stages)
        expand.update(num_warps=t.expand_warps, num_stages=t.num_stages)
    return shrink, expand

