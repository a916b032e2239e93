"""Streaming-input sessions (``AsyncLLM.generate`` with ``StreamingInput`` chunks, each a new
request of the session's id) served with steers by a real vLLM engine (CPU, V1 runner,
prefix caching): each chunk's LM-Steer mix is applied to its own tokens; a chunk that changes
the session's vector steers is refused (they change the KV cache, which vLLM keeps under the
first chunk's salt), its blocks are never cached as the first mix's, and the session ends; the
end of a session's input never strands the session in the engine core.

One ``AsyncLLM`` serves the module, on one event loop (its output handler lives there).
"""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from helpers.steers import random_steer
from vllm_steer.format import save_steer
from vllm_steer.vectors import make_vector_steer, save_vector

pytestmark = pytest.mark.vllm

BLOCK = 32
MAX_TOKENS = 4
ENGINE_KW = dict(dtype="float32", max_model_len=256, max_num_seqs=4, seed=0,
                 enable_prefix_caching=True, block_size=BLOCK, kv_cache_memory_bytes=1 << 26)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Two vector steers (``calm``, ``gg``) and an LM-Steer steer (``lm``) for the tiny
    model."""
    d = tmp_path_factory.mktemp("session-steers")
    paths = {n: str(d / f"{n}.safetensors") for n in ("calm", "gg", "lm")}
    for seed, name in enumerate(("calm", "gg"), 1):
        g = torch.Generator().manual_seed(seed)
        save_vector(paths[name], make_vector_steer(
            {k: torch.randn(64, generator=g) for k in (0, 1)}, name))
    save_steer(paths["lm"], random_steer(64, 8, "lm", seed=4, scale=3.0))
    return paths


@pytest.fixture(scope="module")
def served(tiny_model_dir, files):
    """``[engine, loop]``: an ``AsyncLLM`` serving :func:`files`, and the event loop it runs
    on. It is shut down inside its loop (from outside, ``AsyncLLM.shutdown`` only schedules
    the closing of its sockets there, and a socket left open blocks the exit of Python), then
    collected while Python still runs (its ``__del__`` shuts it down again)."""
    import gc

    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    loop = asyncio.new_event_loop()

    async def start():
        return AsyncLLM.from_engine_args(AsyncEngineArgs(
            model=str(tiny_model_dir), additional_config={"vllm_steer": {"steers": files}},
            **ENGINE_KW))

    async def stop():
        held[0].shutdown()
        left = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in left:
            task.cancel()
        await asyncio.gather(*left, return_exceptions=True)

    held = [loop.run_until_complete(start()), loop]
    yield held
    loop.run_until_complete(stop())
    loop.close()
    held.clear()
    gc.collect()  # the tests' tracebacks hold it in reference cycles


def _params(steer, max_tokens=MAX_TOKENS):
    from vllm import SamplingParams

    return SamplingParams(temperature=0, max_tokens=max_tokens,
                          extra_args=None if steer is None else {"steer": steer})


async def _session(engine, rid, chunks, after_first=None):
    """One streaming-input session of ``chunks`` (``(prompt tokens, steer)``), each sent once
    the one before has generated its tokens, the input ended after the last (``after_first``
    awaited after the first chunk's tokens). Returns ``(tokens generated per chunk, the
    exception generate raised or None)``."""
    from vllm.engine.protocol import StreamingInput
    from vllm.inputs import TokensPrompt

    queue = asyncio.Queue()

    async def inputs():
        while (item := await queue.get()) is not None:
            yield item

    def send(chunk):
        tokens, steer = chunk
        queue.put_nowait(StreamingInput(TokensPrompt(prompt_token_ids=list(tokens)),
                                        _params(steer)))

    todo = list(chunks)
    send(todo.pop(0))
    generated, done = [], 0
    try:
        async for out in engine.generate(inputs(), _params(chunks[0][1]), rid):
            tokens = list(out.outputs[0].token_ids)
            if out.outputs[0].finish_reason is not None and not out.finished:  # a chunk ended
                generated.append(tokens[done:])
                done = len(tokens)
                if after_first is not None and len(generated) == 1:
                    await after_first()
                if todo:
                    send(todo.pop(0))
                else:
                    queue.put_nowait(None)
    except Exception as e:
        return generated, e
    return generated, None


async def _generate(engine, rid, tokens, steer, max_tokens=MAX_TOKENS):
    """One plain request: its output (``token_ids``, ``num_cached_tokens``)."""
    from vllm.inputs import TokensPrompt

    last = None
    async for out in engine.generate(TokensPrompt(prompt_token_ids=list(tokens)),
                                     _params(steer, max_tokens), rid):
        last = out
    return last


async def _unload(engine, name: str) -> None:
    from vllm_steer.integrations.frontend.engine_client import manage

    assert (await manage(engine, "unload", name=name))["ok"]


def _wait_freed(engine, loop, files, name: str) -> None:
    """Wait until the unloaded steer ``name`` leaves the listing (its slot freed: no request
    in the engine core holds it any more, a streaming-input session included), then load it
    again."""
    from vllm_steer.integrations.frontend.engine_client import manage

    async def listed():
        return {s["name"]: s["state"] for s in (await manage(engine, "list"))["steers"]}

    try:
        deadline = time.monotonic() + 10
        while name in (steers := loop.run_until_complete(listed())):
            assert time.monotonic() < deadline, f"a request still holds {name!r}: {steers}"
            loop.run_until_complete(asyncio.sleep(0.2))
    finally:
        loop.run_until_complete(manage(engine, "load", name=name, path=files[name]))


def test_each_input_chunk_is_served_with_its_own_lm_steer_mix(served):
    """A later chunk's LM-Steer mix (no change to the KV cache) is the one its tokens are
    generated with: the workers take each chunk's sampling params. Its tokens are those of a
    single request of the session's tokens so far (the first chunk's prompt, its generated
    tokens but the last, which the session drops, and the chunk's prompt) with its mix."""
    engine, loop = served
    first, later = list(range(1000, 1040)), list(range(2000, 2040))
    generated, error = loop.run_until_complete(_session(
        engine, "lm-session", [(first, {"lm": 4.0}), (later, {"lm": -4.0})]))
    assert error is None and len(generated) == 2
    so_far = first + generated[0][:-1] + later
    own, other = (loop.run_until_complete(_generate(engine, f"lm-alone-{s}", so_far, {"lm": s}))
                  for s in (-4.0, 4.0))
    assert list(own.outputs[0].token_ids) != list(other.outputs[0].token_ids)  # it tells
    assert generated[1] == list(own.outputs[0].token_ids)


