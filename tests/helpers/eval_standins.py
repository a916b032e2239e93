"""A stand-in for the engine of ``vllm-steer tune`` and ``eval`` (no vLLM): its samples name
the strength that made them (``" s=+2 sample0"``), and their perplexity is a curve the test
gives, so that the right answer is known by hand."""

from __future__ import annotations

import math
import re

from vllm_steer.eval.fluency import SampleNLL


def sample_strength(text: str) -> float:
    """The strength a stand-in sample names."""
    return float(re.search(r"s=([-+.\d]+)", text).group(1))


def standin_generator(ppl_of):
    """A generator class for the harness (its ``generator`` argument) whose samples name their
    strength and score perplexity ``ppl_of(strength)``; ``made`` records the steers each
    instance was given."""

    class StandInGenerator:
        made: list = []

        def __init__(self, model, steers, blacklists, engine, seed):
            StandInGenerator.made.append(dict(steers))

        def generate(self, prompts, conditions, sampling, progress=True):
            return {c.label: [[f" s={c.strength:+g} sample{j}"
                               for j in range(sampling.samples)] for _ in prompts]
                    for c in conditions}

        def nll(self, prompts, continuations, progress=True):
            return [SampleNLL(3 * math.log(ppl_of(sample_strength(t))), 3)
                    for t in continuations]

        def close(self):
            pass

    return StandInGenerator
