#!/usr/bin/env python3
"""Rehearse the GPU window on this CPU (make gpu-plan): every device call of the plan, in
order, through a stand-in for the GPU host's remote runner, with what each carries and its
estimated device time.

The stand-in (:class:`Runner`) enforces the host's limits on each call (at most 64 MiB carried,
working tree included; a command timeout of at most 600 s) and counts calls, bytes and device
seconds. It executes nothing on a GPU: the plan's commands are the ones to send. The calls:

  1. no vLLM: first the grouped capture-safe steer op beside vLLM's ``lora_shrink`` /
     ``lora_expand`` and the roofline (``benchmarks/bench_grouped_vs_lora.py``: d 4096, rank
     64, K = 1, 8, 64, 256 distinct steers over 256 and 64 rows, bf16, CUDA graphs; vLLM's two
     op files carried alone in ``build/lora_ops``, made before the window with ``python
     benchmarks/lora_ops.py carry build/lora_ops``), then the decoder layers' vector-steer op
     against its roofline (``benchmarks/bench_layer_vectors.py``: d 4096, bf16 rows, 256 bank
     slots, 256 and 64 rows and 8192 prefill tokens, K = 1, 8, 64, 256, one layer and 32, eager
     and compiled, CUDA graphs), then ``scripts/gpu_window.sh`` (kernel
     tests on CUDA, compile count after warm-up, batch invariance, capture guard, one-step-ahead
     steps after a CUDA-graph forward,
     ``auto``) and the worker's CUDA tests (the sync test in bf16 and fp32 steps; the
     staging tests run a recording fake of CUDA, on this CPU); the LoRA op files it carries
     (``build/lora_ops``) are made from the installed vLLM when missing;
  2. the lean vLLM carry, one chunk per call (``scripts/gpu_vllm_carry.py download --lean``:
     chunks of 56 MiB, less when the working tree is over 7 MiB; the last call assembles,
     installs and says which attention extensions load, ``scripts/gpu_vllm_lean.py host``);
  3. the throughput call, in the configuration the Kubernetes Deployment serves
     (deploy/kubernetes/deployment.yaml: no compilation option, so vLLM's defaults, torch.compile
     on and its default CUDA-graph mode): ``scripts/gpu_throughput.py``, steered against plain
     tokens/s in one engine at the 8B-like shape (hidden 4096, 32 layers, random weights;
     V2, bf16), 256 rows, K = 1, 64 and 256 distinct steers (256 steers of rank 64 loaded:
     the head's graphs read the bank in place, whatever its size, and replay the grouped op);
     and, in the same rounds, a second engine at that shape (the first one's steers loaded,
     never used) with 64 random vector steers on all 32 decoder layers (``--vector-k 1
     64``): loaded but unused, every row on one vector steer, and the rows over 64 distinct
     ones, each against the first engine's plain;
  4. the engine check, when the estimate still leaves room: ``scripts/gpu_vllm_check.py`` on
     Model Runner V2, bf16, vLLM's default
     compilation (the plugin's engine and stock vLLM's);
  5. the profile call, when the estimate still leaves room (not at 12 minutes):
     ``scripts/gpu_throughput.py --profile`` on the embedded model's architecture, the
     plugin's host time per run by site (every hook, the head and its parts, the per-request
     callbacks) in an in-process engine;
  6. the V1 engine check (V1 is deprecated in vLLM), when the estimate still leaves room.

If torch.compile does not run on the host's torch (vLLM 0.33.0 pins a newer one), the engine
calls stop at the engine's start; :data:`FALLBACK_COMPILATION` is what they ran with before
(no torch.compile, decode-only full CUDA graphs) and ``--fallback`` prints the plan with it.

Sizes: the working tree is measured (``git ls-files``); the wheels are measured from ``--wheels
DIR`` (after ``gpu_vllm_carry.py download --lean``) or, without it, the total recorded in
docs/dev/gpu-host.md (the lean carry: 88 wheels, 253.8 MiB, measured here; the whole carry is 115
wheels, 1083.4 MiB). Times: the constants below,
each with its source (benchmarks/RESULTS.md where measured, an estimate where not). Exit
status 0 when every call fits the limits and the total fits ``--budget-min`` (default 12: a
window is 15 minutes of device time, the machine's start and the transfers included).
Standard library only.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
from gpu_vllm_carry import CarryError, MiB, RUN_LIMIT, default_chunk, tree_bytes  # noqa: E402

CALL_LIMIT_S = 600  # the host's limit on one command
RECORDED_WHEELS_MIB = 253.8  # docs/dev/gpu-host.md: `download --lean` measured 88 wheels, 253.8 MiB
FULL_WHEELS_MIB = 1083.4  # `download` without --lean: 115 wheels, 1083.4 MiB (the fallback)
LEAN_CHUNKS = 8  # the target for the vLLM carry

# Device seconds, each with its source.
START_S = 30  # a fresh machine's start and the first tree's transfer: 30-33 s on the H100
#              (2026-11-27: the first call held 138 s for a 108 s run, and 164 s for a
#              131 s one; the device README says "a minute or more"); 28 s on the H200 (a
#              0.4 s first call)
GAP_S = 6  # between consecutive calls (warm 30 s; idle time counts): 4.5-9 s measured
UPLOAD_S_PER_MIB = 0.15  # carrying the working tree and a chunk; estimate (unmeasured)
GPU_WINDOW_S = 125  # `make gpu-window` on the H100: 124 s with its replay and head checks
#                    (131 s with the worker's CUDA tests); on the H200 92 s before the head
#                    check, 104 s with it and the worker's tests (benchmarks/RESULTS.md)
WORKER_CUDA_TESTS_S = 10  # test_syncfree's CUDA tests (bf16, fp32): under 7 s (H200)
RECEIVE_S = 3  # sha256 and copy of one 56 MiB chunk; estimate
INSTALL_S_PER_MIB = 0.14  # assemble + pip install --no-deps + the host check: 38 s for the
#                          253.8 MiB lean carry's last call (H200)
IMPORT_VLLM_S = 40  # gpu_vllm_check's own start (import vLLM, write the models, references):
#                     42 s of its 190 s (H200)
ENGINE_S = 50  # one tiny-model engine with mode 0 (no compile) and decode graphs, with its
#                requests: 44 s with the plugin, 43 s stock on the H200 (2026-11-28); 97 s and
#                51 s on the H200, 67 s and 44 s on the H100 before (benchmarks/RESULTS.md)
COMPILE_TINY_S = 40  # what vLLM's default compilation adds to a tiny model's engine with its
#                      requests (Dynamo, Inductor with a cold cache, the piecewise and full
#                      graphs' captures): 83 s with the plugin, 82 s stock on the H200
#                      (2026-11-28; torch.compile 12-13 s of it), against 44 s and 43 s
ENGINES = 2  # gpu_vllm_check per (dtype, runner): the plugin's engine and stock vLLM
THROUGHPUT_SHAPES = ("8b",)  # gpu_throughput: one engine each; the deployed model's shape
THROUGHPUT_ROWS = 256  # requests at once: K = 256 needs 256 rows to be 256 distinct steers
THROUGHPUT_K = (1, 64, 256)
THROUGHPUT_ROUNDS = 4  # 4 alternating rounds per K: with the 14 MiB working tree (the toxicity
#                        scorer's 7 MiB of weights) the carry needs a sixth chunk, and a fifth
#                        round no longer fits the 12 minutes
ENGINE_8B_S = 50  # the 8B-like engine's start with mode 0 (dummy weights, 64 random steers
#                   written and loaded): about 50 s of the 130 s for both shapes on the H200
COMPILE_8B_S = 90  # what the default compilation adds to the 8B-like engine's start (32
#                    layers traced once, 51 piecewise and 35 full sizes captured): the
#                    engine with 256 steers started in 100 s (torch.compile 20 s), and took
#                    173 s with its 24 runs on the H200 (2026-11-28)
BENCH_LAYER_VECTORS_S = 45  # bench_layer_vectors.py: the vector op at 3 token counts x 4 K x
#   (1, 32 layers) x (eager, compiled), each recorded and replayed 50 times (at most about
#   6 ms a replay: 8192 tokens x 32 layers); torch.compile traced twice (1 and 32 layers);
#   an estimate (unmeasured)
THROUGHPUT_VECTOR_K = (1, 64)  # gpu_throughput --vector-k: the vector engine's steered modes
VECTOR_ENGINE_8B_S = 105  # gpu_throughput --vector-k: the second 8B-like engine's start in vLLM's
#   default compilation, in the process where the first one runs (vLLM imported, the steers
#   written): the first engine's LLM() took 100 s on the H200 (2026-11-28: load, torch.compile
#   20 s, the graphs' captures), plus 5 s for its 64 vector steers and the op's trace (an
#   estimate); with mode 0, ENGINE_8B_S
BENCH_LORA_S = 45  # bench_grouped_vs_lora.py: 8 shapes, each op compiled, recorded and replayed
#                   50 times, the reference on the device; an estimate (unmeasured)
RUN_8B_S = 1.5  # one run of 256 rows x 128 tokens at the 8B-like shape: 1.43-1.65 s (H200)
DEFAULT_COMPILATION = None  # the Deployment passes no compilation option: vLLM's defaults
FALLBACK_COMPILATION = '{"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"}'
PROFILE_S = 65  # gpu_throughput --profile (3 rounds of 64 tokens), the embedded model's shape
#                 alone with mode 0: 65 s (H200), 54 s (H100); plus COMPILE_TINY_S compiled
# The plan's nine calls on the H200 (2026-11-28, mode 0) held the machine 567 s (9.4 min)
# against an estimate of 11.9 min. In the deployed configuration the same day, six calls (the
# first chunk carried with the kernels, the install with the throughput call) held it 597 s
# (10.0 min) against 11.8: kernels 142 s with the start (estimated 184 with the chunk), the
# throughput call with the install 221 s (231), the engine check 206 s (237).
PROFILE_ARGS = "--rounds 3 --output-len 64"  # the profile's sites are medians of 3 rounds


class PlanError(Exception):
    """A call the GPU host would refuse."""


@dataclass
class Call:
    name: str
    command: str
    carry: list[str]
    bytes: int
    timeout_s: int
    est_s: float


@dataclass
class Runner:
    """Stand-in for the GPU host's runner: the limits of one call, the totals of the plan."""

    calls: list[Call] = field(default_factory=list)
    device_s: float = 0.0

    def run(self, name: str, command: str, carry: list[str], nbytes: int, timeout_s: int,
            work_s: float) -> Call:
        if nbytes > RUN_LIMIT:
            raise PlanError(f"call {len(self.calls) + 1} ({name}) carries {nbytes / MiB:.1f} MiB, "
                            f"over the host's {RUN_LIMIT // MiB} MiB per call; split it")
        if timeout_s > CALL_LIMIT_S:
            raise PlanError(f"call {len(self.calls) + 1} ({name}) asks a {timeout_s} s timeout, "
                            f"over the host's {CALL_LIMIT_S} s per call; split it")
        est = (START_S if not self.calls else GAP_S) + nbytes / MiB * UPLOAD_S_PER_MIB + work_s
        call = Call(name, command, carry, nbytes, timeout_s, est)
        self.calls.append(call)
        self.device_s += est
        return call


