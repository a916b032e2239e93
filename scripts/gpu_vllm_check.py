#!/usr/bin/env python3
"""The plugin inside a real vLLM engine, checked against plain torch: the GPU correctness check.

For every dtype x model runner asked for, two engines on a tiny random Llama made on the fly
(saved under --workdir, default a temporary folder), with random steers at its hidden size:

  * the plugin loaded: one mixed batch (steered, unsteered and composed requests of different
    prompt lengths and max_tokens, so rows join and leave at different steps), then each of
    those requests alone;
  * stock vLLM (``VLLM_PLUGINS=none``): the same prompts, unsteered, in one batch.

Checked, per request (greedy, logprobs of the sampled tokens):

  1. steered and unsteered rows: each sampled token's logprob equals the paper's formula applied
     by hand in plain torch on the model's own weights (``HFReference`` of
     tests/helpers/reference.py, fp32)
     to within --tol for that dtype, and the token is the reference's argmax wherever the
     reference's top-2 margin exceeds twice the tolerance;
  2. unsteered rows of the mixed batch get exactly stock vLLM's tokens (logprobs within tol);
  3. every request gets exactly the same tokens in the mixed batch as alone (logprobs within
     tol).

On CUDA, per engine with the plugin: its LM head captured its CUDA graphs while it started
(the engine log's line), and no capture failed.

On ``--device cuda`` the engines run as users run them: CUDA graphs (enforce_eager False) and
async scheduling on, Model Runner V2 (``v2``) or V1 (``v1``, ``VLLM_USE_V2_MODEL_RUNNER=0``).
On ``--device cpu`` (the reduced form run by tests/scripts/test_gpu_vllm_check.py) the engines are
eager, V2 runs through the test shim tests/v2shim, and ``--cpu-async`` keeps async scheduling
on through the same shim (``STEER_TEST_ASYNC_SHIM=1``; vLLM's CPU platform turns it off).

Writes ``OUT/gpu_vllm_check.json`` (every comparison) and prints one line per check; exit
status 0 when all pass. Semantics of the steer: see vllm_steer/reference.py.

    python scripts/gpu_vllm_check.py --device cuda                      # bf16+fp32, V2+V1
    python scripts/gpu_vllm_check.py --device cpu --dtypes float32 --runners v1
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHIM = ROOT / "tests" / "v2shim"
PROMPTS = ["Hello there, my name is", "The weather today", "Once upon a time in a land far",
           "Q: What is two plus two?\nA:", "In the beginning"]
# (steer strengths or None, max_tokens): rows of different lengths join and leave apart
REQUESTS = [({"a": 5}, 6), (None, 9), ({"b": -6}, 4), ({"a": 2, "b": 3}, 7), (None, 3)]
TOL = {"float32": 2e-3, "bfloat16": 0.15, "float16": 0.05}


def _setup_kwargs() -> dict:
    """The package's name, version and entry points, read from setup.py (not run)."""
    import ast

    tree = ast.parse((ROOT / "setup.py").read_text())
    call = next(n for n in ast.walk(tree) if isinstance(n, ast.Call)
                and getattr(n.func, "id", None) == "setup")
    return {k.arg: ast.literal_eval(k.value) for k in call.keywords
            if k.arg in ("name", "version", "entry_points")}


def plugin_metadata(where: Path) -> Path:
    """A folder holding the package's metadata (``*.dist-info``: its name, version and entry
    points), to put on the engines' path where the package is not installed: vLLM finds
    plugins only through their ``vllm.general_plugins`` entry point, and without it the
    engine serves every request unsteered (``extra_args`` it does not know are ignored)."""
    kw = _setup_kwargs()
    dist = where / f"{kw['name'].replace('-', '_')}-{kw['version']}.dist-info"
    dist.mkdir(parents=True, exist_ok=True)
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {kw['name']}\n"
                                   f"Version: {kw['version']}\n")
    (dist / "entry_points.txt").write_text("".join(
        f"[{group}]\n" + "".join(f"{line}\n" for line in lines) + "\n"
        for group, lines in kw["entry_points"].items()))
    return where


def _importable(env: dict, code: str) -> bool:
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          timeout=120).returncode == 0


