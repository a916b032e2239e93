"""Vector steers in ``vllm-steer tune`` and ``vllm-steer eval``: the same runs as for LM-Steer
files, labelled ``vector``, tuned in their own file format, at strengths on their own scale.
Stand-in generators and scorers (no vLLM) for the bookkeeping; one engine run on the tiny model
whose greedy samples are compared token for token with transformers under forward hooks."""

import json

import pytest
import torch

from helpers.eval_standins import sample_strength, standin_generator
from helpers.steers import random_steer
from vllm_steer.eval import register_scorer
from vllm_steer.eval.generation import SamplingConfig
from vllm_steer.eval.harness import EvalConfig, build_conditions, evaluate
from vllm_steer.eval.tune import TuneConfig, tune
from vllm_steer.format import save_steer
from vllm_steer.kinds import read_any_metadata
from vllm_steer.vectors import make_vector_steer, save_gguf, save_vector

HIDDEN = 64


def ppl_of(s: float) -> float:
    """The stand-in perplexity: 10 unsteered, +4% at 0.01, +16% at 0.02, +36% at 0.03."""
    return 10.0 * (1 + 400 * s * s)


StandInGenerator = standin_generator(ppl_of)


class StandInToxicity:
    name = "standin-vtox"

    def score(self, texts):  # less toxic as s grows: 0.9 at 0, 0.5 at 0.02
        return [max(0.0, 0.9 - 20 * max(sample_strength(t), 0.0)) for t in texts]


class StandInPositivity:
    name = "standin-vpos"

    def score(self, texts):
        return [0.5 for _ in texts]


@pytest.fixture(autouse=True)
def scorers():
    register_scorer("toxicity", "standin-vtox", StandInToxicity, overwrite=True)
    register_scorer("sentiment", "standin-vpos", StandInPositivity, overwrite=True)


@pytest.fixture
def prompts_file(tmp_path):
    p = tmp_path / "dev.jsonl"
    p.write_text("\n".join(json.dumps({"prompt": {"text": f"Prompt number {i}"}})
                           for i in range(4)))
    return str(p)


def _directions(layers, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(HIDDEN, generator=g) * scale for k in layers}


def _vector_file(tmp_path, fmt="safetensors", name="calm", recommended=0.04, layers=(1,),
                 seed=0, scale=1.0):
    vs = make_vector_steer(_directions(layers, seed, scale), name,
                           labels={"positive": "non-toxic", "negative": "toxic",
                                   "harmful": "negative"},
                           recommended_strength=recommended, metrics={"pairs": 7})
    p = str(tmp_path / f"{name}.{fmt}")
    (save_gguf if fmt == "gguf" else save_vector)(p, vs)
    return p, vs


def _tune_cfg(steer, prompts, tmp_path, **kw):
    base = dict(steer=steer, task="toxicity", prompts=prompts, strengths=[0.01, 0.02, 0.03],
                num_prompts=3, sampling=SamplingConfig(samples=2, max_tokens=4),
                model="smollm2", data_dir=str(tmp_path / "no-data"),
                out=str(tmp_path / "run"), toxicity_scorer="standin-vtox",
                sentiment_scorers=["standin-vpos"], progress=False)
    base.update(kw)
    return TuneConfig(**base)


