"""The baseline: a *soft blacklist*, a learned offset on the logits.

Definition. A soft blacklist is one vector ``b`` over the vocabulary. At strength ``s``
(units of ``epsilon``, like a steer) the logits become::

    logits'(s) = logits + s * epsilon * b                 (every position, every context)

so it raises or lowers each token's log-odds by a fixed amount whatever the context: a
continuous, learned version of a word blacklist. It is the LM-Steer formula with the
context-dependent ``W c`` replaced by a context-free ``b`` (``c' = c + eps W c`` moves the
logits by ``eps (W c)^T E``, which depends on ``c``; the blacklist moves them by ``eps b``),
so comparing the two at equal perplexity shows what the steer's dependence on the context
adds.

Training (same data, same objective as the steer; see :mod:`vllm_steer.train`): maximum
likelihood of the positive texts under ``logits + eps b + eps d`` and of the negative texts
under ``logits - eps b + eps d``, where ``d`` is a domain offset (the counterpart of the
steer's domain steer, trained alongside and *not* applied when generating). Adam on
``eps b`` and ``eps d`` (logit units), initialised at zero, on the cached final hidden states
of the frozen model (:func:`vllm_steer.train.trainer.hidden_states`); each step costs one
head matmul and no backward through it (the gradient of a logit offset is
``softmax - onehot``).

File: safetensors, tensors ``soft_blacklist.bias`` ``[vocab]`` (``b``) and optionally
``soft_blacklist.domain`` ``[vocab]`` (``d``), JSON metadata under ``vllm_steer_soft_blacklist``
(name, vocab size, epsilon, base model, labels, recipe, data, metrics).

In vLLM it is applied by the V1 logits processor
:class:`vllm_steer.eval.logits_processor.SoftBlacklistLogitsProcessor`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn.functional as F

FORMAT_NAME = "vllm-steer-soft-blacklist"
METADATA_KEY = "vllm_steer_soft_blacklist"
TENSOR_BIAS = "soft_blacklist.bias"
TENSOR_DOMAIN = "soft_blacklist.domain"


@dataclass
class SoftBlacklist:
    """A soft blacklist: ``bias`` ``[vocab]`` (``b``), optional ``domain`` ``[vocab]``."""

    bias: torch.Tensor
    name: str
    epsilon: float = 1e-3
    domain: torch.Tensor | None = None
    base_model: str | None = None
    labels: dict[str, str] = field(default_factory=dict)
    recipe: dict[str, Any] = field(default_factory=dict)
    data: dict[str, Any] = field(default_factory=dict)
    metrics: dict[str, Any] = field(default_factory=dict)

    @property
    def vocab_size(self) -> int:
        return int(self.bias.shape[0])

    def offset(self, strength: float) -> torch.Tensor:
        """``strength * epsilon * b``: what is added to the logits."""
        return self.bias.float() * (float(strength) * self.epsilon)

    def apply(self, logits: torch.Tensor, strength: float) -> torch.Tensor:
        """``logits + strength * epsilon * b`` (logits ``[..., vocab]``)."""
        if logits.shape[-1] != self.vocab_size:
            raise ValueError(f"logits have {logits.shape[-1]} columns but the soft blacklist "
                             f"{self.name!r} covers {self.vocab_size} tokens")
        return logits + self.offset(strength).to(logits.device, logits.dtype)

    def metadata(self) -> dict[str, Any]:
        return {"format": FORMAT_NAME, "format_version": 1, "name": self.name,
                "vocab_size": self.vocab_size, "epsilon": self.epsilon,
                "base_model": self.base_model, "labels": self.labels, "recipe": self.recipe,
                "data": self.data, "metrics": self.metrics}


def save_soft_blacklist(path: str, sb: SoftBlacklist) -> None:
    from safetensors.torch import save_file

    tensors = {TENSOR_BIAS: sb.bias.detach().float().cpu().contiguous()}
    if sb.domain is not None:
        tensors[TENSOR_DOMAIN] = sb.domain.detach().float().cpu().contiguous()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    save_file(tensors, tmp, metadata={METADATA_KEY: json.dumps(sb.metadata(), sort_keys=True),
                                      "format": "pt"})
    os.replace(tmp, path)


def load_soft_blacklist(path: str) -> SoftBlacklist:
    """Read a soft-blacklist file (safetensors only); errors name the file and the problem."""
    from safetensors import SafetensorError, safe_open

    if not os.path.exists(path):
        raise FileNotFoundError(f"soft blacklist {path!r}: no such file")
    try:
        with safe_open(path, framework="pt") as f:
            meta_raw = (f.metadata() or {}).get(METADATA_KEY)
            keys = set(f.keys())
            if meta_raw is None or TENSOR_BIAS not in keys:
                raise ValueError(f"{path!r} is not a soft-blacklist file (no {METADATA_KEY!r} "
                                 f"metadata or no {TENSOR_BIAS!r} tensor; tensors: "
                                 f"{sorted(keys)}); a steer file is used with --steer")
            bias = f.get_tensor(TENSOR_BIAS).float()
            domain = f.get_tensor(TENSOR_DOMAIN).float() if TENSOR_DOMAIN in keys else None
    except SafetensorError as e:
        raise ValueError(f"soft blacklist {path!r}: not a safetensors file ({e})") from None
    meta = json.loads(meta_raw)
    if bias.dim() != 1:
        raise ValueError(f"soft blacklist {path!r}: bias has shape {tuple(bias.shape)}, "
                         "expected [vocab]")
    if not torch.isfinite(bias).all():
        raise ValueError(f"soft blacklist {path!r}: bias holds NaN or inf values")
    return SoftBlacklist(bias, meta.get("name", "soft_blacklist"),
                         float(meta.get("epsilon", 1e-3)), domain, meta.get("base_model"),
                         meta.get("labels", {}), meta.get("recipe", {}), meta.get("data", {}),
                         meta.get("metrics", {}))


# -------------------------------------------------------------------------------- training

@dataclass
class SoftBlacklistConfig:
    """Recipe of the soft-blacklist trainer (recorded in the file)."""

    model: str = "smollm2"
    """Base model (HF folder or id, or ``smollm2``)."""
    epsilon: float = 1e-3
    """Unit of strength: strength ``s`` adds ``s * epsilon * b`` to the logits."""
    lr: float = 3e-2
    """Adam learning rate on ``epsilon * b`` (logit units)."""
    steps: int = 200
    """Optimiser steps (one batch each)."""
    batch_size: int = 32
    """Texts per step."""
    max_length: int = 64
    """Tokens kept per text (longer texts are truncated)."""
    domain: bool = True
    """Train a domain offset ``d`` alongside (absorbs what both sides share; not applied
    when generating)."""
    seed: int = 0
    """Seed of the data split/subset and the batch order."""
    device: str = "auto"
    """``auto``, ``cpu``, ``cuda``, ..."""
    model_dtype: str = "auto"
    """dtype of the frozen model computing the hidden states (``auto``: bf16 where fast)."""
    cache_dtype: str = "bfloat16"
    """dtype the hidden states are kept in."""
    head_dtype: str = "auto"
    """dtype of the head matmul of each step (``auto``: bf16 where fast)."""
    chunk_tokens: int = 1024
    """Rows per head chunk (bounds the memory of the ``[rows, vocab]`` logits)."""
    check_strengths: tuple[float, ...] = (1.0, 5.0)
    """Strengths at which the final report measures dev losses per side."""

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["check_strengths"] = list(self.check_strengths)
        return d

    def validate(self) -> None:
        problems = []
        for k in ("steps", "batch_size", "max_length", "chunk_tokens"):
            v = getattr(self, k)
            if not isinstance(v, int) or v < 1:
                problems.append(f"{k}={v!r}: must be a positive integer")
        for k in ("epsilon", "lr"):
            v = getattr(self, k)
            if not (isinstance(v, (int, float)) and v > 0):
                problems.append(f"{k}={v!r}: must be a positive number")
        if problems:
            raise ValueError("invalid soft-blacklist recipe:\n" +
                             "\n".join(f"  - {p}" for p in problems))


def offset_loss(head, c: torch.Tensor, targets: torch.Tensor, signs: torch.Tensor,
                style: torch.Tensor, domain: torch.Tensor | None, *,
                head_dtype: torch.dtype = torch.float32, chunk_tokens: int = 1024,
                backward: bool = True) -> float:
    """Token-mean cross-entropy of ``head(c) + signs * style + domain`` (``style`` and
    ``domain`` in logit units); accumulates gradients into them when ``backward``."""
    n = int(targets.shape[0])
    total = 0.0
    for a in range(0, n, chunk_tokens):
        with torch.no_grad():
            logits = head.logits(c[a:a + chunk_tokens], head_dtype)
        z = logits + signs[a:a + chunk_tokens, None] * style
        if domain is not None:
            z = z + domain
        loss = F.cross_entropy(z, targets[a:a + chunk_tokens], reduction="sum") / n
        if backward:
            loss.backward()
        total += float(loss.detach())
    return total


def _mean_loss(head, hs, idx, style, domain, strength, **kw) -> float:
    tot, n = 0.0, 0
    for a in range(0, len(idx), 64):
        c, t, s = hs.batch(idx[a:a + 64], style.device)
        s = torch.full_like(s, float(strength)) if strength is not None else s
        with torch.no_grad():
            loss = offset_loss(head, c, t, s, style, domain, backward=False, **kw)
        tot += loss * len(t)
        n += len(t)
    return tot / max(n, 1)


def train_soft_blacklist(cfg: SoftBlacklistConfig, data, out: str | None = None, *,
                         name: str = "soft_blacklist", labels: dict[str, str] | None = None,
                         cache_dir: str | None = None, progress: bool = True,
                         log: Callable[[str], None] | None = None) -> SoftBlacklist:
    """Train a soft blacklist on ``data`` (a :class:`~vllm_steer.train.config.DataConfig` or
    a loaded :class:`~vllm_steer.train.data.Dataset`); write it to ``out`` if given.
    ``cache_dir`` keeps the hidden states (reused by a later run on the same data)."""
    from tqdm.auto import tqdm

    from vllm_steer.train.config import DataConfig, TrainConfig
    from vllm_steer.train.module import Head, dtype_name
    from vllm_steer.train.trainer import BatchSchedule, hidden_states, prepare

    log = log or (lambda m: print(m, file=sys.stderr, flush=True))
    cfg.validate()
    t0 = time.perf_counter()
    tcfg = TrainConfig(model=cfg.model, max_length=cfg.max_length, seed=cfg.seed,
                       device=cfg.device, model_dtype=cfg.model_dtype,
                       cache_dtype=cfg.cache_dtype, head_dtype=cfg.head_dtype,
                       batch_size=cfg.batch_size, steps=cfg.steps)
    prep = prepare(tcfg, data, log)
    train_hs = hidden_states(prep, "train", cache_dir, progress, log)
    dev_hs = hidden_states(prep, "dev", cache_dir, progress, log) if prep.dev_ids else None
    t_h = time.perf_counter() - t0
    head = Head(prep.model)
    V = head.vocab_size
    style = torch.zeros(V, device=prep.device, requires_grad=True)
    domain = torch.zeros(V, device=prep.device, requires_grad=True) if cfg.domain else None
    opt = torch.optim.Adam([style] + ([domain] if domain is not None else []), lr=cfg.lr)
    kw = dict(head_dtype=prep.head_dtype, chunk_tokens=cfg.chunk_tokens)
    history: list[dict[str, float]] = []
    sched = BatchSchedule(train_hs.num_texts, cfg.batch_size, cfg.seed)
    t1 = time.perf_counter()
    bar = tqdm(range(cfg.steps), desc=f"train soft blacklist {name}", disable=not progress)
    window: list[float] = []
    for step in bar:
        c, t, s = train_hs.batch(sched.indices(step), prep.device)
        opt.zero_grad(set_to_none=True)
        window.append(offset_loss(head, c, t, s, style, domain, **kw))
        opt.step()
        bar.set_postfix(loss=f"{sum(window[-20:]) / len(window[-20:]):.4f}")
        if (step + 1) % max(1, cfg.steps // 10) == 0 or step + 1 == cfg.steps:
            history.append({"step": step + 1, "train_loss": sum(window) / len(window)})
            window = []
    bar.close()
    t_train = time.perf_counter() - t1
    metrics: dict[str, Any] = {"history": history, "train_tokens": train_hs.num_targets,
                               "train_texts": train_hs.num_texts}
    if dev_hs is not None:
        zero = torch.zeros_like(style)
        metrics["dev_loss_initial"] = _mean_loss(head, dev_hs, torch.arange(dev_hs.num_texts),
                                                 zero, None, None, **kw)
        metrics["dev_loss"] = _mean_loss(head, dev_hs, torch.arange(dev_hs.num_texts),
                                         style.detach(), None if domain is None
                                         else domain.detach(), None, **kw)
        check: dict[str, dict[str, float]] = {}
        for side_name, side in (("positive", 1), ("negative", -1)):
            idx = torch.nonzero(dev_hs.sides == side).flatten()
            if len(idx):
                row = {"0": _mean_loss(head, dev_hs, idx, style.detach(), None, 0.0, **kw)}
                for v in cfg.check_strengths:
                    for x in (v, -v):
                        row[f"{x:+g}"] = _mean_loss(head, dev_hs, idx, style.detach(), None,
                                                    x, **kw)
                check[side_name] = row
        metrics["dev_check"] = check
    metrics["wall_s"] = {"hidden_states": round(t_h, 2), "train": round(t_train, 2),
                         "total": round(time.perf_counter() - t0, 2)}
    metrics["resolved_dtypes"] = {"model": dtype_name(prep.model_dtype),
                                  "head": dtype_name(prep.head_dtype)}
    data_desc = (prep.dataset.describe(data) if isinstance(data, DataConfig)
                 else {"sha256": prep.dataset.sha256, "counts": prep.dataset.counts()})
    sb = SoftBlacklist(style.detach().cpu() / cfg.epsilon, name, cfg.epsilon,
                       None if domain is None else domain.detach().cpu() / cfg.epsilon,
                       base_model=cfg.model if cfg.model == "smollm2" else prep.model_path,
                       labels=dict(labels or {}), recipe=cfg.to_dict(), data=data_desc,
                       metrics=metrics)
    if out:
        save_soft_blacklist(out, sb)
        log(f"[soft-blacklist] wrote {out}")
    return sb


def recipe_key(cfg: SoftBlacklistConfig, data_cfg, model_path: str) -> str:
    """A short hash naming a trained baseline in the cache (model, data, recipe)."""
    from vllm_steer.train.data import file_sha256

    d = data_cfg.to_dict()
    files = [p for k in ("positive", "negative", "labelled", "dev_positive", "dev_negative",
                         "dev_labelled") for p in d.get(k, [])]
    doc = {"recipe": cfg.to_dict(), "data": d, "model": model_path,
           "sha": [file_sha256(p) for p in files if os.path.exists(p)]}
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:16]


def hidden_cache_dir(cfg: SoftBlacklistConfig, data_cfg, model_path: str) -> str:
    """Where a baseline's hidden states are cached: keyed by what they depend on (model, data,
    max length, dtypes), not by the steps or learning rate, so baselines of the same data
    trained for different steps share one hidden-state pass."""
    import dataclasses

    from vllm_steer.models import cache_dir

    only = dataclasses.replace(SoftBlacklistConfig(), model=cfg.model, max_length=cfg.max_length,
                               model_dtype=cfg.model_dtype, cache_dtype=cfg.cache_dtype)
    return str(cache_dir() / "eval" / "baselines" /
               f"hidden-{recipe_key(only, data_cfg, model_path)}")


def describe(sb: SoftBlacklist, k: int = 12, tokenizer=None) -> dict[str, Any]:
    """The tokens the blacklist raises and lowers most (for reports)."""
    top = torch.topk(sb.bias, k).indices.tolist()
    bot = torch.topk(-sb.bias, k).indices.tolist()
    if tokenizer is not None:  # as each token reads in a text, its word-start space kept
        from vllm_steer.lens.explain import pieces_of

        raised, lowered = pieces_of(tokenizer, top), pieces_of(tokenizer, bot)
    else:
        raised, lowered = [str(i) for i in top], [str(i) for i in bot]
    return {"raised": raised, "lowered": lowered,
            "max_abs_offset_at_1": float(sb.bias.abs().max() * sb.epsilon),
            "rms_offset_at_1": float(math.sqrt(float((sb.bias.float() ** 2).mean()))
                                     * sb.epsilon)}
