"""Training texts: reading JSONL / CSV / TSV / Parquet / plain-text files and Hugging Face
``datasets`` (a name in the local cache or a ``save_to_disk`` folder, read offline), mapping
labels to sides, the presets (``detox``, ``sentiment``), the dev split and the sources'
sha256. Light: no torch.

A *side* is +1 (positive: what a positive strength moves towards) or -1 (negative).
Every problem is a :class:`DataError` naming the file (and line) and what to do.
"""

from __future__ import annotations

import contextlib
import csv
import hashlib
import json
import os
import random
import sys
from dataclasses import dataclass, field, replace
from typing import Any, Iterator

from vllm_steer.train.config import DataConfig, default_data_dir

POSITIVE, NEGATIVE = 1, -1
SIDE_NAMES = {POSITIVE: "positive", NEGATIVE: "negative"}


class DataError(ValueError):
    """A training file was refused; the message names the file and the problem."""


def utf8_lines(path: str) -> Iterator[tuple[int, str]]:
    """``(line number, line)`` of a UTF-8 text file, line endings kept and a leading byte
    order mark dropped; a line that is not UTF-8 is a :class:`DataError` naming the file, the
    line and the column, not a bare codec error."""
    with open(path, "rb") as f:
        for i, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataError(
                    f"{path}:{i}: not UTF-8 (byte {raw[e.start]:#04x} at column {e.start + 1}); "
                    "save the file as UTF-8") from None
            yield i, (line[1:] if i == 1 and line.startswith("\ufeff") else line)


@dataclass(frozen=True)
class Example:
    text: str
    side: int  # +1 positive, -1 negative
    where: str = ""  # "file:line", for messages


@dataclass(frozen=True)
class Preset:
    """A known data set layout under the data folder."""

    name: str
    train: str
    dev: str | None
    format: str
    header: bool
    text_field: str
    label_field: str
    positive_labels: tuple[str, ...]
    negative_labels: tuple[str, ...]
    ignore_labels: tuple[str, ...]
    labels: dict[str, str]
    description: str


PRESETS: dict[str, Preset] = {
    "detox": Preset(
        name="detox", train="jigsaw/jigsaw_balanced.csv", dev=None, format="csv", header=False,
        text_field="0", label_field="1", positive_labels=("0",), negative_labels=("1",),
        ignore_labels=(),
        labels={"positive": "non-toxic", "negative": "toxic", "harmful": "negative"},
        description="Jigsaw toxic comments (CSV without header: text,label); label 0 "
                    "(non-toxic) positive, 1 (toxic) negative; dev split from the file"),
    "sentiment": Preset(
        name="sentiment", train="sst5/train.jsonl", dev="sst5/dev.jsonl", format="jsonl",
        header=True, text_field="sentence", label_field="label",
        positive_labels=("3", "4"), negative_labels=("0", "1"), ignore_labels=("2",),
        labels={"positive": "positive sentiment", "negative": "negative sentiment"},
        description="SST-5 (JSONL sentence,label); labels 3-4 positive, 0-1 negative, 2 "
                    "(neutral) skipped; dev = sst5/dev.jsonl"),
}


def preset_data_config(name: str, data_dir: str | None = None, **overrides) -> DataConfig:
    """The :class:`DataConfig` of a preset, reading from ``data_dir`` (default
    ``$VLLM_STEER_DATA`` or ``../shared/data``)."""
    if name not in PRESETS:
        raise DataError(f"unknown preset {name!r}; available: {', '.join(sorted(PRESETS))}")
    p = PRESETS[name]
    data_dir = data_dir or default_data_dir()
    if not os.path.isdir(data_dir):
        raise DataError(f"preset {name!r}: data folder {data_dir!r} not found (give --data DIR "
                        f"or set $VLLM_STEER_DATA)")
    train = os.path.join(data_dir, p.train)
    if not os.path.exists(train):
        raise DataError(f"preset {name!r}: {train!r} not found in the data folder {data_dir!r} "
                        f"(expected {p.train})")
    cfg = DataConfig(labelled=[train],
                     dev_labelled=[os.path.join(data_dir, p.dev)] if p.dev else [],
                     format=p.format, header=p.header, text_field=p.text_field,
                     label_field=p.label_field, positive_labels=list(p.positive_labels),
                     negative_labels=list(p.negative_labels),
                     ignore_labels=list(p.ignore_labels), preset=name)
    return replace(cfg, **overrides)


