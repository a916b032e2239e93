"""Highlight: the span DP against brute force, the renderers, and scores on a tiny model."""

from __future__ import annotations

import itertools
import math
import json
import random
import subprocess
import sys
import os
from types import SimpleNamespace

import pytest

from vllm_steer.lens.highlight import Span, best_spans, to_ansi, to_html, to_json, use_color


def _brute(scores, k, max_len):
    """Best total over all sets of <= k non-adjacent spans of length <= max_len."""
    n = len(scores)
    cands = [(s, e) for s in range(n) for e in range(s + 1, min(n, s + max_len) + 1)]
    best, arg = 0.0, []
    for m in range(1, k + 1):
        for combo in itertools.combinations(cands, m):
            ok = all(combo[i][1] < combo[i + 1][0] for i in range(m - 1))
            if not ok:
                continue
            tot = sum(sum(scores[s:e]) for s, e in combo)
            if tot > best + 1e-9:
                best, arg = tot, list(combo)
    return best, arg


@pytest.mark.parametrize("seed", range(60))
def test_best_spans_matches_brute_force(seed):
    rng = random.Random(seed)
    n = rng.randint(0, 9)
    k = rng.randint(1, 3)
    max_len = rng.randint(1, 4)
    scores = [round(rng.gauss(0, 1), 3) for _ in range(n)]
    spans = best_spans(scores, k, max_len)
    want, want_spans = _brute(scores, k, max_len)
    got = sum(sp.score for sp in spans)
    assert got == pytest.approx(want, abs=1e-9), (scores, k, max_len, spans, want_spans)
    # the returned spans obey the constraints and their scores are their sums
    assert len(spans) <= k
    for sp in spans:
        assert 1 <= sp.end - sp.start <= max_len
        assert sp.score == pytest.approx(sum(scores[sp.start:sp.end]))
        assert sp.score > 0
    for a, b in zip(spans, spans[1:], strict=False):
        assert a.end < b.start  # non-adjacent, sorted
    if want_spans and len({round(x, 3) for x in scores}) == n:
        assert [(sp.start, sp.end) for sp in spans] == want_spans


@pytest.mark.parametrize("seed", range(200))
def test_best_spans_never_returns_a_span_of_zero_gain(seed):
    """Scores with exact zeros and decimals whose float sums round (0.3 - 0.9 + 0.9): the
    prefix sums' rounding must not add a span that gains nothing; the total is still the
    brute force's."""
    rng = random.Random(seed)
    n = rng.randint(1, 8)
    k, max_len = rng.randint(1, 3), rng.randint(1, 4)
    scores = [rng.choice([0.0, 0.0, 0.1, 0.2, 0.3, -0.3, -0.9, 0.7, -0.1]) for _ in range(n)]
    spans = best_spans(scores, k, max_len)
    want, _ = _brute(scores, k, max_len)
    assert sum(sp.score for sp in spans) == pytest.approx(want, abs=1e-9), (scores, spans)
    for sp in spans:
        assert math.fsum(scores[sp.start:sp.end]) > 0, (scores, k, max_len, spans)


def test_best_spans_examples():
    assert best_spans([0.3, -0.9, 0.0], 2, 3) == [Span(0, 1, 0.3)]
    assert best_spans([], 3, 4) == []
    assert best_spans([-1.0, -2.0], 3, 4) == []
    # one clear span, capped by max_len
    s = [0, 0, 5, 5, 5, 0, -9, 1]
    assert [tuple(x) for x in best_spans(s, 1, 2)] == [(2, 4, 10.0)]
    assert [(x.start, x.end) for x in best_spans(s, 2, 3)] == [(2, 5), (7, 8)]
    # two adjacent maxima cannot both be taken as separate adjacent spans of length 1
    assert sum(x.score for x in best_spans([3.0, 3.0], 2, 1)) == 3.0
    start, end, score = best_spans([1.0], 1, 1)[0]
    assert (start, end, score) == (0, 1, 1.0)


