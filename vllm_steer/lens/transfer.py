r"""Transfer: move a steer from model A to model B through their output embeddings.

Conventions (row vectors, as everywhere in vllm-steer; semantics: see
:mod:`vllm_steer.reference`)::

    logits   l = c @ E.T                      E [vocab, d], c [1, d] final hidden state
    steer    c' = c + eps * (c @ P1) @ P2.T    i.e. c' = c (I + eps S),  S = P1 @ P2.T  [d, d]

(``S`` is the transpose of the paper's column-form ``W = P2 P1^T``.)

**The map.** Tokens that both vocabularies share (matched by token string) give paired rows
``E_A[v]`` and ``E_B[v]``. We fit a linear map ``H`` [d_B, d_A] with::

    E_A - mean_A  ~=  (E_B - mean_B) @ H

by ridge least squares in closed form, ``H = (X^T X + lam I)^{-1} X^T Y`` with the centred
anchor rows ``X = E_B - mean_B``, ``Y = E_A - mean_A`` and ``lam = ridge * trace(X^T X) / d_B``.
``ridge = 0`` is the unregularised limit, computed with the pseudo-inverse (``H = X^+ Y``, the
least-norm least-squares fit) rather than by solving a system that can be singular.
Centring is free: adding a vector ``m`` to every output embedding adds the same number
``c . m`` to every logit of a context, which the softmax ignores. The fit is reported on
held-out anchor tokens (R^2 and the mean cosine between predicted and true centred rows).

**The steer** (``form="logit"``, the default). Take a context ``c_B`` of model B. The
A-context that gives the same logits satisfies ``c_A E_A^T = c_B E_B^T``; with
``E_A = E_B H`` (up to the ignored mean) this is ``c_A H^T = c_B``, solved (least norm, with
the same small ridge) by ``c_A = c_B G``, ``G = H (H^T H + lam' I)^{-1}`` [d_B, d_A] (at
``ridge = 0``: ``G = (H^T)^+``; for ``d_B < d_A`` the matrix ``H^T H`` is singular). The steer
changes A's logits by ``eps c_A S_A E_A^T = eps c_B G S_A H^T E_B^T``, so on B::

    S_B = G S_A H^T = (G P1)(H P2)^T,     i.e.   P1_B = G @ P1,   P2_B = H @ P2

which reproduces A's logit shift at corresponding contexts exactly when ``E_A = E_B H`` holds
and ``d_B <= d_A`` (for ``d_B > d_A`` only the part of ``c_B`` in the column space of ``H``
is steered).

``form="congruence"`` is the transfer of the paper's code (``S_B = H S_A H^T``:
``P1_B = H P1``, ``P2_B = H P2``). It equals the logit form when ``H`` is orthogonal (a
rotation: ``G = H``), but when ``H`` also scales, the shift is scaled by about ``|H|^2``
instead of 1 -- one reason the paper found transferred steers to need a different (about a
tenth of the) strength.

**Strength.** Even an exact transfer preserves the shift at *corresponding* contexts, but B's
own hidden states are not exactly ``c_A H^T``. We therefore measure, on a few plain sentences,
the RMS of the centred logit shift per unit of strength that the source steer causes on A's
own hidden states and that the transferred steer causes on B's own hidden states, and
recommend ``strength_B = strength_A * rms_A / rms_B`` (``strength_A`` = the source's
recommended strength, else 5). Both numbers are stored in the metadata ``source``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Literal, Mapping, Sequence

import torch

from vllm_steer.format import Steer, SteerMetadata

Form = Literal["logit", "congruence"]
#: Fitting anchors taken by default, and held-out anchors for the report.
DEFAULT_ANCHORS = 4000
DEFAULT_HELDOUT = 1000
DEFAULT_RIDGE = 1e-4
#: Below this held-out R^2 the report warns that little of the steer can carry over.
LOW_R2 = 0.3
#: The paper generates at strength 5: the fallback when the source recommends none.
FALLBACK_STRENGTH = 5.0
_SPACE_MARKERS = ("\u0120", "\u2581")  # GPT-2 byte-level "Ġ", SentencePiece "▁"


@dataclass
class TransferConfig:
    """How to fit the embedding map and transfer the steer."""

    anchors: int = DEFAULT_ANCHORS
    """Shared tokens used to fit the map (the most frequent first: lowest ids)."""
    heldout: int = DEFAULT_HELDOUT
    """Further shared tokens, interleaved with the fitting ones, used only for the report."""
    ridge: float = DEFAULT_RIDGE
    """Ridge strength relative to the mean eigenvalue of ``X^T X`` (and of ``H^T H``); 0 = no
    regularisation (pseudo-inverse: the least-norm least-squares solutions)."""
    form: Form = "logit"
    """``logit`` (keeps the logit shift; see the module doc) or ``congruence`` (the paper's
    ``H S H^T``)."""

    def __post_init__(self):
        if self.anchors < 1 or self.heldout < 0:
            raise ValueError(f"anchors={self.anchors} must be >= 1 and heldout={self.heldout} "
                             ">= 0")
        check_ridge(self.ridge)
        if self.form not in ("logit", "congruence"):
            raise ValueError(f"form={self.form!r}: choose 'logit' or 'congruence'")


def ridge_problem(ridge, shown: str | None = None) -> str | None:
    """Why ``ridge`` (a number, or the text of one) cannot be used (``None`` when it can): it
    must be a finite number >= 0. ``shown``: how the message names it (``ridge VALUE``)."""
    try:
        r = float(ridge)
    except (TypeError, ValueError):
        r = float("nan")
    if math.isfinite(r) and r >= 0:
        return None
    return (f"{shown or f'ridge {ridge}'} is not a finite number >= 0: give the relative ridge "
            f"strength, e.g. the default {DEFAULT_RIDGE} (0 = no regularisation)")


def check_ridge(ridge: float) -> None:
    """Raise ``ValueError`` naming the value, the limit and the fix unless ``ridge`` is a
    finite number >= 0."""
    problem = ridge_problem(ridge)
    if problem:
        raise ValueError(problem)


def normalise_token(tok: str) -> str:
    """Token string with the tokenizer's word-start marker ("Ġ", "▁") turned into a space."""
    for m in _SPACE_MARKERS:
        if tok.startswith(m):
            return " " + tok[len(m):]
    return tok


