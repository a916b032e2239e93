"""Highlight: which spans of a text a steer explains best.

For each token ``t_i`` of a text the *evidence* is the log-likelihood difference::

    score_i = log p_steered(t_i | t_<i) - log p_against(t_i | t_<i)

between the model steered at ``strength`` and the model at ``against`` (default 0, the plain
model). A positive score means the steer (at that strength) makes the token more likely: the
text "sounds like" the side the strength moves towards. The paper's lens (LM-Steer, section
"LM-Steer as a text analyser") compares +1 and -1; ``against=-strength`` gives that contrast.

The best spans are found by dynamic programming (:func:`best_spans`): at most ``k``
non-adjacent spans of at most ``max_len`` tokens each, maximising the summed score, in
``O(k * n * log max_len)`` vectorised numpy operations.

This module is light on purpose: :func:`best_spans` and the renderers (:func:`to_json`,
:func:`to_html`, :func:`to_ansi`) import neither torch nor transformers (numpy, lazily),
so a server route
that gets per-token scores from an engine's prompt logprobs can reuse them. Only
:func:`token_scores` (the transformers path) imports torch, lazily.
"""

from __future__ import annotations

import html as _html
import json
import math
import os
import sys
from dataclasses import dataclass
from typing import IO, Sequence

#: Default number of spans and their longest length (tokens).
DEFAULT_K = 3
DEFAULT_MAX_LEN = 8


@dataclass(frozen=True)
class Span:
    """A highlighted span: tokens ``start`` (inclusive) to ``end`` (exclusive)."""

    start: int
    end: int
    score: float
    """Sum of the per-token scores over the span."""

    def __iter__(self):  # allows ``start, end, score = span``
        return iter((self.start, self.end, self.score))


def _window_max(a, width: int):
    """``out[i] = max(a[max(0, i - width + 1) : i + 1])`` for every ``i`` (numpy, by
    doubling: ``O(len(a) * log(width))``)."""
    import numpy as np

    n = len(a)
    padded = np.concatenate([np.full(width - 1, -np.inf), a])
    m, w = padded, 1
    while 2 * w <= width:
        m = np.maximum(m[:-w], m[w:])  # m[t] = max(padded[t : t + 2w])
        w *= 2
    return np.maximum(m[:n], m[width - w: width - w + n])


def best_spans(scores: Sequence[float], k: int = DEFAULT_K,
               max_len: int = DEFAULT_MAX_LEN) -> list[Span]:
    """At most ``k`` spans of at most ``max_len`` tokens maximising the summed score.

    Spans are disjoint and non-adjacent (at least one token between two spans, so that each
    is shown as its own block), and each has a positive sum (a span that does not raise the
    total is never chosen). Returned sorted by ``start``; ``end`` is exclusive.

    Dynamic programme over prefixes: ``best[j][i]`` is the best total over ``scores[:i]``
    with at most ``j`` spans; either token ``i-1`` is outside every span
    (``best[j][i-1]``), or a span ``[s, i)`` of at most ``max_len`` tokens ends there and
    token ``s-1`` is a gap::

        best[j][i] = max(best[j][i-1],
                         prefix[i] + max_{i-max_len <= s < i} (best[j-1][s-1] - prefix[s]))

    (``best[j-1][-1] = 0``). Each row is computed at once with numpy: the inner maximum is
    a sliding-window maximum (``O(n log max_len)``) and the outer one a running maximum, so
    the whole search is ``O(k * n * log max_len)``, vectorised, with no Python loop over
    tokens; the spans are then read back from the rows.
    """
    import numpy as np

    k, max_len = int(k), int(max_len)
    if k < 0 or max_len < 1:
        raise ValueError(f"best_spans: k={k} must be >= 0 and max_len={max_len} >= 1")
    vals = np.asarray([float(x) for x in scores] if not isinstance(scores, np.ndarray)
                      else scores, dtype=np.float64).reshape(-1)
    bad = np.flatnonzero(~np.isfinite(vals))
    if bad.size:
        raise ValueError(f"best_spans: scores must be finite; positions {bad[:5].tolist()} "
                         "are not")
    n = len(vals)
    if n == 0 or k == 0:
        return []
    prefix = np.concatenate([[0.0], np.cumsum(vals)])
    width = min(max_len, n)
    rows = [np.zeros(n + 1)]
    for _ in range(k):
        prev = rows[-1]
        # a[s] = best[j-1][s-1] - prefix[s]: the value of starting a span at token s
        a = np.concatenate([[0.0], prev[:n - 1]]) - prefix[:n]
        cand = prefix[1:] + _window_max(a, width)  # best total with a span ending at i
        row = np.maximum.accumulate(np.concatenate([[0.0], cand]))
        rows.append(row)
        if np.array_equal(row, prev):
            break  # one more span does not help: neither will more
    spans: list[Span] = []
    i, j = n, len(rows) - 1
    while i > 0 and j > 0:
        row, prev = rows[j], rows[j - 1]
        if row[i] <= 0.0:
            break
        # the first position where the row reaches row[i]: a span ends there
        end = int(np.searchsorted(row, row[i], side="left"))
        lo = max(0, end - width)
        starts = np.arange(lo, end)
        gain = np.where(starts >= 1, prev[np.maximum(starts - 1, 0)], 0.0) - prefix[starts]
        s = int(starts[len(gain) - 1 - int(np.argmax(gain[::-1]))])  # the shortest best span
        score = math.fsum(vals[s:end].tolist())  # its sum, exactly rounded
        if score <= 0.0:  # the prefix sums' rounding made it look like a gain: one span fewer
            j -= 1
            continue
        spans.append(Span(s, end, score))
        i, j = s - 1, j - 1
    spans.reverse()
    return spans


