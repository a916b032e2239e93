"""``vllm-steer train --kind vector`` on a tiny random Llama with synthetic pairs: CAA against
the mean difference read from transformers' ``output_hidden_states``, PCA against numpy's SVD,
the files it writes read back with the gguf package and with ours, and ``convert`` both ways."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from vllm_steer.cli import main
from vllm_steer.train.config import DataConfig, VectorConfig
from vllm_steer.train.vector import train_vector
from vllm_steer.vectors import load_vector

gguf = pytest.importorskip("gguf")

POS = "happy good great lovely wonderful kind sunny bright joyful nice".split()
NEG = "sad bad awful terrible horrible cruel dark gloomy nasty ugly".split()
FILL = "the a day was and it felt very so we".split()
LAYERS = 4


def _texts(words, n, seed):
    rng = random.Random(seed)
    return [" ".join(rng.choice(words) if rng.random() < 0.5 else rng.choice(FILL)
                     for _ in range(rng.randint(3, 9))) for _ in range(n)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from helpers.models import make_tiny_llama

    return make_tiny_llama(tmp_path_factory.mktemp("tiny4"), layers=LAYERS)


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> DataConfig:
    d = tmp_path_factory.mktemp("pairs")
    files = {}
    for name, words, n, seed in (("pos", POS, 30, 1), ("neg", NEG, 30, 2),
                                 ("dev_pos", POS, 6, 3), ("dev_neg", NEG, 6, 4)):
        files[name] = d / f"{name}.txt"
        files[name].write_text("\n".join(_texts(words, n, seed)))
    return DataConfig(positive=[str(files["pos"])], negative=[str(files["neg"])],
                      dev_positive=[str(files["dev_pos"])], dev_negative=[str(files["dev_neg"])])


def _train_pairs(model_dir, data, cfg):
    """The training pairs as train_vector forms them (the data's seeded order), as texts."""
    from vllm_steer.train.data import load_dataset

    ds = load_dataset(data, cfg.seed)
    pos = [e.text for e in ds.train if e.side > 0]
    neg = [e.text for e in ds.train if e.side < 0]
    n = min(len(pos), len(neg))
    return pos[:n], neg[:n]


def _last_token_states(model_dir, texts):
    """Each text alone through transformers with output_hidden_states: block k's output at the
    last token is hidden_states[k + 1]; the last block's is read with the final norm removed
    (transformers' last entry is normalised)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = np.zeros((LAYERS, len(texts), model.config.hidden_size))
    with torch.no_grad():
        for i, t in enumerate(texts):
            ids = tok(t, return_tensors="pt")["input_ids"]
            hs = model(ids, output_hidden_states=True).hidden_states
            for k in range(LAYERS - 1):
                out[k, i] = hs[k + 1][0, -1].double().numpy()
        model.model.norm = torch.nn.Identity()
        for i, t in enumerate(texts):
            ids = tok(t, return_tensors="pt")["input_ids"]
            out[LAYERS - 1, i] = model(ids, output_hidden_states=True).hidden_states[-1][0, -1] \
                .double().numpy()
    return out


def test_caa_is_the_mean_difference(model_dir, data, tmp_path):
    cfg = VectorConfig(model=str(model_dir), method="caa", layers="all", model_dtype="float32")
    res = train_vector(cfg, data, [str(tmp_path / "caa.safetensors")], progress=False,
                       log=lambda m: None)
    pos, neg = _train_pairs(model_dir, data, cfg)
    # the training texts read from the files by hand, not through load_dataset: every line of
    # --positive is a positive text (the dev texts have files of their own, so all are used)
    assert sorted(pos) == sorted(open(data.positive[0]).read().splitlines())
    assert sorted(neg) == sorted(open(data.negative[0]).read().splitlines())
    hp, hn = _last_token_states(model_dir, pos), _last_token_states(model_dir, neg)
    assert res.steer.layers == [0, 1, 2, 3]
    for k in range(LAYERS):
        want = (hp[k] - hn[k]).mean(0)
        np.testing.assert_allclose(res.steer.directions[k].double().numpy(), want,
                                   rtol=1e-4, atol=1e-5 * np.abs(want).max())
    assert res.metrics["pairs"]["train"] == len(pos) >= 20
    # the dev check: unsteered dev losses as transformers computes them, and the rule
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    check = res.metrics["dev_check"]
    for side, f in (("positive", data.dev_positive[0]), ("negative", data.dev_negative[0])):
        nll, n = 0.0, 0
        for t in open(f).read().splitlines():
            ids = tok(t, return_tensors="pt")["input_ids"]
            with torch.no_grad():
                nll += float(model(ids, labels=ids).loss) * (ids.shape[1] - 1)
            n += ids.shape[1] - 1
        assert check[side]["0"] == pytest.approx(nll / n, rel=1e-4)
    strengths = (0.01, 0.02, 0.03, 0.05, 0.1)  # CAA's default: fractions of one difference
    ok = [s for s in strengths
          if check["positive"][f"{s:+g}"] - check["positive"]["0"] <= 0.05
          and check["negative"][f"{-s:+g}"] - check["negative"]["0"] <= 0.05]
    assert res.steer.metadata.recommended_strength == (max(ok) if ok else 0.01)
    assert check["positive"]["+0.1"] != check["positive"]["0"]  # the vectors were applied


def test_pca_is_the_first_singular_vector_signed_towards_positive(model_dir, data, tmp_path):
    cfg = VectorConfig(model=str(model_dir), method="pca", model_dtype="float32",
                       fluency_budget=None)
    out = tmp_path / "pca.safetensors"
    res = train_vector(cfg, data, [str(out)], name="calm", progress=False, log=lambda m: None)
    pos, neg = _train_pairs(model_dir, data, cfg)
    hp, hn = _last_token_states(model_dir, pos), _last_token_states(model_dir, neg)
    assert res.steer.layers == [1, 2, 3]  # default: every block but 0, as llama.cpp steers
    for k in (1, 2, 3):
        d = hp[k] - hn[k]
        _, _, vt = np.linalg.svd(d - d.mean(0), full_matrices=False)
        got = res.steer.directions[k].double().numpy()
        assert abs(np.linalg.norm(got) - 1) < 1e-5
        np.testing.assert_allclose(abs(got @ vt[0]), 1.0, atol=1e-4)  # same axis
        higher = ((hp[k] - hn[k]) @ got > 0).mean()
        assert higher >= 0.5  # the sign: positive texts project higher in most pairs
        assert res.metrics["per_layer"][str(k)]["train_separation"] == pytest.approx(higher,
                                                                                    abs=1e-3)
    meta = load_vector(out).metadata
    assert meta.name == "calm" and meta.model_layers == LAYERS and meta.model_type == "llama"
    assert meta.recipe["method"] == "pca" and meta.data["sha256"]


def test_cli_writes_gguf_and_ours_and_converts_both_ways(model_dir, data, tmp_path, capsys):
    ours, gg = tmp_path / "v.safetensors", tmp_path / "v.gguf"
    assert main(["train", "--kind", "vector", "--model", str(model_dir), "--positive",
                 *data.positive, "--negative", *data.negative, "--method", "caa",
                 "--layers", "1-3", "--model-dtype", "float32", "--quiet",
                 "--out", str(ours), str(gg)]) == 0
    a, b = load_vector(ours), load_vector(gg)
    assert a.layers == b.layers == [1, 2, 3]
    reader = gguf.GGUFReader(str(gg))  # the gguf package's own reader
    assert reader.get_field("general.architecture").contents() == "controlvector"
    assert reader.get_field("controlvector.model_hint").contents() == "llama"
    for t in reader.tensors:
        k = int(t.name.split(".")[1])
        assert np.asarray(t.data).tobytes() == a.directions[k].numpy().tobytes()
    # GGUF -> ours -> GGUF keeps every tensor bit for bit
    back, again = tmp_path / "back.safetensors", tmp_path / "again.gguf"
    assert main(["convert", str(gg), "--out", str(back)]) == 0
    assert main(["convert", str(back), "--out", str(again), "--layers", "2-3"]) == 0
    assert "blocks 2-3" in capsys.readouterr().out
    r2 = gguf.GGUFReader(str(again))
    assert {t.name: np.asarray(t.data).tobytes() for t in r2.tensors} == {
        t.name: np.asarray(t.data).tobytes() for t in reader.tensors if t.name != "direction.1"}
    assert main(["info", str(gg)]) == 0
    assert '"kind": "vector"' in capsys.readouterr().out


def test_cli_refusals(model_dir, data, tmp_path, capsys):
    base = ["train", "--model", str(model_dir), "--positive", *data.positive, "--negative",
            *data.negative]
    assert main([*base, "--kind", "vector", "--steps", "5", "--out",
                 str(tmp_path / "x.safetensors")]) == 2
    assert "--steps: LM-Steer training flags, not used by --kind vector" in \
        capsys.readouterr().err
    assert main([*base, "--layers", "1-2", "--out", str(tmp_path / "x.safetensors")]) == 2
    assert "--layers: vector-steer flags; add --kind vector" in capsys.readouterr().err
    assert main([*base, "--kind", "vector", "--layers", "0-3", "--out",
                 str(tmp_path / "x.gguf")]) == 1
    assert "llama.cpp refuses direction.0" in capsys.readouterr().err
    assert main([*base, "--kind", "vector", "--layers", "2-9", "--out",
                 str(tmp_path / "x.safetensors")]) == 1
    assert "block 9 does not exist; the model has 4 decoder blocks" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_pairs_file_keeps_each_pair_together(model_dir, tmp_path, capsys):
    """``--pairs``: PCA of the differences of the file's own pairs (same topic, the sentiment
    word swapped), compared with numpy's SVD of those differences."""
    import json

    rng = random.Random(5)
    pairs = []
    for _ in range(24):
        words = [rng.choice(FILL) for _ in range(rng.randint(3, 7))]
        at = rng.randrange(len(words) + 1)
        pairs.append((" ".join(words[:at] + [rng.choice(POS)] + words[at:]),
                      " ".join(words[:at] + [rng.choice(NEG)] + words[at:])))
    f = tmp_path / "pairs.jsonl"
    f.write_text("\n".join(json.dumps({"positive": p, "negative": n}) for p, n in pairs))
    out = tmp_path / "p.safetensors"
    assert main(["train", "--kind", "vector", "--model", str(model_dir), "--pairs", str(f),
                 "--dev-fraction", "0", "--model-dtype", "float32", "--quiet",
                 "--out", str(out)]) == 0
    vs = load_vector(out)
    hp = _last_token_states(model_dir, [p for p, _ in pairs])
    hn = _last_token_states(model_dir, [n for _, n in pairs])
    for k in vs.layers:
        d = hp[k] - hn[k]
        _, _, vt = np.linalg.svd(d - d.mean(0), full_matrices=False)
        np.testing.assert_allclose(abs(vs.directions[k].double().numpy() @ vt[0]), 1.0,
                                   atol=1e-4)
    assert vs.metadata.data["counts"] == {"pairs": 24, "dev_pairs": 0}
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"positive": "a b c", "negative": "d e f"}\n{"positive": 3}\n')
    assert main(["train", "--kind", "vector", "--model", str(model_dir), "--pairs", str(bad),
                 "--out", str(tmp_path / "b.safetensors")]) == 1
    assert 'bad.jsonl:2: expected an object with string keys "positive" and "negative"' in \
        capsys.readouterr().err
    assert main(["train", "--kind", "vector", "--model", str(model_dir), "--pairs", str(f),
                 "--positive", str(f), "--out", str(tmp_path / "b.safetensors")]) == 2
    assert "--pairs and --positive: give the pairs or the sides, not both" in \
        capsys.readouterr().err


