"""Score: log-likelihood at several strengths, the zero-shot classifier, data readers, CLI."""

from __future__ import annotations

import json

import pytest
import torch

from helpers.steers import random_steer
from vllm_steer.format import make_steer, save_steer
from vllm_steer.lens.score import (TextScores, auc, balanced_sample, evaluate, read_dataset,
                                   score_texts)


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    return model, AutoTokenizer.from_pretrained(tiny_model_dir)


def test_auc():
    assert auc([3, 2, 1, 0], [True, True, False, False]) == 1.0
    assert auc([0, 1, 2, 3], [True, True, False, False]) == 0.0
    assert auc([1, 1, 1, 1], [True, False, True, False]) == 0.5
    assert auc([0.9, 0.1, 0.5, 0.4], [True, False, False, True]) == 0.75


def test_text_scores_best_and_contrast():
    sc = TextScores([-5.0, 0.0, 5.0], [[-3.0, -2.0, -1.0], [-1.0, -2.0, -3.0]])
    assert sc.best() == [5.0, -5.0]
    assert sc.contrast(5) == [2.0, -2.0]
    with pytest.raises(ValueError, match=r"\+2 and -2"):
        sc.contrast(2)


@pytest.mark.parametrize("domain", [False, True])
def test_loglik_at_strengths_matches_token_logprobs(tiny, domain):
    from vllm_steer.hf import token_logprobs

    model, tok = tiny
    steer = random_steer(64, 4, "s", seed=7)
    if domain:  # a served domain component joins every non-zero strength
        g = torch.Generator().manual_seed(8)
        steer.domain_p1, steer.domain_p2 = torch.randn(64, 2, generator=g), torch.randn(
            64, 2, generator=g)
        steer.metadata.domain, steer.metadata.domain_strength = "with_steer", 3.0
    texts = ["A somewhat longer sentence about the weather today.", "A short one.",
             "Medium length text here."]
    sc = score_texts(model, tok, steer, texts, [-5.0, 0.0, 5.0], max_tokens=None)
    for k, s in enumerate(sc.strengths):
        if s == 0:
            ref = token_logprobs(model, tok, texts)
        else:
            ref = token_logprobs(model, tok, texts, {"s": steer}, {"s": s})
        for t in range(len(texts)):
            assert sc.loglik[t][k] == pytest.approx(float(ref[t].mean()), abs=1e-4)


def _planted_steer(model, tok, good_words, bad_words, texts):
    """S = m u^T with ``c . m ~= 1`` for the texts' contexts (least squares): every context
    is pushed along ``u = mean(good) - mean(bad)`` output embeddings, so a positive strength
    raises the good words' logits and lowers the bad ones'."""
    from vllm_steer.lens.lm import final_hidden_states

    E = model.lm_head.weight.detach()
    ids = lambda ws: [tok(w, add_special_tokens=False)["input_ids"][0] for w in ws]  # noqa
    u = E[ids(good_words)].mean(0) - E[ids(bad_words)].mean(0)
    h = torch.cat([e.hidden for e in final_hidden_states(model, tok, texts)])
    m = torch.linalg.lstsq(h, torch.ones(h.shape[0], 1)).solution[:, 0]  # c . m ~= 1
    assert float(((h @ m) > 0.5).float().mean()) > 0.9  # (almost) every context reads +1
    p1, p2 = torch.zeros(64, 2), torch.zeros(64, 2)
    p1[:, 0] = m
    p2[:, 0] = 20.0 * u / u.norm()
    return make_steer(p1, p2, "planted", labels={"positive": "good", "negative": "bad"})


