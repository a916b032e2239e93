#!/usr/bin/env python
"""Batched steer kernel benchmark: the kernel against the naive per-steer loop (reference).

For each shape (hidden d, rows, K steers, rank, coefficient pattern) it prints the kernel's
time, the reference's time, the bytes the operation must move (activations in and out, the
factors of the steers in use, the coefficients), the achieved bandwidth as a fraction of the
measured device-to-device copy bandwidth, and the steer's cost as a fraction of the LM-head
matmul ``[rows, d] @ [d, vocab]`` of the same shape.

Patterns (``--pattern``):
  distinct  row r uses steer r % K: min(K, rows) distinct steers in the batch (the bytes grow
            with the number of steers in use);
  loaded    K steers loaded in the bank, every steered row uses steer 0: the cost must not
            grow with the number of *loaded* steers (the naive loop's does);
  mixed     each row uses two random steers.

On CUDA the kernel is the fused Triton kernel (``--backend triton``); on CPU the torch path
(the CPU goal: at least as fast as the naive loop everywhere, faster for K > 1).

Examples::

    .venv/bin/python benchmarks/kernel_bench.py                # CPU defaults, ~2 min on 2 cores
    python benchmarks/kernel_bench.py --device cuda            # the GPU sweep
    python benchmarks/kernel_bench.py --device cuda --quick    # the goal shapes only
    python benchmarks/kernel_bench.py --d 4096 --rows 256 --K 1 8 64 --rank full
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch

try:
    from vllm_steer.reference import steer_reference
    from vllm_steer import kernels
except ImportError:  # run from a checkout that is not installed
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from vllm_steer.reference import steer_reference
    from vllm_steer import kernels

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


# ---------------------------------------------------------------------------------------------
# timing


class Timer:
    """Median wall time of a callable (CUDA events on GPU), interleaving callables so that
    a noisy, shared machine hurts them alike."""

    def __init__(self, device: torch.device, stat: str = "median", flush_mb: int = 256):
        self.device = device
        self.stat = {"median": statistics.median, "min": min}[stat]
        self.cuda = device.type == "cuda"
        # Flushing L2 between GPU runs: bandwidth numbers mean HBM, not cache.
        self.flush = (torch.empty(flush_mb * 2 ** 20, dtype=torch.uint8, device=device)
                      if self.cuda else None)

    def _once(self, fn) -> float:
        if self.cuda:
            self.flush.zero_()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) * 1e-3
        t = time.perf_counter()
        fn()
        return time.perf_counter() - t

    def compare(self, fns: dict, budget_s: float, min_reps: int = 3, max_reps: int = 50):
        """{name: seconds} medians; each fn warmed up once, then run in turn."""
        first = {}
        for name, fn in fns.items():
            fn()  # warm-up (compilation, caches)
            first[name] = self._once(fn)
        per_round = sum(first.values())
        reps = int(max(min_reps, min(max_reps, budget_s / max(per_round, 1e-9))))
        times = {name: [first[name]] for name in fns}
        names = list(fns)
        for i in range(1, reps):  # rotate the order: no callable always runs on cold caches
            for name in names[i % len(names):] + names[:i % len(names)]:
                times[name].append(self._once(fns[name]))
        return {name: self.stat(ts) for name, ts in times.items()}


def copy_bandwidth(device: torch.device, timer: Timer, mb: int) -> float:
    """Bytes per second of a large device-to-device copy (read + write counted)."""
    n = mb * 2 ** 20
    src = torch.empty(n, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    t = timer.compare({"copy": lambda: dst.copy_(src)}, budget_s=1.0, min_reps=5)["copy"]
    src = dst = None  # released (the closures above hold them)
    return 2 * n / t


# ---------------------------------------------------------------------------------------------
# shapes


def make_coefs(pattern: str, rows: int, K: int, device, gen) -> torch.Tensor:
    coefs = torch.zeros(rows, K)
    strength = 5e-3  # the paper's strength 5 times eps0 = 1e-3
    r = torch.arange(rows)
    if pattern == "distinct":
        coefs[r, r % K] = strength
    elif pattern == "loaded":
        coefs[:, 0] = strength
    elif pattern == "mixed":
        a = torch.randint(0, K, (rows,), generator=gen)
        b = torch.randint(0, K, (rows,), generator=gen)
        coefs[r, a] = strength
        coefs[r, b] = -strength
    else:
        raise ValueError(f"unknown pattern {pattern!r}")
    return coefs.to(device)


def must_move_bytes(rows, d, ranks, coefs, act_elt, fac_elt) -> int:
    used = (coefs != 0).any(dim=0).tolist()
    factor = sum(2 * d * r * fac_elt for r, u in zip(ranks, used, strict=False) if u)
    return 2 * rows * d * act_elt + factor + coefs.numel() * 4


def parse_rank(s: str, d: int) -> int:
    return d if s == "full" else min(int(s), d)


def _parser() -> argparse.ArgumentParser:
    """The command line's options."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    ap.add_argument("--backend", default=None,
                    help="kernel backend to time (default: triton on cuda, torch on cpu)")
    ap.add_argument("--quick", action="store_true", help="only the goal shapes")
    ap.add_argument("--d", type=int, nargs="+", help="hidden sizes")
    ap.add_argument("--rows", type=int, nargs="+", help="batch rows")
    ap.add_argument("--K", type=int, nargs="+", help="numbers of steers")
    ap.add_argument("--rank", nargs="+", help="ranks, 'full' = d")
    ap.add_argument("--pattern", nargs="+", choices=["distinct", "loaded", "mixed"],
                    help="coefficient patterns (default: distinct loaded)")
    ap.add_argument("--dtype", choices=list(DTYPES), help="activation and factor dtype "
                    "(default: bf16 on cuda, fp32 on cpu)")
    ap.add_argument("--vocab", type=int, default=128256, help="LM-head vocabulary for the ratio")
    ap.add_argument("--max-factor-gb", type=float, default=24.0,
                    help="skip shapes whose factors exceed this (and 60%% of free GPU memory)")
    ap.add_argument("--no-reference", action="store_true", help="do not time the naive loop")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="stop starting new shapes after this many seconds (noted in the table)")
    ap.add_argument("--time-per-shape", type=float, default=None,
                    help="seconds of timed runs per shape (default 0.3 cuda, 0.6 cpu)")
    ap.add_argument("--stat", choices=["median", "min"], default=None,
                    help="statistic over the timed runs (default: median on cuda; min on cpu, "
                         "whose shared cores add noise that only ever makes runs slower)")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    ap.add_argument("--plan", choices=["call", "once"], default="call",
                    help="torch backend: plan per call (default), or once per shape and time "
                         "the plan's runs, as a decode step of the serving path does; with "
                         "'once', the note compares the chosen strategy with the others, "
                         "timed side by side")
    ap.add_argument("--tiles", default=None, help="Triton tile overrides, e.g. "
                    "'expand_r=64,num_stages=4' (sets $VLLM_STEER_TILES; see Tiles)")
    return ap


