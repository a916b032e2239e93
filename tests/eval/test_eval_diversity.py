"""dist-n: exact values on hand-made samples (DExperts formula: distinct n-grams / words)."""

import pytest

from vllm_steer.eval.diversity import distinct_n, diversity_metrics


def test_distinct_n_exact_values():
    samples = ["the cat sat", "the cat ran"]  # 6 words
    assert distinct_n(samples, 1) == pytest.approx(4 / 6)  # the, cat, sat, ran
    assert distinct_n(samples, 2) == pytest.approx(3 / 6)  # the cat, cat sat, cat ran
    assert distinct_n(samples, 3) == pytest.approx(2 / 6)  # the cat sat, the cat ran


def test_ngrams_do_not_cross_samples_and_whitespace_splits():
    # "a b" + "c" would give the bigram "b c" if samples were joined; they are not
    assert distinct_n(["a  b", " c\n"], 2) == pytest.approx(1 / 3)
    assert distinct_n(["x x x x"], 1) == pytest.approx(1 / 4)


def test_empty_samples_give_zero_and_bad_n_is_refused():
    assert distinct_n(["", "  "], 1) == 0.0
    with pytest.raises(ValueError, match="n >= 1"):
        distinct_n(["a"], 0)


def test_diversity_metrics_average_over_prompts():
    m = diversity_metrics([["a b", "a b"], ["a b c", "d e f"]])
    # prompt 1: dist-1 = 2/4, dist-2 = 1/4, dist-3 = 0; prompt 2: 6/6, 4/6, 2/6
    assert m["dist-1"] == pytest.approx((0.5 + 1.0) / 2)
    assert m["dist-2"] == pytest.approx((0.25 + 4 / 6) / 2)
    assert m["dist-3"] == pytest.approx((0.0 + 2 / 6) / 2)
    with pytest.raises(ValueError, match="no prompts"):
        diversity_metrics([])
