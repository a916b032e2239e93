#!/usr/bin/env python3
"""Steered against plain tokens/s in one engine run: what steering costs a GPU's decode.

For each model shape asked for, one vLLM engine (random weights, ``load_format="dummy"``, no
tokenizer, no download) with the plugin loaded and K_max random steers, then rounds of the
same work in every mode, in a fresh random order per round (drift of the machine hits all
modes alike):

  * ``plain``: no request steered (the plugin loaded, its head doing nothing);
  * ``K=1``: every request steered with one steer;
  * ``K=64``: the requests spread over 64 distinct steers (one each at 64 rows).

With ``--vector-k``, a second engine at the same shape, in the same process, whose steers are
the first engine's (loaded, never used: its bank the first engine's plus the vectors) and
max(``--vector-k``) random vector steers (control
vectors) on every decoder layer (the op inside vLLM's compiled forward), its bank of
max(``--k``) + max(``--vector-k``) slots; its modes join the same rounds, and their ratios are
to the first engine's ``plain`` (no vector op in its model):

  * ``vector unused``: no request steered (vectors loaded, unused: the op adds zeros);
  * ``vector K=1``: every request steered by one vector steer;
  * ``vector K=64``: the requests spread over 64 distinct vector steers.

Each run is ``--rows`` requests at once (``max_num_seqs``), ``--prompt-len`` prompt tokens,
``--output-len`` generated tokens (EOS ignored), greedy. Reported per shape and mode: output
tokens/s (median over rounds) and the median of the paired ratio to ``plain`` in the same
round; the fastest run's tokens/s and its ratio to plain's fastest (stalls of the host only
slow a run down: on an H100 host, runs of the same plain work took 0.20 to 0.55 s); and the
range of a run's seconds. Python's garbage is collected before each run, outside its timing.
The vector engine is checked: its op is in every decoder block, the first engine's in none;
its step mapping fed no step in ``vector unused`` and at least one per generated token in the
steered vector modes. Also reported: the share of requests whose tokens the vectors changed
(against ``vector unused``'s); whether the head's steer op replayed from CUDA graphs, and the
graphs it captured while the engine started (the engine log's lines). With ``--profile`` the engine
runs in one process and the plugin's own host time is timed by site in every timed run
(:class:`Profiler`; the ratios of such a run are not the figures to report: one process
does the work of three).

Shapes: ``smollm2`` (the embedded model's architecture, SmolLM2-135M: hidden 576),
``8b`` (an 8B-like Llama: hidden 4096, benchmarks/configs/llama-3.1-8b.json, with
``--layers-8b`` layers), ``tiny`` (hidden 64, 2 layers: the reduced form for a CPU).

On ``--device cuda`` the engine runs as users run it (CUDA graphs, async scheduling), on the
runner asked for (``v2``: Model Runner V2, the default). On ``--device cpu`` it is eager, V2
through the test shim tests/v2shim (as scripts/gpu_vllm_check.py). Writes
``OUT/gpu_throughput.json``; exit status 0 when every engine ran, produced the asked number
of tokens in every mode, and its steer op saw no row in ``plain`` and every generated token's
row in the steered modes.

    python scripts/gpu_throughput.py --device cuda                 # smollm2 and 8b, bf16, V2
    python scripts/gpu_throughput.py --device cpu --shapes tiny --dtype float32 --runner v1 \\
        --rows 4 --k 1 4 --output-len 4 --rounds 1 [--vector-k 1 4]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

#: SmolLM2-135M's architecture (the embedded model), weights left to ``load_format=dummy``.
SMOLLM2 = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 576,
           "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
           "num_key_value_heads": 3, "head_dim": 64, "vocab_size": 49152,
           "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 100000.0,
           "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2,
           "pad_token_id": 2, "hidden_act": "silu"}
#: The reduced form for a CPU (vLLM's CPU attention needs head_dim 32/64/128...).
TINY = {**SMOLLM2, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 1, "num_key_value_heads": 1, "vocab_size": 512,
        "max_position_embeddings": 512}
SHAPES = ("smollm2", "8b", "tiny")
STEER_RANK = 64  # the random steers' rank (the cost does not depend on what a steer learned)


def model_config(shape: str, layers_8b: int) -> dict:
    if shape == "smollm2":
        return dict(SMOLLM2)
    if shape == "tiny":
        return dict(TINY)
    cfg = json.loads((ROOT / "benchmarks" / "configs" / "llama-3.1-8b.json").read_text())
    return {**cfg, "num_hidden_layers": layers_8b}


def write_model(folder: Path, config: dict) -> Path:
    """A model folder holding only its config.json (random weights at load)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    return folder


