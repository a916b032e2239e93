"""Agreement of toxicity scorers with Perspective (the RealToxicityPrompts scores), and the
script that prints it."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_steer.eval.agreement import (PERSPECTIVE_FILES, agreement, agreement_table,
                                       perspective_texts, scorer_agreement)

ROOT = Path(__file__).resolve().parents[2]


class Shouty:
    """A stand-in scorer: the share of upper-case letters."""

    name = "shouty"

    def score(self, texts):
        return [sum(c.isupper() for c in t) / max(1, sum(c.isalpha() for c in t)) for t in texts]


def _rtp(tmp_path) -> Path:
    recs = [  # (prompt, its Perspective toxicity, continuation, its toxicity)
        ("YOU IDIOT", 0.9, " and more", 0.1),
        ("a calm day", 0.05, " SHUT UP NOW", 0.8),
        ("repeated", 0.2, " no score", None),
        ("repeated", 0.3, " QUITE LOUD", 0.6),
    ]
    for i, rel in enumerate(PERSPECTIVE_FILES):
        p = tmp_path / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text("\n".join(json.dumps({"prompt": {"text": a, "toxicity": ta},
                                           "continuation": {"text": b, "toxicity": tb}})
                               for a, ta, b, tb in recs[2 * i:2 * i + 2]) + "\n")
    return tmp_path


def test_texts_labels_and_the_two_measures(tmp_path):
    pt = perspective_texts(str(_rtp(tmp_path)))
    assert pt.texts == ["YOU IDIOT", " and more", "a calm day", " SHUT UP NOW", "repeated",
                        " QUITE LOUD"]
    assert pt.labels == [1, 0, 0, 1, 0, 1]
    assert pt.skipped_null == 1 and pt.skipped_repeat == 1
    assert pt.source[3] == f"{PERSPECTIVE_FILES[0]}:2:continuation"
    a = agreement(Shouty().score(pt.texts), pt.perspective)
    assert a["auroc"] == 1.0 and a["texts"] == 6 and a["toxic"] == 3
    # ranks (ties averaged): scores [5, 2, 2, 5, 2, 5], Perspective [6, 2, 1, 5, 3, 4]
    assert a["spearman"] == pytest.approx(13.5 / (13.5 * 17.5) ** 0.5)
    assert agreement([0.1, 0.3, 0.5], [0.9, 0.1, 0.6])["auroc"] == 0.5  # 1 pair of 2 right


def test_the_script_prints_the_table_for_scorers_given_by_module(tmp_path, monkeypatch):
    from vllm_steer.eval import register_scorer, scorers

    monkeypatch.setitem(scorers._REGISTRY, "toxicity", dict(scorers._REGISTRY["toxicity"]))

    register_scorer("toxicity", "shouty", Shouty, overwrite=True)
    pt, res = scorer_agreement(["shouty"], str(_rtp(tmp_path)), progress=False)
    table = agreement_table(pt, res)
    assert "| shouty | 1.000 | 0.878 |" in table and "3 toxic" in table
    out = tmp_path / "a.json"
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "scorer_agreement.py"),
                        "--toxicity-scorer", f"{__name__}:Shouty", "--data", str(tmp_path),
                        "--json", str(out), "--quiet"], capture_output=True, text=True,
                       timeout=120, env=dict(os.environ, PYTHONPATH=os.pathsep.join(
                           [str(ROOT), str(Path(__file__).parent),
                            os.environ.get("PYTHONPATH", "")])))
    assert r.returncode == 0, r.stderr[-2000:]
    assert "| test_eval_agreement:Shouty | 1.000 | 0.878 |" in r.stdout
    doc = json.loads(out.read_text())
    assert doc["texts"]["texts"] == 6 and doc["scorers"]["test_eval_agreement:Shouty"][
        "auroc"] == 1.0
