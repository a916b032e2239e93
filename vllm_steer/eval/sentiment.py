"""Sentiment: the built-in scorers and the paper's positivity metric.

Metric (DExperts / LM-Steer): for each prompt, the fraction of its samples classified
positive; **positivity** is the mean of that fraction over prompts (reported in percent).

Scorers (``score(texts) -> P(positive)`` per text, registered under the ``sentiment`` kind):

- ``sst2`` (default): TF-IDF (word 1-2 grams, sublinear tf) + logistic regression trained
  by this project on ``sst2/train.tsv`` (the paper used a DistilBERT SST-2 classifier, which
  cannot be downloaded here). Trained on first use in about a second, cached as JSON (no
  pickle) in ``~/.cache/vllm-steer/eval/`` keyed by the training file's sha256; its SST-2
  dev and test accuracies are stored with it and printed in every report.
- ``vader``: VADER's rule-based compound score ``c`` in [-1, 1] mapped to ``(c + 1) / 2``
  (so "positive" means ``c > 0``; a text VADER finds neutral counts as not positive), a
  second opinion that shares no training data with anything here.
"""

from __future__ import annotations

import json
import math
import os
import re
import time
from pathlib import Path
from typing import Sequence


POSITIVE_THRESHOLD = 0.5
#: Bump when the classifier recipe changes (invalidates the cache).
SST2_RECIPE = {"version": 1, "ngram_range": [1, 2], "min_df": 2, "sublinear_tf": True,
               "C_grid": [0.5, 1.0, 2.0, 4.0, 8.0], "preprocess": "lower; n't -> not"}

_NT = re.compile(r"\s*n't\b")


def preprocess(text: str) -> str:
    """Lower-case and spell out ``n't`` (SST writes ``does n't``, generations ``doesn't``),
    so negation survives tokenisation in both."""
    return _NT.sub(" not", text.lower())


