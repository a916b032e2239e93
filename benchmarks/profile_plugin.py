"""What the plugin itself costs inside a running engine: its entry points timed in process.

End-to-end throughput ratios (bench_throughput.py) cannot resolve a 1% cost on a noisy
2-core machine; this measures it directly. One offline engine runs in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``) with K random steers loaded; the plugin's per-step
bookkeeping (the V1 processor's ``update_state``), the steer op in the head
(``StepPlanner.steer_rows``, with its planning ``prepare_torch`` counted separately) and,
for scale, vLLM's LM-head matmul are wrapped with timers. For each pattern (no request
steered; every request on one steer; requests spread over K distinct steers) the same batch
is generated and each part's share of the generate time is printed.

    python benchmarks/profile_plugin.py                      # embedded model, CPU
    python benchmarks/profile_plugin.py --patterns 0,1,16 --repeats 3
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

TIMES: collections.Counter = collections.Counter()
CALLS: collections.Counter = collections.Counter()


def timed(owner, name: str, key: str) -> None:
    """Replace ``owner.name`` (a function attribute) by a timed wrapper."""
    fn = getattr(owner, name)

    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            TIMES[key] += time.perf_counter() - t0
            CALLS[key] += 1

    setattr(owner, name, wrapper)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--steers", type=int, default=16, help="steers loaded (K max)")
    ap.add_argument("--rank", type=int, default=64)
    ap.add_argument("--patterns", default="0,1,4,16",
                    help="K per run: 0 = no request steered, K = requests over K steers")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--dtype", default="auto")
    args = ap.parse_args(argv)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the worker runs in this process

    import torch
    from transformers import AutoConfig
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.model_executor.layers.logits_processor import LogitsProcessor

    from bench_throughput import make_prompts, random_steer_files
    from vllm_steer import kernels, ops
    from vllm_steer.integrations import request_state_v1
    from vllm_steer.integrations.worker import planner
    from vllm_steer.models import resolve_model

    class Hooks:  # the torch backend's two entry points, as registered with the dispatch
        prepare = staticmethod(kernels.torch_steer.prepare_torch)
        run = staticmethod(kernels.torch_steer.steer_torch)

    timed(request_state_v1.SteerRequestStateV1, "update_state", "bookkeeping (update_state)")
    timed(planner.StepPlanner, "steer_rows", "steer op in the head (steer_rows)")
    timed(Hooks, "prepare", "  of which planning (prepare_torch)")
    timed(LogitsProcessor, "_get_logits", "LM-head matmul (for scale)")
    ops.register_backend("torch", Hooks.run, prepare=Hooks.prepare)

    model = resolve_model(args.model)
    hidden = AutoConfig.from_pretrained(model).hidden_size
    steers = random_steer_files(hidden, args.rank, args.steers, "profile-steers-")
    llm = LLM(model, max_model_len=args.prompt_len + args.output_len + 16,
              max_num_seqs=args.batch, seed=0, enforce_eager=True, dtype=args.dtype,
              kv_cache_memory_bytes=1 << 30,
              additional_config={"vllm_steer": {"steers": steers}})
    prompts = [TokensPrompt(prompt_token_ids=p)
               for p in make_prompts(model, args.batch, args.prompt_len)]
    names = list(steers)

    def params(k):
        return [SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=0,
                               extra_args={"steer": {names[i % k]: 1.0 + i % 7}} if k else None)
                for i in range(args.batch)]

    llm.generate(prompts, params(1), use_tqdm=False)  # warm-up, steered once
    patterns = [int(k) for k in args.patterns.split(",")]
    print(f"\n{args.model}: batch {args.batch}, {args.output_len} output tokens, "
          f"{args.steers} rank-{args.rank} steers loaded, dtype {args.dtype}, "
          f"torch threads {torch.get_num_threads()}")
    print("\n| steered requests | part | ms per step | share of generate time |")
    print("|---|---|---:|---:|")
    for _ in range(args.repeats):
        for k in patterns:
            TIMES.clear(), CALLS.clear()
            t0 = time.perf_counter()
            llm.generate(prompts, params(k), use_tqdm=False)
            total = time.perf_counter() - t0
            label = "none" if k == 0 else f"K = {k}" + (" (one steer)" if k == 1 else
                                                         " distinct steers")
            steps = max(CALLS["bookkeeping (update_state)"], 1)
            for key in ("bookkeeping (update_state)", "steer op in the head (steer_rows)",
                        "  of which planning (prepare_torch)", "LM-head matmul (for scale)"):
                print(f"| {label} | {key} | {1e3 * TIMES[key] / steps:.3f} | "
                      f"{100 * TIMES[key] / total:.2f}% |")
            print(f"| {label} | generate ({steps} steps) | {1e3 * total / steps:.1f} | 100% |")
    os._exit(0)  # the in-process engine has no clean shutdown path worth waiting for


if __name__ == "__main__":
    sys.exit(main())
