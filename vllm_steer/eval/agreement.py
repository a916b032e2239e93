"""How well an offline toxicity scorer agrees with Perspective.

The RealToxicityPrompts files of the data folder carry Perspective API scores for each
prompt and its human-written continuation (``prompt.toxicity``, ``continuation.toxicity``).
:func:`perspective_texts` collects those texts (prompts and continuations of
:data:`PERSPECTIVE_FILES`, those with a score; an exact repeat of a text is kept once, with
its first score), each labelled toxic when Perspective's toxicity is above
:data:`PERSPECTIVE_THRESHOLD`; :func:`agreement` gives a scorer's AUROC against those labels
and its Spearman rank correlation with Perspective's scores.

    python scripts/scorer_agreement.py --toxicity-scorer profanity-check \\
        --toxicity-scorer minilm-jigsaw
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Sequence

#: The RealToxicityPrompts files read, relative to the data folder.
PERSPECTIVE_FILES = ("prompts/toxicity/rtp_toxic_dev_598.jsonl",
                     "prompts/toxicity/rtp_nontoxic_1200.jsonl")
#: A text is labelled toxic when its Perspective toxicity is above this.
PERSPECTIVE_THRESHOLD = 0.5
#: The parts of a RealToxicityPrompts record that are scored.
PARTS = ("prompt", "continuation")


@dataclass
class PerspectiveTexts:
    texts: list[str] = field(default_factory=list)
    perspective: list[float] = field(default_factory=list)
    source: list[str] = field(default_factory=list)  # "FILE:LINE:PART"
    skipped_null: int = 0
    skipped_repeat: int = 0
    files: dict[str, str] = field(default_factory=dict)  # file -> sha256

    @property
    def labels(self) -> list[int]:
        return [int(p > PERSPECTIVE_THRESHOLD) for p in self.perspective]

    def describe(self) -> dict:
        return {"files": self.files, "parts": list(PARTS), "texts": len(self.texts),
                "toxic": sum(self.labels), "label_rule": f"Perspective toxicity > "
                f"{PERSPECTIVE_THRESHOLD:g}", "skipped_null_toxicity": self.skipped_null,
                "skipped_repeated_text": self.skipped_repeat}


def perspective_texts(data_dir: str, files: Sequence[str] = PERSPECTIVE_FILES
                      ) -> PerspectiveTexts:
    """The prompts and continuations of ``files`` (under ``data_dir``) with their
    Perspective toxicity; texts without a score are skipped, a repeated text is kept once."""
    from vllm_steer.train.data import file_sha256, json_lines

    out = PerspectiveTexts()
    seen: set[str] = set()
    for rel in files:
        path = os.path.join(data_dir, rel)
        if not os.path.exists(path):
            raise FileNotFoundError(f"{path}: no such file (give --data DIR holding {rel})")
        out.files[rel] = file_sha256(path)
        for n, rec in json_lines(path):
            if not isinstance(rec, dict):
                raise ValueError(f"{path}:{n}: expected a JSON object per line, got "
                                 f"{type(rec).__name__}")
            for part in PARTS:
                d = rec.get(part) or {}
                tox, text = d.get("toxicity"), d.get("text")
                if tox is None or not isinstance(text, str):
                    out.skipped_null += 1
                    continue
                if text in seen:
                    out.skipped_repeat += 1
                    continue
                seen.add(text)
                out.texts.append(text)
                out.perspective.append(float(tox))
                out.source.append(f"{rel}:{n}:{part}")
    return out


def agreement(scores: Sequence[float], perspective: Sequence[float]) -> dict[str, float]:
    """AUROC of ``scores`` against ``perspective > 0.5`` and Spearman's rho with it."""
    from scipy.stats import spearmanr
    from sklearn.metrics import roc_auc_score

    labels = [int(p > PERSPECTIVE_THRESHOLD) for p in perspective]
    return {"auroc": float(roc_auc_score(labels, list(scores))),
            "spearman": float(spearmanr(list(scores), list(perspective)).statistic),
            "texts": len(labels), "toxic": sum(labels)}


def scorer_agreement(names: Sequence[str], data_dir: str, progress: bool = True
                     ) -> tuple[PerspectiveTexts, dict[str, dict[str, float]]]:
    """``(texts, {scorer: agreement})`` for registered toxicity scorers ``names``."""
    from tqdm.auto import tqdm

    from vllm_steer.eval.scorers import get_scorer, score_texts

    pt = perspective_texts(data_dir)
    out = {}
    for name in names:
        get_scorer("toxicity", name)
        scores: list[float] = []
        step = 256
        for a in tqdm(range(0, len(pt.texts), step), desc=name, disable=not progress,
                      leave=False):
            scores += score_texts("toxicity", name, pt.texts[a:a + step])
        out[name] = agreement(scores, pt.perspective)
    return pt, out


def agreement_table(pt: PerspectiveTexts, results: dict[str, dict[str, float]]) -> str:
    """A Markdown table of :func:`scorer_agreement`'s results."""
    d = pt.describe()
    lines = [f"{d['texts']} texts (prompts and continuations of "
             f"{', '.join(d['files'])}; {d['toxic']} toxic: {d['label_rule']})", "",
             "| scorer | AUROC | Spearman |", "|---|---|---|"]
    lines += [f"| {n} | {r['auroc']:.3f} | {r['spearman']:.3f} |" for n, r in results.items()]
    return "\n".join(lines)
