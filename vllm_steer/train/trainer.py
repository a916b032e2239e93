"""Offline steer training: hidden states once, then Adam steps that cost only the head.

    result = train_steer(TrainConfig(model="smollm2", rank=64, steps=300),
                         preset_data_config("detox"), out="detox.safetensors")

Semantics: see :mod:`vllm_steer.reference` (via :mod:`vllm_steer.train.module`). The batch
order is a pure function of (seed, step), so a run resumed from a checkpoint gives the same
steer as an uninterrupted one.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from vllm_steer.format import Steer, save_steer
from vllm_steer.names import check_steer_name, safe_steer_name
from vllm_steer.train.config import DataConfig, TrainConfig
from vllm_steer.train.data import PRESETS, Dataset, load_dataset
from vllm_steer.train.hidden import (CHAT_USER_TURN, HiddenStates, cache_key, compute_hidden,
                                     final_hidden, model_window, tokenize, tokenize_chat)
from vllm_steer.train.module import (LMSteer, dtype_name, load_model, resolve_device,
                                     resolve_dtype)

CHECKPOINT_NAME = "state.pt"
CHECKPOINT_FORMAT = "vllm-steer-train-checkpoint"
#: Recipe fields that may differ between a checkpoint and the resumed run.
RESUMABLE_CHANGES = {"steps", "eval_every", "checkpoint_every", "device", "chunk_tokens",
                     "cache_batch_tokens", "final_eval_max_texts", "check_strengths",
                     "fluency_budget"}


class BatchSchedule:
    """Step -> text indices: a seeded permutation per epoch, cut in batches."""

    def __init__(self, n: int, batch_size: int, seed: int):
        self.n, self.bs, self.seed = n, min(batch_size, n), seed
        self.per_epoch = math.ceil(n / self.bs)
        self._perm: tuple[int, torch.Tensor] | None = None

    def indices(self, step: int) -> torch.Tensor:
        epoch, k = divmod(step, self.per_epoch)
        if self._perm is None or self._perm[0] != epoch:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perm = (epoch, torch.randperm(self.n, generator=g))
        return self._perm[1][k * self.bs:(k + 1) * self.bs]


def pad_batch(ids_list, pad_id: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ``(input_ids, attention_mask)`` for the full-model path."""
    T = max(len(x) for x in ids_list)
    inp = torch.full((len(ids_list), T), pad_id, dtype=torch.long)
    att = torch.zeros((len(ids_list), T), dtype=torch.long)
    for j, x in enumerate(ids_list):
        inp[j, :len(x)] = torch.as_tensor(x)
        att[j, :len(x)] = 1
    return inp.to(device), att.to(device)


#: Recipe fields that :func:`prepare` depends on (a shared ``PreparedRun`` must agree on them).
PREPARE_FIELDS = ("model", "max_length", "seed", "device", "model_dtype", "cache_dtype",
                  "head_dtype", "chat_template")


@dataclass
class PreparedRun:
    """Everything a training run needs, loaded once (also used by tests and benchmarks)."""

    cfg: TrainConfig
    device: torch.device
    model: Any
    tokenizer: Any
    model_path: str
    dataset: Dataset
    train_ids: list[list[int]]
    dev_ids: list[list[int]]
    train_sides: list[int]
    dev_sides: list[int]
    reports: dict[str, Any]
    head_dtype: torch.dtype
    model_dtype: torch.dtype
    cache_dtype: torch.dtype
    train_starts: list[int] | None = None
    """Per train text, its first target token (``--chat-template``: the reply's first
    token); ``None``: token 1 of every text."""
    dev_starts: list[int] | None = None
    """The same for the dev texts."""


def prepare(cfg: TrainConfig, data: DataConfig | Dataset, log: Callable[[str], None] = print
            ) -> PreparedRun:
    """Validate, load the model and the data, tokenize (truncation counted)."""
    cfg.validate()
    device = resolve_device(cfg.device)
    model_dtype = resolve_dtype(cfg.model_dtype, device, "model_dtype")
    cache_dtype = resolve_dtype(cfg.cache_dtype, device, "cache_dtype")
    head_dtype = resolve_dtype(cfg.head_dtype, device, "head_dtype")
    dataset = data if isinstance(data, Dataset) else load_dataset(data, cfg.seed)
    model, tok, path = load_model(cfg.model, device, model_dtype)
    window = model_window(model)
    reports = {}
    out, starts = {}, {}
    chat = getattr(cfg, "chat_template", False)
    for split, xs in (("train", dataset.train), ("dev", dataset.dev)):
        if chat:
            ids, starts[split], kept, rep = tokenize_chat(
                tok, [e.text for e in xs], cfg.max_length, window, [e.where for e in xs])
        else:
            ids, kept, rep = tokenize(tok, [e.text for e in xs], cfg.max_length, window,
                                      [e.where for e in xs])
            starts[split] = None
        out[split] = (ids, [xs[i].side for i in kept])
        reports[split] = rep.to_dict()
        if rep.truncated:
            log(f"[train] {split}: {rep.truncated} of {rep.texts} texts longer than "
                f"--max-length {cfg.max_length} tokens were truncated (longest "
                f"{rep.max_tokens_seen} tokens; e.g. {', '.join(rep.examples_truncated)})")
        if rep.too_short:
            log(f"[train] {split}: {rep.too_short} texts of fewer than 2 tokens dropped")
    sides = out["train"][1]
    if not (any(s > 0 for s in sides) and any(s < 0 for s in sides)):
        raise ValueError("after tokenization the training set lacks one side entirely")
    return PreparedRun(cfg, device, model, tok, path, dataset, out["train"][0], out["dev"][0],
                    out["train"][1], out["dev"][1], reports, head_dtype, model_dtype,
                    cache_dtype, starts["train"], starts["dev"])


