#!/usr/bin/env python
"""The grouped capture-safe steer op beside vLLM's ``lora_shrink`` / ``lora_expand``, on the
same shapes, in the same run, against the roofline.

Shapes (the defaults): hidden 4096, rank 64, bf16; a bank of 256 steers (512 coefficient
columns, as the server lays out 256 slots with their domain components); K = 1, 8, 64, 256
distinct steers over 256 rows and over 64 rows (row r uses steer r % K: min(K, rows) steers
in use). Each op is recorded in a CUDA graph and replayed, one call per replay, with L2 flushed
before each (a write of 2x its size), timed with CUDA events; the median is printed.

- **ours**: :func:`vllm_steer.kernels.triton.grouped.steer_grouped` over the bank in place
  (table + index in, the steered rows out; rows grouped on the device inside the graph).
- **lora**: vLLM's kernels (:mod:`lora_ops`, loaded from vLLM's files without vLLM) on the same
  factors in LoRA's layout (``A [L, rank, hidden]``, ``B [L, hidden, rank]``). LoRA takes no
  per-row scale, so the graph scales each row's input by its coefficient first (one
  elementwise kernel: the down-projection is linear), copies the rows to the output, then
  ``lora_shrink`` and ``lora_expand`` (``add_inputs``). Its metadata
  (``LoRAKernelMeta.prepare_tensors``: sort, unique, a host read) is made outside the graph,
  as vLLM makes it once per step; it is timed apart (``meta``). One adapter per token: several
  steers per row would need a token per (row, steer) and a sum after.
- **roofline**: (bytes of the used steers' two factors + the activations read and written) /
  the device-to-device copy bandwidth measured here (each byte read and written, so copy
  bandwidth is the figure), plus 10 us. The goal: ours within 2x of it.

Each line also checks both ops against the reference (fp32 torch), so a fast wrong op fails.

    python benchmarks/bench_grouped_vs_lora.py --device cuda [--lora-ops build/lora_ops]
    TRITON_INTERPRET=1 .venv/bin/python benchmarks/bench_grouped_vs_lora.py --quick   # CPU

On the CPU (Triton's interpreter, no timing): the small shapes' correctness only, in fp16 (the
interpreter's dot mishandles bf16 operands, which the LoRA kernels pass as they are). Exits 1
if a result is wrong.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import lora_ops  # noqa: E402
from cuda_timing import copy_bandwidth, time_graph  # noqa: E402

from vllm_steer.kernels.triton.grouped import grouped_scratch, steer_grouped  # noqa: E402
from vllm_steer.reference import steer_reference  # noqa: E402


def make_bank(d, rank, slots, dtype, device, seed=0):
    """A bank of ``slots`` random steers in the fixed layout (2 * slots columns: the domain
    columns empty, as a server's), and the same steers in LoRA's layout."""
    g = torch.Generator().manual_seed(seed)
    cols = 2 * slots
    a = (torch.randn(slots, d, rank, generator=g) / d ** 0.5).to(dtype)  # P1 of each slot
    b = (torch.randn(slots, d, rank, generator=g) / rank ** 0.5).to(dtype)  # P2
    p1 = torch.zeros(d, cols * rank, dtype=dtype)
    p2 = torch.zeros_like(p1)
    p1[:, :slots * rank] = a.permute(1, 0, 2).reshape(d, slots * rank)
    p2[:, :slots * rank] = b.permute(1, 0, 2).reshape(d, slots * rank)
    return dict(p1=p1.to(device), p2=p2.to(device), lora_a=a.transpose(1, 2).contiguous()
                .to(device), lora_b=b.contiguous().to(device), rank=rank, cols=cols,
                slots=slots)


def make_case(bank, k, rows, seed=0):
    """The table (row r: steer r % k of the bank, spread over its slots, at a coefficient of
    0.5 or 1: a power of two, so LoRA's scaled input is exact), the index and the rows."""
    g = torch.Generator().manual_seed(seed)
    device, dtype = bank["p1"].device, bank["p1"].dtype
    d, slots = bank["p1"].shape[0], bank["slots"]
    used = min(k, rows)
    which = torch.randperm(slots, generator=g)[:used]
    steer_of_row = which[torch.arange(rows) % used]
    coef = 2.0 ** torch.randint(-1, 1, (rows,), generator=g).float()
    table = torch.zeros(rows, bank["cols"])
    table[torch.arange(rows), steer_of_row] = coef
    h = torch.randn(rows, d, generator=g).to(dtype)
    dev = lambda t: t.to(device)  # noqa: E731
    return dict(bank, table=dev(table), index=dev(torch.arange(rows)), h=dev(h),
                mapping=dev(steer_of_row.to(torch.int32)), coef=dev(coef), used=used)


def reference(c):
    """The reference's rows (fp32), on the rows' device, over the steers in use only."""
    cols = sorted(set(c["mapping"].tolist()))
    r = c["rank"]
    take = torch.tensor([j * r + i for j in cols for i in range(r)], device=c["h"].device)
    p1 = c["p1"].index_select(1, take).float()
    p2 = c["p2"].index_select(1, take).float()
    offs = [i * r for i in range(len(cols) + 1)]
    return steer_reference(c["h"].float(), p1, p2, offs, c["table"][:, cols].contiguous()).cpu()


def ours_fn(c):
    rows, d = c["h"].shape
    out = torch.empty_like(c["h"])
    scratch = grouped_scratch(rows, c["cols"], 2, c["rank"], d, c["h"].device)

    def call():
        steer_grouped(c["h"], c["p1"], c["p2"], c["rank"], c["table"], c["index"], out,
                      scratch)
    return call, out


def lora_fn(c, L):
    rows, d = c["h"].shape
    meta = L.Meta.make(c["slots"], rows, c["h"].device)
    meta.prepare_tensors(c["mapping"])
    args = meta.meta_args(rows, False)
    buf = torch.zeros(1, rows, c["rank"], dtype=torch.float32, device=c["h"].device)
    out = torch.empty_like(c["h"])
    x = torch.empty_like(c["h"])

    def call():
        torch.mul(c["h"], c["coef"].to(c["h"].dtype)[:, None], out=x)  # LoRA has no row scale
        out.copy_(c["h"])
        L.shrink(x, [c["lora_a"]], buf, *args, 1.0)
        L.expand(buf, [c["lora_b"]], out, *args, offset_start=0, add_inputs=True)
    return call, out, (lambda: meta.prepare_tensors(c["mapping"]))


def time_eager(call, flush, reps):
    call()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        flush.zero_()
        start.record()
        call()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def check(name, got, ref, h, dtype) -> str | None:
    scale = (ref - h.cpu().float()).abs().max().item()
    err = (got.cpu().float() - ref).abs().max().item()
    # 16-bit outputs: one rounding of values up to a few times the delta (LoRA rounds twice:
    # its delta, then the sum in the output's dtype)
    lim = (2 ** -6 if dtype == torch.bfloat16 else 2 ** -8) * max(scale, h.abs().max().item())
    return None if err <= lim else f"{name}: max error {err:.3g} over {lim:.3g}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--lora-ops", default=None, help="a `lora_ops.py carry` folder (default: "
                    "build/lora_ops if present, else the installed vLLM's files)")
    ap.add_argument("--d", type=int, default=4096)
    ap.add_argument("--rank", type=int, default=64)
    ap.add_argument("--slots", type=int, default=256)
    ap.add_argument("--K", type=int, nargs="+", default=[1, 8, 64, 256])
    ap.add_argument("--rows", type=int, nargs="+", default=[256, 64])
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--quick", action="store_true", help="small shapes (the CPU check)")
    a = ap.parse_args(argv)
    device = torch.device(a.device)
    cuda = device.type == "cuda"
    if not cuda and os.environ.get("TRITON_INTERPRET") != "1":
        print("bench_grouped_vs_lora: on the CPU set TRITON_INTERPRET=1", file=sys.stderr)
        return 2
    if a.quick or not cuda:
        a.d, a.rank, a.slots, a.K, a.rows = 128, 16, 8, [1, 8], [16, 5]
    dtype = torch.bfloat16 if cuda else torch.float16
    src = a.lora_ops or (ROOT / "build" / "lora_ops" if (ROOT / "build" / "lora_ops").exists()
                         else None)
    L = lora_ops.load(src)
    lines, failures = [], []
    say = lambda s: (print(s, flush=True), lines.append(s))  # noqa: E731
    bw = copy_bandwidth(device) if cuda else None
    say(f"# grouped steer op vs vLLM {L.version} lora_shrink+lora_expand; d {a.d}, rank "
        f"{a.rank}, {a.slots} steers loaded ({2 * a.slots} columns), {str(dtype)[6:]}, "
        f"{device}" + (f"; copy bandwidth {bw / 1e12:.2f} TB/s" if bw else " (no timing)"))
    if cuda:
        flush = torch.empty(256 << 20, dtype=torch.uint8, device=device)
        say(f"{'rows':>5} {'K':>4} {'used':>4} {'MiB':>7} {'roof us':>8} {'ours us':>8} "
            f"{'lora us':>8} {'meta us':>8} {'ours/roof':>9} {'lora/ours':>9}")
    bank = make_bank(a.d, a.rank, a.slots, dtype, device)
    for rows in a.rows:
        for k in a.K:
            c = make_case(bank, k, rows, seed=rows * 1000 + k)
            ref = reference(c)
            ours, out_ours = ours_fn(c)
            lora, out_lora, meta = lora_fn(c, L)
            ours(), lora()
            for name, got in (("ours", out_ours), ("lora", out_lora)):
                problem = check(f"rows {rows} K {k} {name}", got, ref, c["h"], dtype)
                if problem:
                    failures.append(problem)
            if not cuda:
                say(f"rows {rows:4} K {k:4}: ours and lora match the reference")
                continue
            nbytes = c["used"] * 2 * a.d * a.rank * dtype.itemsize + 2 * rows * a.d * \
                dtype.itemsize
            roof = nbytes / bw * 1e6 + 10
            t_ours = time_graph(ours, flush, a.reps)
            t_lora = time_graph(lora, flush, a.reps)
            t_meta = time_eager(meta, flush, max(5, a.reps // 5))
            say(f"{rows:5} {k:4} {c['used']:4} {nbytes / 2**20:7.1f} {roof:8.1f} "
                f"{t_ours:8.1f} {t_lora:8.1f} {t_meta:8.1f} {t_ours / roof:9.2f} "
                f"{t_lora / t_ours:9.2f}")
    for f in failures:
        say(f"FAILED {f}")
    out = os.environ.get("OUT")
    if out:
        Path(out, "grouped_vs_lora.txt").write_text("\n".join(lines) + "\n")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