LORA_OPS_DIR = "build/lora_ops"  # vLLM's LoRA op files (benchmarks/lora_ops.py carry)


def ensure_lora_ops() -> None:
    """Make :data:`LORA_OPS_DIR` from the installed vLLM when it is missing (the first call
    carries it: the GPU host has no vLLM, and a carried path missing here is removed there, so
    the grouped-vs-LoRA table would be lost); refused when there is no vLLM to copy it from."""
    folder = ROOT / LORA_OPS_DIR
    if folder.is_dir():
        return
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import lora_ops
    finally:
        sys.path.pop(0)
    if lora_ops.installed_dir() is None:
        raise PlanError(f"{LORA_OPS_DIR} is missing and no installed vLLM has its LoRA op files "
                        "to copy: run `python benchmarks/lora_ops.py carry build/lora_ops` "
                        "where vLLM is installed, then plan again")
    lora_ops.carry(folder)
    print(f"# gpu_plan: made {LORA_OPS_DIR} from the installed vLLM (the first call carries it)")


def lora_ops_bytes() -> int:
    """Bytes of the carried LoRA op files: the folder when made, else the installed vLLM's
    five files (without importing vLLM), else 64 KiB (their size in vLLM 0.32: 51 KiB)."""
    folder = ROOT / LORA_OPS_DIR
    if folder.is_dir():
        return sum(f.stat().st_size for f in folder.iterdir())
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    if spec and spec.submodule_search_locations:
        d = Path(list(spec.submodule_search_locations)[0]) / "lora" / "ops" / "triton_ops"
        names = ("kernel_utils.py", "utils.py", "lora_kernel_metadata.py", "lora_shrink_op.py",
                 "lora_expand_op.py")
        if all((d / n).exists() for n in names):
            return sum((d / n).stat().st_size for n in names)
    return 64 << 10


