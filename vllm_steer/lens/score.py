"""Score: which steering strength best explains a text -- a zero-shot style classifier.

The paper's read-out (its demo's "sentence classification"): compute the text's mean token
log-likelihood under the model steered at several strengths; the strength with the highest
likelihood is the style the text is closest to. As a binary classifier we use the contrast::

    score(text) = mean log p(text | +s) - mean log p(text | -s)

and predict the steer's *positive* side when ``score > 0`` (no threshold is fitted: zero-shot).
``AUC`` (threshold-free) is reported next to the accuracy, and the grid read-out (the argmax
strength over ``--strengths``) per class.
A text with no token to score (empty, or a single token without a prefix to give it a
context) has no score: no likelihood, no best strength, no side; an evaluation counts such
texts apart and leaves them out of the accuracy and the AUC.

Datasets (read from the data folder, never copied): ``sst2`` (``sst2/{test,dev}.tsv``,
label 1 = positive sentiment) and ``jigsaw`` (``jigsaw/jigsaw_balanced.csv``, label 0 =
non-toxic). Which dataset label is the steer's positive side is ``--positive-label``
(defaults: sst2 ``1``, jigsaw ``0``, matching the shipped steers: positive strength = positive
sentiment / non-toxic).
"""

from __future__ import annotations

import csv
import math
import os
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

DEFAULT_STRENGTHS = (-5.0, 0.0, 5.0)
DEFAULT_LIMIT = 300
DEFAULT_MAX_TOKENS = 128
DATASETS = {
    # name: (relative path pattern, default positive label)
    "sst2": ("sst2/{split}.tsv", "1"),
    "jigsaw": ("jigsaw/jigsaw_balanced.csv", "0"),
}


def default_data_dir() -> Path:
    """``$VLLM_STEER_DATA``, else ``../shared/data`` relative to the repository root."""
    env = os.environ.get("VLLM_STEER_DATA")
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[2].parent / "shared" / "data"


def read_dataset(name: str, data_dir: str | os.PathLike | None = None, split: str = "test"
                 ) -> list[tuple[str, str]]:
    """All ``(text, label)`` rows of a dataset (labels as strings)."""
    if name not in DATASETS:
        raise ValueError(f"unknown dataset {name!r}; choose one of {sorted(DATASETS)}")
    data_dir = Path(data_dir) if data_dir else default_data_dir()
    path = data_dir / DATASETS[name][0].format(split=split)
    if not path.exists():
        raise FileNotFoundError(f"{path} not found: pass --data DIR or set VLLM_STEER_DATA "
                                "to the folder holding sst2/ and jigsaw/")
    rows: list[tuple[str, str]] = []
    with open(path, newline="", encoding="utf-8") as f:
        if name == "sst2":
            reader = csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE)
            header = next(reader)
            if header[:2] != ["sentence", "label"]:
                raise ValueError(f"{path}: expected a 'sentence<TAB>label' header, got {header}")
            rows = [(r[0], r[1].strip()) for r in reader if len(r) >= 2]
        else:
            rows = [(r[0], r[1].strip()) for r in csv.reader(f) if len(r) >= 2]
    return rows


