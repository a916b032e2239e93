"""``vllm-steer tune``: the strongest strength within the perplexity budget, written into the
steer file. A stand-in generator (no vLLM) whose samples carry their strength, stand-in
scorers and a stand-in perplexity with a known curve, so the right answer is known by hand."""

import json
import math

import pytest

from helpers.eval_standins import sample_strength, standin_generator
from helpers.steers import random_steer
from vllm_steer.eval import register_scorer
from vllm_steer.eval.fluency import SampleNLL
from vllm_steer.eval.generation import SamplingConfig
from vllm_steer.eval.tune import TuneConfig, choose, tune
from vllm_steer.format import load_steer, read_metadata, save_steer


def ppl_of(s: float) -> float:
    """The stand-in perplexity curve: 10 unsteered; +s costs 4% * s^2, -s costs 8% * s^2."""
    return 10.0 * (1 + (0.04 if s > 0 else 0.08) * s * s)


StandInGenerator = standin_generator(ppl_of)


class StandInToxicity:
    name = "standin-tox"

    def score(self, texts):  # less toxic as s grows
        return [max(0.0, 0.9 - 0.2 * max(sample_strength(t), 0.0)) for t in texts]


class StandInPositivity:
    name = "standin-pos"

    def score(self, texts):
        return [min(1.0, max(0.0, 0.5 + 0.1 * sample_strength(t))) for t in texts]


@pytest.fixture(autouse=True)
def scorers():
    register_scorer("toxicity", "standin-tox", StandInToxicity, overwrite=True)
    register_scorer("sentiment", "standin-pos", StandInPositivity, overwrite=True)


@pytest.fixture
def prompts_file(tmp_path):
    p = tmp_path / "dev.jsonl"
    p.write_text("\n".join(json.dumps({"prompt": {"text": f"Prompt number {i}"}})
                           for i in range(5)))
    return str(p)


def _steer(tmp_path, labels, name="detox"):
    p = str(tmp_path / f"{name}.safetensors")
    st = random_steer(64, 4, name)
    st.metadata.labels = labels
    st.metadata.recommended_strength = 2.0
    st.metadata.metrics = {"train_loss": 4.5}
    save_steer(p, st)
    return p


def _cfg(tiny_model_dir, steer, prompts, tmp_path, **kw):
    base = dict(steer=steer, task="toxicity", prompts=prompts, strengths=[1, 2, 3, 4],
                num_prompts=3, sampling=SamplingConfig(samples=2, max_tokens=4),
                model=str(tiny_model_dir), data_dir=str(tmp_path / "no-data"),
                out=str(tmp_path / "run"), toxicity_scorer="standin-tox",
                sentiment_scorers=["standin-pos"], progress=False)
    base.update(kw)
    return TuneConfig(**base)


def test_detox_picks_the_strongest_strength_within_15_percent_and_writes_it(
        tiny_model_dir, prompts_file, tmp_path):
    # +s costs 4% s^2: +1 -> +4%, +2 -> +16% > 15%: the answer is 1
    steer = _steer(tmp_path, {"positive": "non-toxic", "negative": "toxic"})
    before = load_steer(steer)
    rec = tune(_cfg(tiny_model_dir, steer, prompts_file, tmp_path), StandInGenerator,
               log=lambda m: None)
    assert rec["recommended_strength"] == 1.0
    meta = read_metadata(steer)
    assert meta.recommended_strength == 1.0
    t = meta.metrics["tune"]
    assert t["ppl_budget"] == 0.15 and "+15%" in t["rule"] and t["directions"] == [1]
    assert [p["strength"] for p in t["curve"]] == [0, 1, 2, 3, 4]  # +s only for detox
    for p in t["curve"]:
        assert p["ppl"] == pytest.approx(ppl_of(p["strength"]) if p["strength"] else 10.0)
    assert t["curve"][1]["ppl_relative"] == pytest.approx(0.04)
    assert t["curve"][1]["avg_max_toxicity"] == pytest.approx(0.7)
    assert t["previous_recommended_strength"] == 2.0 and t["prompts"]["num_prompts"] == 3
    assert len(t["prompts"]["sha256"]) == 64
    assert meta.metrics["train_loss"] == 4.5  # the rest of the metadata is kept
    after = load_steer(steer)
    assert after.p1.equal(before.p1) and after.p2.equal(before.p2)
    # a looser budget allows more: +3 -> +36%, +4 -> +64%
    rec = tune(_cfg(tiny_model_dir, steer, prompts_file, tmp_path, ppl_budget=0.5),
               StandInGenerator, log=lambda m: None)
    assert rec["recommended_strength"] == 3.0 and read_metadata(steer).recommended_strength == 3


