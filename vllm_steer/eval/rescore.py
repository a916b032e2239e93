"""Rescore a finished run with another toxicity scorer, without generating again.

    vllm-steer eval rescore eval_out/toxicity-detox --toxicity-scorer minilm-jigsaw

reads the run's ``generations.jsonl`` (every sample of every condition, written by
``vllm-steer eval toxicity|sentiment|grid``), scores every sample's text with each scorer,
and writes:

- ``toxicity_NAME`` per sample into ``generations.jsonl`` (rewritten in place, nothing else
  changed);
- ``rescore-NAME.json``: per condition the paper's metrics (:func:`~vllm_steer.eval.
  toxicity.toxicity_metrics`: avg max toxicity, toxicity probability, mean toxicity) by that
  scorer, each with a 95% bootstrap confidence interval over prompts;
- when the run has a ``results.json``: the metrics as ``avg_max_toxicity_NAME``,
  ``toxicity_prob_NAME``, ``mean_toxicity_NAME`` of each condition (as if the scorer had been
  given with ``--toxicity-scorer`` at the run), the scorer added to the run's list of
  toxicity scorers, and ``results.md`` rewritten.
"""

from __future__ import annotations

import json
import os
from typing import Any, Callable, Sequence

GENERATIONS = "generations.jsonl"
#: Bootstrap resamples of the prompts, and the seed of their draws.
BOOTSTRAP = 1000
BOOTSTRAP_SEED = 0
METRICS = ("avg_max_toxicity", "toxicity_prob", "mean_toxicity")


def read_generations(run: str) -> list[dict[str, Any]]:
    path = os.path.join(run, GENERATIONS)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path}: no such file (give the --out folder of a finished "
                                "`vllm-steer eval` run)")
    rows = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            rec = json.loads(line)
            if not (isinstance(rec, dict) and "condition" in rec
                    and isinstance(rec.get("samples"), list)):
                raise ValueError(f"{path}:{n}: expected an object with 'condition' and "
                                 "'samples' (a generations.jsonl of `vllm-steer eval`)")
            rows.append(rec)
    return rows


def per_condition(rows: Sequence[dict[str, Any]], key: str
                  ) -> dict[str, list[list[float]]]:
    """``{condition: [scores of prompt i's samples, ...]}`` in the file's order (rows of a
    condition are in prompt order)."""
    out: dict[str, list[list[float]]] = {}
    for rec in rows:
        out.setdefault(rec["condition"], []).append([float(s[key]) for s in rec["samples"]])
    return out


def bootstrap_ci(scores_per_prompt: Sequence[Sequence[float]], n: int = BOOTSTRAP,
                 seed: int = BOOTSTRAP_SEED, level: float = 0.95) -> dict[str, list[float]]:
    """Percentile bootstrap intervals of :func:`toxicity_metrics` over prompts (prompts drawn
    with replacement, ``n`` times, with a seeded generator)."""
    import numpy as np

    from vllm_steer.eval.toxicity import TOXIC_THRESHOLD

    rows = [list(s) for s in scores_per_prompt if len(s)]
    maxes = np.array([max(s) for s in rows])
    sums = np.array([sum(s) for s in rows])
    counts = np.array([len(s) for s in rows])
    rng = np.random.default_rng(seed)
    draws = rng.integers(0, len(rows), size=(n, len(rows)))
    stats = {"avg_max_toxicity": maxes[draws].mean(1),
             "toxicity_prob": (maxes[draws] > TOXIC_THRESHOLD).mean(1),
             "mean_toxicity": sums[draws].sum(1) / counts[draws].sum(1)}
    lo, hi = (1 - level) / 2 * 100, (1 + level) / 2 * 100
    return {k: [float(np.percentile(v, lo)), float(np.percentile(v, hi))]
            for k, v in stats.items()}


def rescore(run: str, scorers: Sequence[str], progress: bool = True,
            log: Callable[[str], None] = print) -> dict[str, dict[str, Any]]:
    """Score every sample of ``run`` with each of ``scorers`` and write the results (see the
    module's docstring). Returns ``{scorer: {condition: {metric: value, metric_ci: [lo,
    hi]}}}``."""
    from vllm_steer.eval.harness import _chunked_scores
    from vllm_steer.eval.toxicity import toxicity_metrics

    if not scorers:
        raise ValueError("give at least one --toxicity-scorer")
    rows = read_generations(run)
    texts = [s["text"] for rec in rows for s in rec["samples"]]
    out: dict[str, dict[str, Any]] = {}
    for name in scorers:
        scores = iter(_chunked_scores("toxicity", name, texts, progress))
        key = f"toxicity_{name}"
        for rec in rows:
            for s in rec["samples"]:
                s[key] = next(scores)
        table: dict[str, Any] = {}
        for cond, per in per_condition(rows, key).items():
            m = toxicity_metrics(per)
            ci = bootstrap_ci(per)
            table[cond] = {**m, **{f"{k}_ci95": ci[k] for k in METRICS},
                           "prompts": len(per), "samples": sum(len(s) for s in per)}
        out[name] = table
        doc = {"run": os.path.abspath(run), "scorer": name, "conditions": table,
               "bootstrap": {"resamples": BOOTSTRAP, "seed": BOOTSTRAP_SEED,
                             "over": "prompts", "interval": "95% percentile"}}
        _write_json(os.path.join(run, f"rescore-{_safe(name)}.json"), doc)
        log(markdown_table(name, table))
    _write_generations(run, rows)
    results = os.path.join(run, "results.json")
    if os.path.exists(results):
        _update_results(run, out)
    return out


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)


def _write_json(path: str, doc: Any) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1)
    os.replace(tmp, path)


def _write_generations(run: str, rows: Sequence[dict[str, Any]]) -> None:
    path = os.path.join(run, GENERATIONS)
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        for rec in rows:
            f.write(json.dumps(rec) + "\n")
    os.replace(tmp, path)


def _update_results(run: str, out: dict[str, dict[str, Any]]) -> None:
    """The rescored metrics into the run's ``results.json`` (suffixed ``_NAME``), the scorer
    into its list of toxicity scorers, ``results.md`` rewritten."""
    from vllm_steer.eval.harness import _read_results, write_outputs

    results = _read_results(run)
    tox = results.setdefault("scorers", {}).setdefault("toxicity", {})
    more = tox.setdefault("more", [])
    for name, table in out.items():
        if name != tox.get("name") and name not in more:
            more.append(name)
        for c in results.get("conditions", []):
            m = table.get(c["label"])
            if m is None:
                continue
            if name == tox.get("name"):
                continue  # the headline scorer's own metrics stay as the run measured them
            c["metrics"].update({f"{k}_{name}": m[k] for k in METRICS})
    results.setdefault("rescored", []).extend(
        {"scorer": n, "file": f"rescore-{_safe(n)}.json"} for n in out)
    write_outputs(results, run)


def markdown_table(name: str, table: dict[str, Any]) -> str:
    lines = [f"toxicity by `{name}` (95% bootstrap interval over prompts)", "",
             "| condition | avg max toxicity | toxicity prob. | prompts |", "|---|---|---|---|"]
    for cond, m in table.items():
        a, p = m["avg_max_toxicity_ci95"], m["toxicity_prob_ci95"]
        lines.append(f"| {cond} | {m['avg_max_toxicity']:.3f} [{a[0]:.3f}, {a[1]:.3f}] | "
                     f"{m['toxicity_prob']:.3f} [{p[0]:.3f}, {p[1]:.3f}] | {m['prompts']} |")
    return "\n".join(lines)
