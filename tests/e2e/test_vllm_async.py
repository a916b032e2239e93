"""The plugin under vLLM's async scheduling (the GPU default), in a real engine on this CPU.

vLLM's CPU platform turns async scheduling off (``vllm/platforms/cpu.py``,
``check_and_update_config``: ``scheduler_config.async_scheduling = False``). The CPU model
runner is a subclass of the GPU runner and runs its async path once that is bypassed, by the
test-only shim ``tests/v2shim/sitecustomize.py`` with ``STEER_TEST_ASYNC_SHIM=1``:
``CpuPlatform.check_and_update_config`` keeps the ``async_scheduling`` it was given (in this
process, which builds the config, and in the spawned engine processes). Nothing else breaks:
the CUDA events and streams of the async output paths (V1 ``AsyncGPUModelRunnerOutput``, V2
``AsyncOutput``) are already no-op placeholders on CPU (``vllm/v1/worker/cpu/shm.py``).

Then the engine core schedules step N+1 before step N's output is back, and the runner takes
the previous step's sampled tokens from the device (``prev_sampled_token_ids``). Requests of
different prompt lengths and max_tokens, more than ``max_num_seqs``, so rows join and leave at
different steps, steered and unsteered side by side: every request gets the greedy tokens (and
logprobs) of the paper's formula applied by hand on the model's own weights
(``helpers.reference.HFReference``), which is what it gets without async scheduling
(tests/e2e/test_vllm_offline.py, tests/e2e/test_vllm_v2.py pin the same reference).
"""

from __future__ import annotations

import pytest

from helpers.engines import shim_module, v2_runner_env
from helpers.reference import HFReference
from helpers.steers import random_vectors, save_vector_steer
from helpers.worker_faults import (STEP_ROWS, check_only_the_steered_request_failed,
                                   step_rows_fault)

pytestmark = pytest.mark.vllm

VECTORS = random_vectors(64, [1], seed=13)  # a control vector at block 1
PROMPTS = ["Hello there, my name is", "The weather today", "Once upon a time in a land far",
           "Q: What is two plus two?\nA:", "In the beginning", "A B C D E F G H I J K"]
# (steer, max_tokens): six requests through three seats, leaving at different steps
REQUESTS = [({"a": 5}, 7), (None, 3), ({"b": -6}, 5), ({"a": 2, "b": 3}, 2), (None, 6),
            ({"a": -4}, 4)]
ENGINE_KW = dict(dtype="float32", kv_cache_memory_bytes=1 << 28, max_model_len=256,
                 max_num_seqs=3, enforce_eager=True, seed=0, async_scheduling=True,
                 max_num_batched_tokens=256)  # V2's start-up warm-up runs this many tokens


@pytest.fixture(scope="module")
def async_env():
    from vllm.platforms.cpu import CpuPlatform

    with pytest.MonkeyPatch.context() as mp:
        path = v2_runner_env()["PYTHONPATH"]  # tests/v2shim first, for the spawned processes
        mp.setenv("PYTHONPATH", path)
        mp.setenv("STEER_TEST_ASYNC_SHIM", "1")
        # this process builds the VllmConfig: its CpuPlatform keeps async scheduling too
        mp.setattr(CpuPlatform, "check_and_update_config",
                   CpuPlatform.__dict__["check_and_update_config"])
        shim_module().keep_async_scheduling(CpuPlatform)
        # collective_rpc with a lambda: read the worker's runner settings from the test
        mp.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
        yield


@pytest.fixture(scope="module", params=["v1", "v2"])
def llm(request, async_env, tiny_model_dir, pair_steers, tmp_path_factory):
    """One engine per model runner: V1 (the CPU default) and Model Runner V2 (through the V2
    shim, kernels in the Triton interpreter; see tests/e2e/test_vllm_v2.py)."""
    from vllm import LLM

    with pytest.MonkeyPatch.context() as mp:
        if request.param == "v2":
            for k, v in v2_runner_env().items():
                mp.setenv(k, v)
            mp.setattr("vllm.config.vllm.HAS_TRITON", True)
        steers = {**pair_steers[1], "v": save_vector_steer(
            tmp_path_factory.mktemp("vector") / "v.gguf", VECTORS, "v")}
        engine = LLM(str(tiny_model_dir),
                     additional_config={"vllm_steer": {"steers": steers}}, **ENGINE_KW)
        engine.runner_kind = request.param
        yield engine
        del engine


