"""``vllm-steer train --chat-template``: each text is the assistant's reply under the model's
chat template, and only the reply's tokens are targets. The masked positions are checked
against an independent tokenisation of the whole rendered conversation (character offsets of
the reply), the loss against plain cross-entropy over the reply's tokens, and a short run on
the tiny model through the CLI."""

from __future__ import annotations

import random

import pytest
import torch

from vllm_steer.format import read_metadata
from vllm_steer.train.config import DataConfig, TrainConfig
from vllm_steer.train.hidden import CHAT_USER_TURN, chat_prefix, compute_hidden
from vllm_steer.train.module import LMSteer
from vllm_steer.train.trainer import mean_loss, prepare

WORDS = {"pos": "happy good great lovely kind sunny".split(),
         "neg": "sad bad awful terrible cruel nasty".split()}
FILL = "the a day was and it felt very so we".split()


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("chat-data")
    rng = random.Random(0)
    out = {}
    for name, n in (("pos", 30), ("neg", 30), ("dev_pos", 6), ("dev_neg", 6)):
        words = WORDS[name.split("_")[-1]]
        lines = [" ".join(rng.choice(words + FILL) for _ in range(rng.randint(3, 12)))
                 for _ in range(n)]
        lines[0] = "Well, it's " + lines[0] + "!"  # punctuation and a capital first letter
        out[name] = d / f"{name}.txt"
        out[name].write_text("\n".join(lines))
    return out


def _data(f) -> DataConfig:
    return DataConfig(positive=[str(f["pos"])], negative=[str(f["neg"])],
                      dev_positive=[str(f["dev_pos"])], dev_negative=[str(f["dev_neg"])])


def _cfg(model_dir, **kw) -> TrainConfig:
    base = dict(model=str(model_dir), rank=4, domain_rank=4, steps=10, batch_size=8,
                max_length=10, eval_every=0, checkpoint_every=0, check_strengths=(5.0,),
                model_dtype="float32", cache_dtype="float32", head_dtype="float32",
                chat_template=True)
    base.update(kw)
    return TrainConfig(**base)


@pytest.fixture(scope="module")
def prep(tiny_model_dir, files):
    return prepare(_cfg(tiny_model_dir), _data(files), log=lambda m: None)


def test_targets_are_exactly_the_reply_tokens(prep):
    tok = prep.tokenizer
    texts = [e.text for e in prep.dataset.train]
    hs = compute_hidden(prep.model, tok, prep.train_ids, prep.train_sides,
                        cache_dtype=torch.float32, progress=False, starts=prep.train_starts)
    inp, tgt, text_of_row = hs.rows(torch.arange(hs.num_texts))
    assert (tgt - inp == 1).all()
    for i, text in enumerate(texts):
        # independent: render the whole conversation, tokenise it with character offsets,
        # and take the tokens that lie inside the reply's characters
        conv = [{"role": "user", "content": CHAT_USER_TURN},
                {"role": "assistant", "content": text}]
        full = tok.apply_chat_template(conv, tokenize=False)
        a = full.index(text, full.index("<|im_start|>assistant"))
        enc = tok(full, add_special_tokens=False, return_offsets_mapping=True)
        inside = [k for k, (s, e) in enumerate(enc["offset_mapping"])
                  if s >= a and e <= a + len(text)]
        want = inside[:prep.cfg.max_length]  # max_length counts the reply's tokens
        assert inside == list(range(inside[0], inside[0] + len(inside)))  # contiguous
        got = (tgt[text_of_row == i] - hs.offsets[i]).tolist()
        assert got == want, text
        ids = prep.train_ids[i]
        assert ids == enc["input_ids"][:want[-1] + 1]  # the same tokens, up to the reply's
        assert prep.train_starts[i] == want[0] == len(chat_prefix(tok))
    assert prep.reports["train"]["truncated"] == sum(
        len(tok(t, add_special_tokens=False)["input_ids"]) > prep.cfg.max_length for t in texts)


def test_the_loss_is_cross_entropy_over_the_reply_only(prep):
    hs = compute_hidden(prep.model, prep.tokenizer, prep.dev_ids, prep.dev_sides,
                        cache_dtype=torch.float32, progress=False, starts=prep.dev_starts)
    lm = LMSteer(prep.model, 4, 4, 1e-3, 1e-2, 0)
    got = mean_loss(lm, hs, strength=0.0, domain=0.0)
    tot, n = 0.0, 0
    with torch.no_grad():
        for ids, start in zip(prep.dev_ids, prep.dev_starts, strict=True):
            logits = prep.model(input_ids=torch.tensor([ids])).logits[0].float()
            lp = torch.log_softmax(logits, -1)
            tot -= sum(float(lp[k - 1, ids[k]]) for k in range(start, len(ids)))
            n += len(ids) - start
    assert got == pytest.approx(tot / n, rel=1e-5)


