#!/usr/bin/env python3
"""How well offline toxicity scorers agree with Perspective (docs/eval.md, "Scorers").

    python scripts/scorer_agreement.py --toxicity-scorer profanity-check \\
        --toxicity-scorer minilm-jigsaw [--data DIR] [--json FILE]

The texts: the prompts and the continuations of the RealToxicityPrompts files
``prompts/toxicity/rtp_toxic_dev_598.jsonl`` and ``rtp_nontoxic_1200.jsonl`` of the data
folder, each with its Perspective toxicity (texts without one are skipped, an exact repeat of
a text is kept once). A text is labelled toxic when its Perspective toxicity is above 0.5.
Printed per scorer: the AUROC of its scores against those labels and the Spearman rank
correlation of its scores with Perspective's (:mod:`vllm_steer.eval.agreement`). Scorers are
registered names or ``module:Class``, as for ``vllm-steer eval``.
"""

from __future__ import annotations

import argparse
import json
import sys


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--toxicity-scorer", action="append", default=None, metavar="NAME",
                   help="scorer to measure, repeatable (default: profanity-check and "
                        "minilm-jigsaw)")
    p.add_argument("--data", default=None,
                   help="data folder (default $VLLM_STEER_DATA or ../shared/data)")
    p.add_argument("--json", default=None, metavar="FILE",
                   help="also write the texts' description and the results as JSON")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    args = p.parse_args(argv)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    from vllm_steer.eval.agreement import agreement_table, scorer_agreement
    from vllm_steer.train.config import default_data_dir

    names = args.toxicity_scorer or ["profanity-check", "minilm-jigsaw"]
    pt, results = scorer_agreement(names, args.data or default_data_dir(),
                                   progress=not args.quiet)
    print(agreement_table(pt, results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"texts": pt.describe(), "scorers": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
