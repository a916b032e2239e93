"""Vector steers (control vectors) served per request by a real vLLM engine (CPU, V1 runner),
with torch.compile on (no ``enforce_eager``), prefix caching and chunked prefill: every row
of a mixed batch against a transformers reference that adds the vectors with its own forward
hooks on the model's own weights, and unsteered rows against stock vLLM.

One engine serves the module: a llama.cpp GGUF vector steer, a safetensors vector steer and
an LM-Steer steer, plus run-time loads.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from helpers.reference import HFReference
from helpers.steers import random_steer
from vllm_steer.format import save_steer
from vllm_steer.vectors import make_vector_steer, save_gguf, save_vector

pytestmark = pytest.mark.vllm

PROMPTS = ["Hello there, my name is", "The weather today", "Once upon a time in a land",
           "Q: What is two plus two?\nA:"]
# over 3 KV blocks of 32 and over the 64-token chunks: cached prefixes and chunked prefill
LONG_PROMPT = " ".join(["The quick brown fox jumps over the lazy dog."] * 10)
MAX_TOKENS = 6
ENGINE_KW = dict(dtype="float32", kv_cache_memory_bytes=1 << 27, max_model_len=512,
                 max_num_seqs=8, seed=0, enable_prefix_caching=True, block_size=32,
                 enable_chunked_prefill=True, max_num_batched_tokens=64)


def _vec(seed: int, blocks, scale: float = 1.0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(64, generator=g) * scale for k in blocks}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("vector-steers")
    vecs = {"calm": _vec(1, [0, 1]), "gg": _vec(2, [1]), "late": _vec(3, [0, 1])}
    paths = {"calm": str(d / "calm.safetensors"), "gg": str(d / "gg.gguf"),
             "late": str(d / "late.safetensors")}
    save_vector(paths["calm"], make_vector_steer(vecs["calm"], "calm"))
    save_gguf(paths["gg"], make_vector_steer(vecs["gg"], "gg"))  # llama.cpp's own format
    save_vector(paths["late"], make_vector_steer(vecs["late"], "late"))
    lm = random_steer(64, 8, "lm", seed=4, scale=3.0)
    paths["lm"] = str(d / "lm.safetensors")
    save_steer(paths["lm"], lm)
    return paths, vecs, {"lm": lm}


@pytest.fixture(scope="module")
def llm(tiny_model_dir, files):
    from helpers.engines import steered_llm

    paths, _, _ = files
    served = {k: paths[k] for k in ("calm", "gg", "lm")}  # "late" is loaded at run time
    with steered_llm(tiny_model_dir, served, **ENGINE_KW) as engine:
        yield engine


@pytest.fixture(scope="module")
def ref(tiny_model_dir, files):
    _, vecs, steers = files
    return HFReference(tiny_model_dir, steers, vectors=vecs)


def _sp(steer=None, **kw):
    from vllm import SamplingParams

    kw.setdefault("max_tokens", MAX_TOKENS)
    return SamplingParams(temperature=0, logprobs=0,
                          extra_args=None if steer is None else {"steer": steer}, **kw)


def test_a_mixed_batch_of_vectors_lm_steer_and_plain_rows_matches_the_reference(llm, ref):
    mixes = [None, {"calm": 0.8}, {"calm": -0.8, "lm": 3.0}, {"gg": 1.0, "calm": 0.5}]
    ref.check_generate(llm, PROMPTS, mixes, MAX_TOKENS, changed=(1, 2, 3))


def test_unsteered_rows_are_stock_vllm_bit_for_bit(llm, tiny_model_dir, tmp_path_factory):
    from helpers.engines import stock_vllm

    stock = stock_vllm(tiny_model_dir, PROMPTS, MAX_TOKENS, ENGINE_KW,
                       tmp_path_factory.mktemp("stock"))
    outs = llm.generate(PROMPTS, [_sp(), _sp({"calm": 1.0}), _sp(), _sp({"gg": -1.0})],
                        use_tqdm=False)
    for i in (0, 2):
        got = outs[i].outputs[0]
        assert list(got.token_ids) == stock[i][0]
        assert [e[t].logprob for t, e in zip(got.token_ids, got.logprobs, strict=True)] \
            == stock[i][1]  # the same floats: nothing was added to these rows


def test_the_prefix_cache_never_serves_one_mix_to_another(llm, ref):
    """The same long prompt steered, then unsteered, then steered again, then with another
    mix: each equals its own reference; a vector mix never reuses a prefix cached under
    another mix (or none), an LM-Steer mix shares the unsteered prefix."""
    order = [{"calm": 0.6}, None, {"calm": 0.6}, {"calm": -0.6}, {"lm": 3.0}, None]
    outs = []
    for mix in order:  # one at a time: each request finds the cache the previous ones left
        outs.append(ref.check_generate(llm, [LONG_PROMPT], [mix], MAX_TOKENS)[0])
    cached = [o.num_cached_tokens for o in outs]
    assert cached[0] == 0 or cached[0] is None  # nothing under this mix yet
    assert cached[1] == 0  # unsteered after steered: the vector's blocks are not reused
    assert cached[2] > 0  # the same mix again: its own blocks
    assert cached[3] == 0  # the opposite strength is another mix
    assert cached[4] > 0 and cached[5] > 0  # LM-Steer and plain share the unsteered blocks
    assert outs[0].outputs[0].token_ids == outs[2].outputs[0].token_ids  # the same mix


def test_a_generation_window_on_a_vector_follows_each_token(llm, ref):
    """Inside the window the vector's strength, outside it the base (prompt tokens too): the
    reference recomputes every position with the strength of the generated token its row
    samples."""
    win = {"strength": 1.0, "start": 2, "end": 4, "base": 0.0}
    outs = llm.generate(PROMPTS[:2], [_sp({"calm": win}), _sp({"calm": 1.0})], use_tqdm=False)
    prompt = list(outs[0].prompt_token_ids)
    ids = list(prompt)

    def at(t):  # the window's strength at generated token t (t < 0: a prompt token's row)
        return win["strength"] if win["start"] <= t < win["end"] else win["base"]

    for tok in outs[0].outputs[0].token_ids:
        per_pos = [at(p + 1 - len(prompt)) for p in range(len(ids))]
        lp = ref.logprobs(ids, {"calm": per_pos})[-1]
        assert tok == int(lp.argmax())
        ids.append(tok)
    assert list(outs[0].outputs[0].token_ids) != list(outs[1].outputs[0].token_ids)



def test_a_later_turn_under_the_same_window_reuses_no_block_computed_at_other_strengths(
        llm, ref):
    """Turn 2's prompt is turn 1's prompt and reply, under the same window: the reply's
    tokens were computed at the window's strengths in turn 1 and are prompt tokens, at the
    base strength, in turn 2. Turn 2 equals the reference, token and logprob, although its
    prompt starts with turn 1's cached blocks; the same prompt again reuses its own."""
    from vllm.inputs import TokensPrompt

    win = {"strength": 1.0, "start": 3, "end": 10, "base": 0.0}
    p1 = llm.get_tokenizer()(LONG_PROMPT)["input_ids"][:40]
    t1 = llm.generate([TokensPrompt(prompt_token_ids=p1)], [_sp({"calm": win}, max_tokens=30)],
                      use_tqdm=False)[0]
    p2 = p1 + list(t1.outputs[0].token_ids)  # two blocks of 32 and more
    t2 = llm.generate([TokensPrompt(prompt_token_ids=p2)], [_sp({"calm": win})],
                      use_tqdm=False)[0]

    def at(t):  # the window's strength at generated token t (t < 0: a prompt token's row)
        return win["strength"] if win["start"] <= t < win["end"] else win["base"]

    # under a window a prompt of another length reads none of turn 1's blocks (served from
    # them, turn 2's first token was wrong: its reply's tokens at the window's strengths)
    assert t2.num_cached_tokens == 0
    ids = list(p2)
    for tok, entry in zip(t2.outputs[0].token_ids, t2.outputs[0].logprobs, strict=True):
        lp = ref.logprobs(ids, {"calm": [at(p + 1 - len(p2)) for p in range(len(ids))]})[-1]
        assert tok == int(lp.argmax()), len(ids) - len(p2)
        assert entry[tok].logprob == pytest.approx(lp[tok].item(), abs=2e-3), len(ids) - len(p2)
        ids.append(tok)
    t3 = llm.generate([TokensPrompt(prompt_token_ids=p2)], [_sp({"calm": win})],
                      use_tqdm=False)[0]
    assert t3.num_cached_tokens >= 64  # the same prompt under the same window: its blocks
    assert t3.outputs[0].token_ids == t2.outputs[0].token_ids