def wheel_bytes(wheels: str | None) -> tuple[int, str]:
    if wheels:
        files = sorted(Path(wheels).glob("*.whl"))
        return sum(f.stat().st_size for f in files), f"{len(files)} wheels in {wheels} (measured)"
    return (int(RECORDED_WHEELS_MIB * MiB),
            f"{RECORDED_WHEELS_MIB} MiB (recorded, docs/dev/gpu-host.md)")


def plan(wheels: str | None = None, chunk: int | None = None,
         budget_s: float = 12 * 60,
         compilation: str | None = DEFAULT_COMPILATION) -> tuple[Runner, dict]:
    """The calls in order. ``compilation``: the engines' ``--compilation-config`` (None:
    vLLM's defaults, as the Deployment runs)."""
    tree = tree_bytes()
    chunk = default_chunk(tree) if chunk is None else chunk
    r = Runner()
    ensure_lora_ops()
    lora = lora_ops_bytes()
    r.run("kernels, no vLLM: the grouped op beside lora_shrink/lora_expand, the vector op, "
          "then the window",
          "python3 benchmarks/bench_grouped_vs_lora.py --device cuda --lora-ops build/lora_ops; "
          "b=$?; python3 benchmarks/bench_layer_vectors.py --device cuda; v=$?; "
          "bash scripts/gpu_window.sh; w=$?; python3 -m pytest -q -p no:cacheprovider "
          "tests/integrations/worker/test_syncfree.py -k cuda; exit $((b | v | w | $?))",
          [LORA_OPS_DIR], tree + lora, 360,
          BENCH_LORA_S + BENCH_LAYER_VECTORS_S + GPU_WINDOW_S + WORKER_CUDA_TESTS_S)
    total, source = wheel_bytes(wheels)
    n = max(1, math.ceil(total / chunk))
    me = "python3 scripts/gpu_vllm_carry.py"
    for i in range(n):
        size = min(chunk, total - i * chunk)
        cmd = f"{me} receive .carry/c{i:03d} --area /tmp/vllm_carry"
        work = RECEIVE_S
        if i == n - 1:
            cmd += (f" && {me} assemble --area /tmp/vllm_carry --dest /tmp/vllm_whl "
                    "--install /tmp/site && PYTHONPATH=/tmp/site python3 "
                    "scripts/gpu_vllm_lean.py host")
            work += total / MiB * INSTALL_S_PER_MIB
        r.run(f"carry {i + 1}/{n}", cmd, [f".carry/c{i:03d}"], tree + size, 120, work)
    compiled = compilation is None
    cfg_arg = "" if compiled else f" --compilation-config '{compilation}'"
    label = "vLLM's default compilation" if compiled else "mode 0, FULL_DECODE_ONLY"
    compile_s = COMPILE_TINY_S if compiled else 0
    # the throughput call first: the goal's figure (steered >= 0.995 of plain at the 8B shape)
    # two engines per shape (LM-Steer's and the vector steers'), every mode in each round:
    # plain, K..., vector unused, vector K...
    modes = 1 + len(THROUGHPUT_K) + 1 + len(THROUGHPUT_VECTOR_K)
    runs = (1 + THROUGHPUT_ROUNDS) * modes
    work = len(THROUGHPUT_SHAPES) * (ENGINE_8B_S + (COMPILE_8B_S if compiled else 0)
                                     + (VECTOR_ENGINE_8B_S if compiled else ENGINE_8B_S)
                                     + runs * RUN_8B_S)
    r.run(f"throughput: V2 bf16, {label}, steered vs plain tokens/s, LM-Steer and vector "
          "steers",
          "PYTHONPATH=/tmp/site python3 scripts/gpu_throughput.py --device cuda "
          f"--dtype bfloat16 --runner v2 --shapes {' '.join(THROUGHPUT_SHAPES)} "
          f"--rows {THROUGHPUT_ROWS} --k {' '.join(map(str, THROUGHPUT_K))} "
          f"--vector-k {' '.join(map(str, THROUGHPUT_VECTOR_K))} "
          f"--rounds {THROUGHPUT_ROUNDS} --engine-timeout 520{cfg_arg}",
          [], tree, 580, work)

    def engine_check(runner: str) -> None:
        r.run(f"engine: {runner.upper()} bf16, {label}",
              "PYTHONPATH=/tmp/site python3 scripts/gpu_vllm_check.py --device cuda "
              f"--dtypes bfloat16 --runners {runner} --engine-timeout 240{cfg_arg}",
              [], tree, ENGINES * 240 + 60, IMPORT_VLLM_S + ENGINES * (ENGINE_S + compile_s))

    # then, while the budget allows: the V2 engine check (V2 is the GPU default; it passed in
    # full in the 2026-11-28 window), the profile, and V1 (deprecated)
    if r.device_s + GAP_S + IMPORT_VLLM_S + ENGINES * (ENGINE_S + compile_s) <= budget_s:
        engine_check("v2")
    profile_s = PROFILE_S + compile_s
    if r.device_s + GAP_S + profile_s <= budget_s:
        r.run(f"profile: V2 bf16, {label}, the plugin's host time per run by site",
              "PYTHONPATH=/tmp/site python3 scripts/gpu_throughput.py --device cuda "
              "--dtype bfloat16 --runner v2 --rows 64 --k 1 64 --engine-timeout 240 "
              f"--shapes smollm2 --profile {PROFILE_ARGS}{cfg_arg}", [], tree, 300, profile_s)
    if r.device_s + GAP_S + IMPORT_VLLM_S + ENGINES * (ENGINE_S + compile_s) <= budget_s:
        engine_check("v1")
    return r, {"tree_bytes": tree, "wheel_bytes": total, "wheels": source, "chunks": n,
               "chunk_bytes": chunk}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--wheels", default=None, help="the carried wheels' folder (sizes measured)")
    ap.add_argument("--chunk-mib", type=float, default=None,
                    help="chunk size (default: what `gpu_vllm_carry.py split` picks for this tree)")
    ap.add_argument("--budget-min", type=float, default=12.0,
                    help="device minutes (default 14: the 15 a task is lent at present, less "
                         "one for the estimates' error)")
    ap.add_argument("--json", default=None, help="also write the plan as JSON here")
    ap.add_argument("--fallback", action="store_true",
                    help=f"the engines with {FALLBACK_COMPILATION} (torch.compile not run), "
                         "for a host where vLLM's default compilation does not start")
    a = ap.parse_args(argv)
    try:
        r, info = plan(a.wheels, None if a.chunk_mib is None else int(a.chunk_mib * MiB),
                       a.budget_min * 60, FALLBACK_COMPILATION if a.fallback else None)
    except (PlanError, CarryError) as e:
        print(f"gpu_plan: REFUSED: {e}")
        return 1
    print(f"# gpu_plan: working tree {info['tree_bytes'] / MiB:.1f} MiB; wheels {info['wheels']} "
          f"-> {info['chunks']} chunks of {info['chunk_bytes'] / MiB:g} MiB")
    for i, c in enumerate(r.calls, 1):
        print(json.dumps({"call": i, "name": c.name, "carry": c.carry,
                          "mib": round(c.bytes / MiB, 1), "timeout_s": c.timeout_s,
                          "est_s": round(c.est_s), "command": c.command}))
    fits = r.device_s <= a.budget_min * 60
    lean = info["chunks"] <= LEAN_CHUNKS
    print(f"# calls {len(r.calls)}, carried {sum(c.bytes for c in r.calls) / MiB:.1f} MiB, "
          f"largest call {max(c.bytes for c in r.calls) / MiB:.1f} MiB (limit {RUN_LIMIT // MiB}), "
          f"longest timeout {max(c.timeout_s for c in r.calls)} s (limit {CALL_LIMIT_S})")
    print(f"# estimated device time {r.device_s / 60:.1f} min of {a.budget_min:g}: "
          f"{'FITS' if fits else 'OVER'}")
    print(f"# vLLM carry {info['chunks']} chunks (lean target {LEAN_CHUNKS}): "
          f"{'MET' if lean else 'NOT MET: download --lean, then --wheels .whl'}")
    print(f"# if the engine call stops on a ModuleNotFoundError of a package left behind: carry "
          f"everything (download without --lean: {FULL_WHEELS_MIB} MiB, "
          f"{math.ceil(FULL_WHEELS_MIB * MiB / info['chunk_bytes'])} chunks)")
    if not a.fallback:
        print(f"# if an engine stops at its start under torch.compile (the host's torch is older "
              f"than vLLM's pin): the same calls with --compilation-config "
              f"'{FALLBACK_COMPILATION}' (python3 scripts/gpu_plan.py --fallback)")
    if a.json:
        Path(a.json).write_text(json.dumps({**info, "device_s": r.device_s, "calls": [
            c.__dict__ for c in r.calls]}, indent=1))
    return 0 if fits else 1


if __name__ == "__main__":
    sys.exit(main())
