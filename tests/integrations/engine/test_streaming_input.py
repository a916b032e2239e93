"""Streaming-input sessions in the engine core: vLLM's real ``Scheduler`` and ``Request``
(resumable, hashed by vLLM's own block hasher) behind the plugin's ``EngineCore.add_request``
hook, with an engine core's steer state (two vector steers and an LM-Steer steer on a
two-block model). A session's later input chunks, and the end of its input, reach the engine
core as new requests of the session's id. What a user would see: the refusal message, the
session's blocks and their hashes, the session gone from the scheduler with its KV blocks
freed, a steer's slot freed once no session holds it. (A refused chunk's session is aborted
by the frontend as it raises the refusal: tests/e2e/test_vllm_streaming_input.py.)"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")
torch = pytest.importorskip("torch")

from helpers.engine_cores import Workers, start_vector_core  # noqa: E402
from helpers.steers import random_steer  # noqa: E402
from vllm_steer.config import SteerServerConfig  # noqa: E402
from vllm_steer.format import save_steer  # noqa: E402
from vllm_steer.integrations.engine import core as hooks  # noqa: E402
from vllm_steer.integrations.engine.management import run_op  # noqa: E402
from vllm_steer.integrations.frontend import admission  # noqa: E402
from vllm_steer.integrations.frontend.state import frontend_state  # noqa: E402
from vllm_steer.integrations.protocol import REFUSED_PREFIX  # noqa: E402
from vllm_steer.request import BOUND_KEY, BoundSteer  # noqa: E402
from vllm_steer.vectors import make_vector_steer, save_vector  # noqa: E402

HIDDEN = 64
BLOCK = 16
BLOCKS = 32


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Two vector steers (``calm``, ``gg``) and an LM-Steer steer (``lm``) for the model."""
    d = tmp_path_factory.mktemp("session-steers")
    paths = {n: str(d / f"{n}.safetensors") for n in ("calm", "gg", "lm")}
    for seed, name in enumerate(("calm", "gg"), 1):
        g = torch.Generator().manual_seed(seed)
        save_vector(paths[name], make_vector_steer({1: torch.randn(HIDDEN, generator=g)}, name))
    save_steer(paths["lm"], random_steer(HIDDEN, 4, "lm", seed=3))
    return paths


@pytest.fixture(scope="module")
def vllm_config(tiny_model_dir):
    """The tiny model's ``VllmConfig`` with prefix caching, as the scheduler reads it."""
    from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig

    model = ModelConfig(model=str(tiny_model_dir), dtype="float32", max_model_len=256, seed=0)
    cache = CacheConfig(block_size=BLOCK, enable_prefix_caching=True)
    cache.num_gpu_blocks = BLOCKS
    sched = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=256, max_model_len=256,
                            is_encoder_decoder=False)
    return VllmConfig(model_config=model, cache_config=cache, scheduler_config=sched)


@pytest.fixture
def core(files, vllm_config):
    """An engine core as vLLM starts it (the plugin's steer state made by its start hook)
    whose scheduler is vLLM's own, with :data:`BLOCKS` KV blocks; the outputs it sends its
    client are kept in ``sent``."""
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    cfg = SteerServerConfig(steers=files, max_strength=10.0, max_steers=4,
                            enable_updates=True)
    old = frontend_state().config  # the frontend that admits the session's requests
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=64, dtype=torch.float32)
    kv = KVCacheConfig(num_blocks=BLOCKS, kv_cache_tensors=[],
                       kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)])
    scheduler = Scheduler(vllm_config, kv, StructuredOutputManager(vllm_config),
                          block_size=BLOCK, log_stats=False)
    sent = []
    c = start_vector_core(cfg, HIDDEN, scheduler=scheduler, model_executor=Workers(),
                          output_queue=SimpleNamespace(put_nowait=sent.append))
    c.sent = sent
    yield c
    frontend_state().reset(old)