def test_best_spans_on_a_long_text_finds_planted_blocks():
    """20,000 tokens (the DP is O(n k L), so this is quick): four planted blocks are found."""
    rng = random.Random(0)
    scores = [-abs(rng.gauss(0, 1)) for _ in range(20000)]
    planted = [(1000, 1006), (5000, 5010), (12345, 12349), (19990, 20000)]
    for s, e in planted:
        for i in range(s, e):
            scores[i] = 1.0 + rng.random()
    spans = best_spans(scores, 4, 10)
    assert [(sp.start, sp.end) for sp in spans] == planted


def test_best_spans_rejects_bad_input():
    with pytest.raises(ValueError, match="max_len"):
        best_spans([1.0], 1, 0)
    with pytest.raises(ValueError, match="finite"):
        best_spans([1.0, float("nan")], 1, 2)


TOKENS = ["You", " are", " a", " stupid", " idiot", " and", " <b>", " nice"]
SCORES = [None, 0.1, -0.2, 2.0, 3.0, -0.5, 0.0, 1.0]


def _spans():
    return best_spans([0.0 if s is None else s for s in SCORES], 2, 3)


def test_json_output():
    spans = _spans()
    d = to_json(TOKENS, SCORES, spans, steer="detox", strength=-5)
    assert d["text"] == "You are a stupid idiot and <b> nice"
    assert d["spans"][0] == {"start": 3, "end": 5, "score": 5.0, "text": " stupid idiot"}
    assert d["spans"][1]["text"] == " nice"
    assert d["scores"][0] is None and d["steer"] == "detox"
    json.dumps(d)  # serialisable


def test_html_is_self_contained_and_escaped():
    page = to_html(TOKENS, SCORES, _spans(), title="t<x>")
    assert page.startswith("<!DOCTYPE html>")
    assert "&lt;b&gt;" in page and " <b>" not in page
    assert "t&lt;x&gt;" in page
    assert "http" not in page and "<script" not in page
    assert page.count('class="box"') == 2
    assert "+5.000" in page


def test_ansi_and_plain():
    spans = _spans()
    col = to_ansi(TOKENS, SCORES, spans, color=True)
    assert "\x1b[" in col and "stupid" in col
    plain = to_ansi(TOKENS, SCORES, spans, color=False)
    assert "\x1b" not in plain
    assert plain.splitlines()[0] == "You are a[[1:  stupid idiot]] and <b>[[2:  nice]]"
    assert "span 1: tokens 3-5  score +5.000" in plain


def test_use_color(monkeypatch):
    class Tty:
        def isatty(self):
            return True

    monkeypatch.delenv("NO_COLOR", raising=False)
    assert use_color(Tty()) is True
    monkeypatch.setenv("NO_COLOR", "1")
    assert use_color(Tty()) is False
    assert use_color(Tty(), "always") is True
    assert use_color(Tty(), "never") is False
    monkeypatch.delenv("NO_COLOR")
    assert use_color(object()) is False  # not a tty


