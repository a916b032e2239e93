"""benchmarks/bench_v2_sample.py: its table, from a short run (a few calls, a small eviction)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HOOKS = ["plugin", "pass-through", "check", "binding by of()", "input_batch by Arg.get",
         "batch bytes", "binding inline", "inline, request ids"]


def test_the_table_has_every_hook_timed_against_the_pass_through():
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_v2_sample.py"),
                          "--calls", "5", "--evict-mib", "1", "--parts"],
                         capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, TRITON_INTERPRET="1"))
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()  # after vLLM's own log lines
    lines = lines[next(i for i, ln in enumerate(lines) if ln.startswith("V2 sample hook")):]
    assert lines[0] == ("V2 sample hook, steady steered batch of 16, 5 calls each, "
                        "1 MiB written before each call")
    rows = {}
    for line in lines[2:]:
        name, *nums = line.rsplit(None, 3)
        rows[name.strip()] = [float(x) for x in nums]
    assert list(rows) == HOOKS
    assert all(med > 0 and p25 > 0 for med, p25, _ in rows.values())
    assert rows["pass-through"][2] == 0.0
    for name, (med, _, over) in rows.items():  # each row: its median less the pass-through's
        assert abs(over - (med - rows["pass-through"][0])) < 0.011, name