def write_steers(folder: Path, hidden: int, n: int, rank: int) -> dict[str, str]:
    """``n`` random steers ``s0..s{n-1}`` of ``rank`` at ``hidden``; name -> path."""
    import torch

    from vllm_steer.format import make_steer, save_steer

    folder.mkdir(parents=True, exist_ok=True)
    paths = {}
    for i in range(n):
        g = torch.Generator().manual_seed(i)
        s = make_steer(torch.randn(hidden, rank, generator=g) * 0.05,
                       torch.randn(hidden, rank, generator=g) * 0.05, f"s{i}")
        paths[f"s{i}"] = str(folder / f"s{i}.safetensors")
        save_steer(paths[f"s{i}"], s)
    return paths


def write_vectors(folder: Path, hidden: int, layers: int, n: int) -> dict[str, str]:
    """``n`` random vector steers ``v0..v{n-1}`` at ``hidden``, each with a vector for every
    one of ``layers`` decoder blocks (bench_throughput.py's, larger: a tiny model's tokens
    change under them); name -> path."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_throughput import random_vector_files

    return random_vector_files(hidden, layers, n, folder, scale=0.05, seed=10_000)


VECTOR_PREFIX = "vector "  # the vector engine's modes: "vector unused", "vector K=k"


def mode_steers(mode: str, rows: int) -> list[dict | None]:
    """The ``steer`` of each request in a mode: ``plain`` and ``vector unused`` none, ``K=k``
    request i on steer ``s{i % k}``, ``vector K=k`` on vector steer ``v{i % k}``, at strength
    2."""
    if mode in ("plain", VECTOR_PREFIX + "unused"):
        return [None] * rows
    name = "v" if mode.startswith(VECTOR_PREFIX) else "s"
    k = int(mode.split("=")[1])
    return [{f"{name}{i % k}": 2.0} for i in range(rows)]


def rows_changed(tokens: dict[str, list]) -> dict[str, float]:
    """Per steered vector mode: the fraction of requests whose generated tokens differ from
    ``vector unused``'s (same prompts, greedy): the vectors reached the logits. Reported, not
    checked (a model could map both to the same tokens)."""
    base = tokens.get(VECTOR_PREFIX + "unused")
    if base is None:
        return {}
    return {m: sum(a != b for a, b in zip(t, base, strict=True)) / len(base)
            for m, t in tokens.items() if m.startswith(VECTOR_PREFIX) and t is not base}


def vector_stats(worker=None) -> dict[str, int]:
    """This worker's decoder-layer op: the blocks that have it (0: no vector op in the
    model) and the steps its step mapping fed a steered token. Takes (and ignores) a worker,
    for ``LLM.collective_rpc``."""
    from vllm_steer.integrations.worker.runtime import current_runtime

    rt = current_runtime()
    layers = None if rt is None else rt.layers
    if layers is None:
        return {"blocks": 0, "steered_steps": 0}
    return {"blocks": len(layers.blocks), "steered_steps": rt.step.tokens.steered_steps}


def summarize(runs: dict[str, list[tuple[int, float]]]) -> dict[str, dict]:
    """Per mode: median tokens/s and the median of the per-round ratio to ``plain``; the
    fastest run's tokens/s and its ratio to plain's fastest (a host's stalls only slow a run
    down, so the fastest run is the one they hit least); the fastest and slowest run's
    seconds. ``runs``: mode -> one ``(tokens, seconds)`` per round, rounds in the same order."""
    base = [t / s for t, s in runs["plain"]]
    out = {}
    for mode, rs in runs.items():
        tps = [t / s for t, s in rs]
        out[mode] = {"tokens_per_s": statistics.median(tps),
                     "ratio_to_plain": statistics.median(
                         a / b for a, b in zip(tps, base, strict=False)),
                     "best_tokens_per_s": max(tps), "best_ratio_to_plain": max(tps) / max(base),
                     "seconds": [min(s for _, s in rs), max(s for _, s in rs)],
                     "rounds": len(rs)}
    return out


# ---------------------------------------------------------------------- engine (subprocess)

def run_engine(a) -> int:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    spec = json.loads(a.spec)
    kw = dict(dtype=spec["dtype"], max_model_len=spec["prompt_len"] + spec["output_len"] + 16,
              max_num_seqs=spec["rows"], seed=0, load_format="dummy", skip_tokenizer_init=True,
              enforce_eager=spec["device"] == "cpu",
              additional_config={"vllm_steer": {"steers": spec["steers"],
                                                "max_steer_rank": STEER_RANK}})
    vspec = spec.get("vector")
    if spec["device"] == "cpu":
        kw["kv_cache_memory_bytes"] = 1 << 28
    else:  # two engines at once with --vector-k: each its share of the device
        kw["gpu_memory_utilization"] = 0.42 if vspec else 0.5
    if spec.get("compilation_config"):
        kw["compilation_config"] = spec["compilation_config"]
    profiler = Profiler() if spec.get("profile") else None
    t_start = time.perf_counter()
    llm = LLM(spec["model"], **kw)
    start_s = time.perf_counter() - t_start  # the engine's start (compile and captures in it)
    cc = llm.llm_engine.vllm_config.compilation_config
    engine = {"start_s": round(start_s, 1), "compilation_mode": str(getattr(cc, "mode", None)),
              "cudagraph_mode": str(cc.cudagraph_mode)}
    engines = {"plain": llm}  # the engine that runs each mode (by its first word)
    vector: dict = {}
    vllm_ = None
    if vspec:
        t_start = time.perf_counter()
        try:  # a vector engine that does not start leaves the first engine's figures
            vllm_ = LLM(spec["model"], **{**kw, "additional_config": {"vllm_steer": {
                "steers": vspec["steers"], "max_steers": vspec["max_steers"],
                "max_steer_rank": STEER_RANK}}})
        except Exception as e:  # noqa: BLE001 (reported, and the run fails)
            vector["error"] = f"the vector engine did not start: {type(e).__name__}: {e}"[:3000]
            print(vector["error"], flush=True)
    if vllm_ is not None:
        cc = vllm_.llm_engine.vllm_config.compilation_config
        vector["engine"] = {"start_s": round(time.perf_counter() - t_start, 1),
                            "compilation_mode": str(getattr(cc, "mode", None)),
                            "cudagraph_mode": str(cc.cudagraph_mode)}
        vector["blocks"] = [s["blocks"] for s in vllm_.collective_rpc(vector_stats)]
        vector["blocks_first_engine"] = [s["blocks"] for s in llm.collective_rpc(vector_stats)]
        engines["vector"] = vllm_
    rng = random.Random(0)
    vocab = spec["vocab_size"]
    prompts = [TokensPrompt(prompt_token_ids=[rng.randrange(3, vocab)
                                              for _ in range(spec["prompt_len"])])
               for _ in range(spec["rows"])]

    from vllm_steer.integrations.worker.runtime import steer_stats

    def rows_steered(mode: str) -> int:  # the workers' steer-op row counters, summed
        if mode.startswith(VECTOR_PREFIX):  # the steps the vector engine's mapping fed
            return sum(s["steered_steps"]
                       for s in engines["vector"].collective_rpc(vector_stats))
        return sum(s["rows"] for s in llm.collective_rpc(steer_stats))

    steered: dict[str, int] = {}
    tokens: dict[str, list] = {}  # each mode's last run: every request's generated tokens
    profile: dict[str, list] = {}

    def run(mode: str, warm_up: bool = False) -> tuple[int, float]:
        params = [SamplingParams(max_tokens=spec["output_len"], ignore_eos=True, temperature=0,
                                 detokenize=False, extra_args=None if s is None else {"steer": s})
                  for s in mode_steers(mode, spec["rows"])]
        target = engines["vector" if mode.startswith(VECTOR_PREFIX) else "plain"]
        before = rows_steered(mode)
        gc.collect()  # outside the timing: no run inherits a collection the last one owed
        if profiler is not None:
            profiler.begin()
        t0 = time.perf_counter()
        outs = target.generate(prompts, params, use_tqdm=False)
        dt = time.perf_counter() - t0
        if profiler is not None and not warm_up:
            profile.setdefault(mode, []).append(profiler.end())
        steered[mode] = rows_steered(mode) - before  # outside the timing
        tokens[mode] = [list(o.outputs[0].token_ids) for o in outs]
        return sum(len(o.outputs[0].token_ids) for o in outs), dt

    modes = ["plain"] + [f"K={k}" for k in spec["k"]]
    if vllm_ is not None:
        modes += [VECTOR_PREFIX + "unused"] + [f"{VECTOR_PREFIX}K={k}" for k in vspec["k"]]
    for mode in modes:  # warm-up: every mode once (first steps, first uses of a row bucket)
        run(mode, warm_up=True)
    runs: dict[str, list] = {m: [] for m in modes}
    order = random.Random(1)
    for done in range(1, spec["rounds"] + 1):
        for mode in order.sample(modes, len(modes)):
            runs[mode].append(run(mode))
        # after every round: an engine stopped by its timeout leaves the rounds it ran
        Path(a.result).write_text(json.dumps({
            "runs": runs, "rows_steered": steered, "profile": profile, "engine": engine,
            "vector": {**vector, "rows_changed": rows_changed(tokens)} if vector else vector,
            "plugin_loaded": "vllm_steer.integrations.plugin" in sys.modules,
            "rounds_done": done}))
    return 0


def partial_result(path: Path) -> dict | None:
    """The result an engine stopped by its timeout left after its last whole round (None:
    it ran none)."""
    try:
        result = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return result if result.get("rounds_done", 0) >= 1 else None


class Profiler:
    """``--profile``: the plugin's own host time in each run, by site, and the head's CUDA
    graphs captured and replayed in it. The engine runs in this process (frontend, engine
    core and worker: ``VLLM_ENABLE_V1_MULTIPROCESSING=0``), every hook of the plugin timed
    exclusively (benchmarks/bench_plugin_step.py's timers: a hook's time less vLLM's
    original inside it), with the steered head, the per-request state's callbacks and the op.
    Made before the engine starts (the hooks are wrapped when vLLM loads the plugin)."""

    def __init__(self):
        sys.path.insert(0, str(ROOT / "benchmarks"))
        import bench_plugin_step

        from vllm_steer.integrations.worker.planner import StepPlanner
        from vllm_steer.kernels.graphs import SteerGraphs
        from vllm_steer.metrics import OpTimer

        self.timers = bench_plugin_step
        bench_plugin_step._instrument(processes=("frontend", "engine", "worker"))
        # the head's parts, each out of the head's own time
        for cls, name, site in ((SteerGraphs, "run", "head: graphs.run"),
                                (OpTimer, "start", "head: timer"),
                                (OpTimer, "stop", "head: timer"),
                                (StepPlanner, "_step_rows", "head: rows"),
                                (StepPlanner, "_eager_plan", "head: eager plan")):
            bench_plugin_step._time_method(cls, name, "plugin:" + site)
        self._graphs = (0, 0)

    @staticmethod
    def graph_counts() -> tuple[int, int]:
        from vllm_steer.integrations.worker.runtime import current_runtime

        rt = current_runtime()
        graphs = None if rt is None else rt.bank_state.bank.graphs
        return (0, 0) if graphs is None else (graphs.captures, graphs.replays)

    def begin(self) -> None:
        self.timers.REG.take()
        self._graphs = self.graph_counts()

    def end(self) -> dict:
        """Seconds per site since :meth:`begin` (``vllm``: vLLM's originals inside the hooks;
        ``captures``/``replays``: the head's CUDA graphs; ``regions``: timed regions;
        ``calls``: regions per site)."""
        acc, count = self.timers.REG.take()
        captures, replays = self.graph_counts()
        return {**acc, "captures": captures - self._graphs[0],
                "replays": replays - self._graphs[1], "regions": sum(count.values()),
                "calls": count}


def profile_lines(profile: dict, steps: int) -> list[str]:
    """Per mode: the plugin's host ms per run (median over the rounds), per step, and its
    largest sites."""
    lines = []
    for mode, runs in profile.items():
        sites = sorted({k for r in runs for k in r if k.startswith("plugin:") or k == "op"})
        med = {k: statistics.median(r.get(k, 0.0) for r in runs) for k in sites}
        total = statistics.median(sum(r.get(k, 0.0) for k in sites) for r in runs)
        top = sorted(med.items(), key=lambda kv: -kv[1])[:8]
        lines.append(
            f"  profile {mode}: plugin {total * 1e3:.2f} ms per run ({total / steps * 1e6:.0f} "
            f"us per step), head graphs captured {max(r['captures'] for r in runs)} / replayed "
            f"{statistics.median(r['replays'] for r in runs):.0f} per run; largest: "
            + ", ".join(f"{k.removeprefix('plugin:')} {v * 1e3:.2f} ms" for k, v in top))
    return lines


# ------------------------------------------------------------------------------ main (parent)

def vector_problem(vector: dict, steered: dict[str, int], layers: int,
                   output_len: int) -> str | None:
    """None when the vector engine ran as asked: its op in every decoder block (summed over
    its workers), in none of the first engine's; its step mapping fed no step in ``vector
    unused`` and at least one per generated token in each steered vector mode (``steered``:
    each mode's steered steps in its last run); else what went wrong."""
    if vector.get("error"):
        return vector["error"]
    mine = {m: v for m, v in steered.items() if m.startswith(VECTOR_PREFIX)}
    if sum(vector["blocks"]) < layers or sum(vector["blocks_first_engine"]) != 0:
        return (f"the op is in {vector['blocks']} decoder blocks per worker, of {layers} "
                f"(the first engine's: {vector['blocks_first_engine']}, expected none)")
    unused = mine.pop(VECTOR_PREFIX + "unused")
    if unused != 0 or not mine or any(v < output_len for v in mine.values()):
        return (f"steered steps of the last runs: unused {unused} (expected 0), "
                f"{mine} (expected at least {output_len} each)")
    return None


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--shapes", nargs="+", default=["smollm2", "8b"], choices=SHAPES)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--runner", choices=["v2", "v1"], default="v2")
    ap.add_argument("--rows", type=int, default=64, help="requests at once (max_num_seqs)")
    ap.add_argument("--k", type=int, nargs="+", default=[1, 64],
                    help="steered modes: the requests spread over K steers")
    ap.add_argument("--vector-k", type=int, nargs="+", default=None, metavar="K",
                    help="also a second engine with max(K) random vector steers on every "
                         "decoder layer: its modes unused and the requests spread over each K "
                         "vector steers, against the first engine's plain")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--layers-8b", type=int, default=32,
                    help="layers of the 8b shape (fewer: a quicker engine, a cheaper step)")
    ap.add_argument("--compilation-config", type=json.loads, default=None, metavar="JSON",
                    help="vLLM compilation_config of every engine (default: vLLM's)")
    ap.add_argument("--engine-timeout", type=int, default=600)
    ap.add_argument("--profile", action="store_true",
                    help="the plugin's host time per run by site, in an in-process engine "
                         "(frontend, engine core and worker in one process)")
    ap.add_argument("--workdir", default=None, help="models, steers, engine logs (default: tmp)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."), help="where the JSON goes")
    sub = ap.add_subparsers(dest="cmd")
    e = sub.add_parser("_engine", help="(internal) one engine in this process")
    e.add_argument("--spec", required=True)
    e.add_argument("--result", required=True)
    return ap


