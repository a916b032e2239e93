"""scripts/gpu_window.py's dry run (no CUDA): the replay check runs the LM head's graph path
with a stand-in graph on the CPU, reports host microseconds launched and replayed, and checks
the replayed rows against the reference; the head check does the same through the worker's
head, with its parts, and checks that no step captures."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_dry_run_runs_the_replay_check_and_writes_its_lines(tmp_path):
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    res = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_window.py"), "--dry-run",
                          "--skip", "invariance", "async", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert res.returncode == 0, res.stdout + res.stderr
    lines = (tmp_path / "gpu_window_results.txt").read_text().splitlines()
    timed = [line for line in lines if line.startswith("replay") and "host" in line]
    assert len(timed) == 2, lines  # rows 1 and 5
    for line in timed:
        m = re.search(r"host ([\d.]+) us launched \((\w+)\), ([\d.]+) us replayed", line)
        assert m and float(m[1]) > 0 and float(m[3]) > 0 and m[2] == "torch", line
        assert "not the goal's figure" in line
    assert sum("replayed rows match the reference: PASS" in line for line in lines) == 2
    assert "capture: SKIP: needs CUDA" in res.stdout and lines[-1] == "gpu_window checks: PASS"
    # the head check: the worker's steady step, its parts, its rows, and no capture by a step
    head = [line for line in lines if line.startswith("head") and "host" in line]
    assert len(head) == 2, lines  # rows 1 and 5
    for line in head:
        m = re.search(r"host ([\d.]+) us per steered step warm, ([\d.]+) us with cold caches "
                      r".*graphs.run ([\d.]+).*the rest (-?[\d.]+)\); replayed from a stand-in",
                      line)
        assert m and all(float(m[i]) > 0 for i in (1, 2, 3)), line
    assert sum("steered rows match the reference: PASS" in line for line in lines) == 2
    assert "head d64 r8: 0 graph(s) captured by the steps (captured at start-up: 4): PASS" in lines


def test_the_async_check_runs_without_vllm_as_on_the_gpu_host(tmp_path):
    """The GPU host has no vLLM: the async check (the worker's steps, no engine) must not
    import it. vLLM is hidden from the dry run as it is absent there; a steered step that
    imported it served its rows unsteered and the check failed."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import importlib.abc, sys\n"
        "class NoVllm(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] == 'vllm':\n"
        "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
        "sys.meta_path.insert(0, NoVllm())\n")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=f"{site}{os.pathsep}{ROOT}")
    res = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_window.py"), "--dry-run",
                          "--skip", "invariance", "replay", "head", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    lines = (tmp_path / "gpu_window_results.txt").read_text().splitlines()
    assert res.returncode == 0, "\n".join(lines) + res.stderr[-3000:]
    assert "No module named 'vllm'" not in res.stdout + res.stderr
    assert [line for line in lines if line.startswith("async")], lines
    assert not [line for line in lines if "FAIL" in line], lines
