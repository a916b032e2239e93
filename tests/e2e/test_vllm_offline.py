"""The plugin inside a real vLLM engine (CPU, V1 runner), offline ``LLM`` API.

One engine is shared by the whole module (starting one takes about a minute here). A second,
plugin-free vLLM ("vanilla", ``VLLM_PLUGINS=none``) runs once in a subprocess for the
exactness checks.
"""

from __future__ import annotations


import pytest
import torch

from helpers.steers import random_steer
from vllm_steer.format import make_steer, save_steer

pytestmark = pytest.mark.vllm

PROMPTS = ["Hello there, my name is", "The weather today", "Once upon a time in a land",
           "Q: What is two plus two?\nA:"]
LONG_PROMPT = " ".join(["The quick brown fox jumps over the lazy dog."] * 36)  # > 2 KV blocks
MAX_TOKENS = 8
ENGINE_KW = dict(dtype="float32", gpu_memory_utilization=0.5, kv_cache_memory_bytes=1 << 28,
                 max_model_len=512, max_num_seqs=16, enforce_eager=True, seed=0,
                 enable_prefix_caching=True)


@pytest.fixture(scope="module")
def steer_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("steers")
    a = random_steer(64, 8, "a", seed=1, scale=3.0)
    b = random_steer(64, 8, "b", seed=2, scale=3.0)
    # one steer equal to 2 W_a + 3 W_b, and one equal to 5 W_a
    comp = make_steer(torch.cat([a.p1, b.p1], 1), torch.cat([2 * a.p2, 3 * b.p2], 1), "comp")
    a5 = make_steer(a.p1, 5 * a.p2, "a5")
    paths = {}
    for s in (a, b, comp, a5):
        paths[s.name] = str(d / f"{s.name}.safetensors")
        save_steer(paths[s.name], s)
    return paths


@pytest.fixture(scope="module")
def hooks_record(tmp_path_factory):
    """The directory where this module's engine processes record the hooks they ran."""
    return str(tmp_path_factory.mktemp("hooks-record"))


