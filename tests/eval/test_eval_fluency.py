"""Perplexity of continuations given prompts, checked against an independent computation."""

import math

import pytest
import torch

from vllm_steer.eval.fluency import PerplexityScorer, SampleNLL, perplexity_metrics


@pytest.fixture(scope="module")
def scorer(tiny_model_dir):
    return PerplexityScorer(str(tiny_model_dir), dtype="float32", batch_size=2)


def _independent_nll(scorer, prompt, cont):
    """Sum of -log p(continuation tokens | prompt) from one plain forward pass."""
    tok, model = scorer.tokenizer, scorer.model
    a = tok(prompt, add_special_tokens=False)["input_ids"]
    b = tok(cont, add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        logits = model(torch.tensor([a + b])).logits[0].double()
    lp = torch.log_softmax(logits, -1)
    return -sum(lp[len(a) - 1 + i, t].item() for i, t in enumerate(b)), len(b)


def test_perplexity_is_exp_of_mean_nll_computed_independently(scorer):
    prompts = ["The weather today", "Once upon a time", "The weather today"]
    conts = [" is sunny and warm.", " there was a dragon who liked tea", " rain"]
    got = scorer.nll(prompts, conts, progress=False)
    ref = [_independent_nll(scorer, p, c) for p, c in zip(prompts, conts, strict=True)]
    for g, (s, n) in zip(got, ref, strict=True):
        assert g.tokens == n
        assert g.nll_sum == pytest.approx(s, rel=1e-4)
        assert g.ppl == pytest.approx(math.exp(s / n), rel=1e-4)
    m = perplexity_metrics(got)
    assert m["ppl"] == pytest.approx(sum(math.exp(s / n) for s, n in ref) / 3, rel=1e-4)
    assert m["ppl_tokens"] == pytest.approx(
        math.exp(sum(s for s, _ in ref) / sum(n for _, n in ref)), rel=1e-4)
    assert m["empty_samples"] == 0


def test_order_is_kept_despite_length_sorting(scorer):
    prompts = ["A", "A much longer prompt that has many more tokens than the others", "B c"]
    conts = [" one two three four five six seven", " x", " y z"]
    batched = scorer.nll(prompts, conts, progress=False)
    alone = [scorer.nll([p], [c], progress=False)[0] for p, c in zip(prompts, conts, strict=True)]
    assert [x.tokens for x in batched] == [x.tokens for x in alone]
    assert [x.nll_sum for x in batched] == pytest.approx([x.nll_sum for x in alone], rel=1e-4)


def test_empty_continuations_are_left_out_and_counted():
    m = perplexity_metrics([SampleNLL(2.0, 2), SampleNLL(0.0, 0)])
    assert m["ppl"] == pytest.approx(math.e) and m["empty_samples"] == 1
    assert math.isnan(perplexity_metrics([SampleNLL(0.0, 0)])["ppl"])


def test_mismatched_lengths_are_refused(scorer):
    with pytest.raises(ValueError, match="2 prompts but 1 continuations"):
        scorer.nll(["a", "b"], ["c"])
