"""Speculative decoding with steers under Model Runner V2, live on this CPU through the test
shim (tests/v2shim: V2's Triton kernels in the Triton interpreter), offline ``LLM``.

V2 maps every verification row (``num_draft_tokens + 1`` per request) through the
``expanded_idx_mapping`` that its ``sample()`` gets. Its draft model runs eagerly and is
steered as on V1 (the target as its own draft model: every draft of a mixed batch accepted
only if each drafter row gets its own request's steer). Its EAGLE drafter's head runs inside
CUDA-graph-captured draft steps on a GPU and is steered by the capture-safe op, its rows
mapped on the device from the speculator's ``idx_mapping`` (see
``vllm_steer.integrations.worker.spec_decode``; here it runs eagerly): the oracle EAGLE head
of test_vllm_specdec.py, which proposes exactly the target's greedy tokens when steered like
the target, has every draft of a steered batch accepted too. Outputs are exactly the steered
target's either way.

One engine per method (n-gram, the target as its own draft model, EAGLE, EAGLE-3 with a
random head and a 1,024-token draft vocabulary, MTP on a MiMo-style target), one mixed batch
each (LM-Steer mixes, a vector steer on the target's blocks, none): every request's greedy
tokens and logprobs against transformers on the target's own weights with the request's steer
(vectors added by forward hooks), or none (``HFReference``; test_vllm_specdec.py compares
unsteered requests with stock vLLM on the V1 runner).
"""

from __future__ import annotations

import pytest

from helpers.models import make_tiny_llama, make_tiny_mimo
from helpers.reference import HFReference
from e2e.test_vllm_specdec import (ENGINE_KW, MIXED, PROMPTS, VECTORS, spec_counts,
                                   speculative_config)
from helpers.steers import save_vector_steer

pytestmark = pytest.mark.vllm

#: tokens per request: each V2 step with a drafter takes seconds in the Triton interpreter
#: (the test shim), and 8 tokens already verify drafts at several steps and show every steer
MAX_TOKENS = 8

METHODS = ("ngram", "draft_model", "eagle", "eagle3", "mtp")
TARGET = {"ngram": "tiny", "draft_model": "tiny", "eagle": "bigram", "eagle3": "tiny",
          "mtp": "mimo"}


@pytest.fixture(scope="module")
def targets(tiny_model_dir, tmp_path_factory):
    return {"tiny": tiny_model_dir,
            "bigram": make_tiny_llama(tmp_path_factory.mktemp("bigram-v2"), bigram=True),
            "mimo": make_tiny_mimo(tmp_path_factory.mktemp("mimo-v2"))}


@pytest.fixture(scope="module", params=METHODS)
def engine(request, v2_runner, targets, pair_steers, tmp_path_factory):
    from vllm import LLM

    name = request.param
    target = targets[TARGET[name]]
    spec = speculative_config(name, target, tmp_path_factory, "-v2")
    from hook_recorder import RECORD_ENV

    HOOK_RECORDS[name] = str(tmp_path_factory.mktemp(f"hooks-v2-{name}"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(RECORD_ENV, HOOK_RECORDS[name])  # inherited by the engine processes
        steers = {**pair_steers[1], "v": save_vector_steer(
            tmp_path_factory.mktemp(f"vector-v2-{name}") / "v.safetensors", VECTORS, "v")}
        llm = LLM(str(target), additional_config={"vllm_steer": {"steers": steers}},
                  speculative_config=spec, disable_log_stats=False, **ENGINE_KW)
    yield name, target, llm
    del llm


#: method -> the directory where its engine's processes record the hooks they ran
HOOK_RECORDS: dict[str, str] = {}
#: the wrapped hooks of Model Runner V2's speculative-decoding group each method's drafter
#: calls: the draft model (StandaloneARSpeculator) all three; the EAGLE family loads and
#: samples its drafts through DraftModelSpeculator; n-gram has no drafter model
V2_SPEC_CALLS = {
    "draft_model": ("StandaloneARSpeculator.propose", "DraftModelSpeculator.load_model",
                    "DraftModelSpeculator.sample_draft"),
    "eagle": ("DraftModelSpeculator.load_model", "DraftModelSpeculator.sample_draft"),
    "eagle3": ("DraftModelSpeculator.load_model", "DraftModelSpeculator.sample_draft"),
}


#: the batch: the LM-Steer mixes of test_vllm_specdec.py (one steer, none, a negative
#: strength, two composed), the last two with the vector steer on the target's blocks at both
#: signs, whose verification rows the step mapping covers (the drafts' tokens included); four
#: requests, as each V2 step in the Triton interpreter costs by the request
BATCH = list(zip(PROMPTS, [MIXED[0], MIXED[1], {**MIXED[2], "v": -1.0},
                           {**MIXED[3], "v": 1.0}], strict=True))


def test_v2_speculative_decoding_serves_the_steered_target_in_a_mixed_batch(engine,
                                                                          pair_steers):
    from vllm import SamplingParams

    name, target, llm = engine
    ref = HFReference(target, pair_steers[0], vectors={"v": VECTORS})
    d0, _ = spec_counts(llm)
    outs = llm.generate([p for p, _ in BATCH], [SamplingParams(
        temperature=0, max_tokens=MAX_TOKENS, logprobs=0,
        extra_args=None if s is None else {"steer": s}) for _, s in BATCH], use_tqdm=False)
    drafted, _ = spec_counts(llm)
    assert drafted - d0 > 0, f"{name}: no draft tokens were verified; nothing was tested"
    changed = 0
    for o, (_, steer) in zip(outs, BATCH, strict=True):
        ids, got = list(o.prompt_token_ids), list(o.outputs[0].token_ids)
        assert got == ref.greedy(ids, MAX_TOKENS, steer), (name, o.prompt, steer)
        changed += steer is not None and got != ref.greedy(ids, MAX_TOKENS)
        lp = ref.logprobs(ids + got, steer)
        lps = [lp_[t].logprob for lp_, t in zip(o.outputs[0].logprobs, got, strict=True)]
        assert lps == pytest.approx([float(lp[len(ids) - 1 + i, t]) for i, t in
                                     enumerate(got)], abs=2e-3), (name, o.prompt, steer)
    assert changed == sum(s is not None for _, s in BATCH), "a steer had no visible effect"


def _acceptance(llm, steer) -> float:
    from vllm import SamplingParams

    d0, a0 = spec_counts(llm)
    llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                         extra_args=None if steer is None
                                         else {"steer": steer}), use_tqdm=False)
    d1, a1 = spec_counts(llm)
    assert d1 > d0
    return (a1 - a0) / (d1 - d0)



