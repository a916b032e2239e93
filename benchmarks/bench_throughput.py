"""What steering costs offline vLLM generation, side by side in one run.

Modes (same prompts, same engine settings, fixed output length with EOS ignored):

  (a) plugin not loaded (a vLLM with ``VLLM_PLUGINS=none``)
  (b) plugin loaded with K_max steers, no request steered
  (c) every request steered with one steer
  (d) requests spread over K distinct steers and strengths, K = 1, 2, 4, 8, 16
  (e) two steers composed per request

Two engines live side by side in two worker processes, (a) in one and (b)-(e) in the other,
and the modes are run round-robin for each repeat, so drift of the machine hits all modes
alike. Prints a table of output tokens/s with the ratio to (a) (median and spread over
repeats), writes JSON and a PNG of the ratio against K.

    python benchmarks/bench_throughput.py                    # embedded model, CPU
    python benchmarks/bench_throughput.py --model meta-llama/Llama-3.1-8B --load-format dummy

Steers for (d) are random, at the model's hidden size and the given rank (the cost does not
depend on what a steer has learned); with --steer FILE the shipped steer is used for (c).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

K_LIST = (1, 2, 4, 8, 16)


def engine_kwargs(args) -> dict:
    kw = dict(max_model_len=args.prompt_len + args.output_len + 16, max_num_seqs=args.batch,
              seed=0, enforce_eager=args.enforce_eager, dtype=args.dtype)
    if args.kv_cache_bytes:
        kw["kv_cache_memory_bytes"] = args.kv_cache_bytes
    if args.load_format:
        kw["load_format"] = args.load_format
    return kw


def make_prompts(tokenizer_path: str, n: int, length: int) -> list[list[int]]:
    """n distinct prompts of exactly ``length`` token ids (no prefix sharing between them)."""
    import random

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_path)
    rng = random.Random(0)
    vocab = [i for i in range(min(tok.vocab_size, 30000)) if i not in tok.all_special_ids]
    return [[rng.choice(vocab) for _ in range(length)] for _ in range(n)]


def random_steer_files(hidden: int, rank: int, n: int, prefix: str,
                       first: str | None = None) -> dict[str, str]:
    """``n`` random rank-``rank`` steers ``s0..s{n-1}`` saved in a fresh temporary folder
    (the cost of a steer does not depend on what it learned); ``first``: a real steer file
    used as ``s0``. Returns name -> path."""
    import torch

    from vllm_steer.format import load_steer, make_steer, save_steer

    folder = Path(tempfile.mkdtemp(prefix=prefix))
    steers = {}
    for i in range(n):
        g = torch.Generator().manual_seed(i)
        s = make_steer(torch.randn(hidden, rank, generator=g) * 0.05,
                       torch.randn(hidden, rank, generator=g) * 0.05, f"s{i}")
        if i == 0 and first:
            s = load_steer(first)
        steers[f"s{i}"] = str(folder / f"s{i}.safetensors")
        save_steer(steers[f"s{i}"], s)
    return steers


def worker(conn, model: str, kw: dict, disable_plugin: bool, steers: dict | None):
    if disable_plugin:
        os.environ["VLLM_PLUGINS"] = "none"
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    if steers:
        kw = dict(kw, additional_config={"vllm_steer": {"steers": steers}})
    llm = LLM(model, **kw)
    conn.send("ready")
    while True:
        msg = conn.recv()
        if msg is None:
            # shut the engine down before this process exits: otherwise its exit waits on
            # the engine-core child forever (seen with vLLM 0.32 on CPU)
            llm.llm_engine.engine_core.shutdown()
            conn.send("bye")
            break
        prompts, steer_per_req, output_len = msg
        params = [SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0,
                                 extra_args={"steer": s} if s else None) for s in steer_per_req]
        inputs = [TokensPrompt(prompt_token_ids=p) for p in prompts]
        t0 = time.perf_counter()
        outs = llm.generate(inputs, params, use_tqdm=False)
        dt = time.perf_counter() - t0
        n_out = sum(len(o.outputs[0].token_ids) for o in outs)
        conn.send((n_out, dt))


def start(model, kw, disable_plugin, steers):
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    p = ctx.Process(target=worker, args=(child, model, kw, disable_plugin, steers), daemon=False)
    p.start()
    return p, parent


def modes(n: int, names: list[str]) -> dict[str, list]:
    """Per-request steer dicts for each mode."""
    out = {"(b) plugin, unsteered": [None] * n,
           "(c) all steered, 1 steer": [{names[0]: 5.0}] * n}
    for k in K_LIST:
        if k > len(names):
            break
        out[f"(d) K={k} distinct"] = [{names[i % k]: 1.0 + (i % 7)} for i in range(n)]
    out["(e) 2 steers composed"] = [{names[0]: 5.0, names[1 % len(names)]: -3.0}] * n
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2", help="HF folder/id, or smollm2 (embedded)")
    ap.add_argument("--load-format", default=None, help="e.g. dummy: random weights, no download")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--batch", type=int, default=32, help="concurrent requests (max_num_seqs)")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rank", type=int, default=64, help="rank of the random steers")
    ap.add_argument("--steer", default=None, help="a real steer file used as steer 0")
    ap.add_argument("--kv-cache-bytes", type=int, default=1 << 30)
    ap.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--replot", metavar="JSON", help="only redraw the plot of a saved run")
    args = ap.parse_args(argv)
    if args.replot:
        doc = json.loads(Path(args.replot).read_text())
        path = Path(args.replot).with_name("throughput_vs_k.png")
        plot(doc["rows"], path, doc["meta"])
        print(f"wrote {path}")
        return 0

    import torch
    from transformers import AutoConfig

    from vllm_steer.models import resolve_model

    model = resolve_model(args.model)
    hidden = AutoConfig.from_pretrained(model).hidden_size
    steers = random_steer_files(hidden, args.rank, max(K_LIST), "bench-steers-", args.steer)

    kw = engine_kwargs(args)
    prompts = make_prompts(model, args.batch, args.prompt_len)
    print(f"starting two engines ({model}; batch {args.batch}, prompt {args.prompt_len}, "
          f"output {args.output_len} tokens, {args.repeats} repeats)...", flush=True)
    t0 = time.time()
    pa, ca = start(model, kw, True, None)
    assert ca.recv() == "ready"
    pb, cb = start(model, kw, False, steers)
    assert cb.recv() == "ready"
    startup = time.time() - t0
    names = list(steers)
    plan = {"(a) plugin not loaded": (ca, [None] * args.batch)}
    plan.update({m: (cb, s) for m, s in modes(args.batch, names).items()})
    # warm-up each engine once
    for conn in (ca, cb):
        conn.send((prompts, [None] * args.batch, 8))
        conn.recv()
    results: dict[str, list[float]] = {m: [] for m in plan}
    from tqdm import tqdm

    with tqdm(total=args.repeats * len(plan), desc="bench", unit="run") as bar:
        for r in range(args.repeats):
            order = list(plan) if r % 2 == 0 else list(reversed(plan))
            for m in order:
                conn, steer_per_req = plan[m]
                conn.send((prompts, steer_per_req, args.output_len))
                n_out, dt = conn.recv()
                results[m].append(n_out / dt)
                bar.update()
    for conn, p in ((ca, pa), (cb, pb)):
        conn.send(None)
        conn.recv()
        p.join(timeout=60)
        if p.is_alive():
            p.terminate()

    base = statistics.median(results["(a) plugin not loaded"])
    rows = []
    for m, v in results.items():
        med = statistics.median(v)
        ratios = [x / base for x in v]
        rows.append({"mode": m, "tok_s_median": med, "tok_s": v, "ratio_median": med / base,
                     "ratio_min": min(ratios), "ratio_max": max(ratios)})
    print()
    print(f"| mode | output tok/s (median) | ratio to (a) | spread (min-max ratio) |")
    print(f"|---|---|---|---|")
    for row in rows:
        print(f"| {row['mode']} | {row['tok_s_median']:.1f} | {row['ratio_median']:.3f} | "
              f"{row['ratio_min']:.3f}-{row['ratio_max']:.3f} |")
    import vllm

    meta = {"model": args.model, "hidden_size": hidden, "batch": args.batch,
            "prompt_len": args.prompt_len, "output_len": args.output_len,
            "repeats": args.repeats, "steer_rank": args.rank, "engine_kwargs": kw,
            "startup_s_two_engines": startup, "machine": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(), "vllm": vllm.__version__, "torch": torch.__version__,
            "command": "python benchmarks/bench_throughput.py " + " ".join(argv or sys.argv[1:])}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "throughput.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    plot(rows, out / "throughput_vs_k.png", meta)
    print(f"\nwrote {out / 'throughput.json'} and {out / 'throughput_vs_k.png'}")
    return 0


def plot(rows, path, meta):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ks, med, lo, hi = [], [], [], []
    for row in rows:
        if row["mode"].startswith("(d)"):
            ks.append(int(row["mode"].split("K=")[1].split()[0]))
            med.append(row["ratio_median"]), lo.append(row["ratio_min"]), hi.append(row["ratio_max"])
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(ks, med, "o-", label="vllm-steer, K distinct steers")
    ax.fill_between(ks, lo, hi, alpha=0.2)
    unsteered = next(r for r in rows if r["mode"].startswith("(b)"))["ratio_median"]
    plain = next(r for r in rows if r["mode"].startswith("(a)"))
    ax.axhspan(plain["ratio_min"], plain["ratio_max"], color="k", alpha=0.07,
               label="plain vLLM: its own run-to-run spread")
    ax.axhline(1.0, color="k", lw=0.8, label="plain vLLM (plugin not loaded), median")
    ax.axhline(unsteered, color="gray", ls=":", label="plugin loaded, unsteered")
    ax.axhline(0.95, color="r", ls="--", lw=0.8, label="goal 0.95")
    ax.set_xscale("log", base=2)
    ax.set_xticks(ks, [str(k) for k in ks])
    ax.set_ylim(min(0.8, min(lo) - 0.02, plain["ratio_min"] - 0.02),
                max(1.08, max(hi) + 0.02, plain["ratio_max"] + 0.02))
    ax.set_xlabel("distinct steers in the batch (K)")
    ax.set_ylabel("output tokens/s relative to plain vLLM")
    ax.set_title(f"{meta['model']}, batch {meta['batch']}, {meta['output_len']} output tokens")
    ax.legend(fontsize=8, loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
