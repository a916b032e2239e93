"""The language model as the lens tools see it: loading, the output embeddings, the final
hidden states (the input of the output head, where steers act), and log-likelihoods of a text
under several steer strengths from one pass through the model body.

Semantics of the steer: see :mod:`vllm_steer.reference` (applied through
:class:`vllm_steer.bank.SteerBank`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from vllm_steer.hf import logit_postprocess, output_head, tokenize_scored

#: A few plain sentences used when a tool needs the model's typical final hidden states
#: (orienting directions in ``explain``, calibrating strength in ``transfer``).
CALIBRATION_TEXTS = (
    "The weather was mild in the morning, and by noon the streets were full of people.",
    "She opened the letter, read it twice, and then put it back in the drawer.",
    "Our team will meet on Tuesday to discuss the budget for next year.",
    "The museum has a small collection of paintings from the nineteenth century.",
    "He said that the train would be late because of work on the line.",
    "After dinner we walked along the river and talked about the old days.",
    "The report describes how the new system handles requests from customers.",
    "I think the film was long, but the music and the acting were memorable.",
    "Add the flour slowly and stir until the mixture is smooth.",
    "The committee has not yet decided whether the project will continue.",
    "My brother moved to a small town near the coast last summer.",
    "Students are asked to return their books to the library by Friday.",
)


def load_lm(name_or_path: str, dtype=torch.float32):
    """Load a causal LM and its tokenizer (``smollm2`` = the embedded model) in eval mode."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from vllm_steer.models import resolve_model

    path = resolve_model(name_or_path)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    return model, tok


def output_embeddings(model) -> torch.Tensor:
    """The output embedding matrix ``E`` ([vocab, hidden]): logits are ``c @ E.T``."""
    return output_head(model).weight.detach()


@dataclass
class Encoded:
    """Final hidden states of one text and the tokens they predict."""

    hidden: torch.Tensor  # [n, hidden]: row i is the head input that predicts targets[i]
    targets: torch.Tensor  # [n] token ids


class _Captured(Exception):
    """Raised by the head's pre-hook to stop the forward once its input is captured."""


@torch.no_grad()
def final_hidden_states(model, tokenizer, texts: Sequence[str],
                        prefixes: Sequence[str] | None = None, batch_size: int = 8,
                        max_length: int | None = None, progress: bool = False,
                        max_text_tokens: int | None = None) -> list[Encoded]:
    """The input of the output head for each predicted token of each text.

    Tokenisation and alignment follow :func:`vllm_steer.hf.token_logprobs` exactly: the text
    is tokenised without special tokens; with a prefix, every text token is predicted,
    otherwise tokens ``1..n-1``. ``max_length`` cuts prefix and text together,
    ``max_text_tokens`` the text alone (see :func:`vllm_steer.hf.tokenize_scored`). A text
    with no token to predict (empty, or one token without a prefix) gets no rows. Texts are
    batched by length (less padding) and the forward stops at the head's input (no logits
    are computed here).
    """
    from tqdm.auto import tqdm

    head = output_head(model)
    device = head.weight.device
    captured: list[torch.Tensor] = []

    def grab(_m, args):
        captured.append(args[0].detach())
        raise _Captured

    toks = [tokenize_scored(tokenizer, t, prefixes[i] if prefixes is not None else None,
                            max_length, max_text_tokens) for i, t in enumerate(texts)]
    out: list[Encoded | None] = [None] * len(texts)
    for j, (ids, s) in enumerate(toks):
        if len(ids) <= s:  # no token to predict: no rows, and nothing to run
            out[j] = Encoded(torch.zeros(0, head.weight.shape[1]),
                             torch.zeros(0, dtype=torch.long))
    order = sorted((j for j in range(len(texts)) if out[j] is None),
                   key=lambda i: len(toks[i][0]))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    handle = head.register_forward_pre_hook(grab)
    try:
        batches = range(0, len(order), batch_size)
        for i in tqdm(batches, desc="encoding", disable=not progress, leave=False):
            idx = order[i:i + batch_size]
            T = max(len(toks[j][0]) for j in idx)
            inp = torch.full((len(idx), T), pad, dtype=torch.long)
            att = torch.zeros((len(idx), T), dtype=torch.long)
            for r, j in enumerate(idx):
                ids = toks[j][0]
                inp[r, :len(ids)] = torch.tensor(ids, dtype=torch.long)
                att[r, :len(ids)] = 1
            captured.clear()
            try:
                model(input_ids=inp.to(device), attention_mask=att.to(device))
            except _Captured:
                pass
            if not captured:
                raise RuntimeError(f"{type(model).__name__}: the output head was not called "
                                   "during the forward pass; cannot read final hidden states")
            h = captured[-1]
            for r, j in enumerate(idx):
                ids, s = toks[j]
                n = len(ids)
                out[j] = Encoded(h[r, s - 1:n - 1].float(),
                                 torch.tensor(ids[s:n], dtype=torch.long))
    finally:
        handle.remove()
    return out  # type: ignore[return-value]


@torch.no_grad()
def logprobs_at_strengths(model, encoded: Sequence[Encoded], steer,
                          strengths: Sequence[float]) -> torch.Tensor:
    """Mean token log-likelihood of each encoded text at each strength: ``[texts, strengths]``.

    The model body runs once (in :func:`final_hidden_states`); only the head is re-applied,
    which is exact because a steer acts on the head input alone. For a linear head
    (``logits = c E^T + b``) the steered logits are affine in the strength (semantics: see
    :mod:`vllm_steer.reference`)::

        logits(s) = logits(0) + s * eps * (c P1) (P2^T E^T) [+ domain term when s != 0]

    so two head-sized products serve every strength. Another head goes through
    :class:`~vllm_steer.bank.SteerBank` per strength. The model's processing of the head's
    output (soft-capping, logit scaling: :func:`logit_postprocess`) is applied after.
    """
    from vllm_steer.bank import SteerBank

    head = output_head(model)
    w = head.weight
    linear = isinstance(head, torch.nn.Linear)
    post = logit_postprocess(model)
    bank = SteerBank({steer.name: steer}, device=w.device, dtype=torch.float32)
    res = torch.zeros(len(encoded), len(strengths))
    Wf = w.float()
    factors = steer.to(device=w.device, dtype=torch.float32)
    eps = factors.metadata.epsilon
    z = (factors.p2.T @ Wf.T) if linear else None  # [rank, vocab]
    dom = (factors.metadata.domain == "with_steer" and factors.domain_p1 is not None)
    zd = (factors.domain_p2.T @ Wf.T) if (linear and dom) else None
    for t, enc in enumerate(encoded):
        if enc.hidden.shape[0] == 0:
            res[t] = float("nan")
            continue
        h = enc.hidden.to(w.device).float()
        tgt = enc.targets.to(w.device)
        if linear:
            base = h @ Wf.T
            if head.bias is not None:
                base = base + head.bias.float()
            unit = eps * ((h @ factors.p1) @ z)
            extra = (eps * factors.metadata.domain_strength * ((h @ factors.domain_p1) @ zd)
                     if dom else None)
        for k, s in enumerate(strengths):
            s = float(s)
            if linear:
                logits = base if s == 0 else base + s * unit
                if extra is not None and s != 0:
                    logits = logits + extra
            else:
                hs = bank.apply(h, bank.coefs({steer.name: s}, h.shape[0], device=w.device))
                logits = head(hs.to(w.dtype)).float()
            if post is not None:
                logits = post(logits)
            lp = logits.gather(-1, tgt[:, None])[:, 0] - torch.logsumexp(logits, -1)
            res[t, k] = lp.mean().cpu()
    return res