# ----------------------------------------------------------------------------------- reading

def file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


FILE_EXTENSIONS = ((".jsonl", "jsonl"), (".json", "jsonl"), (".csv", "csv"), (".tsv", "tsv"),
                   (".parquet", "parquet"), (".txt", "txt"))


def detect_format(path: str, fmt: str = "auto") -> str:
    """The format of a source: by extension; a folder or a name that is no file is a
    Hugging Face dataset (``hf``); anything else plain text."""
    if fmt != "auto":
        return fmt
    low = path.lower()
    for ext, name in FILE_EXTENSIONS:
        if low.endswith(ext):
            return name
    if os.path.isdir(path) or not os.path.exists(path):
        return "hf"
    return "txt"


def source_sha256(path: str) -> str:
    """sha256 of a file; of a folder, over its files' names and contents; of a dataset in the
    Hugging Face cache, ``fingerprint:`` and the cache's fingerprint of the split read."""
    if os.path.isfile(path):
        return file_sha256(path)
    if os.path.isdir(path):
        h = hashlib.sha256()
        for root, dirs, files in sorted(os.walk(path)):
            dirs.sort()
            for f in sorted(files):
                full = os.path.join(root, f)
                h.update(os.path.relpath(full, path).encode() + b"\0")
                h.update(file_sha256(full).encode())
        return h.hexdigest()
    return "fingerprint:" + str(_HF_FINGERPRINTS.get(path, "unknown"))


_HF_FINGERPRINTS: dict[str, str] = {}


@contextlib.contextmanager
def _hub_offline(datasets) -> Iterator[None]:
    """The Hugging Face Hub offline for ``datasets`` while the block runs, however the process
    imported it: ``datasets`` and ``huggingface_hub`` read their offline switches from the
    environment once, at import, so a process that imported either before (a notebook,
    ``transformers``) would otherwise try the network, and wait out its retries on a host
    without one, before saying a name is not in the cache. Restored after; the environment
    is left as it was (its variables reach only modules imported later, and child
    processes)."""
    import huggingface_hub.constants as hub

    flags = [(datasets.config, "HF_HUB_OFFLINE"), (datasets.config, "HF_DATASETS_OFFLINE"),
             (hub, "HF_HUB_OFFLINE")]
    was = [(obj, name, getattr(obj, name)) for obj, name in flags if hasattr(obj, name)]
    for obj, name, _ in was:
        setattr(obj, name, True)
    try:
        yield
    finally:
        for obj, name, value in was:
            setattr(obj, name, value)


def load_hf(source: str, split: str | None):
    """A Hugging Face dataset, offline: a ``save_to_disk`` folder, or a name (or a local
    dataset folder) already in the Hugging Face cache. A ``DatasetDict`` gives ``split``."""
    try:
        import datasets
    except ImportError:
        raise DataError(f"{source}: reading a Hugging Face dataset needs the `datasets` "
                        "package (pip install datasets, or vllm-steer[train]); or give a "
                        "JSONL/CSV/Parquet file") from None
    saved = os.path.isdir(source) and any(
        os.path.exists(os.path.join(source, f))
        for f in ("dataset_dict.json", "state.json", "dataset_info.json"))
    try:
        with _hub_offline(datasets):
            ds = datasets.load_from_disk(source) if saved else datasets.load_dataset(source)
    except (FileNotFoundError, ConnectionError):  # offline: a name not in the cache
        raise DataError(f"{source}: no such file, and no Hugging Face dataset of that name in "
                        "the local cache (datasets are read offline). On a machine with "
                        "network access save it once, e.g. python -c \"import datasets; "
                        f"datasets.load_dataset('{source}').save_to_disk('{os.path.basename(source)}')\""
                        ", and pass that folder to --data") from None
    except Exception as e:  # datasets raises many kinds for a missing or offline dataset
        raise DataError(f"{source}: cannot read it as a Hugging Face dataset offline "
                        f"({type(e).__name__}: {str(e)[:300]}). Give a JSONL/CSV/Parquet file "
                        "or a folder written by Dataset.save_to_disk") from None
    if isinstance(ds, (datasets.DatasetDict, dict)):
        if split not in ds:
            raise DataError(f"{source}: no split {split!r}; splits: {sorted(ds)} (choose one "
                            "with --split / --dev-split)")
        ds = ds[split]
    _HF_FINGERPRINTS[source] = getattr(ds, "_fingerprint", "unknown")
    return ds


