"""What steering costs offline vLLM generation, side by side in one run.

Modes (same prompts, same engine settings, fixed output length with EOS ignored):

  (a) plugin not loaded (a vLLM with ``VLLM_PLUGINS=none``)
  (b) plugin loaded with K_max steers, no request steered
  (c) every request steered with one steer
  (d) requests spread over K distinct steers and strengths, K = 1, 2, 4, 8, 16
  (e) two steers composed per request
  (f) vector steers (control vectors on every decoder layer) loaded, no request steered
  (g) every request steered with one vector steer, on every layer
  (h) requests spread over K distinct vector steers, K = 1, 4, 16 (at most K_max)
  (i) a vector steer and an LM-Steer steer per request

Modes (f)-(i) run on a third engine (``--vectors``, the default) that serves the same
LM-Steer steers plus K_max vector steers; (b)-(e) run on an engine with no vector steer, whose
model has no op in its layers (what (b) measures against (a)).

The engines live side by side in worker processes, (a) in one and (b)-(e) in another, and
every round runs each mode once, in a fresh random order, so drift of the machine hits all
modes alike. With ``--control`` (the default) a second plugin-free engine, started last,
runs the same work as (a): its ratio (a') shows what two identical engines differ by on
this machine, i.e. the smallest difference the run can resolve.

Ratios are paired: each run is divided by the (a) run of the same round, and the median over
rounds is reported with a 95% bootstrap interval. Besides wall-clock tokens/s, the CPU time
of each engine's processes (front end, engine core, workers) is recorded per run: tokens per
CPU-second is much less sensitive to other load on the machine than tokens per second.
Prints a table, writes JSON and a PNG of the ratio against K.

    python benchmarks/bench_throughput.py                    # embedded model, CPU
    python benchmarks/bench_throughput.py --model meta-llama/Llama-3.1-8B --load-format dummy
    python benchmarks/bench_throughput.py --model benchmarks/configs/llama-3.1-8b.json

The last form needs nothing but the shipped config: the architecture with random weights, no
tokenizer (token-id prompts, no detokenization), no download.

Steers for (d) are random, at the model's hidden size and the given rank (the cost does not
depend on what a steer has learned); with --steer FILE the shipped steer is used for (c).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import random
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
    if args.gpu_memory_utilization:
        kw["gpu_memory_utilization"] = args.gpu_memory_utilization
    return kw


def architecture_only(config_file: str, load_format: str | None) -> str:
    """A model folder holding only ``config_file`` (as its config.json), for dummy weights:
    a real architecture's cost without its weights, tokenizer or network access. Refuses a
    load format other than dummy, which would look for weights that are not there."""
    path = Path(config_file)
    if not path.is_file():
        raise SystemExit(f"--model {config_file}: no such config file")
    if load_format not in (None, "dummy"):
        raise SystemExit(f"--model {config_file} is an architecture without weights: it needs "
                         f"--load-format dummy, not {load_format!r}")
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise SystemExit(f"--model {config_file}: not a JSON config ({e})") from None
    missing = [k for k in ("architectures", "model_type", "hidden_size", "vocab_size")
               if k not in config]
    if missing:
        raise SystemExit(f"--model {config_file}: a model config needs {', '.join(missing)}")
    folder = Path(tempfile.mkdtemp(prefix=f"bench-{path.stem}-"))
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return str(folder)


def make_prompts(model: str, n: int, length: int, tokenizer: bool = True) -> list[list[int]]:
    """n distinct prompts of exactly ``length`` token ids (no prefix sharing between them),
    avoiding special tokens; without a tokenizer, ids below the config's vocab_size."""
    if tokenizer:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(model)
        vocab_size, special = tok.vocab_size, set(tok.all_special_ids)
    else:
        config = json.loads((Path(model) / "config.json").read_text())
        vocab_size = config["vocab_size"]
        special = {config.get(k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    rng = random.Random(0)
    vocab = [i for i in range(min(vocab_size, 30000)) if i not in special]
    return [[rng.choice(vocab) for _ in range(length)] for _ in range(n)]


def random_steer_files(hidden: int, rank: int, n: int, prefix: str,
                       first: str | None = None, full_rank: int = 0) -> dict[str, str]:
    """``n`` random rank-``rank`` steers ``s0..s{n-1}`` saved in a fresh temporary folder
    (the cost of a steer does not depend on what it learned); ``first``: a real steer file
    used as ``s0``; ``full_rank``: the last that many steers have rank ``hidden`` (the
    paper's full-rank W). Returns name -> path."""
    import torch

    from vllm_steer.format import load_steer, make_steer, save_steer

    folder = Path(tempfile.mkdtemp(prefix=prefix))
    steers = {}
    for i in range(n):
        g = torch.Generator().manual_seed(i)
        r = hidden if i >= n - full_rank else rank
        s = make_steer(torch.randn(hidden, r, generator=g) * 0.05,
                       torch.randn(hidden, r, generator=g) * 0.05, f"s{i}")
        if i == 0 and first:
            s = load_steer(first)
        steers[f"s{i}"] = str(folder / f"s{i}.safetensors")
        save_steer(steers[f"s{i}"], s)
    return steers


def random_vector_files(hidden: int, layers: int, n: int, folder: Path, scale: float = 0.01,
                        seed: int = 1000) -> dict[str, str]:
    """``n`` random vector steers ``v0..v{n-1}`` with a vector on every one of ``layers``
    decoder blocks (entries ``scale`` times a standard normal, seeds ``seed + i``: the cost
    does not depend on the direction), saved in ``folder``; name -> path."""
    import torch

    from vllm_steer.vectors import make_vector_steer, save_vector

    folder.mkdir(parents=True, exist_ok=True)
    out = {}
    for i in range(n):
        g = torch.Generator().manual_seed(seed + i)
        vs = make_vector_steer({k: torch.randn(hidden, generator=g) * scale
                                for k in range(layers)}, f"v{i}")
        out[f"v{i}"] = str(folder / f"v{i}.safetensors")
        save_vector(out[f"v{i}"], vs)
    return out


def vector_modes(n: int, vnames: list[str], lm: str, k_list=(1, 4, 16)) -> dict[str, list]:
    """Per-request steer dicts of the vector modes (f)-(i)."""
    out = {"(f) vectors loaded, unsteered": [None] * n,
           "(g) all steered, 1 vector, every layer": [{vnames[0]: 1.0}] * n}
    for k in k_list:
        if k > len(vnames):
            break
        out[f"(h) K={k} distinct vectors"] = [{vnames[i % k]: 0.5 + 0.1 * (i % 7)}
                                              for i in range(n)]
    out["(i) vector + LM-Steer"] = [{vnames[0]: 1.0, lm: 5.0}] * n
    return out


def engine_cpu_seconds(procs) -> float:
    """User + system CPU seconds used so far by ``procs`` (psutil processes; ones that exited
    are skipped)."""
    import psutil

    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += t.user + t.system
    return total


def worker(conn, model: str, kw: dict, disable_plugin: bool, steers: dict | None):
    if disable_plugin:
        os.environ["VLLM_PLUGINS"] = "none"
    import psutil
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    if steers:
        kw = dict(kw, additional_config={"vllm_steer": {"steers": steers}})
    llm = LLM(model, **kw)
    me = psutil.Process()
    procs = [me, *me.children(recursive=True)]  # the engine core and its workers
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
                                 detokenize=not kw.get("skip_tokenizer_init", False),
                                 extra_args={"steer": s} if s else None) for s in steer_per_req]
        inputs = [TokensPrompt(prompt_token_ids=p) for p in prompts]
        c0, t0 = engine_cpu_seconds(procs), time.perf_counter()
        outs = llm.generate(inputs, params, use_tqdm=False)
        dt, cpu = time.perf_counter() - t0, engine_cpu_seconds(procs) - c0
        n_out = sum(len(o.outputs[0].token_ids) for o in outs)
        conn.send((n_out, dt, cpu))