# ----------------------------------------------------------------------------------------
# Rendering: tokens (text pieces whose concatenation is the text), scores, spans.
# ----------------------------------------------------------------------------------------

def _check(tokens: Sequence[str], scores: Sequence[float | None], spans: Sequence[Span]):
    if len(tokens) != len(scores):
        raise ValueError(f"{len(tokens)} tokens but {len(scores)} scores: give one score per "
                         "token (None for a token without one)")
    for sp in spans:
        if not (0 <= sp.start < sp.end <= len(tokens)):
            raise ValueError(f"span {tuple(sp)} lies outside the {len(tokens)} tokens")


def to_json(tokens: Sequence[str], scores: Sequence[float | None], spans: Sequence[Span],
            **info) -> dict:
    """A JSON-ready dict: ``tokens``, ``scores``, ``spans`` (with their text) and ``info``."""
    _check(tokens, scores, spans)
    return {
        **info,
        "text": "".join(tokens),
        "tokens": list(tokens),
        "scores": [None if s is None else round(float(s), 6) for s in scores],
        "spans": [{"start": sp.start, "end": sp.end, "score": round(sp.score, 6),
                   "text": "".join(tokens[sp.start:sp.end])} for sp in spans],
    }


def _scale(scores: Sequence[float | None]) -> float:
    m = max((abs(s) for s in scores if s is not None), default=0.0)
    return m if m > 0 else 1.0


def _span_of(spans: Sequence[Span], n: int) -> list[int]:
    """Per token: index of the span it belongs to, or -1."""
    owner = [-1] * n
    for r, sp in enumerate(spans):
        for i in range(sp.start, sp.end):
            owner[i] = r
    return owner


