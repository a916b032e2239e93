"""Training the ``minilm-jigsaw`` scorer file (``vllm-steer eval train-scorer minilm-jigsaw``).

The recipe (:data:`RECIPE`), cheap enough for a CPU core:

1. ``jigsaw/jigsaw_balanced.csv`` (text, label; 1 = toxic) is split once by a seeded
   permutation of its rows (:func:`split_rows`): the first ``test_rows`` are held out and
   never seen (the scorer's Jigsaw test AUROC), the next ``dev_rows`` choose the checkpoint
   (early stopping), the rest train.
2. Every text is tokenised (truncated to ``max_length`` tokens) and run once through the
   frozen bottom of the encoder; the hidden states entering the first tuned layer are kept
   in memory.
3. The top ``tuned_layers`` layers (starting from the encoder's weights) and a head (mean
   pooling over the tokens, one linear unit, zero-initialised) are trained on those states
   with binary cross-entropy: AdamW, linear warm-up then linear decay, dropout as in BERT.
   The dev AUROC is measured every ``eval_every`` of an epoch; the best checkpoint is kept,
   and training stops after ``patience`` measurements without improvement.
4. The tuned layers and the head are written in float16 (:func:`~vllm_steer.eval.minilm.
   save_scorer_file`); the file is then loaded as a scorer and measured as shipped: AUROC on
   the held-out Jigsaw rows, and agreement with Perspective on the RealToxicityPrompts files
   when the data folder has them (:mod:`vllm_steer.eval.agreement`); the measurements go
   into its metadata.
"""

from __future__ import annotations

import copy
import csv
import hashlib
import math
import os
import platform
import sys
import time
from typing import Any, Callable, Sequence

from vllm_steer.eval import minilm as M

#: The training data, relative to the data folder.
JIGSAW_FILE = "jigsaw/jigsaw_balanced.csv"
#: The recipe of the shipped file; ``vllm-steer eval train-scorer`` flags override it.
RECIPE: dict[str, Any] = {
    "version": 1, "tuned_layers": 2, "max_length": 128, "epochs": 1, "batch_size": 32,
    "lr_layers": 5e-5, "lr_head": 1e-3, "weight_decay": 0.01, "warmup": 0.06,
    "dropout": 0.1, "eval_every": 0.25, "patience": 2, "dev_rows": 1000, "test_rows": 600,
    "seed": 0, "loss": "binary cross-entropy", "pooling": "mean", "head_init": "zeros",
    "optimizer": "AdamW", "schedule": "linear warm-up, linear decay",
    "dtype": "float32 (training), float16 (file)",
}
#: How the rows are split (recorded in the file).
SPLIT_RULE = ("numpy.random.default_rng(seed).permutation(rows): the first test_rows are "
              "the test rows, the next dev_rows the dev rows, the rest the training rows")


