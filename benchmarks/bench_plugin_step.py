"""The plugin's own host work per decode step, through the real hooks of an in-process engine,
next to vLLM's own step time, for the V1 runner and Model Runner V2, in one run.

An offline engine runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: the engine core
and the worker are this process) on a tiny random Llama (hidden 64) with four random steers,
and is stepped by hand (``LLMEngine.step``) through decode steps of a batch of 256 requests
(``--batch``), of which 0, 1 or 256 are steered (``--rows``). Every site where the plugin
runs is timed *exclusively*: each worker hook of ``plugin.HOOKS`` (the time inside vLLM's
original, ``orig``, taken out), the steered head (``SteeredLogitsProcessor.forward`` less
vLLM's own logits layer) and the per-request steer state's callbacks (``update_state``;
``add_request``, ``apply_staged_writes``). The steer op (the backend function the runtime
calls) is timed on its own in the same calls.

Steps alternate between the plugin and stand-ins at the very same sites (after :data:`WARM`
untimed steps of each kind; every step decodes the whole batch), timed by the same harness: a
hook that only calls ``orig``, empty callbacks, and for the head the steer op alone on the same
rows (launched as the plugin's head launches it, its result unused) before vLLM's plain logits
layer. A gated hook (``Hook.gates``) whose gates are all closed calls no wrapper in either kind
of step (vLLM's patched method runs its own code): it shows no site. What the stand-ins measure
is what the harness, the call sites and the op cost on this machine at that moment (cold
caches, other load); ``net`` is the plugin's time less the stand-ins', medians over each kind
of step: what the plugin adds to an unsteered step, and to a steered step beyond the op alone.
``net-op`` is the same without the op's own time, which is the same call in both kinds of step:
its medians (``op us``, ``null op``) differ by a few µs from run to run, a noise that ``net``
carries and ``net-op`` does not (a plugin that made the op itself slower would show there, not
in ``net-op``). The goals are judged by ``net-op``, whose medians are of each step's sites less
that step's own op. The timer stamps each region's start and end into a log (exclusive times
are worked out after the step), and its own cost per region, measured, is taken out of both.
vLLM's step is the wall time of ``LLMEngine.step`` (scheduling, the forward on this CPU,
sampling, output processing), plugin included.

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
import contextlib
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
#: untimed decode steps of each kind before the timed ones: Python specialises the code a site
#: runs only after its first few calls (the plugin's and the stand-ins' alike)
WARM = 8
#: the batch: this many requests decode together; the first ``rows`` of them are steered
BATCH = 256


class Regions:
    """Exclusive timers: each region's time less the regions inside it.

    While a step runs, a region costs two clock reads and two list appends (its start and its
    end, stamped into one log); the exclusive times are worked out from the log afterwards
    (:meth:`take`), so that the harness adds as little as it can to what it measures."""

    def __init__(self):
        self.log: list = []

    def run(self, bucket: str, fn, *args, **kwargs):
        log, clock = self.log, time.perf_counter_ns
        log.append((bucket, clock()))
        try:
            return fn(*args, **kwargs)
        finally:
            log.append((None, clock()))

    def take(self) -> tuple[dict, dict]:
        """Seconds per bucket (exclusive) and regions per bucket since the last take."""
        log, self.log = self.log, []
        acc: dict[str, float] = {}
        count: dict[str, int] = {}
        stack: list[list] = []  # [bucket, start ns, children ns] per open region
        for bucket, t in log:
            if bucket is not None:
                stack.append([bucket, t, 0])
                continue
            b, t0, children = stack.pop()
            dt = t - t0
            acc[b] = acc.get(b, 0.0) + (dt - children) * 1e-9
            count[b] = count.get(b, 0) + 1
            if stack:
                stack[-1][2] += dt
        return acc, count


REG = Regions()
sys.modules.setdefault("bench_plugin_step", sys.modules[__name__])


#: ``MODE["null"]``: this step runs do-nothing stand-ins at every site the plugin hooks (the
#: same harness, the same call sites, none of the plugin's work)
MODE = {"null": False}
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


def _null_hook(orig, *args, **kwargs):
    return orig(*args, **kwargs)


def _null_after(orig, self, out):
    """The stand-in of a hook run after vLLM's method (``Hook.after``): the output as is."""
    return out


def _timed_hook(wrapper, after: bool = False):
    """A hook wrapper whose own time goes to "plugin:<name>" and its ``orig``'s to "vllm"; in
    a null step, a do-nothing hook in its place (``after``: one run after vLLM's method,
    ``wrapper(orig, self, out)``, which calls no ``orig``)."""
    from vllm_steer.integrations import hooks

    name = "plugin:" + getattr(wrapper, "__name__", "timed")
    resolve = getattr(wrapper, getattr(hooks, "RESOLVE_ATTR", "vllm_steer_resolve"), None)
    fn = []  # what the plugin's patched method calls: the imported function, once resolved

    def timed(orig, *args, **kwargs):
        if not fn:
            fn.append(resolve() if resolve is not None else wrapper)
        null = _null_after if after else _null_hook
        return REG.run(name, null if MODE["null"] else fn[0], _timed_orig(orig),
                       *args, **kwargs)

    timed.__name__ = getattr(wrapper, "__name__", "timed")
    return timed


