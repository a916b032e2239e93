"""The paper's way of generating against ours, same model, prompts, steer and output length.

(paper) transformers, one prompt at a time, the steer applied on the LM head (as the
        LM-Steer code does: a hook on the output embeddings), greedy, fixed output length;
(ours)  vLLM with the vllm-steer plugin, all prompts submitted at once, every request steered.

Prints output tokens/s of both and the speed-up; writes JSON next to the other results.

    python benchmarks/bench_reference.py --prompts 32 --output-len 32
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

OURS = r"""
import json, sys, time
from vllm import LLM, SamplingParams
if __name__ == "__main__":
    model, steer, prompts, n, strength, kw = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), \
        int(sys.argv[4]), float(sys.argv[5]), json.loads(sys.argv[6])
    llm = LLM(model, additional_config={"vllm_steer": {"steers": {"s": steer}}}, **kw)
    sp = SamplingParams(max_tokens=n, ignore_eos=True, temperature=0,
                        extra_args={"steer": {"s": strength}})
    llm.generate(prompts[:2], sp, use_tqdm=False)  # warm-up
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    dt = time.perf_counter() - t0
    print("RESULT" + json.dumps({"tokens": sum(len(o.outputs[0].token_ids) for o in outs),
                                 "seconds": dt,
                                 "texts": [o.outputs[0].text for o in outs]}))
"""


def load_prompts(n: int) -> list[str]:
    data = Path(os.environ.get("VLLM_STEER_DATA", ROOT.parent / "shared" / "data"))
    f = data / "prompts" / "sentiment" / "neutral_prompts.jsonl"
    if f.exists():
        lines = f.read_text().splitlines()[:n]
        return [json.loads(ln)["prompt"]["text"] for ln in lines]
    return [f"Sample prompt number {i} is about" for i in range(n)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--steer", default=str(ROOT / "steers" / "smollm2-sentiment.safetensors"))
    ap.add_argument("--strength", type=float, default=5.0)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = ap.parse_args(argv)

    import torch
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from vllm_steer.format import load_steer
    from vllm_steer.hf import steering
    from vllm_steer.models import resolve_model

    model_dir = resolve_model(args.model)
    prompts = load_prompts(args.prompts)
    steer = load_steer(args.steer)

    # (paper) one prompt at a time through transformers, steer on the LM head
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    n_tokens, t0 = 0, time.perf_counter()
    with torch.no_grad(), steering(model, {"s": steer}, {"s": args.strength}):
        for p in tqdm(prompts, desc="transformers, one prompt at a time"):
            ids = tok(p, return_tensors="pt")
            out = model.generate(**ids, max_new_tokens=args.output_len,
                                 min_new_tokens=args.output_len, do_sample=False,
                                 pad_token_id=tok.eos_token_id)
            n_tokens += out.shape[1] - ids["input_ids"].shape[1]
    paper_s = time.perf_counter() - t0
    paper = {"tokens": n_tokens, "seconds": paper_s, "tok_s": n_tokens / paper_s}
    del model

    # (ours) vLLM + plugin, all prompts at once
    kw = {"dtype": "float32", "max_model_len": 1024, "kv_cache_memory_bytes": 1 << 30,
          "max_num_seqs": max(8, args.prompts), "seed": 0}
    script = Path(args.out) / "_bench_reference_ours.py"
    script.parent.mkdir(parents=True, exist_ok=True)
    script.write_text(OURS)
    print("vLLM + vllm-steer, all prompts at once (engine start-up not timed)...", flush=True)
    res = subprocess.run([sys.executable, str(script), model_dir, args.steer, json.dumps(prompts),
                          str(args.output_len), str(args.strength), json.dumps(kw)],
                         capture_output=True, text=True)
    script.unlink()
    line = [ln for ln in res.stdout.splitlines() if ln.startswith("RESULT")]
    if not line:
        print(res.stderr[-3000:], file=sys.stderr)
        return 1
    ours = json.loads(line[0][6:])
    ours["tok_s"] = ours["tokens"] / ours["seconds"]
    speedup = ours["tok_s"] / paper["tok_s"]
    print("\n| implementation | output tokens | seconds | tokens/s |\n|---|---|---|---|")
    print(f"| paper-style transformers, 1 prompt at a time | {paper['tokens']} | "
          f"{paper['seconds']:.1f} | {paper['tok_s']:.1f} |")
    print(f"| vLLM + vllm-steer, batched | {ours['tokens']} | {ours['seconds']:.1f} | "
          f"{ours['tok_s']:.1f} |")
    print(f"\nspeed-up: {speedup:.1f}x")
    meta = {"model": args.model, "prompts": args.prompts, "output_len": args.output_len,
            "strength": args.strength, "steer": os.path.basename(args.steer),
            "machine": platform.machine(), "cpus": os.cpu_count(), "torch": torch.__version__,
            "command": "python benchmarks/bench_reference.py " + " ".join(argv or sys.argv[1:])}
    (Path(args.out) / "reference.json").write_text(json.dumps(
        {"meta": meta, "paper": paper, "ours": {k: v for k, v in ours.items() if k != "texts"},
         "speedup": speedup}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