def _grid(args, cuda: bool) -> tuple[list, list, list, list, list]:
    """The shapes measured: hidden sizes, rows, K, ranks and patterns (the options', else the
    device's defaults, or its quick set)."""
    if cuda:
        defaults = dict(d=[576, 2048, 4096, 8192], rows=[1, 16, 64, 256, 512], K=[1, 8, 64],
                        rank=["64", "1024", "full"])
        quick = dict(d=[576, 4096], rows=[1, 256], K=[1, 8, 64], rank=["64", "full"])
    else:
        defaults = dict(d=[576], rows=[1, 16, 128], K=[1, 8, 64], rank=["64", "full"])
        quick = dict(d=[576], rows=[1, 64], K=[1, 8, 64], rank=["64", "full"])
    base = quick if args.quick else defaults
    return (args.d or base["d"], args.rows or base["rows"], args.K or base["K"],
            args.rank or base["rank"], args.pattern or ["distinct", "loaded"])


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    if args.tiles:
        os.environ["VLLM_STEER_TILES"] = args.tiles
    if args.threads:
        torch.set_num_threads(args.threads)

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cuda = device.type == "cuda"
    backend = args.backend or ("triton" if cuda else "torch")
    fn = {"torch": kernels.steer_torch, "triton": kernels.steer_triton,
          "reference": steer_reference}[backend]
    if fn is None:
        print(f"backend {backend!r} is not available (triton not installed?)", file=sys.stderr)
        return 2
    if args.plan == "once" and backend != "torch":
        print(f"--plan once applies to the torch backend, not {backend!r}", file=sys.stderr)
        return 2
    dtype = DTYPES[args.dtype or ("bf16" if cuda else "fp32")]
    ds, rows_list, Ks, ranks, patterns = _grid(args, cuda)
    per_shape = args.time_per_shape or (0.3 if cuda else 0.6)

    stat = args.stat or ("median" if cuda else "min")
    timer = Timer(device, stat)
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    act_elt = torch.empty((), dtype=dtype).element_size()
    bw = copy_bandwidth(device, timer, 1024 if cuda else 256)
    name = torch.cuda.get_device_name(device) if cuda else f"CPU, {torch.get_num_threads()} threads"
    if args.tiles:
        print(f"# tile overrides: {args.tiles}")
    print(f"# steer kernel benchmark | device: {name} | kernel: {backend}"
          f"{', planned once per shape' if args.plan == 'once' else ''} | dtype: "
          f"{str(dtype)[6:]} | torch {torch.__version__} | {stat} of interleaved runs")
    print(f"# copy bandwidth (read+write): {bw / 1e9:.1f} GB/s | LM head vocab {args.vocab} | "
          f"strength 5e-3 per steered row" + ("" if cuda else f" | load average "
                                               f"{os.getloadavg()[0]:.1f} on "
                                               f"{os.cpu_count()} cpus"))
    cols = ("d", "rows", "K", "rank", "pattern", "used", "MB", "kernel_us", "ref_us", "speedup",
            "GB/s", "%copy", "lmhead_us", "%lmhead", "note")
    fmt = ("{:>5} {:>5} {:>3} {:>5} {:>8} {:>4} {:>8} {:>10} {:>10} {:>7} {:>7} {:>6} {:>10} "
           "{:>7}  {}")
    print(fmt.format(*cols))
    t_start = time.time()
    results = []
    lm_cache: dict = {}
    for d in ds:
        head = None
        for rank_s in ranks:
            r = parse_rank(rank_s, d)
            for K in Ks:
                factor_bytes = 2 * d * r * K * act_elt
                limit = args.max_factor_gb * 1e9
                if cuda:
                    free, _ = torch.cuda.mem_get_info(device)
                    limit = min(limit, 0.6 * free)
                for rows in rows_list:
                    for pattern in patterns:
                        row = dict(d=d, rows=rows, K=K, rank=rank_s, pattern=pattern)
                        if args.budget_s and time.time() - t_start > args.budget_s:
                            print(fmt.format(d, rows, K, rank_s, pattern, *[""] * 9,
                                             f"skipped: --budget-s {args.budget_s:g} spent"))
                            continue
                        if factor_bytes > limit:
                            print(fmt.format(d, rows, K, rank_s, pattern, *[""] * 9,
                                             f"skipped: factors {factor_bytes / 1e9:.1f} GB > "
                                             f"cap {limit / 1e9:.1f} GB"))
                            continue
                        res = run_shape(fn, timer, device, dtype, d, rows, K, r, pattern, gen,
                                        per_shape, not args.no_reference, args.plan == "once")
                        if head is None:
                            head = torch.randn(args.vocab, d, device=device, dtype=dtype)
                        if (rows, d) not in lm_cache:
                            h = torch.randn(rows, d, device=device, dtype=dtype)
                            lm_cache[(rows, d)] = timer.compare(
                                {"lm": lambda h=h, head=head: h @ head.T},
                                budget_s=per_shape / 2)["lm"]
                        lm = lm_cache[(rows, d)]
                        row.update(res, lmhead=lm)
                        results.append(row)
                        bytes_ = res["bytes"]
                        gbs = bytes_ / res["kernel"] / 1e9
                        ref = res.get("ref")
                        print(fmt.format(
                            d, rows, K, rank_s, pattern, res["used"], f"{bytes_ / 1e6:.2f}",
                            f"{res['kernel'] * 1e6:.1f}",
                            f"{ref * 1e6:.1f}" if ref else "-",
                            f"{ref / res['kernel']:.2f}" if ref else "-",
                            f"{gbs:.1f}", f"{100 * gbs * 1e9 / bw:.0f}%", f"{lm * 1e6:.1f}",
                            f"{100 * res['kernel'] / lm:.1f}%", res.get("note", "")), flush=True)
        head = None  # released (the closures above hold them)
        if cuda:
            torch.cuda.empty_cache()
    if not cuda:
        print(f"# load average at the end: {os.getloadavg()[0]:.1f} (other processes on these "
              f"cores inflate both columns; ratios are of interleaved runs)")
    summarize(results, bw, cuda)
    return 0


