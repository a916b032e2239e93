"""`vllm-steer eval rescore`: a finished run's samples scored by another toxicity scorer,
without generating again."""

import json

import numpy as np
import pytest

from vllm_steer.eval import register_scorer
from vllm_steer.eval.rescore import bootstrap_ci, rescore
from vllm_steer.eval.toxicity import toxicity_metrics


class Length:
    """A stand-in scorer: longer texts are 'more toxic'."""

    name = "length"

    def score(self, texts):
        return [min(1.0, len(t) / 20) for t in texts]


# condition -> per prompt its samples' texts
RUN = {"unsteered": [["a" * 18, "b" * 4], ["c" * 12, "d" * 25], ["e", "f" * 9]],
       "lm-steer detox=+5": [["g" * 2, "h" * 3], ["i" * 11, ""], ["j" * 5, "k" * 6]]}


def _write_run(path):
    path.mkdir()
    with open(path / "generations.jsonl", "w") as f:
        for cond, prompts in RUN.items():
            for i, samples in enumerate(prompts):
                f.write(json.dumps({"condition": cond, "prompt_index": i, "prompt": f"P{i}",
                                    "samples": [{"text": t, "toxicity": 0.01, "ppl": 3.0}
                                                for t in samples]}) + "\n")
    return path


@pytest.fixture
def own_registry(monkeypatch):
    """The toxicity scorers registered by a test are gone after it."""
    from vllm_steer.eval import scorers

    monkeypatch.setitem(scorers._REGISTRY, "toxicity", dict(scorers._REGISTRY["toxicity"]))


def test_rescore_adds_the_scores_and_the_metrics_of_a_direct_computation(tmp_path, capsys,
                                                                         own_registry):
    from vllm_steer.cli import main

    register_scorer("toxicity", "length", Length, overwrite=True)
    run = _write_run(tmp_path / "run")
    assert main(["eval", "rescore", str(run), "--toxicity-scorer", "length", "--quiet"]) == 0
    recs = [json.loads(x) for x in (run / "generations.jsonl").read_text().splitlines()]
    assert [r["condition"] for r in recs] == ["unsteered"] * 3 + ["lm-steer detox=+5"] * 3
    for r in recs:
        for s in r["samples"]:
            assert s["toxicity_length"] == min(1.0, len(s["text"]) / 20)
            assert s["toxicity"] == 0.01 and s["ppl"] == 3.0  # the rest unchanged
    doc = json.loads((run / "rescore-length.json").read_text())
    for cond, prompts in RUN.items():
        scores = [[min(1.0, len(t) / 20) for t in p] for p in prompts]
        want = toxicity_metrics(scores)
        got = doc["conditions"][cond]
        for k in ("avg_max_toxicity", "toxicity_prob", "mean_toxicity"):
            assert got[k] == pytest.approx(want[k])
            lo, hi = got[k + "_ci95"]
            assert lo <= want[k] <= hi
        assert got["prompts"] == 3 and got["samples"] == 6
    # unsteered: maxes 0.9, 1.0, 0.45 -> avg 0.7833, prob 2/3
    assert doc["conditions"]["unsteered"]["avg_max_toxicity"] == pytest.approx(2.35 / 3)
    assert doc["conditions"]["unsteered"]["toxicity_prob"] == pytest.approx(2 / 3)
    out = capsys.readouterr().out
    assert "| unsteered | 0.783 [" in out and "| lm-steer detox=+5 | 0.333 [" in out


def test_the_bootstrap_interval_is_an_independent_resampling_of_prompts():
    scores = [[0.9, 0.2], [1.0, 0.3], [0.45, 0.05], [0.1, 0.7]]
    ci = bootstrap_ci(scores, n=500, seed=3)
    rng = np.random.default_rng(3)
    draws = rng.integers(0, 4, size=(500, 4))
    maxes = np.array([0.9, 1.0, 0.45, 0.7])
    amt = [maxes[d].mean() for d in draws]
    prob = [(maxes[d] > 0.5).mean() for d in draws]
    assert ci["avg_max_toxicity"] == pytest.approx(list(np.percentile(amt, [2.5, 97.5])))
    assert ci["toxicity_prob"] == pytest.approx(list(np.percentile(prob, [2.5, 97.5])))


def test_a_run_with_results_gets_the_metrics_beside_the_headline(tmp_path, monkeypatch,
                                                                 own_registry):
    """With a results.json, the rescored metrics join each condition's (suffixed by the
    scorer's name, as with a second --toxicity-scorer), and the report is rewritten."""
    import vllm_steer.eval.harness as harness

    register_scorer("toxicity", "length", Length, overwrite=True)
    run = _write_run(tmp_path / "run")
    results = {"scorers": {"toxicity": {"name": "profanity-check", "more": []}},
               "conditions": [{"label": c, "metrics": {"avg_max_toxicity": 0.01}}
                              for c in RUN]}
    (run / "results.json").write_text(json.dumps(results))
    written = []
    monkeypatch.setattr(harness, "write_outputs", lambda r, out: written.append((r, out)))
    rescore(str(run), ["length"], progress=False, log=lambda m: None)
    (doc, out), = written
    assert out == str(run) and doc["scorers"]["toxicity"]["more"] == ["length"]
    m = {c["label"]: c["metrics"] for c in doc["conditions"]}
    assert m["unsteered"]["avg_max_toxicity"] == 0.01  # the headline's, as measured
    assert m["unsteered"]["avg_max_toxicity_length"] == pytest.approx(2.35 / 3)
    assert m["lm-steer detox=+5"]["toxicity_prob_length"] == pytest.approx(1 / 3)
    assert doc["rescored"] == [{"scorer": "length", "file": "rescore-length.json"}]


def test_a_folder_without_generations_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="generations.jsonl"):
        rescore(str(tmp_path), ["profanity-check"], progress=False)