def test_a_later_chunk_with_another_vector_mix_is_refused_and_caches_nothing(served, files):
    """A chunk that changes the session's vector steers is refused (HTTP 400 through the API
    server), naming both mixes and the fix, and the session ends (the frontend aborts it as
    it raises the refusal). Served, its blocks were hashed as the first mix's: the next request
    of the first mix and the session's tokens was handed the keys and values computed under
    the other mix (its cached tokens counted them)."""
    from vllm.exceptions import VLLMValidationError

    engine, loop = served
    first, later = list(range(3000, 3040)), list(range(4000, 4040))
    generated, error = loop.run_until_complete(_session(
        engine, "vector-session", [(first, {"calm": 0.5}), (later, {"gg": 1.0})]))
    assert isinstance(error, VLLMValidationError), error
    assert ("a streaming-input session keeps the vector steers it started with (calm=0.5), "
            "but this input chunk asks for gg=1.") in str(error)
    so_far = first + generated[0][:-1] + later  # the session's tokens, had it gone on
    out = loop.run_until_complete(_generate(engine, "calm-alone", so_far, {"calm": 0.5}, 1))
    assert out.num_cached_tokens == BLOCK  # the first chunk's own block: the same mix
    loop.run_until_complete(_unload(engine, "calm"))
    _wait_freed(engine, loop, files, "calm")  # the session holds it no more


def test_the_end_of_the_input_frees_the_steer_unloaded_meanwhile(served, files):
    """A steer unloaded while a session waits for its next chunk is kept (draining) until the
    session ends. The end of the session's input (a request of its id carrying its first
    sampling params) was refused in the engine core (``unknown steer``) after the client's
    stream had ended: the session stayed in the scheduler for ever, and the steer draining.
    (A chunk naming the unloaded steer is refused by the frontend, which then ends the input
    the same way.)"""
    engine, loop = served
    generated, error = loop.run_until_complete(_session(
        engine, "unloaded-session", [(range(5000, 5040), {"calm": 0.5})],
        after_first=lambda: _unload(engine, "calm")))
    assert error is None and len(generated) == 1
    _wait_freed(engine, loop, files, "calm")
