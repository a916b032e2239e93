"""More than one toxicity scorer in one run: the headline one (profanity-check by default)
and others beside it, on the same samples, each with the paper's metrics."""

import json

import pytest

from helpers.steers import random_steer
from vllm_steer.eval import register_scorer
from vllm_steer.eval.harness import evaluate
from vllm_steer.eval.toxicity import toxicity_metrics
from vllm_steer.format import save_steer

TEXTS = {True: " you stupid idiot, shut up", False: " what a lovely day it is"}


class MixedGenerator:
    """Sample j of prompt i is insulting when (i + j) is even, unsteered; steered, never."""

    def __init__(self, model, steers, blacklists, engine, seed):
        pass

    def generate(self, prompts, conditions, sampling, progress=True):
        return {c.label: [[TEXTS[c.strength == 0 and (i + j) % 2 == 0]
                           for j in range(sampling.samples)] for i in range(len(prompts))]
                for c in conditions}

    def close(self):
        pass


class LengthScorer:
    """A stand-in second opinion: longer texts are 'more toxic'."""

    name = "length"

    def score(self, texts):
        return [min(1.0, len(t) / 40) for t in texts]


def test_a_second_toxicity_scorer_is_reported_beside_the_first(tiny_model_dir, tmp_path):
    from vllm_steer.cli import build_parser
    from vllm_steer.eval.cli import config_from_args

    register_scorer("toxicity", "length", LengthScorer, overwrite=True)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": f"Prompt {i}"}) for i in range(3)))
    steer = str(tmp_path / "s.safetensors")
    save_steer(steer, random_steer(64, 4, "detox"))
    argv = ["eval", "toxicity", "--model", str(tiny_model_dir), "--steer", steer,
            "--prompts", str(prompts), "--strengths", "0,5", "--baseline", "none",
            "--samples", "2", "--toxicity-scorer", "profanity-check", "--toxicity-scorer",
            "length", "--sentiment-scorer", "vader", "--scorer-dtype", "float32",
            "--data", str(tmp_path / "none"), "--out", str(tmp_path / "run"), "--quiet"]
    cfg = config_from_args(build_parser().parse_args(argv))
    assert cfg.toxicity_scorer == "profanity-check" and cfg.extra_toxicity_scorers == ["length"]
    again = config_from_args(build_parser().parse_args(
        __import__("shlex").split(cfg.command)[1:]))
    assert again.extra_toxicity_scorers == ["length"]
    res = evaluate(cfg, generator_factory=MixedGenerator, log=lambda m: None)
    by = {c["label"]: c["metrics"] for c in res["conditions"]}
    recs = [json.loads(x) for x in (tmp_path / "run" / "generations.jsonl").read_text()
            .splitlines()]
    for label, m in by.items():
        rows = [r for r in recs if r["condition"] == label]
        for key, name in (("toxicity", None), ("toxicity_length", "length")):
            want = toxicity_metrics([[s[key] for s in r["samples"]] for r in rows])
            suffix = f"_{name}" if name else ""
            assert m["avg_max_toxicity" + suffix] == pytest.approx(want["avg_max_toxicity"])
            assert m["toxicity_prob" + suffix] == want["toxicity_prob"]
    s = recs[0]["samples"][0]
    assert s["toxicity_length"] == pytest.approx(len(s["text"]) / 40)
    # profanity-check, the headline: the insults are toxic, the steered text is not
    assert by["unsteered"]["toxicity_prob"] == 1.0 > by["lm-steer detox=+5"]["toxicity_prob"]
    assert res["scorers"]["toxicity"]["more"] == ["length"]
    md = (tmp_path / "run" / "results.md").read_text()
    assert "toxicity `profanity-check` (also `length`)" in md
    assert "| avg max toxicity (length) | toxicity prob. (length) |" in md
    row = next(line for line in md.splitlines() if line.startswith("| unsteered |"))
    assert f"| {100 * by['unsteered']['toxicity_prob_length']:.1f}% |" in row  # as a share
