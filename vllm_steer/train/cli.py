"""``vllm-steer train`` and ``vllm-steer convert``. Heavy imports happen inside the commands.

    vllm-steer train --model PATH_OR_NAME --positive nontoxic.jsonl --negative toxic.jsonl \\
        --out detox.safetensors
    vllm-steer train --model smollm2 --preset detox --data ../shared/data \\
        --out steers/smollm2-detox.safetensors
    vllm-steer train --model smollm2 --data reviews.csv --label-field stars \\
        --positive-labels 4 5 --negative-labels 1 2 --ignore-labels 3 --out stars.safetensors
    vllm-steer convert checkpoint.pt --unsafe-allow-pickle --out steer.safetensors
"""

from __future__ import annotations

import argparse
import math
import os
import sys

from vllm_steer.format import MAX_META_STRENGTH
from vllm_steer.train.config import DataConfig, TrainConfig, VectorConfig
from vllm_steer.usage import UsageError, checked

#: The model the demo presets (``--preset``) train when no ``--model`` is given.
DEMO_MODEL = "smollm2"


class StrengthList(argparse.Action):
    """A list of strengths written as vllm-steer writes them everywhere, comma-separated
    (``--train-strengths 1,2,4``); the space-separated form (``1 2 4``) is read too."""

    comma_list = True  # vllm_steer.cli.HelpFormatter shows it as "--flag M,M,..."

    def __call__(self, parser, namespace, values, option_string=None):
        from vllm_steer.strengths import parse_strengths

        try:
            out = parse_strengths(",".join(values if isinstance(values, list) else [values]))
        except argparse.ArgumentTypeError as e:
            raise argparse.ArgumentError(self, str(e)) from None
        setattr(namespace, self.dest, out)


def _rank_arg(text: str) -> int | None:
    """``--rank``: a positive integer, or ``full`` (the hidden size)."""
    if text.strip().lower() == "full":
        return None
    try:
        r = int(text)
    except ValueError:
        r = 0
    if r < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give a positive integer (e.g. 16) or "
                                         "'full' (the model's hidden size)")
    return r


def _dtype_arg(p, flag, default, help_):
    p.add_argument(flag, default=default, choices=["auto", "float32", "bfloat16", "float16"],
                   help=help_ + f" (default {default})")


