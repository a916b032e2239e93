"""One chart of engine throughput against the number of distinct steers in a batch, from the
two committed runs of ``benchmarks/bench_throughput.py``: K = 1..16 in a batch of 32
(``results/throughput.json``) and K = 64 and 256 in a batch of 256
(``results/throughput_k64-256.json``).

    python benchmarks/plot_throughput_vs_k.py   # -> benchmarks/results/throughput_vs_k_all.png

Each point is the median, over paired repetitions, of the plugin's output tokens/s divided by
plain vLLM's in the same repetition, with its 95% bootstrap interval; each run's grey band is
its second plain engine's interval (what two identical engines differ by on that machine).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

HERE = Path(__file__).resolve().parent / "results"
RUNS = [HERE / "throughput.json", HERE / "throughput_k64-256.json"]
CONTROL = "(a') plugin not loaded, 2nd engine"


def series(doc: dict) -> tuple[list[int], list[float], list[float], list[float], list | None]:
    """(K, median, interval low, interval high, the control's interval) of one run."""
    ks, med, lo, hi = [], [], [], []
    for row in doc["rows"]:
        if row["mode"].startswith("(d)"):
            ks.append(int(row["mode"].split("K=")[1].split()[0]))
            med.append(row["ratio_median"])
            lo.append(row["ratio_ci95"][0])
            hi.append(row["ratio_ci95"][1])
    control = next((r["ratio_ci95"] for r in doc["rows"] if r["mode"] == CONTROL), None)
    return ks, med, lo, hi, control


def plot(docs: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.8, 5.0))
    all_ks, floor = [], 0.9
    for doc, color in zip(docs, ("tab:blue", "tab:green"), strict=False):
        m = doc["meta"]
        ks, med, lo, hi, control = series(doc)
        all_ks += ks
        err = [[a - b for a, b in zip(med, lo, strict=True)],
               [b - a for a, b in zip(med, hi, strict=True)]]
        ax.errorbar(ks, med, yerr=err, fmt="o-", color=color, capsize=4,
                    label=f"batch {m['batch']}, {m['output_len']} output tokens, "
                          f"{m['repeats']} repetitions (median, 95% interval)")
        if control:
            x0, x1 = min(ks) / 1.3, max(ks) * 1.3
            ax.fill_between([x0, x1], control[0], control[1], color=color, alpha=0.1)
        floor = min(floor, min(lo) - 0.02)
    ax.fill_between([], [], [], color="gray", alpha=0.2,
                    label="second plain engine of the same run: 95% interval")
    ax.axhline(1.0, color="k", lw=0.8, label="plain vLLM (plugin not loaded)")
    ax.set_xscale("log", base=2)
    ks = sorted(set(all_ks))
    ax.set_xticks(ks, [str(k) for k in ks])
    ax.set_ylim(floor, 1.1)
    ax.set_xlabel("distinct steers in the batch (K)")
    ax.set_ylabel("output tokens/s relative to plain vLLM")
    m = docs[0]["meta"]
    ax.set_title(f"{m['model']} on a {m['cpus']}-core CPU, vLLM {m['vllm']}: "
                 "throughput with K distinct steers", fontsize=10)
    ax.legend(fontsize=7.5, loc="upper center", bbox_to_anchor=(0.5, -0.14))
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", nargs="+", type=Path, default=RUNS,
                    help="throughput JSON files of bench_throughput.py")
    ap.add_argument("--out", type=Path, default=HERE / "throughput_vs_k_all.png")
    a = ap.parse_args(argv)
    plot([json.loads(p.read_text()) for p in a.runs], a.out)
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