@pytest.mark.parametrize("fmt", ["safetensors", "gguf"])
def test_tune_a_vector_steer_writes_its_strength_into_its_own_file(tmp_path, prompts_file, fmt,
                                                                   monkeypatch):
    import vllm_steer.models as models

    monkeypatch.setattr(models, "resolve_model", lambda m: m)
    path, vs = _vector_file(tmp_path, fmt)
    StandInGenerator.made.clear()
    rec = tune(_tune_cfg(path, prompts_file, tmp_path), StandInGenerator, log=lambda m: None)
    # +0.01 costs +4%, +0.02 +16% > 15%: 0.01 is the strongest within the budget
    assert rec["recommended_strength"] == 0.01
    assert [p["strength"] for p in rec["curve"]] == [0, 0.01, 0.02, 0.03]
    assert rec["curve"][1]["ppl_relative"] == pytest.approx(0.04)
    assert StandInGenerator.made == [{"calm": str(tmp_path / f"calm.{fmt}")}]
    meta = read_any_metadata(path)
    assert meta.kind == "vector" and meta.recommended_strength == 0.01
    assert meta.metrics["tune"]["previous_recommended_strength"] == 0.04
    assert meta.metrics["pairs"] == 7 and meta.labels["harmful"] == "negative"
    # the file is still of its format, its vectors bit for bit
    if fmt == "gguf":
        import gguf

        r = gguf.GGUFReader(path)
        assert r.get_field("general.architecture").contents() == "controlvector"
        got = {t.name: torch.from_numpy(t.data.copy()) for t in r.tensors}
        assert sorted(got) == ["direction.1"]
        assert torch.equal(got["direction.1"], vs.directions[1])
    else:
        from safetensors.torch import load_file

        got = load_file(path)
        assert sorted(got) == ["direction.1"] and torch.equal(got["direction.1"],
                                                              vs.directions[1])
    labels = [c["label"] for c in json.loads(
        (tmp_path / "run" / "results.json").read_text())["conditions"]]
    assert labels == ["unsteered", "vector calm=+0.01", "vector calm=+0.02", "vector calm=+0.03"]


def test_cli_defaults_for_a_vector_steer_are_on_its_own_scale(tmp_path, prompts_file,
                                                              monkeypatch, capsys):
    import vllm_steer.eval.harness as harness
    import vllm_steer.models as models
    from vllm_steer.cli import build_parser, main
    from vllm_steer.eval.cli import config_from_args

    monkeypatch.setattr(models, "resolve_model", lambda m: m)
    monkeypatch.setattr(harness, "default_generator", StandInGenerator)
    path, _ = _vector_file(tmp_path, "gguf", recommended=0.02)
    argv = ["eval", "toxicity", "--steer", path, "--prompts", prompts_file]
    cfg = config_from_args(build_parser().parse_args(argv))
    assert cfg.strengths == [-0.04, -0.02, 0.0, 0.02, 0.04]  # -2r, -r, 0, r, 2r
    assert cfg.baseline_strengths == [-10.0, -5.0, 0.0, 5.0, 10.0]  # the blacklist's own
    assert cfg.out.endswith("toxicity-calm")
    # the recorded command reproduces it
    import shlex

    assert config_from_args(build_parser().parse_args(shlex.split(cfg.command)[1:])) == cfg
    # tune: the candidates are multiples of the recommended strength
    rc = main(["tune", path, "--task", "toxicity", "--prompts", prompts_file, "--num-prompts",
               "2", "--samples", "1", "--toxicity-scorer", "standin-vtox", "--sentiment-scorer",
               "standin-vpos", "--out", str(tmp_path / "t"), "--dry-run", "--quiet"])
    assert rc == 0
    res = json.loads((tmp_path / "t" / "results.json").read_text())
    assert [c["strength"] for c in res["conditions"]] == [0, 0.005, 0.01, 0.02, 0.03, 0.04,
                                                          0.06]
    assert read_any_metadata(path).recommended_strength == 0.02  # --dry-run wrote nothing
    # a vector steer without a recommended strength has no scale: a clear refusal
    bare, _ = _vector_file(tmp_path, name="bare", recommended=None)
    assert main(["eval", "toxicity", "--steer", bare, "--prompts", prompts_file]) == 1
    err = capsys.readouterr().err
    assert "'bare' records no recommended_strength" in err and "give --strengths" in err
    assert main(["tune", bare, "--task", "toxicity", "--prompts", prompts_file]) == 1
    assert "give --strengths" in capsys.readouterr().err