def add_commands(subparsers) -> None:
    d = TrainConfig()
    t = subparsers.add_parser(
        "train", help="train a steer offline from positive and negative texts",
        description="Train an LM-Steer on a frozen Hugging Face causal LM. The final hidden "
                    "states of the texts are computed once; each step then costs only the "
                    "output head. Texts are read as plain text (no chat template), for chat "
                    "models too, unless --chat-template. See docs/training.md.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    src = t.add_argument_group("data")
    src.add_argument("--preset", choices=["detox", "sentiment"],
                     help="known data set: detox = Jigsaw (label 0 positive, 1 negative), "
                          "sentiment = SST-5 (3-4 positive, 0-1 negative)")
    src.add_argument("--data", nargs="+", metavar="SOURCE",
                     help="with --preset: the data folder (default $VLLM_STEER_DATA or "
                          "../shared/data); without: labelled data, each a JSONL/CSV/TSV/"
                          "Parquet file or a Hugging Face dataset (a save_to_disk folder, or "
                          "a name in the local cache, e.g. civil_comments; read offline)")
    src.add_argument("--positive", nargs="+", default=[], metavar="FILE",
                     help="files of positive texts (JSONL, CSV/TSV, or plain text one per line)")
    src.add_argument("--negative", nargs="+", default=[], metavar="FILE",
                     help="files of negative texts")
    src.add_argument("--dev-positive", nargs="+", default=[], metavar="FILE",
                     help="held-out positive texts for the dev loss (default: --dev-fraction "
                          "of the training texts)")
    src.add_argument("--dev-negative", nargs="+", default=[], metavar="FILE",
                     help="held-out negative texts")
    src.add_argument("--dev-data", nargs="+", default=[], metavar="SOURCE",
                     help="labelled dev data (same forms and label rule as --data)")
    src.add_argument("--format", default="auto",
                     choices=["auto", "jsonl", "csv", "tsv", "parquet", "hf", "txt"],
                     help="source format; auto goes by the extension (a folder or a name "
                          "that is no file: a Hugging Face dataset)")
    src.add_argument("--split", default=DataConfig.split,
                     help="split of a Hugging Face dataset to train on")
    src.add_argument("--dev-split", default=DataConfig.dev_split,
                     help="split of the --dev-data Hugging Face dataset")
    src.add_argument("--text-field", help="JSONL key or CSV/TSV column (name or 0-based index) "
                                          "of the text (default: text, or column 0)")
    src.add_argument("--label-field", help="JSONL key or CSV/TSV column of the label "
                                           "(default: label, or column 1)")
    src.add_argument("--no-header", action="store_true", help="CSV/TSV files have no header row")
    src.add_argument("--positive-labels", nargs="+", default=[], metavar="LABEL",
                     help="label values whose texts are positive (+strength), e.g. 0 for "
                          "clean comments or 4 5 for good reviews; a numeric label may be "
                          "compared: '<0.1'")
    src.add_argument("--negative-labels", nargs="+", default=[], metavar="LABEL",
                     help="label values whose texts are negative (-strength)")
    src.add_argument("--ignore-labels", nargs="+", default=[], metavar="LABEL",
                     help="labels skipped on purpose (others not listed are an error); '*' "
                          "skips every row that is neither positive nor negative")
    src.add_argument("--max-examples", type=int, metavar="N",
                     help="training texts per side (seeded random subset; default all)")
    src.add_argument("--dev-fraction", type=float, default=DataConfig.dev_fraction,
                     help="share of each side held out for the dev loss when no dev files "
                          "are given")
    src.add_argument("--dev-max", type=int, default=DataConfig.dev_max_per_side,
                     help="dev texts per side at most")

    kind = t.add_argument_group("kind (docs/training.md: vector steers)")
    kind.add_argument("--kind", choices=["lm-steer", "vector"], default="lm-steer",
                      help="lm-steer: a steer on the final hidden state (trained by gradient "
                           "steps); vector: a control vector per decoder block, from the "
                           "positive and negative texts paired (no steps)")
    kind.add_argument("--method", choices=["pca", "caa"], default=VectorConfig.method,
                      help="--kind vector: pca = first principal component of the paired "
                           "differences (as repeng makes them), caa = their mean")
    kind.add_argument("--layers", default=None, metavar="SPEC",
                      help="--kind vector: decoder blocks (0-based), e.g. 1-29, 5,10,12-14 or "
                           "all (default: every block but 0, what llama.cpp can steer)")
    kind.add_argument("--pairs", nargs="+", default=None, metavar="FILE",
                      help="--kind vector: JSONL files of contrastive pairs, one "
                           '{"positive": ..., "negative": ...} a line (repeng\'s form), '
                           "instead of --positive/--negative/--data/--preset")
    kind.add_argument("--max-pairs", type=int, default=None, metavar="N",
                      help="--kind vector: training pairs at most (default: as many as the "
                           "smaller side has)")

    rec = t.add_argument_group("recipe")
    rec.add_argument("--model", default=None,
                     help="the model the steer is for: HF folder or id, or smollm2 (the "
                          "embedded model); required, except with a demo --preset, which "
                          f"defaults to {DEMO_MODEL}")
    rec.add_argument("--steps", type=int, default=d.steps,
                     help="optimiser steps (one batch each; the paper's 1000)")
    rec.add_argument("--batch-size", type=int, default=d.batch_size, help="texts per step")
    rec.add_argument("--rank", type=_rank_arg, default=d.rank, metavar="R",
                     help="rank of the steer; 'full' = the model's hidden size (the paper's)")
    rec.add_argument("--domain-rank", type=int, default=None,
                     help="rank of the domain steer (default = --rank; 0 = none)")
    rec.add_argument("--lr", type=float, default=d.lr, help="Adam learning rate")
    rec.add_argument("--epsilon", type=float, default=d.epsilon,
                     help="unit of strength eps0 (strength s applies s * eps0 * W)")
    rec.add_argument("--init-std", type=float, default=d.init_std,
                     help="standard deviation of the initial factors")
    rec.add_argument("--domain-dropout", type=float, default=d.domain_dropout,
                     help="probability that a text is trained without the domain steer, so "
                          "that the steer also works alone as served (0 = the paper's recipe)")
    rec.add_argument("--regularization", type=float, default=d.regularization,
                     help="L2 penalty on the factors (0 = off, as in the paper)")
    rec.add_argument("--max-length", type=int, default=d.max_length,
                     help="tokens per text; longer texts are truncated (counted, reported)")
    rec.add_argument("--seed", type=int, default=d.seed,
                     help="seed of the initial factors, the dev split and the batch order")
    rec.add_argument("--device", default=d.device,
                     help="auto (CUDA if available, else CPU), cpu, cuda, cuda:1, ...")
    _dtype_arg(rec, "--model-dtype", d.model_dtype, "dtype of the frozen model's one pass")
    _dtype_arg(rec, "--cache-dtype", d.cache_dtype, "dtype of the stored hidden states")
    _dtype_arg(rec, "--head-dtype", d.head_dtype, "dtype of the head matmuls in each step")
    rec.add_argument("--step-tokens", type=int, default=None, metavar="N",
                     help="sample N target tokens of each batch (default: all); the head "
                          "matmul over the vocabulary dominates a step, so N below the "
                          "batch's tokens makes steps proportionally cheaper")
    rec.add_argument("--train-strengths", nargs="+", action=StrengthList,
                     default=list(d.train_strengths), metavar="M,M,...",
                     help="strength magnitudes each training text is drawn at (units of "
                          "--epsilon; default 1, the paper's), comma-separated, e.g. 1,2,4")
    rec.add_argument("--chat-template", action="store_true",
                     help="train on each text as the assistant's reply to a fixed user turn "
                          "under the model's chat template; only the reply's tokens are "
                          "targets (--max-length counts them)")
    rec.add_argument("--chunk-tokens", type=int, default=d.chunk_tokens,
                     help="tokens per output-head chunk (bounds memory; same gradient)")
    rec.add_argument("--eval-every", type=int, default=d.eval_every,
                     help="steps between dev-loss evaluations (0 = only at the end)")
    rec.add_argument("--check-strengths", nargs="+", action=StrengthList,
                     default=None, metavar="S,S,...",
                     help="strengths of the final dev check (+-s versus 0), comma-separated "
                          f"(default: {','.join(f'{v:g}' for v in d.check_strengths)}; for "
                          "--kind vector: fractions 0.01, 0.02, 0.03, 0.05, 0.1 of one mean "
                          "difference per block)")
    rec.add_argument("--fluency-budget", type=float, default=d.fluency_budget,
                     help="nats/token the steered-towards dev texts may lose at the "
                          "recommended strength (the largest check strength within it)")

    out = t.add_argument_group("output")
    out.add_argument("--out", required=True, nargs="+", metavar="FILE",
                     help="steer file to write (.safetensors); --kind vector takes several, "
                          "and writes llama.cpp's GGUF for a .gguf one")
    out.add_argument("--name", help="steer name (default: the preset, or the file's stem)")
    out.add_argument("--positive-means", help="what positive strengths move towards, for the "
                                              "metadata (e.g. non-toxic)")
    out.add_argument("--negative-means", help="what negative strengths move towards")
    out.add_argument("--recommended-strength", type=float, default=None,
                     help="recorded in the metadata (default: measured, see "
                          "--fluency-budget; with no dev set, 5 (the paper's) for an LM-Steer "
                          "and none for --kind vector)")
    out.add_argument("--checkpoint-dir", help="default: OUT.ckpt")
    out.add_argument("--checkpoint-every", type=int, default=d.checkpoint_every,
                     help="steps between checkpoints (0 = none)")
    out.add_argument("--resume", action="store_true",
                     help="continue from the checkpoint (same data and recipe; --steps may grow)")
    out.add_argument("--keep-checkpoint", action="store_true",
                     help="keep the checkpoint folder after success (default: removed)")
    out.add_argument("--quiet", action="store_true", help="no progress bars")
    t.set_defaults(func=cmd_train, train_parser=t)

    c = subparsers.add_parser(
        "convert", help="import a steer trained with the paper's original code, or convert "
                        "a vector steer between llama.cpp's GGUF and our file",
        description="Convert a checkpoint of github.com/Glaciohound/LM-Steer "
                    "(torch.save([args, {projector1, projector2}, step])) to a steer file; or "
                    "a control vector between llama.cpp's GGUF (as repeng and EasySteer "
                    "write it) and this project's file, both ways (--out X.gguf writes GGUF).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    c.add_argument("checkpoint", help="checkpoint of the paper's train.py (.pt), a control "
                                      "vector .gguf, or a vector steer .safetensors")
    c.add_argument("--out", required=True, help="file to write (.safetensors; .gguf for a "
                                                "vector steer in llama.cpp's format)")
    c.add_argument("--layers", default=None, metavar="SPEC",
                   help="vector steers: keep only these blocks (0-based), e.g. 1-29")
    c.add_argument("--unsafe-allow-pickle", action="store_true",
                   help="allow reading the pickle with torch's restricted loader "
                        "(weights_only=True; enough for the paper's checkpoints)")
    c.add_argument("--unsafe-full-unpickle", action="store_true",
                   help="unpickle fully when the restricted loader refuses the file: this runs "
                        "any code the file holds, only for files you trust")
    c.add_argument("--steer-index", type=int, default=None,
                   help="which steer is the style (default: args.training_steer, else 0)")
    c.add_argument("--dummy-index", type=int, default=None,
                   help="which steer is the dummy/domain one (default: args.dummy_steer, else "
                        "1 when there are several)")
    c.add_argument("--no-dummy", action="store_true", help="drop the dummy steer")
    c.add_argument("--domain", choices=["with_steer", "none"], default="with_steer",
                   help="serve the dummy steer at strength 1 along with the steer (the paper's "
                        "--steer_values S 1), or keep it for reference only")
    c.add_argument("--name", help="steer name (default: the file name, made to follow the "
                                  "steer-name rule)")
    c.add_argument("--base-model", help="default: args.model_name")
    c.add_argument("--epsilon", type=float, help="default: args.epsilon, else 1e-3")
    c.set_defaults(func=cmd_convert)


def _data_config(args) -> DataConfig:
    from vllm_steer.train.data import preset_data_config

    common = dict(dev_fraction=args.dev_fraction, dev_max_per_side=args.dev_max,
                  max_examples=args.max_examples)
    checked(DataConfig(**common).validate)  # before any file is read
    if args.preset:
        if args.positive or args.negative:
            raise UsageError("--preset reads its own files; drop --positive/--negative")
        if args.data and len(args.data) > 1:
            raise UsageError("with --preset, --data takes one folder")
        return preset_data_config(args.preset, args.data[0] if args.data else None, **common)
    if not (args.positive or args.negative or args.data):
        raise UsageError("no training data: give --positive FILE --negative FILE, a labelled "
                         "--data FILE with --positive-labels/--negative-labels, or --preset")
    return DataConfig(positive=args.positive, negative=args.negative, labelled=args.data or [],
                      dev_positive=args.dev_positive, dev_negative=args.dev_negative,
                      dev_labelled=args.dev_data, format=args.format,
                      text_field=args.text_field, label_field=args.label_field,
                      header=not args.no_header, split=args.split, dev_split=args.dev_split,
                      positive_labels=args.positive_labels,
                      negative_labels=args.negative_labels, ignore_labels=args.ignore_labels,
                      **common)


def train_model(model: str | None, preset: str | None) -> str:
    """``--model``, or the embedded model for a demo preset; else a clear error."""
    if model:
        return model
    if preset:
        return DEMO_MODEL
    from vllm_steer.train.data import PRESETS

    demos = ", ".join(f"--preset {p}" for p in sorted(PRESETS))
    raise UsageError("--model is required: the model the steer is for (a Hugging Face "
                     "folder or id, e.g. --model meta-llama/Llama-3.1-8B-Instruct); a steer "
                     "only works on the model it was trained on. Only the demo presets "
                     f"({demos}) default to {DEMO_MODEL}, the embedded model")


#: ``train`` flags that only an LM-Steer uses: refused with ``--kind vector`` when set.
LM_STEER_ONLY = ("steps", "batch_size", "rank", "domain_rank", "lr", "epsilon", "init_std",
                 "domain_dropout", "regularization", "cache_dtype", "head_dtype", "step_tokens",
                 "train_strengths", "chat_template", "chunk_tokens", "eval_every",
                 "checkpoint_dir", "checkpoint_every",
                 "resume", "keep_checkpoint")
#: ``train`` flags that only a vector steer uses.
VECTOR_ONLY = ("method", "layers", "max_pairs", "pairs")


def _set_flags(args, dests) -> list[str]:
    """The flags among ``dests`` given a value other than their default."""
    parser = args.train_parser
    flag = {a.dest: a.option_strings[0] for a in parser._actions if a.option_strings}
    return [flag[d] for d in dests if getattr(args, d) != parser.get_default(d)]


def cmd_train_vector(args) -> int:
    from vllm_steer.train.vector import train_vector

    given = _set_flags(args, LM_STEER_ONLY)
    if given:
        raise UsageError(f"{', '.join(given)}: LM-Steer training flags, not used by --kind "
                         "vector (its recipe: --method, --layers, --max-pairs, --max-length, "
                         "--seed, --model-dtype, --check-strengths, --fluency-budget); drop "
                         "them")
    cfg = VectorConfig(model=train_model(args.model, args.preset), method=args.method,
                       layers=args.layers, max_length=args.max_length,
                       max_pairs=args.max_pairs, seed=args.seed, device=args.device,
                       model_dtype=args.model_dtype,
                       check_strengths=(None if args.check_strengths is None
                                        else tuple(args.check_strengths)),
                       fluency_budget=args.fluency_budget)
    checked(cfg.validate)
    if args.layers is not None and args.layers.strip().lower() != "all":
        from vllm_steer.vectors import parse_layers

        checked(lambda: parse_layers(args.layers))  # its syntax, before the model loads
    labels = {k: v for k, v in (("positive", args.positive_means),
                                ("negative", args.negative_means)) if v}
    if args.pairs:
        other = [f for f, on in (("--positive", args.positive), ("--negative", args.negative),
                                 ("--data", args.data), ("--preset", args.preset)) if on]
        if other:
            raise UsageError(f"--pairs and {', '.join(other)}: give the pairs or the "
                             "sides, not both")
        if args.max_examples is not None:
            raise UsageError("--max-examples and --pairs: the pairs are subset with "
                             "--max-pairs N")
        dev = [f for f, on in (("--dev-positive", args.dev_positive),
                               ("--dev-negative", args.dev_negative),
                               ("--dev-data", args.dev_data)) if on]
        if dev:
            raise UsageError(f"--pairs and {', '.join(dev)}: the dev pairs are held out of "
                             "the --pairs files (--dev-fraction, --dev-max); dev texts by side "
                             "go with --positive/--negative/--data")
        unused = _set_flags(args, ("format", "split", "dev_split", "text_field", "label_field",
                                   "no_header", "positive_labels", "negative_labels",
                                   "ignore_labels"))
        if unused:
            raise UsageError(f"{', '.join(unused)}: flags of --data/--positive/--negative, not "
                             "used by --pairs (one JSON object a line with \"positive\" and "
                             "\"negative\"); drop them")
        data = DataConfig(dev_fraction=args.dev_fraction, dev_max_per_side=args.dev_max)
        checked(data.validate)
    else:
        data = _data_config(args)
    train_vector(cfg, data, args.out, name=args.name, labels=labels or None,
                 recommended_strength=args.recommended_strength, progress=not args.quiet,
                 pairs=args.pairs)
    return 0


def cmd_train(args) -> int:
    from vllm_steer.train.trainer import train_steer

    check_outs(args.out)
    rec = args.recommended_strength
    if rec is not None and not (math.isfinite(rec) and abs(rec) <= MAX_META_STRENGTH):
        raise UsageError(f"--recommended-strength {rec!r}: give a finite strength of at most "
                         f"{MAX_META_STRENGTH:g} in size (or omit it: it is measured)")
    if args.kind == "vector":
        return cmd_train_vector(args)
    given = _set_flags(args, VECTOR_ONLY)
    if given:
        raise UsageError(f"{', '.join(given)}: vector-steer flags; add --kind vector, or drop "
                         "them")
    from vllm_steer.vectors import is_gguf_name

    if len(args.out) != 1 or is_gguf_name(args.out[0]):
        raise UsageError(f"--out {' '.join(args.out)}: an LM-Steer is written to one "
                         ".safetensors file (llama.cpp's GGUF holds vector steers only)")
    args.out = args.out[0]

    cfg = TrainConfig(model=train_model(args.model, args.preset), rank=args.rank,
                      domain_rank=args.domain_rank,
                      epsilon=args.epsilon, init_std=args.init_std, lr=args.lr,
                      steps=args.steps, batch_size=args.batch_size, max_length=args.max_length,
                      regularization=args.regularization, seed=args.seed,
                      domain_dropout=args.domain_dropout, device=args.device,
                      model_dtype=args.model_dtype, cache_dtype=args.cache_dtype,
                      head_dtype=args.head_dtype, chunk_tokens=args.chunk_tokens,
                      step_tokens=args.step_tokens,
                      train_strengths=tuple(args.train_strengths),
                      eval_every=args.eval_every, checkpoint_every=args.checkpoint_every,
                      check_strengths=(TrainConfig.check_strengths
                                       if args.check_strengths is None
                                       else tuple(args.check_strengths)),
                      fluency_budget=args.fluency_budget, chat_template=args.chat_template)
    checked(cfg.validate)
    data = _data_config(args)
    labels = {k: v for k, v in (("positive", args.positive_means),
                                ("negative", args.negative_means)) if v}
    train_steer(cfg, data, args.out, name=args.name, labels=labels or None, resume=args.resume,
                checkpoint_dir=args.checkpoint_dir, keep_checkpoint=args.keep_checkpoint,
                recommended_strength=args.recommended_strength, progress=not args.quiet)
    return 0


def _is_vector_input(path: str) -> bool:
    """A llama.cpp GGUF, or one of our safetensors files of kind ``vector``."""
    from vllm_steer.format import KIND_VECTOR, file_kind, read_document
    from vllm_steer.vectors import is_gguf

    if is_gguf(path):
        return True
    if not os.path.isfile(path):
        return False
    _, d, _ = read_document(path)
    return file_kind(d) == KIND_VECTOR


def check_outs(outs: list[str]) -> None:
    """Refuse, before any work, output paths that cannot be files (a directory, a path below
    a file), every one named in one error."""
    from vllm_steer.format import FILE_SUFFIX, output_path_problem
    from vllm_steer.vectors import GGUF_SUFFIX, is_gguf_name

    problems = [p for o in outs
                if (p := output_path_problem(o, GGUF_SUFFIX if is_gguf_name(o) else FILE_SUFFIX))]
    seen: dict[str, str] = {}
    for o in outs:
        key = os.path.realpath(o)
        if key in seen:
            problems.append(f"{o!r} is given twice ({seen[key]!r} names the same file); give "
                            "each output once")
        seen.setdefault(key, o)
    if problems:
        raise UsageError("--out: " + "; ".join(problems))


def file_layers(spec: str, vs, path: str) -> list[int]:
    """The blocks ``--layers`` keeps of the vector steer ``vs`` read from ``path``: ``all`` is
    every block the file has a vector for; any other block is refused, naming the file's."""
    from vllm_steer.vectors import _ranges, parse_layers

    if spec.strip().lower() == "all":
        return list(vs.layers)
    want = parse_layers(spec)
    missing = sorted(set(want) - set(vs.layers))
    if missing:
        raise ValueError(f"--layers {spec}: {path} has no vector for blocks {_ranges(missing)}; "
                         f"it has vectors for blocks {_ranges(vs.layers)} (--layers all keeps "
                         "them all)")
    return want


def cmd_convert_vector(args) -> int:
    """GGUF -> our file, our file -> GGUF (or either to itself, e.g. to keep some layers)."""
    from vllm_steer.vectors import _ranges, is_gguf_name, load_vector, save_any

    given = [f for f, on in (("--unsafe-allow-pickle", args.unsafe_allow_pickle),
                             ("--unsafe-full-unpickle", args.unsafe_full_unpickle),
                             ("--steer-index", args.steer_index is not None),
                             ("--dummy-index", args.dummy_index is not None),
                             ("--no-dummy", args.no_dummy), ("--epsilon", args.epsilon),
                             ("--domain", args.domain != "with_steer")) if on]
    if given:
        raise UsageError(f"{', '.join(given)}: flags of LM-Steer checkpoints; "
                         f"{args.checkpoint} is a vector steer")
    vs = load_vector(args.checkpoint)
    if args.layers is not None:
        vs = vs.select(file_layers(args.layers, vs, args.checkpoint))
    if args.name:
        from vllm_steer.names import check_steer_name

        check_steer_name(args.name)
        vs.metadata.name = args.name
    if args.base_model:
        vs.metadata.base_model = args.base_model
    save_any(args.out, vs)
    kind = "llama.cpp GGUF" if is_gguf_name(args.out) else "vector steer file"
    print(f"wrote {args.out} ({kind}): {vs.name}, hidden size {vs.hidden_size}, blocks "
          f"{_ranges(vs.layers)} ({len(vs.layers)} vectors)")
    return 0


def _checkpoint_problems(args) -> list[str]:
    """Every reason ``convert`` refuses an input that is no vector steer, before unpickling
    anything: what the file is when it is no checkpoint of the paper's code (by its first
    bytes), an LM-Steer asked for as a GGUF, ``--layers``. Empty for a missing file or a
    directory (the loader names them)."""
    from vllm_steer.format import KIND_LM_STEER, file_kind, read_document
    from vllm_steer.train.convert import content_problem
    from vllm_steer.vectors import is_gguf_name

    path = args.checkpoint
    if not os.path.isfile(path):
        return []
    problem = content_problem(path)
    problems = [problem] if problem else []
    lm_steer = problem is None or file_kind(read_document(path)[1]) == KIND_LM_STEER
    if lm_steer and is_gguf_name(args.out):
        problems.append(f"--out {args.out}: an LM-Steer cannot be written as llama.cpp's GGUF, "
                        "which holds control vectors (vector steers) only; write a "
                        ".safetensors file")
    if args.layers is not None:
        problems.append(f"--layers selects the blocks of a vector steer, and {path} is no "
                        "vector steer; drop --layers")
    return problems


def cmd_convert(args) -> int:
    from vllm_steer.format import SteerFileError, save_steer
    from vllm_steer.train.convert import PickleRefused, convert_checkpoint, describe

    check_outs([args.out])
    if _is_vector_input(args.checkpoint):
        return cmd_convert_vector(args)
    problems = _checkpoint_problems(args)
    if problems:
        raise ValueError(f"{args.checkpoint}: " + "; ".join(problems))

    try:
        steer = convert_checkpoint(args.checkpoint, allow_pickle=args.unsafe_allow_pickle,
                                   full_unpickle=args.unsafe_full_unpickle,
                                   steer_index=args.steer_index, dummy_index=args.dummy_index,
                                   no_dummy=args.no_dummy, domain=args.domain, name=args.name,
                                   base_model=args.base_model, epsilon=args.epsilon)
    except PickleRefused as e:
        print(f"vllm-steer convert: refused: {e}", file=sys.stderr)
        return 2
    try:
        save_steer(args.out, steer)
    except SteerFileError as e:  # e.g. an out-of-range epsilon in the checkpoint's args
        print(f"vllm-steer convert: error: {args.out}: " + "; ".join(e.reasons), file=sys.stderr)
        return 1
    print(f"wrote {args.out}: {describe(steer)}")
    return 0