@dataclass
class Anchors:
    """Shared tokens: their strings, ids in A and B, and which are held out."""

    tokens: list[str]
    ids_a: list[int]
    ids_b: list[int]
    fit: list[int]  # positions into the lists above
    heldout: list[int]
    shared_total: int = 0
    """How many token strings the two vocabularies share in all."""


def shared_anchors(vocab_a: Mapping[str, int], vocab_b: Mapping[str, int],
                   n_fit: int = DEFAULT_ANCHORS, n_heldout: int = DEFAULT_HELDOUT,
                   exclude_a: Sequence[int] = (), exclude_b: Sequence[int] = (),
                   rows_a: int | None = None, rows_b: int | None = None) -> Anchors:
    """Tokens both vocabularies share, matched by (normalised) string, in a deterministic
    order: by ``max(id_A, id_B)`` (BPE ids grow as tokens get rarer), then by string. The
    first ``n_fit + n_heldout`` are taken and ``n_heldout`` of them, evenly spread, held out.
    Special tokens (``exclude_*``) and ids beyond the embedding rows are skipped; when one
    normalised string has several ids, the lowest id is kept."""
    def norm(vocab, exclude, rows):
        out: dict[str, int] = {}
        ex = set(int(i) for i in exclude)
        for t, i in vocab.items():
            if i in ex or (rows is not None and i >= rows):
                continue
            key = normalise_token(t)
            if key not in out or i < out[key]:
                out[key] = int(i)
        return out

    a, b = norm(vocab_a, exclude_a, rows_a), norm(vocab_b, exclude_b, rows_b)
    shared = sorted(set(a) & set(b), key=lambda t: (max(a[t], b[t]), t))
    total = len(shared)
    want = n_fit + n_heldout
    if total < 2 or total < min(want, 16):
        raise ValueError(f"the two vocabularies share only {total} tokens (after removing "
                         "special tokens); a linear map needs at least a few hundred -- are "
                         "these models from unrelated tokenizer families?")
    chosen = shared[:want]
    n = len(chosen)
    h = round(n * n_heldout / want) if want else 0
    held = sorted({int((r + 1) * n / (h + 1)) for r in range(h)} - {n}) if h else []
    held_set = set(held)
    fit = [i for i in range(n) if i not in held_set]
    return Anchors(chosen, [a[t] for t in chosen], [b[t] for t in chosen], fit, held, total)