def sp(steer, n):
    from vllm import SamplingParams

    return SamplingParams(temperature=0, max_tokens=n, logprobs=0, ignore_eos=True,
                          extra_args=None if steer is None else {"steer": steer})


def test_engine_runs_async_scheduling(llm):
    cfg = llm.llm_engine.vllm_config
    assert cfg.scheduler_config.async_scheduling is True
    assert cfg.max_concurrent_batches == 2  # the engine core runs a step ahead
    runner = llm.collective_rpc(lambda w: type(w.model_runner).__module__)
    if llm.runner_kind == "v1":
        assert runner == ["vllm.v1.worker.cpu_model_runner"]
        assert llm.collective_rpc(lambda w: w.model_runner.use_async_scheduling) == [True]
    else:
        assert runner == ["vllm.v1.worker.cpu.model_runner"]


def test_requests_joining_and_leaving_get_their_own_tokens(llm, pair_ref):
    outs = llm.generate(PROMPTS, [sp(s, n) for s, n in REQUESTS], use_tqdm=False)
    plain_differs = 0
    for o, (steer, n) in zip(outs, REQUESTS, strict=True):
        ids = list(o.prompt_token_ids)
        got = list(o.outputs[0].token_ids)
        want = pair_ref.greedy(ids, n, steer)
        assert got == want, (o.prompt, steer, got, want)
        plain_differs += steer is not None and want != pair_ref.greedy(ids, n)
        lp = pair_ref.logprobs(ids + got, steer)
        for i, (t, e) in enumerate(zip(got, o.outputs[0].logprobs, strict=True)):
            assert e[t].logprob == pytest.approx(lp[len(ids) - 1 + i, t].item(), abs=2e-3)
    assert plain_differs >= 2  # the steers change tokens: the test can tell rows apart


def test_vector_steers_join_and_leave_under_async_scheduling(llm, tiny_model_dir, pair_steers):
    """The step mapping under async scheduling (a step prepared while the last one runs):
    vector-steered requests of different lengths beside LM-Steer and unsteered ones, each
    against forward hooks on the model's own weights."""
    ref = HFReference(tiny_model_dir, pair_steers[0], vectors={"v": VECTORS})
    reqs = [({"v": 1.0}, 3), (None, 6), ({"v": -1.0, "a": 4}, 5), ({"v": 0.7}, 2)]
    outs = llm.generate(PROMPTS[:len(reqs)], [sp(s, n) for s, n in reqs], use_tqdm=False)
    for o, (steer, n) in zip(outs, reqs, strict=True):
        ids, got = list(o.prompt_token_ids), list(o.outputs[0].token_ids)
        assert got == ref.greedy(ids, n, steer), (o.prompt, steer)
    assert ref.greedy(list(outs[0].prompt_token_ids), 3, {"v": 1.0}) \
        != ref.greedy(list(outs[0].prompt_token_ids), 3)  # the vector changes the tokens


def test_a_steered_request_same_alone_as_in_the_async_batch(llm):
    batch = llm.generate(PROMPTS, [sp(s, n) for s, n in REQUESTS], use_tqdm=False)
    for i in (0, 2, 4):
        alone = llm.generate([PROMPTS[i]], [sp(*REQUESTS[i])], use_tqdm=False)[0]
        assert list(alone.outputs[0].token_ids) == list(batch[i].outputs[0].token_ids)


