"""The plugin's own host work per decode step, through the real hooks of an in-process engine,
next to vLLM's own step time, for the V1 runner and Model Runner V2, in one run.

An offline engine runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: the engine core
and the worker are this process) on a tiny random Llama (hidden 64) with four random steers,
and is stepped by hand (``LLMEngine.step``) through decode steps of a batch of 256 requests
(``--batch``), of which 0, 1 or 256 are steered (``--rows``). Every worker hook of the plugin (``plugin.HOOKS``, worker
process) is timed *exclusively*: the time inside vLLM's original (``orig``) is taken out; so
are the steered head (``SteeredLogitsProcessor.forward`` less vLLM's own logits layer) and the
per-request steer state's callbacks (``update_state``; ``add_request``, ``apply_staged_writes``).
The steer op (the backend function the runtime calls) is timed on its own in the same calls:
``plugin - op`` is what the plugin adds around the op. A do-nothing hook on a method vLLM calls
once per step (``Scheduler.schedule``), timed the same way, measures what the harness itself
costs per hook call where vLLM calls it (cold caches, this machine's load); ``net`` takes that
out per plugin call (``calls``: hook, head and callback calls per step). The timer's own cost per region is
measured and taken out (every region's, vLLM's ``orig`` calls included: each one's cost
lands in the plugin region around it). vLLM's step is the wall time of ``LLMEngine.step`` (scheduling, the
forward on this CPU, sampling, output processing), plugin included.

    python benchmarks/bench_plugin_step.py                       # V1 and V2, 0/1/256 rows
    python benchmarks/bench_plugin_step.py --runners v1 --steps 20 --rows 0,1
    python benchmarks/bench_plugin_step.py --runners v2 --batch 32 --rows 0,1,32   # quicker V2

Model Runner V2 runs on this CPU only through the test shim tests/v2shim (its kernels in the
Triton interpreter: docs/internals.md, "Model Runner V2 on a CPU"); its step time is therefore
far above a GPU's (a batch of 256 takes tens of minutes on a loaded 2-core machine), and only
the plugin's own microseconds compare across runners.
Goals on a CPU: under 10 us of plugin work per unsteered step; within 10 us of the op alone
per steered step.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HIDDEN, RANK, K = 64, 8, 4
#: the batch: this many requests decode together; the first ``rows`` of them are steered
BATCH = 256


class Regions:
    """Exclusive timers: each region's time less the regions inside it (a stack)."""

    def __init__(self):
        self.acc: dict[str, float] = {}
        self.count: dict[str, int] = {}
        self.stack: list[list[float]] = []  # [children time] per open region

    def run(self, bucket: str, fn, *args, **kwargs):
        clock = time.perf_counter
        self.stack.append([0.0])
        t0 = clock()
        try:
            return fn(*args, **kwargs)
        finally:
            dt = clock() - t0
            children = self.stack.pop()[0]
            self.acc[bucket] = self.acc.get(bucket, 0.0) + dt - children
            self.count[bucket] = self.count.get(bucket, 0) + 1
            if self.stack:
                self.stack[-1][0] += dt

    def take(self) -> tuple[dict, dict]:
        acc, count = self.acc, self.count
        self.acc, self.count = {}, {}
        return acc, count


REG = Regions()


_TIMED_ORIG: dict = {}


def _timed_orig(orig):
    """``orig`` timed as "vllm", made once per function (with its signature: the plugin reads
    arguments by name from it, once per function)."""
    inner = _TIMED_ORIG.get(orig)
    if inner is None:
        def inner(*a, **k):
            return REG.run("vllm", orig, *a, **k)
        functools.update_wrapper(inner, orig)
        _TIMED_ORIG[orig] = inner
    return inner


def _timed_hook(wrapper):
    """A hook wrapper whose own time goes to "plugin" and its ``orig``'s to "vllm"."""
    def timed(orig, *args, **kwargs):
        return REG.run("plugin:" + timed.__name__, wrapper, _timed_orig(orig), *args, **kwargs)

    timed.__name__ = getattr(wrapper, "__name__", "timed")
    return timed


def _null_hook(orig, *args, **kwargs):
    return orig(*args, **kwargs)


def _time_method(cls, name: str, bucket: str) -> None:
    fn = cls.__dict__.get(name)
    if fn is None:
        return

    def timed(*args, **kwargs):
        return REG.run(bucket, fn, *args, **kwargs)

    setattr(cls, name, timed)