def check_head(prep: PreparedRun, lm: LMSteer) -> float:
    """Max |logit| difference between the model and head(final hidden state) on one text;
    raises if the model computes its logits in a way the trainer does not reproduce."""
    ids = torch.tensor([prep.train_ids[0][:32]], device=prep.device)
    att = torch.ones_like(ids)
    with torch.no_grad():
        ref = prep.model(input_ids=ids, attention_mask=att).logits[0].float()
        c = final_hidden(prep.model, ids, att)[0]
        ours = lm.head.logits(c, c.dtype)
    err = float((ref - ours).abs().max())
    scale = float(ref.abs().max()) + 1e-6
    if err > 1e-2 * scale + 1e-3:
        raise RuntimeError(f"{type(prep.model).__name__}: its logits differ from "
                           f"head(final hidden state) by up to {err:.3g} (logits up to {scale:.3g})"
                           "; the model post-processes logits in a way the trainer does not "
                           "reproduce")
    return err


def used_texts(sched: "BatchSchedule", steps: int) -> torch.Tensor:
    """The (sorted) indices of the training texts that steps ``0 .. steps-1`` draw: the only
    ones whose hidden states a run needs (``--steps 20`` of batch 32 reads 640 texts, not the
    whole file)."""
    seen = torch.zeros(sched.n, dtype=torch.bool)
    if steps >= sched.per_epoch:  # a whole epoch reads every text
        seen[:] = True
    for step in range(min(steps, sched.per_epoch)):
        seen[sched.indices(step)] = True
    return torch.nonzero(seen).flatten()


def local_index(hs: HiddenStates, n_split: int) -> torch.Tensor:
    """Split index -> row of ``hs``'s texts (-1 where the text is not stored)."""
    pos = torch.full((n_split,), -1, dtype=torch.long)
    pos[hs.text_indices()] = torch.arange(hs.num_texts)
    return pos


def hidden_cache_name(split: str) -> str:
    """The file of a split's cached hidden states in the checkpoint folder."""
    return f"hidden-{split}.safetensors"


def hidden_states(prep: PreparedRun, split: str, ckpt_dir: str | None, progress: bool,
                  log: Callable[[str], None] = print, needed: torch.Tensor | None = None
                  ) -> HiddenStates:
    """The split's hidden states of the texts ``needed`` (indices into the split; default
    all). Only texts not already in ``ckpt_dir``'s cache for this exact model, split and
    recipe are computed; the cache then holds the union (so a resumed or longer run reuses
    what a shorter one computed). The result may hold more texts than ``needed``: map split
    indices with :func:`local_index`."""
    ids = prep.train_ids if split == "train" else prep.dev_ids
    sides = prep.train_sides if split == "train" else prep.dev_sides
    starts = prep.train_starts if split == "train" else prep.dev_starts
    texts = ["\x02".join(map(str, x)) for x in ids]
    if starts is not None:  # the first target is part of what a cached text is
        texts = [f"{t}\x03{a}" for t, a in zip(texts, starts, strict=True)]
    key = cache_key(prep.model_path, prep.model, texts, sides, prep.cfg.max_length,
                    prep.model_dtype, prep.cache_dtype)
    path = os.path.join(ckpt_dir, hidden_cache_name(split)) if ckpt_dir else None
    want = torch.arange(len(ids)) if needed is None else torch.as_tensor(needed).long()
    hs = HiddenStates.load(path, key) if path else None
    have = torch.zeros(len(ids), dtype=torch.bool)
    if hs is not None:
        have[hs.text_indices()] = True
    missing = want[~have[want]]
    if hs is not None and len(missing) == 0:
        log(f"[train] {split}: reusing the hidden states in {path}")
        return hs
    if hs is not None:
        log(f"[train] {split}: reusing the hidden states of {hs.num_texts} texts in {path}; "
            f"{len(missing)} more to compute")
    if len(missing) < len(ids):
        log(f"[train] {split}: computing the hidden states of the {len(missing)} of "
            f"{len(ids)} texts this run uses")
    sub = missing.tolist()
    new = compute_hidden(prep.model, prep.tokenizer, [ids[i] for i in sub],
                         [sides[i] for i in sub], cache_dtype=prep.cache_dtype,
                         batch_tokens=prep.cfg.cache_batch_tokens, progress=progress,
                         desc=f"{split} hidden states",
                         starts=None if starts is None else [starts[i] for i in sub])
    new.texts = missing.clone()
    hs = new if hs is None else HiddenStates.concat(hs, new)
    if path:
        os.makedirs(ckpt_dir, exist_ok=True)
        hs.save(path, key)
    return hs


