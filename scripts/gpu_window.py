"""The serving-readiness checks of the steer kernels on a GPU (run by scripts/gpu_window.sh).

Needs python3 with torch and triton only (no vLLM, no pytest); run from the repository root
with PYTHONPATH=$PWD. Each check prints its lines and one verdict line (PASS / FAIL / SKIP /
INFO); the exit status is 1 when any check fails.

- compiles: ``ops.warm_up`` for 256 rows, then calls for every row count 1..256 (planned from
  host coefficients, as the serving path does, and unplanned, which runs the segments kernel)
  add no entry to the kernels' Triton caches;
- invariance: with VLLM_BATCH_INVARIANT=1 the first rows of a batch are bit for bit the same
  at 1, 7, 64 and 256 rows (Triton, fp32 and bf16); without it, and the torch path, reported;
- capture: the steer op refuses to run inside ``torch.cuda.graph`` capture, with the error
  that names the vLLM options, and the GPU works normally after it;
- async: steered steps run one step ahead with the forward in a CUDA graph and the steer op
  after it, and a drafter's steer captured inside a CUDA graph replayed while requests and
  steers change, against the plain-torch formula (``scripts/gpu_async_steps.py``);
- auto: times the planned Triton and torch paths at a few shapes, back to back (launches and
  kernels) and on the device alone (the calls enqueued behind a sleeping kernel), and reports
  whether ``ops.AUTO_CUDA`` picks the faster one (reported, never a failure);
- replay: the LM head's steer op replayed from its row bucket's CUDA graph
  (``kernels/graphs.py``) against the eager launch of the planned op, per steered step: host
  microseconds (the goal: at most :data:`HOST_US_GOAL`, reported), microseconds per call back
  to back and on the device alone, and the replayed rows against the reference (a failure
  when they differ); beside it, the fused Triton op over the same bank recorded in a
  CUDA graph with its segments computed on the device (``kernels/triton/launch.py``,
  ``steer_triton_replayable``), timed the same way and checked against the reference: it reads
  only the steers in use, where the head's op multiplies every column of the copy;
- head: the worker's head on a steady steered step (``StepPlanner.steer_rows``, graphs
  captured at start-up as in an engine), host microseconds warm and with cold caches, by part
  (``graphs.run``, the op's timer, the row lookup); a failure when its rows differ from the
  reference or a step captured a graph.

``--dry-run`` (no CUDA): the invariance check on CPU under Triton's interpreter
(TRITON_INTERPRET=1), the async check on CPU (small, eager, no overlap) and the replay check
and the head check on CPU with a stand-in for the graph (the function run again at each
replay: the code path, not the figures), the others skipped with a line saying why.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "benchmarks"))
from bench_plugin_step import timed_methods  # noqa: E402  (the head check's timers by part)
from gpu_async_steps import EagerGraphs  # noqa: E402  (the dry run's graph backend)

RESULTS: list[str] = []


def say(line: str) -> None:
    print(line, flush=True)
    RESULTS.append(line)


def offsets(ranks):
    offs = [0]
    for r in ranks:
        offs.append(offs[-1] + r)
    return offs


def make_bank(d, ranks, dtype, dev, seed=0):
    offs = offsets(ranks)
    gen = torch.Generator().manual_seed(seed)
    p1 = (torch.randn(d, offs[-1], generator=gen) / d ** 0.5).to(dev, dtype)
    p2 = (torch.randn(d, offs[-1], generator=gen) / max(max(ranks), 1) ** 0.5).to(dev, dtype)
    return p1, p2, offs


def distinct_coefs(rows, ranks, seed=0, unsteered=True):
    """Row r on the r-th steer of non-zero rank (cyclically); every third row unsteered."""
    gen = torch.Generator().manual_seed(seed)
    used = [k for k, r in enumerate(ranks) if r] or [0]
    co = torch.zeros(rows, len(ranks))
    ks = torch.tensor([used[r % len(used)] for r in range(rows)])
    co[torch.arange(rows), ks] = 0.5 + torch.rand(rows, generator=gen)
    if unsteered:
        co[::3] = 0.0
    return co


def cache_entries(kernel) -> int:
    """Compiled binaries in a Triton kernel's in-memory cache (all devices)."""
    caches = getattr(kernel, "device_caches", None)
    if caches is not None:  # Triton 3.x: device -> (kernel_cache, ...)
        return sum(len(v[0]) for v in caches.values())
    return sum(len(v) for v in getattr(kernel, "cache", {}).values())  # older Triton


