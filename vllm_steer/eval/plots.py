"""Figures of a run (matplotlib, Agg), written next to ``results.json``.

- ``ablation.png``: each headline metric vs strength, LM-Steer and the soft blacklist, with
  perplexity on a second axis (the paper's strength ablation);
- ``tradeoff.png``: headline metric vs perplexity (log axis) for both methods (compare at
  equal fluency; points labelled with their strength);
- ``sentiment_distribution.png``: per-sample P(positive) for each steer strength in
  [-5, 5] (continuous control), sentiment runs only;
- ``grid.png``: heatmaps over the two steers' strengths (composition), grid runs only.
"""

from __future__ import annotations

import os

from vllm_steer.eval.report import LABELS, headline, steer_kind_label

STEER_COLOR, BL_COLOR = "tab:blue", "tab:orange"
#: Each method's curve and colour (a run has one steer: LM-Steer or a vector steer).
METHOD_COLORS = (("lm-steer", STEER_COLOR), ("vector", STEER_COLOR), ("soft-blacklist", BL_COLOR))


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _curve(results: dict, method: str) -> list[dict]:
    base = [c for c in results["conditions"] if c["method"] == "unsteered"]
    pts = [c for c in results["conditions"] if c["method"] == method]
    return sorted(base + pts, key=lambda c: c["strength"]) if pts else []


