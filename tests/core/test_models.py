"""``--model`` names (vllm_steer.models): a folder that does not exist, or a Hugging Face id
not in the cache while the Hub is off, is refused at once naming the value, by every tool
that loads a model (train, the lens, eval), instead of a minute of Hub retries on a host
without network and an error that does not name it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from vllm_steer.models import resolve_model


def _cli(args, tmp_path, **env):
    """``vllm-steer ARGS`` as a user runs it, with its own (empty) Hugging Face cache."""
    full = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "hub"), **env}
    return subprocess.run([sys.executable, "-m", "vllm_steer.cli", *args], capture_output=True,
                          text=True, env=full, timeout=300)


def test_a_missing_folder_is_refused_at_once_naming_it(tmp_path):
    for name in (str(tmp_path / "nomodel"), "./nomodel", "models/llama/8b"):
        with pytest.raises(FileNotFoundError, match=f"model '{name}': no such folder"):
            resolve_model(name)
    assert resolve_model(str(tmp_path)) == str(tmp_path)  # a folder: the loader's to check


def test_a_hub_id_not_in_the_cache_while_the_hub_is_off_is_refused_by_the_lens(tmp_path):
    """``explain --model nomodel`` on a host without the Hub: one line naming the value and
    the cache, exit 1, before any loader runs."""
    from helpers.steers import random_steer
    from vllm_steer.format import save_steer

    save_steer(tmp_path / "d.safetensors", random_steer(16, 2, "d"))
    r = _cli(["explain", "--steer", str(tmp_path / "d.safetensors"), "--model", "nomodel"],
             tmp_path, HF_HUB_OFFLINE="1")
    assert r.returncode == 1, r.stderr[-2000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("vllm-steer explain: error: model 'nomodel': no such folder, and "
                           "not in the Hugging Face cache"), r.stderr[-2000:]
    assert str(tmp_path / "hub") in last and "Traceback" not in r.stderr