def test_classifier_on_planted_steer(tiny):
    """A steer that raises ' happy'-like tokens: texts full of them score positive."""
    model, tok = tiny
    good = [" happy", " wonderful", " great", " lovely"]
    bad = [" awful", " terrible", " horrible", " nasty"]
    texts_good = [" ".join([w.strip()] * 4) + "." for w in good] + [
        "happy happy wonderful great lovely", "lovely great happy wonderful"]
    texts_bad = [" ".join([w.strip()] * 4) + "." for w in bad] + [
        "awful awful terrible nasty horrible", "nasty horrible terrible awful"]
    steer = _planted_steer(model, tok, good, bad, texts_good + texts_bad)
    rows = [(t, "1") for t in texts_good] + [(t, "0") for t in texts_bad]
    ev, sc = evaluate(model, tok, steer, rows, "planted", "1", 5.0, progress=False)
    assert ev.accuracy == 1.0 and ev.auc == 1.0, ev
    assert ev.n == len(rows) and set(ev.best_strength_by_class) == {"0", "1"}
    assert ev.best_strength_by_class["1"] == {"5": 6}
    assert ev.best_strength_by_class["0"] == {"-5": 6}
    assert ev.by_strength == {"5": {"accuracy": 1.0, "auc": 1.0}}
    # the opposite steer flips every prediction
    ev_neg, _ = evaluate(model, tok, steer.scaled(-1.0), rows, "planted", "1", 5.0,
                         progress=False)
    assert ev_neg.accuracy == 0.0


def test_read_dataset_and_sample(tmp_path):
    (tmp_path / "sst2").mkdir()
    (tmp_path / "sst2" / "test.tsv").write_text(
        "sentence\tlabel\n" + "".join(f"good {i}\t1\nbad {i}\t0\n" for i in range(10)))
    (tmp_path / "jigsaw").mkdir()
    (tmp_path / "jigsaw" / "jigsaw_balanced.csv").write_text(
        '"hello, ""you""\nthere",0\nyou idiot,1\n')
    rows = read_dataset("sst2", tmp_path)
    assert len(rows) == 20 and rows[0] == ("good 0", "1")
    j = read_dataset("jigsaw", tmp_path)
    assert j == [('hello, "you"\nthere', "0"), ("you idiot", "1")]
    s = balanced_sample(rows, 6, seed=1)
    assert len(s) == 6 and sum(lab == "1" for _, lab in s) == 3
    assert s == balanced_sample(rows, 6, seed=1)
    with pytest.raises(FileNotFoundError, match="VLLM_STEER_DATA"):
        read_dataset("sst2", tmp_path / "nope")
    with pytest.raises(ValueError, match="unknown dataset"):
        read_dataset("imdb", tmp_path)


def test_score_cli_text_and_dataset(tiny_model_dir, tmp_path, capsys):
    from vllm_steer.cli import main

    path = tmp_path / "s.safetensors"
    save_steer(path, random_steer(64, 4, "s", seed=2))
    out = tmp_path / "o.json"
    rc = main(["score", "--steer", str(path), "--model", str(tiny_model_dir), "--text",
               "What a lovely day.", "--json", str(out), "--strengths=-2,0,2"])
    assert rc == 0
    d = json.loads(out.read_text())
    assert list(d[0]["loglik"]) == ["-5", "-2", "0", "2", "5"]
    assert d[0]["best_strength"] in (-5, -2, 0, 2, 5)
    assert d[0]["side"] in ("positive", "negative")
    data = tmp_path / "data"
    (data / "sst2").mkdir(parents=True)
    (data / "sst2" / "test.tsv").write_text(
        "sentence\tlabel\n" + "".join(f"nice film {i}\t1\nbad film {i}\t0\n" for i in range(5)))
    ev_json = tmp_path / "ev.json"
    rc = main(["score", "--steer", str(path), "--model", str(tiny_model_dir), "--dataset",
               "sst2", "--data-dir", str(data), "--limit", "6", "--json", str(ev_json),
               "--quiet"])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "s on sst2: accuracy" in printed and "(n=6," in printed
    ev = json.loads(ev_json.read_text())
    assert ev["n"] == 6 and 0.0 <= ev["accuracy"] <= 1.0 and ev["positive_label"] == "1"
    assert len(ev["per_text"]) == 6 and len(ev["per_text"][0]["loglik"]) == 3
    assert sorted(p["label"] for p in ev["per_text"]) == ["0", "0", "0", "1", "1", "1"]
    assert main(["score", "--steer", str(path), "--model", str(tiny_model_dir), "--dataset",
                 "sst2", "--data", str(data), "--positive-label", "7"]) == 1
    # a steer of another model: named, before any text is scored
    narrow = tmp_path / "narrow.safetensors"
    save_steer(narrow, random_steer(32, 4, "narrow", seed=3))
    capsys.readouterr()
    assert main(["score", "--steer", str(narrow), "--model", str(tiny_model_dir), "--text",
                 "What a lovely day."]) == 1
    err = capsys.readouterr().err
    assert "has hidden size 32 but" in err and "takes 64" in err and "transfer" in err, err


