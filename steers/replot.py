"""Redraw the figures of evaluation runs from their committed ``results.json``.

    python steers/replot.py steers/eval/*/                  # every figure of every run
    python steers/replot.py --only tradeoff steers/eval/*/  # only tradeoff.png

A run's figures are drawn by ``vllm_steer.eval.plots`` when ``vllm-steer eval`` (or
``tune``) writes the run; this draws them again from the same ``results.json``, with no
model and no generation, after the plotting code changed. Folders without a
``results.json`` are skipped.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from vllm_steer.eval import plots

FIGURES = {
    "ablation": lambda r, d: plots.ablation(r, str(d / "ablation.png")),
    "tradeoff": lambda r, d: plots.tradeoff(r, str(d / "tradeoff.png")),
    "sentiment_distribution": lambda r, d: plots.sentiment_distribution(
        r, str(d / "sentiment_distribution.png")),
    "grid": lambda r, d: plots.grid(r, str(d / "grid.png")),
}


def replot(run: Path, only: str | None = None) -> list[str]:
    """Redraw ``run``'s figures (all that ``make_plots`` draws, or just ``only``); return the
    file names written."""
    results = json.loads((run / "results.json").read_text())
    if only is None:
        return plots.make_plots(results, str(run))
    if only == "grid" and results["task"] != "grid":
        return []
    if only != "grid" and results["task"] == "grid":
        return []
    if only == "sentiment_distribution" and results["task"] != "sentiment":
        return []
    if FIGURES[only](results, run) is False:
        return []
    return [f"{only}.png"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", type=Path, help="run folders (each with results.json)")
    ap.add_argument("--only", choices=sorted(FIGURES), default=None,
                    help="redraw only this figure (default: every figure of the run)")
    a = ap.parse_args(argv)
    for run in a.runs:
        if not (run / "results.json").is_file():
            print(f"skip {run}: no results.json", file=sys.stderr)
            continue
        made = replot(run, a.only)
        print(f"{run}: {', '.join(made) or 'nothing to draw'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