def balanced_sample(rows: Sequence[tuple[str, str]], limit: int | None, seed: int = 0
                    ) -> list[tuple[str, str]]:
    """A deterministic sample with the same number of rows per label (``limit`` in all)."""
    if not limit or limit >= len(rows):
        return list(rows)
    by: dict[str, list[int]] = {}
    for i, (_t, lab) in enumerate(rows):
        by.setdefault(lab, []).append(i)
    rng = random.Random(seed)
    per = max(1, limit // len(by))
    chosen: list[int] = []
    for lab in sorted(by):
        idx = by[lab][:]
        rng.shuffle(idx)
        chosen += idx[:per]
    rng.shuffle(chosen)
    return [rows[i] for i in chosen]


def training_texts(steer) -> set[str] | None:
    """The texts the steer was trained on, rebuilt from its metadata (data config and seed)
    with :func:`vllm_steer.train.data.load_dataset`; ``None`` when that is not possible
    (another trainer, files moved)."""
    cfg_d = (steer.metadata.data or {}).get("config")
    if not cfg_d:
        return None
    try:
        from vllm_steer.train.config import DataConfig
        from vllm_steer.train.data import load_dataset

        names = {f.name for f in __import__("dataclasses").fields(DataConfig)}
        cfg = DataConfig(**{k: v for k, v in cfg_d.items() if k in names})
        ds = load_dataset(cfg, seed=int((steer.metadata.recipe or {}).get("seed", 0)))
    except Exception:  # noqa: BLE001 - best effort: report and go on
        return None
    return {e.text for e in ds.train}


def auc(scores: Sequence[float], positive: Sequence[bool]) -> float:
    """Area under the ROC curve (probability a positive outranks a negative; ties count 1/2)."""
    pos = [s for s, p in zip(scores, positive, strict=True) if p]
    neg = [s for s, p in zip(scores, positive, strict=True) if not p]
    if not pos or not neg:
        return float("nan")
    ranked = sorted([(s, 1) for s in pos] + [(s, 0) for s in neg])
    # rank-sum with average ranks for ties
    ranks = [0.0] * len(ranked)
    i = 0
    while i < len(ranked):
        j = i
        while j + 1 < len(ranked) and ranked[j + 1][0] == ranked[i][0]:
            j += 1
        for t in range(i, j + 1):
            ranks[t] = (i + j) / 2 + 1
        i = j + 1
    rsum = sum(r for r, (_, lab) in zip(ranks, ranked, strict=True) if lab == 1)
    return (rsum - len(pos) * (len(pos) + 1) / 2) / (len(pos) * len(neg))


def check_max_tokens(max_tokens: int | None) -> None:
    """``max_tokens`` is ``None`` (no limit) or a positive integer."""
    if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(
            max_tokens, int) or max_tokens < 1):
        raise ValueError(f"max_tokens={max_tokens!r}: give a positive number of text tokens "
                         f"(default {DEFAULT_MAX_TOKENS}), or None for no limit")


@dataclass
class TextScores:
    """Log-likelihoods of texts at each strength."""

    strengths: list[float]
    loglik: list[list[float] | None]
    """[text][strength]: mean token log-likelihood; ``None`` for a text with no token to
    score (no score at any strength)."""
    tokens: list[int] | None = None
    """Tokens scored per text (``None``: not recorded)."""

    def scored(self) -> list[bool]:
        """Whether each text has a score."""
        return [r is not None for r in self.loglik]

    def best(self) -> list[float | None]:
        """The strength with the highest likelihood, per text (``None``: no score)."""
        return [None if r is None else self.strengths[max(range(len(r)), key=r.__getitem__)]
                for r in self.loglik]

    def contrast(self, s: float) -> list[float | None]:
        """``loglik(+s) - loglik(-s)`` per text (``None``: no score)."""
        try:
            ip, im = self.strengths.index(abs(s)), self.strengths.index(-abs(s))
        except ValueError:
            raise ValueError(f"the contrast needs both +{abs(s)} and -{abs(s)} among the "
                             f"strengths {self.strengths}") from None
        return [None if r is None else r[ip] - r[im] for r in self.loglik]


def score_texts(model, tokenizer, steer, texts: Sequence[str],
                strengths: Sequence[float] = DEFAULT_STRENGTHS,
                max_tokens: int | None = DEFAULT_MAX_TOKENS, batch_size: int = 8,
                prefix: str | None = None, progress: bool = False) -> TextScores:
    """Mean token log-likelihood of each text at each strength (one pass through the model
    body per text; see :func:`vllm_steer.lens.lm.logprobs_at_strengths`). ``max_tokens``
    keeps each text's first that many tokens (the prefix does not count); a text with no
    token to score gets ``None``."""
    from tqdm.auto import tqdm

    from vllm_steer.lens.lm import final_hidden_states, logprobs_at_strengths

    check_max_tokens(max_tokens)
    strengths = [float(s) for s in strengths]
    if not strengths:
        raise ValueError("give at least one strength")
    rows: list[list[float] | None] = []
    tokens: list[int] = []
    step = max(batch_size, 1) * 4
    bar = tqdm(total=len(texts), desc=f"scoring ({steer.name})", disable=not progress,
               unit="text")
    for i in range(0, len(texts), step):
        chunk = list(texts[i:i + step])
        pre = [prefix] * len(chunk) if prefix else None
        enc = final_hidden_states(model, tokenizer, chunk, prefixes=pre, batch_size=batch_size,
                                  max_text_tokens=max_tokens)
        res = logprobs_at_strengths(model, enc, steer, strengths).tolist()
        rows += [r if e.targets.numel() else None for r, e in zip(res, enc, strict=True)]
        tokens += [int(e.targets.numel()) for e in enc]
        bar.update(len(chunk))
    bar.close()
    return TextScores(strengths, rows, tokens)


