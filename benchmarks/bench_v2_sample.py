"""Model Runner V2's steered ``sample`` hook alone, with the caches evicted before each call,
against a hook that only calls vLLM's original, in one process.

In an engine, the plugin's V2 ``sample`` runs once per step, after vLLM's whole step has
evicted its objects from the caches (``bench_plugin_step.py`` measures it there). This
reproduces that in a loop: before each call it writes ``--evict-mib`` of memory (0: warm),
then times one call of each hook, interleaved, on the same steady steered batch (16 requests,
one of them steered, the rows of the previous step reused). The runner's ``sample()`` here only
counts the head call the hook checks for, so what is timed is the hook.

``--parts`` adds hooks that stop after each piece of the steady path, written as the plugin
wrote them before it read its binding and ``input_batch`` inline (``V2RunnerBinding.of()``,
``Arg.get``) and keyed a steady step by the bytes of the batch's slots, and as it reads them
now (the request ids), so that each piece's cost shows as a difference within this run.

    python benchmarks/bench_v2_sample.py                 # cold: plugin against pass-through
    python benchmarks/bench_v2_sample.py --evict-mib 0   # warm
    python benchmarks/bench_v2_sample.py --parts --calls 500
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # helpers: the tiny random model and steers
BATCH = 16
#: the ``--parts`` hooks that read as the plugin reads now (the others: as it read before)
INLINE = ("binding inline", "inline, request ids")


def _runtime(workdir: Path):
    """The engine config and the V2 per-request state's runtime (steers a and b, loaded on the
    CPU: ``helpers.v2_state``), with request 0 steered and the other 15 not."""
    from vllm import SamplingParams

    from helpers.engines import bound_extra
    from helpers.models import make_tiny_llama
    from helpers.v2_state import v2_request_state, v2_steer_config

    cfg = v2_steer_config(make_tiny_llama(workdir / "model"), workdir)
    proc = v2_request_state(cfg, max_num_reqs=64)
    proc.add_request(0, SamplingParams(extra_args=bound_extra(["a", "b"], {"a": 4})))
    for slot in range(1, BATCH):
        proc.add_request(slot, SamplingParams())
    proc.apply_staged_writes()
    return cfg, proc.runtime


def _part_hooks(binding_of):
    """Hooks that stop after each piece of the steady path (``binding_of()``: the plugin's
    runner, whose binding they read)."""
    from vllm_steer.integrations.worker import v2
    from vllm_steer.integrations.worker.gates import GATES
    from vllm_steer.integrations.worker.runtime import BINDINGS, V2RunnerBinding

    by_id, arg = BINDINGS.by_id, v2._INPUT_BATCH

    def upto(part):
        def hook(orig, self, *args, **kwargs):
            if not GATES.steered_slots or part == "check":
                return orig(self, *args, **kwargs)
            owner = binding_of()
            if part in INLINE:
                b = by_id.get(id(owner))
                if part == "binding inline":
                    return orig(self, *args, **kwargs)
                input_batch = args[1]  # the runner's sample(hidden_states, input_batch, ...)
            else:
                b = V2RunnerBinding.of(owner)
                if part == "binding by of()":
                    return orig(self, *args, **kwargs)
                input_batch = arg.get(orig, (self, *args), kwargs)
                if part == "input_batch by Arg.get":
                    return orig(self, *args, **kwargs)
            if b.runtime is None:
                raise RuntimeError("the plugin's runner has no runtime")
            if part in INLINE:  # the steady step's check: the request ids of the last one
                if input_batch.req_ids != b.steady_ids:
                    raise RuntimeError("the batch is not the plugin's steady one")
            else:
                input_batch.idx_mapping_np.tobytes()  # the batch's bytes, the old steady key
            return orig(self, *args, **kwargs)
        return hook

    return {name: upto(name) for name in (
        "check", "binding by of()", "input_batch by Arg.get", "batch bytes", *INLINE)}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=400, help="timed calls of each hook")
    ap.add_argument("--evict-mib", type=int, default=64,
                    help="memory written before each call (0: warm caches)")
    ap.add_argument("--parts", action="store_true",
                    help="also hooks that stop after each piece of the steady path")
    args = ap.parse_args(argv)

    import numpy as np
    import torch
    from vllm.v1.worker.gpu.input_batch import InputBatch, InputBuffers

    from vllm_steer.integrations.hooks import wrap_method
    from vllm_steer.integrations.worker import v2

    cfg, rt = _runtime(Path(tempfile.mkdtemp()))
    planner = rt.planner

    class Runner:  # V2's GPUModelRunner as the hook sees it: sample() calls the head
        vllm_config = cfg

        def sample(self, hidden_states, input_batch, grammar_output):
            planner.head_calls += 1

    def pass_through(orig, self, *a, **kw):
        return orig(self, *a, **kw)

    hooks = {"plugin": v2.sample, "pass-through": pass_through}
    if args.parts:
        hooks.update(_part_hooks(lambda: runners["plugin"]))
    runners = {}
    for name, hook in hooks.items():
        cls = type(f"Runner_{len(runners)}", (Runner,), {"sample": Runner.__dict__["sample"]})
        wrap_method(cls, "sample", hook)
        runners[name] = cls()

    batch = InputBatch.make_dummy(BATCH, BATCH, InputBuffers(64, 64, torch.device("cpu")))
    batch.idx_mapping_np = np.arange(BATCH, dtype=np.int32)
    batch.expanded_idx_mapping = torch.arange(BATCH, dtype=torch.int32)
    hidden = torch.randn(BATCH, 64)
    runners["plugin"].sample(hidden, batch, None)  # maps the rows once: later steps reuse them
    evict = np.zeros((args.evict_mib << 20) // 8)
    clock = time.perf_counter_ns
    times: dict[str, list] = {name: [] for name in runners}
    warmup = 20
    for _ in range(warmup + args.calls):
        for name, runner in runners.items():
            if evict.size:
                evict += 1.0
            t0 = clock()
            runner.sample(hidden, batch, None)
            times[name].append(clock() - t0)
    base = statistics.median(times["pass-through"][warmup:]) / 1e3
    caches = "warm" if not evict.size else f"{args.evict_mib} MiB written before each call"
    print(f"V2 sample hook, steady steered batch of {BATCH}, {args.calls} calls each, {caches}")
    print(f"{'hook':<26}{'median us':>10}{'p25 us':>8}{'over pass-through us':>22}")
    for name, ts in times.items():
        ts = ts[warmup:]
        med = statistics.median(ts) / 1e3
        print(f"{name:<26}{med:>10.2f}{np.percentile(ts, 25) / 1e3:>8.2f}{med - base:>22.2f}")


if __name__ == "__main__":
    main()
