"""Training inputs (vllm_steer.train.data and the tokenization in train.hidden): formats,
label rules, presets, the dev split, and clear errors for bad input."""

from __future__ import annotations

import json

import pytest

from vllm_steer.train.config import DataConfig
from vllm_steer.train.data import (DataError, file_sha256, load_dataset, preset_data_config,
                                   read_examples)


def _write(path, text):
    path.write_text(text, encoding="utf-8")
    return str(path)


def _jsonl(path, rows):
    return _write(path, "".join(json.dumps(r) + "\n" for r in rows))


def test_jsonl_txt_and_sides(tmp_path):
    pos = _jsonl(tmp_path / "pos.jsonl", [{"text": f"good {i}"} for i in range(5)])
    neg = _write(tmp_path / "neg.txt", "bad 1\n\n   \nbad 2\nbad 3\n")
    ds = load_dataset(DataConfig(positive=[pos], negative=[neg], dev_fraction=0.0))
    assert sorted(e.text for e in ds.train if e.side == 1) == [f"good {i}" for i in range(5)]
    assert sorted(e.text for e in ds.train if e.side == -1) == ["bad 1", "bad 2", "bad 3"]
    assert ds.report.files[neg]["empty_texts_skipped"] == 2
    assert ds.sha256 == {pos: file_sha256(pos), neg: file_sha256(neg)}
    assert ds.counts() == {"train": {"positive": 5, "negative": 3},
                           "dev": {"positive": 0, "negative": 0}}


def test_jsonl_named_text_field_and_missing_field_error(tmp_path):
    pos = _jsonl(tmp_path / "p.jsonl", [{"sentence": "nice"}, {"sentence": "lovely"}])
    neg = _jsonl(tmp_path / "n.jsonl", [{"sentence": "awful"}])
    ds = load_dataset(DataConfig(positive=[pos], negative=[neg], text_field="sentence",
                                 dev_fraction=0))
    assert {e.text for e in ds.train} == {"nice", "lovely", "awful"}
    with pytest.raises(DataError) as e:
        load_dataset(DataConfig(positive=[pos], negative=[neg]))
    msg = str(e.value)
    assert f"{pos}:1" in msg and "'text'" in msg and "sentence" in msg and "--text-field" in msg


def test_csv_with_header_and_label_rule(tmp_path):
    f = _write(tmp_path / "d.csv", 'text,label\n"hello, world",pos\nugly thing,neg\n'
                                   '"multi\nline",pos\nmeh,neutral\n')
    cfg = DataConfig(labelled=[f], positive_labels=["pos"], negative_labels=["neg"],
                     ignore_labels=["neutral"], dev_fraction=0)
    ds = load_dataset(cfg)
    assert sorted((e.text, e.side) for e in ds.train) == [
        ("hello, world", 1), ("multi\nline", 1), ("ugly thing", -1)]
    assert ds.report.files[f]["ignored_label_rows"] == 1


def test_csv_without_header_by_index_and_tsv(tmp_path):
    f = _write(tmp_path / "d.csv", "a text,0\nanother,1\n")
    ds = load_dataset(DataConfig(labelled=[f], header=False, positive_labels=["0"],
                                 negative_labels=["1"], dev_fraction=0))
    assert sorted((e.text, e.side) for e in ds.train) == [("a text", 1), ("another", -1)]
    t = _write(tmp_path / "d.tsv", 'sentence\tlabel\nit\'s "great"\t1\nno good\t0\n')
    ds = load_dataset(DataConfig(labelled=[t], text_field="sentence", positive_labels=["1"],
                                 negative_labels=["0"], dev_fraction=0))
    assert sorted((e.text, e.side) for e in ds.train) == [("it's \"great\"", 1), ("no good", -1)]


def test_unknown_label_names_file_line_and_fix(tmp_path):
    f = _write(tmp_path / "d.csv", "text,label\nx,0\ny,7\n")
    with pytest.raises(DataError) as e:
        read_examples(DataConfig(labelled=[f], positive_labels=["0"], negative_labels=["1"]))
    msg = str(e.value)
    assert f"{f}:3" in msg and "'7'" in msg and "--ignore-labels" in msg


def test_missing_column_missing_file_empty_file(tmp_path):
    f = _write(tmp_path / "d.csv", "body,stars\nx,1\n")
    with pytest.raises(DataError, match=r"no text column 'text' in the header \['body', 'stars'\]"):
        read_examples(DataConfig(labelled=[f], positive_labels=["1"], negative_labels=["2"]))
    with pytest.raises(DataError, match="no label column 'score'"):
        read_examples(DataConfig(labelled=[f], text_field="body", label_field="score",
                                 positive_labels=["1"], negative_labels=["2"]))
    missing = str(tmp_path / "nope.jsonl")
    with pytest.raises(DataError, match=f"{missing}: no such file"):
        read_examples(DataConfig(positive=[missing]))
    empty = _write(tmp_path / "empty.txt", "")
    with pytest.raises(DataError, match=f"{empty}: file is empty"):
        read_examples(DataConfig(positive=[empty]))
    blank = _write(tmp_path / "blank.txt", "\n  \n")
    with pytest.raises(DataError, match=f"{blank}: no non-empty texts"):
        read_examples(DataConfig(positive=[blank]))
    bad = _write(tmp_path / "bad.jsonl", '{"text": "ok"}\n{oops\n')
    with pytest.raises(DataError, match=f"{bad}:2: not valid JSON"):
        read_examples(DataConfig(positive=[bad]))