def test_training_texts_are_rebuilt_from_the_metadata(tmp_path):
    """A steer records its data config and seed; the score command leaves those texts out."""
    from vllm_steer.lens.score import training_texts

    csv_path = tmp_path / "d.csv"
    csv_path.write_text("".join(f"clean text {i},0\ntoxic text {i},1\n" for i in range(30)))
    s = random_steer(8, 2, "s")
    assert training_texts(s) is None
    s.metadata.data = {"config": {"labelled": [str(csv_path)], "format": "csv",
                                  "header": False, "text_field": "0", "label_field": "1",
                                  "positive_labels": ["0"], "negative_labels": ["1"],
                                  "max_examples": 5, "dev_fraction": 0.1}}
    s.metadata.recipe = {"seed": 0}
    texts = training_texts(s)
    assert texts is not None and len(texts) == 10
    assert sum(t.startswith("clean") for t in texts) == 5
    assert texts <= {f"{w} text {i}" for w in ("clean", "toxic") for i in range(30)}


# ---- texts with no token to score, --prefix and --max-tokens ---------------------------

def _strict_json(path):
    """The file parsed as standard JSON: a bare NaN or Infinity fails."""
    def refuse(c):
        raise ValueError(f"non-standard JSON constant {c}")
    return json.loads(path.read_text(), parse_constant=refuse)


def _plain_loglik(model, tok, text, steer, strengths, prefix_ids=(), max_text=None):
    """Mean token log-likelihood at each strength in plain float64 torch: the final hidden
    states h, the steered head input h + s eps (h P1) P2^T, log-softmax of its logits, over
    the text's tokens that have a context (all of them after a prefix, else from the 2nd)."""
    text_ids = tok(text, add_special_tokens=False)["input_ids"][:max_text]
    ids = list(prefix_ids) + text_ids
    start = max(len(prefix_ids), 1)
    with torch.no_grad():
        out = model(torch.tensor([ids]), output_hidden_states=True)
    h = out.hidden_states[-1][0].double()
    W = model.lm_head.weight.detach().double()
    assert torch.allclose(h @ W.T, out.logits[0].double(), atol=1e-4)  # h is the head input
    p1, p2, eps = steer.p1.double(), steer.p2.double(), steer.metadata.epsilon
    tgt = torch.tensor(ids[start:])
    res = []
    for s in strengths:
        lp = torch.log_softmax((h + s * eps * (h @ p1) @ p2.T) @ W.T, -1)
        res.append(float(lp[start - 1:len(ids) - 1].gather(-1, tgt[:, None]).mean()))
    return res


def test_text_scores_without_a_score():
    sc = TextScores([-5.0, 0.0, 5.0], [[-3.0, -2.0, -1.0], None])
    assert sc.scored() == [True, False]
    assert sc.best() == [5.0, None]
    assert sc.contrast(5) == [2.0, None]


