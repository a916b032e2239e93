"""scripts/gpu_throughput.py (the GPU plan's throughput call), its parts on the CPU: the
shapes it builds, the requests of each mode, the steers it writes and the figures it reports
(an engine run is the GPU window's: a CPU engine start costs a minute)."""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import pytest
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
    # the fastest runs: K=1's 100/1.1 tokens/s against plain's 100
    assert s["K=1"]["best_tokens_per_s"] == 100 / 1.1
    assert s["K=1"]["best_ratio_to_plain"] == pytest.approx(1 / 1.1)
    assert s["K=1"]["seconds"] == [1.1, 2.0] and s["plain"]["seconds"] == [1.0, 2.0]


def test_profile_lines_give_each_modes_median_run_and_its_largest_sites():
    runs = [{"plugin:head": 0.004, "op": 0.002, "vllm": 0.5, "captures": 1, "replays": 9,
             "regions": 40, "calls": {"plugin:head": 9}},
            {"plugin:head": 0.006, "op": 0.002, "vllm": 0.5, "captures": 0, "replays": 9,
             "regions": 40, "calls": {"plugin:head": 9}},
            {"plugin:head": 0.008, "op": 0.004, "vllm": 0.5, "captures": 0, "replays": 9,
             "regions": 40, "calls": {"plugin:head": 9}}]
    (line,) = gt.profile_lines({"K=1": runs}, steps=10)
    # the median run's total (head and op: vLLM's own time is not the plugin's), per step
    assert line.startswith("  profile K=1: plugin 8.00 ms per run (800 us per step)")
    assert "captured 1 / replayed 9 per run" in line
    assert line.endswith("largest: head 6.00 ms, op 2.00 ms")


@pytest.mark.vllm
def test_the_profile_puts_the_steered_modes_time_on_the_head_and_the_op(tmp_path):
    import json
    import os
    import subprocess

    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_throughput.py"),
                        "--device", "cpu", "--shapes", "tiny", "--dtype", "float32",
                        "--runner", "v1", "--rows", "8", "--k", "1", "--output-len", "4",
                        "--rounds", "1", "--profile", "--workdir", str(tmp_path / "w"),
                        "--out", str(tmp_path)], capture_output=True, text=True,
                       env=dict(os.environ), timeout=900, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    prof = json.loads((tmp_path / "gpu_throughput.json").read_text())["shapes"]["tiny"]["profile"]
    (plain,), (steered,) = prof["plain"], prof["K=1"]
    assert "op" not in plain  # no row steered: the op never ran
    # every generated token's row went through the head and the op: one call per step
    assert steered["calls"]["op"] == steered["calls"]["plugin:head"] >= 4
    assert steered["op"] > 0 and steered["plugin:head"] > 0
    assert steered["calls"]["plugin:SteerRequestStateV1.validate_params"] == 8  # per request
    assert "profile K=1: plugin" in r.stdout


