"""Training inputs (vllm_steer.train.data and the tokenization in train.hidden): formats,
label rules, presets, the dev split, and clear errors for bad input."""

from __future__ import annotations

import json
import os

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


def test_a_jsonl_line_that_is_not_utf8_is_named_and_a_byte_order_mark_is_read(tmp_path):
    bad = tmp_path / "latin1.jsonl"
    bad.write_bytes(b'{"text": "ok"}\n{"text": "caf\xe9"}\n')
    with pytest.raises(DataError, match=rf"{bad}:2: not UTF-8 \(byte 0xe9 at column 14\); "
                                        "save the file as UTF-8"):
        read_examples(DataConfig(positive=[str(bad)]))
    bom = tmp_path / "bom.jsonl"
    bom.write_bytes('{"text": "caf\u00e9"}\n{"text": "x"}\n'.encode("utf-8-sig"))
    ex = read_examples(DataConfig(positive=[str(bom)]))
    assert [e.text for e in ex] == ["caf\u00e9", "x"]


@pytest.mark.parametrize("name", ["p.txt", "p.csv", "p.tsv"])
def test_csv_tsv_and_plain_text_read_utf8_strictly_with_a_byte_order_mark(tmp_path, name):
    """As JSONL: Excel's "CSV UTF-8" (a byte order mark before the header) reads its header;
    a plain-text file's first text has no mark; a Latin-1 file is refused naming the line,
    not trained on with replacement characters."""
    header = "" if name.endswith(".txt") else "text\n"
    bom = tmp_path / name
    bom.write_bytes((header + "caf\u00e9 au lait\nthe end\n").encode("utf-8-sig"))
    ex = read_examples(DataConfig(positive=[str(bom)]))
    assert [e.text for e in ex] == ["caf\u00e9 au lait", "the end"]
    bad = tmp_path / ("latin1" + name[1:])
    bad.write_bytes((header + "ok\ncaf\u00e9 au lait\n").encode("latin-1"))
    line = 2 if not header else 3
    with pytest.raises(DataError, match=rf"{bad}:{line}: not UTF-8 \(byte 0xe9 at column 4\)"):
        read_examples(DataConfig(positive=[str(bad)]))


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


# Parquet files and Hugging Face datasets (made here; read offline), and label rules that
# compare numeric labels (civil_comments' toxicity scores).

ROWS = [{"text": f"kind words {i}", "label": 0, "score": 0.02 * i} for i in range(4)] + \
    [{"text": f"rude words {i}", "label": 1, "score": 0.6 + 0.1 * i} for i in range(3)] + \
    [{"text": "borderline", "label": 2, "score": 0.3}]


def _cfg(source, **kw):
    base = dict(labelled=[str(source)], positive_labels=["0"], negative_labels=["1"],
                ignore_labels=["2"], dev_fraction=0)
    base.update(kw)
    return DataConfig(**base)


def _sides(ds):
    return (sorted(e.text for e in ds.train if e.side > 0),
            sorted(e.text for e in ds.train if e.side < 0))


EXPECTED = ([f"kind words {i}" for i in range(4)], [f"rude words {i}" for i in range(3)])


def test_parquet_csv_and_jsonl_give_the_same_examples(tmp_path):
    import csv

    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(ROWS), tmp_path / "c.parquet")
    _jsonl(tmp_path / "c.jsonl", ROWS)
    with open(tmp_path / "c.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["text", "label", "score"])
        w.writeheader()
        w.writerows(ROWS)
    for name in ("c.parquet", "c.jsonl", "c.csv"):
        ds = load_dataset(_cfg(tmp_path / name))
        assert _sides(ds) == EXPECTED, name
        assert ds.report.files[str(tmp_path / name)]["ignored_label_rows"] == 1
    with pytest.raises(DataError, match=r"c\.parquet: no label column 'stars' \(columns: "
                                        r"\['text', 'label', 'score'\]\); name it with "
                                        r"--label-field"):
        load_dataset(_cfg(tmp_path / "c.parquet", label_field="stars"))


def test_a_saved_hugging_face_dataset_and_its_splits(tmp_path):
    import datasets

    dd = datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS),
                               "validation": datasets.Dataset.from_list(ROWS[:1] + ROWS[4:5])})
    dd.save_to_disk(tmp_path / "dd")
    datasets.Dataset.from_list(ROWS).save_to_disk(tmp_path / "one")
    ds = load_dataset(_cfg(tmp_path / "dd", dev_labelled=[str(tmp_path / "dd")]))
    assert _sides(ds) == EXPECTED
    assert sorted(e.text for e in ds.dev) == ["kind words 0", "rude words 0"]
    assert set(ds.sha256) == {str(tmp_path / "dd")} and len(ds.sha256[str(tmp_path / "dd")]) == 64
    assert _sides(load_dataset(_cfg(tmp_path / "one"))) == EXPECTED
    with pytest.raises(DataError, match=r"dd: no split 'test'; splits: \['train', "
                                        r"'validation'\] \(choose one with --split"):
        load_dataset(_cfg(tmp_path / "dd", split="test"))