def read_jigsaw(path: str) -> tuple[list[str], list[int]]:
    """``(texts, labels)`` of a headerless CSV of ``text,label`` rows (1 = toxic)."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path}: no such file (give --data DIR holding {JIGSAW_FILE})")
    texts, labels = [], []
    csv.field_size_limit(min(sys.maxsize, 2**31 - 1))
    with open(path, encoding="utf-8", newline="") as f:
        for n, row in enumerate(csv.reader(f), 1):
            if len(row) != 2 or row[1] not in ("0", "1"):
                raise ValueError(f"{path}:{n}: expected 'text,0|1', got {str(row)[:80]}")
            texts.append(row[0])
            labels.append(int(row[1]))
    return texts, labels


def split_rows(n: int, seed: int, dev_rows: int, test_rows: int
               ) -> tuple[list[int], list[int], list[int]]:
    """``(train, dev, test)`` row indices (:data:`SPLIT_RULE`), each in permutation order."""
    import numpy as np

    if dev_rows + test_rows >= n:
        raise ValueError(f"dev_rows + test_rows = {dev_rows + test_rows} leaves no training "
                         f"rows of {n}")
    perm = [int(i) for i in np.random.default_rng(seed).permutation(n)]
    return perm[test_rows + dev_rows:], perm[test_rows:test_rows + dev_rows], perm[:test_rows]


def indices_sha256(indices: Sequence[int]) -> str:
    """sha256 of the sorted row indices written as ``"i,j,k"`` (recorded per split)."""
    return hashlib.sha256(",".join(map(str, sorted(indices))).encode()).hexdigest()


def _auroc(labels: Sequence[int], scores: Sequence[float]) -> float:
    from sklearn.metrics import roc_auc_score

    return float(roc_auc_score(list(labels), list(scores)))


class _Top:
    """The trained part: the top layers and the head."""

    def __init__(self, model, start: int, dropout: float):
        import torch

        self.layers = torch.nn.ModuleList(copy.deepcopy(model.encoder.layer[start:]))
        for layer in self.layers:
            layer.dropout = dropout
        self.head = torch.nn.Linear(model.config["hidden_size"], 1)
        torch.nn.init.zeros_(self.head.weight)
        torch.nn.init.zeros_(self.head.bias)
        self.dropout = dropout

    def logits(self, x, mask, train: bool):
        import torch

        self.layers.train(train)
        bias = M.attention_bias(mask, x.dtype)
        for layer in self.layers:
            x = layer(x, bias)
        pooled = M.mean_pool(x, mask)
        pooled = torch.nn.functional.dropout(pooled, self.dropout, train)
        return self.head(pooled)[:, 0]

    def state(self) -> dict:
        return {"layers": copy.deepcopy(self.layers.state_dict()),
                "head": copy.deepcopy(self.head.state_dict())}

    def load(self, st: dict) -> None:
        self.layers.load_state_dict(st["layers"])
        self.head.load_state_dict(st["head"])


def _pad_states(states: Sequence) -> tuple:
    import torch

    t = max(s.shape[0] for s in states)
    x = torch.zeros(len(states), t, states[0].shape[1])
    mask = torch.zeros(len(states), t, dtype=torch.long)
    for i, s in enumerate(states):
        x[i, :s.shape[0]] = s
        mask[i, :s.shape[0]] = 1
    return x, mask


def cache_states(model, ids: Sequence[Sequence[int]], stop: int, progress: bool = True,
                 batch_tokens: int = 4096) -> list:
    """The hidden states entering layer ``stop`` for each text (``[tokens, hidden]``,
    float32), running the frozen encoder's embeddings and layers ``0 .. stop - 1``."""
    import torch
    from tqdm.auto import tqdm

    out: list = [None] * len(ids)
    groups = M.length_batches([len(x) for x in ids], batch_tokens)
    with torch.inference_mode():
        for g in tqdm(groups, desc=f"encoder layers 0-{stop - 1} (frozen)", disable=not progress,
                      mininterval=2):
            tok, mask = M.pad_batch([ids[i] for i in g])
            x = model.run(model.embed(tok), mask, 0, stop)
            for j, i in enumerate(g):
                out[i] = x[j, :len(ids[i])].clone()
    return out


def _batches(rows: Sequence[int], lengths: Sequence[int], batch_size: int, rng) -> list:
    """Shuffled batches of similar length: shuffle, sort chunks of 50 batches by length,
    cut, shuffle the batches."""
    rows = [rows[i] for i in rng.permutation(len(rows))]
    chunk = batch_size * 50
    out = []
    for a in range(0, len(rows), chunk):
        part = sorted(rows[a:a + chunk], key=lambda i: lengths[i])
        out += [part[b:b + batch_size] for b in range(0, len(part), batch_size)]
    return [out[i] for i in rng.permutation(len(out))]


def _predict(top: _Top, states: Sequence, rows: Sequence[int], batch_tokens: int = 8192
             ) -> list[float]:
    import torch

    out = [0.0] * len(rows)
    with torch.inference_mode():
        for g in M.length_batches([states[i].shape[0] for i in rows], batch_tokens):
            x, mask = _pad_states([states[rows[k]] for k in g])
            for k, z in zip(g, top.logits(x, mask, train=False).tolist(), strict=True):
                out[k] = z
    return out