def test_light_import():
    code = ("import sys, vllm_steer.lens.highlight as h; h.best_spans([1.0], 1, 1); "
            "print('torch' in sys.modules, 'transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False False"


def test_renderers_check_lengths():
    with pytest.raises(ValueError, match="2 tokens but 1 scores"):
        to_json(["a", "b"], [1.0], [])
    with pytest.raises(ValueError, match="outside"):
        to_json(["a"], [1.0], [Span(0, 2, 1.0)])


# -------------------------------------------------------------- on the tiny random model

@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    return model, AutoTokenizer.from_pretrained(tiny_model_dir)


def test_token_scores_match_logprob_difference(tiny):
    import torch

    from helpers.steers import random_steer
    from vllm_steer.hf import steering
    from vllm_steer.lens.highlight import text_pieces, token_scores

    model, tok = tiny
    steer = random_steer(64, 4, "s", seed=1)
    text = "The quick brown fox jumps over the lazy dog."
    pieces, scores = token_scores(model, tok, text, steer, 5.0, prefix="")
    assert "".join(pieces) == text
    assert scores[0] is None and all(isinstance(s, float) for s in scores[1:])
    ids, _ = text_pieces(tok, text)
    x = torch.tensor([ids])
    with torch.no_grad():
        plain = torch.log_softmax(model(x).logits[0, :-1], -1)
        with steering(model, steer, 5.0):
            st = torch.log_softmax(model(x).logits[0, :-1], -1)
    want = (st - plain).gather(-1, x[0, 1:, None])[:, 0]
    assert torch.allclose(torch.tensor(scores[1:]), want, atol=1e-4)
    # with a prefix every token is scored
    pieces2, scores2 = token_scores(model, tok, text, steer, 5.0, against=-5.0)
    assert "".join(pieces2) == text and None not in scores2


def test_highlight_cli(tiny_model_dir, tmp_path):
    from helpers.steers import random_steer
    from vllm_steer.cli import main
    from vllm_steer.format import save_steer

    path = tmp_path / "s.safetensors"
    save_steer(path, random_steer(64, 4, "s", seed=1))
    out_json, out_html = tmp_path / "h.json", tmp_path / "h.html"
    text_file = tmp_path / "t.txt"
    text_file.write_text("I really love this wonderful movie, it is great.")
    rc = main(["highlight", "--steer", str(path), "--model", str(tiny_model_dir),
               "--file", str(text_file), "--strength", "8", "--spans", "2", "--max-span", "3",
               "--json", str(out_json), "--html", str(out_html), "--color", "never"])
    assert rc == 0
    d = json.loads(out_json.read_text())
    assert d["text"] == text_file.read_text()
    assert 1 <= len(d["spans"]) <= 2
    assert d["strength"] == 8.0 and d["steer"] == "s"
    assert out_html.read_text().startswith("<!DOCTYPE html>")


def test_the_highlights_label_line_reads_the_shipped_detox_steers_labels():
    """``harmful`` names a side, not a direction of the strength: the shipped detox steer's
    labels read as its two sides and which of them is harmful."""
    from vllm_steer.format import read_metadata
    from vllm_steer.lens.cli import _labels_line

    meta = read_metadata(os.path.join(os.path.dirname(__file__), "..", "..", "steers",
                                      "smollm2-detox.safetensors"))
    line = _labels_line(SimpleNamespace(metadata=meta))
    assert line == (f"positive strength -> {meta.labels['positive']}, negative strength -> "
                    f"{meta.labels['negative']}, the negative side is the harmful one")
    assert "harmful strength" not in line


def test_a_text_longer_than_the_models_context_is_refused(tmp_path):
    """GPT-2-style models have learned position embeddings: a longer text would crash with
    "IndexError: index out of range in self" inside the model. Refused before, naming
    --max-tokens; cut to fit, it is scored."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from helpers.families import HIDDEN, make_family_model
    from helpers.steers import random_steer
    from vllm_steer.lens.highlight import token_scores

    path = make_family_model("gpt2", tmp_path / "gpt2")
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    tok = AutoTokenizer.from_pretrained(path)
    steer = random_steer(HIDDEN, 4, "s", seed=1)
    text = "The quick brown fox jumps over the lazy dog. " * 60  # 600 tokens > 512 positions
    with pytest.raises(ValueError, match="--max-tokens 511 or less"):
        token_scores(model, tok, text, steer, 5.0)
    pieces, scores = token_scores(model, tok, text, steer, 5.0, max_length=511)
    assert len(pieces) == len(scores) == 511 and all(s is not None for s in scores)


def test_max_tokens_inside_the_first_character_is_refused_not_an_empty_result(tmp_path):
    """A character the tokenizer splits into several byte tokens: a cut inside the first one
    left no text at all (an empty result, no error); refused, naming the tokens it takes."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from helpers.families import HIDDEN, make_family_model
    from helpers.steers import random_steer
    from vllm_steer.lens.highlight import text_pieces, token_scores

    path = make_family_model("gpt2", tmp_path / "gpt2")
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    tok = AutoTokenizer.from_pretrained(path)
    steer = random_steer(HIDDEN, 4, "s", seed=1)
    text = "\U0001F600\U0001F600 hi"
    ids, pieces = text_pieces(tok, text)
    first = next(i + 1 for i, p in enumerate(pieces) if p)
    assert first > 1  # the emoji takes several tokens with this tokenizer
    with pytest.raises(ValueError, match=f"--max-tokens {first} or more"):
        token_scores(model, tok, text, steer, 5.0, max_length=first - 1)
    got, scores = token_scores(model, tok, text, steer, 5.0, max_length=first)
    assert "".join(got) == "\U0001F600" and len(scores) == first
