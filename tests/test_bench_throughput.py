"""benchmarks/bench_throughput.py: the paired ratios and intervals its table reports.

The engines themselves are exercised by running the benchmark (benchmarks/RESULTS.md); this
checks the arithmetic that turns runs into the ratios a reader compares with the goals.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from bench_throughput import PLAIN, median_ci, paired_ratios, summarize, table_row  # noqa: E402


def test_paired_ratio_cancels_drift_that_hits_both_modes():
    # the machine slows down 30% in round 2; the steered mode is 5% slower in every round
    plain = [(2000, 10.0, 15.0), (2000, 13.0, 15.0), (2000, 10.0, 15.0)]
    steered = [(2000, 10.5, 15.75), (2000, 13.65, 15.75), (2000, 10.5, 15.75)]
    rows = {r["mode"]: r for r in summarize({PLAIN: plain, "(c) steered": steered})}
    assert rows[PLAIN]["ratio_median"] == pytest.approx(1.0)
    assert rows["(c) steered"]["ratio_median"] == pytest.approx(1 / 1.05)
    assert rows["(c) steered"]["ratio_ci95"] == pytest.approx([1 / 1.05, 1 / 1.05])
    assert rows["(c) steered"]["cpu_ratio_median"] == pytest.approx(1 / 1.05)
    # unpaired, the slow round would have widened the spread to 0.73-1.0
    assert rows["(c) steered"]["ratio_min"] == pytest.approx(1 / 1.05)


def test_interval_brackets_the_median_and_is_reproducible():
    xs = [0.97, 1.01, 0.99, 1.03, 0.95, 1.00, 0.98, 1.02]
    med, lo, hi = median_ci(xs)
    assert lo <= med <= hi
    assert min(xs) <= lo < hi <= max(xs)
    assert median_ci(xs) == (med, lo, hi)


def test_unpaired_rounds_are_refused():
    with pytest.raises(ValueError, match="3 runs against 2 base runs"):
        paired_ratios([1.0, 1.0, 1.0], [1.0, 1.0])
    with pytest.raises(ValueError, match="no runs"):
        median_ci([])


def test_table_row_shows_ratio_interval_and_cpu_ratio():
    rows = summarize({PLAIN: [(100, 1.0, 1.5)] * 3, "(b) plugin": [(100, 1.0, 1.5)] * 3})
    line = table_row(rows[1])
    assert line.startswith("| (b) plugin | 100.0 | 1.000 [1.000, 1.000] | 1.000-1.000 |")
    assert line.endswith("1.000 [1.000, 1.000] |")