def _request(tokens, steer, resumable=True, rid="session", max_tokens=2):
    """An engine-core ``Request`` of ``tokens`` with ``steer`` as the frontend admits it and
    vLLM sends it (msgpack), hashed by vLLM's block hasher; ``resumable``: an input chunk of a
    streaming-input session (AsyncLLM's ``StreamingInput``), else the end of its input."""
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256_cbor
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    init_none_hash(sha256_cbor)
    params = SamplingParams(max_tokens=max_tokens, temperature=0,
                            extra_args=None if steer is None else {"steer": steer})
    admission.validate(params)
    params = MsgpackDecoder(SamplingParams).decode(MsgpackEncoder().encode(params))
    return Request(rid, list(tokens), params, None, resumable=resumable,
                   block_hasher=get_request_block_hasher(BLOCK, sha256_cbor))


def _add(core, request) -> None:
    """``EngineCore.add_request`` with the plugin's hook (vLLM's own hands the request to its
    scheduler)."""
    hooks.add_request(lambda self, r, wave=0: self.scheduler.add_request(r), core, request)


def _run_chunk(core, rid="session") -> None:
    """Step the scheduler, each scheduled request sampling token 7, until the session has
    generated its chunk's tokens and waits for its next input chunk."""
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import RequestStatus

    sched = core.scheduler
    for _ in range(20):
        if sched.requests[rid].status == RequestStatus.WAITING_FOR_STREAMING_REQ:
            return
        out = sched.schedule()
        ids = [r.req_id for r in out.scheduled_new_reqs] + list(out.scheduled_cached_reqs.req_ids)
        sched.update_from_output(out, ModelRunnerOutput(
            req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
            sampled_token_ids=[[7] for _ in ids]))
    raise AssertionError("the session's chunk did not end")


def _free_blocks(core) -> int:
    return core.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()


def _refusals(core) -> list[str]:
    """The refusals the engine core sent its client (their ``stop_reason``)."""
    return [o.stop_reason for _, outs in core.sent for o in outs.outputs
            if isinstance(o.stop_reason, str) and o.stop_reason.startswith(REFUSED_PREFIX)]


def _refusal_counts(core) -> dict[str, int]:
    """The engine core's refusal counts (``status:reason``), which
    ``vllm_steer:requests_refused_total{source="engine_core"}`` reports."""
    from vllm_steer.integrations.engine.state import engine_state

    return dict(engine_state(core).registry.refused)


def _session(core, steer, tokens=range(100, 100 + 3 * BLOCK)) -> None:
    """A streaming-input session whose first chunk (``tokens``, ``steer``) has been served:
    it waits for its next chunk, holding its KV blocks."""
    from vllm.v1.request import RequestStatus

    free = _free_blocks(core)
    _add(core, _request(tokens, steer))
    _run_chunk(core)
    assert core.scheduler.requests["session"].status == RequestStatus.WAITING_FOR_STREAMING_REQ
    assert _free_blocks(core) < free and not _refusals(core)


@pytest.mark.parametrize("later, asks", [
    ({"gg": 1.0}, "gg=1"),
    ({"calm": -0.5}, "calm=-0.5"),
    ({"calm": 0.5, "gg": 0.25}, "calm=0.5, gg=0.25"),
    (None, "no vector steers"),
    ({"lm": 2.0}, "no vector steers"),
])
def test_a_later_chunk_with_another_vector_mix_is_refused(core, later, asks):
    """vLLM keeps a session's ``cache_salt`` from its first chunk and salts only the first
    block's hash: a later chunk computed under another vector mix (or none) would cache its
    blocks as the first mix's, and the next request of that mix with the same tokens would be
    served their keys and values. Such a chunk is refused, naming both mixes and the fix;
    nothing of it reaches the session (its tokens, its blocks' hashes)."""
    _session(core, {"calm": 0.5})
    session = core.scheduler.requests["session"]
    tokens, hashes = list(session.all_token_ids), list(session.block_hashes)
    _add(core, _request(range(200, 200 + 2 * BLOCK), later))
    (refusal,) = _refusals(core)
    assert (f"a streaming-input session keeps the vector steers it started with (calm=0.5), "
            f"but this input chunk asks for {asks}.") in refusal
    assert "send every chunk of the session with the same vector steers" in refusal
    assert "start a new session" in refusal
    assert _refusal_counts(core) == {"400:streaming_input": 1}  # its own metrics label
    assert list(session.all_token_ids) == tokens and session.block_hashes == hashes


