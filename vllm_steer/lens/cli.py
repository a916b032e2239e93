"""``vllm-steer transfer | highlight | explain | score``: the lens commands.

Heavy imports (torch, transformers) happen inside the command functions, so building the
parser stays fast.
"""

from __future__ import annotations

import argparse
import json
import sys

from vllm_steer.usage import int_at_least


def _load_lm_steer(path: str):
    """The LM-Steer file at ``path``; a steer of another kind (a control vector) is refused
    naming what the lens reads, not with the LM-Steer reader's advice."""
    from vllm_steer.format import load_steer
    from vllm_steer.kinds import LM_STEER, kind_of_file

    kind = kind_of_file(path)
    if kind is not LM_STEER:
        raise ValueError(f"--steer {path}: a {kind.name} steer, not an LM-Steer; the lens "
                         "reads LM-Steer files, whose matrix W it transfers, highlights, "
                         f"explains and scores (`vllm-steer info {path}` shows this file)")
    return load_steer(path)


def _steer_and_model(args):
    from vllm_steer.lens.lm import load_lm

    steer = _load_lm_steer(args.steer)
    name = args.model or steer.metadata.base_model
    if not name:
        raise ValueError(f"{args.steer} names no base_model in its metadata: pass --model")
    model, tok = load_lm(name)
    from vllm_steer.lens.lm import output_embeddings

    width = int(output_embeddings(model).shape[1])
    if width != steer.hidden_size:
        raise ValueError(f"{args.steer} has hidden size {steer.hidden_size} but {name}'s LM head "
                         f"takes {width}: the steer is for another model (`vllm-steer "
                         "transfer` carries a steer to this one)")
    return steer, model, tok, name


def _strength(args, steer) -> float:
    if args.strength is not None:
        return float(args.strength)
    return float(steer.metadata.recommended_strength or 5.0)


def _read_text(args) -> str:
    """The text of ``--text`` or ``--file`` (the parser takes exactly one of them)."""
    if args.file is not None:
        with open(args.file, encoding="utf-8") as f:
            return f.read()
    return args.text


def _labels_line(steer) -> str:
    lab = steer.metadata.labels or {}
    if not lab:
        return ""
    sides = [f"{k} strength -> {lab[k]}" for k in ("positive", "negative") if k in lab]
    harmful = lab.get("harmful")  # which side moves towards harmful text, not a direction
    other = [f"{k}: {v}" for k, v in sorted(lab.items())
             if k not in ("positive", "negative", "harmful")]
    return ", ".join(sides + ([f"the {harmful} side is the harmful one"] if harmful else [])
                     + other)


# --------------------------------------------------------------------------- transfer

def cmd_transfer(args) -> int:
    from vllm_steer.format import save_steer
    from vllm_steer.lens.lm import load_lm
    from vllm_steer.lens.transfer import TransferConfig, transfer

    steer = _load_lm_steer(args.steer)
    given = dict(anchors=args.anchors, heldout=args.heldout, ridge=args.ridge, form=args.form)
    cfg = TransferConfig(**{k: v for k, v in given.items() if v is not None})
    model_a, tok_a = load_lm(args.from_model)
    model_b, tok_b = load_lm(args.to_model)
    texts = None
    if args.calibration_file:
        with open(args.calibration_file, encoding="utf-8") as f:
            texts = [line.strip() for line in f if line.strip()]
    out, report = transfer(steer, model_a, tok_a, model_b, tok_b, cfg, args.from_model,
                           args.to_model, texts)
    if args.name:
        out.metadata.name = args.name
    save_steer(args.out, out)
    print(f"transferred {steer.name!r} ({args.from_model}, hidden {steer.hidden_size}) -> "
          f"{args.to_model} (hidden {out.hidden_size}), form {cfg.form}")
    for line in report.lines():
        print("  " + line)
    print(f"wrote {args.out}")
    return 0


# --------------------------------------------------------------------------- highlight

