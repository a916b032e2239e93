"""A whole evaluation run with a stand-in generator (no vLLM): files, metrics, grid."""

import json
import os

import pytest
import torch

from helpers.steers import random_steer
from vllm_steer.eval.generation import SamplingConfig
from vllm_steer.eval.harness import EvalConfig, build_conditions, evaluate
from vllm_steer.eval.soft_blacklist import SoftBlacklist, save_soft_blacklist
from vllm_steer.format import save_steer

pytestmark = pytest.mark.data

WORDS = {1: "what a wonderful lovely great day", -1: "you stupid idiot, I hate this crap",
         0: "the table is in the room"}


class FakeGenerator:
    """Positive strengths of the first steer -> pleasant text, negative -> toxic text."""

    calls = []

    def __init__(self, model, steers, blacklists, engine, seed):
        FakeGenerator.calls.append({"model": model, "steers": steers, "blacklists": blacklists})
        self.closed = False

    def generate(self, prompts, conditions, sampling, progress=True):
        out = {}
        for c in conditions:
            sign = (c.strength > 0) - (c.strength < 0)
            out[c.label] = [[f" {WORDS[sign]} {j}" for j in range(sampling.samples)]
                            for _ in prompts]
        return out

    def close(self):
        self.closed = True


@pytest.fixture
def steer_path(tmp_path):
    p = str(tmp_path / "detox.safetensors")
    save_steer(p, random_steer(64, 4, "detox"))
    return p