def read_sst2(path: str) -> tuple[list[str], list[int]]:
    """``(sentences, labels)`` of an SST-2 TSV (header ``sentence<TAB>label``, 1 = positive)."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"SST-2 file {path!r} not found (give --data DIR holding "
                                "sst2/train.tsv, dev.tsv, test.tsv, or set $VLLM_STEER_DATA)")
    texts, labels = [], []
    with open(path, encoding="utf-8") as f:
        header = f.readline().rstrip("\n").split("\t")
        if header[:2] != ["sentence", "label"]:
            raise ValueError(f"{path}: expected the header 'sentence<TAB>label', got {header}")
        for i, line in enumerate(f, 2):
            if not line.strip():
                continue
            parts = line.rstrip("\n").split("\t")
            if len(parts) < 2 or parts[1] not in ("0", "1"):
                raise ValueError(f"{path}:{i}: expected 'sentence<TAB>0|1', got {line[:80]!r}")
            texts.append(parts[0])
            labels.append(int(parts[1]))
    return texts, labels


class SST2Classifier:
    """TF-IDF + logistic regression on SST-2; ``score`` gives P(positive)."""

    name = "sst2"

    def __init__(self, vocabulary: dict[str, int], idf: list[float], coef: list[float],
                 intercept: float, info: dict | None = None):
        from sklearn.feature_extraction.text import TfidfVectorizer

        self.info = dict(info or {})
        self._vec = TfidfVectorizer(vocabulary=vocabulary, ngram_range=tuple(
            SST2_RECIPE["ngram_range"]), sublinear_tf=SST2_RECIPE["sublinear_tf"],
            preprocessor=preprocess)
        import numpy as np

        self._vec.idf_ = np.asarray(idf, dtype=np.float64)
        self._coef = np.asarray(coef, dtype=np.float64)
        self._intercept = float(intercept)

    # -------------------------------------------------------------------- training / cache
    @classmethod
    def train(cls, data_dir: str, progress_log=None) -> "SST2Classifier":
        """Fit on ``sst2/train.tsv``; C chosen on ``dev.tsv``; accuracies recorded."""
        import numpy as np
        from sklearn.feature_extraction.text import TfidfVectorizer
        from sklearn.linear_model import LogisticRegression

        t0 = time.perf_counter()
        tr_x, tr_y = read_sst2(os.path.join(data_dir, "sst2", "train.tsv"))
        dv_x, dv_y = read_sst2(os.path.join(data_dir, "sst2", "dev.tsv"))
        vec = TfidfVectorizer(ngram_range=tuple(SST2_RECIPE["ngram_range"]),
                              min_df=SST2_RECIPE["min_df"],
                              sublinear_tf=SST2_RECIPE["sublinear_tf"], preprocessor=preprocess)
        xtr = vec.fit_transform(tr_x)
        xdv = vec.transform(dv_x)
        best = None
        for c in SST2_RECIPE["C_grid"]:
            clf = LogisticRegression(C=c, max_iter=2000).fit(xtr, tr_y)
            acc = float((clf.predict(xdv) == np.asarray(dv_y)).mean())
            if best is None or acc > best[0]:
                best = (acc, c, clf)
        dev_acc, c, clf = best
        vocab = {k: int(v) for k, v in vec.vocabulary_.items()}
        info = {"recipe": SST2_RECIPE, "C": c, "dev_accuracy": dev_acc,
                "train_examples": len(tr_x), "train_seconds": time.perf_counter() - t0}
        model = cls(vocab, vec.idf_.tolist(), clf.coef_[0].tolist(), float(clf.intercept_[0]),
                    info)
        test = os.path.join(data_dir, "sst2", "test.tsv")
        if os.path.exists(test):
            model.info["test_accuracy"] = model.accuracy(*read_sst2(test))
        return model

    def to_json(self) -> dict:
        return {"vocabulary": self._vec.vocabulary, "idf": self._vec.idf_.tolist(),
                "coef": self._coef.tolist(), "intercept": self._intercept, "info": self.info}

    @classmethod
    def from_json(cls, d: dict) -> "SST2Classifier":
        return cls(d["vocabulary"], d["idf"], d["coef"], d["intercept"], d.get("info"))

    @classmethod
    def cached(cls, data_dir: str | None = None, cache: str | os.PathLike | None = None
               ) -> "SST2Classifier":
        """The classifier for this data, from the cache if trained before, else trained now
        and cached."""
        from vllm_steer.models import cache_dir
        from vllm_steer.train.config import default_data_dir
        from vllm_steer.train.data import file_sha256

        data_dir = data_dir or default_data_dir()
        train = os.path.join(data_dir, "sst2", "train.tsv")
        if not os.path.exists(train):
            raise FileNotFoundError(f"the sst2 sentiment scorer trains on {train!r}, which is "
                                    "missing (give --data DIR or set $VLLM_STEER_DATA)")
        key = file_sha256(train)[:16] + "-v" + str(SST2_RECIPE["version"])
        folder = Path(cache) if cache else cache_dir() / "eval"
        path = folder / f"sst2-tfidf-lr-{key}.json"
        if path.exists():
            try:
                return cls.from_json(json.loads(path.read_text()))
            except (ValueError, KeyError):
                pass  # a broken cache is simply retrained
        model = cls.train(data_dir)
        model.info["train_sha256"] = file_sha256(train)
        folder.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(model.to_json()))
        os.replace(tmp, path)
        return model

    # ------------------------------------------------------------------------- scoring
    def score(self, texts: Sequence[str]) -> list[float]:
        if not texts:
            return []
        z = self._vec.transform(list(texts)) @ self._coef + self._intercept
        return [1.0 / (1.0 + math.exp(-float(v))) for v in z]

    def accuracy(self, texts: Sequence[str], labels: Sequence[int]) -> float:
        p = self.score(texts)
        hits = sum((x > POSITIVE_THRESHOLD) == bool(y) for x, y in zip(p, labels, strict=True))
        return hits / len(labels)


class VaderScorer:
    """VADER compound score mapped to [0, 1]."""

    name = "vader"

    def __init__(self) -> None:
        try:
            from vaderSentiment.vaderSentiment import SentimentIntensityAnalyzer
        except ImportError as e:
            raise RuntimeError("the vader scorer needs the package vaderSentiment "
                               "(pip install vaderSentiment)") from e
        self._a = SentimentIntensityAnalyzer()

    def score(self, texts: Sequence[str]) -> list[float]:
        return [(self._a.polarity_scores(t)["compound"] + 1.0) / 2.0 for t in texts]


def sst2_scorer() -> SST2Classifier:
    """The ``sst2`` scorer of the registry (:data:`vllm_steer.eval.scorers.BUILTINS`)."""
    return SST2Classifier.cached(os.environ.get("VLLM_STEER_DATA"))


def positivity_metrics(scores_per_prompt: Sequence[Sequence[float]],
                       threshold: float = POSITIVE_THRESHOLD) -> dict[str, float]:
    """``positivity``: mean over prompts of the fraction of samples scoring > ``threshold``
    (0..1); ``mean_p_positive``: mean score over all samples."""
    fr = [sum(x > threshold for x in s) / len(s) for s in scores_per_prompt if len(s)]
    if not fr:
        raise ValueError("no samples to score: every prompt has zero samples")
    n = sum(len(s) for s in scores_per_prompt)
    return {"positivity": sum(fr) / len(fr),
            "mean_p_positive": sum(sum(s) for s in scores_per_prompt) / n}