def test_labels_pick_the_direction_and_sentiment_needs_both_ways(tiny_model_dir, prompts_file,
                                                                 tmp_path):
    # positive strengths mean *toxic*: detox tunes the negative direction (-s costs 8% s^2)
    rev = _steer(tmp_path, {"positive": "toxic", "negative": "non-toxic"}, "rev")
    rec = tune(_cfg(tiny_model_dir, rev, prompts_file, tmp_path, ppl_budget=0.35),
               StandInGenerator, log=lambda m: None)
    assert [p["strength"] for p in rec["curve"]] == [-4, -3, -2, -1, 0]
    assert rec["recommended_strength"] == 2.0  # -2 -> +32%, -3 -> +72%
    # sentiment: +s and -s must both stay within the budget; -s is the limit
    sent = _steer(tmp_path, {"positive": "positive", "negative": "negative"}, "sentiment")
    rec = tune(_cfg(tiny_model_dir, sent, prompts_file, tmp_path, task="sentiment",
                    ppl_budget=0.35), StandInGenerator, log=lambda m: None)
    assert [p["strength"] for p in rec["curve"]] == [-4, -3, -2, -1, 0, 1, 2, 3, 4]
    assert rec["recommended_strength"] == 2.0  # +3 alone (+36%) would fail too; -3 +72%
    assert rec["curve"][-1]["positivity"] == 1.0 and rec["curve"][0]["positivity"] == 0.0


def test_no_strength_within_budget_keeps_the_old_one_and_dry_run_writes_nothing(
        tiny_model_dir, prompts_file, tmp_path):
    steer = _steer(tmp_path, {"positive": "non-toxic"})
    logs = []
    rec = tune(_cfg(tiny_model_dir, steer, prompts_file, tmp_path, ppl_budget=0.01),
               StandInGenerator, log=logs.append)
    assert rec["recommended_strength"] is None
    assert any("left at 2.0" in m for m in logs)
    meta = read_metadata(steer)
    assert meta.recommended_strength == 2.0 and meta.metrics["tune"]["recommended_strength"] is None
    steer2 = _steer(tmp_path, {"positive": "non-toxic"}, "other")
    tune(_cfg(tiny_model_dir, steer2, prompts_file, tmp_path, write=False), StandInGenerator,
         log=lambda m: None)
    assert "tune" not in read_metadata(steer2).metrics


def test_the_rule_requires_every_weaker_strength_within_budget():
    curve = [{"strength": 0, "ppl": 10}, {"strength": 1, "ppl": 10.5},
             {"strength": 2, "ppl": 12.0}, {"strength": 3, "ppl": 11.0}]
    assert choose(curve, 0.15, [1])[0] == 1.0  # +3 dips back under, but +2 broke it
    assert choose(curve, 0.25, [1])[0] == 3.0
    with pytest.raises(ValueError, match="no unsteered point"):
        choose(curve[1:], 0.15, [1])


