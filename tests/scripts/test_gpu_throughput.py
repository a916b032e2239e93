"""scripts/gpu_throughput.py (the GPU plan's throughput call), its parts on the CPU: the
shapes it builds, the requests of each mode, the steers it writes and the figures it reports
(an engine run is the GPU window's: a CPU engine start costs a minute)."""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

import gpu_throughput as gt  # noqa: E402


def test_the_shapes_are_the_embedded_models_and_an_8b_like_one(tmp_path):
    import json

    embedded = gt.model_config("smollm2", 32)
    assert embedded["hidden_size"] == 576 and embedded["num_hidden_layers"] == 30
    big = gt.model_config("8b", 4)
    assert big["hidden_size"] == 4096 and big["num_hidden_layers"] == 4
    assert big["vocab_size"] == 128256  # the 8B head's width, from the shipped config
    folder = gt.write_model(tmp_path / "m", big)
    assert json.loads((folder / "config.json").read_text()) == big
    assert [p.name for p in folder.iterdir()] == ["config.json"]  # weights: load_format dummy


def test_each_mode_spreads_its_rows_over_k_steers():
    assert gt.mode_steers("plain", 3) == [None, None, None]
    assert gt.mode_steers("K=1", 3) == [{"s0": 2.0}] * 3
    assert [next(iter(s)) for s in gt.mode_steers("K=4", 6)] == ["s0", "s1", "s2", "s3", "s0",
                                                                 "s1"]
    assert len({next(iter(s)) for s in gt.mode_steers("K=64", 64)}) == 64


def test_the_steers_load_at_the_models_hidden_size_and_rank(tmp_path):
    from vllm_steer.format import load_steer

    paths = gt.write_steers(tmp_path, 96, 3, 8)
    assert sorted(paths) == ["s0", "s1", "s2"]
    steers = [load_steer(p) for p in paths.values()]
    assert all(s.p1.shape == (96, 8) and s.p2.shape == (96, 8) for s in steers)
    assert not torch.equal(steers[0].p1, steers[1].p1)  # distinct steers


def test_ratios_pair_each_round_with_plain_of_the_same_round():
    runs = {"plain": [(100, 1.0), (100, 2.0), (100, 1.0)],
            "K=1": [(100, 1.25), (100, 2.0), (100, 1.1)]}
    s = gt.summarize(runs)
    assert s["plain"]["ratio_to_plain"] == 1.0 and s["plain"]["tokens_per_s"] == 100.0
    assert s["K=1"]["ratio_to_plain"] == statistics.median([0.8, 1.0, 1 / 1.1])
    assert s["K=1"]["tokens_per_s"] == statistics.median([80.0, 50.0, 100 / 1.1])
    assert s["K=1"]["rounds"] == 3
