"""Vector steers trained from contrastive pairs: ``vllm-steer train --kind vector``.

Each positive text is paired with a negative one (the data's seeded order, as many pairs as
the smaller side has). The output of every chosen decoder block is read at the last token of
each text (:func:`vllm_steer.train.hidden.block_outputs_at_last`), and per block ``k``, with
``d_j = h_k(positive_j) - h_k(negative_j)``:

- ``caa``: ``v_k = mean_j d_j`` (contrastive activation addition);
- ``pca``: ``v_k`` = the first principal component of the ``d_j`` (centred, unit norm), signed
  so that in most pairs the positive text projects higher (repeng's ``pca_diff``, its default).

A positive strength then moves towards the positive texts. Semantics of serving the result:
:func:`vllm_steer.reference.vector_steer_reference`.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from vllm_steer.train.config import DataConfig, VectorConfig
from vllm_steer.vectors import (VectorSteer, is_gguf_name, make_vector_steer, parse_layers,
                               save_any)


def caa_direction(pos: torch.Tensor, neg: torch.Tensor) -> torch.Tensor:
    """The mean paired difference ``mean_j (pos_j - neg_j)`` ([n, hidden] each), float32."""
    return (pos.double() - neg.double()).mean(0).float()


def pca_direction(pos: torch.Tensor, neg: torch.Tensor) -> torch.Tensor:
    """The first principal component (unit norm) of the centred paired differences, signed so
    that the positive text of a pair projects higher in more pairs than not; on a tie (as many
    pairs each way: an even number of pairs), so that the mean difference projects positive,
    and failing that, its largest component is positive (never the solver's arbitrary sign)."""
    diffs = pos.double() - neg.double()
    if diffs.shape[0] < 2:
        raise ValueError(f"PCA needs at least 2 pairs, got {diffs.shape[0]}")
    centred = diffs - diffs.mean(0, keepdim=True)
    _, sv, vh = torch.linalg.svd(centred, full_matrices=False)
    if float(sv[0]) <= 1e-5 * max(float(pos.double().norm()), float(neg.double().norm()),
                                  1e-30):
        raise ValueError("the pairs' differences are all the same (one pair repeated?), so "
                         "they have no principal component (any unit vector would do); give "
                         "pairs that vary, or use --method caa (their mean difference)")
    v = vh[0]
    along = diffs @ v
    higher, lower = int((along > 0).sum()), int((along < 0).sum())
    if higher == lower:  # a tie: the mean difference, then the largest component
        mean = float(along.mean())
        higher, lower = (mean > 0, mean < 0) if mean else (float(v[v.abs().argmax()]) > 0,
                                                           float(v[v.abs().argmax()]) < 0)
    if lower > higher:
        v = -v
    return v.float()


def separation(v: torch.Tensor, pos: torch.Tensor, neg: torch.Tensor) -> float:
    """Share of pairs whose positive text projects higher on ``v`` than its negative one."""
    return float(((pos.double() @ v.double()) > (neg.double() @ v.double())).double().mean())


def side_nll(model, ids_list: list[list[int]], pad_id: int, batch_texts: int = 16) -> float:
    """Mean next-token negative log-likelihood (nats per predicted token) of ``ids_list``."""
    from vllm_steer.train.trainer import pad_batch

    device = next(model.parameters()).device
    total, count = 0.0, 0
    with torch.no_grad():
        for a in range(0, len(ids_list), batch_texts):
            inp, att = pad_batch(ids_list[a:a + batch_texts], pad_id, device)
            logits = model(input_ids=inp, attention_mask=att, use_cache=False).logits.float()
            lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, inp[:, 1:, None])[..., 0]
            mask = att[:, 1:].bool()
            total -= float(lp[mask].double().sum())
            count += int(mask.sum())
    return total / max(count, 1)


def vector_check(model, vs: VectorSteer, pos_ids, neg_ids, strengths, pad_id: int,
                 progress: bool = False) -> dict[str, dict[str, float]]:
    """Dev losses per side at strengths 0 and +-s, the vector applied at every position (as
    served): the same table as an LM-Steer's ``dev_check``."""
    from tqdm.auto import tqdm

    from vllm_steer.hf import vector_steering

    out: dict[str, dict[str, float]] = {}
    bar = tqdm(total=2 * (1 + 2 * len(strengths)), desc="dev check", unit="pass",
               disable=not progress, leave=False)
    for side, ids in (("positive", pos_ids), ("negative", neg_ids)):
        row = {"0": side_nll(model, ids, pad_id)}
        bar.update()
        for s in strengths:
            for v in (s, -s):
                with vector_steering(model, vs, v):
                    row[f"{v:+g}"] = side_nll(model, ids, pad_id)
                bar.update()
        out[side] = row
    bar.close()
    return out