def _instrument() -> None:
    """Time the plugin's worker hooks, head, per-request state and op (before vLLM starts)."""
    import dataclasses

    from vllm_steer import ops
    from vllm_steer.integrations import plugin

    plugin.HOOKS = tuple(
        dataclasses.replace(h, wrapper=_timed_hook(h.wrapper))
        if h.process == "worker" and h.wrapper is not None else h for h in plugin.HOOKS)
    from vllm.model_executor.layers.logits_processor import LogitsProcessor

    from vllm_steer.integrations.worker import head, request_state_v1, request_state_v2

    _time_method(head.SteeredLogitsProcessor, "forward", "plugin:head")
    _time_method(LogitsProcessor, "forward", "vllm")
    for module in (request_state_v1, request_state_v2):
        for cls_name in dir(module):
            cls = getattr(module, cls_name)
            if isinstance(cls, type) and cls.__module__ == module.__name__:
                for m in ("update_state", "add_request", "apply_staged_writes"):
                    _time_method(cls, m, f"plugin:{cls_name}.{m}")
    # a hook that does nothing, on a vLLM method called once per step, timed like ours: what
    # the timer and a pass-through wrapper cost where vLLM calls them (cold caches, this load)
    from vllm.v1.core.sched.scheduler import Scheduler

    from vllm_steer.integrations.hooks import wrap_method

    wrap_method(Scheduler, "schedule", _timed_hook(_null_hook))
    backend_fn = ops.backend_fn

    def timed_backend_fn(name):
        fn = backend_fn(name)

        def op(*args, **kwargs):
            return REG.run("op", fn, *args, **kwargs)
        return op

    ops.backend_fn = timed_backend_fn


def _region_cost(n: int = 20000) -> float:
    """Seconds the timer itself adds per region (measured: an empty region in a region)."""
    reg = Regions()
    noop = lambda: None  # noqa: E731
    t0 = time.perf_counter()
    for _ in range(n):
        reg.run("x", reg.run, "y", noop)
    t_two = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(n):
        noop()
    return max(0.0, (t_two - (time.perf_counter() - t0)) / (2 * n))


def child(runner: str, rows_list: list[int], steps: int, batch: int = BATCH) -> dict:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    import torch

    torch.set_num_threads(1)
    sys.path.insert(0, str(ROOT / "tests"))
    from helpers.models import make_tiny_llama
    from helpers.steers import random_steer, save_steers

    _instrument()
    from vllm import LLM, SamplingParams

    if runner == "v2":
        import vllm.config.vllm as vcfg

        vcfg.HAS_TRITON = True  # the shim's stand-in backend (as the v2_runner fixture)
    out = {"runner": runner, "batch": batch, "region_cost_us": _region_cost() * 1e6, "rows": {}}
    with tempfile.TemporaryDirectory() as d:
        model = make_tiny_llama(Path(d) / "model")
        steers = save_steers(Path(d), {f"s{i}": random_steer(HIDDEN, RANK, f"s{i}", seed=i)
                                       for i in range(K)})
        llm = LLM(str(model), additional_config={"vllm_steer": {"steers": steers}},
                  dtype="float32", max_num_seqs=batch, max_model_len=128, enforce_eager=True,
                  kv_cache_memory_bytes=1 << 28, seed=0, enable_prefix_caching=False,
                  max_num_batched_tokens=4096)
        engine = llm.llm_engine
        tok = llm.get_tokenizer()
        prompt = tok.encode("Hello there, my name is")
        for rows in rows_list:
            for i in range(batch):
                steer = {f"s{i % K}": 4} if i < rows else None
                sp = SamplingParams(temperature=0, max_tokens=steps + 16, ignore_eos=True,
                                    extra_args=None if steer is None else {"steer": steer})
                engine.add_request(f"r{rows}-{i}", {"prompt_token_ids": prompt}, sp)
            for _ in range(4):  # prefill and the first decode steps, not timed
                engine.step()
            REG.take()
            samples = []
            for _ in range(steps):
                t0 = time.perf_counter()
                engine.step()
                wall = time.perf_counter() - t0
                acc, count = REG.take()
                plugin = sum(v for b, v in acc.items() if b.startswith("plugin:")
                             and b != "plugin:_null_hook")
                regions = sum(count.values())  # each region's cost lands in its parent
                calls = sum(v for b, v in count.items() if b.startswith("plugin:")
                            and b != "plugin:_null_hook")
                samples.append((wall, plugin, acc.get("op", 0.0), regions, acc, calls))
            engine.abort_request([f"r{rows}-{i}" for i in range(batch)])
            while engine.has_unfinished_requests():
                engine.step()
            cost = out["region_cost_us"] * 1e-6
            med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
            out["rows"][rows] = {
                "step_us": med([s[0] for s in samples]) * 1e6,
                "plugin_us": med([max(0.0, s[1] + s[2] - s[3] * cost) for s in samples]) * 1e6,
                "op_us": med([s[2] for s in samples]) * 1e6,
                "regions": med([s[3] for s in samples]),
                "hook_calls": med([s[5] for s in samples]),
                "null_hook_us": med([s[4].get("plugin:_null_hook", 0.0) for s in samples]) * 1e6,
                "detail_us": {b: med([s[4].get(b, 0.0) for s in samples]) * 1e6
                              for b in sorted({b for s in samples for b in s[4]})
                              if b.startswith("plugin:")},
            }
        del llm
    return out