def test_more_steers_than_rows_is_refused_naming_the_fix(capsys):
    with pytest.raises(SystemExit) as e:
        gt.main(["--device", "cpu", "--shapes", "tiny", "--rows", "64", "--k", "1", "256"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--k 256 is more than --rows 64" in err and "use --rows 256 or more" in err


def test_the_vector_modes_spread_their_rows_over_k_vector_steers():
    assert gt.mode_steers("vector unused", 3) == [None, None, None]
    assert gt.mode_steers("vector K=1", 3) == [{"v0": 2.0}] * 3
    assert [next(iter(s)) for s in gt.mode_steers("vector K=4", 6)] == ["v0", "v1", "v2", "v3",
                                                                        "v0", "v1"]
    assert len({next(iter(s)) for s in gt.mode_steers("vector K=64", 256)}) == 64


def test_the_vector_steers_cover_every_decoder_layer_at_the_models_hidden_size(tmp_path):
    from vllm_steer.vectors import load_vector

    paths = gt.write_vectors(tmp_path, 96, 5, 3)
    assert sorted(paths) == ["v0", "v1", "v2"]
    steers = [load_vector(p) for p in paths.values()]
    assert all(s.layers == [0, 1, 2, 3, 4] and s.hidden_size == 96 for s in steers)
    assert all(s.directions[k].shape == (96,) for s in steers for k in range(5))
    assert not torch.equal(steers[0].directions[0], steers[1].directions[0])  # distinct


def test_the_vector_engines_check_names_what_went_wrong():
    good = {"blocks": [32], "blocks_first_engine": [0]}
    steered = {"plain": 0, "K=1": 999, "vector unused": 0, "vector K=1": 128,
               "vector K=64": 130}
    assert gt.vector_problem(good, steered, 32, 128) is None
    # the op missing from blocks, or present in the first engine's model
    assert "in [30] decoder blocks" in gt.vector_problem(
        {**good, "blocks": [30]}, steered, 32, 128)
    assert "expected none" in gt.vector_problem(
        {**good, "blocks_first_engine": [32]}, steered, 32, 128)
    # an unused run that fed steered steps; a steered run that fed too few
    assert "unused 3 (expected 0)" in gt.vector_problem(
        good, {**steered, "vector unused": 3}, 32, 128)
    assert "expected at least 128 each" in gt.vector_problem(
        good, {**steered, "vector K=64": 5}, 32, 128)
    # two pipeline stages, 16 blocks each: the op in all 32
    assert gt.vector_problem({**good, "blocks": [16, 16]}, steered, 32, 128) is None
    assert gt.vector_problem({"error": "the vector engine did not start: OOM"}, steered, 32,
                             128) == "the vector engine did not start: OOM"


def test_more_vector_steers_than_rows_or_with_the_profile_is_refused(capsys):
    with pytest.raises(SystemExit) as e:
        gt.main(["--device", "cpu", "--shapes", "tiny", "--rows", "8", "--k", "1",
                 "--vector-k", "1", "64"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--vector-k 64 is more than --rows 8" in err and "use --rows 64 or more" in err
    with pytest.raises(SystemExit):
        gt.main(["--device", "cpu", "--shapes", "tiny", "--rows", "8", "--k", "1",
                 "--vector-k", "1", "--profile"])
    assert "--vector-k with --profile" in capsys.readouterr().err


def test_rows_changed_counts_the_requests_whose_tokens_differ_from_unused():
    tokens = {"plain": [[1, 2]] * 4, "vector unused": [[1, 2], [3, 4], [5, 6], [7, 8]],
              "vector K=1": [[1, 2], [3, 9], [5, 6], [0, 8]],
              "vector K=4": [[1, 2], [3, 4], [5, 6], [7, 8]]}
    assert gt.rows_changed(tokens) == {"vector K=1": 0.5, "vector K=4": 0.0}
    assert gt.rows_changed({"plain": [[1]]}) == {}


def test_an_engine_stopped_by_its_timeout_leaves_the_rounds_it_ran(tmp_path, monkeypatch,
                                                                   capsys):
    """The engine writes its result after every round: one stopped by ``--engine-timeout``
    (the window's throughput call is the one that may overrun) still reports the rounds it
    ran, marked a failure, instead of nothing."""
    import json
    import subprocess

    real = subprocess.run

    def engine(cmd, timeout=None, **kw):  # two of three rounds, then the timeout
        if "--result" not in cmd:  # not the engine
            return real(cmd, timeout=timeout, **kw)
        result = Path(cmd[cmd.index("--result") + 1])
        result.write_text(json.dumps({
            "runs": {"plain": [[32, 1.0], [32, 1.1]], "K=1": [[32, 1.05], [32, 1.1]]},
            "rows_steered": {"plain": 0, "K=1": 40}, "profile": {}, "engine": {},
            "vector": {}, "plugin_loaded": True, "rounds_done": 2}))
        raise subprocess.TimeoutExpired(cmd, timeout)

    monkeypatch.setattr(gt.subprocess, "run", engine)
    rc = gt.main(["--device", "cpu", "--shapes", "tiny", "--dtype", "float32", "--runner", "v1",
                  "--rows", "8", "--k", "1", "--output-len", "4", "--rounds", "3",
                  "--workdir", str(tmp_path / "w"), "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 1 and "engine timed out after" in out and "2 of 3 rounds" in out
    got = json.loads((tmp_path / "gpu_throughput.json").read_text())["shapes"]["tiny"]
    assert got["rounds_done"] == 2 and got["complete"] is False
    assert got["modes"]["K=1"]["ratio_to_plain"] == statistics.median([1 / 1.05, 1.0])
    assert "FAIL [tiny" in out and "K=1:" in out