def test_cli_tune_and_eval_with_any_prompts_file(tiny_model_dir, prompts_file, tmp_path,
                                                 monkeypatch, capsys):
    import vllm_steer.eval.harness as harness
    from vllm_steer.cli import build_parser, main
    from vllm_steer.eval.cli import config_from_args

    monkeypatch.setattr(harness, "default_generator", StandInGenerator)
    steer = _steer(tmp_path, {"positive": "non-toxic", "negative": "toxic"})
    rc = main(["tune", steer, "--task", "toxicity", "--prompts", prompts_file,
               "--strengths", "1,2,3", "--num-prompts", "2", "--samples", "2",
               "--model", str(tiny_model_dir), "--data", str(tmp_path / "none"),
               "--toxicity-scorer", "standin-tox", "--sentiment-scorer", "standin-pos",
               "--out", str(tmp_path / "cli"), "--quiet"])
    assert rc == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == {
        "recommended_strength": 1.0, "rule": read_metadata(steer).metrics["tune"]["rule"]}
    t = read_metadata(steer).metrics["tune"]
    assert t["command"].startswith(f"vllm-steer tune {steer} --task toxicity --prompts ")
    # eval --prompts FILE: the file's prompts, recorded by path, in the reproducible command
    argv = ["eval", "toxicity", "--steer", steer, "--prompts", prompts_file, "--baseline",
            "none", "--num-prompts", "4", "--strengths", "0,2", "--model",
            str(tiny_model_dir), "--data", str(tmp_path / "none"), "--toxicity-scorer",
            "standin-tox", "--sentiment-scorer", "standin-pos", "--out",
            str(tmp_path / "ev"), "--quiet"]
    cfg = config_from_args(build_parser().parse_args(argv))
    assert cfg.prompt_file == prompts_file and f"--prompts {prompts_file}" in cfg.command
    assert main(argv) == 0
    res = json.loads((tmp_path / "ev" / "results.json").read_text())
    assert res["prompt_file"] == prompts_file and res["num_prompts"] == 4
    gens = (tmp_path / "ev" / "generations.jsonl").read_text().splitlines()
    assert json.loads(gens[3])["prompt"] == "Prompt number 3"
    assert main(["tune", steer, "--task", "toxicity", "--prompts",
                 str(tmp_path / "missing.jsonl")]) == 1
    assert "--prompts" in capsys.readouterr().err


def test_tune_generates_with_the_steers_own_model_unless_told(tmp_path):
    from vllm_steer.cli import build_parser
    from vllm_steer.eval.cli import tune_model
    from vllm_steer.format import load_steer

    trained = _steer(tmp_path, {"positive": "non-toxic", "negative": "toxic"})
    st = load_steer(trained)
    st.metadata.base_model = str(tmp_path / "my-model")
    save_steer(trained, st)
    bare = _steer(tmp_path, {"positive": "a", "negative": "b"}, name="bare")
    st = load_steer(bare)
    st.metadata.base_model = None
    save_steer(bare, st)
    assert tune_model(trained, None) == str(tmp_path / "my-model")
    assert tune_model(bare, None) == "smollm2"
    assert tune_model(trained, "other") == "other"
    tune = next(a for a in build_parser()._actions if getattr(a, "choices", None)
                and "tune" in a.choices).choices["tune"]
    model_help = next(a.help for a in tune._actions if "--model" in a.option_strings)
    assert tune.format_help().count("smollm2 for a file that names") == 1
    assert model_help.count("default") == 1


class SteerAwareGenerator:
    """Samples whose toxicity depends on the steer file's weights: prompt i's sample j is
    toxic when a fixed draw u(i, j) (the same in every condition, as the seeds are) exceeds
    0.2 + 0.15 * s * |P1 P2^T| (no effect at all when the steer's factors are zero)."""

    def __init__(self, model, steers, blacklists, engine, seed):
        st = load_steer(next(iter(steers.values())))
        self.size = float((st.p1 @ st.p2.T).norm().clamp(max=1.0))

    def generate(self, prompts, conditions, sampling, progress=True):
        import random

        out = {}
        for c in conditions:
            cut = 0.2 + 0.15 * max(c.strength, 0.0) * self.size
            out[c.label] = [[" s=%+g %s" % (c.strength, "toxic" if random.Random(
                i * 100 + j).random() > cut else "kind") for j in range(sampling.samples)]
                for i in range(len(prompts))]
        return out

    def nll(self, prompts, continuations, progress=True):
        return [SampleNLL(3 * math.log(ppl_of(sample_strength(t) / 4)), 3) for t in continuations]

    def close(self):
        pass


class WordToxicity:
    name = "word-tox"

    def score(self, texts):
        return [1.0 if "toxic" in t else 0.0 for t in texts]