def ablation(results: dict, path: str) -> None:
    plt = _plt()
    keys = headline(results)
    fig, axes = plt.subplots(1, len(keys), figsize=(5.2 * len(keys), 3.8), squeeze=False)
    # a vector steer's strength (the coefficient a) and the soft blacklist's (units of
    # epsilon) share no unit: each method is then drawn against its strength over the largest
    # it was run at, so both curves span the axis
    relative = steer_kind_label(results) == "vector steer" and len(
        [m for m, _ in METHOD_COLORS if _curve(results, m)]) > 1
    for ax, key in zip(axes[0], keys, strict=True):
        ax2 = ax.twinx()
        for method, color in METHOD_COLORS:
            cs = _curve(results, method)
            if not cs:
                continue
            x = [c["strength"] for c in cs]
            top = max(abs(v) for v in x) or 1.0
            if relative:
                x = [v / top for v in x]
            label = f"{method} (largest {top:g})" if relative else method
            ax.plot(x, [c["metrics"][key] for c in cs], "o-", color=color, label=label)
            ax2.plot(x, [c["metrics"]["ppl"] for c in cs], "s--", color=color, alpha=0.45,
                     label=f"{method} perplexity")
        ax.set_xlabel("strength / the method's largest (each in its own unit)" if relative
                      else "strength (coefficient a)" if steer_kind_label(results) ==
                      "vector steer" else "strength (units of epsilon)")
        ax.set_ylabel(LABELS.get(key, key))
        ax2.set_ylabel("perplexity (dashed)")
        ax.grid(alpha=0.3)
        ax.set_title(f"{LABELS.get(key, key)} and perplexity vs strength", fontsize=10)
        ax.legend(loc="best", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _log_perplexity_axis(ax) -> None:
    """Perplexity on a log axis, labelled in plain numbers (20, 50, 100, not 2x10^1): the
    strongest strengths' perplexity can be ten times the plain model's, and on a linear axis
    the moderate strengths, the ones worth comparing, crowd into its left edge."""
    import math

    from matplotlib.ticker import MaxNLocator, NullFormatter

    ax.set_xscale("log")  # after the data is drawn: the limits below are the data's
    lo, hi = ax.get_xlim()
    for subs in ((1, 1.5, 2, 3, 4, 5, 7), (1, 2, 5), (1, 3), (1,)):
        ticks = [s * 10 ** e
                 for e in range(math.floor(math.log10(lo)), math.ceil(math.log10(hi)) + 1)
                 for s in subs if lo <= s * 10 ** e <= hi]
        if len(ticks) <= 7:
            break
    if len(ticks) < 2:  # a narrow range (less than the step from 1 to 1.5): evenly spaced
        ticks = [x for x in MaxNLocator(4).tick_values(lo, hi) if lo <= x <= hi]
    ax.set_xticks(ticks, [f"{x:g}" for x in ticks])
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("perplexity (log scale)")


def tradeoff(results: dict, path: str) -> None:
    """Headline metric against perplexity, perplexity on a log axis."""
    plt = _plt()
    keys = headline(results)
    fig, axes = plt.subplots(1, len(keys), figsize=(5.2 * len(keys), 3.8), squeeze=False)
    for ax, key in zip(axes[0], keys, strict=True):
        for method, color in METHOD_COLORS:
            cs = _curve(results, method)
            if not cs:
                continue
            for side in (1, -1):
                part = [c for c in cs if c["strength"] * side >= 0]
                part.sort(key=lambda c: abs(c["strength"]))
                ax.plot([c["metrics"]["ppl"] for c in part], [c["metrics"][key] for c in part],
                        "o-" if side > 0 else "o:", color=color,
                        label=method if side > 0 else None)
            for c in cs:
                ax.annotate(f"{c['strength']:+g}", (c["metrics"]["ppl"], c["metrics"][key]),
                            fontsize=7, xytext=(3, 3), textcoords="offset points")
        _log_perplexity_axis(ax)
        ax.set_ylabel(LABELS.get(key, key))
        ax.grid(alpha=0.3, which="both")
        ax.set_title(f"{LABELS.get(key, key)} vs perplexity (solid: + strengths)", fontsize=10)
        ax.legend(loc="best", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def sentiment_distribution(results: dict, path: str, lo: float = -5, hi: float = 5) -> bool:
    plt = _plt()
    panels = []
    for method, _ in METHOD_COLORS:
        cs = [c for c in _curve(results, method) if lo <= c["strength"] <= hi
              and c.get("sample_p_positive")]
        if len(cs) >= 2:
            panels.append((method, cs))
    if not panels:
        return False
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 3.8), squeeze=False)
    for ax, (method, cs) in zip(axes[0], panels, strict=True):
        data = [c["sample_p_positive"] for c in cs]
        pos = list(range(len(cs)))
        parts = ax.violinplot(data, positions=pos, showmeans=True, showextrema=False)
        for body in parts["bodies"]:
            body.set_facecolor(dict(METHOD_COLORS)[method])
            body.set_alpha(0.5)
        ax.plot(pos, [c["metrics"]["positivity"] for c in cs], "k^-", ms=5,
                label="fraction positive")
        ax.set_xticks(pos, [f"{c['strength']:+g}" for c in cs])
        ax.set_ylim(-0.02, 1.02)
        ax.axhline(0.5, color="gray", lw=0.8, ls=":")
        ax.set_xlabel("strength")
        ax.set_ylabel("P(positive) per sample")
        ax.set_title(f"{method}: sample sentiment by strength", fontsize=10)
        ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def grid(results: dict, path: str) -> None:
    import numpy as np

    from vllm_steer.eval.report import _grid_cell, fmt

    plt = _plt()
    g = results["grid"]
    a, b = g["steers"]
    keys = ["avg_max_toxicity", "positivity", "ppl"]
    fig, axes = plt.subplots(1, len(keys), figsize=(4.6 * len(keys), 4), squeeze=False)
    for ax, key in zip(axes[0], keys, strict=True):
        m = np.full((len(g["a"]), len(g["b"])), np.nan)
        for i, sa in enumerate(g["a"]):
            for j, sb in enumerate(g["b"]):
                c = _grid_cell(results, a, b, sa, sb)
                if c:
                    m[i, j] = c["metrics"][key]
        im = ax.imshow(m, cmap="viridis", aspect="auto", origin="lower")
        lo, hi = np.nanmin(m), np.nanmax(m)
        for i in range(m.shape[0]):
            for j in range(m.shape[1]):
                bright = hi > lo and (m[i, j] - lo) / (hi - lo) > 0.6  # viridis: light top
                ax.text(j, i, fmt(key, m[i, j]), ha="center", va="center", fontsize=8,
                        color="k" if bright else "w")
        ax.set_xticks(range(len(g["b"])), [f"{x:+g}" for x in g["b"]])
        ax.set_yticks(range(len(g["a"])), [f"{x:+g}" for x in g["a"]])
        ax.set_xlabel(f"{b} strength")
        ax.set_ylabel(f"{a} strength")
        ax.set_title(LABELS.get(key, key), fontsize=10)
        fig.colorbar(im, ax=ax, fraction=0.046)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def make_plots(results: dict, out: str) -> list[str]:
    """Write the run's figures into ``out``; return their file names."""
    made = []
    if results["task"] == "grid":
        grid(results, os.path.join(out, "grid.png"))
        return ["grid.png"]
    ablation(results, os.path.join(out, "ablation.png"))
    tradeoff(results, os.path.join(out, "tradeoff.png"))
    made += ["ablation.png", "tradeoff.png"]
    if results["task"] == "sentiment" and sentiment_distribution(
            results, os.path.join(out, "sentiment_distribution.png")):
        made.append("sentiment_distribution.png")
    return made