@pytest.fixture(scope="module")
def llm(tiny_model_dir, steer_files, hooks_record):
    from vllm import LLM

    from hook_recorder import RECORD_ENV

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(RECORD_ENV, hooks_record)  # inherited by the engine core it starts
        # vLLM's CPU defaults: a worker process of its own, and the engine's processes spawned,
        # each importing vLLM and the plugin afresh (the suite's other engines of one worker
        # run it in the engine core, and fork their processes, as on a GPU: tests/conftest.py)
        mp.setenv("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
        engine = LLM(str(tiny_model_dir), distributed_executor_backend="mp",
                     additional_config={"vllm_steer": {"steers": steer_files}}, **ENGINE_KW)
    yield engine
    del engine


@pytest.fixture(scope="module")
def vanilla_tokens(tiny_model_dir, tmp_path_factory):
    """Greedy tokens of stock vLLM with no plugin loaded, same engine settings."""
    from helpers.engines import stock_vllm

    return [t for t, _ in stock_vllm(tiny_model_dir, PROMPTS, MAX_TOKENS, ENGINE_KW,
                                     tmp_path_factory.mktemp("vanilla"))]


def sp(steer=None, **kw):
    from vllm import SamplingParams

    kw.setdefault("max_tokens", MAX_TOKENS)
    return SamplingParams(temperature=0, extra_args=None if steer is None else {"steer": steer},
                          **kw)


def tokens(outs):
    return [list(o.outputs[0].token_ids) for o in outs]


def test_unsteered_and_zero_strength_equal_vanilla_vllm_also_in_mixed_batches(vanilla_tokens,
                                                                              llm):
    assert tokens(llm.generate(PROMPTS, sp())) == vanilla_tokens
    assert tokens(llm.generate(PROMPTS, sp({"a": 0, "b": 0.0}))) == vanilla_tokens
    # unsteered requests sharing a batch with steered ones
    params = [sp(), sp({"a": 5}), sp({"a": 0}), sp({"b": -7})]
    mixed = tokens(llm.generate(PROMPTS, params))
    assert mixed[0] == vanilla_tokens[0] and mixed[2] == vanilla_tokens[2]
    assert mixed[1] != vanilla_tokens[1] and mixed[3] != vanilla_tokens[3]


def test_steered_request_same_alone_and_in_mixed_batch(llm):
    alone = tokens(llm.generate(PROMPTS[1:2], sp({"a": 5})))[0]
    neg = tokens(llm.generate(PROMPTS[1:2], sp({"a": -5})))[0]
    assert alone != neg  # the sign flips the direction
    batch = [sp({"b": 3}), sp({"a": 5}), sp(), sp({"a": -5}), sp({"a": 5}), sp({"a": 2, "b": 1})]
    outs = tokens(llm.generate([PROMPTS[0], PROMPTS[1], PROMPTS[2], PROMPTS[1], PROMPTS[1],
                                PROMPTS[3]], batch))
    assert outs[1] == alone and outs[4] == alone and outs[3] == neg


def test_logprobs_match_transformers_on_the_same_weights(llm, tiny_model_dir, steer_files):
    from transformers import AutoModelForCausalLM

    from vllm_steer.format import load_steer
    from vllm_steer.hf import steering

    strengths = {"a": 4, "b": -2}
    out = llm.generate(PROMPTS[:2], sp(strengths, logprobs=0))
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    steers = {n: load_steer(steer_files[n]) for n in ("a", "b")}
    for o in out:
        ids = list(o.prompt_token_ids) + list(o.outputs[0].token_ids)
        with torch.no_grad(), steering(model, steers, strengths):
            logits = model(torch.tensor([ids])).logits[0].float()
        lp = torch.log_softmax(logits, -1)
        n_prompt = len(o.prompt_token_ids)
        for i, (tok, entry) in enumerate(zip(o.outputs[0].token_ids, o.outputs[0].logprobs,
                                             strict=True)):
            expected = lp[n_prompt - 1 + i, tok].item()
            assert entry[tok].logprob == pytest.approx(expected, abs=2e-3), (i, tok)
            # greedy: the sampled token is the argmax of the steered transformers logits
            assert tok == int(lp[n_prompt - 1 + i].argmax())


def test_composition_equals_the_summed_steer_and_strength_is_linear(llm):
    lp = dict(logprobs=0)
    both = llm.generate(PROMPTS, sp({"a": 2, "b": 3}, **lp))
    merged = llm.generate(PROMPTS, sp({"comp": 1}, **lp))
    assert tokens(both) == tokens(merged)
    for x, y in zip(both, merged, strict=True):
        for ex, ey, t in zip(x.outputs[0].logprobs, y.outputs[0].logprobs, x.outputs[0].token_ids,
                             strict=True):
            assert ex[t].logprob == pytest.approx(ey[t].logprob, abs=1e-4)
    s5 = llm.generate(PROMPTS, sp({"a": 5}, **lp))
    w5 = llm.generate(PROMPTS, sp({"a5": 1}, **lp))
    assert tokens(s5) == tokens(w5)
    for x, y in zip(s5, w5, strict=True):
        for ex, ey, t in zip(x.outputs[0].logprobs, y.outputs[0].logprobs, x.outputs[0].token_ids,
                             strict=True):
            assert ex[t].logprob == pytest.approx(ey[t].logprob, abs=1e-4)


def test_prefix_cache_is_on_and_shared_between_steered_and_unsteered(llm):
    assert llm.llm_engine.vllm_config.cache_config.enable_prefix_caching
    llm.reset_prefix_cache()
    steered_cold = llm.generate([LONG_PROMPT], sp({"a": 5}))[0]
    llm.reset_prefix_cache()
    plain = llm.generate([LONG_PROMPT], sp())[0]
    steered_warm = llm.generate([LONG_PROMPT], sp({"a": 5}))[0]
    assert plain.num_cached_tokens == 0
    # the steered request reuses the KV blocks the unsteered one computed ...
    assert steered_warm.num_cached_tokens > 0
    # ... and still gets exactly the steered tokens
    assert tokens([steered_warm]) == tokens([steered_cold]) != tokens([plain])


def test_prompt_logprobs_are_steered_for_steered_requests(llm, tiny_model_dir, steer_files):
    from transformers import AutoModelForCausalLM

    from vllm_steer.format import load_steer
    from vllm_steer.hf import steering

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    steers = {"a": load_steer(steer_files["a"])}
    # a steered and an unsteered request with prompt logprobs, in one batch
    outs = llm.generate([PROMPTS[2], PROMPTS[2]],
                        [sp({"a": 5}, prompt_logprobs=0, max_tokens=1),
                         sp(prompt_logprobs=0, max_tokens=1)])
    ids = list(outs[0].prompt_token_ids)
    for o, strengths in zip(outs, ({"a": 5}, {"a": 0}), strict=True):
        with torch.no_grad(), steering(model, steers, strengths):
            lp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
        got = [entry[t].logprob for entry, t in zip(o.prompt_logprobs[1:], ids[1:], strict=True)]
        want = [lp[i, t].item() for i, t in enumerate(ids[1:])]
        assert got == pytest.approx(want, abs=2e-3)
    assert outs[0].prompt_logprobs[1:] != outs[1].prompt_logprobs[1:]


def test_bad_request_is_refused_and_engine_keeps_serving(vanilla_tokens, llm):
    from vllm.exceptions import VLLMValidationError

    for bad, fragment in [({"nope": 1}, "unknown steer 'nope'"),
                          ({"a": "x"}, "must be a number"),
                          ({"a": 1000}, "exceeds the server's maximum"),
                          ("a=1", "malformed entry")]:
        with pytest.raises(VLLMValidationError, match=fragment):
            llm.generate(PROMPTS[:1], sp(bad))
    assert tokens(llm.generate(PROMPTS, sp())) == vanilla_tokens


def test_a_bad_steer_that_slips_past_admission_is_served_unsteered_not_a_crash(
        vanilla_tokens, llm, monkeypatch):
    from vllm_steer.integrations.frontend import admission as frontend

    # a frontend that validates nothing (e.g. an API server that never learnt the steers):
    # each bad request is refused on its own or served unsteered; the engine never dies
    monkeypatch.setattr(frontend, "validate", lambda params: None)
    for i, bad in enumerate([{"nope": 1}, {"a": "x"}, {"a": 1e9}]):
        try:
            out = tokens(llm.generate(PROMPTS[i:i + 1], sp(bad)))[0]
        except Exception as e:  # noqa: BLE001 - refused by the engine core's admission
            assert "steer" in str(e)
        else:  # refused: an error output with no tokens; or served unsteered
            assert out in ([], vanilla_tokens[i])
    monkeypatch.undo()
    assert tokens(llm.generate(PROMPTS, sp())) == vanilla_tokens  # the engine is alive
    assert tokens(llm.generate(PROMPTS[2:3], sp({"a": 5})))[0] != vanilla_tokens[2]


def test_generation_windows_follow_each_requests_own_generated_tokens(llm, tiny_model_dir,
                                                                       steer_files):
    """Two requests with different windows and prompt lengths, beside an unsteered one, in one
    batch: every generated token (greedy) and its logprob equal a hand-written decode loop in
    transformers on the same weights that applies the window's strength at that token
    (``Window.at``), independently of the batch's other requests and positions."""
    from helpers.reference import HFReference
    from vllm_steer.format import load_steer

    reqs = [(PROMPTS[2], {"a": {"strength": 6, "start": 2, "end": 5}}),
            (PROMPTS[1], {"b": {"strength": -6, "start": 1, "ramp": 4}, "a": 2}),
            (PROMPTS[0], None)]
    outs = llm.generate([p for p, _ in reqs], [sp(s, logprobs=0) for _, s in reqs])
    ref = HFReference(tiny_model_dir, {n: load_steer(steer_files[n]) for n in ("a", "b")})
    constant = ref.check_windowed(outs, [s for _, s in reqs], MAX_TOKENS)
    assert any(constant)


def test_every_hook_of_the_v1_runner_groups_ran_in_the_engine(llm, hooks_record):
    """Hook coverage on the V1 runner: every wrapped hook of the groups this engine uses
    (engine core, V1 runner, its prompt logprobs) was called in the engine's processes, and
    the frontend hooks of the offline path in this one, so a patched name vLLM stopped
    calling fails here. Steered requests with prompt logprobs make sure every path ran."""
    from vllm_steer.integrations.protocol import MANAGEMENT_METHOD
    from hook_recorder import CALLED, recorded, wrapped_targets
    from vllm_steer.integrations.plugin import HOOKS

    listed = llm.collective_rpc(MANAGEMENT_METHOD, args=("list", {}))[0]["steers"]
    assert "a" in [e["name"] for e in listed]  # through EngineCore.collective_rpc
    outs = llm.generate(PROMPTS[:2], [sp({"a": 3}, prompt_logprobs=0, max_tokens=2),
                                      sp(max_tokens=2)])
    assert all(o.outputs[0].token_ids for o in outs)
    ran = recorded(hooks_record) | CALLED
    want = wrapped_targets(HOOKS, ("engine", "v1", "v1-lens")) | {
        "vllm.engine.arg_utils:EngineArgs.create_engine_config",
        "vllm.v1.engine.input_processor:InputProcessor.__init__"}
    assert len(want) == 10, sorted(want)
    assert want - ran == set(), f"hooks never called: {sorted(want - ran)}"
    assert not ran & wrapped_targets(HOOKS, ("v2", "v2-lens", "v2-spec"))


# ---- the engine core in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0) -------------------
_IN_PROCESS = r'''
import json
import os
import sys
import threading

from vllm import LLM, SamplingParams

from vllm_steer import offline
from vllm_steer.integrations.engine import core

spec = json.loads(sys.argv[1])
seen = {}


def within(label, fn):
    """fn() in a thread; one still running after the timeout ends this process with what it
    saw (a generate that never returns)."""
    box = {}

    def run():
        try:
            box["value"] = fn()
        except Exception as e:  # noqa: BLE001 - recorded for the test
            box["error"] = f"{type(e).__name__}: {e}"

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(spec["timeout"])
    if t.is_alive():
        seen["hung"] = label
        print("RESULT" + json.dumps(seen), flush=True)
        os._exit(0)
    return box


def generate(label, prompts, steers):
    params = [SamplingParams(temperature=0, max_tokens=spec["max_tokens"],
                             extra_args=None if s is None else {"steer": s}) for s in steers]
    box = within(label, lambda: llm.generate(prompts, params, use_tqdm=False))
    seen[label] = box.get("error") or [
        [list(o.outputs[0].token_ids), o.outputs[0].finish_reason, o.outputs[0].stop_reason]
        for o in box["value"]]


def listed(label):
    seen[label] = sorted([s["name"], s["load_id"], s["bank_slot"], s["file"]]
                         for s in within(label, lambda: offline.list_steers(llm))["value"])


def planted_fault(*args):
    raise RuntimeError("planted fault")


if __name__ == "__main__":
    llm = LLM(spec["model"], additional_config={"vllm_steer": spec["steer_config"]},
              **spec["engine_kw"])
    prompts, steered = spec["prompts"], spec["steered"]
    for when in ("before", "after"):
        if when == "after":
            # a steer the engine core refuses (its file's rank over --max-steer-rank), beside
            # a plain request; then a fault of the plugin's admission code
            generate("refused", prompts[:2], [spec["refused"], None])
            core.bind_request, bind = planted_fault, core.bind_request
            generate("fault", prompts[:1], [steered[0]])
            core.bind_request = bind
        generate(f"plain_{when}", prompts, [None] * len(prompts))
        generate(f"steered_{when}", prompts, steered)
        listed(f"listed_{when}")
    print("RESULT" + json.dumps(seen), flush=True)
'''


def test_an_engine_side_refusal_in_process_is_an_error_output_and_the_llm_keeps_serving(
        tiny_model_dir, steer_files, tmp_path):
    """Offline, with the engine core in the ``LLM``'s process: a request the engine core
    refuses (a ``--steer-dir`` file the frontend accepts, of a rank over ``--max-steer-rank``)
    ends with ``finish_reason`` ``"error"`` and the refusal in ``stop_reason``, as with the
    engine core in a process of its own, and a request of the same call is served; so is a
    fault of the plugin's admission code (``vllm-steer failed: ``). The ``LLM`` keeps serving:
    plain and steered requests give the tokens they gave before (greedy), and every loaded
    steer is still listed in its slot. Each call runs under a timeout (a generate that never
    returns fails the test), the engine in a subprocess (the environment variable)."""
    import json
    import os
    import subprocess
    import sys

    from vllm_steer.integrations.protocol import FAILED_PREFIX, REFUSED_PREFIX

    steer_dir = tmp_path / "steer-dir"
    steer_dir.mkdir()
    save_steer(str(steer_dir / "wide.safetensors"), random_steer(64, 16, "wide", seed=4))
    spec = {"model": str(tiny_model_dir), "prompts": PROMPTS, "max_tokens": MAX_TOKENS,
            "steer_config": {"steers": {n: steer_files[n] for n in ("a", "b")},
                             "steer_dir": str(steer_dir), "max_steer_rank": 8},
            "engine_kw": dict(dtype="float32", kv_cache_memory_bytes=1 << 26,
                              max_model_len=128, max_num_seqs=4, enforce_eager=True, seed=0,
                              enable_prefix_caching=False),
            "steered": [{"a": 5}, {"b": -7}, {"a": 2, "b": 3}, None],
            "refused": {"wide": 3}, "timeout": 120}
    script = tmp_path / "in_process.py"
    script.write_text(_IN_PROCESS)
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0")
    out = subprocess.run([sys.executable, str(script), json.dumps(spec)], env=env,
                         capture_output=True, text=True, timeout=900)
    line = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT")]
    assert line, out.stderr[-3000:]
    seen = json.loads(line[0][len("RESULT"):])
    assert "hung" not in seen, f"{seen['hung']}: generate never returned; before it: {seen}"
    assert isinstance(seen["refused"], list), seen["refused"]  # not raised
    (refused_tokens, refused_reason, refusal), plain = seen["refused"]
    assert refused_tokens == [] and refused_reason == "error", seen["refused"]
    assert refusal.startswith(REFUSED_PREFIX) and "over --max-steer-rank=8" in refusal
    assert plain == seen["plain_before"][1]  # the call's other request is served
    [(fault_tokens, fault_reason, fault)] = seen["fault"]
    assert fault_tokens == [] and fault_reason == "error" and fault.startswith(FAILED_PREFIX)
    assert "planted fault" in fault
    for kind in ("plain", "steered"):
        assert seen[f"{kind}_after"] == seen[f"{kind}_before"]
    assert seen["steered_before"][:3] != seen["plain_before"][:3]  # the steers steer
    assert [e[0] for e in seen["listed_after"]] == ["a", "b"]
    assert seen["listed_after"] == seen["listed_before"]