def default_check_strengths(method: str, per_layer: dict[str, dict[str, float]]
                            ) -> tuple[float, ...]:
    """Strengths of the dev check when none are given: fractions of one mean difference per
    block (CAA's unit; a PCA vector's unit is scaled by the mean difference along it). Small:
    a vector on every block adds up along the residual stream (on the embedded model, 0.05
    of the detox mean difference on blocks 1-29 already costs 0.1 nats/token)."""
    fractions = (0.01, 0.02, 0.03, 0.05, 0.1)
    if method == "caa":
        return fractions
    scale = sum(abs(m["mean_difference_along"]) for m in per_layer.values()) / len(per_layer)
    return tuple(float(f"{f * scale:.3g}") for f in fractions)


@dataclass
class VectorResult:
    steer: VectorSteer
    paths: list[str]
    metrics: dict[str, Any]


def _pairs(ids: list[list[int]], sides: list[int], limit: int | None
           ) -> tuple[list[list[int]], list[list[int]]]:
    pos = [x for x, s in zip(ids, sides, strict=True) if s > 0]
    neg = [x for x, s in zip(ids, sides, strict=True) if s < 0]
    n = min(len(pos), len(neg), limit or len(ids))
    return pos[:n], neg[:n]


def load_pairs(files: list[str], *, dev_fraction: float = 0.1, dev_max: int = 200,
               seed: int = 0) -> tuple[list[tuple[str, str]], list[tuple[str, str]],
                                       dict[str, Any]]:
    """Contrastive pairs from JSONL files, one ``{"positive": str, "negative": str}`` object
    a line (repeng's ``DatasetEntry``): ``(train, dev, description)``, the dev pairs a seeded
    ``dev_fraction`` (at most ``dev_max``) of them."""
    import json
    import random

    from vllm_steer.train.data import file_sha256

    pairs: list[tuple[str, str]] = []
    for f in files:
        if not os.path.isfile(f):
            raise FileNotFoundError(f"--pairs {f}: no such file")
        with open(f, encoding="utf-8") as fh:
            for n, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    d = json.loads(line)
                except ValueError as e:
                    raise ValueError(f"{f}:{n}: not JSON ({str(e)[:80]}); each line is "
                                     '{"positive": "...", "negative": "..."}') from None
                if not (isinstance(d, dict) and isinstance(d.get("positive"), str)
                        and isinstance(d.get("negative"), str)):
                    raise ValueError(f"{f}:{n}: expected an object with string keys "
                                     '"positive" and "negative" (a contrastive pair)')
                pairs.append((d["positive"], d["negative"]))
    if len(pairs) < 2:
        raise ValueError(f"--pairs {' '.join(files)}: {len(pairs)} pairs; a vector needs at "
                         "least 2")
    order = list(range(len(pairs)))
    random.Random(seed).shuffle(order)
    pairs = [pairs[i] for i in order]
    n_dev = min(int(round(dev_fraction * len(pairs))), dev_max, len(pairs) - 2)
    if dev_fraction > 0 and len(pairs) >= 3:
        n_dev = max(n_dev, 1)
    desc = {"pairs": list(files), "sha256": {f: file_sha256(f) for f in files},
            "counts": {"pairs": len(pairs), "dev_pairs": n_dev}}
    return pairs[n_dev:], pairs[:n_dev], desc


def _joint_pairs(tok, pairs: list[tuple[str, str]], max_length: int, window, limit):
    """Token ids of each pair's two texts, a pair dropped when either text is; and how many
    texts were longer than ``max_length`` (their end kept)."""
    from vllm_steer.train.hidden import tokenize

    pos, kp, rp = tokenize(tok, [p for p, _ in pairs], max_length, window, keep_end=True)
    neg, kn, rn = tokenize(tok, [n for _, n in pairs], max_length, window, keep_end=True)
    at_p, at_n = dict(zip(kp, pos, strict=True)), dict(zip(kn, neg, strict=True))
    whole = [i for i in range(len(pairs)) if i in at_p and i in at_n]
    both = whole[:limit or len(pairs)]
    return ([at_p[i] for i in both], [at_n[i] for i in both], rp.truncated + rn.truncated,
            max(rp.max_tokens_seen, rn.max_tokens_seen), len(pairs) - len(whole))


