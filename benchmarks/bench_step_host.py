"""Host time of one steered decode step in the worker runtime, for two source trees side by side.

``StepPlanner.steer_rows`` is timed per call on an unchanged batch (the steady decode step:
what the plugin adds to each step), for the V1 row source ("batch", row i = slot i) and the V2
one ("mapping": the step's row -> slot). As a floor, the steer op alone with a ready plan
(``steer_torch(..., prepared=plan)``) is timed on the same rows: the difference is the
runtime's own per-step work. Each tree runs in its own process (same package name), one after
the other, in one invocation, so the ratios compare like with like on this machine.

    python benchmarks/bench_step_host.py --trees /work/main,.      # before (main) vs this tree
    python benchmarks/bench_step_host.py --trees . --batch 1,32,256 --calls 400

A second table times *changed* steps on the path the LM head's CUDA graphs replay (a graph
backend that replays nothing stands in for CUDA, so only host work is timed): ``--changed-rows``
rows over ``--max-steers`` bank slots (2 coefficient columns each), twice as many request slots,
and at every step one request replaced: V1 ("batch": a new request in the same slot, row i =
slot i) and V2 ("mapping": the request leaves, a new one joins in a free slot, so the step's row
-> slot array changes too). Each step is the request state's work (two ``set_slot``, one
``flush``) and the head's (``steer_rows``), timed together and the head alone.

CPU only (torch backend); on CUDA the same path would add the kernels' launch cost only.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HIDDEN, RANK, K = 576, 16, 4
CHANGED_HIDDEN, CHANGED_RANK = 64, 4  # the changed-step case: host work, not the op, is timed


class NoReplay:
    """A graph backend whose graphs do nothing: the head's host work on the graphs' path."""

    def capture(self, fn):
        return None

    def replay(self, graph) -> None:
        pass

    def reset(self) -> None:
        pass


def _request_row(cols: int, rng, k: int):
    """Request ``k``'s coefficients: one of the K steers, every 4th request unsteered."""
    import numpy as np

    r = np.zeros(cols, dtype=np.float32)
    if k % 4 != 3:
        r[k % K] = float(rng.uniform(-8, 8)) * 1e-3
    return r


def changed_steps(steers: dict, rows: int, max_steers: int, calls: int) -> dict:
    """Host us per changed step (one request replaced) on the graphs' path: see the doc."""
    import numpy as np
    import torch

    from vllm_steer.config import SteerServerConfig
    from vllm_steer.integrations.worker.rows import BatchRows, MappedRows
    from vllm_steer.integrations.worker.runtime import SteerRuntime

    out = {}
    cpu = torch.device("cpu")
    for name in ("batch", "mapping"):
        rt = SteerRuntime(SteerServerConfig(steers=steers, max_steers=max_steers,
                                            max_steer_rank=CHANGED_RANK))
        rt.bank_state.graph_backend = NoReplay()
        slots = 2 * rows
        rt.ensure_slots(slots, cpu)
        rt.bank_state.load(CHANGED_HIDDEN, cpu, torch.float32)
        rt.model_loaded(torch.float32)
        assert rt.bank_state.bank.graphs is not None
        rng = np.random.default_rng(0)
        cols = rt.slots.num_columns
        live = np.arange(rows) if name == "batch" else rng.permutation(slots)[:rows]
        free = collections.deque(sorted(set(range(slots)) - set(live.tolist())))
        for k, slot in enumerate(live):
            rt.set_slot(int(slot), _request_row(cols, rng, k))
        rt.step.batch_size = rows
        rt.slots.flush()
        h = torch.randn(rows, CHANGED_HIDDEN)
        total, head = [], []
        for i in range(calls + 20):
            t0 = time.perf_counter()
            k = i % rows
            if name == "batch":  # a new request in the slot of the one that left
                rt.set_slot(k, None)
                rt.set_slot(k, _request_row(cols, rng, i))
                src = BatchRows()
            else:  # the request in row k leaves; a new one joins in a free slot, in its row
                old, new = int(live[k]), free.popleft()
                free.append(old)
                rt.set_slot(old, None)
                rt.set_slot(new, _request_row(cols, rng, i))
                live = live.copy()
                live[k] = new
                src = MappedRows(mapping=None, slots=live, key=live.tobytes())
            rt.slots.flush()
            rt.step.sampled = src
            t1 = time.perf_counter()
            rt.planner.steer_rows(h)
            t2 = time.perf_counter()
            if i >= 20:
                total.append(t2 - t0)
                head.append(t2 - t1)
        graphs = rt.bank_state.bank.graphs
        assert graphs.replays == calls + 20, (graphs.replays, graphs.failed)
        out[f"changed/{name}"] = float(np.median(total) * 1e6)
        out[f"changed-head/{name}"] = float(np.median(head) * 1e6)
    return out


def child(batches: list[int], calls: int, changed_rows: int, max_steers: int) -> dict:
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
        if changed_rows:
            small = {}
            for i in range(K):
                small[f"c{i}"] = f"{d}/c{i}.safetensors"
                save_steer(small[f"c{i}"], random_steer(CHANGED_HIDDEN, CHANGED_RANK, f"c{i}",
                                                        seed=i))
            out.update(changed_steps(small, changed_rows, max_steers, calls))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trees", default="/work/main,.", help="comma-separated source trees")
    ap.add_argument("--batch", default="1,32,256")
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=3,
                    help="trees run alternately this many times; each cell keeps its lowest "
                         "median (a shared machine's noise only ever adds time)")
    ap.add_argument("--changed-rows", type=int, default=256,
                    help="rows of the changed-step case (0: not run)")
    ap.add_argument("--max-steers", type=int, default=256,
                    help="bank slots of the changed-step case (2 coefficient columns each)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    batches = [int(b) for b in args.batch.split(",")]
    if args.child:
        print(json.dumps(child(batches, args.calls, args.changed_rows, args.max_steers)))
        return
    here = Path(__file__).resolve().parents[1]
    results: dict[str, dict] = {}
    for _ in range(args.rounds):
        for tree in args.trees.split(","):
            root = Path(tree).resolve()
            env = dict(os.environ, PYTHONPATH=str(root))
            res = subprocess.run([sys.executable, str(here / "benchmarks" / "bench_step_host.py"),
                                  "--child", "--batch", args.batch, "--calls", str(args.calls),
                                  "--changed-rows", str(args.changed_rows),
                                  "--max-steers", str(args.max_steers)],
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
    if args.changed_rows:
        print()
        print(f"host us per changed step on the graphs' path (one request replaced a step; "
              f"{args.changed_rows} rows, {args.max_steers} steer slots = "
              f"{2 * args.max_steers} columns, {2 * args.changed_rows} request slots; the "
              f"graphs replay nothing): request state + head, and the head alone")
        print("| source | " + " | ".join(f"{t} (all) | {t} (head)" for t in trees) + " |")
        print("|" + "---|" * (1 + 2 * len(trees)))
        for src in ("batch", "mapping"):
            cells = [f"{results[t][f'changed/{src}']:.1f} | "
                     f"{results[t][f'changed-head/{src}']:.1f}" for t in trees]
            print(f"| {src} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
