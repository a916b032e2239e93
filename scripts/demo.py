"""`make demo`: serve the embedded model with the shipped steers and show steered output.

Starts `vllm serve` on loopback with `steers/smollm2-detox.safetensors` and
`steers/smollm2-sentiment.safetensors`, sends the same prompts unsteered and steered at two
strengths through the OpenAI client (`extra_body={"steer": {...}}`), prints them side by side
and stops the server.
"""

from __future__ import annotations

import os
import socket
import subprocess
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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    from vllm_steer.format import read_metadata
    from vllm_steer.models import prepare_embedded

    missing = [str(p) for p in STEERS.values() if not p.exists()]
    if missing:
        print(f"demo: shipped steers missing: {missing} (make steers trains them)", file=sys.stderr)
        return 1
    model = prepare_embedded("smollm2", quiet=False)
    port = free_port()
    exe = Path(sys.executable).with_name("vllm")
    cmd = [str(exe), "serve", str(model), "--served-model-name", "smollm2",
           "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
           "--max-model-len", "1024", "--kv-cache-memory-bytes", str(1 << 30)]
    for name, path in STEERS.items():
        cmd += ["--steer", f"{name}={path}"]
    print("$ " + " ".join(cmd[0:1] + ["serve"] + cmd[2:]))
    log_path = ROOT / ".cache" / "demo-server.log"
    log_path.parent.mkdir(exist_ok=True)
    log = open(log_path, "w")
    t0 = time.time()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        import requests

        spinner = "|/-\\"
        while True:
            if proc.poll() is not None:
                print(f"\nserver exited; log: {log_path}\n" + log_path.read_text()[-2000:])
                return 1
            try:
                if requests.get(f"http://127.0.0.1:{port}/health", timeout=1).ok:
                    break
            except requests.RequestException:
                pass
            print(f"\rstarting vLLM with the vllm-steer plugin {spinner[int(time.time()) % 4]} "
                  f"{time.time() - t0:4.0f}s", end="", flush=True)
            time.sleep(0.5)
        print(f"\rserver up in {time.time() - t0:.0f}s (log: {log_path})" + " " * 20)
        import openai

        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="demo")
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
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        print("server stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
