"""The transformers API (vllm_steer.hf): steered logits against the reference formula on the
tiny model, strength 0, restoring on exit, composition, untied head with bias, token_logprobs
and generate."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from helpers.steers import random_steer
from vllm_steer.hf import generate, output_head, steering, token_logprobs
from vllm_steer.reference import steered_logits_reference

TEXTS = ["The quick brown fox jumps over the lazy dog.", "Hello there, how are you today?"]


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    return model, tok


def _batch(tok, texts=TEXTS):
    enc = tok(texts, return_tensors="pt", padding=True)
    return enc["input_ids"], enc["attention_mask"]


def _logits_and_hidden(model, ids, att):
    """Model logits and the head's input, captured by our own hook (independent of hf.py)."""
    store = []
    h = output_head(model).register_forward_pre_hook(lambda m, a: store.append(a[0].detach()))
    try:
        with torch.no_grad():
            logits = model(input_ids=ids, attention_mask=att).logits
    finally:
        h.remove()
    return logits.float(), store[0]


def _ref(model, hidden, steers_and_strengths):
    head = output_head(model)
    p1 = torch.cat([s.p1 for s, _ in steers_and_strengths], 1)
    p2 = torch.cat([s.p2 for s, _ in steers_and_strengths], 1)
    offs = [0]
    for s, _ in steers_and_strengths:
        offs.append(offs[-1] + s.p1.shape[1])
    flat = hidden.reshape(-1, hidden.shape[-1])
    coefs = torch.tensor([[v * s.metadata.epsilon for s, v in steers_and_strengths]]
                         ).expand(flat.shape[0], -1)
    out = steered_logits_reference(flat, head.weight, p1, p2, offs, coefs,
                                   bias=getattr(head, "bias", None))
    return out.reshape(*hidden.shape[:-1], -1)


def test_steered_logits_equal_reference_formula(tiny):
    model, tok = tiny
    steer = random_steer(64, 4, "a", seed=1)
    ids, att = _batch(tok)
    plain, hidden = _logits_and_hidden(model, ids, att)
    with steering(model, steer, 5.0):
        got, _ = _logits_and_hidden(model, ids, att)
    want = _ref(model, hidden, [(steer, 5.0)])
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    # and the steer actually changed something visible: the greedy next tokens
    assert (got.argmax(-1) != plain.argmax(-1)).any()


def test_strength_zero_is_plain_and_exit_restores(tiny):
    model, tok = tiny
    steer = random_steer(64, 4, "a", seed=2)
    ids, att = _batch(tok)
    plain, _ = _logits_and_hidden(model, ids, att)
    with steering(model, {"a": steer}, {"a": 0.0}):
        zero, _ = _logits_and_hidden(model, ids, att)
    assert torch.equal(zero, plain)
    with steering(model, steer, 8.0):
        pass
    after, _ = _logits_and_hidden(model, ids, att)
    assert torch.equal(after, plain)
    with pytest.raises(RuntimeError, match="boom"):
        with steering(model, steer, 8.0):
            raise RuntimeError("boom")
    assert torch.equal(_logits_and_hidden(model, ids, att)[0], plain)
    assert not output_head(model)._forward_pre_hooks


def test_composition_of_two_steers(tiny):
    model, tok = tiny
    a, b = random_steer(64, 4, "a", seed=3), random_steer(64, 2, "b", seed=4)
    ids, att = _batch(tok)
    _, hidden = _logits_and_hidden(model, ids, att)
    with steering(model, {"a": a, "b": b}, {"a": 3.0, "b": -2.0}):
        got, _ = _logits_and_hidden(model, ids, att)
    torch.testing.assert_close(got, _ref(model, hidden, [(a, 3.0), (b, -2.0)]),
                               rtol=1e-4, atol=1e-4)
    # composing equals adding the two matrices (the paper's composition)
    w = a.matrix() * 3.0 + b.matrix() * -2.0
    flat = hidden.reshape(-1, 64)
    dense = (flat + 1e-3 * flat @ w.T) @ output_head(model).weight.T
    torch.testing.assert_close(got.reshape(-1, got.shape[-1]), dense, rtol=1e-4, atol=1e-4)


