"""Explain: SVD from the factors, planted directions and tokens, orientation, table, figure."""

from __future__ import annotations

import pytest
import torch

from vllm_steer.format import make_steer, save_steer
from vllm_steer.lens.explain import (all_singular_values, direction_tokens, explain,
                                     markdown_table, orient_by_extremes, steer_directions,
                                     word_like)

D, V = 32, 2000


def _planted(seed=0):
    """E with tokens 0..9 planted along +u and 10..19 along -u; W = u v^T (column form),
    i.e. S = v u^T: P1 = [v, small], P2 = [u, small] (rank 3)."""
    g = torch.Generator().manual_seed(seed)
    E = torch.randn(V, D, generator=g) * 0.3
    u = torch.randn(D, generator=g)
    u /= u.norm()
    v = torch.randn(D, generator=g) * 2.0
    E[:10] += 4.0 * u
    E[10:20] -= 4.0 * u
    p1 = torch.cat([v[:, None], 0.01 * torch.randn(D, 2, generator=g)], 1)
    p2 = torch.cat([u[:, None], 0.01 * torch.randn(D, 2, generator=g)], 1)
    letters = "abcdefghijklmnopqrstuvwxyz"
    pieces = [" tok" + "".join(letters[(i // 26 ** j) % 26] for j in range(3)) for i in range(V)]
    return E, u, v, p1, p2, pieces


def test_top_direction_is_u_and_top_tokens_are_the_planted_ones():
    E, u, v, p1, p2, pieces = _planted()
    steer = make_steer(p1, p2, "planted")
    dirs, rows = explain(steer, E, pieces, k=3, n=10)
    assert abs(float(dirs.outputs[0] @ u)) > 0.999  # output side = u
    assert abs(float(dirs.inputs[0] @ v / v.norm())) > 0.999  # input side = v
    assert float(dirs.sigma[0]) == pytest.approx(float(v.norm()), rel=1e-3)
    # oriented by extremes: both planted groups are extreme, one per end
    top = {t for t, _ in rows[0].top}
    bottom = {t for t, _ in rows[0].bottom}
    planted_pos, planted_neg = set(pieces[:10]), set(pieces[10:20])
    assert {frozenset(top), frozenset(bottom)} == {frozenset(planted_pos), frozenset(planted_neg)}
    assert rows[0].share > 0.99


def test_singular_values_match_dense_svd():
    g = torch.Generator().manual_seed(1)
    p1, p2 = torch.randn(40, 6, generator=g), torch.randn(40, 6, generator=g)
    s = make_steer(p1, p2, "x")
    dense = torch.linalg.svdvals((p1 @ p2.T).double())[:6].float()
    assert torch.allclose(all_singular_values(s), dense, rtol=1e-4)
    dirs = steer_directions(p1, p2, k=6)
    S = (p1 @ p2.T).double()
    for i in range(6):  # a_i S = sigma_i b_i
        assert torch.allclose((dirs.inputs[i].double() @ S).float(),
                              dirs.sigma[i] * dirs.outputs[i], atol=1e-3)


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_orientation_follows_the_contexts(sign):
    """Contexts with c.v > 0 get pushed towards +u, so the + end is the tokens along +u;
    with c.v < 0 the + end is the tokens along -u."""
    E, u, v, p1, p2, pieces = _planted()
    g = torch.Generator().manual_seed(2)
    contexts = torch.randn(200, D, generator=g) * 0.1 + sign * v / v.norm()
    dirs, rows = explain(make_steer(p1, p2, "p"), E, pieces, k=1, n=10, contexts=contexts)
    want = set(pieces[:10]) if sign > 0 else set(pieces[10:20])
    assert {t for t, _ in rows[0].top} == want
    assert rows[0].agreement > 0.95
    # the sign convention: positive strength raises the + end's logits in these contexts
    steer = make_steer(p1, p2, "p")
    shift = ((contexts @ steer.p1) @ steer.p2.T) @ E.T  # [contexts, vocab]
    top_ids = [pieces.index(t) for t, _ in rows[0].top]
    bottom_ids = [pieces.index(t) for t, _ in rows[0].bottom]
    assert float(shift[:, top_ids].mean()) > 0 > float(shift[:, bottom_ids].mean())


def test_word_like_and_table():
    assert word_like(" hello") and word_like(" Idiot")
    assert not word_like("hello") and not word_like(" hi") and not word_like(" he's")
    assert not word_like(" 123") and not word_like(" ##")
    E, u, v, p1, p2, pieces = _planted()
    _, rows = explain(make_steer(p1, p2, "p"), E, pieces, k=2, n=3)
    md = markdown_table(rows, {"positive": "non-toxic"})
    lines = md.strip().splitlines()
    assert lines[0].startswith("| dir | sigma") and "raised by non-toxic" in lines[0]
    assert len(lines) == 2 + 2
    assert lines[2].startswith("| 1 | ")
    first = {t for t, _ in rows[0].top}
    assert all(t.strip() in lines[2] for t in first)


def test_is_word_filter_skips_rejected_candidates():
    E, u, v, p1, p2, pieces = _planted()
    dirs = orient_by_extremes(steer_directions(p1, p2, 1), E)
    rejected = set(range(0, 5))  # half of the planted "+" tokens are "fragments"
    rows = direction_tokens(dirs, E, pieces, n=10,
                            is_word=lambda ids: [i not in rejected for i in ids])
    top = [t for t, _ in rows[0].top]
    assert set(pieces[5:10]) <= set(top) and not set(pieces[:5]) & set(top)
    assert len(top) == 10  # refilled from further candidates


def test_word_end_probability_tells_words_from_fragments(smollm2_dir):
    from vllm_steer.lens.explain import token_pieces, word_end_probability
    from vllm_steer.lens.lm import load_lm

    model, tok = load_lm(str(smollm2_dir))
    words = [" verification", " calligraphy", " ideas", " happy"]
    fragments = [" affili", " sovere", " strugg", " ingred"]
    ids = {w: tok(w, add_special_tokens=False)["input_ids"] for w in words + fragments}
    assert all(len(i) == 1 for i in ids.values()), ids
    p = word_end_probability(model, tok, [i[0] for i in ids.values()],
                             token_pieces(tok, model.lm_head.weight.shape[0]))
    assert all(p[ids[w][0]] > 0.5 for w in words), p
    assert all(p[ids[f][0]] < 0.5 for f in fragments), p


def test_direction_tokens_checks_lengths():
    E, u, v, p1, p2, pieces = _planted()
    dirs = steer_directions(p1, p2, 1)
    with pytest.raises(ValueError, match="token strings"):
        direction_tokens(dirs, E, pieces[:10])


def test_explain_cli_on_tiny_model(tiny_model_dir, tmp_path, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from vllm_steer.cli import main

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    E = model.lm_head.weight.detach()
    words = [" happy", " wonderful"]
    ids = [tok(w, add_special_tokens=False)["input_ids"] for w in words]
    assert all(len(i) == 1 for i in ids)
    u = E[[i[0] for i in ids]].sum(0)
    g = torch.Generator().manual_seed(0)
    p1 = torch.randn(64, 2, generator=g)
    p2 = torch.stack([u, 0.001 * torch.randn(64, generator=g)], 1)
    path = tmp_path / "planted.safetensors"
    save_steer(path, make_steer(p1, p2, "planted", labels={"positive": "joy"}))
    png, md = tmp_path / "e.png", tmp_path / "e.md"
    rc = main(["explain", "--steer", str(path), "--model", str(tiny_model_dir),
               "--directions", "2", "--top", "8", "--png", str(png), "--markdown", str(md),
               "--word-threshold", "0"])
    assert rc == 0
    out = capsys.readouterr().out
    row1 = [ln for ln in out.splitlines() if ln.startswith("| 1 |")][0]
    plus, minus = row1.split("|")[5], row1.split("|")[6]
    assert all(w.strip() in plus for w in words) or all(w.strip() in minus for w in words)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert row1 in md.read_text().splitlines()
    assert "domain component" not in out
    # a domain component served with the steer is left out of S, and the table says so
    served = tmp_path / "served.safetensors"
    save_steer(served, make_steer(p1, p2, "served", labels={"positive": "joy"},
                                  domain_p1=torch.randn(64, 1, generator=g),
                                  domain_p2=torch.randn(64, 1, generator=g), domain="with_steer",
                                  domain_strength=2.0))
    assert main(["explain", "--steer", str(served), "--model", str(tiny_model_dir),
                 "--directions", "2", "--top", "8", "--word-threshold", "0"]) == 0
    out2 = capsys.readouterr().out
    assert ("domain component (rank 1), served with it at domain strength 2 whatever the "
            "request's strength, is not in S") in out2
    assert [ln for ln in out2.splitlines() if ln.startswith("| 1 |")][0] == row1


def _spm_tokenizer(words):
    """A Llama-2 / Mistral-style SentencePiece BPE in memory: "▁" word starts, byte fallback
    and the SPM decoder (which strips the leading space of a decoded sequence's first token)."""
    import json

    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    merges = []
    for w in ["\u2581" + w for w in words]:
        for ch in w:
            vocab.setdefault(ch, len(vocab))
        for j in range(2, len(w) + 1):
            if w[:j] not in vocab:
                merges.append([w[:j - 1], w[j - 1]])
                vocab[w[:j]] = len(vocab)
    special = [{"id": i, "content": c, "single_word": False, "lstrip": False, "rstrip": False,
                "normalized": False, "special": True} for c, i in (("<unk>", 0), ("<s>", 1),
                                                                   ("</s>", 2))]
    spec = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": special,
            "normalizer": {"type": "Sequence", "normalizers": [
                {"type": "Prepend", "prepend": "\u2581"},
                {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"}]},
            "pre_tokenizer": None, "post_processor": None,
            "decoder": {"type": "Sequence", "decoders": [
                {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
                {"type": "ByteFallback"}, {"type": "Fuse"},
                {"type": "Strip", "content": " ", "start": 1, "stop": 0}]},
            "model": {"type": "BPE", "dropout": None, "unk_token": "<unk>",
                      "continuing_subword_prefix": None, "end_of_word_suffix": None,
                      "fuse_unk": True, "byte_fallback": True, "vocab": vocab,
                      "merges": merges}}
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(spec)),
                                   bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def test_token_pieces_keep_the_word_start_space_of_sentencepiece_tokens():
    from vllm_steer.lens.explain import token_pieces

    words = ["hello", "world", "apple", "a"]
    tok = _spm_tokenizer(words)
    ids = tok("hello world", add_special_tokens=False)["input_ids"]
    assert tok.convert_ids_to_tokens(ids) == ["\u2581hello", "\u2581world"]
    pieces = token_pieces(tok, len(tok))
    assert [pieces[i] for i in ids] == [" hello", " world"]
    assert word_like(pieces[ids[0]])
    assert pieces[tok.convert_tokens_to_ids("h")] == "h"  # a word-inside piece: no space


def test_the_soft_blacklist_report_keeps_the_word_start_space_too():
    """``eval``'s soft-blacklist report names its tokens as they read in a text, like
    ``explain`` (it decoded each alone: SentencePiece tokenizers dropped the space)."""
    from types import SimpleNamespace

    import torch

    from vllm_steer.eval.soft_blacklist import describe

    tok = _spm_tokenizer(["hello", "world", "apple", "a"])
    hello, world = (tok.convert_tokens_to_ids(t) for t in ("\u2581hello", "\u2581world"))
    bias = torch.zeros(len(tok))
    bias[hello], bias[world] = 2.0, -2.0
    d = describe(SimpleNamespace(bias=bias, epsilon=1e-3), k=1, tokenizer=tok)
    assert d["raised"] == [" hello"] and d["lowered"] == [" world"]