_FIND_PLUGIN = ("import sys, importlib.metadata as m; sys.exit(not any(e.name == 'vllm_steer' "
                "for e in m.entry_points(group='vllm.general_plugins')))")


def plugin_path(env: dict, where: Path) -> Path | None:
    """None where a Python run with ``env`` finds the plugin's ``vllm.general_plugins`` entry
    point; else :func:`plugin_metadata` written to ``where``, the folder to put on its path
    (also run by scripts/gpu_check.sh)."""
    return None if _importable(env, _FIND_PLUGIN) else plugin_metadata(where)


def _pythonpath(path: list[str], env: dict) -> str:
    return os.pathsep.join(path + [p for p in [env.get("PYTHONPATH")] if p])


def engine_env(a, runner: str, plugin: bool) -> dict:
    """The environment of one engine: the model runner, the plugin (its entry point found, or
    the plugin left out: ``VLLM_PLUGINS=none``), the test shims on a CPU (where stock vLLM
    runs in-process, ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, to start faster); on CUDA without
    FlashInfer (a lean vLLM carry), vLLM's FlashInfer sampler off."""
    env = dict(os.environ)
    env["VLLM_USE_V2_MODEL_RUNNER"] = "1" if runner == "v2" else "0"
    if not plugin:
        env["VLLM_PLUGINS"] = "none"
    path = [str(ROOT)]
    if plugin:
        where = plugin_path({**env, "PYTHONPATH": _pythonpath(path, env)},
                            Path(getattr(a, "workdir", None)
                                 or tempfile.mkdtemp(prefix="steer-meta-")) / "steer_meta")
        if where is not None:
            print(f"  the package is not installed here: its entry points from {where}",
                  flush=True)
            path.append(str(where))
    if a.device == "cuda" and "VLLM_USE_FLASHINFER_SAMPLER" not in env \
            and not _importable(env, "import flashinfer"):
        env["VLLM_USE_FLASHINFER_SAMPLER"] = "0"  # V2's sampler imports it at start-up
    if a.device == "cpu":
        if not plugin:  # stock vLLM inside its one process: no engine-core and worker spawns
            env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        if runner == "v2":
            env["STEER_TEST_V2_SHIM"] = "1"
            env["TRITON_INTERPRET"] = "1"
        if a.cpu_async:
            env["STEER_TEST_ASYNC_SHIM"] = "1"
        if runner == "v2" or a.cpu_async:
            path.insert(0, str(SHIM))
    env["PYTHONPATH"] = _pythonpath(path, env)
    env["PYTHONUNBUFFERED"] = "1"
    return env


# ---------------------------------------------------------------------- engine (subprocess)

def run_engine(a) -> int:
    from vllm import LLM, SamplingParams

    spec = json.loads(a.spec)
    kw = dict(dtype=spec["dtype"], max_model_len=256, max_num_seqs=8, seed=0,
              enforce_eager=spec["device"] == "cpu", async_scheduling=spec["async"])
    if spec["device"] == "cpu":
        kw["kv_cache_memory_bytes"] = 1 << 28
    else:
        kw["gpu_memory_utilization"] = 0.3
    if spec.get("compilation_config"):
        kw["compilation_config"] = spec["compilation_config"]
    if spec["plugin"]:
        kw["additional_config"] = {"vllm_steer": {"steers": spec["steers"]}}
    t_start = time.perf_counter()
    llm = LLM(spec["model"], **kw)
    cfg = llm.llm_engine.vllm_config
    info = {"plugin_loaded": "vllm_steer.integrations.plugin" in sys.modules,
            "async_scheduling": bool(cfg.scheduler_config.async_scheduling),
            "compilation_mode": str(getattr(cfg.compilation_config, "mode", None)),
            "cudagraph_mode": str(cfg.compilation_config.cudagraph_mode),
            "start_s": round(time.perf_counter() - t_start, 1),
            "v2_runner": bool(getattr(cfg, "use_v2_model_runner", False))}

    def sp(steer, n):
        return SamplingParams(temperature=0, max_tokens=n, logprobs=0, ignore_eos=True,
                              extra_args=None if steer is None else {"steer": steer})

    def outs(prompts, params):
        res = []
        for o in llm.generate(prompts, params, use_tqdm=False):
            c = o.outputs[0]
            res.append({"prompt_ids": list(o.prompt_token_ids), "tokens": list(c.token_ids),
                        "logprobs": [e[t].logprob
                                     for e, t in zip(c.logprobs, c.token_ids, strict=False)]})
        return res

    reqs = [(p, s, n) for p, (s, n) in zip(PROMPTS, REQUESTS, strict=False)]
    result = {"info": info}
    if spec["plugin"]:
        result["mixed"] = outs([p for p, _, _ in reqs], [sp(s, n) for _, s, n in reqs])
        result["alone"] = [outs([p], [sp(s, n)])[0] for p, s, n in reqs]
    else:
        result["stock"] = outs([p for p, _, _ in reqs], [sp(None, n) for _, _, n in reqs])
    Path(a.result).write_text(json.dumps(result))
    return 0


