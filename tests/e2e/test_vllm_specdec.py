"""Speculative decoding with steers, in a real vLLM engine (CPU, V1 runner), offline ``LLM``.

One engine per speculative method, shared by the module's tests (tiny random models):

- ``ngram``: prompt lookup, no drafter logits (only the target's verification rows);
- ``draft_model``: the target model itself as the draft model (same hidden size: the
  drafter is steered, so a greedy steered request accepts every draft token);
- ``eagle``: an EAGLE head (``EagleLlamaForCausalLM``) on a *bigram* target (its layers add
  nothing to the residual stream, so the head's input is the normalised embedding of the
  current token). The head is built to predict that target exactly: ``fc`` passes the next
  token's embedding through, its decoder layer adds nothing, and the target's LM head is
  shared; its output is the target's head input up to a positive scale, so the steered
  drafter proposes exactly the steered target's greedy tokens and every draft is accepted,
  only if each drafter row gets its own request's steer;
- ``eagle3``: a random EAGLE-3 head (``Eagle3LlamaForCausalLM``, three target layers' hidden
  states, its own LM head over a 1,024-token draft vocabulary mapped by ``d2t``);
- ``mtp``: a MiMo-style target with one multi-token-prediction layer (``{"method": "mtp"}``).

A drafter of another hidden size than the steers' is left unsteered: that decision is tested
without an engine in test_spec_decode.py (``prepare_drafter``).

Greedy tokens are compared with transformers on the target's own weights (``HFReference``),
unsteered tokens and logprobs with stock vLLM (no plugin, no speculative decoding: under
greedy verification both give the target's own tokens).
"""

from __future__ import annotations

import functools

import pytest

from helpers.models import make_tiny_eagle, make_tiny_llama, make_tiny_mimo
from helpers.reference import HFReference
from helpers.steers import random_vectors, save_vector_steer

pytestmark = pytest.mark.vllm

PROMPTS = ["Hello there, my name is", "The weather today",
           "one two three one two three one two three one two",
           "Q: What is two plus two?\nA:"]
MAX_TOKENS = 16
ENGINE_KW = dict(dtype="float32", kv_cache_memory_bytes=1 << 27, max_model_len=256,
                 max_num_seqs=8, enforce_eager=True, seed=0, enable_prefix_caching=False,
                 max_num_batched_tokens=256)  # V2's start-up warm-up runs this many tokens
SPEC = {
    "ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
              "prompt_lookup_min": 1},
    "draft_model": {"method": "draft_model", "num_speculative_tokens": 3},
    "eagle": {"method": "eagle", "num_speculative_tokens": 3},
    "eagle3": {"method": "eagle3", "num_speculative_tokens": 3},
    "mtp": {"method": "mtp", "num_speculative_tokens": 1},  # MiMo's MTP predicts one token
}
#: the target model each method runs on
TARGET = {"ngram": "tiny", "draft_model": "tiny", "eagle": "bigram", "eagle3": "tiny",
          "mtp": "mimo"}
#: methods whose drafter is built to propose exactly the target's greedy tokens
EXACT_DRAFTER = ("draft_model", "eagle")
# a mixed batch: steered and unsteered requests
MIXED = [{"a": 5}, None, {"b": -4}, {"a": 3, "b": 2}]
#: a vector steer on both blocks of every target (all of hidden size 64)
VECTORS = random_vectors(64, [0, 1], seed=15)


def oracle_eagle_head(out, hidden: int = 64):
    """An EAGLE head that predicts a bigram target's next token exactly (see the module
    docstring): ``fc = [I | 0]`` keeps the next token's embedding, and the decoder layer's
    output projections are zero, so the head returns that embedding."""
    import torch

    fc = torch.zeros(hidden, 2 * hidden)
    fc[:, :hidden] = torch.eye(hidden)
    return make_tiny_eagle(out, "eagle", hidden, weights={
        "fc.weight": fc, "layers.0.self_attn.o_proj.weight": torch.zeros(hidden, 64),
        "layers.0.mlp.down_proj.weight": torch.zeros(hidden, 2 * hidden)})