def _time_method(cls, name: str, bucket: str, null=None) -> None:
    """Time ``cls.name`` as ``bucket``; in a null step, ``null`` runs in its place."""
    fn = cls.__dict__.get(name)
    if fn is None:
        return
    method = isinstance(fn, classmethod)
    fn = fn.__func__ if method else fn

    def timed(*args, **kwargs):
        return REG.run(bucket, null if MODE["null"] and null is not None else fn,
                       *args, **kwargs)

    setattr(cls, name, classmethod(timed) if method else timed)


@contextlib.contextmanager
def timed_methods(parts):
    """Time each ``(bucket, cls, name)`` of ``parts`` as :func:`_time_method` does while the
    block runs, then put the methods back; yields :data:`REG`, emptied first (its ``take()``:
    seconds per bucket, exclusive)."""
    saved = [(cls, name, cls.__dict__[name]) for _, cls, name in parts]
    REG.take()
    try:
        for bucket, cls, name in parts:
            _time_method(cls, name, bucket)
        yield REG
    finally:
        for cls, name, fn in reversed(saved):
            setattr(cls, name, fn)


def _instrument(processes: tuple[str, ...] = ("worker",)) -> None:
    """Time the plugin's hooks of ``processes`` (the worker's by default; an in-process engine
    may time the frontend's and the engine core's too), head, per-request state and op
    (before vLLM starts), each with its do-nothing stand-in for the null steps."""
    import dataclasses

    from vllm_steer import ops
    from vllm_steer.integrations import plugin

    plugin.HOOKS = tuple(
        dataclasses.replace(h, wrapper=_timed_hook(h.wrapper, h.after))
        if h.process in processes and h.wrapper is not None else h for h in plugin.HOOKS)
    from vllm.model_executor.layers.logits_processor import LogitsProcessor

    from vllm_steer.integrations.worker import head
    from vllm_steer.integrations.worker.planner import StepPlanner

    def plain_forward(self, lm_head, hidden_states, embedding_bias=None, skip_gather=False):
        """The head's stand-in: vLLM's plain logits layer, after the steer op alone on the
        same rows as the plugin's head launches it in the steps around (its last plan,
        through the same timed op), its result unused: so ``net`` compares the plugin's head
        with the op it launches, at the same site."""
        rt = self.steer_runtime
        planner = None if rt is None else rt.planner
        eager = None if planner is None else planner.eager_inputs()
        if eager is not None and rt.slots.num_active_slots \
                and eager[0].shape[0] == hidden_states.shape[0]:
            bank = rt.bank_state.bank
            coefs, plan = eager
            kw = {} if plan is None else {"prepared": plan}
            rt.bank_state.fn(hidden_states, bank.p1, bank.p2, bank.rank_offsets, coefs, **kw)
        return LogitsProcessor.forward(self, lm_head, hidden_states, embedding_bias, skip_gather)

    _time_method(head.SteeredLogitsProcessor, "forward", "plugin:head", null=plain_forward)
    _time_method(StepPlanner, "plan_step", "plugin:head (re-planned)")
    _time_method(LogitsProcessor, "forward", "vllm")
    for module in _state_modules():
        for cls_name in dir(module):
            cls = getattr(module, cls_name)
            if isinstance(cls, type) and cls.__module__ == module.__name__:
                for m, null in (("update_state", lambda self, *a: None),
                                ("add_request", lambda self, *a: False),
                                ("apply_staged_writes", lambda self: None),
                                ("validate_params", lambda cls, params: None)):
                    _time_method(cls, m, f"plugin:{cls_name}.{m}", null=null)
    backend_fn = ops.backend_fn

    def timed_backend_fn(name):
        fn = backend_fn(name)

        def op(*args, **kwargs):
            return REG.run("op", fn, *args, **kwargs)
        return op

    ops.backend_fn = timed_backend_fn