def _columns_named(path: str, columns: list[str], text_field: str | None,
                   label_field: str | None, need_label: bool) -> tuple[str, str | None]:
    """The text and label column of a table with named columns (Parquet, datasets)."""
    def pick(spec, default, what):
        name = spec if spec is not None else default
        if name in columns:
            return name
        if spec is not None and str(spec).isdigit() and int(spec) < len(columns):
            return columns[int(spec)]
        raise DataError(f"{path}: no {what} column {name!r} (columns: {columns}); name it "
                        f"with --{what}-field")
    tcol = pick(text_field, "text", "text")
    lcol = pick(label_field, "label", "label") if need_label else None
    return tcol, lcol


def _iter_table(path: str, texts, labels) -> Iterator[tuple[int, str, str | None]]:
    for n, text in enumerate(texts, 1):
        if text is not None and not isinstance(text, str):
            raise DataError(f"{path}: row {n}: the text is {type(text).__name__}, expected a "
                            "string; name the text column with --text-field")
        yield n, text or "", (None if labels is None else _label_str(labels[n - 1]))


def _label_str(v: Any) -> str:
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, float) and v.is_integer():
        return str(int(v))
    return str(v).strip()


def _check_file(path: str) -> None:
    if not os.path.exists(path):
        raise DataError(f"{path}: no such file")
    if os.path.isdir(path):
        raise DataError(f"{path}: is a directory, expected a file")
    if os.path.getsize(path) == 0:
        raise DataError(f"{path}: file is empty")


def _parquet_columns(path: str, text_field: str | None, label_field: str | None,
                     need_label: bool) -> tuple[list, list | None]:
    """The texts and labels (None when not needed) of a Parquet file."""
    _check_file(path)
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"{path}: reading Parquet needs pyarrow (pip install pyarrow, "
                        "or vllm-steer[train])") from None
    table = pq.read_table(path)
    tcol, lcol = _columns_named(path, table.column_names, text_field, label_field, need_label)
    texts = table.column(tcol).to_pylist()
    labels = table.column(lcol).to_pylist() if lcol else None
    return texts, labels


def _dataset_columns(path: str, split: str | None, text_field: str | None,
                     label_field: str | None, need_label: bool) -> tuple[Any, Any]:
    """The texts and labels (None when not needed) of a Hugging Face dataset's split."""
    ds = load_hf(path, split)
    tcol, lcol = _columns_named(path, list(ds.column_names), text_field, label_field,
                                need_label)
    return ds[tcol], (ds[lcol] if lcol else None)


def _iter_txt(path: str, need_label: bool) -> Iterator[tuple[int, str, None]]:
    """The lines of a plain-text file (which has no labels)."""
    if need_label:
        raise DataError(f"{path}: a plain-text file has no labels; give it with --positive "
                        "or --negative, or use CSV/TSV/JSONL with a label column")
    for i, line in utf8_lines(path):  # strict UTF-8, a byte order mark dropped
        yield i, line.rstrip("\r\n"), None


def _jsonl_record(where: str, rec: Any, tkey: str, lkey: str, need_label: bool
                  ) -> tuple[str, str | None]:
    """The text and label (None when not needed) of one parsed JSONL line."""
    if not isinstance(rec, dict):
        raise DataError(f"{where}: expected a JSON object per line, got {type(rec).__name__}")
    if tkey not in rec:
        raise DataError(f"{where}: no field {tkey!r} (fields: {sorted(rec)}); "
                        "name the text field with --text-field")
    text = rec[tkey]
    if not isinstance(text, str):
        raise DataError(f"{where}: field {tkey!r} is {type(text).__name__}, expected a string")
    if not need_label:
        return text, None
    if lkey not in rec:
        raise DataError(f"{where}: no label field {lkey!r} (fields: {sorted(rec)}); name it "
                        "with --label-field")
    return text, _label_str(rec[lkey])