@pytest.mark.parametrize("imported_online", [False, True])
def test_a_dataset_name_not_in_the_local_cache_says_how_to_get_it(tmp_path, monkeypatch,
                                                                   imported_online):
    """Read offline, with no connection tried, also in a process that imported ``datasets``
    and ``huggingface_hub`` online before (they read their offline switches at import): on a
    host without network the answer comes at once, not after the Hub client's retries. The
    switches are put back, and the environment is left as it was (a process reading a model
    from the Hub later is not made offline)."""
    import socket

    datasets = pytest.importorskip("datasets")
    import huggingface_hub.constants as hub

    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # an empty cache
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf" / "datasets"))
    if imported_online:
        monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
        monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", False)
        monkeypatch.setattr(hub, "HF_HUB_OFFLINE", False)
    switches = (datasets.config.HF_HUB_OFFLINE, hub.HF_HUB_OFFLINE)
    environment = {k: os.environ.get(k) for k in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")}
    tried = []

    def no_network(self, address, *a, **k):
        tried.append(address)
        raise OSError("no network in this test")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    monkeypatch.setattr(socket.socket, "connect_ex", no_network)
    with pytest.raises(DataError) as e:
        load_dataset(_cfg("no_such_org/no_such_dataset"))
    msg = str(e.value)
    assert msg.startswith("no_such_org/no_such_dataset: no such file, and no Hugging Face "
                          "dataset of that name in the local cache"), msg
    assert "offline" in msg and "save_to_disk" in msg
    assert not tried, tried
    assert (datasets.config.HF_HUB_OFFLINE, hub.HF_HUB_OFFLINE) == switches  # put back
    assert {k: os.environ.get(k) for k in environment} == environment  # nor set for later
    with pytest.raises(DataError, match=r"missing\.parquet: no such file"):
        load_dataset(_cfg(tmp_path / "missing.parquet"))


def test_numeric_label_rules_for_scores(tmp_path):
    """civil_comments-style toxicity scores: clean below 0.1, toxic from 0.5, the rest
    skipped; overlapping rules are refused naming the label."""
    src = _jsonl(tmp_path / "s.jsonl", ROWS)
    ds = load_dataset(_cfg(src, label_field="score", positive_labels=["<0.1"],
                           negative_labels=[">=0.5"], ignore_labels=["*"]))
    assert _sides(ds) == (EXPECTED[0][:4], EXPECTED[1])
    assert ds.report.files[src]["ignored_label_rows"] == 1
    with pytest.raises(DataError, match=r"unknown label '0\.3'"):
        load_dataset(_cfg(src, label_field="score", positive_labels=["<0.1"],
                          negative_labels=[">=0.5"], ignore_labels=[]))
    with pytest.raises(DataError, match=r"label '0\.6' matches both --positive-labels and "
                                        r"--negative-labels"):
        load_dataset(_cfg(src, label_field="score", positive_labels=["<0.7"],
                          negative_labels=[">=0.5"], ignore_labels=["*"]))
    with pytest.raises(DataError, match=r"label rule '>=high': >= must be followed by a number"):
        load_dataset(_cfg(src, label_field="score", negative_labels=[">=high"]))


def test_load_dataset_refuses_bad_split_settings_before_reading(tmp_path):
    """The Python API refuses every bad split setting at once, like the command line, before a
    file is read (the missing file is not what the error names)."""
    cfg = DataConfig(positive=[str(tmp_path / "missing.txt")], negative=[str(tmp_path / "n")],
                     dev_fraction=1.5, dev_max_per_side=0, max_examples=-3)
    with pytest.raises(DataError) as e:
        load_dataset(cfg)
    msg = str(e.value)
    assert "--dev-fraction 1.5" in msg and "--dev-max 0" in msg and "--max-examples -3" in msg
    assert "no such file" not in msg