def test_untied_head_with_bias(tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    old = model.lm_head
    new = torch.nn.Linear(old.in_features, old.out_features, bias=True)
    with torch.no_grad():
        new.weight.copy_(old.weight)
        new.bias.copy_(torch.randn(old.out_features) * 2)
    model.lm_head = new
    assert model.get_output_embeddings() is new
    assert model.lm_head.weight.data_ptr() != model.get_input_embeddings().weight.data_ptr()
    steer = random_steer(64, 4, "a", seed=5)
    ids, att = _batch(tok)
    _, hidden = _logits_and_hidden(model, ids, att)
    with steering(model, steer, -6.0):
        got, _ = _logits_and_hidden(model, ids, att)
    want = _ref(model, hidden, [(steer, -6.0)])
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    # the bias is really in there
    no_bias = want - new.bias.detach()
    assert (got - no_bias).abs().max() > 1.0


def test_domain_component_served_only_with_steer(tiny):
    model, tok = tiny
    s = random_steer(64, 4, "a", seed=6)
    d = random_steer(64, 3, "d", seed=7)
    steer = dataclasses.replace(s, domain_p1=d.p1, domain_p2=d.p2,
                                metadata=dataclasses.replace(s.metadata, domain="with_steer",
                                                             domain_strength=1.0))
    ids, att = _batch(tok)
    plain, hidden = _logits_and_hidden(model, ids, att)
    with steering(model, steer, 4.0):
        got, _ = _logits_and_hidden(model, ids, att)
    torch.testing.assert_close(got, _ref(model, hidden, [(s, 4.0), (d, 1.0)]),
                               rtol=1e-4, atol=1e-4)
    with steering(model, steer, 0.0):
        assert torch.equal(_logits_and_hidden(model, ids, att)[0], plain)


def test_errors_name_the_problem(tiny):
    model, _ = tiny
    a, b = random_steer(64, 2, "a"), random_steer(64, 2, "b")
    with pytest.raises(ValueError, match="bare strength needs exactly one steer"):
        with steering(model, {"a": a, "b": b}, 5.0):
            pass
    with pytest.raises(KeyError, match="unknown steers"):
        with steering(model, {"a": a}, {"zzz": 1.0}):
            pass
    with pytest.raises(ValueError, match="hidden size 32 does not fit"):
        with steering(model, random_steer(32, 2, "x"), 1.0):
            pass


def test_token_logprobs_match_manual_and_move_with_the_steer(tiny):
    model, tok = tiny
    steer = random_steer(64, 4, "a", seed=8)
    lps = token_logprobs(model, tok, TEXTS)
    for text, lp in zip(TEXTS, lps, strict=True):
        ids = torch.tensor([tok(text)["input_ids"]])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0].float()
        want = torch.log_softmax(logits[:-1], -1).gather(-1, ids[0, 1:, None])[:, 0]
        assert lp.shape == (ids.shape[1] - 1,)
        torch.testing.assert_close(lp, want, rtol=1e-4, atol=1e-4)
    steered = token_logprobs(model, tok, TEXTS, steers=steer, strengths=5.0)
    assert all(not torch.allclose(a, b) for a, b in zip(lps, steered, strict=True))
    # prefixes: only the text's own tokens are scored
    pre = token_logprobs(model, tok, ["over the lazy dog."],
                         prefixes=["The quick brown fox jumps "])
    assert pre[0].shape[0] == len(tok("over the lazy dog.", add_special_tokens=False)["input_ids"])


def test_generate_greedy_matches_manual_decoding(tiny):
    model, tok = tiny
    steer = random_steer(64, 4, "a", seed=9)
    prompt = "Once upon a time"
    plain = generate(model, tok, [prompt], max_new_tokens=6)
    steered = generate(model, tok, [prompt], {"a": steer}, {"a": 8.0}, max_new_tokens=6)
    # manual greedy decoding with the reference formula
    ids = torch.tensor([tok(prompt)["input_ids"]])
    for _ in range(6):
        _, hidden = _logits_and_hidden(model, ids, torch.ones_like(ids))
        nxt = _ref(model, hidden[:, -1:], [(steer, 8.0)])[0, -1].argmax()
        ids = torch.cat([ids, nxt.view(1, 1)], 1)
    manual = tok.decode(ids[0, len(tok(prompt)["input_ids"]):], skip_special_tokens=True)
    assert steered[0] == manual
    assert steered[0] != plain[0]
    # batched prompts with left padding give the same as one by one
    both = generate(model, tok, [prompt, "A much longer prompt that needs padding here"],
                    {"a": steer}, {"a": 8.0}, max_new_tokens=6)
    assert both[0] == steered[0]


def test_generate_pads_a_batch_for_a_tokenizer_without_a_pad_token(tiny):
    """GPT-2's and GPT-NeoX's tokenizers have no pad token: a batch is padded with the end of
    text and each prompt gets what it gets alone; the tokenizer is left as it was."""
    model, tok = tiny
    saved = tok.pad_token
    tok.pad_token = None
    try:
        prompts = ["Once upon a time", "A much longer prompt that needs padding here"]
        both = generate(model, tok, prompts, max_new_tokens=5)
        assert both == [generate(model, tok, [p], max_new_tokens=5)[0] for p in prompts]
        assert tok.pad_token is None
    finally:
        tok.pad_token = saved


def test_token_logprobs_of_an_empty_text_are_empty_alone_or_batched(tiny):
    """An empty text has no token to score, batched with others or alone; a one-token text
    neither; the other texts of the batch get what they get alone."""
    model, tok = tiny
    text = "hello there, how are you"
    alone = token_logprobs(model, tok, [text])[0]
    got = token_logprobs(model, tok, ["", text, "a"])
    assert [t.numel() for t in got] == [0, alone.numel(), 0]
    assert torch.allclose(got[1], alone, atol=1e-5)
    assert [t.numel() for t in token_logprobs(model, tok, ["", ""])] == [0, 0]