def start(model, kw, disable_plugin, steers):
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    p = ctx.Process(target=worker, args=(child, model, kw, disable_plugin, steers), daemon=False)
    p.start()
    return p, parent


PLAIN = "(a) plugin not loaded"
CONTROL = "(a') plugin not loaded, 2nd engine"


def paired_ratios(values: list[float], base: list[float]) -> list[float]:
    """Each round's value over the base mode's value in the same round."""
    if len(values) != len(base):
        raise ValueError(f"{len(values)} runs against {len(base)} base runs: rounds must pair")
    return [v / b for v, b in zip(values, base, strict=True)]


def median_ci(xs: list[float], level: float = 0.95, draws: int = 2000,
              seed: int = 0) -> tuple[float, float, float]:
    """Median of ``xs`` and a percentile-bootstrap interval for it (rounds resampled with
    replacement, ``draws`` times, fixed seed so a rerun on the same numbers agrees)."""
    if not xs:
        raise ValueError("no runs to summarize")
    rng = random.Random(seed)
    meds = sorted(statistics.median(rng.choices(xs, k=len(xs))) for _ in range(draws))
    lo = meds[int((1 - level) / 2 * draws)]
    hi = meds[min(draws - 1, int((1 + level) / 2 * draws))]
    return statistics.median(xs), lo, hi


