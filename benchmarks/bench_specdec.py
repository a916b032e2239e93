"""Acceptance rate of speculative decoding with steers: steered vs unsteered drafter.

Target: the embedded SmolLM2-135M-Instruct; draft model: the same model cut to its first
``--draft-layers`` layers (plus its final norm and tied head), made here with transformers,
so it has the steers' hidden size and can be steered. One engine with the drafter steered
(default) and one with ``steer_drafter: false`` (``--no-steer-drafter``); each runs the same
greedy workload unsteered and steered with the shipped sentiment steer. Acceptance rate =
vLLM's ``spec_decode_num_accepted_tokens / spec_decode_num_draft_tokens`` over the run
(``LLM.get_metrics()``). Greedy outputs of the two engines are also compared (they must be
equal: the drafter never changes what is generated).

    .venv/bin/python benchmarks/bench_specdec.py --out benchmarks/results/specdec.json

``--method eagle --draft PATH``: an EAGLE-1 head instead (e.g. the one
``benchmarks/train_eagle_head.py`` trains; its LM head is the target's, steered with the
request's steer unless ``steer_drafter`` is off). ``--extra-steer NAME=PATH@STRENGTH`` adds a
workload steered with that steer (label ``steered_NAME``).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def layer_cut(src: str, layers: int, out: Path) -> Path:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    model.model.layers = model.model.layers[:layers]
    model.config.num_hidden_layers = layers
    if hasattr(model.config, "layer_types") and model.config.layer_types:
        model.config.layer_types = model.config.layer_types[:layers]
    model.save_pretrained(out)
    for f in os.listdir(src):
        if f.startswith("tokenizer") or f in ("chat_template.jinja", "generation_config.json"):
            shutil.copy(os.path.join(src, f), out / f)
    return out


def prompts(n: int) -> list[str]:
    data = Path(os.environ.get("VLLM_STEER_DATA", "../shared/data"))
    rows = (data / "prompts" / "sentiment" / "neutral_prompts.jsonl").read_text().splitlines()
    return [json.loads(r)["prompt"]["text"] for r in rows[:n]]


def counts(llm) -> tuple[int, int]:
    vals = {m.name: m.value for m in llm.get_metrics() if hasattr(m, "value")}
    return (int(vals.get("vllm:spec_decode_num_draft_tokens", 0)),
            int(vals.get("vllm:spec_decode_num_accepted_tokens", 0)))


def extra_steers(specs: list[str]) -> list[tuple[str, str, float]]:
    """``NAME=PATH@STRENGTH`` -> (name, path, strength)."""
    out = []
    for spec in specs:
        name, rest = spec.split("=", 1)
        path, _, strength = rest.rpartition("@")
        out.append((name, path, float(strength)))
    return out


def run(model, draft, steer_path, steer_drafter, args, texts):
    from vllm import LLM, SamplingParams

    extra = extra_steers(args.extra_steer)
    cfg = {"steers": {"sentiment": steer_path, **{n: p for n, p, _ in extra}}}
    if not steer_drafter:
        cfg["steer_drafter"] = False
    llm = LLM(model, additional_config={"vllm_steer": cfg}, dtype="float32",
              speculative_config={"method": args.method, "model": str(draft),
                                  "num_speculative_tokens": args.k},
              disable_log_stats=False, enforce_eager=True, max_model_len=512, seed=0,
              kv_cache_memory_bytes=1 << 29, max_num_seqs=len(texts))
    out = {}
    workloads = [("unsteered", None), ("steered", {"sentiment": args.strength})]
    workloads += [(f"steered_{n}", {n: st}) for n, _, st in extra]
    for label, steer in workloads:
        params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True,
                                extra_args=None if steer is None else {"steer": steer})
        d0, a0 = counts(llm)
        t0 = time.perf_counter()
        res = llm.generate(texts, params)
        dt = time.perf_counter() - t0
        d1, a1 = counts(llm)
        out[label] = {"draft_tokens": d1 - d0, "accepted_tokens": a1 - a0,
                      "acceptance_rate": (a1 - a0) / max(1, d1 - d0), "seconds": dt,
                      "tokens": [list(o.outputs[0].token_ids) for o in res]}
    del llm
    gc.collect()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--method", default="draft_model", choices=["draft_model", "eagle"])
    ap.add_argument("--draft", default=None,
                    help="--method eagle: the EAGLE head folder (fc + layers.0, config.json); "
                    "default: ~/.cache/vllm-steer/smollm2-eagle, made by "
                    "benchmarks/train_eagle_head.py")
    ap.add_argument("--draft-layers", type=int, default=10)
    ap.add_argument("--k", type=int, default=3, help="num_speculative_tokens")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--strength", type=float, default=5.0)
    ap.add_argument("--steer", default=str(ROOT / "steers" / "smollm2-sentiment.safetensors"))
    ap.add_argument("--extra-steer", action="append", default=[],
                    metavar="NAME=PATH@STRENGTH", help="another steered workload (repeatable)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    model = str(Path.home() / ".cache" / "vllm-steer" / "smollm2-135m-instruct")
    texts = prompts(args.prompts)
    if args.method == "eagle" and not args.draft:
        args.draft = str(Path(os.environ.get("VLLM_STEER_CACHE", Path.home() / ".cache" /
                                             "vllm-steer")) / "smollm2-eagle")
    if args.method == "eagle" and not (Path(args.draft) / "config.json").is_file():
        raise SystemExit(f"bench_specdec: no EAGLE head in {args.draft}: train one with "
                         f"'python benchmarks/train_eagle_head.py --prompts 1536 --seconds 720 "
                         f"--out {args.draft}' (data generation included, about 45 minutes on "
                         "a 2-core CPU), or pass --draft")
    with tempfile.TemporaryDirectory() as tmp:
        if args.method == "eagle":
            draft = Path(args.draft).resolve()
        else:
            draft = layer_cut(model, args.draft_layers, Path(tmp) / "draft")
        results = {"steered_drafter": run(model, draft, args.steer, True, args, texts),
                   "unsteered_drafter": run(model, draft, args.steer, False, args, texts)}
    same = all(results["steered_drafter"][k]["tokens"] == results["unsteered_drafter"][k]["tokens"]
               for k in results["steered_drafter"])
    what = (f"EAGLE head {args.draft}" if args.method == "eagle"
            else f"first {args.draft_layers} of 30 layers")
    print(f"draft: {what}, k={args.k}, {len(texts)} prompts, "
          f"{args.max_tokens} tokens, steer strength {args.strength}")
    print("| drafter | requests | draft tokens | accepted | acceptance rate | seconds |")
    print("|---|---|---|---|---|---|")
    for drafter, res in results.items():
        for label, r in res.items():
            print(f"| {drafter.split('_')[0]} | {label} | {r['draft_tokens']} | "
                  f"{r['accepted_tokens']} | {r['acceptance_rate']:.3f} | {r['seconds']:.1f} |")
    print(f"greedy outputs identical with steered and unsteered drafter: {same}")
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "identical_outputs": same,
                                              "results": results}, indent=1))


if __name__ == "__main__":
    main()
