"""README's "Your own model" quickstart and its "Client" snippet, run as written there.

The commands are read from README.md (so the test and the README cannot drift) and run on a
tiny random Llama instead of ``MODEL``, with data files made here in the format the README
describes. Flags appended after README's own only make the runs small (argparse keeps the
last value): fewer training steps, fewer tuning prompts, a small server.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.engines import serve_spawns_engines

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

# Appended to README's commands: small and quick on a 2-core CPU, same code paths.
SMALL = {
    "train": ["--steps", "3", "--batch-size", "8", "--max-length", "32", "--eval-every", "0",
              "--checkpoint-every", "0", "--quiet"],
    "tune": ["--num-prompts", "2", "--samples", "1", "--max-tokens", "4", "--strengths=1,2",
             "--max-num-seqs", "8", "--kv-cache-gib", "0.25", "--quiet"],
    "serve": ["--dtype", "float32", "--max-model-len", "256", "--max-num-seqs", "8",
              "--kv-cache-memory-bytes", str(1 << 27), "--enforce-eager"],
}


def section(title: str) -> str:
    text = (ROOT / "README.md").read_text()
    m = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert m, f"README.md has no section '## {title}'"
    return m.group(1)


def fenced(text: str, lang: str) -> str:
    m = re.search(rf"```{lang}\n(.*?)```", text, re.S)
    assert m, f"no ```{lang} block"
    return m.group(1)


def quickstart_commands() -> list[list[str]]:
    block = fenced(section("Your own model"), "bash")
    block = re.sub(r"\\\n", " ", block)
    return [shlex.split(ln) for ln in block.split("\n") if ln.strip() and
            not ln.lstrip().startswith("#")]


def test_readme_quickstart_lists_train_tune_serve():
    cmds = quickstart_commands()
    assert [c[:2] for c in cmds] == [["vllm-steer", "train"], ["vllm-steer", "tune"],
                                     ["vllm", "serve"]]
    assert all("MODEL" in c for c in cmds)


def _write_data(d: Path) -> None:
    clean = ["thank you for the careful edit", "a helpful and kind comment",
             "please see the talk page", "the article reads well now"]
    toxic = ["you are a stupid idiot", "shut up you moron", "this is crap and you suck",
             "what the hell is wrong with you"]
    with open(d / "comments.jsonl", "w") as f:
        for i in range(6):
            for t, label in [(c, 0) for c in clean] + [(t, 1) for t in toxic]:
                f.write(json.dumps({"text": f"{t} ({i})", "label": label}) + "\n")
    with open(d / "prompts.jsonl", "w") as f:
        for p in ["My neighbours are", "The comment said"]:
            f.write(json.dumps({"prompt": p}) + "\n")


def test_readme_quickstart_and_client_run_as_written(tiny_model_dir, tmp_path, monkeypatch):
    from vllm_steer.format import read_metadata
    from vllm_steer.server.launch import serve

    _write_data(tmp_path)
    monkeypatch.chdir(tmp_path)  # README's relative paths, for every process started here
    serve_spawns_engines(monkeypatch)  # `vllm serve` as a host runs it: engine core spawned
    train, tune, vllm_serve = [[str(tiny_model_dir) if w == "MODEL" else w for w in c]
                               for c in quickstart_commands()]
    run = dict(cwd=tmp_path, capture_output=True, text=True, timeout=900)
    cli = [sys.executable, "-m", "vllm_steer.cli"]

    out = subprocess.run(cli + train[1:] + SMALL["train"], **run)
    assert out.returncode == 0, out.stderr[-3000:]
    steer_file = tmp_path / train[train.index("--out") + 1]
    meta = read_metadata(str(steer_file))
    assert (meta.name, meta.rank, meta.labels["positive"]) == ("detox", 16, "non-toxic")

    out = subprocess.run(cli + tune[1:] + SMALL["tune"], **run)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    tuned = read_metadata(str(steer_file))
    assert tuned.metrics["tune"]["curve"] and tuned.recommended_strength in (1.0, 2.0)

    client = fenced(section("Client"), "python")
    assert 'base_url="http://localhost:8000/v1"' in client
    with serve(vllm_serve[2:] + SMALL["serve"], tmp_path / "server.log") as url:
        code = client.replace("http://localhost:8000/v1", f"{url}/v1")
        out = subprocess.run([sys.executable, "-c", code], **run)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.split("\n")
    assert [ln for ln in lines if ln.startswith("applied:")] == ["applied: detox=4"] * 2, \
        out.stdout
    assert len([ln for ln in lines if ln.strip() and not ln.startswith("applied:")]) >= 1