# ------------------------------------------------------------------------------ main (parent)

def spawn(a, spec: dict, tag: str) -> dict:
    out = Path(a.workdir) / f"{tag}.json"
    cmd = [sys.executable, str(Path(__file__).resolve()), "_engine", "--spec", json.dumps(spec),
           "--result", str(out)]
    env = engine_env(a, spec["runner"], spec["plugin"])
    t0 = time.time()
    with open(Path(a.workdir) / f"{tag}.log", "w") as log:
        rc = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                            timeout=a.engine_timeout).returncode
    print(f"  engine {tag}: exit {rc} in {time.time() - t0:.0f}s (log {a.workdir}/{tag}.log)",
          flush=True)
    if rc != 0:
        tail = (Path(a.workdir) / f"{tag}.log").read_text()[-3000:]
        raise RuntimeError(f"engine {tag} failed (exit {rc}):\n{tail}")
    return json.loads(out.read_text())


def compare(a, dtype: str, runner: str, ref, on: dict, off: dict) -> list[dict]:
    tol = a.tol if a.tol is not None else TOL[dtype]
    checks = []

    def check(name, ok, **detail):
        checks.append({"dtype": dtype, "runner": runner, "check": name, "ok": bool(ok), **detail})

    for i, (steer, _n) in enumerate(REQUESTS):
        row, alone, stock = on["mixed"][i], on["alone"][i], off["stock"][i]
        ids = row["prompt_ids"] + row["tokens"]
        lp = ref.logprobs(ids, steer)
        n0 = len(row["prompt_ids"])
        errs, bad_tokens = [], []
        for j, (t, got) in enumerate(zip(row["tokens"], row["logprobs"], strict=False)):
            r = lp[n0 - 1 + j]
            errs.append(abs(got - float(r[t])))
            top2 = r.topk(2).values
            if float(top2[0] - top2[1]) > 2 * tol and t != int(r.argmax()):
                bad_tokens.append(j)
        kind = "steered" if steer else "unsteered"
        check(f"{kind} row {i} {steer or {}}: logprobs = plain-torch formula",
              max(errs) <= tol and not bad_tokens, max_abs_err=max(errs), tol=tol,
              tokens_off_reference=bad_tokens)
        if steer is None:
            d = max(abs(x - y) for x, y in zip(row["logprobs"], stock["logprobs"], strict=False))
            check(f"unsteered row {i}: tokens = stock vLLM (no plugin)",
                  row["tokens"] == stock["tokens"] and d <= tol, max_abs_err=d,
                  tokens=row["tokens"], stock=stock["tokens"])
        d = max(abs(x - y) for x, y in zip(row["logprobs"], alone["logprobs"], strict=False))
        check(f"{kind} row {i}: mixed batch = alone", row["tokens"] == alone["tokens"]
              and d <= tol, max_abs_err=d, mixed=row["tokens"], alone=alone["tokens"])
    # the steers must move the logprobs by more than the tolerance, or 1. proves nothing
    row = on["mixed"][0]
    ids = row["prompt_ids"] + row["tokens"]
    n0 = len(row["prompt_ids"])
    moved = float((ref.logprobs(ids, REQUESTS[0][0]) - ref.logprobs(ids))[n0 - 1:].abs().max())
    check("the steer moves logprobs by more than the tolerance", moved > 10 * tol,
          moved=moved, tol=tol)
    return checks


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"],
                    choices=sorted(TOL))
    ap.add_argument("--runners", nargs="+", default=["v2", "v1"], choices=["v2", "v1"])
    ap.add_argument("--cpu-async", action="store_true",
                    help="on --device cpu: async scheduling on through tests/v2shim")
    ap.add_argument("--tol", type=float, default=None,
                    help=f"logprob tolerance (default per dtype: {TOL})")
    ap.add_argument("--workdir", default=None, help="model, steers, engine logs (default: tmp)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."), help="where the JSON goes")
    ap.add_argument("--engine-timeout", type=int, default=900)
    ap.add_argument("--compilation-config", type=json.loads, default=None, metavar="JSON",
                    help='vLLM compilation_config of every engine, e.g. \'{"mode": 0, '
                         '"cudagraph_mode": "FULL_DECODE_ONLY"}\' (default: vLLM\'s)')
    sub = ap.add_subparsers(dest="cmd")
    e = sub.add_parser("_engine", help="(internal) one engine in this process")
    e.add_argument("--spec", required=True)
    e.add_argument("--result", required=True)
    a = ap.parse_args(argv)
    if a.cmd == "_engine":
        return run_engine(a)

    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "tests"))
    from helpers.models import make_tiny_llama
    from helpers.reference import HFReference
    from helpers.steers import random_steer, save_steers

    a.workdir = a.workdir or tempfile.mkdtemp(prefix="gpu_vllm_check-")
    work = Path(a.workdir)
    work.mkdir(parents=True, exist_ok=True)
    model = work / "tiny-llama"
    if not (model / "config.json").exists():
        make_tiny_llama(model)
    steers = {"a": random_steer(64, 8, "a", seed=1, scale=3.0),
              "b": random_steer(64, 8, "b", seed=2, scale=3.0)}
    paths = save_steers(work, steers)
    ref = HFReference(model, steers)
    use_async = a.device == "cuda" or a.cpu_async
    print(f"gpu_vllm_check: device {a.device}, dtypes {a.dtypes}, runners {a.runners}, "
          f"async scheduling {'on' if use_async else 'off'}, work in {work}", flush=True)
    checks, infos = [], {}
    for dtype in a.dtypes:
        for runner in a.runners:
            spec = {"model": str(model), "dtype": dtype, "runner": runner, "device": a.device,
                    "async": use_async, "steers": paths,
                    "compilation_config": a.compilation_config}
            on = spawn(a, {**spec, "plugin": True}, f"{dtype}-{runner}-plugin")
            off = spawn(a, {**spec, "plugin": False}, f"{dtype}-{runner}-stock")
            infos[f"{dtype}-{runner}"] = on["info"]
            checks.append({"dtype": dtype, "runner": runner, "check": "engine settings as asked",
                           "ok": on["info"]["async_scheduling"] == use_async
                           and on["info"]["v2_runner"] == (runner == "v2")
                           and on["info"]["plugin_loaded"]
                           and not off["info"]["plugin_loaded"], **on["info"],
                           "stock_start_s": off["info"].get("start_s")})
            if a.device == "cuda":  # the head's own graphs, captured while the engine started
                lines = (work / f"{dtype}-{runner}-plugin.log").read_text().splitlines()
                captured = [line.split("vllm-steer: ", 1)[-1] for line in lines
                            if "CUDA graph(s) of the LM head's steer op" in line]
                failed = [line.split("vllm-steer: ", 1)[-1] for line in lines
                          if "launched eagerly from now on" in line]
                checks.append({"dtype": dtype, "runner": runner,
                               "check": "the head's CUDA graphs captured at start-up",
                               "ok": bool(captured) and not failed, "captured": captured,
                               "failed": failed})
            checks += compare(a, dtype, runner, ref, on, off)
    for c in checks:
        detail = {k: v for k, v in c.items() if k not in ("dtype", "runner", "check", "ok")}
        print(f"{'PASS' if c['ok'] else 'FAIL'} [{c['dtype']} {c['runner']}] {c['check']}  "
              f"{json.dumps(detail)}")
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "gpu_vllm_check.json").write_text(json.dumps(
        {"device": a.device, "engines": infos, "checks": checks}, indent=1))
    bad = sum(not c["ok"] for c in checks)
    print(f"gpu_vllm_check: {len(checks) - bad} passed, {bad} failed")
    return 0 if bad == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