def test_a_text_longer_than_max_length_is_read_at_its_own_last_token(model_dir, tmp_path,
                                                                    capsys):
    """Pairs of a long shared context and a different ending (repeng's usual data): a text
    over --max-length keeps its end (and its beginning-of-sequence token), so the state read
    is its own last token's, as repeng reads it; the cut is said. Before, the texts were cut
    to their first tokens, the same in both texts of a pair: every difference was 0 and the
    file held an arbitrary unit vector, without a word."""
    import json

    from transformers import AutoModelForCausalLM, AutoTokenizer

    context = " ".join(FILL * 3)
    pairs = [(f"{context} {p}", f"{context} {n}") for p, n in zip(POS, NEG, strict=True)]
    f = tmp_path / "pairs.jsonl"
    f.write_text("\n".join(json.dumps({"positive": p, "negative": n}) for p, n in pairs))
    out = tmp_path / "long.safetensors"
    max_length = 8
    assert main(["train", "--kind", "vector", "--model", str(model_dir), "--pairs", str(f),
                 "--dev-fraction", "0", "--model-dtype", "float32", "--quiet",
                 "--max-length", str(max_length), "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert f"20 texts were longer than --max-length {max_length} tokens" in err, err
    vs = load_vector(out)
    assert vs.metadata.metrics["texts_cut_at_start"] == 20
    # the reference: each text's end in plain transformers (block k's output: hidden_states
    # [k + 1]), its first token kept when it is the beginning-of-sequence token
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    def states(texts):
        rows = []
        for t in texts:
            ids = tok(t)["input_ids"]
            keep = ([ids[0]] + ids[len(ids) - max_length + 1:]
                    if tok.bos_token_id is not None and ids[0] == tok.bos_token_id
                    else ids[len(ids) - max_length:])
            with torch.no_grad():
                hs = model(torch.tensor([keep]), output_hidden_states=True).hidden_states
            rows.append([hs[k + 1][0, -1].double().numpy() for k in range(LAYERS - 1)])
        return np.array(rows).transpose(1, 0, 2)

    hp, hn = states([p for p, _ in pairs]), states([n for _, n in pairs])
    for k in (1, 2):
        d = hp[k] - hn[k]
        assert np.abs(d).max() > 1e-3  # the endings differ
        _, _, vt = np.linalg.svd(d - d.mean(0), full_matrices=False)
        np.testing.assert_allclose(abs(vs.directions[k].double().numpy() @ vt[0]), 1.0,
                                   atol=1e-4)
    same = tmp_path / "same.jsonl"
    same.write_text("\n".join(json.dumps({"positive": p, "negative": p}) for p, _ in pairs))
    assert main(["train", "--kind", "vector", "--model", str(model_dir), "--pairs", str(same),
                 "--dev-fraction", "0", "--quiet", "--out", str(tmp_path / "s.safetensors")]) == 1
    assert "every training pair's two texts have the same state at their last token" in \
        capsys.readouterr().err
    assert not (tmp_path / "s.safetensors").exists()


def test_pca_sign_on_a_tie_follows_the_mean_difference_not_the_solver():
    """As many pairs project each way (an even number of pairs): the direction is signed so
    that the mean difference projects positive, whatever sign the SVD returned (it was kept
    as returned: an arbitrary half of such files were flipped)."""
    from vllm_steer.train.vector import pca_direction

    along = torch.tensor([3.0, 3.0, -1.0, -1.0], dtype=torch.float64)  # a tie, mean +1
    for seed in range(8):
        g = torch.Generator().manual_seed(seed)
        q = torch.linalg.qr(torch.randn(16, 16, generator=g, dtype=torch.float64))[0][:, 0]
        neg = torch.randn(4, 16, generator=g, dtype=torch.float64)
        pos = neg + along[:, None] * q
        got = pca_direction(pos, neg).double()
        torch.testing.assert_close(got, q, rtol=0, atol=1e-6)
        # the rows in another order: the same direction
        perm = torch.tensor([2, 0, 3, 1])
        torch.testing.assert_close(pca_direction(pos[perm], neg[perm]).double(), q, rtol=0,
                                   atol=1e-6)


def test_a_multimodal_checkpoint_trains_on_its_language_model(tmp_path):
    """Gemma 3 4B and up (and Mistral 3, Qwen2.5-VL, ...) load through AutoModelForCausalLM
    as a ...ForConditionalGeneration whose config holds the hidden size in its text config:
    the vector is read at its language model's blocks (hidden_states[k + 1]) like any other."""
    import transformers as tf

    from helpers.models import copy_tokenizer

    text = tf.Gemma3TextConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=3,
                               num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                               vocab_size=49152, max_position_embeddings=512,
                               query_pre_attn_scalar=64, sliding_window=256, bos_token_id=1,
                               eos_token_id=2, pad_token_id=2)
    vision = tf.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=2, image_size=28, patch_size=14)
    cfg = tf.Gemma3Config(text_config=text.to_dict(), vision_config=vision.to_dict(),
                          mm_tokens_per_image=4, image_token_index=3, boi_token_index=4,
                          eoi_token_index=5)
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(cfg).eval()
    assert not hasattr(model.config, "hidden_size")  # only its text config has one
    folder = tmp_path / "gemma3"
    model.save_pretrained(folder)
    copy_tokenizer(folder)
    pos, neg = _texts(POS, 12, 1), _texts(NEG, 12, 2)
    (tmp_path / "p.txt").write_text("\n".join(pos))
    (tmp_path / "n.txt").write_text("\n".join(neg))
    data = DataConfig(positive=[str(tmp_path / "p.txt")], negative=[str(tmp_path / "n.txt")],
                      dev_fraction=0.0)
    vcfg = VectorConfig(model=str(folder), method="caa", layers="0-1", model_dtype="float32")
    res = train_vector(vcfg, data, [str(tmp_path / "v.safetensors")], progress=False,
                       log=lambda m: None)
    tp, tn = _train_pairs(folder, data, vcfg)
    tok = tf.AutoTokenizer.from_pretrained(folder)
    model = tf.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()

    def states(texts):
        with torch.no_grad():
            return np.array([[model(torch.tensor([tok(t)["input_ids"]]),
                                    output_hidden_states=True).hidden_states[k + 1][0, -1]
                              .double().numpy() for t in texts] for k in (0, 1)])

    hp, hn = states(tp), states(tn)
    for k in (0, 1):
        want = (hp[k] - hn[k]).mean(0)
        np.testing.assert_allclose(res.steer.directions[k].double().numpy(), want,
                                   rtol=1e-4, atol=1e-5 * np.abs(want).max())
    assert res.steer.metadata.model_layers == 3


