"""Compile the steer kernels for a CUDA architecture without a GPU (ahead of time).

Semantics: see vllm_steer.reference. This checks what the interpreter cannot: that the kernels
lower through Triton's real code generator (types of loop-carried values, dot operand dtypes,
layouts) for the configurations ``choose_tiles`` (:mod:`.triton.tiling`) picks, and how many
registers they use and whether they spill (with ``cuobjdump -res-usage`` from Triton's bundled
CUDA tools).

    python -m vllm_steer.kernels.aot_check            # the default shapes x dtypes, sm_90
    python -m vllm_steer.kernels.aot_check --arch 80 --quick

Both ops: the planned fused op (segments, shrink, expand) and the grouped capture-safe op
(:mod:`.triton.grouped`: rows, segments, shrink, expand) at :data:`GROUPED_SHAPES`.

Must run with ``TRITON_INTERPRET`` unset (interpreted kernels cannot be compiled); exits 1 if a
kernel fails to compile.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

import torch

DT = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
TT = {"fp32": "fp32", "fp16": "fp16", "bf16": "bf16"}
# (rows, hidden, ranks, K): decode, the goal shape, many low-rank steers, odd sizes.
SHAPES = [(1, 4096, 64, 1), (256, 4096, 4096, 8), (512, 8192, 1024, 8), (256, 4096, 64, 64),
          (16, 576, 576, 1), (37, 1000, 17, 3)]
DTYPES = [("bf16", "bf16"), ("fp16", "fp16"), ("fp32", "fp32"), ("fp32", "bf16"),
          ("bf16", "fp32")]
# The grouped op: (hidden, rank, bank columns, most steers a row): the goal shape (256 slots
# of rank 64, 8 steers a request), a narrow steer, odd sizes.
GROUPED_SHAPES = [(4096, 64, 512, 16), (4096, 16, 64, 2), (1000, 17, 6, 3)]


def _resources(cubin: bytes) -> str:
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                        "cuobjdump")
    if not os.path.exists(tool):
        return "?"
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
    try:
        out = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True).stdout
    finally:
        os.unlink(f.name)
    m = re.search(r"REG:(\d+) STACK:(\d+)", out)
    return f"regs {m.group(1)} stack {m.group(2)}" if m else "?"


def compile_all(arch: int, shapes, dtypes, num_sms: int = 132,
                grouped_shapes=tuple(GROUPED_SHAPES)) -> int:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from .triton import jit, launch, tiling

    if launch._interpreting():
        print("aot_check: TRITON_INTERPRET is set; run without it", file=sys.stderr)
        return 2
    target = GPUTarget("cuda", arch, 32)

    def build(fn, sig, params):
        params = dict(params)
        opts = {k: params.pop(k) for k in ("num_warps", "num_stages") if k in params}
        sig = dict(sig, **{k: "constexpr" for k in params})
        return triton.compile(ASTSource(fn=fn, signature=sig, constexprs=params),
                              target=target, options=opts)

    failures = 0
    seg = build(jit._steer_segments_kernel,
                dict(coefs_ptr="*fp32", seg_rows_ptr="*i32", seg_counts_ptr="*i32",
                     perm_ptr="*i32", num_rows="i32", K="i32"), dict(CHUNK=128, K_PAD=64))
    print(f"segments: {_resources(seg.asm['cubin'])}")
    for rows, d, rank, K in shapes:
        offs = [min(rank, d) * k for k in range(K + 1)]
        t = tiling.choose_tiles(rows, d, offs, num_sms)
        for act, fac in dtypes:
            shrink_kw, expand_kw = tiling.kernel_params(t, d, offs, DT[act], DT[fac])
            ints = dict(num_rows="i32", hidden="i32", total_rank="i32", K="i32")
            try:
                s = build(jit._steer_shrink_kernel, dict(
                    hidden_ptr=f"*{TT[act]}", p1_ptr=f"*{TT[fac]}", coefs_ptr="*fp32",
                    seg_rows_ptr="*i32", seg_counts_ptr="*i32", blk_steer_ptr="*i32",
                    blk_col_ptr="*i32", blk_end_ptr="*i32", buf_ptr="*fp32", stride_h="i32",
                    **ints), shrink_kw)
                e = build(jit._steer_expand_kernel, dict(
                    hidden_ptr=f"*{TT[act]}", p2_ptr=f"*{TT[fac]}", coefs_ptr="*fp32",
                    perm_ptr="*i32", rank_offsets_ptr="*i32", buf_ptr="*fp32",
                    out_ptr=f"*{TT[act]}", stride_h="i32", stride_o="i32", **ints), expand_kw)
                print(f"rows {rows:4} d {d:5} rank {rank:5} K {K:3} {act}/{fac}: "
                      f"shrink {t.shrink_m}x{t.shrink_r} split {t.split_d} w{t.shrink_warps} "
                      f"{_resources(s.asm['cubin'])} | expand {t.expand_m}x{t.expand_d} "
                      f"r{t.expand_r} w{t.expand_warps} {_resources(e.asm['cubin'])}", flush=True)
            except Exception as exc:  # report every failing configuration, then fail
                failures += 1
                print(f"FAILED rows {rows} d {d} rank {rank} K {K} {act}/{fac}: "
                      f"{type(exc).__name__}: {exc}", flush=True)
    return 1 if (failures or compile_grouped(build, grouped_shapes, dtypes)) else 0


def compile_grouped(build, shapes, dtypes) -> int:
    """Compile the grouped op's four kernels (:mod:`.triton.grouped_jit`) for each shape and
    dtype pair, as :func:`.triton.grouped.steer_grouped` launches them; returns the failures."""
    from .triton import grouped, grouped_jit, tiling

    failures = 0
    p2 = tiling._pow2_at_least
    for d, rank, cols, s in shapes:
        s_pad, br = max(2, p2(s)), max(16, p2(rank))
        split = grouped.split_d(d)
        common = dict(FP32_PREC=tiling.FP32_PRECISION, INTERPRET=False)
        for act, fac in dtypes:
            try:
                rows = build(grouped_jit._grouped_rows_kernel, dict(
                    table_ptr="*fp32", index_ptr="*i64", slots_ptr="*i32", vals_ptr="*fp32",
                    num_rows="i32", table_rows="i32", C="i32"),
                    dict(HAS_INDEX=True, S=s, S_PAD=s_pad, BLOCK_M=grouped.BLOCK_M,
                         C_CHUNK=max(16, min(128, p2(cols)))))
                seg = build(grouped_jit._grouped_segments_kernel, dict(
                    slots_ptr="*i32", seg_ptr="*i32", counts_ptr="*i32", perm_ptr="*i32",
                    num_rows="i32", C="i32"), dict(S=s, S_PAD=s_pad, CHUNK=256))
                shrink = build(grouped_jit._grouped_shrink_kernel, dict(
                    hidden_ptr=f"*{TT[act]}", p1_ptr=f"*{TT[fac]}", seg_ptr="*i32",
                    counts_ptr="*i32", widths_ptr="*i32", buf_ptr="*fp32", stride_h="i32",
                    ld_p="i32",
                    num_rows="i32", hidden="i32", R="i32"), dict(
                    S=s, BLOCK_M=grouped.BLOCK_M, BLOCK_R=br, BLOCK_D=grouped.SHRINK_D,
                    SPLIT=split, HAS_WIDTHS=True, EVEN_R=False,
                    EVEN_D=d % (grouped.SHRINK_D * split) == 0,
                    MODE=tiling._mode(DT[act], DT[fac]), num_warps=grouped.SHRINK_WARPS,
                    **common))
                expand = build(grouped_jit._grouped_expand_kernel, dict(
                    hidden_ptr=f"*{TT[act]}", p2_ptr=f"*{TT[fac]}", slots_ptr="*i32",
                    vals_ptr="*fp32", perm_ptr="*i32", widths_ptr="*i32", buf_ptr="*fp32",
                    out_ptr=f"*{TT[act]}",
                    stride_h="i32", stride_o="i32", ld_p="i32", num_rows="i32", hidden="i32",
                    R="i32", C="i32"), dict(
                    S=s, S_PAD=s_pad, BLOCK_M=grouped.BLOCK_M, BLOCK_D=grouped.EXPAND_D,
                    BLOCK_R=br, SPLIT=split, HAS_WIDTHS=True, EVEN_R=False,
                    EVEN_D=d % grouped.EXPAND_D == 0, MODE=tiling._mode(torch.float32, DT[fac]),
                    num_warps=grouped.EXPAND_WARPS, **common))
                print(f"grouped d {d:5} rank {rank:3} columns {cols:4} S {s:2} {act}/{fac}: "
                      f"rows {_resources(rows.asm['cubin'])} | segments "
                      f"{_resources(seg.asm['cubin'])} | shrink split {split} "
                      f"{_resources(shrink.asm['cubin'])} | expand "
                      f"{_resources(expand.asm['cubin'])}", flush=True)
            except Exception as exc:  # report every failing configuration, then fail
                failures += 1
                print(f"FAILED grouped d {d} rank {rank} columns {cols} S {s} {act}/{fac}: "
                      f"{type(exc).__name__}: {exc}", flush=True)
    return failures


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 80, 90")
    ap.add_argument("--quick", action="store_true", help="the goal shape, bf16 and fp32 only")
    ap.add_argument("--grouped-only", action="store_true",
                    help="only the grouped capture-safe op's kernels")
    args = ap.parse_args(argv)
    shapes = SHAPES[1:2] if args.quick else SHAPES
    dtypes = [("bf16", "bf16"), ("fp32", "fp32")] if args.quick else DTYPES
    if args.grouped_only:
        shapes = []
    return compile_all(args.arch, shapes, dtypes,
                       grouped_shapes=GROUPED_SHAPES[:1] if args.quick else GROUPED_SHAPES)


if __name__ == "__main__":
    sys.exit(main())