@pytest.fixture(scope="module")
def targets(tiny_model_dir, tmp_path_factory):
    """Target model folders by name, made on first use."""
    makers = {"tiny": lambda: tiny_model_dir,
              "bigram": lambda: make_tiny_llama(tmp_path_factory.mktemp("bigram"), bigram=True),
              "mimo": lambda: make_tiny_mimo(tmp_path_factory.mktemp("mimo"))}
    return functools.cache(lambda name: makers[name]())


@pytest.fixture(scope="module")
def refs(targets, pair_steers):
    return functools.cache(lambda name: HFReference(targets(name), pair_steers[0]))


@pytest.fixture(scope="module")
def stock(targets, tmp_path_factory):
    """Greedy tokens and their logprobs from stock vLLM (no plugin, no speculative decoding),
    per target: every target's engine in one subprocess, on first use."""
    from helpers.engines import stock_vllm_many

    names = sorted(set(TARGET.values()))

    @functools.cache
    def all_targets():
        jobs = [(targets(n), PROMPTS, MAX_TOKENS, ENGINE_KW) for n in names]
        return dict(zip(names, stock_vllm_many(jobs, tmp_path_factory.mktemp("stock")),
                        strict=True))

    return lambda name: all_targets()[name]


def speculative_config(name: str, target, tmp_path_factory, tag: str = "") -> dict:
    """``--speculative-config`` of method ``name`` for the target model folder ``target``:
    the target itself as the draft model, the oracle EAGLE head, or a random EAGLE-3 head
    (``tag``: a suffix for the folders it makes)."""
    spec = dict(SPEC[name])
    if name == "draft_model":
        spec["model"] = str(target)
    elif name == "eagle":
        spec["model"] = str(oracle_eagle_head(tmp_path_factory.mktemp("eagle" + tag)))
    elif name == "eagle3":
        spec["model"] = str(make_tiny_eagle(tmp_path_factory.mktemp("eagle3" + tag), "eagle3",
                                            draft_vocab=1024))
    return spec