def _iter_jsonl(path: str, text_field: str | None, label_field: str | None, need_label: bool
                ) -> Iterator[tuple[int, str, str | None]]:
    """The records of a JSONL file, one JSON object a line; blank lines skipped."""
    tkey = text_field or "text"
    lkey = label_field or "label"
    for i, rec in json_lines(path):
        text, label = _jsonl_record(f"{path}:{i}", rec, tkey, lkey, need_label)
        yield i, text, label


def json_lines(path: str) -> Iterator[tuple[int, Any]]:
    """``(line number, parsed value)`` of each non-blank line of a JSONL file
    (:func:`utf8_lines`); a line that is not JSON is a :class:`DataError` naming it."""
    for i, line in utf8_lines(path):
        if not line.strip():
            continue
        try:
            yield i, json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{i}: not valid JSON ({e})") from None


def _csv_column(path: str, columns: list[str] | None, spec: str | None, default_name: str,
                default_idx: int, what: str) -> int:
    """The index of a CSV/TSV column given by name or 0-based index (``spec``), by default
    the column ``default_name`` of the header, or ``default_idx`` without a header."""
    if spec is None:
        if columns is not None:
            if default_name in columns:
                return columns.index(default_name)
            raise DataError(f"{path}: no {what} column {default_name!r} in the header "
                            f"{columns}; name it with --{what}-field (a name or a "
                            "0-based index), or --no-header if the file has none")
        return default_idx
    if columns is not None and spec in columns:
        return columns.index(spec)
    if str(spec).isdigit():
        return int(spec)
    found = f"header {columns}" if columns is not None else "no header (--no-header)"
    raise DataError(f"{path}: no {what} column {spec!r} ({found})")


def _iter_delimited(path: str, fmt: str, text_field: str | None, label_field: str | None,
                    header: bool, need_label: bool) -> Iterator[tuple[int, str, str | None]]:
    """The rows of a CSV or TSV file; blank rows skipped."""
    delim = "," if fmt == "csv" else "\t"
    quoting = csv.QUOTE_MINIMAL if fmt == "csv" else csv.QUOTE_NONE
    csv.field_size_limit(min(sys.maxsize, 2**31 - 1))
    # strict UTF-8, a byte order mark dropped (Excel's "CSV UTF-8"); lines as the file has them
    lines = (line for _, line in utf8_lines(path))
    reader = csv.reader(lines, delimiter=delim, quoting=quoting)
    columns: list[str] | None = None
    if header:
        try:
            columns = [c.strip() for c in next(reader)]
        except StopIteration:
            raise DataError(f"{path}: file is empty") from None
    ti = _csv_column(path, columns, text_field, "text", 0, "text")
    li = _csv_column(path, columns, label_field, "label", 1, "label") if need_label else None
    first = 2 if header else 1
    for n, row in enumerate(reader, first):
        if not row or (len(row) == 1 and not row[0].strip()):
            continue
        need = max(ti, li if li is not None else 0)
        if len(row) <= need:
            raise DataError(f"{path}: row {n} has {len(row)} column(s), expected at least "
                            f"{need + 1} (text column {ti}" +
                            (f", label column {li})" if li is not None else ")"))
        yield n, row[ti], (_label_str(row[li]) if li is not None else None)


