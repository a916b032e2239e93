"""``vllm-steer eval``: argument parsing, the reproducible command line, and one end-to-end
run through a real vLLM engine on the tiny model."""

import argparse
import json
import shlex

import pytest
import torch

from helpers.steers import random_steer
from vllm_steer.cli import build_parser, main
from vllm_steer.eval.cli import config_from_args, parse_strengths
from vllm_steer.format import save_steer


def test_strength_lists_parse_including_leading_negatives():
    assert parse_strengths("-10,-5,0,5,10") == [-10.0, -5.0, 0.0, 5.0, 10.0]
    assert parse_strengths(" 2.5 , -1, 2.5") == [2.5, -1.0]
    with pytest.raises(argparse.ArgumentTypeError, match="'x' in '1,x' is not a number"):
        parse_strengths("1,x")
    args = build_parser().parse_args(["eval", "toxicity", "--strengths", "-10,-5,0",
                                      "--baseline-strengths", "-3"])
    assert args.strengths == [-10.0, -5.0, 0.0] and args.baseline_strengths == [-3.0]
    assert args.samples == 25 and args.max_tokens == 20 and args.top_p == 0.9  # the paper's


def test_the_recorded_command_reproduces_the_config(tmp_path):
    steer = tmp_path / "detox.safetensors"
    from vllm_steer.format import save_steer

    save_steer(str(steer), random_steer(64, 4, "detox"))
    argv = ["eval", "sentiment", "--steer", str(steer), "--strengths", "-5,0,5",
            "--prompt-set", "negative", "--num-prompts", "7", "--samples", "3",
            "--baseline", "none", "--sentiment-scorer", "vader", "--max-num-seqs", "32"]
    cfg = config_from_args(build_parser().parse_args(argv))
    assert cfg.out.endswith("sentiment-detox") and cfg.sampling.samples == 3
    again = config_from_args(build_parser().parse_args(shlex.split(cfg.command)[1:]))
    assert again == cfg


def test_missing_steer_is_a_clear_error(capsys):
    assert main(["eval", "toxicity", "--steer", "nope.safetensors"]) == 1
    assert "--steer nope.safetensors: no such file" in capsys.readouterr().err