def _directions(method: str, layers: list[int], states: dict[str, Any]
                ) -> tuple[dict[int, torch.Tensor], dict[str, dict[str, float]]]:
    """Per block, the direction of ``method`` from the train block outputs, and its metrics:
    norm, separation of the train (and dev) pairs, mean difference along it."""
    directions, per_layer = {}, {}
    tp, tn = states["train"]
    for li, k in enumerate(layers):
        if not bool((tp[li] != tn[li]).any()):
            raise ValueError(f"block {k}: every training pair's two texts have the same state "
                             "at their last token, so there is no direction to learn; the "
                             "positive and negative texts of each pair must differ")
        try:
            v = (caa_direction if method == "caa" else pca_direction)(tp[li], tn[li])
        except ValueError as e:
            raise ValueError(f"block {k}: {e}") from None
        directions[k] = v
        unit = v.double() / max(float(v.double().norm()), 1e-30)
        m = {"norm": round(float(v.norm()), 6),
             "train_separation": round(separation(v, tp[li], tn[li]), 4),
             "mean_difference_along": round(float(((tp[li] - tn[li]).double() @ unit).mean()), 6)}
        if "dev" in states:
            m["dev_separation"] = round(separation(v, states["dev"][0][li],
                                                   states["dev"][1][li]), 4)
        per_layer[str(k)] = m
    return directions, per_layer


def _block_states(model, tok, cfg: VectorConfig, layers: list[int], window, progress: bool,
                  pair_splits, ds):
    """The chosen blocks' outputs at each text's last token, per split: ``(states, counts,
    dev ids, texts cut at their start, the most tokens of a text)``; the texts from
    ``pair_splits`` (train and dev pairs) or ``ds`` (a dataset's sides, paired)."""
    from vllm_steer.train.hidden import block_outputs_at_last, tokenize

    states, counts, dev_ids = {}, {}, None
    cut, longest = 0, 0  # texts longer than --max-length (their end kept), the most tokens
    dropped = {}  # per split: pairs (texts, for a dataset's sides) of fewer than 2 tokens
    for split in ("train", "dev"):
        limit = cfg.max_pairs if split == "train" else None
        if pair_splits is not None:
            pos, neg, n_cut, most, dropped[split] = _joint_pairs(
                tok, pair_splits[split == "dev"], cfg.max_length, window, limit)
        else:
            xs = ds.train if split == "train" else ds.dev
            ids, kept, rep = tokenize(tok, [e.text for e in xs], cfg.max_length, window,
                                      keep_end=True)
            pos, neg = _pairs(ids, [xs[i].side for i in kept], limit)
            n_cut, most, dropped[split] = rep.truncated, rep.max_tokens_seen, rep.too_short
        cut, longest = cut + n_cut, max(longest, most)
        counts[split] = len(pos)
        if split == "train" and len(pos) < 2:
            raise ValueError(f"{len(pos)} training pairs: a vector needs at least 2 (both "
                             "sides need texts of 2 tokens or more)")
        if not pos:
            continue
        if split == "dev":
            dev_ids = (pos, neg)
        both = block_outputs_at_last(model, tok, pos + neg, layers,
                                     batch_tokens=cfg.batch_tokens, progress=progress,
                                     desc=f"{split} block outputs")
        states[split] = (both[:, :len(pos)], both[:, len(pos):])
    return states, counts, dev_ids, cut, longest, dropped


