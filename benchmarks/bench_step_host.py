"""Host time of one steered decode step in the worker runtime, for two source trees side by side.

``StepPlanner.steer_rows`` is timed per call on an unchanged batch (the steady decode step:
what the plugin adds to each step), for the V1 row source ("batch", row i = slot i) and the V2
one ("mapping": the step's row -> slot). As a floor, the steer op alone with a ready plan
(``steer_torch(..., prepared=plan)``) is timed on the same rows: the difference is the
runtime's own per-step work. Each tree runs in its own process (same package name), one after
the other, in one invocation, so the ratios compare like with like on this machine.

    python benchmarks/bench_step_host.py --trees /work/main,.      # before (main) vs this tree
    python benchmarks/bench_step_host.py --trees . --batch 1,32,256 --calls 400

CPU only (torch backend); on CUDA the same path would add the kernels' launch cost only.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HIDDEN, RANK, K = 576, 16, 4


def child(batches: list[int], calls: int) -> dict:
    import numpy as np
    import torch

    torch.set_num_threads(1)
    sys.path.insert(0, str(Path.cwd() / "tests"))
    from helpers.steers import random_steer
    from vllm_steer.config import SteerServerConfig
    from vllm_steer.format import save_steer
    from vllm_steer.integrations.worker.rows import BatchRows, MappedRows
    from vllm_steer.integrations.worker.runtime import SteerRuntime
    from vllm_steer.kernels.torch_steer import prepare_torch, steer_torch

    out = {}
    with tempfile.TemporaryDirectory() as d:
        steers = {}
        for i in range(K):
            steers[f"s{i}"] = f"{d}/s{i}.safetensors"
            save_steer(steers[f"s{i}"], random_steer(HIDDEN, RANK, f"s{i}", seed=i))
        for bs in batches:
            rt = SteerRuntime(SteerServerConfig(steers=steers, backend="torch"))
            rt.bank_state.load(HIDDEN, torch.device("cpu"), torch.float32)
            rt.ensure_slots(max(bs, 8), torch.device("cpu"))
            for slot in range(bs):  # requests on one steer each, every 4th one unsteered
                row = np.zeros(rt.slots.num_columns, dtype=np.float32)
                if slot % 4 != 3:
                    row[slot % K] = 4e-3
                rt.set_slot(slot, row)
            rt.step.batch_size = bs
            rt.slots.flush()
            h = torch.randn(bs, HIDDEN)
            order = np.random.default_rng(0).permutation(bs)
            sources = {"batch": BatchRows(),
                       "mapping": MappedRows(mapping=torch.from_numpy(order), slots=order)}
            for name, src in sources.items():
                times = []
                rt.step.sampled = src  # as the runner adapter writes it
                for i in range(calls + 20):
                    t0 = time.perf_counter()
                    rt.planner.steer_rows(h)
                    if i >= 20:
                        times.append(time.perf_counter() - t0)
                out[f"{name}/{bs}"] = float(np.median(times) * 1e6)
            coefs = rt.slots.table[:bs].contiguous()
            plan = prepare_torch(*rt.bank_state.bank.factors, coefs)
            times = []
            for i in range(calls + 20):
                t0 = time.perf_counter()
                steer_torch(h, *rt.bank_state.bank.factors, coefs,
                            prepared=plan)
                if i >= 20:
                    times.append(time.perf_counter() - t0)
            out[f"op/{bs}"] = float(np.median(times) * 1e6)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trees", default="/work/main,.", help="comma-separated source trees")
    ap.add_argument("--batch", default="1,32,256")
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=3,
                    help="trees run alternately this many times; each cell keeps its lowest "
                         "median (a shared machine's noise only ever adds time)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    batches = [int(b) for b in args.batch.split(",")]
    if args.child:
        print(json.dumps(child(batches, args.calls)))
        return
    here = Path(__file__).resolve().parents[1]
    results: dict[str, dict] = {}
    for _ in range(args.rounds):
        for tree in args.trees.split(","):
            root = Path(tree).resolve()
            env = dict(os.environ, PYTHONPATH=str(root))
            res = subprocess.run([sys.executable, str(here / "benchmarks" / "bench_step_host.py"),
                                  "--child", "--batch", args.batch, "--calls", str(args.calls)],
                                 cwd=root, env=env, capture_output=True, text=True, check=True)
            got = json.loads(res.stdout.strip().splitlines()[-1])
            prev = results.setdefault(tree, got)
            for k, v in got.items():
                prev[k] = min(prev[k], v)
    trees = list(results)
    print(f"host us per steered step (lowest of {args.rounds} medians of {args.calls}; "
          f"hidden {HIDDEN}, {K} steers of rank {RANK}, 3 of 4 rows steered; torch backend, "
          f"1 thread)")
    head = "| rows | source | " + " | ".join(trees) + " | op alone | "
    head += " | ".join(f"ratio {t}/{trees[0]}" for t in trees[1:])
    print(head + " |")
    print("|" + "---|" * (3 + 2 * len(trees) - 1 + 0))
    for bs in batches:
        for src in ("batch", "mapping"):
            vals = [results[t][f"{src}/{bs}"] for t in trees]
            op = results[trees[-1]][f"op/{bs}"]
            ratios = [f"{v / vals[0]:.2f}" for v in vals[1:]]
            print(f"| {bs} | {src} | " + " | ".join(f"{v:.1f}" for v in vals)
                  + f" | {op:.1f} | " + " | ".join(ratios) + " |")


if __name__ == "__main__":
    main()
