"""Speculative decoding with steers, in a real vLLM engine (CPU, V1 runner), offline ``LLM``.

One engine per speculative configuration, shared by the module's tests:

- ``ngram``: prompt lookup, no drafter logits (only the target's verification rows);
- ``draft_model``: the target model itself as the draft model (same hidden size: the
  drafter is steered, so a greedy steered request accepts every draft token);

A drafter of another hidden size than the steers' is left unsteered: that decision is tested
without an engine in test_spec_decode.py (``prepare_drafter``).

Greedy tokens are compared with transformers on the model's own weights (``HFReference``),
unsteered tokens and logprobs with stock vLLM (no plugin, no speculative decoding).
"""

from __future__ import annotations


import pytest

from conftest import HFReference, random_steer, save_steers

pytestmark = pytest.mark.vllm

PROMPTS = ["Hello there, my name is", "The weather today",
           "one two three one two three one two three one two",
           "Q: What is two plus two?\nA:"]
MAX_TOKENS = 16
ENGINE_KW = dict(dtype="float32", kv_cache_memory_bytes=1 << 27, max_model_len=256,
                 max_num_seqs=8, enforce_eager=True, seed=0, enable_prefix_caching=False)
SPEC = {
    "ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
              "prompt_lookup_min": 1},
    "draft_model": {"method": "draft_model", "num_speculative_tokens": 3},
}
STEERS = {"a": 5, "b": -4}
# a mixed batch: steered and unsteered requests
MIXED = [{"a": 5}, None, {"b": -4}, {"a": 3, "b": 2}]


@pytest.fixture(scope="module")
def steers():
    return {"a": random_steer(64, 8, "a", seed=1, scale=3.0),
            "b": random_steer(64, 8, "b", seed=2, scale=3.0)}


@pytest.fixture(scope="module")
def steer_files(tmp_path_factory, steers):
    return save_steers(tmp_path_factory.mktemp("steers"), steers)


@pytest.fixture(scope="module")
def ref(tiny_model_dir, steers):
    return HFReference(tiny_model_dir, steers)


@pytest.fixture(scope="module", params=list(SPEC))
def engine(request, tiny_model_dir, steer_files):
    from vllm import LLM

    spec = dict(SPEC[request.param])
    if request.param == "draft_model":
        spec["model"] = str(tiny_model_dir)
    llm = LLM(str(tiny_model_dir), additional_config={"vllm_steer": {"steers": steer_files}},
              speculative_config=spec, disable_log_stats=False, **ENGINE_KW)
    yield request.param, llm
    del llm


@pytest.fixture(scope="module")
def vanilla(tiny_model_dir, tmp_path_factory):
    """Greedy tokens and their logprobs from stock vLLM: no plugin, no speculative decoding."""
    from conftest import stock_vllm

    return stock_vllm(tiny_model_dir, PROMPTS, MAX_TOKENS, ENGINE_KW,
                      tmp_path_factory.mktemp("vanilla"))


def sp(steer=None, **kw):
    from vllm import SamplingParams

    return SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                          extra_args=None if steer is None else {"steer": steer}, **kw)


def spec_counts(llm) -> tuple[int, int]:
    """(draft tokens, accepted tokens) so far, from vLLM's own spec-decode metrics."""
    vals = {m.name: m.value for m in llm.get_metrics() if hasattr(m, "value")}
    return (int(vals.get("vllm:spec_decode_num_draft_tokens", 0)),
            int(vals.get("vllm:spec_decode_num_accepted_tokens", 0)))


def generate(llm, steers_, **kw):
    """Outputs of PROMPTS with these per-request steers, and the step's (drafted, accepted)."""
    d0, a0 = spec_counts(llm)
    outs = llm.generate(PROMPTS, [sp(s, **kw) for s in steers_])
    d1, a1 = spec_counts(llm)
    return outs, (d1 - d0, a1 - a0)


def test_greedy_steered_tokens_equal_the_steered_reference_in_a_mixed_batch(engine, ref,
                                                                           vanilla):
    name, llm = engine
    outs, (drafted, accepted) = generate(llm, MIXED)
    assert drafted > 0, f"{name}: no draft tokens were verified; the test would prove nothing"
    for o, steer, (plain, _) in zip(outs, MIXED, vanilla):
        got = list(o.outputs[0].token_ids)
        if steer is None:
            assert got == plain, (name, o.prompt)
        else:
            assert got == ref.greedy(list(o.prompt_token_ids), MAX_TOKENS, steer), \
                (name, o.prompt, steer)
            assert got != plain, (name, o.prompt, "the steer has no visible effect")


def test_unsteered_tokens_and_logprobs_equal_stock_vllm(engine, vanilla):
    name, llm = engine
    outs, (drafted, _) = generate(llm, [None] * len(PROMPTS), logprobs=0)
    assert drafted > 0
    for o, (plain, plain_lp) in zip(outs, vanilla):
        toks = list(o.outputs[0].token_ids)
        assert toks == plain, (name, o.prompt)
        got = [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, toks)]
        assert got == pytest.approx(plain_lp, abs=1e-4), (name, o.prompt)


def test_logprobs_follow_the_steered_target(engine, ref):
    name, llm = engine
    outs, (drafted, _) = generate(llm, MIXED, logprobs=0)
    assert drafted > 0
    for o, steer in zip(outs, MIXED):
        ids = list(o.prompt_token_ids) + list(o.outputs[0].token_ids)
        lp = ref.logprobs(ids, steer)
        n = len(o.prompt_token_ids)
        for i, (tok, entry) in enumerate(zip(o.outputs[0].token_ids, o.outputs[0].logprobs)):
            assert entry[tok].logprob == pytest.approx(float(lp[n - 1 + i, tok]), abs=2e-3), \
                (name, o.prompt, steer, i)


def test_a_steered_drafter_proposes_the_steered_tokens(engine):
    """The target itself as the draft model: with its rows steered by each request's own
    steer, every greedy draft token of a steered batch is accepted."""
    name, llm = engine
    if name != "draft_model":
        pytest.skip("only the draft model shares the steers' hidden size")
    _, (drafted, accepted) = generate(llm, MIXED)
    assert drafted > 0 and accepted == drafted, (drafted, accepted)
