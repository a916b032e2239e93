"""The OpenAI server under concurrent load: unsteered vs. mixed steered traffic, side by side.

Starts two servers on loopback, plain `vllm serve MODEL` (``VLLM_PLUGINS=none``) and
`vllm serve MODEL --steer ...` (K random steers), then sends the same bounded workload (N
streaming completions, at most C in flight, fixed output length with EOS ignored) in passes
that alternate, round-robin per repeat:

  plain vLLM (no plugin)   the reference
  plugin, unsteered        no request steered
  plugin, one steer        every request steered with one steer ({"steer": {"s0": 5}})
  plugin, mixed            requests spread over K steers and strengths, some unsteered,
                           some composed

and reports throughput (output tokens/s), time to first token and time per output token
(p50/p90/p99) for each, with ratios to plain vLLM. Strengths are sent through
`extra_body` as a user would. `vllm bench serve --extra-body '{"steer": {"s0": 5}}'` carries
one steer for every request too; this script exists for the mixed pass, where each request
has its own.

    python benchmarks/bench_serve.py --requests 64 --concurrency 32

``--churn``: one server with ``--enable-steer-updates --steer-dir``; the same mixed traffic
runs in passes that alternate between *steady* (no steer changes) and *churn* (a task loads
and unloads extra rank-``--rank`` steers over HTTP all through the pass, one op every
``--churn-interval`` seconds). Reports load and unload latency (p50/p99, as the client sees
them), request latency / TTFT / TPOT p50/p99 of both kinds of pass, and failed requests.

    python benchmarks/bench_serve.py --churn --requests 64 --concurrency 16
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def pct(values, q):
    values = sorted(values)
    if not values:
        return float("nan")
    i = min(len(values) - 1, max(0, round(q / 100 * (len(values) - 1))))
    return values[i]


async def one_request(session, url, prompt, steer, output_len):
    body = {"model": "m", "prompt": prompt, "max_tokens": output_len, "temperature": 0,
            "ignore_eos": True, "stream": True}
    if steer:
        body["steer"] = steer
    t0 = time.perf_counter()
    ttft, n = None, 0
    async with session.post(url, json=body) as r:
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {await r.text()}")
        async for raw in r.content:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            if chunk["choices"] and chunk["choices"][0].get("text"):
                n += 1
                if ttft is None:
                    ttft = time.perf_counter() - t0
    total = time.perf_counter() - t0
    return {"ttft": ttft or total, "latency": total, "chunks": n,
            "tpot": (total - (ttft or total)) / max(1, output_len - 1)}


async def run_pass(base, prompts, steers, output_len, concurrency):
    import aiohttp

    sem = asyncio.Semaphore(concurrency)
    url = base + "/v1/completions"
    timeout = aiohttp.ClientTimeout(total=3600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        async def guarded(p, s):
            async with sem:
                return await one_request(session, url, p, s, output_len)

        t0 = time.perf_counter()
        res = await asyncio.gather(*(guarded(p, s) for p, s in zip(prompts, steers, strict=False)))
        wall = time.perf_counter() - t0
    return {"wall": wall, "tok_s": len(prompts) * output_len / wall,
            "ttft": [r["ttft"] for r in res], "tpot": [r["tpot"] for r in res],
            "latency": [r["latency"] for r in res]}


async def churn(base, paths, interval, stop, ops):
    """Load and unload the steers ``paths`` (name -> file) in turn until ``stop`` is set."""
    import aiohttp

    async with aiohttp.ClientSession() as session:
        i = 0
        names = list(paths)
        while not stop.is_set():
            name = names[i % len(names)]
            t0 = time.perf_counter()
            async with session.post(base + "/v1/steers",
                                    json={"name": name, "path": paths[name]}) as r:
                ok = r.status == 200
                await r.read()
            ops["load"].append((time.perf_counter() - t0, ok))
            await asyncio.sleep(interval)
            t0 = time.perf_counter()
            async with session.delete(base + f"/v1/steers/{name}") as r:
                ok = r.status == 200
                await r.read()
            ops["unload"].append((time.perf_counter() - t0, ok))
            await asyncio.sleep(interval)
            i += 1


async def run_churn_pass(base, prompts, steers, output_len, concurrency, paths, interval):
    stop, ops = asyncio.Event(), {"load": [], "unload": []}
    task = asyncio.create_task(churn(base, paths, interval, stop, ops))
    try:
        res = await run_pass(base, prompts, steers, output_len, concurrency)
    finally:
        stop.set()
        await task
    res["ops"] = ops
    return res


def churn_main(args, model, hidden, common, tmp) -> int:
    from bench_throughput import random_steer_files
    from vllm_steer.server.launch import serve

    steers = random_steer_files(hidden, args.rank, args.steers, "bench-serve-steers-")
    extra = random_steer_files(hidden, args.rank, 4, "bench-serve-churn-")
    extra = {f"churn{i}": p for i, p in enumerate(extra.values())}
    names = list(steers)
    steer_dir = Path(next(iter(steers.values()))).parent
    cmd = common + [a for n, p in steers.items() for a in ("--steer", f"{n}={p}")] + [
        "--steer-dir", str(steer_dir), "--enable-steer-updates", "--steer-updates-any-path",
        "--max-steers", str(args.steers + len(extra))]
    n = args.requests
    prompts = [f"Request {i}: write a short story about the number {i} and" for i in range(n)]
    mixed = [None if i % 4 == 0 else {names[i % len(names)]: float(i % 9 - 4) or 1.0}
             for i in range(n)]
    results = {"steady": [], "churn": []}
    with serve(cmd, tmp / "churn.log") as url:
        asyncio.run(run_pass(url, prompts[:4], [None] * 4, 8, 4))  # warm-up
        for r in range(args.repeats):
            for kind in (("steady", "churn") if r % 2 == 0 else ("churn", "steady")):
                if kind == "steady":
                    res = asyncio.run(run_pass(url, prompts, mixed, args.output_len,
                                               args.concurrency))
                else:
                    res = asyncio.run(run_churn_pass(url, prompts, mixed, args.output_len,
                                                     args.concurrency, extra,
                                                     args.churn_interval))
                results[kind].append(res)
                print(f"  repeat {r + 1} {kind}: {res['tok_s']:.1f} tok/s", flush=True)
    rows = []
    for kind, runs in results.items():
        lat = [t for x in runs for t in x["latency"]]
        ttft = [t for x in runs for t in x["ttft"]]
        tpot = [t for x in runs for t in x["tpot"]]
        row = {"pass": kind, "requests": len(lat),
               "tok_s": statistics.median(x["tok_s"] for x in runs),
               "latency_ms": {q: 1000 * pct(lat, q) for q in (50, 99)},
               "ttft_ms": {q: 1000 * pct(ttft, q) for q in (50, 99)},
               "tpot_ms": {q: 1000 * pct(tpot, q) for q in (50, 99)}}
        if kind == "churn":
            for op in ("load", "unload"):
                times = [t for x in runs for t, ok in x["ops"][op]]
                row[f"{op}_ms"] = {q: 1000 * pct(times, q) for q in (50, 99)}
                row[f"{op}_count"] = len(times)
                row[f"{op}_failed"] = sum(not ok for x in runs for _, ok in x["ops"][op])
        rows.append(row)
    print("\n| pass | requests | tok/s | latency p50/p99 ms | TTFT p50/p99 ms | "
          "TPOT p50/p99 ms |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        lat, t, p = row["latency_ms"], row["ttft_ms"], row["tpot_ms"]
        print(f"| {row['pass']} | {row['requests']} | {row['tok_s']:.1f} | "
              f"{lat[50]:.0f}/{lat[99]:.0f}"
              f" | {t[50]:.0f}/{t[99]:.0f} | {p[50]:.1f}/{p[99]:.1f} |")
    ch = rows[1]
    print(f"\nload over HTTP: {ch['load_count']} ops, p50 {ch['load_ms'][50]:.1f} ms, p99 "
          f"{ch['load_ms'][99]:.1f} ms, {ch['load_failed']} failed; unload: p50 "
          f"{ch['unload_ms'][50]:.1f} ms, p99 {ch['unload_ms'][99]:.1f} ms, "
          f"{ch['unload_failed']} failed")
    print(f"churn / steady latency p99: {ch['latency_ms'][99] / rows[0]['latency_ms'][99]:.3f}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"model": args.model, "requests": args.requests, "concurrency": args.concurrency,
            "output_len": args.output_len, "steers": args.steers, "rank": args.rank,
            "repeats": args.repeats, "churn_interval_s": args.churn_interval,
            "cpus": os.cpu_count(),
            "command": "python benchmarks/bench_serve.py " + " ".join(sys.argv[1:])}
    (out / "serve_churn.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--load-format", default=None)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--steers", type=int, default=8, help="K steers loaded for the mixed pass")
    ap.add_argument("--rank", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--churn", action="store_true",
                    help="load/unload steers over HTTP during the traffic (see above)")
    ap.add_argument("--churn-interval", type=float, default=0.2,
                    help="seconds between two load/unload ops (--churn)")
    args = ap.parse_args(argv)

    import torch
    from transformers import AutoConfig

    from bench_throughput import random_steer_files
    from vllm_steer.models import resolve_model
    from vllm_steer.server.launch import serve

    model = resolve_model(args.model)
    hidden = AutoConfig.from_pretrained(model).hidden_size
    tmp = Path(tempfile.mkdtemp(prefix="bench-serve-"))
    common = [model, "--served-model-name", "m", "--max-num-seqs", str(args.concurrency),
              "--max-model-len", "1024"]
    if args.load_format:
        common += ["--load-format", args.load_format]
    if not torch.cuda.is_available():
        common += ["--kv-cache-memory-bytes", str(1 << 30)]
    if args.churn:
        return churn_main(args, model, hidden, common, tmp)
    steers = random_steer_files(hidden, args.rank, args.steers, "bench-serve-steers-")
    names = list(steers)
    steer_args = [a for n, p in steers.items() for a in ("--steer", f"{n}={p}")]
    print(f"starting two servers (plain vLLM, and vLLM with the plugin and {args.steers} "
          f"steers); logs in {tmp}", flush=True)
    t0 = time.time()
    with contextlib.ExitStack() as stack:
        plain = stack.enter_context(serve(common, tmp / "plain.log",
                                          env={"VLLM_PLUGINS": "none"}))
        steered = stack.enter_context(serve(common + steer_args, tmp / "plugin.log"))
        startup = time.time() - t0
        print(f"servers up in {startup:.0f}s", flush=True)
        prompts = [f"Request {i}: write a short story about the number {i} and" for i in
                   range(args.requests)]
        n = args.requests
        passes = {  # name: (server, per-request steers)
            "plain vLLM (no plugin)": (plain, [None] * n),
            "plugin, unsteered": (steered, [None] * n),
            "plugin, one steer": (steered, [{names[0]: 5.0}] * n),
            "plugin, mixed": (steered, [
                None if i % 4 == 0 else
                {names[i % len(names)]: float(i % 9 - 4) or 1.0} if i % 4 != 3 else
                {names[i % len(names)]: 3.0, names[(i + 1) % len(names)]: -2.0}
                for i in range(n)]),
        }
        for url in (plain, steered):  # warm-up
            asyncio.run(run_pass(url, prompts[:4], [None] * 4, 8, 4))
        results = {k: [] for k in passes}
        for r in range(args.repeats):
            for name in (passes if r % 2 == 0 else reversed(list(passes))):
                url, steers = passes[name]
                results[name].append(asyncio.run(run_pass(url, prompts, steers,
                                                          args.output_len, args.concurrency)))
                print(f"  repeat {r + 1} {name}: {results[name][-1]['tok_s']:.1f} tok/s",
                      flush=True)
    rows = []
    base_tps = statistics.median(x["tok_s"] for x in results["plain vLLM (no plugin)"])
    for name, runs in results.items():
        ttft = [t for x in runs for t in x["ttft"]]
        tpot = [t for x in runs for t in x["tpot"]]
        tps = statistics.median(x["tok_s"] for x in runs)
        rows.append({"pass": name, "tok_s": tps, "ratio": tps / base_tps,
                     "ttft_ms": {q: 1000 * pct(ttft, q) for q in (50, 90, 99)},
                     "tpot_ms": {q: 1000 * pct(tpot, q) for q in (50, 90, 99)}})
    print("\n| traffic | output tok/s | ratio | TTFT p50/p90/p99 ms | TPOT p50/p90/p99 ms |")
    print("|---|---|---|---|---|")
    for row in rows:
        t, p = row["ttft_ms"], row["tpot_ms"]
        print(f"| {row['pass']} | {row['tok_s']:.1f} | {row['ratio']:.3f} | "
              f"{t[50]:.0f}/{t[90]:.0f}/{t[99]:.0f} | {p[50]:.1f}/{p[90]:.1f}/{p[99]:.1f} |")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"model": args.model, "requests": args.requests, "concurrency": args.concurrency,
            "output_len": args.output_len, "steers": args.steers, "rank": args.rank,
            "repeats": args.repeats, "startup_s": startup, "cpus": os.cpu_count(),
            "command": "python benchmarks/bench_serve.py " + " ".join(argv or sys.argv[1:])}
    (out / "serve.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