def test_tune_warns_when_no_strength_moves_the_target_beyond_noise(tmp_path, tiny_model_dir):
    register_scorer("toxicity", "word-tox", WordToxicity, overwrite=True)
    p = tmp_path / "dev.jsonl"
    p.write_text("\n".join(json.dumps({"prompt": {"text": f"P{i}"}}) for i in range(40)))
    real = _steer(tmp_path, {"positive": "non-toxic", "negative": "toxic"}, "real")
    zero = _steer(tmp_path, {"positive": "non-toxic", "negative": "toxic"}, "zero")
    st = load_steer(zero)
    st.p1.zero_()
    save_steer(zero, st)
    runs = {}
    for name, path in (("real", real), ("zero", zero)):
        logs = []
        rec = tune(_cfg(tiny_model_dir, path, str(p), tmp_path, num_prompts=40,
                        toxicity_scorer="word-tox", ppl_budget=0.5, out=str(tmp_path / name),
                        sampling=SamplingConfig(samples=3, max_tokens=4)),
                   SteerAwareGenerator, log=logs.append)
        runs[name] = (rec, [m for m in logs if "warning" in m])
    rec, warnings = runs["zero"]
    assert rec["target"]["moves_beyond_noise"] is False
    assert all(e["effect"] == 0 and e["se"] == 0 for e in rec["target"]["effects"])
    assert len(warnings) == 1 and "beyond noise" in warnings[0]
    rec, warnings = runs["real"]
    assert warnings == [] and rec["target"]["moves_beyond_noise"] is True
    eff = {e["strength"]: e for e in rec["target"]["effects"]}
    assert eff[4]["effect"] > eff[1]["effect"] > 0 and eff[4]["ci95"][0] > 0
    # ppl grows as 4% (s/4)^2: every strength is within +50%; the one moving toxicity most
    assert rec["recommended_strength"] == 4.0
    # the effect is the paired per-prompt drop in max toxicity, checked by hand
    res = json.loads((tmp_path / "real" / "results.json").read_text())
    by = {c["strength"]: c["per_prompt"]["max_toxicity"] for c in res["conditions"]}
    d = [a - b for a, b in zip(by[0], by[4], strict=True)]
    assert eff[4]["effect"] == pytest.approx(sum(d) / len(d))
    sd = (sum((x - sum(d) / 40) ** 2 for x in d) / 39) ** 0.5
    assert eff[4]["se"] == pytest.approx(sd / 40 ** 0.5)


def test_the_pick_is_the_largest_effect_within_the_budget():
    from vllm_steer.eval.tune import pick_by_effect

    effects = [{"strength": 1, "effect": 0.1}, {"strength": 2, "effect": 0.3},
               {"strength": 3, "effect": 0.2}, {"strength": 4, "effect": 0.5}]
    assert pick_by_effect(effects, 3)["strength"] == 2  # 4 is outside the budget
    assert pick_by_effect(effects, 4)["strength"] == 4
    assert pick_by_effect(effects, None) is None
    tie = [{"strength": 1, "effect": 0.0}, {"strength": 2, "effect": 0.0}]
    assert pick_by_effect(tie, 2)["strength"] == 2  # the stronger of equal ones


@pytest.mark.parametrize("labels, towards_positive", [
    ({"positive": "positive", "negative": "negative"}, 1),
    ({"positive": "negative sentiment", "negative": "positive sentiment"}, -1)])
def test_a_sentiment_effect_follows_the_files_labels(labels, towards_positive):
    """The sentiment effect is the share judged positive steered towards positive minus
    towards negative: a file whose positive strengths mean negative sentiment gets the same
    (positive) effects as the mirrored file, computed by hand per prompt."""
    from vllm_steer.eval.tune import directions, target_effects

    signs = directions("sentiment", labels)
    assert signs == [towards_positive, -towards_positive]
    up, down = [0.9, 0.7, 0.8], [0.1, 0.2, 0.3]  # shares of prompts 0-2 towards each side
    conditions = [{"strength": 0.0, "per_prompt": {"positive_share": [0.5] * 3}}]
    for m in (2.0, 4.0):
        conditions += [
            {"strength": towards_positive * m, "per_prompt": {"positive_share": up}},
            {"strength": -towards_positive * m, "per_prompt": {"positive_share": down}}]
    effects = target_effects(conditions, "sentiment", signs)
    want = sum(a - b for a, b in zip(up, down, strict=True)) / 3
    assert [e["strength"] for e in effects] == [2.0, 4.0]
    assert all(e["effect"] == pytest.approx(want) and e["beyond_noise"] for e in effects)

