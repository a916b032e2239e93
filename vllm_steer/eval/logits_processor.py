"""The soft blacklist in vLLM: a V1 custom logits processor (the baseline of the evaluation).

Semantics: see :mod:`vllm_steer.eval.soft_blacklist` (``logits + s * eps * b``).

    LLM(model, logits_processors=[FQCN],
        additional_config={CONFIG_KEY: {"soft_blacklists": {"bl": "bl.safetensors"}}})
    SamplingParams(extra_args={"soft_blacklist": {"bl": 5}})

The files are loaded once per worker; each batch slot keeps its coefficients (a row of
``[max_num_seqs, K]``); ``apply`` adds ``coefs[:batch] @ (eps * B)`` to the logits, and does
nothing while no request in the batch uses a blacklist. It composes with the steer plugin
(the steer acts in the LM head, this after it).
"""

from __future__ import annotations

import math

import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality
from vllm_steer.logs import get_logger

FQCN = "vllm_steer.eval.logits_processor:SoftBlacklistLogitsProcessor"
CONFIG_KEY = "vllm_steer_soft_blacklist"
REQUEST_KEY = "soft_blacklist"

logger = get_logger()


def engine_config(blacklists: dict[str, str]) -> dict:
    """The ``additional_config`` entry loading ``blacklists`` (name -> file)."""
    return {CONFIG_KEY: {"soft_blacklists": dict(blacklists)}}


def request_strengths(extra_args: dict | None) -> dict[str, float]:
    """Parse ``extra_args["soft_blacklist"]`` (``{name: strength}``); raises ValueError."""
    value = (extra_args or {}).get(REQUEST_KEY)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ValueError(f"extra_args[{REQUEST_KEY!r}]: expected {{name: strength}}, got "
                         f"{type(value).__name__}")
    out = {}
    for k, v in value.items():
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise ValueError(f"extra_args[{REQUEST_KEY!r}][{k!r}]: strength must be a finite "
                             f"number, got {v!r}")
        if v:
            out[str(k)] = float(v)
    return out


class SoftBlacklistLogitsProcessor(LogitsProcessor):
    """Adds ``sum_k s_k * eps_k * b_k`` to each request's logits."""

    @classmethod
    def validate_params(cls, sampling_params) -> None:
        request_strengths(getattr(sampling_params, "extra_args", None))

    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool) -> None:
        from vllm_steer.eval.soft_blacklist import load_soft_blacklist

        cfg = ((vllm_config.additional_config or {}).get(CONFIG_KEY) or {})
        paths = dict(cfg.get("soft_blacklists") or {})
        self.names = list(paths)
        self.index = {n: i for i, n in enumerate(self.names)}
        rows = []
        for _name, path in paths.items():
            sb = load_soft_blacklist(path)
            rows.append(sb.bias.float() * sb.epsilon)
        self.offsets = (torch.stack(rows).to(device) if rows
                        else torch.zeros(0, 1, device=device))  # [K, vocab], eps * b
        n = vllm_config.scheduler_config.max_num_seqs
        self.coefs = torch.zeros(n, max(len(rows), 1), device=device)
        self.slots: set[int] = set()  # slots with a non-zero coefficient
        self.batch_size = 0

    def is_argmax_invariant(self) -> bool:
        return False

    def _row(self, params) -> torch.Tensor | None:
        try:
            strengths = request_strengths(getattr(params, "extra_args", None))
        except ValueError as e:  # validated at admission; never crash the engine here
            logger.warning("vllm-steer soft blacklist: %s; ignored", e)
            return None
        if not strengths:
            return None
        row = torch.zeros(self.coefs.shape[1])
        for name, s in strengths.items():
            if name not in self.index:
                logger.warning("vllm-steer soft blacklist: unknown name %r (loaded: %s); "
                               "ignored", name, self.names)
                continue
            row[self.index[name]] = s
        return row if bool(row.any()) else None

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        for slot in batch_update.removed:
            if slot in self.slots:
                self.coefs[slot].zero_()
                self.slots.discard(slot)
        for slot, params, _prompt, _out in batch_update.added:
            row = self._row(params)
            if row is None:
                if slot in self.slots:
                    self.coefs[slot].zero_()
                    self.slots.discard(slot)
            else:
                self.coefs[slot] = row.to(self.coefs.device)
                self.slots.add(slot)
        for a, b, direction in batch_update.moved:
            if direction == MoveDirectionality.SWAP:
                self.coefs[[a, b]] = self.coefs[[b, a]]
                in_a, in_b = a in self.slots, b in self.slots
                self.slots.discard(a), self.slots.discard(b)
                if in_a:
                    self.slots.add(b)
                if in_b:
                    self.slots.add(a)
            else:  # a -> b, a becomes empty
                self.coefs[b] = self.coefs[a]
                self.coefs[a].zero_()
                if a in self.slots:
                    self.slots.discard(a)
                    self.slots.add(b)
                else:
                    self.slots.discard(b)
        self.batch_size = batch_update.batch_size

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.slots or not self.names:
            return logits
        n, v = logits.shape
        k = self.offsets.shape[1]
        add = self.coefs[:n] @ self.offsets  # [n, vocab_b]
        if k == v:
            return logits + add.to(logits.dtype)
        if k > v:
            raise ValueError(f"soft blacklist covers {k} tokens but the logits have {v} columns")
        logits[:, :k] += add.to(logits.dtype)  # padded vocabulary: extra columns untouched
        return logits