def main(argv=None) -> int:
    ap = parser()
    a = ap.parse_args(argv)
    if a.cmd == "_engine":
        return run_engine(a)
    if max(a.k) > a.rows:
        ap.error(f"--k {max(a.k)} is more than --rows {a.rows}: a run of {a.rows} requests "
                 f"uses at most {a.rows} distinct steers; use --rows {max(a.k)} or more")
    if a.vector_k and max(a.vector_k) > a.rows:
        ap.error(f"--vector-k {max(a.vector_k)} is more than --rows {a.rows}: a run of {a.rows} "
                 f"requests uses at most {a.rows} distinct vector steers; use --rows "
                 f"{max(a.vector_k)} or more")
    if a.vector_k and a.profile:
        ap.error("--vector-k with --profile: the profile's in-process engine is one engine; "
                 "run them apart")

    sys.path.insert(0, str(ROOT))
    from gpu_vllm_check import engine_env

    a.cpu_async = False
    work = Path(a.workdir or tempfile.mkdtemp(prefix="gpu_throughput-"))
    a.workdir = str(work)
    print(f"gpu_throughput: device {a.device}, {a.dtype}, runner {a.runner}, {a.rows} rows, "
          f"K {a.k}, vector K {a.vector_k or 'none'}, shapes {a.shapes}, work in {work}",
          flush=True)
    results, ok = {}, True
    for shape in a.shapes:
        cfg = model_config(shape, a.layers_8b)
        spec = {"model": str(write_model(work / f"model-{shape}", cfg)), "dtype": a.dtype,
                "device": a.device, "rows": a.rows, "k": a.k, "prompt_len": a.prompt_len,
                "output_len": a.output_len, "rounds": a.rounds, "vocab_size": cfg["vocab_size"],
                "steers": write_steers(work / f"steers-{shape}", cfg["hidden_size"], max(a.k),
                                       STEER_RANK),
                "compilation_config": a.compilation_config, "profile": a.profile}
        if a.vector_k:  # the first engine's steers, and vector steers on every decoder layer
            vectors = write_vectors(work / f"vectors-{shape}", cfg["hidden_size"],
                                    cfg["num_hidden_layers"], max(a.vector_k))
            spec["vector"] = {"k": a.vector_k, "max_steers": max(a.k) + max(a.vector_k),
                              "steers": {**spec["steers"], **vectors}}
        out, log = work / f"{shape}.json", work / f"{shape}.log"
        cmd = [sys.executable, str(Path(__file__).resolve()), "_engine", "--spec",
               json.dumps(spec), "--result", str(out)]
        env = engine_env(a, a.runner, True)
        # collective_rpc(steer_stats) sends a function to the workers (pickled, as the tests do)
        env["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
        if a.profile:
            env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        t0 = time.time()
        with open(log, "w") as f:
            try:
                rc = subprocess.run(cmd, env=env, stdout=f,
                                    stderr=subprocess.STDOUT, timeout=a.engine_timeout).returncode
            except subprocess.TimeoutExpired:
                rc = "timeout"
        text = log.read_text()
        result = partial_result(out) if rc == "timeout" else None
        if rc != 0 and result is None:
            print(f"FAIL [{shape}] engine exit {rc} in {time.time() - t0:.0f}s:\n{text[-3000:]}")
            results[shape] = {"error": f"exit {rc}"}
            ok = False
            continue
        if result is None:
            result = json.loads(out.read_text())
        else:  # the rounds that ran before the engine's timeout: reported, and a failure
            print(f"FAIL [{shape}] engine timed out after {time.time() - t0:.0f}s and "
                  f"{result['rounds_done']} of {a.rounds} rounds: the figures below are those "
                  f"rounds' (--engine-timeout {a.engine_timeout:g} s)", flush=True)
            ok = False
        runs, steered = result["runs"], result["rows_steered"]
        if not result["plugin_loaded"]:
            print(f"FAIL [{shape}] vLLM did not load the plugin (no vllm.general_plugins entry "
                  f"point named vllm_steer on the engine's path): every mode ran unsteered")
            ok = False
        want = a.rows * a.output_len
        complete = rc == 0 and all(t == want for rs in runs.values() for t, _ in rs)
        # the last run of each mode: plain rows never reach the steer op, steered rows do
        # (at least one row per generated token of every request)
        complete &= steered["plain"] == 0 and all(
            steered[m] >= want for m in runs if m != "plain" and not m.startswith(VECTOR_PREFIX))
        vector = result.get("vector") or {}
        problem = vector_problem(vector, steered, cfg["num_hidden_layers"],
                                 a.output_len) if a.vector_k else None
        if problem:
            print(f"FAIL [{shape}] vector engine: {problem}")
        complete &= problem is None
        ok &= complete
        summary = summarize(runs)
        graphs = "replays from CUDA graphs" in text
        # the head's graphs captured at start-up (count, buckets, seconds, MiB), as logged
        captured = [line.split("vllm-steer: ", 1)[1] for line in text.splitlines()
                    if "CUDA graph(s) of the LM head's steer op" in line]
        results[shape] = {"hidden": cfg["hidden_size"], "layers": cfg["num_hidden_layers"],
                          "graphs": graphs, "captured_at_start": captured,
                          "complete": complete, "modes": summary,
                          "rows_steered_last_run": steered,
                          "runs": runs, "profile": result.get("profile") or None,
                          "engine": result.get("engine"),
                          "rounds_done": result.get("rounds_done", a.rounds),
                          "vector": ({**vector, "k": a.vector_k,
                                      "max_steers": spec["vector"]["max_steers"]}
                                     if a.vector_k else None),
                          "engine_s": round(time.time() - t0)}
        for mode, s in summary.items():
            lo, hi = s["seconds"]
            head = ("" if mode == "plain" else  # plain rows never reach the steer op
                    "; the vector engine" if mode.startswith(VECTOR_PREFIX) else
                    f"; head {'replayed from CUDA graphs' if graphs else 'launched eagerly'}")
            print(f"{'PASS' if complete else 'FAIL'} [{shape} d{cfg['hidden_size']} {a.dtype} "
                  f"{a.runner}] {mode}: {s['tokens_per_s']:.0f} tokens/s, "
                  f"{s['ratio_to_plain']:.3f}x plain (medians); fastest run "
                  f"{s['best_tokens_per_s']:.0f} tokens/s, {s['best_ratio_to_plain']:.3f}x "
                  f"plain's fastest ({s['rounds']} rounds, runs {lo:.3f}-{hi:.3f} s{head})",
                  flush=True)
        eng = result.get("engine") or {}
        print(f"  engine: start {eng.get('start_s')} s, compilation mode "
              f"{eng.get('compilation_mode')}, cudagraph_mode {eng.get('cudagraph_mode')}, "
              f"{round(time.time() - t0)} s in all", flush=True)
        if vector.get("engine"):
            veng = vector["engine"]
            print(f"  vector engine: {max(a.vector_k)} vector steers on every one of "
                  f"{cfg['num_hidden_layers']} decoder layers (op in {vector['blocks']} blocks "
                  f"per worker, the first engine's in {vector['blocks_first_engine']}), "
                  f"{spec['vector']['max_steers']} bank slots; start {veng.get('start_s')} s, "
                  f"compilation mode {veng.get('compilation_mode')}, cudagraph_mode "
                  f"{veng.get('cudagraph_mode')}; requests whose tokens the vectors changed "
                  f"(of unused's): {vector.get('rows_changed')}", flush=True)
        for line in captured:
            print(f"  engine start: {line}", flush=True)
        for line in profile_lines(result.get("profile") or {}, a.output_len + 1):
            print(line, flush=True)
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "gpu_throughput.json").write_text(json.dumps(
        {"device": a.device, "dtype": a.dtype, "runner": a.runner, "rows": a.rows,
         "vector_k": a.vector_k, "shapes": results}, indent=1))
    print(f"gpu_throughput: {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
