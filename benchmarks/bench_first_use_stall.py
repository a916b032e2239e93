"""Does a first-use load from ``--steer-dir`` stall the requests already running?

One ``vllm serve`` of the embedded model (SmolLM2-135M-Instruct) with a steer dir larger than
its bank (``--max-steers 2``: every first use loads a file, most evict one). Streaming
clients decode long completions; their inter-token latency (the time between two streamed
tokens) is measured in rounds that alternate, side by side in one run:

- **quiet**: the streams alone;
- **traffic**: the same streams while another client sends short requests (one every
  ``--load-every`` seconds) that all name one steer, loaded by the first of them: the
  traffic of the next kind without its loads;
- **loads**: the same streams while that client's requests each name a steer not loaded, so
  the engine core loads a file (read, checked, put into the bank) between its steps.

Prints p50, p99 and the largest inter-token gap of each kind, the loads made, and the ratios
loads/traffic (what the loads themselves cost) and loads/quiet. Usage::

    .venv/bin/python benchmarks/bench_first_use_stall.py --rounds 4 --streams 4

The figures: benchmarks/RESULTS.md, "First-use loads and running requests".
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import requests

ROOT = Path(__file__).resolve().parents[1]


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * (len(xs) - 1) + 0.5))] if xs else float("nan")


def stream_gaps(url, model, max_tokens, out: list, steer=None):
    body = {"model": model, "prompt": "The history of the city begins", "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True}
    if steer:
        body["steer"] = steer
    last = None
    with requests.post(url + "/v1/completions", json=body, stream=True, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line or not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            now = time.perf_counter()
            if last is not None:
                out.append(now - last)
            last = now


def loader(url, model, names, every, stop: threading.Event, made: list):
    i = 0
    while not stop.is_set():
        name = names[i % len(names)]
        i += 1
        r = requests.post(url + "/v1/completions", json={
            "model": model, "prompt": "Hi", "max_tokens": 1, "steer": {name: 1}}, timeout=600)
        made.append((name, r.status_code))
        stop.wait(every)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=4, help="rounds of each kind, alternating")
    ap.add_argument("--streams", type=int, default=4, help="concurrent streaming requests")
    ap.add_argument("--tokens", type=int, default=64, help="tokens per streamed request")
    ap.add_argument("--dir-steers", type=int, default=8, help="steers in --steer-dir")
    ap.add_argument("--load-every", type=float, default=0.25, help="seconds between loads")
    ap.add_argument("--json", help="write the figures here too")
    args = ap.parse_args(argv)

    from vllm_steer.models import prepare_embedded
    from vllm_steer.server.launch import serve

    model_dir = prepare_embedded("smollm2", quiet=True)
    work = Path(tempfile.mkdtemp(prefix="stall-"))
    d = work / "steers"
    d.mkdir()
    shipped = sorted((ROOT / "steers").glob("smollm2-*.safetensors"))
    names = []
    for i in range(args.dir_steers):
        name = f"s{i}"
        shutil.copy(shipped[i % len(shipped)], d / f"{name}.safetensors")
        names.append(name)
    cmd = [model_dir, "--served-model-name", "m", "--steer-dir", d, "--max-steers", 2,
           "--max-model-len", 512, "--max-num-seqs", 16, "--kv-cache-memory-bytes", 1 << 28,
           "--enforce-eager"]
    gaps = {"quiet": [], "traffic": [], "loads": []}
    loads: list = []
    try:
        with serve(cmd, work / "server.log") as url:
            stream_gaps(url, "m", 8, [])  # warm-up
            for r in range(args.rounds):
                for kind in ("quiet", "traffic", "loads"):
                    stop, made = threading.Event(), []
                    lt = None
                    if kind != "quiet":
                        which = names if kind == "loads" else names[:1]
                        lt = threading.Thread(target=loader, args=(url, "m", which,
                                                                   args.load_every, stop, made))
                        lt.start()
                    ts = [threading.Thread(target=stream_gaps,
                                           args=(url, "m", args.tokens, gaps[kind]))
                          for _ in range(args.streams)]
                    [t.start() for t in ts]
                    [t.join() for t in ts]
                    stop.set()
                    if lt is not None:
                        lt.join()
                        if kind == "loads":
                            loads.extend(made)
                    print(f"round {r + 1}/{args.rounds} {kind}: {len(gaps[kind])} gaps, "
                          f"{len(made)} first-use requests", file=sys.stderr, flush=True)
    except Exception:
        print(f"the server's log is kept: {work / 'server.log'}", file=sys.stderr)
        raise
    shutil.rmtree(work, ignore_errors=True)
    res = {k: {"p50_ms": 1e3 * statistics.median(v), "p99_ms": 1e3 * pct(v, 0.99),
               "max_ms": 1e3 * max(v), "n": len(v)} for k, v in gaps.items()}
    res["first_use_requests"] = len(loads)
    res["first_use_status"] = {str(c): sum(1 for _, s in loads if s == c)
                               for c in sorted({s for _, s in loads})}
    print(f"{'':8}{'p50 ms':>9}{'p99 ms':>9}{'max ms':>9}{'gaps':>7}")
    for k in ("quiet", "traffic", "loads"):
        v = res[k]
        print(f"{k:8}{v['p50_ms']:9.1f}{v['p99_ms']:9.1f}{v['max_ms']:9.1f}{v['n']:7d}")
    for a, b in (("loads", "traffic"), ("loads", "quiet")):
        print(f"{a}/{b}: p50 x{res[a]['p50_ms'] / res[b]['p50_ms']:.2f}, "
              f"p99 x{res[a]['p99_ms'] / res[b]['p99_ms']:.2f}")
    print(f"first-use requests {res['first_use_requests']} {res['first_use_status']}")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