# ---------------------------------------------------------------------------------------------


# the H200 probe's shapes (7 and 13 mid-serving compiles before warm_up), and a slot bank of 8
# slots with 2 steers loaded (zero-width slots and domain columns: K = 16)
COMPILE_SHAPES = [("d576 r16", 576, [16]), ("d4096 r16/16/64", 4096, [16, 16, 64]),
                  ("d2048 slots", 2048, [64, 64] + [0] * 14)]


def check_compiles(dev, shapes=COMPILE_SHAPES, max_rows: int = 256) -> bool:
    from vllm_steer import ops
    from vllm_steer.kernels.triton import jit
    from vllm_steer.kernels.triton.launch import steer_triton
    from vllm_steer.kernels.triton.plan import prepare_triton

    kernels = {"segments": jit._steer_segments_kernel, "shrink": jit._steer_shrink_kernel,
               "expand": jit._steer_expand_kernel}

    def entries():
        return sum(cache_entries(k) for k in kernels.values())

    ok = True
    for name, d, ranks in shapes:
        p1, p2, offs = make_bank(d, ranks, torch.bfloat16, dev)
        before = entries()
        t0 = time.perf_counter()
        n = ops.warm_up("triton", p1, p2, offs, max_rows, torch.bfloat16)
        torch.cuda.synchronize()
        warm_s = time.perf_counter() - t0
        after_warm = entries()
        worst = (0.0, 0)
        for rows in range(1, max_rows + 1):
            co = distinct_coefs(rows, ranks, seed=rows)
            hidden = torch.randn(rows, d, device=dev, dtype=torch.bfloat16)
            coefs = co.to(dev)
            t = time.perf_counter()
            plan = prepare_triton(p1, p2, offs, coefs, host=co.numpy())  # the serving path
            steer_triton(hidden, p1, p2, offs, coefs, prepared=plan)
            steer_triton(hidden, p1, p2, offs, coefs)  # unplanned: the segments kernel too
            torch.cuda.synchronize()
            worst = max(worst, (time.perf_counter() - t, rows))
        new = entries() - after_warm
        good = new == 0 and after_warm - before <= n
        ok &= good
        say(f"compiles {name}: warm_up {n} specialisations in {warm_s:.1f} s "
            f"({after_warm - before} new cache entries); rows 1..{max_rows} afterwards: {new} new "
            f"entries, slowest first call {worst[0] * 1e3:.1f} ms at {worst[1]} rows: "
            f"{'PASS' if good else 'FAIL'}")
    return ok


def _first_rows_equal(outs: dict) -> tuple[bool, float]:
    same, worst = True, 0.0
    for small, big in [(1, 7), (7, 64), (64, 256)]:
        a, b = outs[small], outs[big][:small]
        same &= torch.equal(a, b)
        worst = max(worst, (a.float() - b.float()).abs().max().item())
    return same, worst


