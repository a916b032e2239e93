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


@pytest.fixture(scope="module")
def bos_model_dir(tiny_model_dir, tmp_path_factory):
    """The tiny model with a tokenizer that adds BOS before every text (as Llama's does)."""
    import shutil

    from helpers.models import add_bos

    out = tmp_path_factory.mktemp("tiny-bos") / "model"
    shutil.copytree(tiny_model_dir, out)
    return add_bos(out)


def _nll_of_ids(model, prompt_ids, cont_ids):
    """Sum of -log p(cont | prompt ids) from one plain forward pass of the model."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids + cont_ids])).logits[0].double()
    lp = torch.log_softmax(logits, -1)
    return -sum(lp[len(prompt_ids) - 1 + i, t].item() for i, t in enumerate(cont_ids))


def test_a_text_prompt_is_scored_after_the_bos_the_model_was_given(bos_model_dir):
    """A Llama-style tokenizer puts BOS before a text prompt (vLLM generates after it): the
    continuation is scored given BOS + prompt, and a templated prompt (which carries its own
    special tokens) is scored as it is."""
    scorer = PerplexityScorer(str(bos_model_dir), dtype="float32", batch_size=2)
    tok = scorer.tokenizer
    bos = tok.bos_token_id
    prompts, conts = ["The weather today", "Once"], [" is sunny and warm.", " upon a time"]
    got = scorer.nll(prompts, conts, progress=False)
    plain = scorer.nll(prompts, conts, progress=False, special_tokens=False)
    for p, c, g, q in zip(prompts, conts, got, plain, strict=True):
        a = tok(p, add_special_tokens=False)["input_ids"]
        b = tok(c, add_special_tokens=False)["input_ids"]
        assert g.tokens == q.tokens == len(b)
        with_bos = _nll_of_ids(scorer.model, [bos] + a, b)
        assert g.nll_sum == pytest.approx(with_bos, rel=1e-4)
        assert q.nll_sum == pytest.approx(_nll_of_ids(scorer.model, a, b), rel=1e-4)
        assert abs(with_bos - q.nll_sum) > 1e-3  # the BOS changes the score


def test_the_engine_scores_a_text_prompt_after_the_bos_it_generated_after(bos_model_dir):
    """The vLLM backend's prompt logprobs are asked for BOS + prompt + continuation (what
    vLLM generated from, tokenising the text prompt); an engine that answers from the model's
    own weights gives the independent score."""
    from types import SimpleNamespace

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from vllm_steer.eval.generation import VLLMGenerator

    tok = AutoTokenizer.from_pretrained(bos_model_dir)
    model = AutoModelForCausalLM.from_pretrained(bos_model_dir, dtype=torch.float32).eval()
    asked = []

    class Engine:
        def get_tokenizer(self):
            return tok

        def generate(self, prompts, params, use_tqdm=False):
            outs = []
            for p in prompts:
                ids = list(p["prompt_token_ids"])
                asked.append(ids)
                with torch.no_grad():
                    lp = torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), -1)
                plp = [None] + [{t: SimpleNamespace(logprob=lp[k - 1, t].item())}
                                for k, t in enumerate(ids) if k]
                outs.append(SimpleNamespace(prompt_token_ids=ids, prompt_logprobs=plp))
            return outs

    gen = VLLMGenerator.__new__(VLLMGenerator)
    gen.llm = Engine()
    prompt, cont = "The weather today", " is sunny"
    (got,) = gen.nll([prompt], [cont], progress=False)
    a = tok(prompt)["input_ids"]  # as vLLM tokenises a text prompt
    b = tok(cont, add_special_tokens=False)["input_ids"]
    assert a[0] == tok.bos_token_id and asked == [a + b]
    assert got.tokens == len(b)
    assert got.nll_sum == pytest.approx(_nll_of_ids(model, a, b), rel=1e-6)


def test_a_scorer_dtype_is_honoured_by_scoring_in_transformers(tmp_path, tiny_model_dir):
    """``--scorer-dtype`` is the transformers scorer's: with ``--ppl-backend auto`` it picks
    transformers (the engine would score in its own dtype and ignore it); with ``vllm`` it is
    refused by name."""
    import json as _json

    from helpers.eval_standins import standin_generator
    from helpers.steers import random_steer
    from vllm_steer.eval import register_scorer
    from vllm_steer.eval.generation import SamplingConfig
    from vllm_steer.eval.harness import EvalConfig, evaluate
    from vllm_steer.format import save_steer

    class Flat:
        name = "standin-flat"

        def score(self, texts):
            return [0.5 for _ in texts]

    register_scorer("toxicity", "standin-flat", Flat, overwrite=True)
    register_scorer("sentiment", "standin-flat", Flat, overwrite=True)
    steer = str(tmp_path / "s.safetensors")
    save_steer(steer, random_steer(64, 4, "s"))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(_json.dumps({"prompt": {"text": f"Prompt {i}"}})
                                 for i in range(2)))
    kw = dict(task="toxicity", model=str(tiny_model_dir), steers=[steer], strengths=[0, 1],
              baseline="none", prompt_file=str(prompts), num_prompts=2,
              sampling=SamplingConfig(samples=1, max_tokens=4), toxicity_scorer="standin-flat",
              sentiment_scorers=["standin-flat"], progress=False)
    gen = standin_generator(lambda s: 7.0)  # the engine's perplexity: 7 everywhere
    engine = evaluate(EvalConfig(out=str(tmp_path / "a"), **kw), gen, log=lambda m: None)
    assert engine["scorers"]["perplexity"]["backend"] == "vllm"
    res = evaluate(EvalConfig(out=str(tmp_path / "b"), scorer_dtype="float32", **kw), gen,
                   log=lambda m: None)
    assert res["scorers"]["perplexity"]["backend"] == "transformers"
    assert res["scorers"]["perplexity"]["dtype"] == "float32"
    ref = PerplexityScorer(str(tiny_model_dir), dtype="float32")
    rec = _json.loads((tmp_path / "b" / "generations.jsonl").read_text().splitlines()[0])
    (sample,) = rec["samples"]
    (want,) = ref.nll([rec["prompt"]], [sample["text"]], progress=False)
    assert sample["ppl"] == pytest.approx(want.ppl, rel=1e-4) and sample["ppl"] != 7.0
    with pytest.raises(ValueError, match="--ppl-backend vllm scores in the engine's dtype; "
                                         "--scorer-dtype float32 is the transformers"):
        EvalConfig(out=str(tmp_path / "c"), scorer_dtype="float32", ppl_backend="vllm",
                   **kw).validate()
