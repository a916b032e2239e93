"""``benchmarks/bench_layer_vectors.py`` on the CPU (tiny shapes, no timing): the decoder
layers' vector-steer op gives the reference's rows (each row's own vector gathered by slot, no
matmul) for one layer and for the model's layers, in fp32 and bf16; the check refuses a wrong
op; the roofline counts the used vectors and the rows, the dense read every slot."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_layer_vectors as B  # noqa: E402


def test_the_op_gives_the_references_rows(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("OUT", str(tmp_path / "out"))
    assert B.main(["--device", "cpu"]) == 0
    out = capsys.readouterr().out
    # 2 dtypes x 2 row counts x 2 K x (1 layer, 2 layers)
    assert out.count("matches the reference") == 16, out
    saved = (tmp_path / "out" / "layer_vectors.txt").read_text()
    assert "FAILED" not in saved and saved.count("matches the reference") == 16


def test_the_check_refuses_rows_that_are_not_the_references():
    bank = B.make_bank(32, 4, 2, torch.device("cpu"))
    c = B.make_case(bank, 2, 6, torch.bfloat16)
    ref = B.reference(c["h"], bank, c["slot_of_row"], c["coef"])
    assert B.check("unsteered", c["h"], ref, c["h"]) is not None
    # one layer's vectors short: off by a vector, refused
    one = B.reference(c["h"], bank[:1], c["slot_of_row"], c["coef"])
    assert B.check("one layer of two", one, ref, c["h"]) is not None
    # the wrong slot for every row
    wrong = B.reference(c["h"], bank, (c["slot_of_row"] + 1) % 4, c["coef"])
    assert B.check("wrong slot", wrong, ref, c["h"]) is not None
    assert B.check("exact", ref, ref, c["h"]) is None


def test_each_row_is_steered_by_one_of_k_distinct_vectors():
    bank = B.make_bank(16, 8, 1, torch.device("cpu"))
    c = B.make_case(bank, 3, 7, torch.float32)
    assert c["used"] == 3 and len(set(c["slot_of_row"].tolist())) == 3
    assert ((c["coefs"] != 0).sum(1) == 1).all()  # one vector per row
    assert set(c["coef"].tolist()) <= {0.5, 2.0}
    assert B.make_case(bank, 64, 5, torch.float32)["used"] == 5  # at most one per row


def test_the_roofline_counts_the_used_vectors_and_the_dense_op_every_slot():
    # d 4096, 256 rows of bf16 in and out: 4 MiB; one used fp32 vector: 16 KiB
    assert B.roofline_bytes(1, 256, 4096, 1, 2) == 4096 * 4 + 2 * 256 * 4096 * 2
    assert B.roofline_bytes(64, 256, 4096, 32, 2) == 32 * (64 * 4096 * 4 + 2 * 256 * 4096 * 2)
    # the dense op: the 256 slots' vectors (4 MiB) and the coefficient rows, whatever K is
    assert B.read_bytes(256, 256, 4096, 1, 2) == (256 * 4096 * 4 + 256 * 256 * 4
                                                  + 2 * 256 * 4096 * 2)


def test_the_dense_matmul_counts_every_slot_for_every_token():
    # 256 rows x 256 slots x 4096: 0.54 GFLOP a layer, 17.2 for 32 layers
    assert B.dense_flops(256, 256, 4096, 1) == 2 * 256 * 256 * 4096
    assert B.dense_flops(8192, 256, 4096, 32) == 32 * 2 * 8192 * 256 * 4096