def test_cli_trains_with_the_chat_template_and_records_it(tiny_model_dir, files, tmp_path,
                                                          capsys):
    from vllm_steer.cli import main

    out = tmp_path / "chat.safetensors"
    rc = main(["train", "--model", str(tiny_model_dir), "--positive", str(files["pos"]),
               "--negative", str(files["neg"]), "--dev-positive", str(files["dev_pos"]),
               "--dev-negative", str(files["dev_neg"]), "--chat-template", "--steps", "8",
               "--batch-size", "8", "--rank", "4", "--max-length", "10",
               "--check-strengths", "2", "--checkpoint-every", "0", "--model-dtype",
               "float32", "--out", str(out), "--quiet"])
    assert rc == 0
    err = capsys.readouterr().err
    assert f"the user turn {CHAT_USER_TURN!r}" in err
    meta = read_metadata(str(out))
    assert meta.recipe["chat_template"] is True
    m = meta.metrics
    assert m["steps"] == 8 and m["train_loss"] == m["train_loss"]  # trained, finite
    # the targets counted are the replies' tokens, not the template's
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    lines = files["pos"].read_text().splitlines() + files["neg"].read_text().splitlines()
    replies = [min(10, len(tok(t, add_special_tokens=False)["input_ids"])) for t in lines]
    assert m["train_texts_used"] == 60 and m["train_tokens"] == sum(replies)


def test_a_tokenizer_without_a_template_is_refused(prep):
    from copy import copy

    tok = copy(prep.tokenizer)
    tok.chat_template = None
    with pytest.raises(ValueError, match="needs a tokenizer with a chat template"):
        chat_prefix(tok)
    with pytest.raises(ValueError, match=r"context window of 512 tokens; use --max-length"):
        from vllm_steer.train.hidden import tokenize_chat

        tokenize_chat(prep.tokenizer, ["hi"], 512, 512)


def _whole_text_head_inputs(model, ids: list[int]) -> torch.Tensor:
    """Independent: the head's input over the whole rendered text, one text at a time."""
    got = []
    handle = model.get_output_embeddings().register_forward_pre_hook(
        lambda _m, args: got.append(args[0][0].detach()))
    try:
        with torch.no_grad():
            model(input_ids=torch.tensor([ids]))
    finally:
        handle.remove()
    return got[0]


def test_the_shared_chat_prompt_runs_once_and_gives_the_whole_texts_states(prep):
    calls = []
    handle = prep.model.register_forward_pre_hook(
        lambda _m, args, kw: calls.append(kw["input_ids"].shape), with_kwargs=True)
    try:
        hs = compute_hidden(prep.model, prep.tokenizer, prep.train_ids, prep.train_sides,
                            cache_dtype=torch.float32, progress=False,
                            starts=prep.train_starts,
                            batch_tokens=64)  # several batches of replies continue one prompt
    finally:
        handle.remove()
    P = prep.train_starts[0]
    longest_reply = max(len(x) for x in prep.train_ids) - P
    # the prompt once (1 x P); then replies only, but for one whole text (the check that
    # this model's forward continues the cache exactly)
    assert calls[0] == (1, P)
    assert [c for c in calls[1:] if c[1] > longest_reply] == [(1, P + longest_reply)]
    assert len(calls) > 3
    for i, ids in enumerate(prep.train_ids):
        want = _whole_text_head_inputs(prep.model, ids)
        got = hs.hidden[hs.offsets[i]:hs.offsets[i + 1]]
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_a_forward_that_does_not_continue_the_cache_falls_back_to_whole_texts(prep,
                                                                             monkeypatch):
    from vllm_steer.train import hidden

    monkeypatch.setattr(hidden._Prefix, "continued",
                        lambda self, inp, att: torch.zeros(*inp.shape, 64))
    hs = compute_hidden(prep.model, prep.tokenizer, prep.dev_ids, prep.dev_sides,
                        cache_dtype=torch.float32, progress=False, starts=prep.dev_starts)
    for i, ids in enumerate(prep.dev_ids):
        torch.testing.assert_close(hs.hidden[hs.offsets[i]:hs.offsets[i + 1]],
                                   _whole_text_head_inputs(prep.model, ids),
                                   rtol=1e-4, atol=1e-5)