def cmd_highlight(args) -> int:
    from vllm_steer.lens.highlight import (best_spans, dump_json, to_ansi, to_html, to_json,
                                           token_scores, use_color)

    text = _read_text(args)
    steer, model, tok, name = _steer_and_model(args)
    strength = _strength(args, steer)
    pieces, scores = token_scores(model, tok, text, steer, strength, args.against,
                                  prefix=args.prefix, max_length=args.max_tokens)
    spans = best_spans([0.0 if s is None else s for s in scores], args.spans, args.max_span)
    info = dict(steer=steer.name, model=name, strength=strength, against=float(args.against),
                labels=steer.metadata.labels, k=args.spans, max_span=args.max_span)
    sub = (f"steer {steer.name} at strength {strength:g} vs {args.against:g} on {name}; "
           f"score = log p(steered) - log p(baseline) per token. {_labels_line(steer)}")
    if args.json:
        d = to_json(pieces, scores, spans, **info)
        if args.json == "-":
            dump_json(d, sys.stdout)
        else:
            with open(args.json, "w", encoding="utf-8") as f:
                dump_json(d, f)
    if args.html:
        with open(args.html, "w", encoding="utf-8") as f:
            f.write(to_html(pieces, scores, spans, title=f"highlight: {steer.name}",
                            subtitle=sub))
    if args.json != "-":
        print(f"# {sub}")
        print(to_ansi(pieces, scores, spans, color=use_color(sys.stdout, args.color)))
    return 0


# --------------------------------------------------------------------------- explain

def _domain_line(steer) -> str:
    """What ``explain`` leaves out of ``S``: a domain component served with the steer."""
    meta = steer.metadata
    if meta.domain != "with_steer" or getattr(steer, "domain_p1", None) is None:
        return ""
    return (f" The steer's domain component (rank {steer.domain_p1.shape[1]}), served with it "
            f"at domain strength {meta.domain_strength:g} whatever the request's strength, is "
            "not in S: these are the directions that the strength scales.")


def cmd_explain(args) -> int:
    import torch

    from vllm_steer.lens.explain import (all_singular_values, explain, markdown_table, plot,
                                         token_pieces, word_end_probability)
    from vllm_steer.lens.lm import CALIBRATION_TEXTS, final_hidden_states, output_embeddings

    steer, model, tok, name = _steer_and_model(args)
    E = output_embeddings(model).float().cpu()  # its width checked by _steer_and_model
    contexts = None
    if not args.no_orient:
        contexts = torch.cat([e.hidden for e in final_hidden_states(
            model, tok, list(CALIBRATION_TEXTS))]).cpu()
    pieces = token_pieces(tok, E.shape[0])
    is_word = None
    if not args.all_tokens and args.word_threshold > 0:
        cache: dict[int, float] = {}

        def is_word(ids):
            todo = [i for i in ids if i not in cache]
            if todo:
                cache.update(word_end_probability(model, tok, todo, pieces))
            return [cache[i] >= args.word_threshold for i in ids]

    dirs, rows = explain(steer.to(dtype=torch.float32), E, pieces, args.directions, args.top,
                         contexts, words_only=not args.all_tokens, is_word=is_word)
    table = markdown_table(rows, steer.metadata.labels)
    header = (f"Steer `{steer.name}` on `{name}`: rank {steer.metadata.rank}, top "
              f"{len(rows)} directions of S = P1 P2^T; tokens read along the output side "
              f"(b_i). {_labels_line(steer)}{_domain_line(steer)}\n\n")
    if args.markdown:
        with open(args.markdown, "w", encoding="utf-8") as f:
            f.write(header + table)
    print(header + table, end="")
    if args.png:
        plot(all_singular_values(steer), E, dirs, pieces, args.png,
             title=f"{steer.name} on {name}")
        print(f"wrote {args.png}")
    return 0


# --------------------------------------------------------------------------- score

#: Why a text gets no score, and what helps.
_NO_SCORE_WHY = ("without a --prefix a text's first token has no context to be scored in, "
                 "so a text needs two tokens or more, counted after --max-tokens; with a "
                 "--prefix, one")