def test_score_cli_a_text_with_no_token_to_score_has_no_score_and_no_side(
        tiny, tiny_model_dir, tmp_path, capsys):
    """--max-tokens 1 without a prefix leaves a text no token with a context: the row says
    "no score" (no side, no "negative"), the JSON is standard with nulls, a note says why;
    the other text of the file is scored as plain torch computes it."""
    from vllm_steer.cli import main

    model, tok = tiny
    steer = random_steer(64, 4, "s", seed=2)
    path = tmp_path / "s.safetensors"
    save_steer(path, steer)
    texts = tmp_path / "t.txt"
    texts.write_text("What a lovely day.\nHello\n")
    assert len(tok("Hello", add_special_tokens=False)["input_ids"]) == 1
    out = tmp_path / "o.json"
    assert main(["score", "--steer", str(path), "--model", str(tiny_model_dir), "--file",
                 str(texts), "--json", str(out), "--strengths=0", "--strength", "2"]) == 0
    cap = capsys.readouterr()
    rows = [line for line in cap.out.splitlines() if line.startswith("loglik")]
    assert len(rows) == 2
    assert "no score (no token to score)" in rows[1] and "'Hello'" in rows[1]
    assert "negative" not in rows[1] and "positive" not in rows[1] and "nan" not in rows[1]
    assert ("note: 1 of 2 text(s) had no token to score, so no score and no side (without a "
            "--prefix a text's first token has no context") in cap.err
    d = _strict_json(out)
    assert d[1] == {"text": "Hello", "tokens_scored": 0, "loglik": None, "best_strength": None,
                    "contrast": None, "side": None, "label": None}
    want = _plain_loglik(model, tok, "What a lovely day.", steer, [-2.0, 0.0, 2.0])
    got = [d[0]["loglik"][k] for k in ("-2", "0", "2")]
    assert got == pytest.approx(want, abs=1e-4)
    assert d[0]["contrast"] == pytest.approx(want[2] - want[0], abs=1e-4)
    assert d[0]["side"] == ("positive" if want[2] > want[0] else "negative")
    assert d[0]["tokens_scored"] == len(tok("What a lovely day.",
                                            add_special_tokens=False)["input_ids"]) - 1
    # every text cut to one token: each has no score
    assert main(["score", "--steer", str(path), "--model", str(tiny_model_dir), "--text",
                 "What a lovely day.", "--max-tokens", "1", "--json", str(out)]) == 0
    assert "no score" in capsys.readouterr().out
    assert _strict_json(out)[0]["side"] is None


def test_score_cli_max_tokens_counts_the_text_not_the_prefix(tiny, tiny_model_dir, tmp_path,
                                                             capsys):
    """A --prefix longer than --max-tokens (default 128) leaves the text scored: the limit
    keeps the text's first N tokens, after the whole prefix."""
    from vllm_steer.cli import main

    model, tok = tiny
    steer = random_steer(64, 4, "s", seed=2)
    path = tmp_path / "s.safetensors"
    save_steer(path, steer)
    prefix = "word " * 200
    pre_ids = tok(prefix, add_special_tokens=False)["input_ids"]
    assert len(pre_ids) > 128
    text = "What a lovely day."
    out = tmp_path / "o.json"
    for extra, max_text in (([], None), (["--max-tokens", "2"], 2)):
        assert main(["score", "--steer", str(path), "--model", str(tiny_model_dir), "--text",
                     text, "--prefix", prefix, "--json", str(out), "--strengths=0",
                     "--strength", "3", *extra]) == 0
        assert "no score" not in capsys.readouterr().out
        d = _strict_json(out)[0]
        n_text = len(tok(text, add_special_tokens=False)["input_ids"])
        assert d["tokens_scored"] == (max_text or n_text)
        want = _plain_loglik(model, tok, text, steer, [-3.0, 0.0, 3.0], pre_ids, max_text)
        assert [d["loglik"][k] for k in ("-3", "0", "3")] == pytest.approx(want, abs=1e-4)


def test_score_help_default_max_tokens_is_the_functions():
    from vllm_steer.lens import cli, score

    assert cli.DEFAULT_MAX_TOKENS == score.DEFAULT_MAX_TOKENS


@pytest.mark.parametrize("cmd", ["score", "highlight"])
@pytest.mark.parametrize("bad", ["0", "-3", "x"])
def test_max_tokens_must_be_a_positive_integer(cmd, bad, tmp_path, capsys):
    from vllm_steer.cli import main

    with pytest.raises(SystemExit) as e:
        main([cmd, "--steer", str(tmp_path / "none.safetensors"), "--text", "hi",
              f"--max-tokens={bad}"])
    assert e.value.code == 2
    assert (f"argument --max-tokens: '{bad}' is not a positive integer: give the number of "
            "tokens to keep from each text, e.g. 128") in capsys.readouterr().err


