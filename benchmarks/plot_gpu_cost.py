"""What a steer costs on a GPU: the steer op (the backend ``auto`` picks) against the LM head
it runs before, per shape, from benchmarks/results/gpu_cost_h200.json -> docs/gpu-cost.png.

    python benchmarks/plot_gpu_cost.py
"""

from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main(src: Path = ROOT / "benchmarks/results/gpu_cost_h200.json",
         out: Path = ROOT / "docs/gpu-cost.png") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from vllm_steer.ops import _auto_cuda, _load_kernels

    _load_kernels()  # the rule picks among the registered backends
    data = json.loads(src.read_text())
    shapes = data["shapes"]
    labels, op, head = [], [], []
    for s in shapes:
        pick = _auto_cuda(s["d"], s["rank"])
        labels.append(f"d {s['d']}\nrank {s['rank']}, {s['steers']} steer(s)\n{s['rows']} rows\n"
                      f"({pick})")
        op.append(s[f"{pick}_us"])
        head.append(s["lmhead_us"])
    fig, ax = plt.subplots(figsize=(11, 4.6))
    x = range(len(shapes))
    ax.bar([i - 0.2 for i in x], op, 0.4, label="steer op (auto's backend, planned, per call)")
    ax.bar([i + 0.2 for i in x], head, 0.4, label="LM head (vocab 128,256), for scale")
    for i, (a, b) in enumerate(zip(op, head, strict=False)):
        ax.text(i - 0.2, a, f"{a:.0f}", ha="center", va="bottom", fontsize=8)
        ax.text(i + 0.2, b, f"{b:.0f}", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(x), labels, fontsize=8)
    ax.set_ylabel("microseconds per call")
    ax.set_title(f"The steer op against the LM head: {data['device']}", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    return out


if __name__ == "__main__":
    print(main())