def summarize(runs: dict[str, list[tuple[int, float, float]]]) -> list[dict]:
    """Rows of the table from ``mode -> [(output tokens, seconds, CPU seconds) per round]``;
    ratios are paired with :data:`PLAIN` round by round."""
    tok_s = {m: [n / dt for n, dt, _ in v] for m, v in runs.items()}
    tok_cpu = {m: [n / cpu for n, _, cpu in v] for m, v in runs.items()}
    rows = []
    for m in runs:
        wall = paired_ratios(tok_s[m], tok_s[PLAIN])
        cpu = paired_ratios(tok_cpu[m], tok_cpu[PLAIN])
        med, lo, hi = median_ci(wall)
        cmed, clo, chi = median_ci(cpu)
        rows.append({"mode": m, "tok_s": tok_s[m], "tok_s_median": statistics.median(tok_s[m]),
                     "tok_per_cpu_s": tok_cpu[m],
                     "tok_per_cpu_s_median": statistics.median(tok_cpu[m]),
                     "ratio_median": med, "ratio_ci95": [lo, hi],
                     "ratio_min": min(wall), "ratio_max": max(wall),
                     "cpu_ratio_median": cmed, "cpu_ratio_ci95": [clo, chi]})
    return rows


TABLE_HEAD = ("| mode | output tok/s (median) | ratio to (a), paired median [95% CI] | "
              "min-max | tokens per CPU-s, ratio to (a) [95% CI] |\n|---|---|---|---|---|")


def table_row(row: dict) -> str:
    lo, hi = row["ratio_ci95"]
    clo, chi = row["cpu_ratio_ci95"]
    return (f"| {row['mode']} | {row['tok_s_median']:.1f} | {row['ratio_median']:.3f} "
            f"[{lo:.3f}, {hi:.3f}] | {row['ratio_min']:.3f}-{row['ratio_max']:.3f} | "
            f"{row['cpu_ratio_median']:.3f} [{clo:.3f}, {chi:.3f}] |")


def modes(n: int, names: list[str], k_list=K_LIST) -> dict[str, list]:
    """Per-request steer dicts for each mode."""
    out = {"(b) plugin, unsteered": [None] * n,
           "(c) all steered, 1 steer": [{names[0]: 5.0}] * n}
    for k in k_list:
        if k > len(names):
            break
        out[f"(d) K={k} distinct"] = [{names[i % k]: 1.0 + (i % 7)} for i in range(n)]
    out["(e) 2 steers composed"] = [{names[0]: 5.0, names[1 % len(names)]: -3.0}] * n
    return out


