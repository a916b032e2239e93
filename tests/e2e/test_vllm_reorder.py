"""Rows that vLLM's V1 runner reorders (SWAP moves) keep their own request's steer, in a real
engine on this CPU.

Attention backends that split decodes from prefills (FlashInfer, MLA, FlashAttention 3 on
GPUs: their metadata builder's ``reorder_batch_threshold``) make the V1 runner reorder its
persistent batch before each step (``reorder_batch_to_split_decodes_and_prefills``): decodes
first, prefills last, by swapping requests, which our logits processor receives as
``BatchUpdate.moved`` entries with ``MoveDirectionality.SWAP`` (``RequestSlots.move``).
The CPU attention backend does not ask for it, so the test sets the runner's
``reorder_batch_threshold`` to 1 in the engine process (what a decode-splitting backend
reports), runs steered and unsteered prompts of different lengths and ``max_tokens`` through
three seats (new prefills land in freed seats in front of running decodes and are swapped
behind them), counts the swaps the runtime received (so the test cannot pass without them) and
checks each request's greedy tokens and logprobs against the formula applied by hand on the
model's weights (``helpers.reference.HFReference``).
"""

from __future__ import annotations

import pytest

from helpers.engines import steered_llm

pytestmark = pytest.mark.vllm

PROMPTS = ["Hello there, my name is", "The weather", "Once upon a time in a land far away, there",
           "Q: What is two plus two?\nA:", "In", "A B C D E F G H I J K L M N",
           "The quick brown fox jumps over"]
# (steer, max_tokens): seven requests through three seats, leaving at different steps
REQUESTS = [({"a": 5}, 2), (None, 6), ({"b": -6}, 3), ({"a": 2, "b": 3}, 7), (None, 2),
            ({"a": -4}, 5), ({"b": 4}, 4)]
ENGINE_KW = dict(dtype="float32", kv_cache_memory_bytes=1 << 28, max_model_len=256,
                 max_num_seqs=3, enforce_eager=True, seed=0)


@pytest.fixture(scope="module")
def llm(tiny_model_dir, pair_steers):
    with steered_llm(tiny_model_dir, pair_steers[1], **ENGINE_KW) as engine:
        yield engine


def sp(steer, n):
    from vllm import SamplingParams

    return SamplingParams(temperature=0, max_tokens=n, logprobs=0, ignore_eos=True,
                          extra_args=None if steer is None else {"steer": steer})


def test_swapped_rows_keep_their_own_steer(llm, pair_ref):
    def force_reorder_and_count(worker):
        """In the engine process: a decode-splitting backend's threshold, and a count of the
        moves the steer runtime receives."""
        from vllm_steer.integrations.worker import request_slots

        worker.model_runner.reorder_batch_threshold = 1
        cls = request_slots.RequestSlots
        if "_test_moves" not in cls.__dict__:
            orig = cls.move
            cls._test_moves = {"swap": 0, "move": 0}

            def move(self, src, dst, swap):
                cls._test_moves["swap" if swap else "move"] += 1
                return orig(self, src, dst, swap)

            cls.move = move
        return dict(cls._test_moves)

    def moves(worker):
        from vllm_steer.integrations.worker import request_slots

        return dict(request_slots.RequestSlots._test_moves)

    assert llm.collective_rpc(lambda w: type(w.model_runner).__module__) == [
        "vllm.v1.worker.cpu_model_runner"]
    (before,) = llm.collective_rpc(force_reorder_and_count)
    outs = llm.generate(PROMPTS, [sp(s, n) for s, n in REQUESTS], use_tqdm=False)
    (after,) = llm.collective_rpc(moves)
    swaps = after["swap"] - before["swap"]
    assert swaps > 0, f"the batch was never reordered (moves {after}): the test shows nothing"

    plain_differs = 0
    for o, (steer, n) in zip(outs, REQUESTS, strict=True):
        ids, got = list(o.prompt_token_ids), list(o.outputs[0].token_ids)
        want = pair_ref.greedy(ids, n, steer)
        assert got == want, (o.prompt, steer, got, want, f"{swaps} swaps")
        plain_differs += steer is not None and want != pair_ref.greedy(ids, n)
        lp = pair_ref.logprobs(ids + got, steer)
        for i, (t, e) in enumerate(zip(got, o.outputs[0].logprobs, strict=True)):
            assert e[t].logprob == pytest.approx(lp[len(ids) - 1 + i, t].item(), abs=2e-3)
    assert plain_differs >= 2  # the steers change tokens: the test can tell rows apart


def test_an_engine_without_vector_steers_has_no_op_in_its_decoder_blocks(llm):
    """LM-Steer steers only: the decoder blocks stay vLLM's own classes (no op inserted)."""
    names = llm.collective_rpc(lambda w: sorted(
        {type(m).__name__ for m in w.model_runner.model.modules()
         if type(m).__name__.endswith("DecoderLayer")}))
    assert names == [["LlamaDecoderLayer"]]