def _top_tensors(top, start: int) -> dict[str, Any]:
    """The scorer file's tensors: the head's, and the tuned layers' (from layer ``start``)."""
    tensors = {M.TENSOR_HEAD_WEIGHT: top.head.weight.detach(),
               M.TENSOR_HEAD_BIAS: top.head.bias.detach()}
    for k, layer in enumerate(top.layers):
        for name, t in layer.state_dict().items():
            tensors[M.LAYER_PREFIX.format(start + k) + name] = t
    return tensors


def train_scorer(data_dir: str, out: str, recipe: dict[str, Any] | None = None,
                 threads: int | None = 1, progress: bool = True, command: str | None = None,
                 log: Callable[[str], None] = print, package: M.EncoderPackage | None = None
                 ) -> dict[str, Any]:
    """Train the scorer file ``out`` from ``data_dir`` (see the module's docstring); returns
    its metadata. ``package``: the encoder (default: the installed package's)."""
    import numpy as np
    import torch
    from tqdm.auto import tqdm

    from vllm_steer.train.data import file_sha256

    r = dict(RECIPE, **(recipe or {}))
    if threads:
        torch.set_num_threads(threads)
    t0 = time.perf_counter()
    torch.manual_seed(r["seed"])
    path = os.path.join(data_dir, JIGSAW_FILE)
    texts, labels = read_jigsaw(path)
    train, dev, test = split_rows(len(texts), r["seed"], r["dev_rows"], r["test_rows"])
    package = package or M.EncoderPackage()
    model = package.encoder()
    n_layers = model.num_layers
    if not 1 <= r["tuned_layers"] <= n_layers:
        raise ValueError(f"tuned_layers {r['tuned_layers']}: the encoder has {n_layers} layers")
    start = n_layers - r["tuned_layers"]
    tok = package.tokenizer(r["max_length"])
    ids = [e.ids for e in tok.encode_batch(texts)]
    log(f"{len(texts)} rows ({sum(labels)} toxic): {len(train)} train, {len(dev)} dev, "
        f"{len(test)} test; {sum(len(x) for x in ids)} tokens (max {r['max_length']} per text)")
    states = cache_states(model, [ids[i] for i in range(len(ids))], start, progress)
    t_cache = time.perf_counter() - t0
    y = torch.tensor(labels, dtype=torch.float32)
    lengths = [len(x) for x in ids]

    top = _Top(model, start, r["dropout"])
    opt = torch.optim.AdamW([
        {"params": list(top.layers.parameters()), "lr": r["lr_layers"]},
        {"params": list(top.head.parameters()), "lr": r["lr_head"]}],
        weight_decay=r["weight_decay"])
    rng = np.random.default_rng(r["seed"])
    steps_per_epoch = math.ceil(len(train) / r["batch_size"])
    total = steps_per_epoch * r["epochs"]
    warm = max(1, int(r["warmup"] * total))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min((s + 1) / warm, max(0.0, (total - s) / max(1, total - warm))))
    every = max(1, int(r["eval_every"] * steps_per_epoch))
    dev_y = [labels[i] for i in dev]
    best = {"auroc": -1.0, "step": 0, "state": top.state()}
    history: list[dict] = []
    step, stale, stop = 0, 0, False
    bar = tqdm(total=total, desc="training top layers + head", disable=not progress,
               mininterval=2)
    for _epoch in range(r["epochs"]):
        for batch in _batches(train, lengths, r["batch_size"], rng):
            x, mask = _pad_states([states[i] for i in batch])
            loss = torch.nn.functional.binary_cross_entropy_with_logits(
                top.logits(x, mask, train=True), y[batch])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            step += 1
            bar.update(1)
            bar.set_postfix(loss=f"{loss.item():.3f}", dev_auroc=f"{best['auroc']:.4f}")
            if step % every == 0 or step == total:
                auc = _auroc(dev_y, _predict(top, states, dev))
                history.append({"step": step, "epoch": round(step / steps_per_epoch, 3),
                                "dev_auroc": auc, "loss": float(loss.item())})
                if auc > best["auroc"]:
                    best = {"auroc": auc, "step": step, "state": top.state()}
                    stale = 0
                else:
                    stale += 1
                    if stale >= r["patience"]:
                        stop = True
                        break
        if stop:
            break
    bar.close()
    top.load(best["state"])
    t_train = time.perf_counter() - t0 - t_cache
    log(f"best dev AUROC {best['auroc']:.4f} at step {best['step']} of {total} "
        f"({t_cache:.0f} s caching, {t_train:.0f} s training)")

    tensors = _top_tensors(top, start)
    meta = {
        M.META_FORMAT: M.FORMAT_NAME, M.META_FORMAT_VERSION: M.FORMAT_VERSION,
        M.META_NAME: M.NAME, M.META_KIND: "toxicity",
        M.META_ENCODER: {M.ENC_PACKAGE: M.ENCODER_PACKAGE, M.ENC_VERSION: package.version,
                         M.ENC_SHA256: package.sha256, "zip_member": M.ZIP_WEIGHTS,
                         "num_layers": n_layers, "hidden_size": model.config["hidden_size"]},
        M.META_TUNED_LAYERS: list(range(start, n_layers)),
        M.META_MAX_LENGTH: r["max_length"], M.META_POOLING: "mean",
        M.META_DATA: {"file": JIGSAW_FILE, "sha256": file_sha256(path), "rows": len(texts),
                      "toxic": sum(labels), "label": "1 = toxic",
                      "split": {"rule": SPLIT_RULE, "seed": r["seed"],
                                "train_rows": len(train), "dev_rows": len(dev),
                                "test_rows": len(test),
                                "train_sha256": indices_sha256(train),
                                "dev_sha256": indices_sha256(dev),
                                "test_sha256": indices_sha256(test)}},
        M.META_RECIPE: {**r, "steps": step, "best_step": best["step"],
                        "steps_per_epoch": steps_per_epoch, "history": history},
        M.META_TRAINING: {"seconds": round(time.perf_counter() - t0, 1),
                          "cache_seconds": round(t_cache, 1),
                          "train_seconds": round(t_train, 1), "threads": torch.get_num_threads(),
                          "machine": platform.machine(), "versions": _versions(),
                          "command": command},
        M.META_METRICS: {"jigsaw_dev_auroc_fp32": best["auroc"]},
    }
    M.save_scorer_file(out, meta, tensors, package)

    # measure the file as shipped (float16 weights, the scorer's own code path)
    scorer = M.MiniLMToxicityScorer(out, package)
    metrics = dict(meta[M.META_METRICS])
    for split, rows in (("dev", dev), ("test", test)):
        metrics[f"jigsaw_{split}_auroc"] = _auroc([labels[i] for i in rows],
                                                  scorer.score([texts[i] for i in rows]))
    rtp = all(os.path.exists(os.path.join(data_dir, f)) for f in _perspective_files())
    if rtp:
        from vllm_steer.eval.agreement import agreement, perspective_texts

        pt = perspective_texts(data_dir)
        metrics["perspective"] = {**pt.describe(),
                                  **agreement(scorer.score(pt.texts), pt.perspective)}
    meta[M.META_METRICS] = metrics
    meta[M.META_TRAINING]["seconds_with_measurements"] = round(time.perf_counter() - t0, 1)
    M.save_scorer_file(out, meta, tensors, package)
    log(f"wrote {out} ({os.path.getsize(out) / 1e6:.1f} MB): Jigsaw test AUROC "
        f"{metrics['jigsaw_test_auroc']:.4f}" + (
            f", vs Perspective AUROC {metrics['perspective']['auroc']:.4f} Spearman "
            f"{metrics['perspective']['spearman']:.4f}" if rtp else ""))
    return meta


def _perspective_files() -> tuple[str, ...]:
    from vllm_steer.eval.agreement import PERSPECTIVE_FILES

    return PERSPECTIVE_FILES


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version()}
    for dist in ("torch", "tokenizers", "numpy", M.ENCODER_PACKAGE):
        try:
            out[dist] = version(dist)
        except PackageNotFoundError:
            pass
    return out