def test_pairs_refuse_the_flags_they_would_ignore(model_dir, tmp_path, capsys):
    """--pairs takes its dev pairs out of its own files: dev texts by side (--dev-positive,
    --dev-negative, --dev-data) and the flags of labelled data were ignored without a word
    (the dev check then ran on pairs held out of the training pairs)."""
    import json

    f = tmp_path / "pairs.jsonl"
    f.write_text("\n".join(json.dumps({"positive": f"the day was {p}",
                                       "negative": f"the day was {n}"})
                           for p, n in zip(POS, NEG, strict=True)))
    dev = tmp_path / "dev.txt"
    dev.write_text("the day was fine\nthe day was good\n")
    base = ["train", "--kind", "vector", "--model", str(model_dir), "--pairs", str(f),
            "--quiet", "--out", str(tmp_path / "v.safetensors")]
    assert main([*base, "--dev-positive", str(dev), "--dev-negative", str(dev)]) == 2
    assert "--pairs and --dev-positive, --dev-negative" in capsys.readouterr().err
    assert main([*base, "--text-field", "sentence"]) == 2
    assert "--text-field: flags of --data/--positive/--negative" in capsys.readouterr().err
    assert not (tmp_path / "v.safetensors").exists()


def test_pca_of_differences_that_do_not_vary_is_refused(model_dir, tmp_path, capsys):
    """One pair repeated: the centred differences are all 0 and their "first principal
    component" is whatever axis the solver returns (hidden dimension 0), written with a
    perfect train separation. Refused, pointing to --method caa, which has a direction."""
    import json

    from vllm_steer.train.vector import pca_direction

    g = torch.Generator().manual_seed(0)
    neg = torch.randn(5, 16, generator=g)
    pos = neg + torch.randn(16, generator=g)  # every pair differs by the same vector
    with pytest.raises(ValueError, match="--method caa"):
        pca_direction(pos, neg)
    f = tmp_path / "same.jsonl"
    f.write_text("\n".join(json.dumps({"positive": "I feel very happy today",
                                       "negative": "I feel very sad today"})
                           for _ in range(6)))
    out = tmp_path / "v.safetensors"
    assert main(["train", "--kind", "vector", "--model", str(model_dir), "--pairs", str(f),
                 "--dev-fraction", "0", "--model-dtype", "float32", "--quiet",
                 "--out", str(out)]) == 1
    assert "the pairs' differences are all the same" in capsys.readouterr().err
    assert not out.exists()
    assert main(["train", "--kind", "vector", "--model", str(model_dir), "--pairs", str(f),
                 "--dev-fraction", "0", "--model-dtype", "float32", "--quiet", "--method",
                 "caa", "--out", str(out)]) == 0


