"""The tradeoff figure puts perplexity on a log axis in plain numbers; steers/replot.py
redraws a run's figures from its results.json alone."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from test_eval_report import cond, results

ROOT = Path(__file__).resolve().parents[2]

pytest.importorskip("matplotlib")


def _toxicity_run():
    return results(conditions=[cond("unsteered", 0, 20.0, 0.3, 0.2)]
                   + [cond("lm-steer", s, 20.0 * 1.6 ** s, 0.3 - 0.03 * s, 0.2 - 0.02 * s)
                      for s in (2, 4, 6)]
                   + [cond("soft-blacklist", s, 20.0 * 2.2 ** s, 0.3 - 0.02 * s, 0.1)
                      for s in (2, 4)])


@pytest.mark.parametrize("span", [(20.0, 400.0), (21.3, 24.7)])
def test_perplexity_axis_is_logarithmic_with_plain_tick_labels(span):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from vllm_steer.eval.plots import _log_perplexity_axis

    fig, ax = plt.subplots()
    ax.plot(span, [0, 1])
    _log_perplexity_axis(ax)
    fig.canvas.draw()
    lo, hi = ax.get_xlim()
    ticks = list(ax.get_xticks())
    labels = [t.get_text() for t in ax.get_xticklabels()]
    plt.close(fig)
    assert ax.get_xscale() == "log" and "log" in ax.get_xlabel()
    assert 2 <= len(ticks) <= 7 and all(lo <= t <= hi for t in ticks)
    assert labels == [f"{t:g}" for t in ticks]  # 50, not 5x10^1


def test_replot_redraws_the_figures_of_a_run_from_its_results_json(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "results.json").write_text(json.dumps(_toxicity_run()))
    out = subprocess.run([sys.executable, str(ROOT / "steers" / "replot.py"), "--only",
                          "tradeoff", str(run), str(tmp_path / "no-run")],
                         capture_output=True, text=True, cwd=ROOT,
                         env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    assert sorted(p.name for p in run.iterdir()) == ["results.json", "tradeoff.png"]
    assert "no results.json" in out.stderr
    out = subprocess.run([sys.executable, str(ROOT / "steers" / "replot.py"), str(run)],
                         capture_output=True, text=True, cwd=ROOT,
                         env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    assert (run / "ablation.png").stat().st_size > 0
