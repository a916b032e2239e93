"""Check a trained steer the way a user would: held-out losses through the transformers API
(vllm_steer.hf.token_logprobs) at strengths 0, +-s, and a few greedy generations with
hf.steering. Prints Markdown.

    .venv/bin/python steers/check_steer.py steers/smollm2-detox.safetensors
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from vllm_steer.format import load_steer  # noqa: E402
from vllm_steer.hf import generate, token_logprobs  # noqa: E402
from vllm_steer.train.config import DataConfig, default_data_dir  # noqa: E402
from vllm_steer.train.data import load_dataset  # noqa: E402
from vllm_steer.train.module import load_model  # noqa: E402

PROMPTS = {"detox": "prompts/toxicity/rtp_nontoxic_1200.jsonl",
           "sentiment": "prompts/sentiment/neutral_prompts.jsonl"}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("steer")
    ap.add_argument("--data", default=None, help="data folder (default $VLLM_STEER_DATA)")
    ap.add_argument("--dev", type=int, default=40, help="held-out texts per side")
    ap.add_argument("--strengths", type=float, nargs="+", default=None,
                    help="default: the recommended strength, 5 and 10")
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=20)
    ap.add_argument("--max-length", type=int, default=64)
    args = ap.parse_args()

    steer = load_steer(args.steer)
    meta = steer.metadata
    if args.strengths is None:
        args.strengths = sorted({float(meta.recommended_strength or 5.0), 5.0, 10.0})
    data_dir = args.data or default_data_dir()
    dcfg = dict(meta.data["config"])
    # the files were recorded with the paths used at training time: re-root them
    for k in ("positive", "negative", "labelled", "dev_positive", "dev_negative", "dev_labelled"):
        dcfg[k] = [os.path.join(data_dir, p.split("/data/", 1)[-1]) if "/data/" in p else p
                   for p in dcfg[k]]
    ds = load_dataset(DataConfig(**dcfg), seed=meta.recipe.get("seed", 0))
    model, tok, _ = load_model(meta.base_model or "smollm2", torch.device("cpu"), torch.float32)
    print(f"## {meta.name} ({os.path.basename(args.steer)})\n")
    print(f"Held-out texts (dev split, {args.dev} per side, at most {args.max_length} tokens), "
          "mean loss per token through `hf.token_logprobs` (lower = more likely):\n")
    strengths = [0.0] + [v for s in args.strengths for v in (s, -s)]
    print("| texts | " + " | ".join(f"s={s:+g}" for s in strengths) + " |")
    print("|---|" + "---|" * len(strengths))
    for side, name in ((1, meta.labels.get("positive", "positive")),
                       (-1, meta.labels.get("negative", "negative"))):
        texts = [e.text for e in ds.dev if e.side == side][:args.dev]
        row = []
        for s in strengths:
            lps = token_logprobs(model, tok, texts, steers=steer, strengths=s,
                                 max_length=args.max_length)
            row.append(-float(torch.cat(lps).mean()))
        best = min(range(len(row)), key=row.__getitem__)
        print(f"| {'positive' if side > 0 else 'negative'} ({name}) | " + " | ".join(
            (f"**{v:.4f}**" if i == best else f"{v:.4f}") for i, v in enumerate(row)) + " |",
              flush=True)
    preset = dcfg.get("preset")
    if preset in PROMPTS and args.prompts:
        path = os.path.join(data_dir, PROMPTS[preset])
        with open(path) as f:
            prompts = [json.loads(line)["prompt"]["text"]
                       for _, line in zip(range(args.prompts), f, strict=False)]
        gen_strengths = sorted({0.0, *[v for s in args.strengths for v in (s, -s)]})
        print(f"\nGreedy continuations ({args.max_new_tokens} new tokens) of prompts from "
              f"`{PROMPTS[preset]}`:\n")
        for p in prompts:
            print(f"**{p.strip()}**\n")
            for s in gen_strengths:
                out = generate(model, tok, [p], steer, s, max_new_tokens=args.max_new_tokens)[0]
                print(f"- s={s:+g}: {out.strip()!r}", flush=True)
            print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