def iter_records(path: str, fmt: str, text_field: str | None, label_field: str | None,
                 header: bool, need_label: bool, split: str | None = None
                 ) -> Iterator[tuple[int, str, str | None]]:
    """Yield ``(line_or_row_number, text, label_or_None)`` from one source."""
    fmt = detect_format(path, fmt)
    if fmt in ("parquet", "hf"):
        if fmt == "parquet":
            texts, labels = _parquet_columns(path, text_field, label_field, need_label)
        else:
            texts, labels = _dataset_columns(path, split, text_field, label_field, need_label)
        if not texts:
            raise DataError(f"{path}: no rows")
        yield from _iter_table(path, texts, labels)
        return
    _check_file(path)
    if fmt == "txt":
        yield from _iter_txt(path, need_label)
    elif fmt == "jsonl":
        yield from _iter_jsonl(path, text_field, label_field, need_label)
    elif fmt in ("csv", "tsv"):
        yield from _iter_delimited(path, fmt, text_field, label_field, header, need_label)
    else:
        raise DataError(f"{path}: unknown format {fmt!r}; choose jsonl, csv, tsv, parquet, "
                        "hf (a Hugging Face dataset) or txt")


@dataclass
class LoadReport:
    """Counts of what reading kept and dropped, per file."""

    files: dict[str, dict[str, Any]] = field(default_factory=dict)

    def add(self, path: str, key: str, n: int = 1) -> None:
        self.files.setdefault(path, {}).setdefault(key, 0)
        self.files[path][key] += n


def read_examples(cfg: DataConfig, dev: bool = False, report: LoadReport | None = None
                  ) -> list[Example]:
    """All examples of the training (or dev) files of ``cfg``, in file order."""
    report = report if report is not None else LoadReport()
    pos, neg, lab = ((cfg.dev_positive, cfg.dev_negative, cfg.dev_labelled) if dev
                     else (cfg.positive, cfg.negative, cfg.labelled))
    split = cfg.dev_split if dev else cfg.split
    out: list[Example] = []
    for files, side in ((pos, POSITIVE), (neg, NEGATIVE)):
        for path in files:
            n0 = len(out)
            for i, text, _ in iter_records(path, cfg.format, cfg.text_field, None, cfg.header,
                                           need_label=False, split=split):
                if not text.strip():
                    report.add(path, "empty_texts_skipped")
                    continue
                out.append(Example(text, side, f"{path}:{i}"))
            report.add(path, SIDE_NAMES[side], len(out) - n0)
            if len(out) == n0:
                raise DataError(f"{path}: no non-empty texts found")
    if lab:
        if not cfg.positive_labels or not cfg.negative_labels:
            raise DataError(f"labelled data {lab}: give both --positive-labels and "
                            "--negative-labels (e.g. --positive-labels 0 --negative-labels 1)")
        overlap = set(cfg.positive_labels) & set(cfg.negative_labels)
        if overlap:
            raise DataError(f"labels {sorted(overlap)} are both positive and negative")
        rule = LabelRule(cfg.positive_labels, cfg.negative_labels, cfg.ignore_labels)
        for path in lab:
            for i, text, label in iter_records(path, cfg.format, cfg.text_field,
                                               cfg.label_field, cfg.header, need_label=True,
                                               split=split):
                side = rule.side(label, f"{path}:{i}")
                if side is _UNKNOWN:
                    raise DataError(
                        f"{path}:{i}: unknown label {label!r}; known: positive "
                        f"{cfg.positive_labels}, negative {cfg.negative_labels}, ignored "
                        f"{cfg.ignore_labels} (add it to --ignore-labels to skip such rows)")
                if side is None:
                    report.add(path, "ignored_label_rows")
                    continue
                if not text.strip():
                    report.add(path, "empty_texts_skipped")
                    continue
                out.append(Example(text, side, f"{path}:{i}"))
                report.add(path, SIDE_NAMES[side])
    return out


_UNKNOWN = object()
_COMPARE = {"<=": lambda a, b: a <= b, ">=": lambda a, b: a >= b,
            "<": lambda a, b: a < b, ">": lambda a, b: a > b}


