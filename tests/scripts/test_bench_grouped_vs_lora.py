"""``benchmarks/bench_grouped_vs_lora.py`` on the CPU (Triton's interpreter): vLLM's
``lora_shrink`` / ``lora_expand``, loaded from the installed vLLM's files without importing
vLLM, and the grouped steer op both give the reference's rows on the same steers (one steer
per row, per-row coefficients folded into LoRA's input), and the check refuses a wrong op."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("the Triton kernels run on the CPU only with TRITON_INTERPRET=1",
                allow_module_level=True)

import lora_ops  # noqa: E402

if lora_ops.installed_dir() is None:
    pytest.skip("no installed vLLM with its LoRA op files", allow_module_level=True)

import bench_grouped_vs_lora as B  # noqa: E402


def test_lora_and_the_grouped_op_give_the_references_rows(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("OUT", str(tmp_path))
    assert B.main(["--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert out.count("ours and lora match the reference") == 4, out
    assert "FAILED" not in (tmp_path / "grouped_vs_lora.txt").read_text()


def test_the_check_refuses_rows_that_are_not_the_references():
    c = B.make_case(B.make_bank(64, 16, 4, torch.float16, torch.device("cpu")), 2, 6)
    ref = B.reference(c)
    assert B.check("unsteered", c["h"], ref, c["h"], torch.float16) is not None
    assert B.check("exact", ref.half(), ref, c["h"], torch.float16) is None


def test_carry_copies_the_files_and_the_vllm_version(tmp_path):
    dest = lora_ops.carry(tmp_path / "lora_ops")
    assert sorted(p.name for p in dest.iterdir()) == sorted([*lora_ops.FILES, "VERSION"])
    assert lora_ops.load(dest).version == (dest / "VERSION").read_text().strip()