def check_invariance(dev, shapes) -> bool:
    from vllm_steer.kernels.torch_steer import steer_torch
    from vllm_steer.kernels.triton.launch import steer_triton

    ok = True
    for d, rank in shapes:
        for dtype in (torch.float32, torch.bfloat16):
            gen = torch.Generator().manual_seed(d + rank)
            p1 = (torch.randn(d, rank, generator=gen) / d ** 0.5).to(dev, dtype)
            p2 = (torch.randn(d, rank, generator=gen) / rank ** 0.5).to(dev, dtype)
            hidden = torch.randn(256, d, generator=gen).to(dev, dtype)
            coefs = torch.randn(256, 1, generator=gen).to(dev)
            line = []
            for mode in ("1", "0"):
                os.environ["VLLM_BATCH_INVARIANT"] = mode
                outs = {n: steer_triton(hidden[:n], p1, p2, [0, rank], coefs[:n].contiguous())
                        for n in (1, 7, 64, 256)}
                same, diff = _first_rows_equal(outs)
                line.append(f"triton mode {mode}: "
                            f"{'identical' if same else f'max diff {diff:.3g}'}")
                if mode == "1":
                    ok &= same
                    verdict = "PASS" if same else "FAIL"
            os.environ.pop("VLLM_BATCH_INVARIANT", None)
            outs = {n: steer_torch(hidden[:n], p1, p2, [0, rank], coefs[:n].contiguous())
                    for n in (1, 7, 64, 256)}
            same, diff = _first_rows_equal(outs)
            line.append(f"torch: {'identical' if same else f'max diff {diff:.3g}'}")
            say(f"invariance d{d} r{rank} {str(dtype)[6:]} rows 1/7/64/256: "
                f"{'; '.join(line)}: {verdict}")
    return ok


def check_capture(dev) -> bool:
    from vllm_steer import ops
    from vllm_steer.kernels.torch_steer import prepare_torch, steer_torch
    from vllm_steer.kernels.triton.launch import steer_triton
    from vllm_steer.kernels.triton.plan import prepare_triton

    p1, p2, offs = make_bank(576, [16, 64], torch.bfloat16, dev)
    co = distinct_coefs(8, [16, 64])
    coefs, hidden = co.to(dev), torch.randn(8, 576, device=dev, dtype=torch.bfloat16)
    tplan = prepare_triton(p1, p2, offs, coefs, host=co.numpy())
    pplan = prepare_torch(p1, p2, offs, coefs, host=co.numpy())
    steer_triton(hidden, p1, p2, offs, coefs, prepared=tplan)  # compiled, tables cached
    torch.cuda.synchronize()
    calls = {
        "steer_triton (planned)": lambda: steer_triton(hidden, p1, p2, offs, coefs,
                                                       prepared=tplan),
        "steer_torch (planned)": lambda: steer_torch(hidden, p1, p2, offs, coefs,
                                                     prepared=pplan),
        "apply_steers (auto)": lambda: ops.apply_steers(hidden, p1, p2, offs, coefs),
    }
    ok = True
    for name, call in calls.items():
        graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
        err = None
        try:
            with torch.cuda.graph(graph, stream=stream):
                call()
        except Exception as e:  # noqa: BLE001 - the verdict reports what came out
            err = e
        chain = []  # ending an (empty) capture may raise too: look for the guard's error
        while err is not None and len(chain) < 5:
            chain.append(err)
            err = err.__context__
        refused = any(isinstance(e, RuntimeError) and "outside CUDA graphs" in str(e)
                      and "PIECEWISE" in str(e) and "--enforce-eager" in str(e) for e in chain)
        err = chain[0] if chain else None
        ok &= refused
        say(f"capture {name}: {'refused with the guard error' if refused else repr(err)}: "
            f"{'PASS' if refused else 'FAIL'}")
    out = steer_triton(hidden, p1, p2, offs, coefs, prepared=tplan)  # the GPU still works
    torch.cuda.synchronize()
    from vllm_steer.reference import steer_reference

    ref = steer_reference(hidden, p1, p2, offs, coefs)
    fine = torch.allclose(out.float(), ref.float(), rtol=2 ** -7, atol=2 ** -7)
    ok &= fine
    say(f"capture afterwards: a normal call {'matches' if fine else 'DOES NOT match'} the "
        f"reference: {'PASS' if fine else 'FAIL'}")
    return ok


#: GPU clock cycles of the kernel that holds the stream while a device-only timing enqueues
#: its calls (about 10 ms at 2 GHz: 20 calls of at most a few hundred us of host time each)
HOLD_CYCLES = 20_000_000