@pytest.mark.parametrize("argv, said", [
    (["eval", "toxicity", "--num-prompts", "0"],
     "argument --num-prompts: '0' is not an integer >= 1: give e.g. 100"),
    (["tune", "s.safetensors", "--task", "toxicity", "--num-prompts", "-1"],
     "argument --num-prompts: '-1' is not an integer >= 1"),
    (["eval", "sentiment", "--samples", "0"], "argument --samples: '0' is not an integer >= 1"),
    (["eval", "grid", "--max-tokens", "-3"], "argument --max-tokens: '-3' is not an integer >= 1"),
    (["tune", "s.safetensors", "--task", "toxicity", "--samples", "0"],
     "argument --samples: '0' is not an integer >= 1: give e.g. 4"),
    (["eval", "train-baseline", "--out", "b.safetensors", "--preset", "detox",
      "--max-examples", "0"], "argument --max-examples: '0' is not an integer >= 1"),
    (["eval", "train-baseline", "--out", "b.safetensors"],
     "one of the arguments --like --preset is required"),
    (["eval", "train-baseline", "--out", "b.safetensors", "--like", "s.safetensors",
      "--preset", "detox"], "argument --preset: not allowed with argument --like"),
])
def test_flags_out_of_range_or_together_are_usage_errors(argv, said, capsys):
    """Refused by the parser (exit status 2, the flag and the value named) before any file,
    model or engine is touched: these exited with status 1 after the parser (--num-prompts),
    or after the steer's metadata was read (train-baseline's choice)."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert said in capsys.readouterr().err


@pytest.mark.parametrize("flags, said", [
    (["toxicity", "--strengths", "1,1.0000001"],
     "--strengths: 1.0000001 and 1.0, which the report labels alike (+1)"),
    (["grid", "--steer", "b.safetensors", "--strengths", "0,5",
      "--grid-strengths", "-5,-5.0000002"],
     "--grid-strengths: -5.0000002 and -5.0, which the report labels alike (-5)")])
def test_strengths_that_would_be_one_condition_are_refused_before_any_work(
        flags, said, tmp_path, capsys):
    """Two strengths the report labels alike were run twice and their samples merged under one
    label (each condition's metrics over both runs' samples); the same value twice, which the
    command line drops, is refused through the Python API."""
    from vllm_steer.eval.harness import EvalConfig

    with pytest.raises(ValueError, match=r"--strengths: 5 twice \(\+5\); give each"):
        EvalConfig(task="toxicity", steers=["a"], strengths=[0, 5, 5]).validate()
    for n in ("a", "b"):
        save_steer(str(tmp_path / f"{n}.safetensors"), random_steer(64, 4, n))
    flags = [f.replace("b.safetensors", str(tmp_path / "b.safetensors")) for f in flags]
    assert main(["eval", *flags[:1], "--steer", str(tmp_path / "a.safetensors"), *flags[1:],
                 "--out", str(tmp_path / "run")]) == 1
    err = capsys.readouterr().err
    assert said in err and "give each strength once" in err
    assert not (tmp_path / "run").exists()


@pytest.mark.vllm
@pytest.mark.data
def test_eval_end_to_end_on_the_tiny_model(tiny_model_dir, data_dir, tmp_path):
    """The real thing, very small: vLLM + plugin + soft-blacklist processor + scorers."""
    from transformers import AutoTokenizer

    from vllm_steer.eval.soft_blacklist import SoftBlacklist, save_soft_blacklist
    from vllm_steer.format import save_steer

    steer = str(tmp_path / "tiny.safetensors")
    save_steer(steer, random_steer(64, 8, "tiny", seed=1, scale=3.0))
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    allowed = {"cat", "dog", "the"}
    ids = [tok.encode(" " + w, add_special_tokens=False)[0] for w in allowed]
    bias = torch.full((49152,), -1e6)
    bias[ids] = 0.0  # at strength 1: every other token gets -1000 logits
    bl = str(tmp_path / "bl.safetensors")
    save_soft_blacklist(bl, SoftBlacklist(bias, "blacklist"))
    out = tmp_path / "run"
    rc = main(["eval", "toxicity", "--model", str(tiny_model_dir), "--steer", steer,
               "--strengths", "-5,0,5", "--baseline", bl, "--baseline-strengths", "1",
               "--num-prompts", "2", "--samples", "2", "--max-tokens", "5",
               "--data", str(data_dir), "--out", str(out), "--max-num-seqs", "16",
               "--kv-cache-gib", "0.25", "--quiet"])
    assert rc == 0
    res = json.loads((out / "results.json").read_text())
    assert [c["label"] for c in res["conditions"]] == [
        "unsteered", "lm-steer tiny=-5", "lm-steer tiny=+5", "soft-blacklist blacklist=+1"]
    for c in res["conditions"]:
        m = c["metrics"]
        assert 0 <= m["avg_max_toxicity"] <= 1 and m["ppl"] > 1 and 0 < m["dist-1"] <= 1
    gens = {}
    for line in (out / "generations.jsonl").read_text().splitlines():
        rec = json.loads(line)
        gens.setdefault(rec["condition"], []).append([s["text"] for s in rec["samples"]])
    assert all(len(g) == 2 and all(len(s) == 2 for s in g) for g in gens.values())
    # same seeds for every condition: only the steering changes the samples
    assert gens["lm-steer tiny=+5"] != gens["unsteered"] != gens["lm-steer tiny=-5"]
    # the blacklist reached the sampler: only the allowed words were generated
    words = {w for g in gens["soft-blacklist blacklist=+1"] for s in g for w in s.split()}
    assert words and words <= allowed
    # perplexity came from the engine (unsteered prompt logprobs) and equals transformers'
    from vllm_steer.eval.fluency import PerplexityScorer

    assert res["scorers"]["perplexity"]["backend"] == "vllm"
    recs = [json.loads(x) for x in (out / "generations.jsonl").read_text().splitlines()]
    pairs = [(r["prompt"], s) for r in recs[::3] for s in r["samples"]]
    ref = PerplexityScorer(str(tiny_model_dir), dtype="float32").nll(
        [p for p, _ in pairs], [s["text"] for _, s in pairs], progress=False)
    for (_, s), r in zip(pairs, ref, strict=False):
        assert s["tokens"] == r.tokens and s["ppl"] == pytest.approx(r.ppl, rel=2e-3)
    md = (out / "results.md").read_text()
    assert "| soft-blacklist | blacklist=+1 |" in md and "## Goals" in md
    for png in ("ablation.png", "tradeoff.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG"
