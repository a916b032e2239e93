"""``vllm-steer tune`` through vLLM's own engine flags, in a tensor-parallel engine: the
command line a user would type for a large model (``--tensor-parallel-size 2 --dtype ...
--max-model-len ...``), run on the tiny model on this CPU (two ``mp`` workers, one core each,
as in tests/e2e/test_vllm_tp.py). One engine start."""

from __future__ import annotations

import json

import pytest

from helpers.models import make_tiny_llama
from helpers.steers import random_steer
from vllm_steer.cli import main

pytestmark = pytest.mark.vllm

HIDDEN = 128  # 2 attention heads: one per rank
PROMPTS = ["Hello there, my name is", "The weather today"]


def test_tune_runs_a_tensor_parallel_engine_from_vllms_flags(tmp_path, monkeypatch, capfd):
    from vllm_steer.eval.fluency import PerplexityScorer
    from vllm_steer.format import read_metadata, save_steer

    model = make_tiny_llama(tmp_path / "tiny-128", hidden=HIDDEN, seed=3)
    steer = tmp_path / "tiny.safetensors"
    save_steer(str(steer), random_steer(HIDDEN, 8, "tiny", seed=1, scale=3.0))
    prompts = tmp_path / "dev.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": {"text": p}}) + "\n" for p in PROMPTS))
    out = tmp_path / "run"
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")  # one core per rank
    rc = main(["tune", str(steer), "--task", "toxicity", "--prompts", str(prompts),
               "--model", str(model), "--strengths", "3", "--ppl-budget", "1000",
               "--num-prompts", "2", "--samples", "2", "--max-tokens", "4",
               "--sentiment-scorer", "vader", "--out", str(out), "--quiet",
               "--tensor-parallel-size", "2", "--distributed-executor-backend", "mp",
               "--dtype", "float32", "--max-model-len", "128", "--max-num-seqs", "8",
               "--kv-cache-gib", "0.125"])
    logs = capfd.readouterr()
    assert rc == 0, logs.err[-3000:]
    # the engine vLLM started is the one the flags describe
    assert "tensor_parallel_size=2" in logs.out + logs.err
    res = json.loads((out / "results.json").read_text())
    assert {k: res["engine"][k] for k in ("tensor_parallel_size", "distributed_executor_backend",
                                          "dtype", "max_model_len", "max_num_seqs")} == {
        "tensor_parallel_size": 2, "distributed_executor_backend": "mp", "dtype": "float32",
        "max_model_len": 128, "max_num_seqs": 8}
    # the steer file records the curve and the command, engine flags included
    tune = read_metadata(str(steer)).metrics["tune"]
    assert [p["strength"] for p in tune["curve"]] == [0.0, 3.0]
    assert tune["recommended_strength"] == 3.0
    assert "--tensor-parallel-size 2" in tune["command"] and "--dtype float32" in tune["command"]
    # the sharded engine's perplexity of every sample equals transformers' on the same weights
    recs = [json.loads(x) for x in (out / "generations.jsonl").read_text().splitlines()]
    by = {}
    for r in recs:
        by.setdefault(r["condition"], []).append([s["text"] for s in r["samples"]])
    assert by["lm-steer tiny=+3"] != by["unsteered"]  # the same seeds: the steer did this
    pairs = [(r["prompt"], s) for r in recs for s in r["samples"]]
    ref = PerplexityScorer(str(model), dtype="float32").nll(
        [p for p, _ in pairs], [s["text"] for _, s in pairs], progress=False)
    for (_, s), r in zip(pairs, ref, strict=False):
        assert s["tokens"] == r.tokens and s["ppl"] == pytest.approx(r.ppl, rel=2e-3)