def test_a_later_chunk_adding_a_vector_steer_is_refused(core):
    _session(core, None)
    _add(core, _request(range(200, 200 + 2 * BLOCK), {"calm": 0.5}))
    (refusal,) = _refusals(core)
    assert "started with (no vector steers), but this input chunk asks for calm=0.5" in refusal


def test_a_later_chunk_keeping_the_vector_mix_is_served_with_its_own_lm_steer_mix(core):
    """LM-Steer steers change no key or value: a later chunk may change them. It is served
    (the workers read the bound steers of the session's sampling params, now the chunk's),
    and the session's blocks stay hashed as a single request of its vector mix and its
    tokens would hash them: its cache is shared with exactly those requests."""
    from vllm.v1.request import RequestStatus

    first, later = list(range(100, 100 + 3 * BLOCK)), list(range(200, 200 + 2 * BLOCK))
    _session(core, {"calm": 0.5, "lm": 2.0}, first)
    _add(core, _request(later, {"calm": 0.5, "lm": -3.0}))
    assert not _refusals(core)
    session = core.scheduler.requests["session"]
    assert session.status == RequestStatus.WAITING
    bound = {b.name: b.value for b in BoundSteer.from_wire(
        session.sampling_params.extra_args[BOUND_KEY])}
    assert bound == {"calm": 0.5, "lm": -3.0}
    alone = _request(session.all_token_ids, {"calm": 0.5}, resumable=False, rid="alone")
    _add(core, alone)
    assert len(session.block_hashes) == 5 and session.block_hashes == alone.block_hashes


def test_the_end_of_the_input_is_not_refused_when_its_steer_was_unloaded(core):
    """The end of a session's input reaches the engine core as a request of the session's
    id with the session's first sampling params (AsyncLLM's ``final_req``); vLLM reads only
    its id. Refused (its steer unloaded meanwhile: ``unknown steer``), the session stayed in
    the scheduler for ever, with its KV blocks and the unloaded steer's slot ("draining"), and
    the client, whose stream had ended, never saw the refusal."""
    free = _free_blocks(core)
    _session(core, {"calm": 0.5})
    assert run_op(core, "unload", {"name": "calm"})["steer"]["state"] == "draining"
    _add(core, _request([0], {"calm": 0.5}, resumable=False))
    assert not _refusals(core)
    assert "session" not in core.scheduler.requests and _free_blocks(core) == free
    assert "calm" not in {s["name"] for s in run_op(core, "list")["steers"]}  # slot freed


def test_a_window_on_a_vector_steer_is_refused_with_streaming_input(core):
    """A later chunk reads the session's output as prompt, at a window's base strength, where
    a single request with the session's salt would have computed those tokens inside its
    window: the prefix cache could not tell them apart. Refused from the first chunk, naming
    the steer and the fix; the same request without streaming input is served."""
    window = {"calm": {"strength": 0.5, "start": 2}, "lm": {"strength": 2.0, "start": 1}}
    _add(core, _request(range(100, 100 + BLOCK), window))
    (refusal,) = _refusals(core)
    assert "a generation window on a vector steer ('calm') is not served to a streaming-input " \
           "session" in refusal
    assert "Give the vector steer a plain strength in a streaming-input session" in refusal
    assert _refusal_counts(core) == {"400:streaming_input": 1}
    assert "session" not in core.scheduler.requests
    _add(core, _request(range(100, 100 + BLOCK), window, resumable=False, rid="alone"))
    assert len(_refusals(core)) == 1 and "alone" in core.scheduler.requests
