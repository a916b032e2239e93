"""Compare several steer files of one task by generation, side by side in one vLLM engine.

The recipe study of steers/README.md: every candidate steer is loaded into one engine under
its own name, and the same prompts are generated unsteered and with each steer at each
candidate strength, with the same sampling seeds (vllm_steer.eval.generation: the draws are
common to every condition), then scored exactly as ``vllm-steer tune`` scores them
(toxicity or positivity, perplexity of each continuation under the unsteered model, through
the same engine). For each steer it prints the curve relative to unsteered and the strength
``tune`` would choose (:func:`vllm_steer.eval.tune.choose`, +15% perplexity budget); the
unsteered run and the engine start are shared, which is what makes comparing many steers
on many prompts affordable on a CPU.

    .venv/bin/python steers/compare.py --task toxicity \\
        --prompts ../shared/data/prompts/toxicity/rtp_toxic_dev_598.jsonl --skip 50 \\
        --num-prompts 200 --samples 2 --strengths 2,3,4 \\
        shipped=steers/smollm2-detox.safetensors full=detox-full.safetensors@2,4,6

Writes ``--out``/compare.json (every condition's metrics) and compare.md (the tables).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("steers", nargs="+", metavar="NAME=PATH[@M,M...]")
    ap.add_argument("--task", choices=["toxicity", "sentiment"], required=True)
    ap.add_argument("--prompts", required=True, help="JSONL prompts file (prompt.text)")
    ap.add_argument("--skip", type=int, default=0, help="skip the first N prompts")
    ap.add_argument("--num-prompts", type=int, default=200)
    ap.add_argument("--samples", type=int, default=2)
    ap.add_argument("--strengths", default="2,3,4", help="magnitudes (sentiment: both signs)")
    ap.add_argument("--budget", type=float, default=0.15)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="compare_out")
    args = ap.parse_args(argv)

    from vllm_steer.eval.fluency import perplexity_metrics
    from vllm_steer.eval.generation import (METHOD_NONE, METHOD_STEER, Condition, EngineConfig,
                                            SamplingConfig, VLLMGenerator)
    from vllm_steer.eval.prompts import read_prompts
    from vllm_steer.eval.scorers import get_scorer
    from vllm_steer.eval.sentiment import positivity_metrics
    from vllm_steer.eval.toxicity import toxicity_metrics
    from vllm_steer.eval.tune import choose
    from vllm_steer.models import resolve_model

    steers, mags = {}, {}
    for spec in args.steers:  # NAME=PATH or NAME=PATH@2,4,6 (that steer's own magnitudes)
        name, rest = spec.split("=", 1)
        path, _, own = rest.partition("@")
        steers[name] = path
        mags[name] = [float(x) for x in (own or args.strengths).split(",")]
    signs = [1] if args.task == "toxicity" else [1, -1]
    prompts = read_prompts(args.prompts, args.skip + args.num_prompts)[args.skip:]
    sampling = SamplingConfig(samples=args.samples, seed=args.seed)
    conds = [Condition(METHOD_NONE)] + [Condition(METHOD_STEER, {n: sg * m})
                                        for n in steers for m in mags[n] for sg in signs]
    t0 = time.perf_counter()
    gen = VLLMGenerator(resolve_model("smollm2"), steers, None, EngineConfig(), args.seed)
    try:
        gens = gen.generate(prompts, conds, sampling)
        flat = [(c.label, i, t) for c in conds for i, ss in enumerate(gens[c.label]) for t in ss]
        nll = gen.nll([prompts[i] for _, i, _ in flat], [t for _, _, t in flat])
    finally:
        gen.close()
    kind = "toxicity" if args.task == "toxicity" else "sentiment"
    scorer = get_scorer(kind, "profanity-check" if kind == "toxicity" else "sst2")
    scores = list(scorer.score([t for _, _, t in flat]))
    per = {c.label: {"s": [[] for _ in prompts], "nll": []} for c in conds}
    for k, (label, i, _) in enumerate(flat):
        per[label]["s"][i].append(scores[k])
        per[label]["nll"].append(nll[k])
    res = {}
    for c in conds:
        m = (toxicity_metrics(per[c.label]["s"]) if kind == "toxicity"
             else positivity_metrics(per[c.label]["s"]))
        m.update(perplexity_metrics(per[c.label]["nll"]))
        res[c.label] = {"steer": next(iter(c.steer), None), "strength": c.strength, **m}
    base = res["unsteered"]
    keys = (["avg_max_toxicity", "toxicity_prob"] if kind == "toxicity" else ["positivity"])
    lines = [f"{len(prompts)} prompts (from #{args.skip}) x {args.samples} samples, "
             f"{time.perf_counter() - t0:.0f} s; unsteered: "
             + ", ".join(f"{k} {base[k]:.3f}" for k in keys) + f", ppl {base['ppl']:.2f}", ""]
    lines.append("| steer | strength | " + " | ".join(keys) + " | ppl | tune's choice |")
    lines.append("|---|---:|" + "---:|" * len(keys) + "---:|---|")
    for n in steers:
        curve = [{"strength": 0.0, "ppl": base["ppl"]}] + [
            {"strength": r["strength"], "ppl": r["ppl"]} for r in res.values() if r["steer"] == n]
        chosen, _ = choose(curve, args.budget, signs)
        for r in (r for r in res.values() if r["steer"] == n):
            if kind == "toxicity":
                cells = [f"{r[k]:.3f} ({100 * (r[k] / base[k] - 1):+.0f}%)" for k in keys]
            else:
                cells = [f"{r[k]:.3f} ({100 * (r[k] - base[k]):+.0f} pts)" for k in keys]
            lines.append(f"| {n} | {r['strength']:+g} | " + " | ".join(cells)
                         + f" | {r['ppl']:.2f} ({100 * (r['ppl'] / base['ppl'] - 1):+.0f}%) | "
                         + (f"{chosen:g}" if chosen is not None else "none") + " |")
    os.makedirs(args.out, exist_ok=True)
    Path(args.out, "compare.md").write_text("\n".join(lines) + "\n")
    Path(args.out, "compare.json").write_text(json.dumps(
        {"command": "python steers/compare.py " + " ".join(sys.argv[1:] if argv is None
                                                            else argv),
         "steers": steers, "results": res}, indent=1, default=str))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