def test_toxicity_run_writes_every_file_with_the_numbers(tiny_model_dir, data_dir, tmp_path,
                                                         steer_path):
    bl = str(tmp_path / "bl.safetensors")
    save_soft_blacklist(bl, SoftBlacklist(torch.zeros(49152), "blacklist"))
    out = tmp_path / "run"
    cfg = EvalConfig(task="toxicity", model=str(tiny_model_dir), steers=[steer_path],
                     strengths=[-5, 0, 5], baseline=bl, baseline_strengths=[2, 4],
                     num_prompts=3, sampling=SamplingConfig(samples=2, max_tokens=8),
                     data_dir=str(data_dir), out=str(out), scorer_dtype="float32",
                     progress=False)
    FakeGenerator.calls.clear()
    res = evaluate(cfg, generator_factory=FakeGenerator, log=lambda m: None)
    assert FakeGenerator.calls[0]["steers"] == {"detox": os.path.abspath(steer_path)}
    assert FakeGenerator.calls[0]["blacklists"] == {"blacklist": bl}
    labels = [c["label"] for c in res["conditions"]]
    assert labels == ["unsteered", "lm-steer detox=-5", "lm-steer detox=+5",
                      "soft-blacklist blacklist=+2", "soft-blacklist blacklist=+4"]
    by = {c["label"]: c["metrics"] for c in res["conditions"]}
    assert by["lm-steer detox=-5"]["avg_max_toxicity"] > 0.5 > by["lm-steer detox=+5"][
        "avg_max_toxicity"]
    assert by["lm-steer detox=-5"]["toxicity_prob"] == 1.0
    assert by["lm-steer detox=+5"]["positivity"] == 1.0
    # "the table is in the room 0" and "... 1": 7 distinct words of 14
    assert by["unsteered"]["dist-1"] == pytest.approx(7 / 14)
    disk = json.loads((out / "results.json").read_text())
    assert disk["conditions"] == res["conditions"] and disk["num_prompts"] == 3
    assert disk["goals"]["met"]["avg_max_toxicity"] is True
    lines = (out / "generations.jsonl").read_text().splitlines()
    assert len(lines) == 5 * 3
    rec = json.loads(lines[3])
    assert rec["condition"] == "lm-steer detox=-5" and len(rec["samples"]) == 2
    assert rec["samples"][0]["toxicity"] > 0.5 and rec["samples"][0]["tokens"] > 0
    md = (out / "results.md").read_text()
    assert "| lm-steer | detox=-5 | " in md and "## Goals" in md
    for png in ("ablation.png", "tradeoff.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert res["plots"] == ["ablation.png", "tradeoff.png"]
    assert res["scorers"]["perplexity"]["backend"] == "transformers"  # the fake has no engine
    # the report can be re-rendered from results.json, e.g. with goals at another strength
    from vllm_steer.eval.harness import rerender

    again = rerender(str(out), recommended_strength=-5)
    assert again["goals"]["detox_strength"] == -5.0
    assert again["conditions"] == res["conditions"]
    assert "At strength -5 (recommended: -5) vs unsteered" in (out / "results.md").read_text()


def test_sentiment_run_plots_the_distribution(tiny_model_dir, data_dir, tmp_path, steer_path):
    out = tmp_path / "sent"
    cfg = EvalConfig(task="sentiment", model=str(tiny_model_dir), steers=[steer_path],
                     strengths=[-5, -2, 0, 2, 5], baseline="none", num_prompts=2,
                     sampling=SamplingConfig(samples=2), data_dir=str(data_dir), out=str(out),
                     sentiment_scorers=["vader"], progress=False)
    res = evaluate(cfg, generator_factory=FakeGenerator, log=lambda m: None)
    assert "sentiment_distribution.png" in res["plots"]
    assert (out / "sentiment_distribution.png").exists()
    g = res["goals"]["shift_points"]["positivity"]
    assert g["towards_positive"] > 30 and g["towards_negative"] <= 0


def test_grid_crosses_two_steers(tiny_model_dir, data_dir, tmp_path, steer_path):
    other = str(tmp_path / "sentiment.safetensors")
    save_steer(other, random_steer(64, 4, "sentiment", seed=3))
    cfg = EvalConfig(task="grid", model=str(tiny_model_dir), steers=[steer_path, other],
                     strengths=[0, 5], grid_strengths=[-5, 0, 5], num_prompts=2,
                     sampling=SamplingConfig(samples=1), data_dir=str(data_dir),
                     out=str(tmp_path / "grid"), sentiment_scorers=["vader"], progress=False)
    conds = build_conditions(cfg, ["detox", "sentiment"], None)
    assert [c.steer for c in conds[1:]] == [{"sentiment": -5.0}, {"sentiment": 5.0},
                                            {"detox": 5.0, "sentiment": -5.0}, {"detox": 5.0},
                                            {"detox": 5.0, "sentiment": 5.0}]
    res = evaluate(cfg, generator_factory=FakeGenerator, log=lambda m: None)
    assert res["plots"] == ["grid.png"] and res["grid"]["b"] == [-5, 0, 5]
    md = (tmp_path / "grid" / "results.md").read_text()
    assert "rows: `detox` strength, columns: `sentiment` strength" in md


def test_config_errors_are_clear(tmp_path, steer_path, data_dir, tiny_model_dir):
    with pytest.raises(ValueError, match="the grid crosses two steers; got 1"):
        EvalConfig(task="grid", steers=[steer_path]).validate()
    with pytest.raises(ValueError, match="unknown task 'poetry'"):
        EvalConfig(task="poetry").validate()
    with pytest.raises(ValueError, match="--samples 0"):
        EvalConfig(sampling=SamplingConfig(samples=0)).validate()
    with pytest.raises(FileNotFoundError, match="--baseline nope.safetensors: no such file"):
        evaluate(EvalConfig(model=str(tiny_model_dir), steers=[steer_path],
                            baseline="nope.safetensors",
                            data_dir=str(data_dir), out=str(tmp_path / "o"), num_prompts=1,
                            progress=False), generator_factory=FakeGenerator)
    assert not (tmp_path / "o").exists()  # a failed run leaves no empty results folder
    (tmp_path / "mine").mkdir()  # one the user made is left as it was
    with pytest.raises(FileNotFoundError):
        evaluate(EvalConfig(model=str(tiny_model_dir), steers=[steer_path],
                            baseline="nope.safetensors", data_dir=str(data_dir),
                            out=str(tmp_path / "mine"), num_prompts=1, progress=False),
                 generator_factory=FakeGenerator)
    assert (tmp_path / "mine").is_dir()


def test_runs_at_other_strengths_merge_into_one_report(tiny_model_dir, data_dir, tmp_path,
                                                       steer_path):
    from vllm_steer.eval.harness import merge

    def run(name, strengths, samples=2):
        cfg = EvalConfig(task="sentiment", model=str(tiny_model_dir), steers=[steer_path],
                         strengths=strengths, baseline="none", num_prompts=2,
                         sampling=SamplingConfig(samples=samples), data_dir=str(data_dir),
                         out=str(tmp_path / name), sentiment_scorers=["vader"], progress=False)
        return evaluate(cfg, generator_factory=FakeGenerator, log=lambda m: None)

    a, b = run("a", [-2, 0, 2]), run("b", [-5, 0, 5])
    res = merge([str(tmp_path / "a"), str(tmp_path / "b")], str(tmp_path / "ab"))
    labels = sorted(c["label"] for c in res["conditions"])
    assert labels == sorted(["unsteered", "lm-steer detox=-2", "lm-steer detox=+2",
                             "lm-steer detox=-5", "lm-steer detox=+5"])
    assert res["continuations"] == 5 * 2 * 2
    assert res["timing"]["total_s"] == pytest.approx(a["timing"]["total_s"]
                                                     + b["timing"]["total_s"])
    md = (tmp_path / "ab" / "results.md").read_text()
    assert "| lm-steer | detox=-2 |" in md and "| lm-steer | detox=+5 |" in md
    assert (tmp_path / "ab" / "sentiment_distribution.png").exists()
    # runs that did not draw the same samples are refused, with every reason
    run("c", [3], samples=1)
    with pytest.raises(ValueError, match=r"(?s)cannot merge.*sampling differs"):
        merge([str(tmp_path / "a"), str(tmp_path / "c")], str(tmp_path / "ac"))
    with pytest.raises(FileNotFoundError, match="results.json"):
        merge([str(tmp_path / "a"), str(tmp_path / "nope")], str(tmp_path / "x"))
    # the same draws scored in other batches: perplexity moves in its fifth digit (as two
    # real runs did), the scores not at all; a real difference is still refused
    doc = json.loads((tmp_path / "b" / "results.json").read_text())
    base = next(c for c in doc["conditions"] if c["label"] == "unsteered")
    for factor, merges in ((1 + 8.2e-6, True), (1.01, False)):
        base["metrics"]["ppl"] *= factor
        (tmp_path / "b" / "results.json").write_text(json.dumps(doc))
        if merges:
            merge([str(tmp_path / "a"), str(tmp_path / "b")], str(tmp_path / "ab2"))
        else:
            with pytest.raises(ValueError, match="'unsteered' has different metrics"):
                merge([str(tmp_path / "a"), str(tmp_path / "b")], str(tmp_path / "ab3"))
    base["metrics"]["ppl"] /= 1.01 * (1 + 8.2e-6)
    base["metrics"]["positivity"] += 1e-5  # a score is the draws': exact
    (tmp_path / "b" / "results.json").write_text(json.dumps(doc))
    with pytest.raises(ValueError, match="'unsteered' has different metrics"):
        merge([str(tmp_path / "a"), str(tmp_path / "b")], str(tmp_path / "ab4"))