def _state_modules():
    """The modules of the per-request steer state (vLLM's custom logits processors)."""
    import importlib

    out = []
    for name in ("vllm_steer.integrations.request_state_v1",
                 "vllm_steer.integrations.request_state_v2"):
        try:
            out.append(importlib.import_module(name))
        except ImportError:
            continue
    return out


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
                  dtype="float32", max_num_seqs=batch, enforce_eager=True,
                  max_model_len=max(128, 2 * (WARM + steps) + 64),  # the prompt and every step
                  kv_cache_memory_bytes=1 << 28, seed=0, enable_prefix_caching=False,
                  max_num_batched_tokens=4096)
        engine = llm.llm_engine
        tok = llm.get_tokenizer()
        prompt = tok.encode("Hello there, my name is")
        for rows in rows_list:
            for i in range(batch):
                steer = {f"s{i % K}": 4} if i < rows else None
                # every timed step decodes the whole batch
                sp = SamplingParams(temperature=0, max_tokens=2 * (WARM + steps) + 8,
                                    ignore_eos=True,
                                    extra_args=None if steer is None else {"steer": steer})
                engine.add_request(f"r{rows}-{i}", {"prompt_token_ids": prompt}, sp)
            engine.step()  # the prefill, not timed
            samples = {False: [], True: []}  # plugin steps, null steps
            for i in range(-2 * WARM, 2 * steps):  # interleaved: the plugin's, then stand-ins
                MODE["null"] = null = bool(i % 2)
                assert engine.get_num_unfinished_requests() == batch
                t0 = time.perf_counter()
                engine.step()
                wall = time.perf_counter() - t0
                acc, count = REG.take()
                if i < 0:  # warming up: both kinds of step, not timed
                    continue
                plugin = sum(v for b, v in acc.items() if b.startswith("plugin:"))
                regions = sum(count.values())  # each region's cost lands in its parent
                samples[null].append((wall, plugin, acc.get("op", 0.0), regions, acc))
            MODE["null"] = False
            engine.abort_request([f"r{rows}-{i}" for i in range(batch)])
            while engine.has_unfinished_requests():
                engine.step()
            cost = out["region_cost_us"] * 1e-6
            med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
            real, null = samples[False], samples[True]

            def work(s, cost=cost):  # the sites' time with the op, less the harness's per region
                return max(0.0, s[1] + s[2] - s[3] * cost)

            def work_ex_op(s, cost=cost):  # the same without the op's own time
                return max(0.0, s[1] - s[3] * cost)

            out["rows"][rows] = {
                "step_us": med([s[0] for s in real]) * 1e6,
                "null_step_us": med([s[0] for s in null]) * 1e6,
                "plugin_us": med([work(s) for s in real]) * 1e6,
                "null_us": med([work(s) for s in null]) * 1e6,
                "plugin_ex_op_us": med([work_ex_op(s) for s in real]) * 1e6,
                "null_ex_op_us": med([work_ex_op(s) for s in null]) * 1e6,
                "op_us": med([s[2] for s in real]) * 1e6,
                "null_op_us": med([s[2] for s in null]) * 1e6,
                "detail_us": {b: med([s[4].get(b, 0.0) for s in real]) * 1e6
                              for b in sorted({b for s in real for b in s[4]})
                              if b.startswith("plugin:")},
                "null_detail_us": {b: med([s[4].get(b, 0.0) for s in null]) * 1e6
                                   for b in sorted({b for s in null for b in s[4]})
                                   if b.startswith("plugin:")},
            }
        del llm
    return out


def _v2_env(path: str) -> dict[str, str]:
    """The test shim's environment, ahead of ``path`` (the child's PYTHONPATH: this tree)."""
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
            env.update(_v2_env(env["PYTHONPATH"]))
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
    print(f"plugin host work per decode step, batch {args.batch}, {args.steps} + {args.steps} "
          f"interleaved steps (median); load average {load:.2f} on {os.cpu_count()} CPUs")
    print(f"{'runner':6} {'steered':>7} {'vLLM step us':>13} {'sites us':>9} {'op us':>8} "
          f"{'null us':>8} {'null op':>8} {'net us':>7} {'net-op':>7} {'net+op/step':>11}  goal")
    for res in results:
        for rows, r in res["rows"].items():
            # net: the plugin's own work: its sites' time less what the stand-ins measure at
            # the same sites in the interleaved null steps (the op alone included there)
            net = r["plugin_us"] - r["null_us"]
            # the same without the op's time: the same call in both kinds of step, whose
            # medians differ by a few µs from run to run (noise that net carries)
            net_ex_op = r["plugin_ex_op_us"] - r["null_ex_op_us"]
            # the goals, judged by net-op (each step's own op time taken out of it; with no
            # steered row there is no op, and net-op is net)
            goal = (f"<10 us: {'met' if net_ex_op < 10 else 'NOT met'}" if int(rows) == 0
                    else f"op+10 us: {'met' if net_ex_op < 10 else 'NOT met'}")
            print(f"{res['runner']:6} {rows:>7} {r['step_us']:13.0f} {r['plugin_us']:9.1f} "
                  f"{r['op_us']:8.1f} {r['null_us']:8.1f} {r['null_op_us']:8.1f} {net:7.1f} "
                  f"{net_ex_op:7.1f} "
                  f"{(net + r['op_us']) / r['step_us']:11.2%}  {goal}")
            if args.detail:
                for label, d in (("plugin", r["detail_us"]), ("null", r["null_detail_us"])):
                    print(f"        {label:6} " + ", ".join(f"{b[7:]} {v:.1f}"
                                                        for b, v in d.items() if v >= 0.05))
        print(f"{res['runner']:6} timer cost {res['region_cost_us']:.2f} us per region (taken out)")

if __name__ == "__main__":
    main()