def train_vector(cfg: VectorConfig, data: DataConfig | None, outs: list[str], *,
                 name: str | None = None, labels: dict[str, str] | None = None,
                 recommended_strength: float | None = None, progress: bool = True,
                 log: Callable[[str], None] | None = None,
                 pairs: list[str] | None = None) -> VectorResult:
    """Make a vector steer from ``data``'s positive and negative texts and write it to each
    path of ``outs`` (``.gguf``: llama.cpp's format; else ours). With dev texts, the
    recommended strength (unless given) is the largest check strength within the fluency
    budget (:func:`vector_check`, the rule of LM-Steer training). ``pairs``: JSONL files of
    contrastive pairs (:func:`load_pairs`) instead of ``data``, each pair kept together."""
    from vllm_steer.hf import decoder_layers
    from vllm_steer.names import check_steer_name, safe_steer_name
    from vllm_steer.train.data import PRESETS, load_dataset
    from vllm_steer.train.hidden import model_window
    from vllm_steer.train.module import load_model, resolve_device, resolve_dtype

    log = log or (lambda m: print(m, file=sys.stderr, flush=True))
    t0 = time.perf_counter()
    cfg.validate()
    preset = PRESETS.get(data.preset) if data is not None and data.preset else None
    name = name or (preset.name if preset else
                    safe_steer_name(os.path.basename(outs[0]).split(".")[0]) if outs else "vector")
    check_steer_name(name)
    labels = labels or (dict(preset.labels) if preset else {})
    device = resolve_device(cfg.device)
    dtype = resolve_dtype(cfg.model_dtype, device, "model_dtype")
    if pairs:
        dev_fraction = data.dev_fraction if data is not None else DataConfig.dev_fraction
        dev_max = data.dev_max_per_side if data is not None else DataConfig.dev_max_per_side
        train_p, dev_p, data_desc = load_pairs(pairs, dev_fraction=dev_fraction,
                                               dev_max=dev_max, seed=cfg.seed)
    else:
        if data is None:
            raise ValueError("no training data: give a DataConfig or pairs files")
        ds = load_dataset(data, cfg.seed)
        data_desc = ds.describe(data)
    model, tok, path = load_model(cfg.model, device, dtype)
    n_blocks = len(decoder_layers(model))
    layers = (parse_layers(cfg.layers, n_blocks) if cfg.layers is not None
              else list(range(1, n_blocks)) or [0])
    if any(is_gguf_name(o) for o in outs) and 0 in layers:
        raise ValueError("block 0 cannot be written to a llama.cpp GGUF (llama.cpp refuses "
                         f"direction.0): choose --layers from 1 (e.g. 1-{n_blocks - 1}), or "
                         "write only the .safetensors file")
    window = model_window(model)
    states, counts, dev_ids, cut, longest, dropped = _block_states(
        model, tok, cfg, layers, window, progress,
        (train_p, dev_p) if pairs else None, None if pairs else ds)
    log(f"[train] {name}: {counts['train']} training pairs, {counts.get('dev', 0)} dev pairs, "
        f"{cfg.method} on blocks {layers[0]}-{layers[-1]} ({len(layers)} blocks)")
    if any(dropped.values()):
        what = "pairs" if pairs else "texts"
        log(f"[train] dropped {dropped['train']} training and {dropped['dev']} dev {what}: "
            "a text of fewer than 2 tokens (empty, or a single token)"
            + ("; no dev pairs are left, so there is no dev check and no recommended "
               "strength" if dropped["dev"] and not counts.get("dev") else ""))
    if cut:
        log(f"[train] {cut} texts were longer than --max-length {cfg.max_length} tokens (the "
            f"longest {longest}): each kept its last {cfg.max_length} tokens, so the state is "
            "still read at its own last token, with less context before it ("
            + (f"--max-length {longest} keeps every text whole)" if window is None
               or longest <= window else f"the model's context window is {window} tokens)"))
    directions, per_layer = _directions(cfg.method, layers, states)
    metrics: dict[str, Any] = {"pairs": counts, "per_layer": per_layer}
    if cut:
        metrics["texts_cut_at_start"] = cut
    if any(dropped.values()):
        metrics["dropped_too_short"] = dropped
    if "dev" in states:
        best = max(per_layer, key=lambda k: per_layer[k]["dev_separation"])
        metrics["best_dev_separation"] = {"layer": int(best),
                                          "separation": per_layer[best]["dev_separation"]}
    recipe = cfg.to_dict()
    recipe["layers_resolved"] = layers
    rec = recommended_strength
    vs = make_vector_steer(directions, name,
                           base_model=cfg.model if cfg.model == "smollm2" else path,
                           model_type=getattr(model.config, "model_type", None),
                           model_layers=n_blocks, labels=labels,
                           recommended_strength=rec, recipe=recipe,
                           data=data_desc, metrics=metrics)
    if dev_ids is not None and cfg.fluency_budget is not None:
        from vllm_steer.train.trainer import recommend_strength

        strengths = cfg.check_strengths or default_check_strengths(cfg.method, per_layer)
        pad = tok.pad_token_id if tok.pad_token_id is not None else 0
        check = vector_check(model, vs, dev_ids[0], dev_ids[1], strengths, pad, progress)
        metrics["dev_check"] = check
        best, rule = recommend_strength(check, strengths, cfg.fluency_budget)
        metrics["recommended_strength_rule"] = rule
        if rec is None:
            vs.metadata.recommended_strength = best if best is not None else min(strengths)
        if best is None:  # as LM-Steer training says it
            log(f"[train] warning: even strength {min(strengths):g} costs the steered-towards "
                f"dev texts more than {cfg.fluency_budget:g} nats/token"
                + (f"; recommending {min(strengths):g}" if rec is None else ""))
        log("[train] dev check: " + ", ".join(
            f"{side} " + " ".join(f"{k}:{v:.3f}" for k, v in row.items())
            for side, row in check.items()))
    metrics["wall_s"] = round(time.perf_counter() - t0, 2)
    for out in outs:
        save_any(out, vs)
        log(f"[train] wrote {out}")
    if "dev" in states:
        b = metrics["best_dev_separation"]
        log(f"[train] dev separation: best {b['separation']:.2f} at block {b['layer']}")
    if vs.metadata.recommended_strength is not None:
        log(f"[train] recommended strength {vs.metadata.recommended_strength:g}")
    return VectorResult(vs, list(outs), metrics)
