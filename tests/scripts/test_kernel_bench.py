"""benchmarks/kernel_bench.py: what its table tells a reader (tiny shapes, fast)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import kernel_bench  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture(autouse=True)
def _keep_threads():
    n = torch.get_num_threads()  # --threads sets it for the whole process
    yield
    torch.set_num_threads(n)

TINY = ["--device", "cpu", "--threads", "1", "--d", "64", "--rows", "8", "--K", "4",
        "--rank", "8", "--pattern", "distinct", "--time-per-shape", "0.02"]


def test_plan_once_compares_the_chosen_strategy_with_the_others(capsys):
    assert kernel_bench.main(TINY + ["--plan", "once"]) == 0
    out = capsys.readouterr().out
    assert "planned once per shape" in out
    row = next(line for line in out.splitlines() if line.split()[:3] == ["64", "8", "4"])
    chosen = row.split()[-1] if "(" not in row else row.split("(")[0].split()[-1]
    assert chosen in ("concat", "gather", "bmm")
    others = {"concat", "gather", "bmm"} - {chosen}
    assert all(f"x vs {s}" in row for s in others), row
    assert "MISMATCH" not in out


def test_per_call_plans_never_pick_bmm(capsys):
    assert kernel_bench.main(TINY) == 0
    row = next(line for line in capsys.readouterr().out.splitlines()
               if line.split()[:3] == ["64", "8", "4"])
    assert row.split()[-1] in ("concat", "gather"), row


def test_plan_once_needs_the_torch_backend(capsys):
    assert kernel_bench.main(TINY + ["--plan", "once", "--backend", "reference"]) == 2
    assert "--plan once applies to the torch backend" in capsys.readouterr().err