def _parser() -> argparse.ArgumentParser:
    """The command line's options."""
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2",
                    help="HF folder/id, smollm2 (embedded), or a config.json file: that "
                         "architecture with dummy weights and no tokenizer (e.g. "
                         "benchmarks/configs/llama-3.1-8b.json)")
    ap.add_argument("--load-format", default=None, help="e.g. dummy: random weights, no download")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--batch", type=int, default=32, help="concurrent requests (max_num_seqs)")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3,
                    help="rounds; each runs every mode once, in a fresh random order")
    ap.add_argument("--rank", type=int, default=64, help="rank of the random steers")
    ap.add_argument("--steer", default=None, help="a real steer file used as steer 0")
    ap.add_argument("--k-list", default=",".join(map(str, K_LIST)),
                    help="K values of mode (d), e.g. 64,256: that many distinct steers loaded "
                         "and spread over the batch (use --batch >= K)")
    ap.add_argument("--full-rank", type=int, default=0,
                    help="how many of the loaded steers are full rank (rank = hidden size)")
    ap.add_argument("--kv-cache-bytes", type=int, default=1 << 30)
    ap.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=True,
                    help="--no-enforce-eager: CUDA graphs (and torch.compile) as on a GPU")
    ap.add_argument("--gpu-memory-utilization", type=float, default=None,
                    help="per engine, on a GPU: the engines share it (e.g. 0.25 for three)")
    ap.add_argument("--vectors", action=argparse.BooleanOptionalAction, default=True,
                    help="also run the vector-steer modes (f)-(i) on a third engine")
    ap.add_argument("--control", action=argparse.BooleanOptionalAction, default=True,
                    help="a second plugin-free engine, (a'): the difference between two "
                         "identical engines on this machine")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--replot", metavar="JSON", help="only redraw the plot of a saved run")
    return ap


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    if args.replot:
        doc = json.loads(Path(args.replot).read_text())
        src = Path(args.replot)  # throughput{stem}.json -> throughput_vs_k{stem}.png
        path = src.with_name(src.stem.replace("throughput", "throughput_vs_k", 1) + ".png")
        plot(doc["rows"], path, doc["meta"])
        print(f"wrote {path}")
        return 0

    import torch
    from transformers import AutoConfig

    from vllm_steer.models import resolve_model

    config_only = args.model.endswith(".json")
    if config_only:
        model = architecture_only(args.model, args.load_format)
        args.load_format = "dummy"
    else:
        model = resolve_model(args.model)
    hf_config = AutoConfig.from_pretrained(model)
    hidden = hf_config.hidden_size
    k_list = tuple(int(k) for k in args.k_list.split(","))
    steers = random_steer_files(hidden, args.rank, max(k_list), "bench-steers-", args.steer,
                                full_rank=args.full_rank)
    vectors = (random_vector_files(hidden, hf_config.num_hidden_layers, max(k_list),
                                   Path(tempfile.mkdtemp(prefix="bench-vectors-")))
               if args.vectors else {})

    kw = engine_kwargs(args)
    if config_only:
        kw["skip_tokenizer_init"] = True
    prompts = make_prompts(model, args.batch, args.prompt_len, tokenizer=not config_only)
    n_engines = 2 + bool(args.control) + bool(vectors)
    print(f"starting {n_engines} engines ({model}; batch {args.batch}, prompt "
          f"{args.prompt_len}, output {args.output_len} tokens, {args.repeats} rounds)...",
          flush=True)
    t0 = time.time()
    engines = {}
    specs = [("plain", True, None), ("plugin", False, steers)]
    if vectors:
        specs.append(("plugin, vectors", False, {**steers, **vectors}))
    if args.control:  # started last: whatever comes from start order shows up in (a')
        specs.append(("plain, 2nd", True, None))
    for name, disable_plugin, engine_steers in specs:  # one at a time, as a user would
        engines[name] = start(model, kw, disable_plugin, engine_steers)
        assert engines[name][1].recv() == "ready", name
    startup = time.time() - t0
    plan = {PLAIN: ("plain", [None] * args.batch)}
    if args.control:
        plan[CONTROL] = ("plain, 2nd", [None] * args.batch)
    plan.update({m: ("plugin", s) for m, s in modes(args.batch, list(steers), k_list).items()})
    if vectors:
        plan.update({m: ("plugin, vectors", s) for m, s in
                     vector_modes(args.batch, list(vectors), list(steers)[0]).items()})
    for _, conn in engines.values():  # warm-up: one full-length pass per engine
        conn.send((prompts, [None] * args.batch, args.output_len))
        conn.recv()
    runs: dict[str, list[tuple[int, float, float]]] = {m: [] for m in plan}
    from tqdm import tqdm

    with tqdm(total=args.repeats * len(plan), desc="bench", unit="run") as bar:
        for r in range(args.repeats):
            order = list(plan)
            random.Random(r).shuffle(order)
            for m in order:
                engine, steer_per_req = plan[m]
                conn = engines[engine][1]
                conn.send((prompts, steer_per_req, args.output_len))
                runs[m].append(conn.recv())
                bar.update()
    for p, conn in engines.values():
        conn.send(None)
        conn.recv()
        p.join(timeout=60)
        if p.is_alive():
            p.terminate()

    rows = summarize(runs)
    print()
    print(TABLE_HEAD)
    for row in rows:
        print(table_row(row))
    import vllm

    meta = {"model": args.model, "hidden_size": hidden, "batch": args.batch,
            "prompt_len": args.prompt_len, "output_len": args.output_len,
            "repeats": args.repeats, "control": args.control, "order": "shuffled per round",
            "steer_rank": args.rank, "full_rank_steers": args.full_rank, "k_list": k_list,
            "vector_steers": len(vectors), "vector_layers": hf_config.num_hidden_layers,
            "engine_kwargs": kw, "startup_s_all_engines": startup,
            "machine": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(), "vllm": vllm.__version__, "torch": torch.__version__,
            "command": "python benchmarks/bench_throughput.py " + " ".join(argv or sys.argv[1:])}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = "" if k_list == K_LIST else "_k" + "-".join(map(str, k_list))  # keep the K<=16 run
    (out / f"throughput{stem}.json").write_text(json.dumps({"meta": meta, "rows": rows},
                                                            indent=2))
    plot(rows, out / f"throughput_vs_k{stem}.png", meta)
    print(f"\nwrote {out / f'throughput{stem}.json'} and {out / f'throughput_vs_k{stem}.png'}")
    return 0