def test_score_cli_dataset_counts_texts_without_a_score_apart(tiny, tiny_model_dir, tmp_path,
                                                              capsys):
    """With --prefix '' the one-token rows have no score: they are not predictions. The line
    and the JSON give their number, ``n`` and the accuracy cover the scored rows only (the
    accuracy checked against each scored row's contrast and label)."""
    from vllm_steer.cli import main

    model, tok = tiny
    path = tmp_path / "s.safetensors"
    save_steer(path, random_steer(64, 4, "s", seed=2))
    data = tmp_path / "data"
    (data / "sst2").mkdir(parents=True)
    rows = [(f"nice film number {i}", "1") for i in range(3)] + [
        (f"bad film number {i}", "0") for i in range(3)] + [("Hello", "1"), ("Hello", "0")]
    (data / "sst2" / "test.tsv").write_text(
        "sentence\tlabel\n" + "".join(f"{t}\t{lab}\n" for t, lab in rows))
    ev_json = tmp_path / "ev.json"
    assert main(["score", "--steer", str(path), "--model", str(tiny_model_dir), "--dataset",
                 "sst2", "--data", str(data), "--limit", "0", "--prefix", "", "--json",
                 str(ev_json), "--quiet", "--strength", "5"]) == 0
    cap = capsys.readouterr()
    assert ("(n=6, +/-5, positive side = label 1); 2 more text(s) had no token to score and "
            "are not counted") in cap.out
    assert "note: 2 of 8 texts had no token to score and are left out" in cap.err
    ev = _strict_json(ev_json)
    assert ev["n"] == 6 and ev["unscored"] == 2
    per = ev["per_text"]  # --limit 0: every row, in the file's order
    assert [p["label"] for p in per] == [lab for _, lab in rows]
    assert [p["loglik"] is None for p in per] == [t == "Hello" for t, _ in rows]
    strengths = ev["strengths"]
    ip, im = strengths.index(5.0), strengths.index(-5.0)
    scored = [p for p in per if p["loglik"] is not None]
    right = sum((p["loglik"][ip] - p["loglik"][im] > 0) == (p["label"] == "1") for p in scored)
    assert ev["accuracy"] == pytest.approx(right / 6)
    assert sum(sum(c.values()) for c in ev["best_strength_by_class"].values()) == 6
    # the scored rows' numbers are plain torch's
    steer = random_steer(64, 4, "s", seed=2)
    for (text, _), p in list(zip(rows, per, strict=True))[:6:5]:
        assert p["loglik"] == pytest.approx(_plain_loglik(model, tok, text, steer, strengths),
                                            abs=1e-4)


def test_tokenize_scored_max_text_tokens_keeps_the_prefix_and_max_length_is_unchanged(tiny):
    from vllm_steer.hf import tokenize_scored

    _, tok = tiny
    pre = tok("some context here", add_special_tokens=False)["input_ids"]
    txt = tok("What a lovely day.", add_special_tokens=False)["input_ids"]
    assert tokenize_scored(tok, "What a lovely day.", "some context here",
                           max_text_tokens=2) == (pre + txt[:2], len(pre))
    assert tokenize_scored(tok, "What a lovely day.", "some context here",
                           max_length=2) == (pre[:2], len(pre))  # prefix and text together
    assert tokenize_scored(tok, "What a lovely day.") == (txt, 1)


@pytest.mark.parametrize("family", ["gemma2", "granite", "cohere"])
def test_loglik_at_strengths_matches_token_logprobs_with_logit_postprocessing(
        family, tmp_path):
    """Gemma 2's soft-cap, Granite's logits_scaling and Cohere's logit_scale act after the
    head: the scores are the model's own log-likelihoods, as token_logprobs (and the
    server) compute them."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from helpers.families import HIDDEN, make_family_model
    from vllm_steer.hf import token_logprobs

    path = make_family_model(family, tmp_path / family)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    tok = AutoTokenizer.from_pretrained(path)
    steer = random_steer(HIDDEN, 4, "s", seed=7)
    texts = ["A somewhat longer sentence about the weather today.", "Medium length text."]
    sc = score_texts(model, tok, steer, texts, [-5.0, 0.0, 5.0], max_tokens=None)
    for k, s in enumerate(sc.strengths):
        ref = (token_logprobs(model, tok, texts, {"s": steer}, {"s": s}) if s
               else token_logprobs(model, tok, texts))
        for t in range(len(texts)):
            assert sc.loglik[t][k] == pytest.approx(float(ref[t].mean()), abs=1e-4)
