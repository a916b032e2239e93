r"""Explain: read a steer through the tokens along its top singular directions.

Row-vector convention (semantics: see :mod:`vllm_steer.reference`): the steer maps a final
hidden state ``c`` to ``c + eps * c S`` with ``S = P1 @ P2.T`` [d, d] (the paper's column-form
``W = P2 P1^T = S^T``). Its singular value decomposition ``S = sum_i sigma_i a_i b_i^T`` is
computed from the factors without forming ``d x d``: ``P1 = Q1 R1``, ``P2 = Q2 R2`` (thin QR),
``R1 R2^T = U Sigma V^T`` (an ``r x r`` SVD), so ``a_i = Q1 U[:, i]`` and ``b_i = Q2 V[:, i]``.

The change of the logit of token ``v`` (output embedding ``e_v``) in context ``c`` is::

    eps * (c S) . e_v = eps * sum_i sigma_i (c . a_i) (b_i . e_v)

so ``a_i`` (the *input* side of ``S``; the right singular vectors of ``W``) says which contexts
a direction reads, and ``b_i`` (the *output* side: the left singular vectors of ``W``, in the
span of ``P2``) says which tokens it pushes up or down. We read tokens along ``b_i``: the
tokens with the highest and lowest ``e_v . b_i`` are those whose logits direction ``i`` moves
most, as the paper does (its analysis projects the embeddings on the right singular vectors
of ``P1 P2^T``, i.e. ``b_i``).

A singular pair is defined up to a joint sign flip ``(a_i, b_i) -> (-a_i, -b_i)``. We orient
each direction so that its "+" tokens are the ones a *positive* strength raises in the model's
typical context: the mean of ``c . a_i`` over the final hidden states of a few plain sentences
is made positive (``agreement`` = the fraction of those contexts with ``c . a_i > 0``). Without
contexts, the side with the larger extreme projection is "+".
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Sequence

import torch

from vllm_steer.format import Steer

DEFAULT_DIRECTIONS = 5
DEFAULT_TOP_TOKENS = 12
_WORD = re.compile(r"^ [A-Za-z]{3,}$")


@dataclass
class Directions:
    """Top singular directions of ``S = P1 P2^T`` (row form)."""

    sigma: torch.Tensor  # [k]
    inputs: torch.Tensor  # [k, d]  a_i: which contexts the direction reads
    outputs: torch.Tensor  # [k, d] b_i: which tokens it moves
    total_energy: float  # sum of all sigma^2 (= ||S||_F^2)
    agreement: list[float | None] = field(default_factory=list)


def steer_directions(p1: torch.Tensor, p2: torch.Tensor, k: int = DEFAULT_DIRECTIONS,
                     contexts: torch.Tensor | None = None) -> Directions:
    """Top ``k`` singular triplets of ``S = p1 @ p2.T`` via QR of both factors and an SVD of
    the ``r x r`` core (never forms ``d x d``), oriented as the module doc says."""
    if p1.shape != p2.shape or p1.dim() != 2:
        raise ValueError(f"P1 {tuple(p1.shape)} and P2 {tuple(p2.shape)} must be equal "
                         "[hidden, rank] shapes")
    q1, r1 = torch.linalg.qr(p1.double())
    q2, r2 = torch.linalg.qr(p2.double())
    u, s, vh = torch.linalg.svd(r1 @ r2.T)
    k = min(int(k), s.shape[0])
    a = (q1 @ u[:, :k]).T  # [k, d]
    b = (q2 @ vh[:k].T).T  # [k, d]
    agreement: list[float | None] = []
    for i in range(k):
        if contexts is not None and contexts.numel():
            proj = contexts.double() @ a[i]
            flip = float(proj.mean()) < 0
            agree = float(((-proj if flip else proj) > 0).double().mean())
        else:
            flip, agree = False, None
        if flip:
            a[i], b[i] = -a[i], -b[i]
        agreement.append(agree)
    return Directions(s[:k].float(), a.float(), b.float(), float((s ** 2).sum()), agreement)


def orient_by_extremes(dirs: Directions, E: torch.Tensor) -> Directions:
    """Without contexts: flip each direction so that the larger |projection| lies on "+"."""
    proj = E.float() @ dirs.outputs.T  # [vocab, k]
    for i in range(dirs.outputs.shape[0]):
        if -float(proj[:, i].min()) > float(proj[:, i].max()):
            dirs.outputs[i], dirs.inputs[i] = -dirs.outputs[i], -dirs.inputs[i]
    return dirs


def word_like(piece: str) -> bool:
    """A leading space then 3+ ASCII letters (a whole word, not a fragment or symbol)."""
    return bool(_WORD.match(piece))


@dataclass
class DirectionTokens:
    index: int
    sigma: float
    share: float  # sigma^2 / ||S||_F^2
    agreement: float | None
    top: list[tuple[str, float]]  # (token, projection) highest first
    bottom: list[tuple[str, float]]  # lowest first


def word_end_probability(model, tokenizer, ids: Sequence[int], pieces: Sequence[str],
                         batch_size: int = 512, context: str = "The") -> dict[int, float]:
    """For each token id: the model's probability that the *next* token starts a new word
    (begins with a space, a newline or punctuation, or ends the text), after ``context`` and
    the token. High for whole words (" idiot"), low for fragments (" affili" -> "ate"): a
    dictionary-free word filter. (Without a context the model's first-position predictions
    are uninformative, hence the short neutral one.)"""
    import string

    starts_new = torch.tensor([bool(p) and (p[0] in " \n\t" or p[0] in string.punctuation)
                               for p in pieces])
    for t in (tokenizer.eos_token_id,):
        if t is not None and t < len(starts_new):
            starts_new[t] = True
    device = next(model.parameters()).device
    out: dict[int, float] = {}
    ids = list(dict.fromkeys(int(i) for i in ids))
    pre = tokenizer(context, add_special_tokens=False)["input_ids"] if context else []
    with torch.no_grad():
        for i in range(0, len(ids), batch_size):
            chunk = ids[i:i + batch_size]
            x = torch.tensor([pre + [t] for t in chunk], device=device)
            logits = model(input_ids=x).logits[:, -1]
            probs = torch.softmax(logits.float(), -1)[:, :len(starts_new)].cpu()
            for t, p in zip(chunk, probs[:, starts_new].sum(-1).tolist(), strict=True):
                out[t] = p
    return out


def direction_tokens(dirs: Directions, E: torch.Tensor, pieces: Sequence[str],
                     n: int = DEFAULT_TOP_TOKENS, words_only: bool = True,
                     is_word=None, pool: int = 8) -> list[DirectionTokens]:
    """For each direction: the ``n`` tokens with the highest and lowest ``e_v . b_i``
    (among word-like tokens when ``words_only``). ``pieces[v]`` is token ``v`` decoded.

    ``is_word`` (optional): a function from a list of token ids to a list of bools, applied
    to the ``pool * n`` best candidates of each end to drop word fragments (see
    :func:`word_end_probability`); candidates it rejects are skipped."""
    if len(pieces) < E.shape[0]:
        raise ValueError(f"{len(pieces)} token strings for {E.shape[0]} embedding rows")
    keep = torch.tensor([word_like(p) for p in pieces[:E.shape[0]]]) if words_only else None
    if keep is not None and int(keep.sum()) < 2 * n:
        keep = None  # too few words (e.g. a toy vocabulary): use every token
    proj = E.float() @ dirs.outputs.T  # [vocab, k]
    out = []
    for i in range(dirs.outputs.shape[0]):
        col = proj[:, i].clone()
        idx = torch.arange(col.shape[0])
        if keep is not None:
            col, idx = col[keep], idx[keep]
        order = torch.argsort(col, descending=True)
        ends = []
        for cand in (order[:pool * n], order.flip(0)[:pool * n]):
            if is_word is not None:
                ok = is_word([int(idx[j]) for j in cand])
                cand = [j for j, good in zip(cand, ok, strict=True) if good] or list(cand)
            ends.append([(pieces[int(idx[j])], float(col[j])) for j in cand[:n]])
        top, bottom = ends
        s = float(dirs.sigma[i])
        out.append(DirectionTokens(i + 1, s, s * s / dirs.total_energy if dirs.total_energy
                                   else 0.0, dirs.agreement[i] if dirs.agreement else None,
                                   top, bottom))
    return out


def _fmt_tokens(items) -> str:
    return ", ".join(t.strip().replace("|", "\\|") for t, _ in items)


def markdown_table(rows: Sequence[DirectionTokens], labels: dict | None = None) -> str:
    """The explain table in Markdown: one row per direction."""
    labels = labels or {}
    pos = labels.get("positive", "positive strength")
    head = ("| dir | sigma | share of ‖S‖² | agreement | + end (raised by "
            f"{pos}) | − end (lowered) |\n|---:|---:|---:|---:|---|---|\n")
    body = "".join(
        f"| {r.index} | {r.sigma:.4g} | {r.share:.1%} | "
        f"{'—' if r.agreement is None else f'{r.agreement:.0%}'} | "
        f"{_fmt_tokens(r.top)} | {_fmt_tokens(r.bottom)} |\n" for r in rows)
    return head + body


def plot(dirs_all_sigma: torch.Tensor, E: torch.Tensor, dirs: Directions,
         pieces: Sequence[str], path: str, title: str = "", label_n: int = 12) -> None:
    """PNG: the singular value spectrum, and word-like tokens projected on directions 1-2
    with the extremes labelled."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 5.5), gridspec_kw={"width_ratios": [1, 2]})
    s = dirs_all_sigma.float().numpy()[:64]
    axes[0].bar(range(1, len(s) + 1), s, color="#1f6feb")
    axes[0].set_xlabel("direction")
    axes[0].set_ylabel("singular value σ")
    axes[0].set_title("spectrum of the steer" + (f" (top 64 of {len(dirs_all_sigma)})"
                                                  if len(dirs_all_sigma) > 64 else ""))
    ax = axes[1]
    keep = [i for i, p in enumerate(pieces[:E.shape[0]]) if word_like(p)] or list(
        range(E.shape[0]))
    idx = torch.tensor(keep)
    k = min(2, dirs.outputs.shape[0])
    proj = (E[idx].float() @ dirs.outputs[:k].T).numpy()
    x = proj[:, 0]
    y = proj[:, 1] if k > 1 else proj[:, 0] * 0
    ax.scatter(x, y, s=3, alpha=0.25, color="#888888", linewidths=0)
    order = x.argsort()
    # The extremes of direction 1, each in a column of labels in an empty margin of its side
    # (clustered points would make labels at the points overlap), with a thin leader line.
    span = float(x.max() - x.min()) or 1.0
    ax.set_xlim(float(x.min()) - 0.45 * span, float(x.max()) + 0.45 * span)
    for js, right, color in ((list(order[:label_n]), False, "#cf222e"),
                             (list(order[-label_n:]), True, "#1a7f37")):
        js = sorted(js, key=lambda j: -y[j])
        for r, j in enumerate(js):
            ax.annotate(pieces[keep[j]].strip(), xy=(x[j], y[j]),
                        xytext=(0.99 if right else 0.01, 0.95 - r * 0.9 / max(len(js) - 1, 1)),
                        textcoords="axes fraction", ha="right" if right else "left",
                        va="center", fontsize=7, color=color,
                        arrowprops=dict(arrowstyle="-", lw=0.4, color=color, alpha=0.4))
    if k > 1:
        order_y = y.argsort()
        for j in list(order_y[:label_n // 2]) + list(order_y[-label_n // 2:]):
            ax.annotate(pieces[keep[j]].strip(), (x[j], y[j]), fontsize=7, color="#0550ae")
    ax.axhline(0, color="#ccc", lw=0.8)
    ax.axvline(0, color="#ccc", lw=0.8)
    ax.set_xlabel("projection on direction 1 (+ = raised by positive strength)")
    ax.set_ylabel("projection on direction 2" if k > 1 else "")
    ax.set_title("word-like tokens along the top two directions")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def explain(steer: Steer, E: torch.Tensor, pieces: Sequence[str], k: int = DEFAULT_DIRECTIONS,
            n: int = DEFAULT_TOP_TOKENS, contexts: torch.Tensor | None = None,
            words_only: bool = True, is_word=None) -> tuple[Directions, list[DirectionTokens]]:
    """Directions (oriented by ``contexts`` when given, else by extremes) and their tokens."""
    dirs = steer_directions(steer.p1, steer.p2, k, contexts)
    if contexts is None:
        dirs = orient_by_extremes(dirs, E)
    return dirs, direction_tokens(dirs, E, pieces, n, words_only, is_word)


def all_singular_values(steer: Steer) -> torch.Tensor:
    """Every singular value of ``S`` (rank many), from the ``r x r`` core."""
    r1 = torch.linalg.qr(steer.p1.double())[1]
    r2 = torch.linalg.qr(steer.p2.double())[1]
    return torch.linalg.svdvals(r1 @ r2.T).float()


def token_pieces(tokenizer, vocab_rows: int) -> list[str]:
    """Each token id's text as it reads inside a text, word-start space included (ids beyond
    the tokenizer's vocabulary give ""). A token is decoded after a fixed one and that one's
    text removed: SentencePiece tokenizers (Llama 2, Mistral, Phi-3) strip the leading space
    of the *first* token of a decoded sequence, so decoding ``▁word`` alone gives ``word``."""
    n = min(vocab_rows, len(tokenizer))
    return pieces_of(tokenizer, range(n)) + [""] * (vocab_rows - n)


def pieces_of(tokenizer, ids) -> list[str]:
    """The text of each token of ``ids`` as it reads inside a text (:func:`token_pieces`)."""
    ids = list(ids)
    ref = list(tokenizer("a", add_special_tokens=False)["input_ids"])
    head = tokenizer.decode(ref) if ref else ""
    pieces = []
    for i, s in zip(ids, tokenizer.batch_decode([ref + [i] for i in ids]), strict=True):
        pieces.append(s[len(head):] if ref and s.startswith(head) else tokenizer.decode([i]))
    return pieces