def run_shape(fn, timer, device, dtype, d, rows, K, r, pattern, gen, per_shape, with_ref,
              plan_once=False):
    ranks = [r] * K
    offs = [r * k for k in range(K + 1)]
    p1 = torch.randn(d, r * K, device=device, dtype=dtype) / math.sqrt(d)
    p2 = torch.randn(d, r * K, device=device, dtype=dtype) / math.sqrt(r)
    hidden = torch.randn(rows, d, device=device, dtype=dtype)
    coefs = make_coefs(pattern, rows, K, device, gen)
    fns = {"kernel": lambda: fn(hidden, p1, p2, offs, coefs)}
    if with_ref:
        fns["ref"] = lambda: steer_reference(hidden, p1, p2, offs, coefs)
    note = ""
    others = {}
    if plan_once:  # the serving path: planned when the batch's steering changes, run per step
        from vllm_steer.kernels.torch_steer import STRATEGIES, choose_strategy, prepare_torch

        note = choose_strategy(coefs != 0, offs, d)[0]
        plans = {s: prepare_torch(p1, p2, offs, coefs, s) for s in STRATEGIES}
        fns["kernel"] = lambda: fn(hidden, p1, p2, offs, coefs, prepared=plans[note])
        for s in STRATEGIES:
            if s != note:
                others[s] = (lambda plan: lambda: fn(hidden, p1, p2, offs, coefs,
                                                     prepared=plan))(plans[s])
        fns.update(others)
    elif hasattr(fn, "__module__") and fn.__module__.endswith("torch_steer"):
        from vllm_steer.kernels.torch_steer import choose_strategy

        note = choose_strategy(coefs != 0, offs, d, reuse=False)[0]  # timed per call
    # Correctness on the benchmark's own inputs (a fast wrong kernel is no result).
    out, ref = fns["kernel"](), steer_reference(hidden, p1, p2, offs, coefs)
    err = (out.float() - ref.float()).abs().max().item() / max(ref.float().abs().max().item(), 1e-9)
    if err > 2 ** -6:
        note = f"{note} MISMATCH rel err {err:.2g}".strip()
    times = timer.compare(fns, budget_s=per_shape, min_reps=3 if device.type == "cuda" else 5)
    if others:  # how much the chosen plan saves over each other strategy's
        note += " (" + ", ".join(f"{times[s] / times['kernel']:.2f}x vs {s}" for s in others) + ")"
    used = int((coefs != 0).any(dim=0).sum().item())
    res = dict(kernel=times["kernel"], ref=times.get("ref"), used=used, note=note,
               bytes=must_move_bytes(rows, d, ranks, coefs, hidden.element_size(),
                                     p1.element_size()))
    p1 = p2 = hidden = coefs = fns = out = ref = None  # released (the closures above hold them)
    return res