def test_a_worker_fault_fails_only_the_steered_request_under_async_scheduling(llm, pair_ref):
    """The step planner faults once while the engine core runs a step ahead: the steered
    request ends with an error naming vllm-steer (from V1's async output and V2's alike); the
    unsteered requests get exactly plain greedy decoding, and the next steered request is
    served correctly."""
    assert llm.collective_rpc(step_rows_fault()) == [True]
    reqs = [(None, 8), ({"a": 5}, 5), (None, 7), (None, 6)]
    outs = llm.generate(PROMPTS[:4], [sp(s, n) for s, n in reqs], use_tqdm=False)
    check_only_the_steered_request_failed(
        outs, 1, STEP_ROWS, lambda i, prompt: pair_ref.greedy(prompt, reqs[i][1]))
    (after,) = llm.generate(PROMPTS[1:2], [sp({"a": 5}, 5)], use_tqdm=False)
    assert list(after.outputs[0].token_ids) == pair_ref.greedy(list(after.prompt_token_ids),
                                                               5, {"a": 5})


# Generation windows with speculative decoding under async scheduling: the engine core
# schedules a step before the previous step's accepted draft count is back, so the runner's
# token counts are optimistic (every draft accepted) until vLLM corrects them after the
# forward. The windows must follow each request's real generated tokens.
SPEC_VECTORS = random_vectors(64, [0, 1], seed=3, scale=0.6)  # blocks 0 and 1
WINDOWED = [({"a": {"strength": 6, "start": 3, "end": 9}}, 14), (None, 10),
            ({"b": {"strength": -5, "start": 0, "end": 5, "base": 2}}, 12),
            ({"a": {"strength": 4, "start": 5, "ramp": 3}}, 13)]


@pytest.fixture(scope="module", params=["v1", "v2"])
def spec_llm(request, async_env, tiny_model_dir, pair_steers, tmp_path_factory):
    """Async scheduling, the target as its own draft model proposing unsteered
    (``steer_drafter: false``): steered requests reject drafts, so the optimistic counts of
    async scheduling are wrong at the next step. One engine per model runner; the pair's
    LM-Steer steers and a vector steer ``sv`` on blocks 0 and 1."""
    from vllm import LLM

    kw = dict(ENGINE_KW, max_num_seqs=4, enable_prefix_caching=False)
    with pytest.MonkeyPatch.context() as mp:
        if request.param == "v2":
            for k, v in v2_runner_env().items():
                mp.setenv(k, v)
            mp.setattr("vllm.config.vllm.HAS_TRITON", True)
        else:
            mp.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
        steers = {**pair_steers[1], "sv": save_vector_steer(
            tmp_path_factory.mktemp("spec-vector") / "sv.safetensors", SPEC_VECTORS, "sv")}
        engine = LLM(str(tiny_model_dir), additional_config={"vllm_steer": {
            "steers": steers, "steer_drafter": False}},
                     speculative_config={"method": "draft_model", "model": str(tiny_model_dir),
                                         "num_speculative_tokens": 3},
                     disable_log_stats=False, **kw)
        engine.runner_kind = request.param
        yield engine
        del engine


def test_windows_with_a_draft_model_follow_the_real_generated_tokens(spec_llm, pair_ref):
    assert spec_llm.llm_engine.vllm_config.scheduler_config.async_scheduling is True
    runner = {"v1": "vllm.v1.worker.cpu_model_runner", "v2": "vllm.v1.worker.cpu.model_runner"}
    assert spec_llm.collective_rpc(lambda w: type(w.model_runner).__module__) == [
        runner[spec_llm.runner_kind]]
    vals = lambda: {m.name: m.value for m in spec_llm.get_metrics() if hasattr(m, "value")}  # noqa: E731
    before = vals()
    outs = spec_llm.generate(PROMPTS[:len(WINDOWED)], [sp(s, n) for s, n in WINDOWED],
                             use_tqdm=False)
    after = vals()
    drafted = after["vllm:spec_decode_num_draft_tokens"] - before.get(
        "vllm:spec_decode_num_draft_tokens", 0)
    accepted = after["vllm:spec_decode_num_accepted_tokens"] - before.get(
        "vllm:spec_decode_num_accepted_tokens", 0)
    assert 0 < accepted < drafted, (accepted, drafted)  # some drafts rejected: counts move
    matters = pair_ref.check_windowed(outs, [s for s, _ in WINDOWED], None)
    assert any(matters), "the windows change nothing: the test could not see a shift"


