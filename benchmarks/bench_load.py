"""How long loading and unloading a steer takes in an idle engine (offline ``vllm.LLM``).

Loads ``--repeats`` random rank-``--rank`` steers (4 files in turn) with
``vllm_steer.offline.load_steer`` and unloads each with ``unload_steer``, timing each call
from the call to the answer: file checks, the engine core's registry, the factors put on
every worker. Under traffic, over HTTP: ``bench_serve.py --churn``.

    .venv/bin/python benchmarks/bench_load.py                 # embedded model, rank 64
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--rank", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=40)
    args = ap.parse_args(argv)

    from transformers import AutoConfig
    from vllm import LLM

    from bench_serve import pct
    from bench_throughput import random_steer_files
    from vllm_steer import offline
    from vllm_steer.models import resolve_model

    model = resolve_model(args.model)
    d = AutoConfig.from_pretrained(model).hidden_size
    paths = list(random_steer_files(d, args.rank, 4, "bench-load-").values())
    llm = LLM(model, additional_config={"vllm_steer": {"steers": {}, "max_steers": 8}},
              max_model_len=256, max_num_seqs=8, enforce_eager=True,
              kv_cache_memory_bytes=1 << 28)
    loads, unloads = [], []
    for k in range(args.repeats):
        t = time.perf_counter()
        offline.load_steer(llm, f"x{k % 4}", paths[k % 4])
        loads.append(1e3 * (time.perf_counter() - t))
        t = time.perf_counter()
        offline.unload_steer(llm, f"x{k % 4}")
        unloads.append(1e3 * (time.perf_counter() - t))
    print(f"{args.model} (hidden {d}), rank {args.rank}, {args.repeats} loads and unloads: "
          f"load p50 {pct(loads, 50):.1f} ms, p99 {pct(loads, 99):.1f} ms; unload p50 "
          f"{pct(unloads, 50):.1f} ms, p99 {pct(unloads, 99):.1f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
