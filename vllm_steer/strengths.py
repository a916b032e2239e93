"""Strength lists on the command line: one syntax for every subcommand (eval, tune, score,
train), comma-separated. Light: standard library only."""

from __future__ import annotations

import argparse


def parse_strengths(text: str) -> list[float]:
    """``"-10,-5,0,5,10"`` -> ``[-10.0, -5.0, 0.0, 5.0, 10.0]`` (duplicates dropped)."""
    out: list[float] = []
    for part in (p.strip() for p in str(text).split(",")):
        if not part:
            continue
        try:
            v = float(part)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"strength {part!r} in {text!r} is not a number; write e.g. -10,-5,0,5,10"
            ) from None
        if v != v or v in (float("inf"), float("-inf")):
            raise argparse.ArgumentTypeError(f"strength {part!r} must be finite")
        if v not in out:
            out.append(v)
    if not out:
        raise argparse.ArgumentTypeError(f"no strengths in {text!r}")
    return out