def summarize(results, bw, cuda):
    if not results:
        return
    print()
    with_ref = [x for x in results if x.get("ref")]
    if with_ref:
        sp = [x["ref"] / x["kernel"] for x in with_ref]
        spk = [x["ref"] / x["kernel"] for x in with_ref if x["K"] > 1]
        slow = [x for x in with_ref if x["ref"] / x["kernel"] < 1.0]
        print(f"speedup over the naive per-steer loop: min {min(sp):.2f}x, median "
              f"{statistics.median(sp):.2f}x over {len(sp)} shapes"
              + (f"; K > 1: min {min(spk):.2f}x, median {statistics.median(spk):.2f}x" if spk
                 else ""))
        for x in slow:
            print(f"  slower than the loop: d={x['d']} rows={x['rows']} K={x['K']} "
                  f"rank={x['rank']} {x['pattern']}: {x['ref'] / x['kernel']:.2f}x")
    # Flatness in K at a fixed number of steered rows.
    groups: dict = {}
    for x in results:
        groups.setdefault((x["d"], x["rows"], x["rank"], x["pattern"]), {})[x["K"]] = x["kernel"]
    flat = [(key, ks[max(ks)] / ks[min(ks)], min(ks), max(ks))
            for key, ks in groups.items() if len(ks) > 1]
    for pattern in ("loaded", "distinct", "mixed"):
        rows = [f for f in flat if f[0][3] == pattern]
        if rows:
            worst = max(rows, key=lambda f: f[1])
            within = sum(f[1] <= 1.2 for f in rows)
            print(f"time(K=max)/time(K=min), pattern {pattern}: {within}/{len(rows)} shapes "
                  f"within 20%; worst {worst[1]:.2f}x at d={worst[0][0]} rows={worst[0][1]} "
                  f"rank={worst[0][2]}")
    if cuda:
        goal = [x for x in results if x["d"] == 4096 and x["rows"] == 256 and x["K"] == 8
                and x["rank"] == "full" and x["pattern"] == "distinct"]
        for x in goal:
            frac = x["bytes"] / x["kernel"] / bw
            print(f"GOAL d=4096 rows=256 K=8 full rank: {100 * frac:.0f}% of copy bandwidth "
                  f"(goal >= 70%), {100 * x['kernel'] / x['lmhead']:.1f}% of the LM head "
                  f"(goal < 10%; the factors alone are {x['bytes'] / 1e6:.0f} MB)")


if __name__ == "__main__":
    sys.exit(main())