class LabelRule:
    """Which side a label is on. A label spec is a value (``1``, ``toxic``), a comparison
    of a numeric label (``<0.1``, ``>=0.5``: scores such as civil_comments' ``toxicity``) or
    ``*`` (any label; for --ignore-labels: skip every row not positive or negative)."""

    def __init__(self, positive, negative, ignore):
        self.rules = []
        for specs, side in ((positive, POSITIVE), (negative, NEGATIVE), (ignore, None)):
            for spec in specs:
                self.rules.append((self._parse(str(spec).strip()), side, spec))

    @staticmethod
    def _parse(spec: str):
        if spec == "*":
            return lambda v: True
        for op in ("<=", ">=", "<", ">"):
            if spec.startswith(op):
                try:
                    bound = float(spec[len(op):])
                except ValueError:
                    raise DataError(f"label rule {spec!r}: {op} must be followed by a number "
                                    f"(e.g. {op}0.5)") from None
                cmp = _COMPARE[op]

                def match(v, cmp=cmp, bound=bound):
                    try:
                        return cmp(float(v), bound)
                    except (TypeError, ValueError):
                        return False
                return match
        return lambda v, spec=spec: v == spec

    def side(self, label, where: str):
        """POSITIVE, NEGATIVE, None (ignored) or _UNKNOWN."""
        hits = {side for match, side, _ in self.rules if side is not None and match(label)}
        if len(hits) > 1:
            raise DataError(f"{where}: label {label!r} matches both --positive-labels and "
                            "--negative-labels; make the rules disjoint")
        if hits:
            return hits.pop()
        if any(match(label) for match, side, _ in self.rules if side is None):
            return None
        return _UNKNOWN


@dataclass
class Dataset:
    """The training and dev examples, with where they came from."""

    train: list[Example]
    dev: list[Example]
    sha256: dict[str, str]
    report: LoadReport

    def counts(self) -> dict[str, dict[str, int]]:
        f = lambda xs: {"positive": sum(e.side > 0 for e in xs),  # noqa: E731
                        "negative": sum(e.side < 0 for e in xs)}
        return {"train": f(self.train), "dev": f(self.dev)}

    def describe(self, cfg: DataConfig) -> dict[str, Any]:
        """What the steer file records under ``data``."""
        return {"config": cfg.to_dict(), "sha256": dict(self.sha256), "counts": self.counts(),
                "files": self.report.files}


def _by_side(xs: list[Example], side: int) -> list[Example]:
    return [e for e in xs if e.side == side]


def load_dataset(cfg: DataConfig, seed: int = 0) -> Dataset:
    """Read the files, split off the dev set (seeded), take the training subset (seeded)."""
    if not (cfg.positive or cfg.negative or cfg.labelled):
        raise DataError("no training data: give --positive FILE and --negative FILE, a "
                        "labelled file with --data FILE, or --preset NAME")
    try:
        cfg.validate()  # the split and subset settings, before any file is read
    except ValueError as e:
        raise DataError(str(e)) from None
    report = LoadReport()
    all_train = read_examples(cfg, dev=False, report=report)
    has_dev_files = bool(cfg.dev_positive or cfg.dev_negative or cfg.dev_labelled)
    rng = random.Random(seed)
    train: list[Example] = []
    dev: list[Example] = []
    dev_files = read_examples(cfg, dev=True, report=report) if has_dev_files else []
    for side in (POSITIVE, NEGATIVE):
        xs = _by_side(all_train, side)
        if not xs:
            srcs = cfg.positive if side > 0 else cfg.negative
            raise DataError(
                f"no {SIDE_NAMES[side]} training texts (files: {srcs or cfg.labelled}); "
                "a steer needs both sides")
        order = list(range(len(xs)))
        rng.shuffle(order)
        xs = [xs[i] for i in order]
        if has_dev_files:
            d = _by_side(dev_files, side)
            if len(d) > cfg.dev_max_per_side:
                d = rng.sample(d, cfg.dev_max_per_side)
        else:
            n_dev = min(int(round(cfg.dev_fraction * len(xs))), cfg.dev_max_per_side)
            if cfg.dev_fraction > 0 and len(xs) >= 2:
                n_dev = max(n_dev, 1)
            n_dev = min(n_dev, len(xs) - 1)
            d, xs = xs[:n_dev], xs[n_dev:]
        if cfg.max_examples is not None:
            xs = xs[:cfg.max_examples]
        train += xs
        dev += d
    files = list(dict.fromkeys(cfg.positive + cfg.negative + cfg.labelled + cfg.dev_positive
                               + cfg.dev_negative + cfg.dev_labelled))
    return Dataset(train, dev, {p: source_sha256(p) for p in files}, report)