def test_a_recommended_strength_beyond_the_budget_is_said(model_dir, data, tmp_path, capsys):
    """No check strength within --fluency-budget: the smallest is recorded, as LM-Steer
    training does, and said (it was recorded silently)."""
    out = tmp_path / "v.safetensors"
    assert main(["train", "--kind", "vector", "--model", str(model_dir), "--positive",
                 *data.positive, "--negative", *data.negative, "--dev-positive",
                 *data.dev_positive, "--dev-negative", *data.dev_negative, "--method", "caa",
                 "--check-strengths", "20,40", "--fluency-budget", "0", "--model-dtype",
                 "float32", "--quiet", "--out", str(out)]) == 0
    meta = load_vector(out).metadata
    check = meta.metrics["dev_check"]
    assert max(check["positive"]["+20"] - check["positive"]["0"],
               check["negative"]["-20"] - check["negative"]["0"]) > 0  # over the budget
    assert meta.recommended_strength == 20
    assert "warning: even strength 20 costs the steered-towards dev texts" in \
        capsys.readouterr().err


def test_pairs_dropped_for_a_short_text_are_said_and_counted(model_dir, tmp_path, capsys):
    """A pair whose text is empty (or one token) is dropped: said, counted in the file, and
    when that empties the dev pairs the missing recommended strength is explained (before,
    half the pairs and every dev pair went without a word)."""
    import json

    both = enumerate(zip(POS * 2, NEG * 2, strict=True))
    lines = [{"positive": f"the day was very {p}", "negative": "" if i % 2 == 0 else
              f"the day was very {n}"} for i, (p, n) in both]
    f = tmp_path / "pairs.jsonl"
    f.write_text("\n".join(json.dumps(d) for d in lines))
    out = tmp_path / "v.safetensors"
    assert main(["train", "--kind", "vector", "--model", str(model_dir), "--pairs", str(f),
                 "--model-dtype", "float32", "--quiet", "--out", str(out)]) == 0
    err = capsys.readouterr().err
    vs = load_vector(out)
    dropped = vs.metadata.metrics["dropped_too_short"]
    assert dropped["train"] + dropped["dev"] == 10
    assert f"dropped {dropped['train']} training and {dropped['dev']} dev pairs" in err
    if vs.metadata.metrics["pairs"]["dev"] == 0:
        assert "no recommended strength" in err
