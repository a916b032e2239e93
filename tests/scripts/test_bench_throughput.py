"""benchmarks/bench_throughput.py: the paired ratios and intervals its table reports.

The engines themselves are exercised by running the benchmark (benchmarks/RESULTS.md); this
checks the arithmetic that turns runs into the ratios a reader compares with the goals.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from bench_throughput import (  # noqa: E402
    PLAIN,
    architecture_only,
    make_prompts,
    median_ci,
    paired_ratios,
    summarize,
    table_row,
)

LLAMA_8B = Path(__file__).resolve().parents[2] / "benchmarks" / "configs" / "llama-3.1-8b.json"


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


def test_shipped_8b_config_becomes_a_weightless_model_folder():
    from transformers import AutoConfig

    folder = architecture_only(str(LLAMA_8B), None)
    config = AutoConfig.from_pretrained(folder)
    assert (config.model_type, config.hidden_size, config.num_hidden_layers) == ("llama", 4096, 32)
    assert sorted(p.name for p in Path(folder).iterdir()) == ["config.json"]
    prompts = make_prompts(folder, 3, 16, tokenizer=False)
    assert [len(p) for p in prompts] == [16, 16, 16]
    assert len({tuple(p) for p in prompts}) == 3
    assert all(0 <= t < config.vocab_size and t not in (128000, 128001) for p in prompts for t in p)


def test_architecture_only_refuses_what_cannot_run(tmp_path):
    with pytest.raises(SystemExit, match="needs --load-format dummy, not 'auto'"):
        architecture_only(str(LLAMA_8B), "auto")
    with pytest.raises(SystemExit, match="no such config file"):
        architecture_only(str(tmp_path / "nope.json"), None)
    bad = tmp_path / "bad.json"
    bad.write_text('{"model_type": "llama"}')
    with pytest.raises(SystemExit, match="needs architectures, hidden_size, vocab_size"):
        architecture_only(str(bad), "dummy")
