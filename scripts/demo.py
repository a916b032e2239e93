"""`make demo`: serve the embedded model with the shipped steers and show steered output.

Starts `vllm serve` on loopback with `steers/smollm2-detox.safetensors` and
`steers/smollm2-sentiment.safetensors`, sends the same prompts unsteered and steered at two
strengths through the OpenAI client (`extra_body={"steer": {...}}`), prints them side by side
and stops the server.
"""

from __future__ import annotations

import sys
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STEERS = {"detox": ROOT / "steers" / "smollm2-detox.safetensors",
          "sentiment": ROOT / "steers" / "smollm2-sentiment.safetensors"}
PROMPTS = {
    "sentiment": ["The movie I saw last night was", "My neighbour's new restaurant is",
                  "The customer service at the bank"],
    "detox": ["I can't believe those people, they are such", "Shut up, you are a",
              "The comments under that video were full of"],
}


def main() -> int:
    from vllm_steer.format import read_metadata
    from vllm_steer.models import prepare_embedded
    from vllm_steer.server.launch import ServerStartError, serve

    missing = [str(p) for p in STEERS.values() if not p.exists()]
    if missing:
        print(f"demo: shipped steers missing: {missing} (make steers trains them)", file=sys.stderr)
        return 1
    model = prepare_embedded("smollm2", quiet=False)
    args = [model, "--served-model-name", "smollm2", "--dtype", "float32",
            "--max-model-len", "1024", "--kv-cache-memory-bytes", str(1 << 30)]
    for name, path in STEERS.items():
        args += ["--steer", f"{name}={path}"]
    print("$ vllm serve " + " ".join(map(str, args)))
    log_path = ROOT / ".cache" / "demo-server.log"
    spinner = "|/-\\"

    def waiting(elapsed):
        print(f"\rstarting vLLM with the vllm-steer plugin {spinner[int(elapsed) % 4]} "
              f"{elapsed:4.0f}s", end="", flush=True)

    t0 = time.time()
    try:
        with serve(args, log_path, on_wait=waiting) as base:
            print(f"\rserver up in {time.time() - t0:.0f}s (log: {log_path})" + " " * 20)
            show(base, read_metadata)
    except ServerStartError as e:
        print(f"\n{e}", file=sys.stderr)
        return 1
    print("server stopped")
    return 0


def show(base: str, read_metadata) -> None:
    import openai

    client = openai.OpenAI(base_url=f"{base}/v1", api_key="demo")
    for name, prompts in PROMPTS.items():
        meta = read_metadata(STEERS[name])
        r = meta.recommended_strength or 5.0
        if name == "sentiment":
            settings = [("plain", None), (f"{name} +{r:g}", r), (f"{name} -{r:g}", -r)]
        else:
            settings = [("plain", None), (f"{name} +{r:g}", r), (f"{name} +{2 * r:g}", 2 * r)]
        labels = meta.labels or {}
        print(f"\n=== {name}: positive strength -> {labels.get('positive', '?')}, "
              f"negative -> {labels.get('negative', '?')} ===")
        for prompt in prompts:
            print(f"\nprompt: {prompt!r}")
            for label, s in settings:
                extra = {"steer": {name: s}} if s is not None else None
                out = client.completions.create(model="smollm2", prompt=prompt, max_tokens=24,
                                                temperature=0, extra_body=extra)
                text = " ".join(out.choices[0].text.split())
                print(textwrap.fill(text, width=100, initial_indent=f"  {label:>15} | ",
                                    subsequent_indent=" " * 20))
    print("\n(greedy decoding; every request above went to the same server, steered per "
          "request with extra_body={'steer': {...}})")


if __name__ == "__main__":
    sys.exit(main())
