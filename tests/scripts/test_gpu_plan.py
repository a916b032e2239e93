"""scripts/gpu_plan.py (make gpu-plan): the GPU window's plan, rehearsed through a stand-in for
the GPU host's runner, fits the host's limits (64 MiB carried per call, 600 s per command) and
12 minutes of device time, with the engines in the deployed configuration (vLLM's
default compilation); a call over a limit is refused, naming it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_plan.py"
MiB = 1 << 20


def run(*args):
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True,
                          text=True, timeout=120, cwd=ROOT)


def calls_of(stdout: str) -> list[dict]:
    return [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]


def saved_chunks(tmp_path) -> int:
    return json.loads((tmp_path / "plan.json").read_text())["chunks"]


def test_the_plan_fits_the_hosts_limits_and_twelve_minutes(tmp_path):
    res = run("--json", tmp_path / "plan.json")
    assert res.returncode == 0, res.stdout + res.stderr
    calls = calls_of(res.stdout)
    assert calls[0]["name"].startswith("kernels") and "gpu_window.sh" in calls[0]["command"]
    assert "test_syncfree.py -k cuda" in calls[0]["command"]
    assert "vllm" not in calls[0]["command"]
    # the LoRA op files the first call carries exist here, or the plan made them (a carried
    # path missing here is removed on the device, and the table with it)
    assert (ROOT / "build" / "lora_ops" / "lora_shrink_op.py").is_file()
    # first of all, the grouped op beside vLLM's LoRA kernels, carried alone
    assert calls[0]["command"].startswith("python3 benchmarks/bench_grouped_vs_lora.py "
                                          "--device cuda --lora-ops build/lora_ops;")
    assert calls[0]["carry"] == ["build/lora_ops"]
    # then the decoder layers' vector op alone, before the window
    cmd = calls[0]["command"]
    assert "python3 benchmarks/bench_layer_vectors.py --device cuda; v=$?;" in cmd
    assert cmd.index("bench_layer_vectors") < cmd.index("gpu_window.sh")
    assert "exit $((b | v | w | $?))" in cmd
    # the engine check (it passed in full in an earlier window) only where it fits: not in 12
    assert not [c for c in calls if c["name"].startswith("engine")]
    engines = [c for c in calls if c["name"].startswith(("throughput", "profile"))]
    throughput = calls[-1]  # last: the profile no longer fits in 12 minutes beside the vectors
    assert throughput["name"].startswith("throughput")
    for c in engines:  # the deployed configuration: vLLM's default compilation
        assert "--compilation-config" not in c["command"] and "--enforce-eager" not in c["command"]
    for arg in ("gpu_throughput.py --device cuda", "--shapes 8b", "--dtype bfloat16",
                "--runner v2", "--rows 256", "--k 1 64 256", "--vector-k 1 64"):
        assert arg in throughput["command"], arg
    assert not [c for c in calls if c["name"].startswith("profile")]
    assert "assemble" in calls[-2]["command"] and "gpu_vllm_lean.py host" in calls[-2]["command"]
    assert saved_chunks(tmp_path) <= 8  # the lean carry
    assert all(c["mib"] <= 64 for c in calls), [c["mib"] for c in calls]
    assert all(c["timeout_s"] <= 600 for c in calls)
    saved = json.loads((tmp_path / "plan.json").read_text())
    assert saved["device_s"] <= 12 * 60 and saved["device_s"] == sum(
        c["est_s"] for c in saved["calls"])
    # the kernels, the carry and the throughput
    assert len(calls) == 2 + saved["chunks"]
    assert "FITS" in res.stdout


def test_a_call_over_64_mib_is_refused_naming_it():
    res = run("--chunk-mib", 63)  # 63 MiB of wheels + the working tree
    assert res.returncode == 1
    assert "REFUSED" in res.stdout and "over the host's 64 MiB per call" in res.stdout
    assert "carry 1/" in res.stdout


def test_measured_wheels_set_the_chunks(tmp_path):
    for i, n in enumerate((30 * MiB, 50 * MiB, 40 * MiB)):
        with open(tmp_path / f"w{i}-1.0-py3-none-any.whl", "wb") as f:
            f.truncate(n)
    res = run("--wheels", tmp_path)
    assert res.returncode == 0, res.stdout
    assert "3 wheels in" in res.stdout and "-> 3 chunks" in res.stdout  # 120 MiB / 56
    assert "lean target 8): MET" in res.stdout


def test_a_tight_budget_keeps_the_throughput_call_only():
    res = run("--budget-min", 8)
    calls = calls_of(res.stdout)
    assert calls[-1]["name"].split(",")[0] == "throughput: V2 bf16"
    assert not any(c["name"].startswith("engine") for c in calls)
    assert not any(c["name"].startswith("profile") for c in calls)
    assert res.returncode == 1 and "OVER" in res.stdout  # and says it does not fit


def test_a_larger_budget_keeps_the_profile_and_the_v1_check_after_them():
    res = run("--budget-min", 22)
    names = [c["name"].split(":")[0] + " " + c["name"].split()[1] for c in calls_of(res.stdout)
             if c["name"].startswith(("engine", "throughput", "profile"))]
    assert names == ["throughput V2", "engine V2", "profile V2", "engine V1"]


def test_the_fallback_runs_the_engines_without_torch_compile_and_leaves_room():
    res = run("--fallback")
    assert res.returncode == 0, res.stdout
    calls = calls_of(res.stdout)
    engines = [c for c in calls if c["name"].startswith(("engine", "throughput", "profile"))]
    assert engines and all('"mode": 0' in c["command"] and "FULL_DECODE_ONLY" in c["command"]
                           for c in engines)
    assert "--rows 256 --k 1 64 256 --vector-k 1 64" in engines[0]["command"]


def test_a_larger_working_tree_gets_smaller_chunks_and_a_huge_one_is_refused(monkeypatch):
    sys.path.insert(0, str(ROOT / "scripts"))
    import gpu_plan
    import gpu_vllm_carry

    monkeypatch.setattr(gpu_plan, "tree_bytes", lambda: 20 * MiB)
    r, info = gpu_plan.plan()
    assert (info["chunk_bytes"] == 43 * MiB
            and info["chunks"] == -(-info["wheel_bytes"] // (43 * MiB)))
    assert max(c.bytes for c in r.calls) <= 63 * MiB
    monkeypatch.setattr(gpu_plan, "tree_bytes", lambda: 60 * MiB)
    with pytest.raises(gpu_vllm_carry.CarryError, match="the working tree is 60.0 MiB"):
        gpu_plan.plan()
