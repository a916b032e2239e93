"""The plugin inside a real tensor-parallel vLLM engine (CPU, V1 runner, TP=2), offline API.

Two workers (``distributed_executor_backend="mp"``, one core each) each hold half of the
vocabulary-parallel LM head and steer their replicated copy of the hidden states. Tokens and
logprobs must be those of the unsharded model (plain torch on the same weights, the steer
applied by hand: what TP=1 is pinned to in tests/e2e/test_vllm_offline.py). The V1 side of the
slot-hygiene check lives here too: after the last steered request finishes, no worker does
steer work. A steer loaded at run time (``vllm_steer.offline.load_steer``) reaches both
workers (it loads into the engine's third slot and unloads again). A fault of the plugin's
worker code on both ranks fails only the steered request of its step, its error carried from
the worker processes to the engine core with the step's output.
"""

from __future__ import annotations

import pytest

from helpers.models import make_tiny_llama
from helpers.reference import HFReference
from helpers.steers import random_steer, random_vectors, save_steers, save_vector_steer
from helpers.worker_faults import (STEP_ROWS, check_only_the_steered_request_failed,
                                   step_rows_fault)
from vllm_steer.integrations.worker.runtime import steer_stats

pytestmark = pytest.mark.vllm

PROMPTS = ["Hello there, my name is", "The weather today", "Once upon a time in a land",
           "Q: What is two plus two?\nA:"]
MAX_TOKENS = 6
HIDDEN = 128  # 2 attention heads: one per rank
VECTORS = random_vectors(HIDDEN, [0, 1], seed=12)
ENGINE_KW = dict(dtype="float32", kv_cache_memory_bytes=1 << 27, max_model_len=256,
                 max_num_seqs=8, enforce_eager=True, seed=0, tensor_parallel_size=2,
                 distributed_executor_backend="mp")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama-128"), hidden=HIDDEN, seed=3)


@pytest.fixture(scope="module")
def steers(tmp_path_factory):
    d = tmp_path_factory.mktemp("steers-tp")
    objs = {"a": random_steer(HIDDEN, 8, "a", seed=1, scale=2.0),
            "b": random_steer(HIDDEN, 8, "b", seed=2, scale=2.0)}
    files = save_steers(d, objs)
    files["v"] = save_vector_steer(d / "v.safetensors", VECTORS, "v")  # a vector steer
    return objs, files


@pytest.fixture(scope="module")
def llm(model_dir, steers):
    from vllm import LLM

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")  # one core per rank
        # collective_rpc(steer_stats): read each worker's steer-op counters from the test
        mp.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
        engine = LLM(str(model_dir),
                     additional_config={"vllm_steer": {"steers": steers[1], "max_steers": 4}},
                     **ENGINE_KW)
        yield engine
        del engine


@pytest.fixture(scope="module")
def ref(model_dir, steers):
    return HFReference(model_dir, steers[0], vectors={"v": VECTORS})


def sp(steer=None, **kw):
    from vllm import SamplingParams

    kw.setdefault("max_tokens", MAX_TOKENS)
    return SamplingParams(temperature=0, extra_args=None if steer is None else {"steer": steer},
                          **kw)


def test_tp2_steered_and_unsteered_equal_the_unsharded_model(llm, ref):
    assert llm.llm_engine.vllm_config.parallel_config.tensor_parallel_size == 2
    strengths = [None, {"a": 5}, {"a": 0}, {"a": 2, "b": -4}]
    # 1 and 3: the steers do change these requests (the check is not vacuous)
    ref.check_generate(llm, PROMPTS, strengths, MAX_TOKENS, changed=(1, 3))


def test_v1_a_finished_steered_request_costs_no_steer_work_on_any_rank(llm, ref):
    before = llm.collective_rpc(steer_stats)
    assert len(before) == 2
    outs = llm.generate(PROMPTS[:2], [sp({"a": 5}, max_tokens=2), sp(max_tokens=6)])
    mid = llm.collective_rpc(steer_stats)
    # each rank steers the two steps that sampled the steered request, then nothing
    assert [m["calls"] - b["calls"] for m, b in zip(mid, before, strict=True)] == [2, 2]
    assert list(outs[1].outputs[0].token_ids) == ref.greedy(list(outs[1].prompt_token_ids), 6)
    llm.generate(PROMPTS[2:3], sp())
    assert llm.collective_rpc(steer_stats) == mid


def test_tp2_workers_both_steer_with_a_steer_loaded_at_run_time(llm, ref, tmp_path):
    from vllm.exceptions import VLLMValidationError

    from vllm_steer import offline
    from vllm_steer.format import save_steer

    steer = random_steer(HIDDEN, 8, "t", seed=5, scale=3.0)
    save_steer(tmp_path / "t.safetensors", steer)
    entry = offline.load_steer(llm, "t", tmp_path / "t.safetensors")
    assert (entry["name"], entry["bank_slot"], entry["source"]) == ("t", 3, "offline")
    # each TP rank computes half of the vocabulary's logits from its own copy of the hidden
    # state: tokens and logprobs match the unsharded reference only if both ranks steered
    ref.steers["t"] = steer
    try:
        ref.check_generate(llm, PROMPTS, [{"t": 5}, {"t": 5, "a": 2}], MAX_TOKENS,
                           changed=(0, 1))
    finally:
        del ref.steers["t"]
    assert [s["name"] for s in offline.list_steers(llm)] == ["a", "b", "v", "t"]
    offline.unload_steer(llm, "t")
    with pytest.raises(VLLMValidationError, match="unknown steer 't'"):
        llm.generate(PROMPTS[:1], sp({"t": 5}))
    save_steer(tmp_path / "small.safetensors", random_steer(64, 4, "small"))
    with pytest.raises(offline.SteerLoadError, match="hidden size 64"):
        offline.load_steer(llm, "small", tmp_path / "small.safetensors")
    assert [s["name"] for s in offline.list_steers(llm)] == ["a", "b", "v"]


def test_tp2_a_worker_fault_fails_only_the_steered_request_across_processes(llm, ref):
    """Both ranks' step planners fault once (each rank runs the same code on the same rows):
    the steered request ends with an error naming vllm-steer, carried from the worker
    processes to the engine core with the step's output; the unsteered requests of the batch
    get exactly plain greedy decoding, and the next steered request is served correctly."""
    assert llm.collective_rpc(step_rows_fault()) == [True, True]
    outs = llm.generate(PROMPTS, [sp(), sp({"a": 5}), sp(), sp()])
    check_only_the_steered_request_failed(
        outs, 1, STEP_ROWS, lambda i, prompt: ref.greedy(prompt, MAX_TOKENS))
    (after,) = llm.generate(PROMPTS[1:2], sp({"a": 5}))
    assert list(after.outputs[0].token_ids) == ref.greedy(list(after.prompt_token_ids),
                                                          MAX_TOKENS, {"a": 5})


def test_vector_steers_on_two_ranks_match_the_reference(llm, ref):
    """Tensor parallelism: each rank adds the vectors to its copy of the residual stream."""
    ref.check_generate(llm, PROMPTS, [{"v": 1.0}, None, {"v": -1.0, "a": 3}],
                       MAX_TOKENS, changed=(0, 2))
