"""Evaluation prompts, read from the data folder.

- toxicity: ``prompts/toxicity/rtp_nontoxic_1200.jsonl`` (RealToxicityPrompts, non-toxic
  prompts; ``{"prompt": {"text": ...}}``);
- sentiment: ``prompts/sentiment/{neutral,positive,negative}_prompts.jsonl`` (the DExperts
  OpenWebText prompts; ``{"prompt": {"text": ...}}``), ``neutral`` by default.

``num_prompts`` takes the first N prompts of the file (the same N for every run, so runs
compare; the files are not ordered by anything that matters here).
"""

from __future__ import annotations

import json
import os

from vllm_steer.train.data import utf8_lines

TASK_FILES = {
    "toxicity": {"rtp_nontoxic": "prompts/toxicity/rtp_nontoxic_1200.jsonl"},
    "sentiment": {s: f"prompts/sentiment/{s}_prompts.jsonl"
                  for s in ("neutral", "positive", "negative")},
}
DEFAULT_SET = {"toxicity": "rtp_nontoxic", "sentiment": "neutral"}


def prompt_file(task: str, data_dir: str, prompt_set: str | None = None) -> str:
    """Path of the prompt file of ``task`` (``toxicity``/``sentiment``) and ``prompt_set``."""
    if task not in TASK_FILES:
        raise ValueError(f"unknown task {task!r}; choose {', '.join(TASK_FILES)}")
    prompt_set = prompt_set or DEFAULT_SET[task]
    if prompt_set not in TASK_FILES[task]:
        raise ValueError(f"unknown prompt set {prompt_set!r} for {task}; choose "
                         f"{', '.join(TASK_FILES[task])}")
    return os.path.join(data_dir, TASK_FILES[task][prompt_set])


def read_prompts(path: str, num_prompts: int | None = None) -> list[str]:
    """The ``prompt.text`` of each JSONL line (first ``num_prompts`` if given)."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"prompt file {path!r} not found (give --data DIR, the folder "
                                "holding prompts/, or set $VLLM_STEER_DATA)")
    if num_prompts is not None and num_prompts < 1:
        raise ValueError(f"--num-prompts {num_prompts}: must be at least 1")
    out: list[str] = []
    for i, line in utf8_lines(path):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            text = rec["prompt"]["text"] if isinstance(rec.get("prompt"), dict) \
                else rec["prompt"]
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError):
            raise ValueError(f"{path}:{i}: expected a JSON object with prompt.text "
                             f"(got {line[:80]!r})") from None
        if not isinstance(text, str):
            raise ValueError(f"{path}:{i}: prompt.text is {type(text).__name__}, "
                             "expected a string")
        out.append(text)
        if num_prompts is not None and len(out) >= num_prompts:
            break
    if not out:
        raise ValueError(f"{path}: no prompts found")
    return out


def load_prompts(task: str, data_dir: str, prompt_set: str | None = None,
                 num_prompts: int | None = None) -> list[str]:
    return read_prompts(prompt_file(task, data_dir, prompt_set), num_prompts)
