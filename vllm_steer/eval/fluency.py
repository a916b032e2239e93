"""Fluency: perplexity of the continuations given their prompts under a scorer model.

For a sample ``x`` (the continuation's tokens ``x_1..x_m``, scored after the prompt ``p``)::

    NLL(x)  = -(1/m) sum_i log p_scorer(x_i | p, x_<i)
    ppl(x)  = exp(NLL(x))

Reported per condition:

- ``ppl``: the mean of ``ppl(x)`` over samples (the DExperts / LM-Steer convention);
- ``ppl_tokens``: ``exp`` of the token-weighted mean NLL over all samples (corpus
  perplexity, less sensitive to single outliers).

Samples with no tokens (an immediate end of sequence) are left out and counted.

The scorer is a transformers causal LM (default: the evaluated model, unsteered); the log
probabilities come from :func:`vllm_steer.hf.token_logprobs` with the prompts as prefixes
(prompt and continuation tokenised separately and concatenated; the prompt with the special
tokens its tokenizer adds, such as Llama's BOS, as the model was given it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence


@dataclass
class SampleNLL:
    """Sum of the negative log-likelihood of one sample and its token count."""

    nll_sum: float
    tokens: int

    @property
    def ppl(self) -> float:
        return math.exp(self.nll_sum / self.tokens) if self.tokens else float("nan")


class PerplexityScorer:
    """A transformers model scoring continuations given prompts."""

    def __init__(self, model: str = "smollm2", dtype: str = "auto", device: str = "auto",
                 batch_size: int = 32):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from vllm_steer.models import resolve_model
        from vllm_steer.train.module import dtype_name, resolve_device, resolve_dtype

        self.path = resolve_model(model)
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device, "scorer dtype")
        self.dtype_name = dtype_name(self.dtype)
        self.batch_size = batch_size
        self.tokenizer = AutoTokenizer.from_pretrained(self.path)
        self.model = AutoModelForCausalLM.from_pretrained(self.path, dtype=self.dtype).to(
            self.device).eval()

    def nll(self, prompts: Sequence[str], continuations: Sequence[str],
            progress: bool = True, desc: str = "perplexity",
            special_tokens: bool = True) -> list[SampleNLL]:
        """One :class:`SampleNLL` per (prompt, continuation), in order.

        ``special_tokens``: a prompt is tokenised as a model is given a text prompt, with the
        special tokens its tokenizer adds (Llama's BOS), as vLLM does; False for text that
        carries its own (a chat template's rendering). The continuation never gets any."""
        from tqdm.auto import tqdm

        from vllm_steer.hf import prompt_ids, token_logprobs

        if len(prompts) != len(continuations):
            raise ValueError(f"{len(prompts)} prompts but {len(continuations)} continuations")
        # length-sorted batches (less padding), results put back in order
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]) + len(continuations[i]))
        out: list[SampleNLL | None] = [None] * len(prompts)
        step = self.batch_size * 4
        bar = tqdm(total=len(order), desc=desc, unit="sample", disable=not progress, leave=False)
        for a in range(0, len(order), step):
            idx = order[a:a + step]
            pre = [prompt_ids(self.tokenizer, prompts[i]) if special_tokens else prompts[i]
                   for i in idx]
            lps = token_logprobs(self.model, self.tokenizer, [continuations[i] for i in idx],
                                 prefixes=pre, batch_size=self.batch_size)
            for i, lp in zip(idx, lps, strict=True):
                out[i] = SampleNLL(-float(lp.double().sum()), int(lp.numel()))
            bar.update(len(idx))
        bar.close()
        return out  # type: ignore[return-value]


def perplexity_metrics(nlls: Sequence[SampleNLL]) -> dict[str, float]:
    """``ppl`` (mean per-sample perplexity), ``ppl_tokens`` (corpus perplexity) and
    ``empty_samples`` (samples without tokens, left out)."""
    scored = [x for x in nlls if x.tokens]
    if not scored:
        return {"ppl": float("nan"), "ppl_tokens": float("nan"), "empty_samples": len(nlls)}
    total = sum(x.tokens for x in scored)
    return {"ppl": sum(x.ppl for x in scored) / len(scored),
            "ppl_tokens": math.exp(sum(x.nll_sum for x in scored) / total),
            "empty_samples": len(nlls) - len(scored)}