def cmd_score(args) -> int:
    from vllm_steer.lens import score as S

    steer, model, tok, name = _steer_and_model(args)
    strengths = list(args.strengths) if args.strengths else list(S.DEFAULT_STRENGTHS)
    strength = _strength(args, steer)
    if args.dataset:
        pos = args.positive_label or S.DATASETS[args.dataset][1]
        rows = S.read_dataset(args.dataset, args.data_dir, args.split)
        labels = sorted({lab for _, lab in rows})
        if pos not in labels:
            raise ValueError(f"--positive-label {pos!r} is not a label of {args.dataset} "
                             f"(labels: {labels})")
        excluded = 0
        if not args.keep_training_texts:
            train = S.training_texts(steer)
            if train is None:
                print("note: could not rebuild the steer's training texts from its metadata; "
                      "the sample may include them", file=sys.stderr)
            else:
                before = len(rows)
                rows = [r for r in rows if r[0] not in train]
                excluded = before - len(rows)
        rows = S.balanced_sample(rows, args.limit, args.seed)
        if excluded:
            print(f"(left out {excluded} rows the steer was trained on)")
        ev, sc = S.evaluate(model, tok, steer, rows, args.dataset, pos, strength, strengths,
                            args.max_tokens, args.batch_size, args.prefix,
                            progress=not args.quiet)
        print(ev.line())
        if len(ev.by_strength) > 1:
            print("  by strength: " + "; ".join(
                f"+/-{k}: accuracy {v['accuracy']:.1%} AUC {v['auc']:.3f}"
                for k, v in ev.by_strength.items()))
        for lab in sorted(ev.best_strength_by_class):
            print(f"  label {lab}: mean contrast {ev.mean_contrast_by_class[lab]:+.4f}; "
                  f"best strength counts {ev.best_strength_by_class[lab]}")
        if ev.unscored:
            print(f"note: {ev.unscored} of {len(rows)} texts had no token to score and are "
                  f"left out of the accuracy and the AUC ({_NO_SCORE_WHY})", file=sys.stderr)
        if args.json:
            with open(args.json, "w", encoding="utf-8") as f:
                json.dump(S.json_safe(
                    {**ev.__dict__, "model": name, "split": args.split,
                     "excluded_training_rows": excluded,
                     "limit": args.limit, "seed": args.seed,
                     "strengths": sc.strengths,
                     "per_text": [{"label": lab, "loglik": ll} for (_, lab), ll
                                  in zip(rows, sc.loglik, strict=True)]}),
                    f, indent=2, allow_nan=False)
                f.write("\n")
        return 0
    if args.file is not None:
        with open(args.file, encoding="utf-8") as f:
            texts = [line.rstrip("\n") for line in f if line.strip()]
    else:
        texts = [args.text]
    grid = sorted(set(strengths) | {abs(strength), -abs(strength)})
    sc = S.score_texts(model, tok, steer, texts, grid, args.max_tokens, args.batch_size,
                       args.prefix, progress=len(texts) > 8 and not args.quiet)
    con = sc.contrast(strength)
    lab = steer.metadata.labels or {}
    out = []
    for text, row, best, c, n in zip(texts, sc.loglik, sc.best(), con, sc.tokens, strict=True):
        side = None if c is None else "positive" if c > 0 else "negative"
        out.append({"text": text, "tokens_scored": n,
                    "loglik": None if row is None else dict(zip([f"{s:g}" for s in grid], row,
                                                                strict=True)),
                    "best_strength": best, "contrast": c, "side": side,
                    "label": lab.get(side) if side else None})
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(S.json_safe(out), f, indent=2, ensure_ascii=False, allow_nan=False)
            f.write("\n")
    print("strength  " + "  ".join(f"{s:>8g}" for s in grid) + "   best  contrast  side")
    for o, row in zip(out, sc.loglik, strict=True):
        short = o["text"][:60].replace("\n", " ")
        if row is None:
            print("loglik    " + "  ".join(f"{'-':>8}" for _ in grid) +
                  f"  {'-':>5}  {'-':>7}  no score (no token to score)   {short!r}")
            continue
        print("loglik    " + "  ".join(f"{v:8.4f}" for v in row) +
              f"  {o['best_strength']:5g}  {o['contrast']:+.4f}  {o['side']}"
              + (f" ({o['label']})" if o["label"] else "") + f"   {short!r}")
    unscored = sc.scored().count(False)
    if unscored:
        print(f"note: {unscored} of {len(texts)} text(s) had no token to score, so no score "
              f"and no side ({_NO_SCORE_WHY})", file=sys.stderr)
    return 0


# --------------------------------------------------------------------------- parsers