def test_plain_text_cannot_be_labelled_and_both_sides_needed(tmp_path):
    t = _write(tmp_path / "a.txt", "x\ny\n")
    with pytest.raises(DataError, match="plain-text file has no labels"):
        read_examples(DataConfig(labelled=[t], positive_labels=["1"], negative_labels=["0"]))
    with pytest.raises(DataError, match="no negative training texts.*needs both sides"):
        load_dataset(DataConfig(positive=[t]))
    with pytest.raises(DataError, match="give both --positive-labels and --negative-labels"):
        read_examples(DataConfig(labelled=[_write(tmp_path / "l.csv", "text,label\na,1\n")],
                                 positive_labels=["1"]))


def test_dev_split_subset_and_seed(tmp_path):
    pos = _write(tmp_path / "p.txt", "\n".join(f"p{i}" for i in range(100)))
    neg = _write(tmp_path / "n.txt", "\n".join(f"n{i}" for i in range(50)))
    cfg = DataConfig(positive=[pos], negative=[neg], dev_fraction=0.2, dev_max_per_side=15,
                     max_examples=30)
    a, b, c = load_dataset(cfg, seed=0), load_dataset(cfg, seed=0), load_dataset(cfg, seed=1)
    assert a.counts() == {"train": {"positive": 30, "negative": 30},
                          "dev": {"positive": 15, "negative": 10}}
    assert not {e.text for e in a.train} & {e.text for e in a.dev}
    assert [e.text for e in a.train] == [e.text for e in b.train]
    assert [e.text for e in a.train] != [e.text for e in c.train]
    # dev files replace the split
    dp = _write(tmp_path / "dp.txt", "dev pos\n")
    dn = _write(tmp_path / "dn.txt", "dev neg\n")
    d = load_dataset(DataConfig(positive=[pos], negative=[neg], dev_positive=[dp],
                                dev_negative=[dn]))
    assert sorted(e.text for e in d.dev) == ["dev neg", "dev pos"]
    assert d.counts()["train"] == {"positive": 100, "negative": 50}


def test_tokenize_truncation_is_counted_and_window_enforced(smollm2_dir):
    from transformers import AutoTokenizer

    from vllm_steer.train.hidden import tokenize

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    texts = ["short one", "word " * 50, "x"]
    ids, kept, rep = tokenize(tok, texts, max_length=16, window=2048, where=["a:1", "a:2", "a:3"])
    assert rep.truncated == 1 and rep.examples_truncated == ["a:2"]
    assert rep.max_tokens_seen == len(tok("word " * 50)["input_ids"])
    assert max(len(x) for x in ids) == 16
    assert rep.too_short == 1 and kept == [0, 1]  # "x" is one token: nothing to predict
    with pytest.raises(ValueError, match="--max-length 4096 exceeds the model's context window "
                                         "of 2048 tokens; use --max-length 2048"):
        tokenize(tok, texts, max_length=4096, window=2048)


@pytest.mark.data
def test_detox_preset_reads_jigsaw_without_header(data_dir):
    cfg = preset_data_config("detox", str(data_dir), dev_max_per_side=50, max_examples=100)
    assert cfg.header is False and cfg.positive_labels == ["0"] and cfg.negative_labels == ["1"]
    ds = load_dataset(cfg, seed=0)
    assert ds.counts() == {"train": {"positive": 100, "negative": 100},
                           "dev": {"positive": 50, "negative": 50}}
    assert ds.report.files[cfg.labelled[0]] == {"positive": 6090, "negative": 6090}
    assert len(ds.sha256[cfg.labelled[0]]) == 64
    # the first row of the file is a text, not a header
    first = (data_dir / "jigsaw" / "jigsaw_balanced.csv").read_text().split(",0\n")[0]
    all_texts = {e.text for e in read_examples(cfg)}
    assert first.strip('"') in all_texts


@pytest.mark.data
def test_sentiment_preset_sst5_labels_and_dev_file(data_dir):
    cfg = preset_data_config("sentiment", str(data_dir), dev_max_per_side=10_000)
    ds = load_dataset(cfg, seed=0)
    rows = [json.loads(x) for x in (data_dir / "sst5" / "train.jsonl").read_text().splitlines()]
    n_pos = sum(r["label"] in ("3", "4") for r in rows)
    n_neg = sum(r["label"] in ("0", "1") for r in rows)
    assert ds.counts()["train"] == {"positive": n_pos, "negative": n_neg}
    assert ds.report.files[cfg.labelled[0]]["ignored_label_rows"] == sum(
        r["label"] == "2" for r in rows)
    assert all(cfg.dev_labelled[0] in e.where for e in ds.dev)


def test_preset_errors(tmp_path):
    with pytest.raises(DataError, match="unknown preset 'nope'; available: detox, sentiment"):
        preset_data_config("nope", str(tmp_path))
    with pytest.raises(DataError, match="data folder .* not found"):
        preset_data_config("detox", str(tmp_path / "missing"))
    with pytest.raises(DataError, match="jigsaw/jigsaw_balanced.csv"):
        preset_data_config("detox", str(tmp_path))