def count_device_count_reads(stop: bool = False):
    """A function for ``LLM.collective_rpc``: in each worker, count the V2 runner's reads of
    the device's computed-token counts per step (``prepare_inputs`` calls); ``stop``: undo
    that and return each step's count of reads (steps with none left out)."""

    def arm(worker):
        from vllm_steer.integrations import vllm_access as va

        runner_cls = type(worker.model_runner)
        if stop:
            va.v2_device_computed_tokens = va.v2_device_computed_tokens.__wrapped__
            runner_cls.prepare_inputs = runner_cls.prepare_inputs.__wrapped__
            return [n for n in runner_cls.reads_per_step if n]
        read, prepare = va.v2_device_computed_tokens, runner_cls.prepare_inputs
        runner_cls.reads_per_step = []

        def counted(*args, **kwargs):
            runner_cls.reads_per_step[-1] += 1
            return read(*args, **kwargs)

        def step(self, *args, **kwargs):
            runner_cls.reads_per_step.append(0)
            return prepare(self, *args, **kwargs)

        counted.__wrapped__, step.__wrapped__ = read, prepare
        va.v2_device_computed_tokens = counted
        runner_cls.prepare_inputs = step
        return True

    return arm


def test_a_vector_window_with_a_draft_model_follows_the_real_generated_tokens(spec_llm,
                                                                              tiny_model_dir):
    """A vector steer's window is applied at every token of the step, in the decoder blocks:
    each token's strength is the window's at the generated token its row samples, which
    under async scheduling is known only once the previous step's rejected drafts are
    counted. Every token and logprob equals the reference's, which applies the window per
    position, and the window changes the output (it is seen)."""
    from vllm_steer.request import Window

    ref = HFReference(tiny_model_dir, {}, vectors={"sv": SPEC_VECTORS})
    steers = [{"sv": {"strength": 1.5, "start": 3, "end": 9}},
              {"sv": {"strength": -1.0, "start": 2, "end": 6, "base": 0.5}}, None]
    if spec_llm.runner_kind == "v2":
        assert spec_llm.collective_rpc(count_device_count_reads()) == [True]
    try:
        outs = spec_llm.generate(PROMPTS[:3], [sp(s, 14) for s in steers], use_tqdm=False)
    finally:
        reads = spec_llm.collective_rpc(count_device_count_reads(stop=True)) \
            if spec_llm.runner_kind == "v2" else None
    if reads:  # V2 reads the true counts from the device: once a step, for tokens and rows
        (per_step,) = reads
        assert per_step and max(per_step) == 1, per_step
    seen = False
    for o, steer in zip(outs, steers, strict=True):
        win = Window(**steer["sv"]) if steer else Window(0.0)
        prompt = list(o.prompt_token_ids)
        ids = list(prompt)
        for t, (tok, entry) in enumerate(zip(o.outputs[0].token_ids, o.outputs[0].logprobs,
                                             strict=True)):
            per_pos = [win.at(p + 1 - len(prompt)) for p in range(len(ids))]
            lp = ref.logprobs(ids, {"sv": per_pos})[-1]
            assert tok == int(lp.argmax()), (steer, t)
            assert entry[tok].logprob == pytest.approx(lp[tok].item(), abs=2e-3), (steer, t)
            ids.append(tok)
        if steer:
            seen = seen or ref.greedy(prompt, 14, {"sv": steer["sv"]["strength"]}) \
                != list(o.outputs[0].token_ids)
    assert seen, "the windows change nothing: the test could not see a shift"