def test_a_vector_run_reports_its_method_blocks_and_goals(tmp_path, prompts_file, monkeypatch):
    import vllm_steer.models as models

    monkeypatch.setattr(models, "resolve_model", lambda m: m)
    path, _ = _vector_file(tmp_path, layers=(1, 2, 3, 5), recommended=0.02)
    cfg = EvalConfig(task="toxicity", steers=[path], strengths=[0, 0.01, 0.02],
                     baseline="none", prompt_file=prompts_file, num_prompts=3,
                     sampling=SamplingConfig(samples=2, max_tokens=4),
                     out=str(tmp_path / "ev"), toxicity_scorer="standin-vtox",
                     sentiment_scorers=["standin-vpos"], progress=False)
    res = evaluate(cfg, StandInGenerator, log=lambda m: None)
    assert res["steers"]["calm"]["kind"] == "vector"
    by = {c["label"]: c for c in res["conditions"]}
    assert by["vector calm=+0.02"]["method"] == "vector"
    assert by["vector calm=+0.02"]["metrics"]["avg_max_toxicity"] == pytest.approx(0.5)
    # the goals are checked at the file's recommended strength, 0.02: 0.9 -> 0.5 is -44%
    g = res["goals"]
    assert g["detox_strength"] == 0.02
    assert g["relative_change"]["avg_max_toxicity"] == pytest.approx(0.5 / 0.9 - 1)
    assert g["relative_change"]["ppl"] == pytest.approx(0.16)
    md = (tmp_path / "ev" / "results.md").read_text()
    assert "vector steer, blocks 1-3, 5" in md
    assert "| vector | calm=+0.02 | 0.500 |" in md


def test_steers_that_do_not_fit_the_model_are_refused_before_the_engine_starts(
        tmp_path, prompts_file, tiny_model_dir):
    # the tiny model: hidden 64, 2 decoder blocks; an LM-Steer of hidden 32 and a vector
    # steer with a block 5 both refused, in one error, and no engine is made
    lm = str(tmp_path / "small.safetensors")
    save_steer(lm, random_steer(32, 4, "small"))
    vec, _ = _vector_file(tmp_path, layers=(1, 5))
    StandInGenerator.made.clear()
    cfg = EvalConfig(task="grid", model=str(tiny_model_dir), steers=[lm, vec],
                     strengths=[0, 1], grid_strengths=[0, 0.01], baseline="none",
                     prompt_file=prompts_file,
                     num_prompts=2, sampling=SamplingConfig(samples=1, max_tokens=4),
                     out=str(tmp_path / "ev"), toxicity_scorer="standin-vtox",
                     sentiment_scorers=["standin-vpos"], progress=False)
    with pytest.raises(ValueError) as e:
        evaluate(cfg, StandInGenerator, log=lambda m: None)
    msg = str(e.value)
    assert msg.startswith("the steers do not fit the model:")
    assert (f"{lm}: steer 'small' has hidden size 32 but the model {tiny_model_dir} has 64"
            in msg)
    assert f"{vec}: the steer has vectors for blocks 5 but the model has 2 decoder blocks" in msg
    assert StandInGenerator.made == []
    assert not (tmp_path / "ev").exists()  # no empty results folder left behind
    fits = str(tmp_path / "fits.safetensors")
    save_steer(fits, random_steer(HIDDEN, 4, "fits"))
    cfg.steers = [fits, _vector_file(tmp_path, name="calm2", layers=(0, 1))[0]]
    evaluate(cfg, StandInGenerator, log=lambda m: None)  # steers that fit run
    assert len(StandInGenerator.made) == 1


def test_grid_and_conditions_name_each_kind(tmp_path):
    lm = str(tmp_path / "detox.safetensors")
    save_steer(lm, random_steer(HIDDEN, 4, "detox"))
    cfg = EvalConfig(task="grid", strengths=[0, 4], grid_strengths=[0, 0.03])
    conds = build_conditions(cfg, ["detox", "calm"], None, {"detox": "lm-steer",
                                                             "calm": "vector"})
    assert [(c.method, c.steer) for c in conds] == [
        ("unsteered", {}), ("vector", {"calm": 0.03}), ("lm-steer", {"detox": 4.0}),
        ("lm-steer+vector", {"detox": 4.0, "calm": 0.03})]
    assert conds[-1].extra_args() == {"steer": {"detox": 4.0, "calm": 0.03}}