@dataclass
class Evaluation:
    """Accuracy of the zero-shot classifier on a labelled sample."""

    dataset: str
    steer: str
    n: int
    """Texts with a score: the ones the accuracy and the AUC count."""
    strength: float
    accuracy: float
    auc: float
    positive_label: str
    best_strength_by_class: dict[str, dict[str, int]] = field(default_factory=dict)
    mean_contrast_by_class: dict[str, float] = field(default_factory=dict)
    by_strength: dict[str, dict[str, float]] = field(default_factory=dict)
    """Accuracy and AUC of the contrast at every ``s`` with both ``+s`` and ``-s`` in the
    grid (keys ``"s"``)."""
    unscored: int = 0
    """Texts of the sample with no token to score: not in ``n``, the accuracy or the AUC."""

    def line(self) -> str:
        out = (f"{self.steer} on {self.dataset}: accuracy {self.accuracy:.1%}  AUC "
               f"{self.auc:.3f}  (n={self.n}, +/-{self.strength:g}, positive side = label "
               f"{self.positive_label})")
        if self.unscored:
            out += (f"; {self.unscored} more text(s) had no token to score and are not "
                    "counted")
        return out


def evaluate(model, tokenizer, steer, rows: Sequence[tuple[str, str]], dataset: str,
             positive_label: str, strength: float = 5.0,
             strengths: Sequence[float] = DEFAULT_STRENGTHS,
             max_tokens: int | None = DEFAULT_MAX_TOKENS, batch_size: int = 8,
             prefix: str | None = None, progress: bool = True) -> tuple[Evaluation, TextScores]:
    """Run the classifier on labelled ``rows`` and measure it. Texts with no token to score
    are counted apart (:attr:`Evaluation.unscored`), not as predictions."""
    grid = sorted(set(float(s) for s in strengths) | {abs(strength), -abs(strength)})
    texts = [t for t, _ in rows]
    sc = score_texts(model, tokenizer, steer, texts, grid, max_tokens, batch_size, prefix,
                     progress)
    keep = [i for i, ok in enumerate(sc.scored()) if ok]
    if rows and not keep:
        raise ValueError(f"none of the {len(rows)} texts has a token to score (each is empty "
                         "or one token long): give a --prefix, or texts of two tokens or more")
    truth = [rows[i][1] == positive_label for i in keep]

    def measure(s: float) -> tuple[float, float]:
        con = sc.contrast(s)
        cs = [con[i] for i in keep]
        return (sum((c > 0) == t for c, t in zip(cs, truth, strict=True)) / max(len(keep), 1),
                auc(cs, truth))

    acc, area = measure(strength)
    best, con = sc.best(), sc.contrast(strength)
    by: dict[str, dict[str, int]] = {}
    mean_con: dict[str, list[float]] = {}
    for i in keep:
        lab, b = rows[i][1], best[i]
        by.setdefault(lab, {}).setdefault(f"{b:g}", 0)
        by[lab][f"{b:g}"] += 1
        mean_con.setdefault(lab, []).append(con[i])
    by_s: dict[str, dict[str, float]] = {}
    for g in grid:
        if g > 0 and -g in grid:
            a_g, auc_g = measure(g)
            by_s[f"{g:g}"] = {"accuracy": a_g, "auc": auc_g}
    ev = Evaluation(dataset, steer.name, len(keep), abs(strength), acc, area,
                    positive_label, by, {k: sum(v) / len(v) for k, v in mean_con.items()},
                    by_s, unscored=len(rows) - len(keep))
    return ev, sc


def json_safe(obj):
    """``obj`` with every NaN or infinite float replaced by ``None`` (JSON ``null``), so that
    ``json.dump(..., allow_nan=False)`` writes standard JSON."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj
