"""benchmarks/plot_throughput_vs_k.py draws README's throughput chart from the committed
runs of bench_throughput.py."""

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytest.importorskip("matplotlib")


def _module():
    spec = importlib.util.spec_from_file_location(
        "plot_throughput_vs_k", ROOT / "benchmarks" / "plot_throughput_vs_k.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_each_committed_run_gives_its_k_points_with_intervals_around_the_median():
    mod = _module()
    for path in mod.RUNS:
        doc = json.loads(path.read_text())
        ks, med, lo, hi, control = mod.series(doc)
        assert ks == doc["meta"].get("k_list", ks) and ks == sorted(ks) and ks
        assert all(a <= m <= b for a, m, b in zip(lo, med, hi, strict=True))
        assert control is not None and control[0] <= control[1]


def test_the_chart_is_drawn_from_the_committed_runs(tmp_path):
    out = tmp_path / "chart.png"
    assert _module().main(["--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