def test_v2_prompt_logprobs_of_mimo_follow_the_steered_target(engine, pair_steers):
    """MiMo (the MTP target) applies its final norm inside ``compute_logits``: its head gets
    a new tensor, not a slice of the step's hidden states; its steered requests' prompt
    logprobs are still the steered model's (they were served unsteered). The other targets'
    prompt logprobs: test_vllm_specdec.py (V1), test_vllm_v2.py."""
    from vllm import SamplingParams

    name, target, llm = engine
    if name != "mtp":
        pytest.skip("MiMo is the MTP target")
    ref = HFReference(target, pair_steers[0])
    steers = [MIXED[0], None]
    outs = llm.generate(PROMPTS[:2], [SamplingParams(
        temperature=0, max_tokens=1, prompt_logprobs=0,
        extra_args=None if s is None else {"steer": s}) for s in steers], use_tqdm=False)
    for o, steer in zip(outs, steers, strict=True):
        ids = list(o.prompt_token_ids)
        lp, plain = ref.logprobs(ids, steer), ref.logprobs(ids)
        for i in range(1, len(ids)):
            assert o.prompt_logprobs[i][ids[i]].logprob == pytest.approx(
                float(lp[i - 1, ids[i]]), abs=2e-3), (steer, i)
        if steer:
            assert max(abs(float(lp[i - 1, ids[i]] - plain[i - 1, ids[i]]))
                       for i in range(1, len(ids))) > 0.05

def test_v2_draft_model_and_eagle_drafters_are_steered(engine):
    """Draft model (eager, rows mapped on the host) and EAGLE (its head inside captured draft
    steps on a GPU, rows mapped on the device): steered, so a steered batch accepts every
    draft, as the unsteered one does."""
    name, _, llm = engine
    if name not in ("draft_model", "eagle"):
        pytest.skip("n-gram has no drafter logits; the random EAGLE-3 / MTP heads' acceptance "
                    "says nothing about their steer")
    plain, steered = _acceptance(llm, None), _acceptance(llm, {"a": 5})
    assert plain == 1.0 and steered == 1.0, (plain, steered)


def test_every_hook_of_the_v2_speculative_decoding_groups_ran_in_the_engine(engine):
    """Hook coverage with speculative decoding on Model Runner V2, per method: the V2
    runner's wrapped hooks, and those of its speculative-decoding group that the method's
    drafter uses (:data:`V2_SPEC_CALLS`; the draft model uses every one), were called in the
    engine's processes, so a patched name vLLM stopped calling fails here."""
    from vllm import SamplingParams

    from hook_recorder import recorded, wrapped_targets
    from vllm_steer.integrations.plugin import HOOKS

    name, _, llm = engine
    outs = llm.generate(PROMPTS, [SamplingParams(  # a prefill and decode steps with drafts
        temperature=0, max_tokens=4, extra_args=None if s is None else {"steer": s})
        for s in MIXED], use_tqdm=False)
    assert all(o.outputs[0].token_ids for o in outs)
    ran = recorded(HOOK_RECORDS[name])
    spec = wrapped_targets(HOOKS, ("v2-spec",))
    want = wrapped_targets(HOOKS, ("v2",)) - {  # only under --enable-batch-sharded-sampling
        "vllm.v1.worker.gpu.sample.batch_shard:BatchSharder.shard_sampler_inputs"} | {
        t for t in spec if t.rpartition(":")[2] in V2_SPEC_CALLS.get(name, ())}
    assert V2_SPEC_CALLS["draft_model"] == tuple(sorted(
        (t.rpartition(":")[2] for t in spec), key=V2_SPEC_CALLS["draft_model"].index))
    assert want - ran == set(), f"{name}: hooks never called: {sorted(want - ran)}"
    assert not ran & wrapped_targets(HOOKS, ("v1", "v1-lens", "v1-spec"))