def domain_mask(hs: HiddenStates, idx: torch.Tensor, cfg: TrainConfig, step: int, device
                ) -> "float | torch.Tensor":
    """Per-row domain coefficient of a step: 1, or 0 for the texts that ``domain_dropout``
    drops (a function of seed and step, so resuming repeats it)."""
    if cfg.domain_dropout <= 0:
        return 1.0
    g = torch.Generator().manual_seed(cfg.seed * 7_919 + step + 1)
    keep = (torch.rand(len(idx), generator=g) >= cfg.domain_dropout).float()
    return torch.repeat_interleave(keep, hs.targets_per_text()[idx]).to(device)


def strength_scale(hs: HiddenStates, idx: torch.Tensor, cfg: TrainConfig, step: int, device
                   ) -> "torch.Tensor | None":
    """Per-row strength magnitude of a step under ``cfg.train_strengths``: one draw per text
    (uniform over the list; a function of seed and step, so resuming repeats it), or
    ``None`` for the paper's single magnitude 1."""
    if tuple(cfg.train_strengths) == (1.0,):
        return None
    mags = torch.tensor([float(m) for m in cfg.train_strengths])
    g = torch.Generator().manual_seed(cfg.seed * 15_485_863 + step + 3)
    per_text = mags[torch.randint(len(mags), (len(idx),), generator=g)]
    return torch.repeat_interleave(per_text, hs.targets_per_text()[idx]).to(device)


def token_sample(n: int, cfg: TrainConfig, step: int) -> torch.Tensor | None:
    """Rows of a step's batch kept under ``cfg.step_tokens`` (sorted; a function of seed and
    step, so resuming repeats it), or ``None`` for all ``n``."""
    if cfg.step_tokens is None or n <= cfg.step_tokens:
        return None
    g = torch.Generator().manual_seed(cfg.seed * 104_729 + step + 7)
    return torch.randperm(n, generator=g)[:cfg.step_tokens].sort().values


def mean_loss(lm: LMSteer, hs: HiddenStates, text_idx=None, *, strength: float | None = None,
              domain: float = 1.0, head_dtype=torch.float32, chunk_tokens: int = 1024,
              device=None, batch_texts: int = 64) -> float:
    """Token-mean loss over texts ``text_idx`` (default all). ``strength=None``: the training
    objective (style sign = the text's side, domain on); a number: that style strength (units
    of epsilon) on every text, with ``domain`` times the domain steer."""
    idx = torch.arange(hs.num_texts) if text_idx is None else torch.as_tensor(text_idx)
    tot, n = 0.0, 0
    for a in range(0, len(idx), batch_texts):
        c, t, s = hs.batch(idx[a:a + batch_texts], device)
        if strength is not None:
            s = torch.full_like(s, float(strength))
        loss = lm.loss_backward(c, t, s, head_dtype=head_dtype, chunk_tokens=chunk_tokens,
                                domain=domain, backward=False)
        tot += loss * len(t)
        n += len(t)
    return tot / max(n, 1)


def steer_check(lm: LMSteer, hs: HiddenStates, strengths, *, head_dtype=torch.float32,
                chunk_tokens: int = 1024, device=None, batch_texts: int = 64) -> dict[str, Any]:
    """Dev losses per side at strengths 0, +-s (no domain, as served): a working steer lowers
    the positive side's loss at +s and the negative side's at -s. All strengths from the
    same two head GEMMs per chunk (:meth:`LMSteer.strength_nll`)."""
    out: dict[str, Any] = {}
    keys = ["0"] + [f"{v:+g}" for s in strengths for v in (s, -s)]
    values = [0.0] + [float(v) for s in strengths for v in (s, -s)]
    for side_name, side in (("positive", 1), ("negative", -1)):
        idx = torch.nonzero(hs.sides == side).flatten()
        if len(idx) == 0:
            continue
        tot, n = [0.0] * len(values), 0
        for a in range(0, len(idx), batch_texts):
            c, t, _ = hs.batch(idx[a:a + batch_texts], device)
            part = lm.strength_nll(c, t, values, head_dtype=head_dtype,
                                   chunk_tokens=min(chunk_tokens, 512))
            tot = [x + y for x, y in zip(tot, part, strict=True)]
            n += len(t)
        out[side_name] = {k: v / max(n, 1) for k, v in zip(keys, tot, strict=True)}
    return out


