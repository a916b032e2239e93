"""Diversity: dist-1/2/3 as in DExperts and LM-Steer.

For one prompt with samples ``g_1..g_k``, each split on whitespace into words::

    dist-n = |{distinct n-grams over all k samples}| / (total words over all k samples)

averaged over prompts. The denominator is the number of *words*, not of n-grams: this is the
formula of the DExperts evaluation script the paper reuses (with n-gram counts as the
denominator dist-2/3 would come out slightly higher for short samples). One detail differs:
DExperts splits on single spaces (``split(' ')``), which makes a continuation's leading
space one more, empty, word; ``str.split()`` here does not (docs/eval.md gives the size of
the difference).
"""

from __future__ import annotations

from typing import Sequence

NS = (1, 2, 3)


def distinct_n(samples: Sequence[str], n: int) -> float:
    """dist-n of one prompt's samples (0.0 when they hold no words)."""
    if n < 1:
        raise ValueError(f"n={n}: n-grams need n >= 1")
    grams: set[tuple[str, ...]] = set()
    total = 0
    for s in samples:
        words = s.split()
        total += len(words)
        grams.update(tuple(words[i:i + n]) for i in range(len(words) - n + 1))
    return len(grams) / total if total else 0.0


def diversity_metrics(samples_per_prompt: Sequence[Sequence[str]]) -> dict[str, float]:
    """``dist-1``, ``dist-2``, ``dist-3`` averaged over prompts."""
    if not samples_per_prompt:
        raise ValueError("no prompts to measure diversity on")
    return {f"dist-{n}": sum(distinct_n(s, n) for s in samples_per_prompt)
            / len(samples_per_prompt) for n in NS}