def _time_us(fn, reps: int = 20, device_only: bool = False) -> float:
    """Microseconds per call of ``fn`` on the current stream, the median of 5 batches of
    ``reps`` calls back to back: launches and kernels together, the larger of the two per call
    (a launch-bound op measures its host time). ``device_only``: the stream is held by a
    sleeping kernel while the calls are enqueued, so the kernels then run without a gap: the
    device's time alone."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if device_only:
            torch.cuda._sleep(HOLD_CYCLES)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / reps)
    return float(np.median(times))


def check_auto(dev) -> bool:
    from vllm_steer import ops
    from vllm_steer.kernels.torch_steer import prepare_torch, steer_torch
    from vllm_steer.kernels.triton.launch import steer_triton
    from vllm_steer.kernels.triton.plan import prepare_triton

    # (d, rank, K, rows): both sides of the AUTO_CUDA rule, and d 8192 where it is extrapolated
    shapes = [(576, 576, 1, 256), (2048, 64, 8, 256), (2048, 1024, 1, 64), (4096, 64, 8, 256),
              (4096, 4096, 8, 256), (8192, 1024, 1, 256), (8192, 8192, 1, 64)]
    agree = agree_gpu = 0
    for d, rank, K, rows in shapes:
        p1, p2, offs = make_bank(d, [rank] * K, torch.bfloat16, dev)
        co = distinct_coefs(rows, [rank] * K, unsteered=False)
        coefs, hidden = co.to(dev), torch.randn(rows, d, device=dev, dtype=torch.bfloat16)
        tplan = prepare_triton(p1, p2, offs, coefs, host=co.numpy())
        pplan = prepare_torch(p1, p2, offs, coefs, host=co.numpy())
        tri = lambda p1=p1, p2=p2, plan=tplan, h=hidden, o=offs, c=coefs: steer_triton(  # noqa: E731
            h, p1, p2, o, c, prepared=plan)
        tor = lambda p1=p1, p2=p2, plan=pplan, h=hidden, o=offs, c=coefs: steer_torch(  # noqa: E731
            h, p1, p2, o, c, prepared=plan)
        t_tri, t_tor = _time_us(tri), _time_us(tor)
        g_tri, g_tor = _time_us(tri, device_only=True), _time_us(tor, device_only=True)
        pick = ops.resolve_backend("auto", dev, hidden=d, max_rank=rank)
        faster = "triton" if t_tri <= t_tor else "torch"
        faster_gpu = "triton" if g_tri <= g_tor else "torch"
        agree += pick == faster
        agree_gpu += pick == faster_gpu
        say(f"auto d{d} rank {rank} K {K} rows {rows}: triton {t_tri:.1f} us, torch {t_tor:.1f} "
            f"us (planned, per call back to back); device alone triton {g_tri:.1f} us, torch "
            f"{g_tor:.1f} us: auto picks {pick}, faster is {faster} ({faster_gpu} on the "
            f"device alone): INFO")
        p1 = p2 = tplan = pplan = None  # released (the closures above hold them)
        torch.cuda.empty_cache()
    say(f"auto: the rule picked the faster path at {agree} of {len(shapes)} shapes back to "
        f"back, at {agree_gpu} on the device alone: INFO")
    return True


#: The most host time one steered step may spend in the steer op on a GPU (microseconds).
HOST_US_GOAL = 20.0
# (label, hidden, steer slots, rank per slot): the embedded model's shape, an 8B-like one, and
# the bank of the throughput call (scripts/gpu_throughput.py: 64 steers of rank 64), whose
# every column the replayed op multiplies
REPLAY_SHAPES = [("d576 8 slots r16", 576, 8, 16), ("d4096 8 slots r64", 4096, 8, 64),
                 ("d4096 64 slots r64", 4096, 64, 64)]


def _host_us(fn, sync, calls: int = 200, burst: int = 20) -> float:
    """Median host time of one call (microseconds), in bursts that never fill the launch
    queue (a wait for the device between bursts, outside the timing)."""
    for _ in range(5):
        fn()
    sync()
    per = []
    for _ in range(calls // burst):
        t0 = time.perf_counter()
        for _ in range(burst):
            fn()
        per.append((time.perf_counter() - t0) / burst * 1e6)
        sync()
    return float(np.median(per))


def _triton_replay(bank, hidden: torch.Tensor, table: torch.Tensor, cuda: bool):
    """The fused Triton op over the bank in place (the head graphs' factors), recorded in a
    CUDA graph as :func:`~vllm_steer.kernels.triton.launch.steer_triton_replayable` allows: a
    function that copies ``hidden`` in, replays, and returns the static output. It reads only
    the steers the rows use, as the head graphs' grouped op does from a table and an index. On
    the CPU (a dry run) the same calls run eagerly under Triton's interpreter."""
    from vllm_steer.kernels.triton.launch import steer_triton_replayable
    from vllm_steer.kernels.triton.plan import prepare_triton

    p1, p2, rank = bank.p1, bank.p2, bank.rank
    offs = [k * rank for k in range(table.shape[1] + 1)]
    h_in, out = hidden.clone(), torch.empty_like(hidden)
    plan = prepare_triton(p1, p2, offs, table)
    call = lambda: steer_triton_replayable(h_in, p1, p2, offs, table, out, plan)  # noqa: E731
    call()  # compiles, outside the capture
    if cuda:
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            call()
        call = graph.replay

    def replay() -> torch.Tensor:
        h_in.copy_(hidden)
        call()
        return out

    return replay


def check_replay(dev, shapes=REPLAY_SHAPES, rows_list=(1, 64), dtype=torch.bfloat16,
                 dry: bool = False) -> bool:
    from vllm_steer import ops
    from vllm_steer.bank import SlotBank
    from vllm_steer.format import make_steer
    from vllm_steer.kernels import graphs as G
    from vllm_steer.kernels.layout import row_bucket
    from vllm_steer.reference import steer_reference

    cuda = dev.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    ok = True
    for label, d, slots, rank in shapes:
        bank = SlotBank(slots, d, device=dev, dtype=dtype, reserve_rank=rank)
        gen = torch.Generator().manual_seed(d)
        for k in range(slots):
            bank.put(k, k + 1, f"s{k}",
                     make_steer(torch.randn(d, rank, generator=gen) / d ** 0.5,
                                torch.randn(d, rank, generator=gen) / rank ** 0.5,
                                f"s{k}"))
        graphs = G.head_graphs(bank, graph_backend=None if cuda else EagerGraphs())
        for rows in rows_list:
            co = torch.zeros(rows, bank.num_columns)
            co[torch.arange(rows), torch.arange(rows) % slots] = (
                0.5 + torch.rand(rows, generator=gen))
            table = co.to(dev)  # the head's persistent coefficient buffer
            hidden = torch.randn(rows, d, generator=gen).to(dev, dtype)
            p1, p2, offs = bank.p1, bank.p2, bank.rank_offsets
            prepared = ops.prepare_steers(p1, p2, offs, table, host=co.numpy())
            fn = ops.backend_fn(prepared.backend)
            if prepared.plan is None:
                launch = lambda: fn(hidden, p1, p2, offs, table)  # noqa: E731, B023 (timed here)
            else:
                launch = lambda: fn(  # noqa: E731, B023 (timed here)
                    hidden, p1, p2, offs, table, prepared=prepared.plan)  # noqa: B023 (timed here)
            # as the head replays them: the table read through a persistent row index
            index = torch.full((row_bucket(rows),), -1, dtype=torch.int64, device=dev)
            index[:rows] = torch.arange(rows, device=dev)
            replay = lambda: graphs.run(hidden, table, index)  # noqa: E731, B023 (timed here)
            t0 = time.perf_counter()
            out = replay().clone()  # the bucket's first step: its capture
            sync()
            first_ms = (time.perf_counter() - t0) * 1e3
            ref = steer_reference(hidden, p1, p2, offs, table)
            scale = (ref.float() - hidden.float()).abs().max().item()
            tol = 2 ** -6 if dtype != torch.float32 else 1e-5
            good = torch.allclose(out.float(), ref.float(), rtol=tol, atol=tol * scale)
            ok &= good
            h_launch, h_replay = _host_us(launch, sync), _host_us(replay, sync)
            gpu = ""
            if cuda:
                gpu = (f"; back to back {_time_us(launch):.1f} us launched, "
                       f"{_time_us(replay):.1f} us replayed; the device alone "
                       f"{_time_us(launch, device_only=True):.1f} us launched, "
                       f"{_time_us(replay, device_only=True):.1f} us replayed")
            goal = ("not the goal's figure (no graphs on CPU)" if dry else
                    f"goal <= {HOST_US_GOAL:g} us "
                    f"{'met' if h_replay <= HOST_US_GOAL else 'NOT met'}")
            say(f"replay {label} {str(dtype)[6:]} rows {rows}: host {h_launch:.1f} us launched "
                f"({prepared.backend}), {h_replay:.1f} us replayed ({h_launch / h_replay:.1f}x; "
                f"{goal}){gpu}; first step (the capture) {first_ms:.1f} ms, "
                f"{graphs.captures} graph(s) captured: INFO")
            say(f"replay {label} rows {rows}: replayed rows "
                f"{'match' if good else 'DO NOT match'} the reference: "
                f"{'PASS' if good else 'FAIL'}")
            what = f"replay {label} rows {rows}: the Triton op over the same copy, its segments"
            try:
                tri = _triton_replay(bank, hidden, table, cuda)
                t_out = tri().clone()
                sync()
                t_good = torch.allclose(t_out.float(), ref.float(), rtol=tol, atol=tol * scale)
                timed = ("run eagerly (no graphs on CPU)" if not cuda else
                         f"replayed from a CUDA graph: host {_host_us(tri, sync):.1f} us, back "
                         f"to back {_time_us(tri):.1f} us, the device alone "
                         f"{_time_us(tri, device_only=True):.1f} us")
                say(f"{what} on the device, {timed}; its rows "
                    f"{'match' if t_good else 'DO NOT match'} the reference: "
                    f"{'PASS' if t_good else 'FAIL'}")
            except Exception as e:  # noqa: BLE001 (report it; the other checks still run)
                t_good = False
                first = (str(e).strip().splitlines() or [""])[0][:300]
                say(f"{what} on the device: {type(e).__name__}: {first}: FAIL")
            ok &= t_good
        bank = graphs = None  # released (the closures above hold them)
        if cuda:
            torch.cuda.empty_cache()
    return ok


#: (label, hidden, rank) of the head check: the embedded model's shape and an 8B-like one
HEAD_SHAPES = [("d576 r16", 576, 16), ("d4096 r64", 4096, 64)]


def check_head(dev, shapes=HEAD_SHAPES, rows_list=(1, 64), dtype=torch.bfloat16,
               steps: int = 100, dry: bool = False) -> bool:
    """The worker's head on a steady steered step, as Model Runner V2 calls it (its rows mapped
    on the host, the step unchanged since the last): ``StepPlanner.steer_rows`` through a
    runtime whose graphs were captured at start-up. Host microseconds per step, back to back
    (warm) and each after a pass over 64 MiB of host memory (caches cold, as after vLLM's own
    step in an engine), with the parts: ``graphs.run`` (one copy and one replay), the op's
    timer (two CUDA event records on one op in 64), the row lookup (which a steady step skips);
    the rest is the head's own code. The rows are checked against the reference (a failure
    when they differ)."""
    import tempfile

    from vllm_steer.config import SteerServerConfig
    from vllm_steer.format import make_steer, save_steer
    from vllm_steer.integrations.worker.planner import StepPlanner
    from vllm_steer.integrations.worker.rows import MappedRows
    from vllm_steer.integrations.worker.runtime import SteerRuntime
    from vllm_steer.kernels.graphs import SteerGraphs
    from vllm_steer.metrics import OpTimer
    from vllm_steer.reference import steer_reference

    cuda = dev.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    flush = np.ones(64 << 17, dtype=np.float64)  # 64 MiB
    ok = True
    for label, d, rank in shapes:
        gen = torch.Generator().manual_seed(d)
        folder = tempfile.mkdtemp(prefix="gpu_window-head-")
        path = os.path.join(folder, "a.safetensors")
        save_steer(path, make_steer(torch.randn(d, rank, generator=gen) / d ** 0.5,
                                    torch.randn(d, rank, generator=gen) / rank ** 0.5, "a"))
        rt = SteerRuntime(SteerServerConfig.from_additional_config(
            {"vllm_steer": {"steers": {"a": path}, "max_steers": 8, "max_steer_rank": rank}}))
        if not cuda:
            rt.bank_state.graph_backend = EagerGraphs()
        rt.ensure_slots(max(rows_list), dev)
        rt.bank_state.load(d, dev, dtype)
        rt.model_loaded(dtype)
        eps = rt.bank_state.bank.steers[0].metadata.epsilon
        row = np.zeros(rt.slots.num_columns, np.float32)
        row[0] = 5 * eps
        for slot in range(max(rows_list)):
            rt.set_slot(slot, row)
        rt.slots.flush()
        captures = (rt.bank_state.bank.graphs.captures if rt.bank_state.bank.graphs is not None
                    else 0)
        for rows in rows_list:
            idx = np.arange(rows, dtype=np.int32)
            src = MappedRows(torch.arange(rows, dtype=torch.int32, device=dev), idx, None,
                             idx.tobytes())
            hidden = torch.randn(rows, d, generator=gen).to(dev, dtype)
            rt.step.sampled = src  # as V2's sample() adapter writes it
            out = rt.planner.steer_rows(hidden).clone()
            ref = steer_reference(hidden, *rt.bank_state.bank.factors,
                                  torch.from_numpy(np.tile(row, (rows, 1))).to(dev))
            scale = (ref.float() - hidden.float()).abs().max().item()
            tol = 2 ** -6 if dtype != torch.float32 else 1e-5
            good = torch.allclose(out.float(), ref.float(), rtol=tol, atol=tol * scale)
            ok &= good
            step = lambda: rt.planner.steer_rows(hidden)  # noqa: E731, B023 (timed here)
            warm = _host_us(step, sync)

            def cold_us(fn, n=steps):
                per = []
                for i in range(n):
                    flush.sum()  # outside the timing: the caches hold vLLM's step's data
                    t0 = time.perf_counter()
                    fn()
                    per.append((time.perf_counter() - t0) * 1e6)
                    if i % 20 == 19:
                        sync()
                sync()
                return float(np.median(per)), per

            cold, _ = cold_us(step)
            parts = [("graphs.run", SteerGraphs, "run"), ("timer", OpTimer, "start"),
                     ("timer", OpTimer, "stop"), ("rows", StepPlanner, "_step_rows")]
            with timed_methods(parts) as regions:
                _, per = cold_us(step)
                seconds, _ = regions.take()
            means = {k: v / steps * 1e6 for k, v in seconds.items()}
            means["the rest"] = float(np.mean(per)) - sum(means.values())
            split = ", ".join(f"{k} {v:.1f}" for k, v in means.items())
            replayed = (rt.bank_state.bank.graphs is not None
                        and rt.bank_state.bank.graphs.replays > 0)
            how = ("replayed from a stand-in graph on the CPU: not a GPU's figures" if dry else
                   "replayed from CUDA graphs" if replayed else "launched eagerly")
            say(f"head {label} {str(dtype)[6:]} rows {rows}: host {warm:.1f} us per steered step "
                f"warm, {cold:.1f} us with cold caches (medians; by part with cold caches, means "
                f"in us: {split}); {how}: INFO")
            say(f"head {label} rows {rows}: steered rows "
                f"{'match' if good else 'DO NOT match'} the reference: "
                f"{'PASS' if good else 'FAIL'}")
        graphs_now = rt.bank_state.bank.graphs
        new = (graphs_now.captures if graphs_now is not None else 0) - captures
        say(f"head {label}: {new} graph(s) captured by the steps (captured at start-up: "
            f"{captures}): {'PASS' if new == 0 else 'FAIL'}")
        ok &= new == 0
        rt = None  # released (the closures above hold them)
        if cuda:
            torch.cuda.empty_cache()
    return ok


def check_async(dev, **sizes) -> bool:
    import gpu_async_steps

    ok = True
    for dtype in (torch.float32, torch.bfloat16):
        for r in (gpu_async_steps.run(dev, dtype, **sizes),
                  gpu_async_steps.run_drafter(dev, dtype, steps=sizes.get("steps", 16),
                                              batch=sizes.get("batch", 64),
                                              hidden=sizes.get("hidden", 1024))):
            for line in r["lines"]:
                say(line)
            ok &= r["ok"]
    return ok


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dry-run", action="store_true",
                    help="no CUDA: the invariance check under Triton's interpreter only")
    ap.add_argument("--out", default=os.environ.get("OUT"),
                    help="folder for gpu_window_results.txt (default: $OUT, if set)")
    ap.add_argument("--skip", nargs="*", default=[], choices=["compiles", "invariance",
                                                               "capture", "async", "auto",
                                                               "replay", "head"])
    args = ap.parse_args(argv)
    os.environ.pop("VLLM_BATCH_INVARIANT", None)
    os.environ.pop("VLLM_STEER_BACKEND", None)
    import triton

    where = ("dry run on CPU" if args.dry_run else torch.cuda.get_device_name(0)
             if torch.cuda.is_available() else "no CUDA")
    say(f"gpu_window: torch {torch.__version__}, triton {triton.__version__}, {where}")
    ok = True
    if args.dry_run:
        from vllm_steer.kernels.triton.launch import _interpreting

        if not _interpreting():
            say("invariance: FAIL: a dry run needs TRITON_INTERPRET=1 (set before Python starts)")
            return 1
        for name in ("compiles", "capture", "auto"):
            say(f"{name}: SKIP: needs CUDA (the interpreter compiles nothing and has no graphs)")
        if "invariance" not in args.skip:
            ok &= check_invariance(torch.device("cpu"), [(256, 16)])
        if "async" not in args.skip:
            ok &= check_async(torch.device("cpu"), steps=8, batch=16, hidden=128, layers=2)
        if "replay" not in args.skip:
            ok &= check_replay(torch.device("cpu"), [("d64 4 slots r8", 64, 4, 8)], (1, 5),
                               dtype=torch.float32, dry=True)
        if "head" not in args.skip:
            ok &= check_head(torch.device("cpu"), [("d64 r8", 64, 8)], (1, 5),
                             dtype=torch.float32, steps=20, dry=True)
    else:
        if not torch.cuda.is_available():
            say("gpu_window: FAIL: CUDA is not available to torch (use --dry-run on CPU)")
            return 1
        dev = torch.device("cuda", 0)
        checks = {"compiles": lambda: check_compiles(dev),
                  "invariance": lambda: check_invariance(dev, [(576, 16), (4096, 64)]),
                  "capture": lambda: check_capture(dev),
                  "async": lambda: check_async(dev, steps=48, batch=256, hidden=4096),
                  "auto": lambda: check_auto(dev),
                  "replay": lambda: check_replay(dev),
                  "head": lambda: check_head(dev)}
        for name, check in checks.items():
            if name in args.skip:
                say(f"{name}: SKIP: --skip")
                continue
            t0 = time.perf_counter()
            try:
                good = check()
            except Exception as e:  # noqa: BLE001 - one broken check must not hide the others
                import traceback

                traceback.print_exc()
                say(f"{name}: FAIL: {type(e).__name__}: {e}")
                good = False
            ok &= good
            print(f"   ({name}: {time.perf_counter() - t0:.1f} s)", flush=True)
    say(f"gpu_window checks: {'PASS' if ok else 'FAIL'}")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "gpu_window_results.txt"), "a") as f:
            f.write("\n".join(RESULTS) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