def recommend_strength(check: dict[str, Any], strengths, budget: float
                       ) -> tuple[float | None, str]:
    """The largest strength whose target side stays within ``budget`` nats/token of s = 0 on
    both sides (positive texts at +s, negative at -s); ``None`` if no strength does."""
    ok = []
    for s in sorted(strengths):
        p, n = check.get("positive"), check.get("negative")
        if p and n and p[f"{s:+g}"] - p["0"] <= budget and n[f"{-s:+g}"] - n["0"] <= budget:
            ok.append(s)
    rule = (f"largest of {sorted(strengths)} at which dev positive texts at +s and negative "
            f"texts at -s lose at most {budget:g} nats/token against s=0")
    return (max(ok) if ok else None), rule


#: The files a run writes into its checkpoint folder (and their temporary names).
CHECKPOINT_FILES = (CHECKPOINT_NAME, *(hidden_cache_name(s) for s in ("train", "dev")))


def _remove_checkpoint(checkpoint_dir: str) -> None:
    """Remove what the run wrote into ``checkpoint_dir``, then the folder if that left it
    empty: a folder the user named (``--checkpoint-dir``) may hold other files, kept."""
    for name in CHECKPOINT_FILES:
        for path in (os.path.join(checkpoint_dir, name),
                     os.path.join(checkpoint_dir, name + ".tmp")):
            try:
                os.remove(path)
            except FileNotFoundError:
                pass
    try:
        os.rmdir(checkpoint_dir)
    except OSError:  # not empty: the user's files stay
        pass


def _save_checkpoint(path: str, lm: LMSteer, opt, step: int, recipe: dict, data_desc: dict,
                     history: list) -> None:
    state = {"format": CHECKPOINT_FORMAT, "version": 1, "step": step,
             "factors": lm.factor_state(), "optimizer": opt.state_dict(),
             "recipe": json.dumps(recipe, sort_keys=True),
             "data": json.dumps(data_desc, sort_keys=True), "history": json.dumps(history)}
    tmp = path + ".tmp"
    torch.save(state, tmp)
    os.replace(tmp, path)


def _load_checkpoint(path: str, recipe: dict, data_desc: dict) -> dict:
    state = torch.load(path, map_location="cpu", weights_only=True)  # our own file: no pickle
    if state.get("format") != CHECKPOINT_FORMAT:
        raise ValueError(f"{path}: not a vllm-steer training checkpoint")
    old = json.loads(state["recipe"])
    old.setdefault("train_strengths", [1.0])  # checkpoints from before the option
    old.setdefault("chat_template", False)
    diffs = [f"{k}: checkpoint {old.get(k)!r}, now {recipe.get(k)!r}" for k in sorted(recipe)
             if k not in RESUMABLE_CHANGES and old.get(k) != recipe.get(k)]
    old_data = json.loads(state["data"])
    if old_data.get("sha256") != data_desc.get("sha256"):
        diffs.append("the training files changed (sha256 differs)")
    if old_data.get("config") != data_desc.get("config"):
        diffs.append("the data configuration changed")
    if int(recipe.get("steps", 0)) < int(state["step"]):
        diffs.append(f"steps: the checkpoint is at step {state['step']}, past --steps "
                     f"{recipe.get('steps')} (--steps may grow, not shrink: give "
                     f"--steps {state['step']} or more)")
    if diffs:
        raise ValueError(f"cannot resume from {path}: the run differs from the checkpoint's:\n"
                         + "\n".join(f"  - {d}" for d in diffs)
                         + "\n(run without --resume to start over)")
    return state


def _gib(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n / 1024:.3g} KiB"


def _minutes(sec: float) -> str:
    return f"{sec:.0f} s" if sec < 90 else f"{sec / 60:.1f} min"


