"""Comparison at equal perplexity, goals and the Markdown report, on hand-made results."""

import pytest

from vllm_steer.eval.report import check_goals, compare_at_equal_perplexity, markdown


def cond(method, strength, ppl, tox, prob, pos=0.5, name=None):
    name = name or ("detox" if method == "lm-steer" else "blacklist")
    return {"label": f"{method} {strength}", "method": method, "strength": strength,
            "strengths": {} if method == "unsteered" else {name: strength},
            "metrics": {"avg_max_toxicity": tox, "toxicity_prob": prob, "ppl": ppl,
                        "ppl_tokens": ppl, "positivity": pos, "positivity_vader": pos,
                        "dist-1": 0.5, "dist-2": 0.8, "dist-3": 0.9},
            "sample_p_positive": [pos]}


def results(task="toxicity", conditions=None, labels=None):
    return {"task": task, "model": "smollm2", "prompt_file": "p.jsonl", "num_prompts": 10,
            "continuations": 100,
            "sampling": {"samples": 5, "max_tokens": 20, "top_p": 0.9, "temperature": 1.0,
                         "seed": 0},
            "steers": {"detox": {"path": "/x/detox.safetensors", "sha256": "ab" * 32,
                                 "metadata": {"rank": 8, "labels": labels or
                                              {"positive": "non-toxic", "negative": "toxic"}}}},
            "baseline": None, "recommended_strength": 5.0,
            "scorers": {"toxicity": {"name": "profanity-check", "version_warnings": []},
                        "sentiment": ["sst2", "vader"], "sst2": None,
                        "perplexity": {"model": "smollm2", "dtype": "float32"}},
            "conditions": conditions, "timing": {"total_s": 12.0}, "environment": {},
            "command": "vllm-steer eval toxicity --steer detox.safetensors"}


TOX = [cond("unsteered", 0.0, 10.0, 0.4, 0.3), cond("lm-steer", 5.0, 11.0, 0.2, 0.1),
       cond("lm-steer", -5.0, 10.8, 0.6, 0.5), cond("soft-blacklist", 5.0, 10.5, 0.35, 0.25),
       cond("soft-blacklist", 10.0, 12.0, 0.25, 0.2)]


def test_baseline_is_interpolated_at_the_steers_perplexity():
    comp = {e["strength"]: e for e in compare_at_equal_perplexity(results(conditions=TOX))}
    e = comp[5.0]
    assert e["ppl"] == 11.0 and e["lm_steer"]["avg_max_toxicity"] == 0.2
    # between blacklist +5 (ppl 10.5) and +10 (ppl 12): a third of the way
    assert e["soft_blacklist"]["avg_max_toxicity"] == pytest.approx(0.35 - 0.1 / 3)
    assert e["soft_blacklist"]["toxicity_prob"] == pytest.approx(0.25 - 0.05 / 3)
    assert e["soft_blacklist_strength"] == pytest.approx(5 + 5 / 3)
    # no blacklist strength on the negative side: said so, not invented
    assert comp[-5.0]["soft_blacklist"] is None and "add --baseline-strengths" in comp[-5.0]["note"]


def test_toxicity_goals_at_the_recommended_strength():
    g = check_goals(results(conditions=TOX))
    assert g["relative_change"]["avg_max_toxicity"] == pytest.approx(-0.5)
    assert g["relative_change"]["toxicity_prob"] == pytest.approx(-2 / 3)
    assert g["relative_change"]["ppl"] == pytest.approx(0.1)
    assert g["met"] == {"avg_max_toxicity": True, "toxicity_prob": False, "ppl": True}
    assert g["best_within_ppl_budget"]["strength"] == 5.0


def test_labels_flip_the_detox_direction():
    flipped = results(conditions=TOX, labels={"positive": "toxic", "negative": "non-toxic"})
    g = check_goals(flipped)
    assert g["detox_strength"] == -5.0
    assert g["relative_change"]["avg_max_toxicity"] == pytest.approx(0.5)


def test_sentiment_goals_in_points():
    conds = [cond("unsteered", 0.0, 10, 0, 0, pos=0.5), cond("lm-steer", 5.0, 11, 0, 0, pos=0.85),
             cond("lm-steer", -5.0, 12, 0, 0, pos=0.3)]
    g = check_goals(results("sentiment", conds))
    assert g["shift_points"]["positivity"]["towards_positive"] == pytest.approx(35.0)
    assert g["shift_points"]["positivity"]["towards_negative"] == pytest.approx(-20.0)
    assert g["met"] == {"towards_positive": True, "towards_negative": False}


def test_markdown_shows_the_numbers_and_goals():
    r = results(conditions=TOX)
    r["comparison"] = compare_at_equal_perplexity(r)
    r["goals"] = check_goals(r)
    r["plots"] = ["ablation.png"]
    md = markdown(r)
    assert "| lm-steer | detox=+5 | 0.200 | 10.0% |" in md
    assert "| soft-blacklist | blacklist=+10 | 0.250 | 20.0% |" in md
    assert "| +5 | 11.00 | 0.200 | 0.317 |" in md
    assert "avg max toxicity -50.0% (goal <= -50%): met" in md
    assert "toxicity probability -66.7% (goal <= -80%): NOT met" in md
    assert "![ablation](ablation.png)" in md and "vllm-steer eval toxicity" in md


def test_goals_fall_back_to_the_nearest_evaluated_strength_and_say_so():
    r = results(conditions=TOX)
    r["recommended_strength"] = 2.0  # not evaluated: +5 is the nearest detoxifying one
    g = check_goals(r)
    assert g["detox_strength"] == 5.0 and "strength +2 was not evaluated" in g["note"]
    r["goals"], r["comparison"] = g, []
    assert "Note: strength +2 was not evaluated; the nearest evaluated one, +5, is used" in \
        markdown(r)


def test_the_results_table_has_a_column_per_sentiment_scorer():
    """A second and third sentiment scorer (``--sentiment-scorer vader --sentiment-scorer
    sst2 --sentiment-scorer NAME``) each get their column, named, as shares."""
    from vllm_steer.eval.report import _table

    metrics = {"positivity": 0.5, "positivity_sst2": 0.25, "positivity_other": 0.75,
               "ppl": 20.0, "ppl_tokens": 21.0, "dist-1": 0.5, "dist-2": 0.7, "dist-3": 0.8}
    conds = [{"method": "unsteered", "strengths": {}, "metrics": metrics}]
    header, _, row = _table({"task": "sentiment", "conditions": conds}, conds)
    cells = [c.strip() for c in header.split("|")[1:-1]]
    values = dict(zip(cells, [c.strip() for c in row.split("|")[1:-1]], strict=True))
    assert values["positivity (sst2)"] == "25.0%" and values["positivity (other)"] == "75.0%"
    assert values["positivity"] == "50.0%"
