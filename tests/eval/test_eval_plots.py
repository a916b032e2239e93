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


def test_a_vector_steer_and_the_blacklist_each_span_the_ablation_axis(tmp_path, monkeypatch):
    """A vector steer's strengths (the coefficient a, here +-0.08) and the soft blacklist's
    (units of epsilon, +-10) share no unit: each is drawn against its strength over its
    largest, so neither collapses into a vertical line at 0; one method alone keeps its own
    unit."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from vllm_steer.eval.plots import ablation

    run = results(conditions=[cond("unsteered", 0, 20.0, 0.3, 0.2)]
                  + [cond("vector", s, 21.0, 0.25, 0.15, name="calm") for s in (-0.08, 0.08)]
                  + [cond("soft-blacklist", s, 25.0, 0.2, 0.1) for s in (-10, 10)])
    run["steers"]["detox"]["kind"] = "vector"
    kept = []
    monkeypatch.setattr(plt, "close", lambda fig=None: kept.append(fig))
    ablation(run, str(tmp_path / "a.png"))
    ax = kept[-1].axes[0]
    spans = {ln.get_label().split(" ")[0]: (min(ln.get_xdata()), max(ln.get_xdata()))
             for ln in ax.get_lines()}
    assert spans == {"vector": (-1.0, 1.0), "soft-blacklist": (-1.0, 1.0)}
    assert "each in its own unit" in ax.get_xlabel()
    run["conditions"] = [c for c in run["conditions"] if c["method"] != "soft-blacklist"]
    ablation(run, str(tmp_path / "b.png"))
    ax = kept[-1].axes[0]
    assert ax.get_xlabel() == "strength (coefficient a)"
    assert [(min(ln.get_xdata()), max(ln.get_xdata())) for ln in ax.get_lines()] == [(-0.08,
                                                                                        0.08)]