@dataclass
class EmbeddingMap:
    """``E_A - mean_a ~= (E_B - mean_b) @ H``, fitted on anchor rows."""

    H: torch.Tensor  # [d_b, d_a] float64
    mean_a: torch.Tensor  # [d_a]
    mean_b: torch.Tensor  # [d_b]
    ridge: float

    def predict_a(self, e_b: torch.Tensor) -> torch.Tensor:
        """A-embeddings predicted from B-embeddings (rows)."""
        return (e_b.double() - self.mean_b) @ self.H + self.mean_a

    def context_map(self) -> torch.Tensor:
        """``G = H (H^T H + lam I)^{-1}`` [d_b, d_a]: ``c_A = c_B @ G`` gives (least-norm,
        ridge-regularised) ``c_A H^T ~= c_B``, i.e. the A-context with the same logits. At
        ridge 0 it is the limit ``(H^T)^+`` (pseudo-inverse): ``H^T H`` [d_a, d_a] has rank at
        most d_b, so for d_b < d_a the unregularised system is singular."""
        if self.ridge == 0:
            return torch.linalg.pinv(self.H.T)
        hth = self.H.T @ self.H
        d = hth.shape[0]
        lam = self.ridge * float(torch.trace(hth)) / d
        return torch.linalg.solve(hth + lam * torch.eye(d, dtype=hth.dtype), self.H.T).T


def fit_map(e_b: torch.Tensor, e_a: torch.Tensor, ridge: float = DEFAULT_RIDGE) -> EmbeddingMap:
    """Ridge least squares ``(E_A - mean) ~= (E_B - mean) H`` in closed form (float64);
    ``ridge=0``: the least-norm least-squares fit ``H = X^+ Y`` (pseudo-inverse)."""
    check_ridge(ridge)
    ridge = float(ridge)
    if e_a.shape[0] != e_b.shape[0]:
        raise ValueError(f"anchor rows differ: {e_b.shape[0]} in B, {e_a.shape[0]} in A")
    x, y = e_b.double(), e_a.double()
    mb, ma = x.mean(0), y.mean(0)
    x, y = x - mb, y - ma
    if ridge == 0:
        return EmbeddingMap(torch.linalg.pinv(x) @ y, ma, mb, ridge)
    xtx = x.T @ x
    d = xtx.shape[0]
    lam = ridge * float(torch.trace(xtx)) / d
    H = torch.linalg.solve(xtx + lam * torch.eye(d, dtype=xtx.dtype), x.T @ y)
    return EmbeddingMap(H, ma, mb, ridge)


def fit_quality(m: EmbeddingMap, e_b: torch.Tensor, e_a: torch.Tensor) -> dict[str, float]:
    """R^2 and mean cosine of the predicted vs true centred A-rows (use held-out anchors)."""
    pred = m.predict_a(e_b) - m.mean_a
    true = e_a.double() - m.mean_a
    resid = float(((pred - true) ** 2).sum())
    tot = float(((true - true.mean(0)) ** 2).sum())
    cos = torch.nn.functional.cosine_similarity(pred, true, dim=1)
    return {"r2": 1.0 - resid / tot if tot > 0 else float("nan"),
            "cosine": float(cos.mean()), "rows": int(e_a.shape[0])}