#: Shown in --help; the values used are TransferConfig's (kept equal by a test). Not imported
#: from vllm_steer.lens.transfer so that building the parser does not import torch.
DEFAULT_ANCHORS, DEFAULT_HELDOUT, DEFAULT_RIDGE = 4000, 1000, 1e-4
#: ``score``'s --max-tokens default (vllm_steer.lens.score.DEFAULT_MAX_TOKENS).
DEFAULT_MAX_TOKENS = 128


def _positive_int(text: str) -> int:
    """``--max-tokens``: a positive integer."""
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer: give the number "
                                         "of tokens to keep from each text, e.g. 128")
    return n


def _strengths_arg(text: str) -> list[float]:
    """``score --strengths``: the one strength-list syntax (:mod:`vllm_steer.strengths`)."""
    from vllm_steer.strengths import parse_strengths

    return parse_strengths(text)


def _ridge_arg(text: str) -> float:
    """``--ridge``: a finite number >= 0 (0 is the unregularised, pseudo-inverse limit); the
    rule is :func:`vllm_steer.lens.transfer.ridge_problem`'s (imported only when the flag is
    given: building the parser imports no torch)."""
    from vllm_steer.lens.transfer import ridge_problem

    problem = ridge_problem(text, repr(text))
    if problem:
        raise argparse.ArgumentTypeError(problem)
    return float(text)