PROMPTS = ["The weather today is", "My favourite food is"]


def _hf_greedy(model_dir, vs, strength, prompts, max_tokens, chat_ids=None):
    """Greedy continuations from transformers with the vector added by forward hooks
    (vllm_steer.hf.vector_steering), decoded as vLLM decodes them."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from vllm_steer.hf import vector_steering

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    for i, p in enumerate(prompts):
        ids = chat_ids[i] if chat_ids is not None else tok(p)["input_ids"]
        x = torch.tensor([ids])
        with torch.no_grad(), vector_steering(model, vs, strength):
            for _ in range(max_tokens):
                nxt = int(model(input_ids=x).logits[0, -1].argmax())
                x = torch.cat([x, torch.tensor([[nxt]])], 1)
                if nxt == tok.eos_token_id:
                    break
        new = x[0, len(ids):].tolist()
        out.append(tok.decode(new, skip_special_tokens=True))
    return out


@pytest.mark.vllm
@pytest.mark.parametrize("mode", ["plain", "chat"])
def test_eval_serves_a_gguf_vector_as_transformers_applies_it(tiny_model_dir, tmp_path, mode):
    """The real engine, both toxicity scorers: a llama.cpp GGUF vector on block 1, greedy
    samples (top-p ~0) equal transformers' with the vector added to block 1's output; the
    unsteered samples in the same batch equal transformers' plain ones."""
    from transformers import AutoTokenizer

    from vllm_steer.cli import main
    from vllm_steer.eval.chat import chat_prompts

    path, vs = _vector_file(tmp_path, "gguf", name="calm", layers=(1,), scale=4.0,
                            recommended=1.0)
    pfile = tmp_path / "p.jsonl"
    pfile.write_text("\n".join(json.dumps({"prompt": p}) for p in PROMPTS))
    out = tmp_path / "run"
    rc = main(["eval", "toxicity", "--model", str(tiny_model_dir), "--steer", path,
               "--strengths=0,1.5", "--baseline", "none", "--prompts", str(pfile),
               "--samples", "1", "--max-tokens", "6", "--top-p", "1e-9", "--mode", mode,
               "--toxicity-scorer", "profanity-check", "--toxicity-scorer", "minilm-jigsaw",
               "--sentiment-scorer", "vader", "--data", str(tmp_path / "none"),
               "--out", str(out), "--max-num-seqs", "8", "--kv-cache-gib", "0.25", "--quiet"])
    assert rc == 0
    res = json.loads((out / "results.json").read_text())
    assert [c["label"] for c in res["conditions"]] == ["unsteered", "vector calm=+1.5"]
    for c in res["conditions"]:
        m = c["metrics"]
        assert 0 <= m["avg_max_toxicity"] <= 1 and 0 <= m["avg_max_toxicity_minilm-jigsaw"] <= 1
        assert m["ppl"] > 1
    gens = {}
    for line in (out / "generations.jsonl").read_text().splitlines():
        rec = json.loads(line)
        gens.setdefault(rec["condition"], []).append(rec["samples"][0]["text"])
    chat_ids = None
    if mode == "chat":
        tok = AutoTokenizer.from_pretrained(tiny_model_dir)
        chat_ids = chat_prompts(tok, PROMPTS, "chat")[2]
    want = _hf_greedy(tiny_model_dir, vs, 1.5, PROMPTS, 6, chat_ids)
    plain = _hf_greedy(tiny_model_dir, vs, 0.0, PROMPTS, 6, chat_ids)
    assert gens["vector calm=+1.5"] == want
    assert gens["unsteered"] == plain
    assert want != plain  # the vector changed the tokens
    md = (out / "results.md").read_text()
    assert "| vector | calm=+1.5 |" in md and "vector steer, blocks 1" in md