def _v2_env() -> dict[str, str]:
    path = os.environ.get("PYTHONPATH", "")
    return {"PYTHONPATH": os.pathsep.join(p for p in (str(ROOT / "tests" / "v2shim"), path) if p),
            "STEER_TEST_V2_SHIM": "1", "VLLM_USE_V2_MODEL_RUNNER": "1", "TRITON_INTERPRET": "1"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runners", default="v1,v2")
    ap.add_argument("--rows", default="0,1,256", help="steered rows of the batch")
    ap.add_argument("--batch", type=int, default=BATCH, help="requests decoding together")
    ap.add_argument("--steps", type=int, default=30, help="timed decode steps per case")
    ap.add_argument("--detail", action="store_true", help="µs per hook, head and callback")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    if args.child:
        print("RESULT " + json.dumps(child(args.child, rows, args.steps, args.batch)))
        return
    results = []
    for runner in args.runners.split(","):
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", ""))
                                            if p)
        if runner == "v2":
            env.update(_v2_env())
        proc = subprocess.run([sys.executable, __file__, "--child", runner, "--rows", args.rows,
                               "--steps", str(args.steps), "--batch", str(args.batch)], env=env,
                              capture_output=True, text=True)
        line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
        if proc.returncode or not line:
            sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-6000:])
            raise SystemExit(f"{runner}: the benchmark child failed (exit {proc.returncode})")
        results.append(json.loads(line[-1][len("RESULT "):]))
    try:
        load = os.getloadavg()[0]
    except OSError:
        load = float("nan")
    print(f"plugin host work per decode step, batch {args.batch}, {args.steps} steps (median); "
          f"load average {load:.2f} on {os.cpu_count()} CPUs")
    print(f"{'runner':6} {'steered':>7} {'vLLM step us':>13} {'plugin us':>10} {'op us':>8} "
          f"{'plugin-op us':>12} {'plugin/step':>11} {'calls':>5} {'net us':>7}  goal")
    detail = args.detail
    for res in results:
        for rows, r in res["rows"].items():
            extra = r["plugin_us"] - r["op_us"]
            # net: less what a do-nothing hook measures per call where vLLM calls it
            net = max(0.0, extra - r["hook_calls"] * r["null_hook_us"])
            goal = (f"<10 us: {'met' if net < 10 else 'NOT met'}" if int(rows) == 0
                    else f"op+10 us: {'met' if net < 10 else 'NOT met'}")
            print(f"{res['runner']:6} {rows:>7} {r['step_us']:13.0f} {r['plugin_us']:10.1f} "
                  f"{r['op_us']:8.1f} {extra:12.1f} {r['plugin_us'] / r['step_us']:11.2%} "
                  f"{r['hook_calls']:5d} {net:7.1f}  {goal}")
            if detail:
                print("        " + ", ".join(f"{b[7:]} {v:.1f}" for b, v in
                                             r["detail_us"].items() if v >= 0.05))
        null = [r["null_hook_us"] for r in res["rows"].values()]
        print(f"{res['runner']:6} timer cost {res['region_cost_us']:.2f} us per region (taken "
              f"out); a do-nothing hook measures {min(null):.1f}-{max(null):.1f} us per call")


if __name__ == "__main__":
    main()