def transfer_factors(p1: torch.Tensor, p2: torch.Tensor, m: EmbeddingMap, form: Form = "logit"
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Factors on B from factors on A (``[d_a, r]`` -> ``[d_b, r]``); see the module doc."""
    H = m.H
    if p1.shape[0] != H.shape[1]:
        raise ValueError(f"steer hidden size {p1.shape[0]} does not match model A's output "
                         f"embeddings ({H.shape[1]})")
    left = m.context_map() if form == "logit" else H
    return (left @ p1.double()).float(), (H @ p2.double()).float()


def transfer_steer(steer: Steer, m: EmbeddingMap, form: Form = "logit",
                   source: dict | None = None, base_model: str | None = None,
                   recommended_strength: float | None = None) -> Steer:
    """The steer on model B (domain component transferred the same way)."""
    p1, p2 = transfer_factors(steer.p1, steer.p2, m, form)
    d1 = d2 = None
    if steer.domain_p1 is not None:
        d1, d2 = transfer_factors(steer.domain_p1, steer.domain_p2, m, form)
    meta: SteerMetadata = dataclasses.replace(
        steer.metadata, hidden_size=int(p1.shape[0]), base_model=base_model,
        recommended_strength=recommended_strength,
        source=dict(source or {}),
        metrics={}, extra=dict(steer.metadata.extra))
    return Steer(p1.contiguous(), p2.contiguous(), meta, d1, d2)


def logit_shift_rms(hidden: torch.Tensor, E: torch.Tensor, steer: Steer,
                    chunk: int = 256, post=None, bias: torch.Tensor | None = None) -> float:
    """RMS over contexts and tokens of the centred logit shift per unit strength,
    ``eps (c S) E^T`` minus its mean over the vocabulary (the part the softmax sees).
    ``post`` (optional): the model's processing of its head's output
    (:func:`vllm_steer.hf.logit_postprocess`; ``bias`` its head bias), so that the
    shift is the one of the model's own logits: ``post(l + delta) - post(l)``."""
    eps = steer.metadata.epsilon
    p1, p2, E = steer.p1.float(), steer.p2.float(), E.float()
    tot, n = 0.0, 0
    for i in range(0, hidden.shape[0], chunk):
        c = hidden[i:i + chunk].float()
        delta = eps * ((c @ p1) @ p2.T) @ E.T  # [rows, vocab]
        if post is not None:
            base = c @ E.T + (bias.float() if bias is not None else 0.0)
            delta = post(base + delta) - post(base)
        delta = delta - delta.mean(-1, keepdim=True)
        tot += float((delta ** 2).sum())
        n += delta.numel()
    return (tot / max(n, 1)) ** 0.5


@dataclass
class TransferReport:
    """What :func:`transfer` measured."""

    shared_tokens: int
    anchors: int
    heldout: int
    fit: dict[str, float]
    heldout_fit: dict[str, float]
    rms_source: float | None = None
    rms_target: float | None = None
    source_strength: float = FALLBACK_STRENGTH
    recommended_strength: float | None = None
    extra: dict = field(default_factory=dict)

    def lines(self) -> list[str]:
        out = [f"shared tokens: {self.shared_tokens}; fitted on {self.anchors}, "
               f"held out {self.heldout}",
               f"fit (train):    R^2 {self.fit['r2']:.4f}  mean cosine {self.fit['cosine']:.4f}"]
        if self.heldout_fit:
            out.append(f"fit (held out): R^2 {self.heldout_fit['r2']:.4f}  mean cosine "
                       f"{self.heldout_fit['cosine']:.4f}")
            if self.heldout_fit["r2"] < LOW_R2:
                out.append(f"warning: held-out R^2 below {LOW_R2}: the two embedding spaces "
                           "are barely linearly related, so the transferred steer is unlikely "
                           "to mean what it meant on the source model")
        if self.rms_source is not None and self.rms_target is not None:
            out.append(f"logit shift per unit strength (RMS, centred): source "
                       f"{self.rms_source:.4g}, transferred {self.rms_target:.4g} "
                       f"(ratio {self.rms_source / self.rms_target:.3g})")
        if self.recommended_strength is not None:
            out.append(f"recommended strength: {self.recommended_strength:.3g} (source "
                       f"{self.source_strength:.3g} x RMS ratio)")
        return out


def fit_between(E_a: torch.Tensor, E_b: torch.Tensor, vocab_a: Mapping[str, int],
                vocab_b: Mapping[str, int], cfg: TransferConfig,
                exclude_a: Sequence[int] = (), exclude_b: Sequence[int] = ()
                ) -> tuple[EmbeddingMap, Anchors, dict, dict]:
    """Anchors, the fitted map, and its fit on the fitting and on the held-out anchors."""
    anc = shared_anchors(vocab_a, vocab_b, cfg.anchors, cfg.heldout, exclude_a, exclude_b,
                         rows_a=E_a.shape[0], rows_b=E_b.shape[0])
    ia, ib = torch.tensor(anc.ids_a), torch.tensor(anc.ids_b)
    fit_i, held_i = torch.tensor(anc.fit), torch.tensor(anc.heldout, dtype=torch.long)
    m = fit_map(E_b[ib[fit_i]], E_a[ia[fit_i]], cfg.ridge)
    q_fit = fit_quality(m, E_b[ib[fit_i]], E_a[ia[fit_i]])
    q_held = fit_quality(m, E_b[ib[held_i]], E_a[ia[held_i]]) if len(anc.heldout) > 1 else {}
    return m, anc, q_fit, q_held


def transfer(steer: Steer, model_a, tok_a, model_b, tok_b, cfg: TransferConfig | None = None,
             name_a: str | None = None, name_b: str | None = None,
             calibration_texts: Sequence[str] | None = None) -> tuple[Steer, TransferReport]:
    """Transfer ``steer`` from (model_a, tok_a) to (model_b, tok_b) (transformers objects)."""
    from vllm_steer.hf import logit_postprocess, output_head
    from vllm_steer.lens.lm import CALIBRATION_TEXTS, final_hidden_states, output_embeddings

    cfg = cfg or TransferConfig()
    E_a, E_b = output_embeddings(model_a).float().cpu(), output_embeddings(model_b).float().cpu()
    if steer.hidden_size != E_a.shape[1]:
        raise ValueError(f"the steer has hidden size {steer.hidden_size} but --from model has "
                         f"{E_a.shape[1]}: is the steer for this model? (its base_model is "
                         f"{steer.metadata.base_model!r})")
    m, anc, q_fit, q_held = fit_between(E_a, E_b, tok_a.get_vocab(), tok_b.get_vocab(), cfg,
                                        tok_a.all_special_ids, tok_b.all_special_ids)
    src_strength = steer.metadata.recommended_strength or FALLBACK_STRENGTH
    provisional = transfer_steer(steer, m, cfg.form)
    texts = list(calibration_texts or CALIBRATION_TEXTS)
    h_a = torch.cat([e.hidden for e in final_hidden_states(model_a, tok_a, texts)]).cpu()
    h_b = torch.cat([e.hidden for e in final_hidden_states(model_b, tok_b, texts)]).cpu()
    def head_bias(model):
        b = getattr(output_head(model), "bias", None)
        return None if b is None else b.detach().float().cpu()

    rms_a = logit_shift_rms(h_a, E_a, steer.to(dtype=torch.float32),
                            post=logit_postprocess(model_a), bias=head_bias(model_a))
    rms_b = logit_shift_rms(h_b, E_b, provisional, post=logit_postprocess(model_b),
                            bias=head_bias(model_b))
    rec = src_strength * rms_a / rms_b if rms_b > 0 else None
    report = TransferReport(anc.shared_total, len(anc.fit), len(anc.heldout), q_fit, q_held,
                            rms_a, rms_b, src_strength, rec)
    source = {
        "kind": "transfer",
        "from_model": name_a or steer.metadata.base_model,
        "from_steer": steer.name,
        "from_base_model": steer.metadata.base_model,
        "from_recommended_strength": steer.metadata.recommended_strength,
        "form": cfg.form,
        "ridge": cfg.ridge,
        "shared_tokens": anc.shared_total,
        "anchors": len(anc.fit),
        "heldout": len(anc.heldout),
        "fit_r2": round(q_fit["r2"], 6),
        "heldout_r2": round(q_held["r2"], 6) if q_held else None,
        "heldout_cosine": round(q_held["cosine"], 6) if q_held else None,
        "logit_shift_rms_source": rms_a,
        "logit_shift_rms_target": rms_b,
        "strength_rule": "recommended = source strength * rms_source / rms_target "
                         "(RMS of the centred logit shift per unit strength on each model's "
                         "own hidden states over calibration sentences)",
    }
    if steer.metadata.source:
        source["from_source"] = steer.metadata.source
    out = transfer_steer(steer, m, cfg.form, source=source, base_model=name_b,
                         recommended_strength=round(rec, 4) if rec is not None else None)
    return out, report
