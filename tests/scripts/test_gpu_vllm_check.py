"""scripts/gpu_vllm_check.py (the GPU correctness check) in its reduced CPU form, so that the
script a GPU session runs is not untested code: a tiny model, fp32, the V1 runner, async
scheduling on through the test shim (tests/v2shim, ``--cpu-async``), one engine with the
plugin and one stock engine. Its comparisons are checked to catch a wrong token or logprob."""

from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.reference import HFReference
from helpers.steers import random_steer

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_vllm_check.py"
sys.path.insert(0, str(ROOT / "scripts"))
import gpu_vllm_check as gvc  # noqa: E402


@pytest.fixture(scope="module")
def ref(tiny_model_dir):
    steers = {"a": random_steer(64, 8, "a", seed=1, scale=3.0),
              "b": random_steer(64, 8, "b", seed=2, scale=3.0)}
    return HFReference(tiny_model_dir, steers)


def fake_engine_results(ref):
    """What a correct engine returns: the reference's greedy tokens and their logprobs."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(ref.model.name_or_path)
    rows = []
    for p, (steer, n) in zip(gvc.PROMPTS, gvc.REQUESTS, strict=True):
        ids = tok.encode(p)
        toks = ref.greedy(ids, n, steer)
        lp = ref.logprobs(ids + toks, steer)
        rows.append({"prompt_ids": ids, "tokens": toks,
                     "logprobs": [float(lp[len(ids) - 1 + i, t]) for i, t in enumerate(toks)]})
    stock = [copy.deepcopy(r) if s is None else None
             for r, (s, _) in zip(rows, gvc.REQUESTS, strict=True)]
    for i, (s, n) in enumerate(gvc.REQUESTS):
        if s is not None:
            ids = rows[i]["prompt_ids"]
            toks = ref.greedy(ids, n)
            lp = ref.logprobs(ids + toks)
            stock[i] = {"prompt_ids": ids, "tokens": toks,
                        "logprobs": [float(lp[len(ids) - 1 + j, t]) for j, t in enumerate(toks)]}
    return {"mixed": rows, "alone": copy.deepcopy(rows)}, {"stock": stock}


def failed(checks):
    return [c["check"] for c in checks if not c["ok"]]


def test_compare_passes_a_correct_engine_and_catches_wrong_rows(ref):
    args = argparse.Namespace(tol=None)
    on, off = fake_engine_results(ref)
    checks = gvc.compare(args, "float32", "v1", ref, on, off)
    assert failed(checks) == [] and len(checks) == 5 + 2 + 5 + 1
    bad = copy.deepcopy(on)
    bad["mixed"][0]["logprobs"][1] += 0.01  # a steered row off the formula (and off "alone")
    assert failed(gvc.compare(args, "float32", "v1", ref, bad, off)) == [
        "steered row 0 {'a': 5}: logprobs = plain-torch formula",
        "steered row 0: mixed batch = alone"]
    bad = copy.deepcopy(off)
    bad["stock"][1]["tokens"][-1] += 1  # stock vLLM disagrees with an unsteered row
    assert failed(gvc.compare(args, "float32", "v1", ref, on, bad)) == [
        "unsteered row 1: tokens = stock vLLM (no plugin)"]
    bad = copy.deepcopy(on)
    bad["alone"][2]["tokens"][0] += 1
    assert failed(gvc.compare(args, "float32", "v1", ref, bad, off)) == [
        "steered row 2: mixed batch = alone"]


def test_the_plugins_metadata_carries_the_installed_packages_entry_points(tmp_path):
    """Where the package is not installed (a GPU host with the checkout alone), the engines
    get its metadata on their path: the same entry points as the installed distribution's,
    found by the lookup vLLM uses."""
    import importlib.metadata as md

    where = gvc.plugin_metadata(tmp_path / "meta")
    written = [d for d in md.distributions(path=[str(where)])]
    assert [d.metadata["Name"] for d in written] == ["vllm-steer"]
    installed = md.distribution("vllm-steer")
    assert {(e.group, e.name, e.value) for e in written[0].entry_points} == \
        {(e.group, e.name, e.value) for e in installed.entry_points}
    found = [e for e in md.entry_points(group="vllm.general_plugins") if e.name == "vllm_steer"]
    assert found and found[0].value in {e.value for e in written[0].entry_points}


def test_engine_env_puts_the_metadata_on_the_path_and_turns_off_a_missing_flashinfer(
        tmp_path, monkeypatch):
    monkeypatch.delenv("VLLM_USE_FLASHINFER_SAMPLER", raising=False)
    a = argparse.Namespace(device="cuda", cpu_async=False, workdir=str(tmp_path))
    monkeypatch.setattr(gvc, "_importable", lambda env, code: False)  # neither is found
    env = gvc.engine_env(a, "v2", True)
    assert env["VLLM_USE_FLASHINFER_SAMPLER"] == "0" and "VLLM_PLUGINS" not in env
    assert str(tmp_path / "steer_meta") in env["PYTHONPATH"].split(os.pathsep)
    assert list((tmp_path / "steer_meta").glob("*.dist-info/entry_points.txt"))
    stock = gvc.engine_env(a, "v2", False)
    assert stock["VLLM_PLUGINS"] == "none"
    monkeypatch.setattr(gvc, "_importable", lambda env, code: True)  # both are found
    env = gvc.engine_env(argparse.Namespace(device="cuda", cpu_async=False,
                                            workdir=str(tmp_path / "other")), "v2", True)
    assert "VLLM_USE_FLASHINFER_SAMPLER" not in env and "steer_meta" not in env["PYTHONPATH"]


@pytest.mark.vllm
def test_reduced_check_runs_on_cpu_with_async_scheduling(tmp_path):
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--dtypes", "float32",
                        "--runners", "v1", "--cpu-async", "--workdir", str(tmp_path / "w"),
                        "--out", str(tmp_path)], capture_output=True, text=True, env=env,
                       timeout=1200, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    doc = json.loads((tmp_path / "gpu_vllm_check.json").read_text())
    assert doc["engines"]["float32-v1"]["async_scheduling"] is True
    assert doc["engines"]["float32-v1"]["plugin_loaded"] is True
    names = [c["check"] for c in doc["checks"]]
    assert len(names) == 1 + 13 and all(c["ok"] for c in doc["checks"])
    assert "gpu_vllm_check: 14 passed, 0 failed" in r.stdout
