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

from vllm_steer.hf import output_head

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


@torch.no_grad()
def final_hidden_states(model, tokenizer, texts: Sequence[str],
                        prefixes: Sequence[str] | None = None, batch_size: int = 8,
                        max_length: int | None = None, progress: bool = False) -> list[Encoded]:
    """The input of the output head for each predicted token of each text.

    Tokenisation and alignment follow :func:`vllm_steer.hf.token_logprobs` exactly: the text
    is tokenised without special tokens; with a prefix, every text token is predicted,
    otherwise tokens ``1..n-1``.
    """
    from tqdm.auto import tqdm

    head = output_head(model)
    device = head.weight.device
    captured: list[torch.Tensor] = []

    def grab(_m, args):
        captured.append(args[0].detach())

    handle = head.register_forward_pre_hook(grab)
    out: list[Encoded] = []
    try:
        starts_iter = range(0, len(texts), batch_size)
        for i in tqdm(starts_iter, desc="encoding", disable=not progress, leave=False):
            chunk = texts[i:i + batch_size]
            pre = prefixes[i:i + batch_size] if prefixes is not None else [None] * len(chunk)
            ids_list, starts = [], []
            for text, p in zip(chunk, pre):
                if p:
                    a = tokenizer(p, add_special_tokens=False)["input_ids"]
                    b = tokenizer(text, add_special_tokens=False)["input_ids"]
                    ids, start = a + b, len(a)
                else:
                    ids, start = tokenizer(text, add_special_tokens=False)["input_ids"], 1
                if max_length:
                    ids = ids[:max_length]
                ids_list.append(ids), starts.append(max(start, 1))
            T = max(len(x) for x in ids_list)
            pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
            inp = torch.full((len(ids_list), T), pad, dtype=torch.long)
            att = torch.zeros((len(ids_list), T), dtype=torch.long)
            for j, ids in enumerate(ids_list):
                inp[j, :len(ids)] = torch.tensor(ids, dtype=torch.long)
                att[j, :len(ids)] = 1
            captured.clear()
            model(input_ids=inp.to(device), attention_mask=att.to(device))
            h = captured[-1]
            for j, ids in enumerate(ids_list):
                s, n = starts[j], len(ids)
                out.append(Encoded(h[j, s - 1:n - 1].float(),
                                   torch.tensor(ids[s:n], dtype=torch.long)))
    finally:
        handle.remove()
    return out


@torch.no_grad()
def logprobs_at_strengths(model, encoded: Sequence[Encoded], steer,
                          strengths: Sequence[float]) -> torch.Tensor:
    """Mean token log-likelihood of each encoded text at each strength: ``[texts, strengths]``.

    The model body runs once (in :func:`final_hidden_states`); only the head is re-applied per
    strength, which is exact because a steer acts on the head input alone. (A model whose
    logits are post-processed outside its head, e.g. soft-capping, would need
    :func:`vllm_steer.hf.token_logprobs` instead.)
    """
    from vllm_steer.bank import SteerBank

    head = output_head(model)
    w = head.weight
    bank = SteerBank({steer.name: steer}, device=w.device, dtype=torch.float32)
    res = torch.zeros(len(encoded), len(strengths))
    for t, enc in enumerate(encoded):
        if enc.hidden.shape[0] == 0:
            res[t] = float("nan")
            continue
        h = enc.hidden.to(w.device)
        tgt = enc.targets.to(w.device)
        for k, s in enumerate(strengths):
            hs = bank.apply(h, bank.coefs({steer.name: float(s)}, h.shape[0], device=w.device))
            logits = head(hs.to(w.dtype)).float()
            lp = logits.gather(-1, tgt[:, None])[:, 0] - torch.logsumexp(logits, -1)
            res[t, k] = lp.mean().cpu()
    return res