@pytest.fixture(scope="module", params=list(SPEC))
def engine(request, targets, pair_steers, tmp_path_factory):
    from vllm import LLM

    name = request.param
    target = targets(TARGET[name])
    spec = speculative_config(name, target, tmp_path_factory)
    from hook_recorder import RECORD_ENV

    HOOK_RECORDS[name] = str(tmp_path_factory.mktemp(f"hooks-{name}"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(RECORD_ENV, HOOK_RECORDS[name])  # inherited by the engine core it starts
        steers = {**pair_steers[1], "v": save_vector_steer(
            tmp_path_factory.mktemp(f"vector-{name}") / "v.safetensors", VECTORS, "v")}
        llm = LLM(str(target), additional_config={"vllm_steer": {"steers": steers}},
                  speculative_config=spec, disable_log_stats=False, **ENGINE_KW)
    yield name, llm
    del llm


#: method -> the directory where its engine's processes record the hooks they ran
HOOK_RECORDS: dict[str, str] = {}


@pytest.fixture
def ref(engine, refs):
    return refs(TARGET[engine[0]])


@pytest.fixture
def vanilla(engine, stock):
    return stock(TARGET[engine[0]])


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
    for o, steer, (plain, _) in zip(outs, MIXED, vanilla, strict=True):
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
    for o, (plain, plain_lp) in zip(outs, vanilla, strict=True):
        toks = list(o.outputs[0].token_ids)
        assert toks == plain, (name, o.prompt)
        got = [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, toks, strict=True)]
        assert got == pytest.approx(plain_lp, abs=1e-4), (name, o.prompt)


def test_logprobs_follow_the_steered_target(engine, ref):
    name, llm = engine
    outs, (drafted, _) = generate(llm, MIXED, logprobs=0)
    assert drafted > 0
    for o, steer in zip(outs, MIXED, strict=True):
        ids = list(o.prompt_token_ids) + list(o.outputs[0].token_ids)
        lp = ref.logprobs(ids, steer)
        n = len(o.prompt_token_ids)
        for i, (tok, entry) in enumerate(zip(o.outputs[0].token_ids, o.outputs[0].logprobs,
                                             strict=True)):
            assert entry[tok].logprob == pytest.approx(float(lp[n - 1 + i, tok]), abs=2e-3), \
                (name, o.prompt, steer, i)



def test_prompt_logprobs_follow_the_steered_target(engine, ref):
    """Prompt logprobs of steered requests are the steered model's, on every target: MiMo
    (the MTP target) applies its final norm inside ``compute_logits``, so its head gets a new
    tensor, not a slice of the step's hidden states (it was served unsteered)."""
    name, llm = engine
    outs = llm.generate(PROMPTS, [sp(s, prompt_logprobs=0) for s in MIXED],
                        use_tqdm=False)
    for o, steer in zip(outs, MIXED, strict=True):
        ids = list(o.prompt_token_ids)
        lp = ref.logprobs(ids, steer)
        plain = ref.logprobs(ids)
        for i in range(1, len(ids)):
            got = o.prompt_logprobs[i][ids[i]].logprob
            assert got == pytest.approx(float(lp[i - 1, ids[i]]), abs=2e-3), (name, steer, i)
        if steer:
            assert max(abs(float(lp[i - 1, ids[i]] - plain[i - 1, ids[i]]))
                       for i in range(1, len(ids))) > 0.05, (name, steer)

def test_a_steered_drafter_proposes_the_steered_tokens(engine):
    """A drafter that predicts the target exactly (the target itself as the draft model; the
    oracle EAGLE head on the bigram target): with its rows steered by each request's own
    steer, every greedy draft token of a mixed batch is accepted."""
    name, llm = engine
    if name not in EXACT_DRAFTER:
        pytest.skip("only these drafters predict the target exactly")
    _, (drafted, accepted) = generate(llm, MIXED)
    assert drafted > 0 and accepted == drafted, (drafted, accepted)


def test_every_hook_of_the_v1_speculative_decoding_groups_ran_in_the_engine(engine):
    """Hook coverage with speculative decoding on the V1 runner, per method: every wrapped
    hook of the V1 runner's groups and of its speculative-decoding group was called in the
    engine's processes, so a patched name vLLM stopped calling fails here."""
    from hook_recorder import recorded, wrapped_targets
    from vllm_steer.integrations.plugin import HOOKS

    name, llm = engine
    outs = llm.generate(PROMPTS, [sp(s) for s in MIXED], use_tqdm=False)
    assert all(o.outputs[0].token_ids for o in outs)
    ran = recorded(HOOK_RECORDS[name])
    want = wrapped_targets(HOOKS, ("v1", "v1-spec"))
    assert len(want) == 6, sorted(want)
    assert want - ran == set(), f"{name}: hooks never called: {sorted(want - ran)}"


def test_vector_steered_verification_gives_the_greedy_text_without_speculation(engine, targets,
                                                                                pair_steers):
    """The target's verification of the drafts runs with the requests' vectors in its blocks
    (the step mapping covers the draft tokens): the greedy text is the model's with the
    vectors added by forward hooks, whatever the (unsteered-in-layers) drafter proposed."""
    name, llm = engine
    ref = HFReference(targets(TARGET[name]), pair_steers[0], vectors={"v": VECTORS})
    mixes = [{"v": 1.0}, None, {"v": -1.0, "a": 3}]
    outs = llm.generate(PROMPTS[:3], [sp(m) for m in mixes], use_tqdm=False)
    for o, mix in zip(outs, mixes, strict=True):
        ids, got = list(o.prompt_token_ids), list(o.outputs[0].token_ids)
        assert got == ref.greedy(ids, len(got), mix), (name, mix)
    ids = list(outs[0].prompt_token_ids)
    assert ref.greedy(ids, 6, {"v": 1.0}) != ref.greedy(ids, 6), name  # the vector matters
