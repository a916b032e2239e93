"""Evaluation prompts from the data folder."""

import json

import pytest

from vllm_steer.eval.prompts import load_prompts, prompt_file, read_prompts


@pytest.mark.data
def test_the_task_files_and_first_n(data_dir):
    tox = load_prompts("toxicity", str(data_dir), num_prompts=3)
    first = json.loads(open(prompt_file("toxicity", str(data_dir))).readline())
    assert len(tox) == 3 and tox[0] == first["prompt"]["text"]
    assert len(load_prompts("sentiment", str(data_dir), "negative", 5)) == 5
    assert prompt_file("sentiment", str(data_dir)).endswith("neutral_prompts.jsonl")


def test_errors_name_the_problem(tmp_path):
    with pytest.raises(ValueError, match="unknown prompt set 'happy'"):
        prompt_file("sentiment", str(tmp_path), "happy")
    with pytest.raises(ValueError, match="unknown task 'math'"):
        prompt_file("math", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="--data DIR"):
        read_prompts(str(tmp_path / "nope.jsonl"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": {"text": "ok"}}\n{"text": "no prompt"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: expected a JSON object with prompt.text"):
        read_prompts(str(bad))
    assert read_prompts(str(bad), 1) == ["ok"]
    with pytest.raises(ValueError, match="--num-prompts 0"):
        read_prompts(str(bad), 0)


def test_a_prompt_file_that_is_not_utf8_is_named_with_its_line(tmp_path):
    bad = tmp_path / "p.jsonl"
    bad.write_bytes(b'{"prompt": {"text": "ok"}}\n{"prompt": {"text": "\xff"}}\n')
    with pytest.raises(ValueError, match=rf"{bad}:2: not UTF-8 \(byte 0xff at column 22\)"):
        read_prompts(str(bad))
    assert read_prompts(str(bad), 1) == ["ok"]  # the first N read only what they need