def test_a_vector_loaded_and_unloaded_at_run_time_is_served_and_listed(llm, ref, files):
    from vllm_steer import offline

    paths, _, _ = files
    entry = offline.load_steer(llm, "late", paths["late"])
    assert entry["kind"] == "vector" and entry["layers"] == [0, 1] and entry["rank"] == 0
    kinds = {s["name"]: s["kind"] for s in offline.list_steers(llm)}
    assert kinds == {"calm": "vector", "gg": "vector", "lm": "lm-steer", "late": "vector"}
    ref.check_generate(llm, PROMPTS[:2], [{"late": 0.7, "lm": -2.0}, None], MAX_TOKENS,
                       changed=(0,))
    offline.unload_steer(llm, "late")
    with pytest.raises(Exception, match="late"):
        llm.generate(PROMPTS[:1], [_sp({"late": 0.7})], use_tqdm=False)



def test_an_lm_steer_loaded_into_a_vector_s_slot_gets_nothing_of_the_vector(llm, ref, files,
                                                                            tmp_path):
    """A full bank: a name held by a vector steer is loaded again with an LM-Steer file, into
    its own slot. The new steer's requests get no vector in the decoder blocks, and neither do
    the unsteered requests that share their prefix cache (LM-Steer mixes are not salted)."""
    from vllm_steer import offline

    paths, _, _ = files
    big = tmp_path / "big.safetensors"
    save_vector(big, make_vector_steer(_vec(9, [0, 1], scale=10.0), "big"))
    lm2 = random_steer(64, 8, "swap", seed=6, scale=3.0)
    save_steer(tmp_path / "swap.safetensors", lm2)
    room = 8 - len(offline.list_steers(llm)) - 1  # --max-steers 8: all but one slot
    fillers = [f"fill{i}" for i in range(room)]
    for n in fillers:
        offline.load_steer(llm, n, paths["lm"])
    try:
        assert offline.load_steer(llm, "swap", str(big))["kind"] == "vector"
        assert len(offline.list_steers(llm)) == 8  # full: the next load takes its own slot
        llm.generate([LONG_PROMPT], [_sp({"swap": 0.5})], use_tqdm=False)
        assert offline.load_steer(llm, "swap", str(tmp_path / "swap.safetensors"))["kind"] \
            == "lm-steer"
        ref.steers["swap"] = lm2
        ref.check_generate(llm, [LONG_PROMPT], [{"swap": 3.0}], MAX_TOKENS, changed=(0,))
        plain = ref.check_generate(llm, [LONG_PROMPT], [None], MAX_TOKENS)[0]
        assert plain.num_cached_tokens > 0  # from the LM-Steer request's blocks
    finally:
        ref.steers.pop("swap", None)
        for n in [*fillers, "swap"]:
            with contextlib.suppress(offline.SteerLoadError):  # "swap": if its load failed
                offline.unload_steer(llm, n)


def test_a_vector_for_another_model_is_refused_naming_both_sides(llm, files, tmp_path):
    from vllm_steer import offline

    bad = make_vector_steer(_vec(5, [0, 7], scale=1.0) | {}, "wide")
    path = tmp_path / "wide.safetensors"
    save_vector(path, bad)
    with pytest.raises(offline.SteerLoadError) as e:
        offline.load_steer(llm, "wide", str(path))
    assert "blocks 7" in str(e.value) and "2 decoder blocks" in str(e.value)
    assert {s["name"] for s in offline.list_steers(llm)} == {"calm", "gg", "lm"}


def _block_classes(worker):
    """The class names of the worker's decoder blocks."""
    return sorted({type(m).__name__ for m in worker.model_runner.model.modules()
                   if type(m).__name__.endswith("DecoderLayer")})


def test_the_op_sits_in_the_compiled_model_s_decoder_blocks(llm):
    assert llm.collective_rpc(_block_classes) == [["SteeredLlamaDecoderLayer"]]
    # compiled: vLLM's torch.compile mode, not eager
    assert llm.llm_engine.vllm_config.model_config.enforce_eager is False
    assert llm.llm_engine.vllm_config.compilation_config.mode != 0