def estimate_run(prep: PreparedRun, lm: LMSteer, used, start: int = 0) -> dict[str, float]:
    """What a run will cost, before it starts: the hidden-state cache (tokens x hidden size
    in the cache dtype, train texts the steps draw plus the dev texts), peak memory (model,
    cache, one head chunk's logits and their gradient) and time, from a probe of this device's
    matmul rate at the head's shape (a rough guide: the first real steps may differ by 2x)."""
    d, vocab = lm.hidden_size, lm.head.vocab_size
    cfg = prep.cfg
    n_train = sum(len(prep.train_ids[i]) for i in used)
    n_dev = sum(len(x) for x in prep.dev_ids)
    tokens = n_train + n_dev
    elem = torch.tensor([], dtype=prep.cache_dtype).element_size()
    cache = tokens * (d * elem + 8)  # states + (target, side) per token
    params = sum(p.numel() for p in prep.model.parameters())
    model_bytes = params * torch.tensor([], dtype=prep.model_dtype).element_size()
    per_text = n_train / max(1, len(used))
    step_tokens = min(cfg.step_tokens or 1 << 30, max(1, int(per_text * cfg.batch_size)))
    chunk = min(cfg.chunk_tokens, step_tokens)
    peak = model_bytes + cache + 3 * chunk * vocab * 4 + 8 * d * (lm.rank + lm.domain_rank) * 4
    sync = (lambda: torch.cuda.synchronize(prep.device)) if prep.device.type == "cuda" \
        else (lambda: None)
    # the hidden-state pass: the model on a few of the run's own texts (second call timed)
    from vllm_steer.train.hidden import final_hidden

    sample = [prep.train_ids[i] for i in list(used)[:32]] or [[0, 1]]
    width = max(len(x) for x in sample)
    ids = torch.zeros(len(sample), width, dtype=torch.long, device=prep.device)
    att = torch.zeros_like(ids)
    for k, x in enumerate(sample):
        ids[k, :len(x)] = torch.tensor(x)
        att[k, :len(x)] = 1
    for _ in range(2):
        sync()
        t = time.perf_counter()
        final_hidden(prep.model, ids, att)
        sync()
    tok_per_s = int(att.sum()) / max(time.perf_counter() - t, 1e-9)
    # a step: the head GEMM at the step's tokens, forward and backward (~2 of them)
    x = torch.randn(step_tokens, d, device=prep.device).to(prep.head_dtype)
    w = lm.head.w(prep.head_dtype)
    torch.nn.functional.linear(x, w)  # warm-up
    reps, t = 0, time.perf_counter()
    while reps < 2 or (time.perf_counter() - t < 0.2 and reps < 20):
        torch.nn.functional.linear(x, w)
        reps += 1
    sync()
    gemm_s = (time.perf_counter() - t) / reps
    evals = (cfg.steps // cfg.eval_every + 1) if cfg.eval_every else 1
    eval_s = evals * 2 * gemm_s * n_dev / step_tokens
    device_bytes = peak - cache  # the cache is kept in host memory, batches are copied over
    if prep.device.type != "cpu":
        peak = device_bytes
    return {"tokens": tokens, "cache_bytes": cache, "peak_bytes": peak,
            "hidden_s": tokens / tok_per_s, "tokens_per_s": tok_per_s,
            "steps": cfg.steps - start, "train_s": (cfg.steps - start) * 2 * gemm_s + eval_s,
            "device": prep.device.type, "params": params, "model_bytes": model_bytes,
            "hidden_size": d, "vocab": vocab, "model_dtype": dtype_name(prep.model_dtype)}


def _count(n: float) -> str:
    return f"{n / 1e9:.3g}B" if n >= 1e9 else f"{n / 1e6:.3g}M"


def describe_estimate(e: dict[str, Any]) -> str:
    where = e.get("device", "cpu")
    host = ("" if where == "cpu" else
            f" on {where}, and {_gib(e['cache_bytes'])} of host memory for the cache")
    model = ("" if "params" not in e else
             f"; the model: {_count(e['params'])} parameters, hidden size {e['hidden_size']}, "
             f"vocabulary {e['vocab']:,}, {e['model_dtype']} on {where} "
             f"({_gib(e['model_bytes'])})")
    return (f"hidden states of {e['tokens']:,} tokens (cache {_gib(e['cache_bytes'])}, "
            f"~{_minutes(e['hidden_s'])} at {e['tokens_per_s']:,.0f} tokens/s unless already "
            f"cached), {e['steps']} steps (~{_minutes(e['train_s'])}); peak memory about "
            f"{_gib(e['peak_bytes'])}{host} (rough: timed on a few texts and one head "
            f"product){model}")


CHAT_NOTE = ("note: {model} has a chat template; training texts are read as plain text "
             "(the tokenizer's own special tokens, no chat template), as the paper trains. A "
             "served steer applies to every generated token, in completions and chat alike "
             "(docs/training.md, chat models); --chat-template trains on them as chat "
             "replies")
CHAT_TRAIN_NOTE = ("chat template: each text is the assistant's reply to the user turn "
                   f"{CHAT_USER_TURN!r} under the model's chat template; only the reply's "
                   "tokens are targets")


@dataclass
class TrainResult:
    steer: Steer
    path: str | None
    metrics: dict[str, Any]
    history: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class _Run:
    """What the steps of a training run share: the steer and its optimizer, the batch order,
    the hidden states, the history and where checkpoints go."""

    cfg: TrainConfig
    prep: PreparedRun
    lm: LMSteer
    opt: Any
    sched: BatchSchedule
    used: torch.Tensor
    train_hs: HiddenStates
    dev_hs: HiddenStates | None
    pos: torch.Tensor
    history: list[dict[str, Any]]
    ckpt_path: str | None
    recipe: dict[str, Any]
    data_desc: dict[str, Any]

    def eval_kw(self) -> dict[str, Any]:
        """The keyword arguments of :func:`mean_loss` and :func:`steer_check`."""
        return dict(head_dtype=self.prep.head_dtype, chunk_tokens=self.cfg.chunk_tokens,
                    device=self.prep.device)


def _name_and_labels(data_cfg: DataConfig | None, out: str | None, name: str | None,
                     labels: dict[str, str] | None) -> tuple[str, dict[str, str]]:
    """The steer's name (checked) and labels: as given, else the preset's, else the name
    from ``out`` (or ``steer``) and no labels."""
    preset = PRESETS.get(data_cfg.preset) if data_cfg and data_cfg.preset else None
    name = name or (preset.name if preset else
                    safe_steer_name(os.path.basename(out).split(".")[0]) if out else "steer")
    check_steer_name(name)  # before training, not when saving its result
    return name, labels or (dict(preset.labels) if preset else {})


def _data_description(prep: PreparedRun, data_cfg: DataConfig | None) -> dict[str, Any]:
    """What the steer file and the checkpoint record of the data, tokenization included."""
    ds = prep.dataset
    data_desc = ds.describe(data_cfg) if data_cfg else {"sha256": ds.sha256,
                                                         "counts": ds.counts(), "config": None}
    data_desc["tokenization"] = prep.reports
    return data_desc


def _resume_or_start(resume: bool, ckpt_path: str | None, checkpoint_dir: str | None,
                     lm: LMSteer, opt, recipe: dict, data_desc: dict,
                     log: Callable[[str], None]) -> tuple[int, list[dict[str, Any]]]:
    """The first step and the history so far: with ``resume``, the checkpoint's (its factors
    and optimizer state loaded into ``lm`` and ``opt``); else step 0 and no history."""
    if resume:
        if not (ckpt_path and os.path.exists(ckpt_path)):
            raise FileNotFoundError(f"--resume: no checkpoint at {ckpt_path}; run without "
                                    "--resume to start")
        state = _load_checkpoint(ckpt_path, recipe, data_desc)
        lm.load_factors(state["factors"])
        opt.load_state_dict(state["optimizer"])
        start, history = int(state["step"]), json.loads(state["history"])
        log(f"[train] resuming from step {start} ({ckpt_path})")
        return start, history
    if ckpt_path and os.path.exists(ckpt_path):
        log(f"[train] note: starting over; the checkpoint in {checkpoint_dir} is replaced "
            "(--resume continues it)")
    return 0, []


def _log_plan(prep: PreparedRun, lm: LMSteer, used: torch.Tensor, start: int,
              log: Callable[[str], None]) -> None:
    """Log the run's estimated cost and how the texts are read (chat template or not)."""
    cfg = prep.cfg
    log("[train] estimate: " + describe_estimate(estimate_run(prep, lm, used, start)))
    if cfg.chat_template:
        log("[train] " + CHAT_TRAIN_NOTE)
    elif getattr(prep.tokenizer, "chat_template", None):
        log("[train] " + CHAT_NOTE.format(model=cfg.model))


def _train_step(run: _Run, step: int) -> float:
    """One Adam step on the step's batch; its loss."""
    cfg, hs, device = run.cfg, run.train_hs, run.prep.device
    idx = run.pos[run.sched.indices(step)]
    c, t, s = hs.batch(idx, device)
    dom = domain_mask(hs, idx, cfg, step, device)
    mag = strength_scale(hs, idx, cfg, step, device)
    if mag is not None:
        s = s * mag
    sel = token_sample(len(t), cfg, step)
    if sel is not None:
        sel = sel.to(c.device)
        c, t, s = c[sel], t[sel], s[sel]
        dom = dom[sel] if torch.is_tensor(dom) else dom
    run.opt.zero_grad(set_to_none=True)
    loss = run.lm.loss_backward(c, t, s, head_dtype=run.prep.head_dtype,
                                chunk_tokens=cfg.chunk_tokens, domain=dom)
    if cfg.regularization > 0:
        (cfg.regularization * run.lm.regularization()).backward()
    run.opt.step()
    return loss


def _run_steps(run: _Run, start: int, name: str, progress: bool) -> float:
    """Steps ``start .. cfg.steps-1`` under a progress bar, with the history's evaluations
    and the checkpoints; the seconds they took."""
    from tqdm.auto import tqdm

    cfg = run.cfg
    t_train = time.perf_counter()
    window: list[float] = []
    bar = tqdm(range(start, cfg.steps), desc=f"train {name}", disable=not progress,
               initial=start, total=cfg.steps)
    for step in bar:
        window.append(_train_step(run, step))
        bar.set_postfix(loss=f"{sum(window[-20:]) / len(window[-20:]):.4f}")
        done = step + 1
        last = done == cfg.steps
        if (cfg.eval_every and done % cfg.eval_every == 0) or last:
            entry = {"step": done, "train_loss": sum(window) / len(window)}
            if run.dev_hs is not None:
                entry["dev_loss"] = mean_loss(run.lm, run.dev_hs, **run.eval_kw())
            run.history.append(entry)
            window = []
        if run.ckpt_path and cfg.checkpoint_every and (done % cfg.checkpoint_every == 0 or last):
            _save_checkpoint(run.ckpt_path, run.lm, run.opt, done, run.recipe, run.data_desc,
                             run.history)
    bar.close()
    return time.perf_counter() - t_train


#: The most dev-loss evaluations the file's ``metrics.history`` keeps (its metadata has a
#: size limit): a longer history keeps its first and last points and evenly spaced ones.
MAX_HISTORY_POINTS = 500


def thin_history(history: list[dict[str, Any]], limit: int = MAX_HISTORY_POINTS
                 ) -> list[dict[str, Any]]:
    """At most ``limit`` points of ``history``, the first and the last always among them."""
    n = len(history)
    if n <= limit:
        return list(history)
    keep = sorted({round(i * (n - 1) / (limit - 1)) for i in range(limit)})
    return [history[i] for i in keep]


def _final_metrics(run: _Run, t0: float, cpu0: float, t_h: float, t_train: float
                   ) -> dict[str, Any]:
    """The trained steer's losses (a sample of the texts trained on, the dev texts), its dev
    check, the history, the timings and the dtypes."""
    cfg, lm, prep, kw = run.cfg, run.lm, run.prep, run.eval_kw()
    metrics: dict[str, Any] = {}
    t_e = time.perf_counter()
    n_final = min(len(run.used), cfg.final_eval_max_texts)  # a sample of the texts trained on
    g = torch.Generator().manual_seed(cfg.seed)
    final_idx = run.pos[run.used[torch.randperm(len(run.used), generator=g)[:n_final]]]
    metrics["train_loss"] = mean_loss(lm, run.train_hs, final_idx, **kw)
    metrics["train_loss_texts"] = n_final
    if run.dev_hs is not None:
        metrics["dev_loss"] = mean_loss(lm, run.dev_hs, **kw)
        metrics["dev_check"] = steer_check(lm, run.dev_hs, cfg.check_strengths, **kw)
    metrics["dev_loss_initial"] = next((h["dev_loss"] for h in run.history if h["step"] == 0),
                                       None)
    metrics["steps"] = cfg.steps
    metrics["history"] = thin_history(run.history)
    metrics["wall_s"] = {"hidden_states": round(t_h, 2), "train": round(t_train, 2),
                         "final_eval": round(time.perf_counter() - t_e, 2),
                         "total": round(time.perf_counter() - t0, 2),
                         "cpu_total": round(time.process_time() - cpu0, 2)}
    metrics["train_tokens"] = int(run.train_hs.targets_per_text()[run.pos[run.used]].sum())
    metrics["train_texts_used"] = len(run.used)
    metrics["resolved_dtypes"] = {"model": dtype_name(prep.model_dtype),
                                  "cache": dtype_name(prep.cache_dtype),
                                  "head": dtype_name(prep.head_dtype)}
    return metrics


def _recommended(cfg: TrainConfig, metrics: dict[str, Any], given: float | None,
                 log: Callable[[str], None]) -> float:
    """The strength to recommend: ``given``, else by the dev check (its rule recorded in
    ``metrics``; the smallest check strength when none is within the budget), else 5."""
    rec = given
    if rec is None and metrics.get("dev_check"):
        rec, rule = recommend_strength(metrics["dev_check"], cfg.check_strengths,
                                       cfg.fluency_budget)
        metrics["recommended_strength_rule"] = rule
        if rec is None:
            rec = min(cfg.check_strengths)
            log(f"[train] warning: even strength {rec:g} costs the steered-towards dev texts "
                f"more than {cfg.fluency_budget} nats/token; recommending {rec:g}")
    return 5.0 if rec is None else float(rec)


def train_steer(cfg: TrainConfig, data: DataConfig | Dataset, out: str | None = None, *,
                name: str | None = None, labels: dict[str, str] | None = None,
                resume: bool = False, checkpoint_dir: str | None = None,
                keep_checkpoint: bool = False, recommended_strength: float | None = None,
                progress: bool = True, log: Callable[[str], None] | None = None,
                prepared: PreparedRun | None = None) -> TrainResult:
    """Train a steer and (if ``out``) write it as a steer file. See the module docstring."""
    log = log or (lambda m: print(m, file=sys.stderr, flush=True))
    t0, cpu0 = time.perf_counter(), time.process_time()
    data_cfg = data if isinstance(data, DataConfig) else None
    prep = prepared or prepare(cfg, data, log)
    diff = [k for k in PREPARE_FIELDS if getattr(prep.cfg, k) != getattr(cfg, k)]
    if diff:
        raise ValueError(f"the prepared data was made with a different {', '.join(diff)}")
    name, labels = _name_and_labels(data_cfg, out, name, labels)
    recipe = cfg.to_dict()
    data_desc = _data_description(prep, data_cfg)
    if checkpoint_dir is None and out and (cfg.checkpoint_every > 0 or resume):
        checkpoint_dir = out + ".ckpt"
    ckpt_path = os.path.join(checkpoint_dir, CHECKPOINT_NAME) if checkpoint_dir else None

    lm = LMSteer(prep.model, cfg.rank, cfg.domain_rank, cfg.epsilon, cfg.init_std, cfg.seed)
    check_head(prep, lm)
    opt = torch.optim.Adam(lm.factor_params(), lr=cfg.lr)
    start, history = _resume_or_start(resume, ckpt_path, checkpoint_dir, lm, opt, recipe,
                                      data_desc, log)

    sched = BatchSchedule(len(prep.train_ids), cfg.batch_size, cfg.seed)
    used = used_texts(sched, cfg.steps)
    _log_plan(prep, lm, used, start, log)
    t_h = time.perf_counter()
    train_hs = hidden_states(prep, "train", checkpoint_dir, progress, log, needed=used)
    pos = local_index(train_hs, len(prep.train_ids))
    dev_hs = hidden_states(prep, "dev", checkpoint_dir, progress, log) if prep.dev_ids else None
    t_h = time.perf_counter() - t_h
    run = _Run(cfg, prep, lm, opt, sched, used, train_hs, dev_hs, pos, history, ckpt_path,
               recipe, data_desc)
    log(f"[train] {name}: {len(used)} of {len(prep.train_ids)} train texts used "
        f"({train_hs.num_targets} tokens cached), "
        f"{dev_hs.num_texts if dev_hs else 0} dev texts; rank {lm.rank} + domain "
        f"{lm.domain_rank}; head {dtype_name(prep.head_dtype)} ({lm.route(prep.head_dtype)}); "
        f"hidden states in {t_h:.1f}s")

    if start == 0 and dev_hs is not None:
        history.append({"step": 0, "dev_loss": mean_loss(lm, dev_hs, **run.eval_kw())})
    t_train = _run_steps(run, start, name, progress)

    metrics = _final_metrics(run, t0, cpu0, t_h, t_train)
    rec = _recommended(cfg, metrics, recommended_strength, log)
    steer = lm.to_steer(name, base_model=cfg.model if cfg.model == "smollm2" else prep.model_path,
                        labels=labels, domain="none", recommended_strength=rec,
                        recipe=recipe, data=data_desc, metrics=metrics)
    if out:
        save_steer(out, steer)
        log(f"[train] wrote {out}")
    if checkpoint_dir and not keep_checkpoint and os.path.isdir(checkpoint_dir):
        _remove_checkpoint(checkpoint_dir)
    _log_summary(log, metrics)
    log(f"[train] recommended strength {rec:g}")
    return TrainResult(steer, out, metrics, history)


def _log_summary(log, m: dict[str, Any]) -> None:
    parts = [f"train loss {m['train_loss']:.4f}"]
    if m.get("dev_loss") is not None:
        init = m.get("dev_loss_initial")
        parts.append(f"dev loss {m['dev_loss']:.4f}" +
                     (f" (initially {init:.4f})" if init is not None else ""))
    log("[train] " + ", ".join(parts) + f"; {m['wall_s']['total']:.1f}s in all")
    for side, row in (m.get("dev_check") or {}).items():
        sign = 1 if side == "positive" else -1
        cells = ", ".join(f"s={k}: {v:.4f}" for k, v in row.items())
        best = min(row, key=row.get)
        log(f"[train] dev {side} texts (want lower at {'+' if sign > 0 else '-'}s): {cells}; "
            f"lowest at s={best}")