def add_commands(subparsers) -> None:
    # transfer
    t = subparsers.add_parser(
        "transfer", help="move a steer to another model through their output embeddings",
        description="Fit a linear map between the two models' output embeddings on shared "
        "tokens (ridge least squares) and rewrite the steer's factors for model B. See "
        "docs/lens.md for the derivation.")
    t.add_argument("--steer", required=True, help="source steer file (.safetensors)")
    t.add_argument("--from", dest="from_model", required=True,
                   help="model the steer was trained on (HF folder/id or smollm2)")
    t.add_argument("--to", dest="to_model", required=True, help="target model")
    t.add_argument("--out", required=True, help="output steer file")
    t.add_argument("--anchors", type=int_at_least(1, DEFAULT_ANCHORS), default=None,
                   help=f"shared tokens used to fit the map (default {DEFAULT_ANCHORS})")
    t.add_argument("--heldout", type=int_at_least(0, DEFAULT_HELDOUT), default=None,
                   help=f"shared tokens held out to report the fit (default {DEFAULT_HELDOUT})")
    t.add_argument("--ridge", type=_ridge_arg, default=None,
                   help=f"relative ridge strength, a finite number >= 0 (default "
                   f"{DEFAULT_RIDGE}; 0 = none: the least-norm least-squares map)")
    t.add_argument("--form", choices=["logit", "congruence"], default="logit",
                   help="logit: keep the logit shift (default); congruence: the paper's H S H^T")
    t.add_argument("--calibration-file", help="sentences (one a line) for the strength "
                   "calibration (default: a dozen built-in plain sentences)")
    t.add_argument("--name", help="name of the transferred steer (default: the source's)")
    t.set_defaults(func=cmd_transfer)

    def common(p, strength_help, prefix_help, max_tokens_default):
        p.add_argument("--steer", required=True, help="steer file (.safetensors)")
        p.add_argument("--model", help="model (HF folder/id or smollm2; default: the steer's "
                       "base_model)")
        p.add_argument("--strength", type=float, default=None, help=strength_help)
        p.add_argument("--prefix", default=None, help=prefix_help)
        p.add_argument("--max-tokens", type=_positive_int, default=max_tokens_default,
                       metavar="N",
                       help="keep each text's first N tokens, a positive integer (the "
                       "--prefix does not count; default "
                       + ("no limit)" if max_tokens_default is None
                          else f"{max_tokens_default})"))

    # highlight
    h = subparsers.add_parser(
        "highlight", help="per-token evidence of a steer in a text, and its best spans",
        description="Score each token by log p(steered) - log p(baseline) and pick the best "
        "spans by dynamic programming.")
    common(h, "strength of the steered model (default: the steer's recommended strength, "
              "else 5); a negative strength highlights the negative side (e.g. toxic text "
              "for a detox steer)",
           "context before the text (default: the tokenizer's BOS/EOS token so the first "
           "token is scored too; '' for none)", None)
    text = h.add_mutually_exclusive_group(required=True)  # one, refused before any load
    text.add_argument("--text", help="the text")
    text.add_argument("--file", help="read the text from this file")
    h.add_argument("--against", type=float, default=0.0,
                   help="baseline strength (default 0 = the plain model)")
    h.add_argument("--spans", type=int_at_least(0, 3), default=3,
                   help="at most this many spans (default 3)")
    h.add_argument("--max-span", type=int_at_least(1, 8), default=8,
                   help="at most this many tokens per span (default 8)")
    h.add_argument("--json", help="write JSON here ('-' = stdout only)")
    h.add_argument("--html", help="write a self-contained HTML page here")
    h.add_argument("--color", choices=["auto", "always", "never"], default="auto",
                   help="ANSI colours (auto: on a terminal unless NO_COLOR is set)")
    h.set_defaults(func=cmd_highlight)

    # explain
    e = subparsers.add_parser(
        "explain", help="tokens along the steer's top singular directions",
        description="SVD of S = P1 P2^T from the factors; tokens with the highest/lowest "
        "projection of their output embedding on each output-side direction.")
    e.add_argument("--steer", required=True, help="steer file (.safetensors)")
    e.add_argument("--model", help="model (default: the steer's base_model)")
    e.add_argument("--directions", type=int_at_least(1, 5), default=5,
                   help="directions shown (default 5)")
    e.add_argument("--top", type=int_at_least(1, 12), default=12,
                   help="tokens per end (default 12)")
    e.add_argument("--all-tokens", action="store_true",
                   help="do not restrict to word-like tokens (' word')")
    e.add_argument("--word-threshold", type=float, default=0.5,
                   help="keep a token only if the model gives at least this probability "
                   "that a new word follows it (drops fragments like ' affili'; 0 = off; "
                   "default 0.5)")
    e.add_argument("--no-orient", action="store_true", help="orient directions by their "
                   "extreme tokens instead of by the model's hidden states")
    e.add_argument("--markdown", help="also write the table to this file")
    e.add_argument("--png", help="write a figure (spectrum + token map) to this PNG")
    e.set_defaults(func=cmd_explain)

    # score
    s = subparsers.add_parser(
        "score", help="which strength best explains a text (zero-shot style classifier)",
        description="Mean token log-likelihood under several strengths; the contrast "
        "loglik(+s) - loglik(-s) classifies the text. With --dataset, measure accuracy.")
    common(s, "the s of the +s/-s contrast (default: recommended strength, else 5)",
           "context before each text, so that its first token is scored too (default: none; "
           "a text then needs two tokens or more to get a score)", DEFAULT_MAX_TOKENS)
    texts = s.add_mutually_exclusive_group(required=True)  # one, refused before any load
    texts.add_argument("--text", help="one text")
    texts.add_argument("--file", help="texts, one a line")
    s.add_argument("--strengths", type=_strengths_arg,
                   help="comma-separated grid for the read-out, e.g. --strengths=-10,-5,0,5,10 "
                   "(default -5,0,5; +/-strength are always added)")
    texts.add_argument("--dataset", choices=["sst2", "jigsaw"],
                       help="evaluate on this data set")
    s.add_argument("--split", default="test", help="sst2 split: test or dev (default test)")
    s.add_argument("--data", "--data-dir", dest="data_dir", metavar="DIR",
                   help="data folder (default $VLLM_STEER_DATA or ../shared/data)")
    s.add_argument("--limit", type=int_at_least(0, 300), default=300,
                   help="balanced sample of this many rows (default 300; 0 = all)")
    s.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    s.add_argument("--positive-label", help="dataset label of the steer's positive side "
                   "(default: sst2 1, jigsaw 0)")
    s.add_argument("--keep-training-texts", action="store_true",
                   help="do not leave out the texts the steer was trained on (by default "
                   "they are rebuilt from its metadata and left out of --dataset samples)")
    s.add_argument("--batch-size", type=int_at_least(1, 8), default=8,
                   help="texts per forward pass")
    s.add_argument("--json", help="write results as JSON here")
    s.add_argument("--quiet", action="store_true", help="no progress bar")
    s.set_defaults(func=cmd_score)