def plot(rows, path, meta):
    """Paired throughput ratio against K with its 95% interval; the control (a') band shows
    what two identical plain engines differ by on the machine."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def band(row):  # runs saved before the paired CI existed have only min-max
        return row.get("ratio_ci95") or [row["ratio_min"], row["ratio_max"]]

    ks, med, lo, hi = [], [], [], []
    for row in rows:
        if row["mode"].startswith("(d)"):
            ks.append(int(row["mode"].split("K=")[1].split()[0]))
            med.append(row["ratio_median"])
            lo.append(band(row)[0]), hi.append(band(row)[1])
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    ax.plot(ks, med, "o-", label="vllm-steer, K distinct steers (median)")
    ax.fill_between(ks, lo, hi, alpha=0.2, label="95% interval")
    floor = min(lo)
    control = next((r for r in rows if r["mode"] == CONTROL), None)
    if control:
        clo, chi = band(control)
        floor = min(floor, clo)
        ax.axhspan(clo, chi, color="k", alpha=0.08,
                   label="second plain engine (a'): 95% interval")
    ax.axhline(1.0, color="k", lw=0.8, label="plain vLLM (plugin not loaded)")
    unsteered = next(r for r in rows if r["mode"].startswith("(b)"))["ratio_median"]
    ax.axhline(unsteered, color="gray", ls=":", label="plugin loaded, unsteered")
    ax.axhline(0.95, color="r", ls="--", lw=0.8, label="goal at K = 16 and 64: 0.95")
    ax.set_xscale("log", base=2)
    ax.set_xticks(ks, [str(k) for k in ks])
    ax.set_ylim(min(0.9, floor - 0.02), max(1.05, max(hi) + 0.02))
    ax.set_xlabel("distinct steers in the batch (K)")
    ax.set_ylabel("output tokens/s relative to plain vLLM")
    ax.set_title(f"{meta['model']}, batch {meta['batch']}, {meta['output_len']} output tokens, "
                 f"{meta['repeats']} paired repetitions", fontsize=10)
    ax.legend(fontsize=7.5, loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