def to_html(tokens: Sequence[str], scores: Sequence[float | None], spans: Sequence[Span],
            title: str = "vllm-steer highlight", subtitle: str = "") -> str:
    """A self-contained HTML page (inline CSS, no scripts, no external resources).

    Each token's background is green (score > 0: the steer explains it) or red (< 0), with an
    opacity proportional to ``|score|``; the best spans are boxed and listed below the text;
    hovering a token shows its score.
    """
    _check(tokens, scores, spans)
    scale = _scale(scores)
    owner = _span_of(spans, len(tokens))
    parts = []
    for i, (tok, s) in enumerate(zip(tokens, scores, strict=True)):
        if s is None:
            style, tip = "", "no score"
        else:
            a = min(1.0, abs(s) / scale) * 0.75
            rgb = "40,167,69" if s > 0 else "220,53,69"
            style, tip = f"background:rgba({rgb},{a:.3f})", f"{s:+.3f}"
        cls = ' class="span"' if owner[i] >= 0 else ""
        open_ = i == 0 or owner[i] != owner[i - 1]
        if owner[i] >= 0 and open_:
            parts.append(f'<span class="box" title="span {owner[i] + 1}">')
        parts.append(f'<span{cls} style="{style}" title="{tip}">{_html.escape(tok)}</span>')
        close = i == len(tokens) - 1 or owner[i] != owner[i + 1]
        if owner[i] >= 0 and close:
            parts.append(f'<sup class="n">{owner[i] + 1}</sup></span>')
    rows = "".join(
        f"<tr><td>{r + 1}</td><td>{sp.start}&ndash;{sp.end}</td><td>{sp.score:+.3f}</td>"
        f"<td>{_html.escape(''.join(tokens[sp.start:sp.end]))}</td></tr>"
        for r, sp in enumerate(spans))
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{_html.escape(title)}</title>
<style>
body {{ font-family: system-ui, sans-serif; max-width: 52em; margin: 2em auto; color: #222; }}
.text {{ font-family: ui-monospace, monospace; white-space: pre-wrap; line-height: 1.9;
         border: 1px solid #ddd; padding: 1em; border-radius: 6px; }}
.box {{ outline: 2px solid #1f6feb; border-radius: 3px; }}
.n {{ color: #1f6feb; font-size: 0.7em; }}
table {{ border-collapse: collapse; margin-top: 1em; }}
td, th {{ border: 1px solid #ddd; padding: 0.3em 0.6em; text-align: left; }}
.legend {{ color: #555; font-size: 0.9em; }}
</style></head><body>
<h2>{_html.escape(title)}</h2>
<p class="legend">{_html.escape(subtitle)}</p>
<p class="legend">Green: the steer makes the token more likely; red: less likely
(opacity &prop; |score|, largest |score| = {scale:.3f}). Boxed: the best spans.</p>
<div class="text">{''.join(parts)}</div>
<table><tr><th>#</th><th>tokens</th><th>score</th><th>text</th></tr>{rows}</table>
</body></html>
"""


def use_color(stream: IO | None = None, mode: str = "auto") -> bool:
    """Whether to emit ANSI colours: ``always``/``never``, or ``auto`` = a tty and no
    ``NO_COLOR`` in the environment (https://no-color.org)."""
    if mode not in ("auto", "always", "never"):
        raise ValueError(f"color mode {mode!r}: choose auto, always or never")
    if mode != "auto":
        return mode == "always"
    if os.environ.get("NO_COLOR"):
        return False
    stream = stream if stream is not None else sys.stdout
    return bool(getattr(stream, "isatty", lambda: False)())


def to_ansi(tokens: Sequence[str], scores: Sequence[float | None], spans: Sequence[Span],
            color: bool = True) -> str:
    """Terminal text. With colour: tokens tinted green/red by score (bold when
    ``|score| >= half the largest``), spans on a blue background with their number. Without
    colour: spans are marked ``[[1: ...]]``. Followed by one line per span."""
    _check(tokens, scores, spans)
    scale = _scale(scores)
    owner = _span_of(spans, len(tokens))
    out = []
    for i, (tok, s) in enumerate(zip(tokens, scores, strict=True)):
        opening = owner[i] >= 0 and (i == 0 or owner[i - 1] != owner[i])
        closing = owner[i] >= 0 and (i == len(tokens) - 1 or owner[i + 1] != owner[i])
        if color:
            codes = []
            if s is not None and abs(s) >= 0.1 * scale:
                codes.append("32" if s > 0 else "31")
                if abs(s) >= 0.5 * scale:
                    codes.append("1")
            if owner[i] >= 0:
                codes.append("44;97")
            tag = f"\x1b[44;97;1m{owner[i] + 1}:\x1b[0m" if opening else ""
            out.append(tag + (f"\x1b[{';'.join(codes)}m{tok}\x1b[0m" if codes else tok))
        else:
            out.append((f"[[{owner[i] + 1}: " if opening else "") + tok + ("]]" if closing else ""))
    lines = ["".join(out)]
    for r, sp in enumerate(spans):
        lines.append(f"  span {r + 1}: tokens {sp.start}-{sp.end}  score {sp.score:+.3f}  "
                     f"{''.join(tokens[sp.start:sp.end])!r}")
    if not spans:
        lines.append("  (no span with a positive score)")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------
# Scores from a transformers model (the only part that needs torch).
# ----------------------------------------------------------------------------------------

def text_pieces(tokenizer, text: str, prefix: str | None = None) -> tuple[list[int], list[str]]:
    """Token ids of ``text`` (as ``hf.token_logprobs`` tokenises it, no special tokens) and
    the text piece of each token, such that ``"".join(pieces) == text``."""
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offs = enc["input_ids"], enc["offset_mapping"]
    starts = [0] + [max(o[0], 0) for o in offs[1:]]
    # keep starts non-decreasing (byte-level tokens of one character share offsets)
    for i in range(1, len(starts)):
        starts[i] = max(starts[i], starts[i - 1])
    ends = starts[1:] + [len(text)]
    pieces = [text[a:b] for a, b in zip(starts, ends, strict=True)]
    return list(ids), pieces


def default_prefix(tokenizer) -> str:
    """Context put before the text so its first token gets a score too: the tokenizer's BOS
    token, else its EOS token, else nothing (then the first token has no score)."""
    return tokenizer.bos_token or tokenizer.eos_token or ""


def token_scores(model, tokenizer, text: str, steer, strength: float, against: float = 0.0,
                 prefix: str | None = None, max_length: int | None = None
                 ) -> tuple[list[str], list[float | None]]:
    """Pieces of ``text`` and, per token, ``log p(strength) - log p(against)``
    (via :func:`vllm_steer.hf.token_logprobs`). A token without a score gets ``None``."""
    from vllm_steer.hf import token_logprobs

    if strength == against:
        raise ValueError(f"--strength {strength} equals --against {against}: the scores would "
                         "all be 0; pick two different strengths")
    prefix = default_prefix(tokenizer) if prefix is None else prefix
    ids, pieces = text_pieces(tokenizer, text)
    if not ids:
        raise ValueError("the text is empty after tokenisation")
    if max_length and len(ids) > max_length:
        first = next((i + 1 for i, p in enumerate(pieces) if p), len(pieces))
        if first > max_length:  # the cut would leave no whole character
            raise ValueError(f"--max-tokens {max_length} cuts inside the text's first "
                             f"character, which takes {first} tokens: pass --max-tokens "
                             f"{first} or more")
        text = "".join(pieces[:max_length])  # whole characters: a split one is left out
        ids, pieces = text_pieces(tokenizer, text)
    from vllm_steer.train.hidden import model_window

    window = model_window(model)
    n_prefix = len(tokenizer(prefix, add_special_tokens=False)["input_ids"]) if prefix else 0
    if window and n_prefix + len(ids) > window:
        raise ValueError(f"the text is {len(ids)} tokens (with the prefix, "
                         f"{n_prefix + len(ids)}) but the model reads at most {window}: "
                         f"pass --max-tokens {window - n_prefix} or less")
    kw = dict(prefixes=[prefix] if prefix else None)
    name = steer.name
    text_in = text
    a = token_logprobs(model, tokenizer, [text_in], {name: steer}, {name: strength}, **kw)[0]
    b = (token_logprobs(model, tokenizer, [text_in], {name: steer}, {name: against}, **kw)[0]
         if against else token_logprobs(model, tokenizer, [text_in], **kw)[0])
    diff = (a - b).tolist()
    missing = len(pieces) - len(diff)
    if missing < 0:
        raise RuntimeError(f"got {len(diff)} scores for {len(pieces)} tokens: the tokenizer "
                           "splits the text differently with the prefix; pass --prefix ''")
    return pieces, [None] * missing + diff


def dump_json(obj: dict, fp: IO) -> None:
    json.dump(obj, fp, indent=2, ensure_ascii=False)
    fp.write("\n")
