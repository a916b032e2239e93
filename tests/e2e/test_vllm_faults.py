"""No request, load or file takes a replica down: one server with a small bank and a steer
dir larger than it, the shape of ``docs/deploy.md`` (``--max-steers 3``, one steer pinned by
``--steer``, six steers in ``--steer-dir``, run-time updates, a preset).

- A request naming more steers than the bank holds at once is a 400 naming the count,
  ``--max-steers`` and the fix; over ``--max-steers-per-request`` a 400 naming that flag; the
  engine goes on, and a fitting request is then served with the right tokens (plain torch on
  the model's own weights).
- Concurrent first-use requests over the whole steer dir: every answer a 200 or a 400, and
  the server serves after them.
- A streamed ``/v1/responses`` request (whose first events vLLM makes before the request
  reaches the engine) refused by the plugin gets the refusal's status before any event: an
  unknown steer the engine core refuses a 400, a full bank a 429 with ``Retry-After``.
- **Fault injection**, one case per hook of the ``frontend`` and ``engine`` groups of
  ``HOOKS`` that runs per request or per management call: the plugin's code at that hook
  raises on a single request (``tests/faultshim``, in the server's processes); that request
  fails with HTTP 500 naming vllm-steer, and the next request on the same engine is served
  and correct. The other hooks of those groups run at start-up only (:data:`STARTUP`); every
  hook of the two groups is one or the other.
- **Faults half-way through a management call that writes** (``POST`` and ``DELETE
  /v1/steers``, ``POST``, ``PUT`` and ``DELETE /v1/steer-presets``): a load that fails after
  every worker's put and before the registry's commit, an unload whose slot a worker fails to
  empty, a preset change that fails in the preset table. The listing afterwards is the one
  before the call (or, for the unload, the one after it: the unload is done and says so), the
  same call then succeeds, and the engine serves the right tokens. A replacement in the
  name's own slot (a full bank) whose worker put fails: the name serves its previous file
  again, and the 500 says so.
- **Worker faults** (:data:`WORKER_CASES`): the plugin's per-step worker code (the steer op,
  the V1 runner's row positions, one request's slot) raises while one steered request runs
  beside unsteered ones: it gets a 500 naming vllm-steer and the request, the unsteered ones
  exactly plain greedy tokens, and the next steered request is served correctly.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import random
import threading
import time
from pathlib import Path

import pytest
import requests
import torch

from helpers.steers import random_steer
from vllm_steer.format import load_steer, save_steer

pytestmark = pytest.mark.vllm
HIDDEN = 64
CAPACITY = 3
PER_REQUEST = 4
FIRST_USE_WAIT = 1.5  # seconds a first-use request waits for a slot before its 429
DIR_NAMES = [f"d{i}" for i in range(1, 7)]
PROMPT = [1, 504, 3458, 314, 253, 655]
SHIM = Path(__file__).resolve().parents[1] / "faultshim"
STATE: dict = {}


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    from vllm_steer.server.launch import serve

    root = tmp_path_factory.mktemp("faults")
    d = root / "steers"
    d.mkdir()
    for i, name in enumerate(DIR_NAMES):
        save_steer(d / f"{name}.safetensors", random_steer(HIDDEN, 8, name, seed=20 + i,
                                                           scale=3.0))
    save_steer(root / "pin.safetensors", random_steer(HIDDEN, 8, "pin", seed=5, scale=3.0))
    faults = root / "faults"
    faults.mkdir()
    args = [tiny_model_dir, "--served-model-name", "tiny",
            "--steer", f"pin={root / 'pin.safetensors'}", "--steer-dir", d,
            "--max-steers", CAPACITY, "--max-steers-per-request", PER_REQUEST,
            "--enable-steer-updates", "--steer-preset", "polite=pin:2",
            "--dtype", "float32", "--max-model-len", "512", "--max-num-seqs", "16",
            "--kv-cache-memory-bytes", 1 << 28, "--enforce-eager"]
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(SHIM),
                                                       os.environ.get("PYTHONPATH")])),
           "STEER_TEST_FAULTS": str(faults), "VLLM_STEER_POLL_SECONDS": "3600",
           "VLLM_STEER_FIRST_USE_WAIT_SECONDS": str(FIRST_USE_WAIT)}
    STATE.update(dir=d, root=root, faults=faults, log=root / "server.log")
    with serve(args, root / "server.log", env=env) as url:
        yield url


def complete(url, steer=None, model="tiny", max_tokens=6, headers=None, **kw):
    body = {"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "return_tokens_as_token_ids": True, "logprobs": 0, **kw}
    if steer:
        body["steer"] = steer
    return requests.post(url + "/v1/completions", json=body, headers=headers, timeout=120)


def tokens(r) -> list[int]:
    assert r.status_code == 200, r.text
    return [int(t.split(":")[1]) for t in r.json()["choices"][0]["logprobs"]["tokens"]]


def reference_tokens(model_dir, steers: dict[str, float], n: int = 6) -> list[int]:
    """Greedy tokens of the steered model in plain torch (transformers, the model's own
    weights), each steer read from its file."""
    from transformers import AutoModelForCausalLM

    from vllm_steer.hf import steering

    files = {name: (STATE["root"] / "pin.safetensors" if name == "pin"
                    else STATE["dir"] / f"{name}.safetensors") for name in steers}
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = list(PROMPT)
    with torch.no_grad(), steering(model, {k: load_steer(v) for k, v in files.items()},
                                   steers):
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(PROMPT):]


# ---- over capacity and per-request limits ---------------------------------------------------
def test_over_capacity_request_is_a_400_and_the_engine_goes_on(server, tiny_model_dir):
    r = complete(server, {"d1": 1, "d2": 1, "d3": 1, "d4": 1})
    assert r.status_code == 400, r.text
    msg = r.json()["error"]["message"]
    assert "4 steers" in msg and "--max-steers=3" in msg and "at most 3" in msg, msg
    r = complete(server, {"d1": 1, "d2": 1, "d3": 1, "d4": 1, "d5": 1})
    assert r.status_code == 400, r.text
    msg = r.json()["error"]["message"]
    assert "5 steers" in msg and f"--max-steers-per-request={PER_REQUEST}" in msg, msg
    # the engine serves on: a fitting request, with the right tokens, and a plain one
    want = {"d1": 4.0, "d2": -3.0}
    assert tokens(complete(server, want)) == reference_tokens(tiny_model_dir, want)
    assert tokens(complete(server)) == reference_tokens(tiny_model_dir, {})
    assert requests.get(server + "/health", timeout=10).status_code == 200


def test_a_request_over_the_free_room_never_evicts_its_own_steers(server, tiny_model_dir):
    """Two first-use steers beside the pinned one fill the bank: a request naming the
    pinned steer and two steer-dir steers fits, whatever was loaded before."""
    for names in (("d3", "d4"), ("d5", "d6"), ("d1", "d6")):
        want = {"pin": 2.0, names[0]: 3.0, names[1]: -3.0}
        assert tokens(complete(server, want)) == reference_tokens(tiny_model_dir, want)


def test_concurrent_first_use_requests_get_200_400_or_429(server, tiny_model_dir):
    rng = random.Random(7)
    mixes = [{n: rng.choice([-3, 2, 4]) for n in rng.sample(DIR_NAMES, rng.randint(1, 4))}
             for _ in range(32)]
    with cf.ThreadPoolExecutor(8) as pool:
        codes = list(pool.map(lambda m: complete(server, m).status_code, mixes))
    assert set(codes) <= {200, 400, 429}, codes
    # a request that fits waits for a slot while running requests hold them all (a 429 if
    # none frees in time): the 400s are the requests over the bank (more dir steers than its
    # 2 free slots)
    over = [c for m, c in zip(mixes, codes, strict=True) if len(m) > CAPACITY - 1]
    fits = [c for m, c in zip(mixes, codes, strict=True) if len(m) <= CAPACITY - 1]
    assert set(over) == {400}, (codes, mixes)
    assert 400 not in fits, (codes, mixes)
    assert fits.count(200) >= len(fits) // 2, (codes, mixes)
    assert requests.get(server + "/health", timeout=10).status_code == 200
    want = {"d2": 1.0, "d5": -2.0}  # the bank is not wedged: two first-use steers fit
    assert tokens(complete(server, want)) == reference_tokens(tiny_model_dir, want)


def metric(url, name, **labels) -> float:
    """The value of ``name`` on /metrics after the API server took the engine core's counters
    (``GET /v1/steers`` runs a ``list``): its samples with ``labels`` summed."""
    from prometheus_client.parser import text_string_to_metric_families

    assert requests.get(url + "/v1/steers", timeout=30).status_code == 200
    body = requests.get(url + "/metrics", timeout=30).text
    return sum(s.value for f in text_string_to_metric_families(body) for s in f.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


class Holder:
    """A long streamed completion with one steer, read in a thread: it holds its steer's bank
    slot from its first token until it ends."""

    def __init__(self, url, name):
        self.r = requests.post(url + "/v1/completions", stream=True, timeout=300, json={
            "model": "tiny", "prompt": PROMPT, "max_tokens": 500, "temperature": 0,
            "ignore_eos": True, "stream": True, "steer": {name: 1.0}})
        assert self.r.status_code == 200, self.r.text
        self.lines = self.r.iter_lines()
        assert next(line for line in self.lines if line)  # admitted: its steer is bound
        self.t = threading.Thread(target=lambda: [None for _ in self.lines])
        self.t.start()

    def running(self) -> bool:
        return self.t.is_alive()


def test_a_full_bank_is_a_429_with_retry_after_and_its_retry_is_served(server, tiny_model_dir):
    """Both slots the pinned steer leaves held by running requests: a request needing a third
    ``--steer-dir`` steer waits, then gets HTTP 429 with ``Retry-After`` through the OpenAI
    client (plain and streamed), reading no file while it waits; counted as a wait, not as a
    load failure. Its retry once the slots free is served, with the right tokens."""
    import openai

    client = openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0)
    for name in ("d3", "d4"):  # loaded, so the holders start at once
        assert complete(server, {name: 1}).status_code == 200
    reads = metric(server, "vllm_steer:steer_file_reads_total")
    failures = metric(server, "vllm_steer:steer_load_failures_total")
    waits = metric(server, "vllm_steer:bank_full_waits_total", outcome="retry_after")
    holders = [Holder(server, "d3"), Holder(server, "d4")]
    want = {"d5": 3.0}

    def plain():
        t0 = time.monotonic()
        with pytest.raises(openai.RateLimitError) as e:
            client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6,
                                      extra_body={"steer": want})
        return e.value, time.monotonic() - t0

    def streamed():
        with pytest.raises(openai.RateLimitError) as e:
            client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, stream=True,
                                      extra_body={"steer": {"d6": 1.0}})
        return e.value, 0.0

    with cf.ThreadPoolExecutor(2) as pool:
        answers = [f.result() for f in [pool.submit(plain), pool.submit(streamed)]]
    assert all(h.running() for h in holders), "the holders ended before the 429s: longer ones"
    for err, _took in answers:
        assert err.status_code == 429, err
        assert err.response.headers["retry-after"].isdigit(), err.response.headers
        msg = err.response.json()["error"]["message"]
        # the API server's wait, or (its view of the names a moment old) the engine core's
        # admission: both name the bank and the limit
        assert ("all 3 steer slots are in use" in msg
                or "only 0 of the 3 steer slots can take one now" in msg), msg
        assert "--max-steers=3" in msg, msg
    assert answers[0][1] >= FIRST_USE_WAIT - 0.1  # it waited before the 429
    assert metric(server, "vllm_steer:steer_file_reads_total") == reads  # nothing read
    assert metric(server, "vllm_steer:steer_load_failures_total") == failures
    assert metric(server, "vllm_steer:bank_full_waits_total", outcome="retry_after") == \
        waits + 2
    for h in holders:
        h.t.join(timeout=300)
    # the retry, after Retry-After: served with the right tokens, the file read once
    time.sleep(int(answers[0][0].response.headers["retry-after"]))
    # a new client, as a retrying caller's connection: the first client's pooled connection,
    # idle for about uvicorn's 5 s keep-alive while the holders ended, may be closed by the
    # server as it is reused (a connection error the client's own retries, off here, cover)
    client = openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0)
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0,
                                    logprobs=0, extra_body={"steer": want, "ignore_eos": True,
                                                            "return_tokens_as_token_ids": True})
    got = [int(t.split(":")[1]) for t in out.choices[0].logprobs.tokens]
    assert got == reference_tokens(tiny_model_dir, want)
    assert metric(server, "vllm_steer:steer_file_reads_total") == reads + 1
    assert metric(server, "vllm_steer:steer_load_failures_total") == failures
    assert requests.get(server + "/health", timeout=10).status_code == 200


def responses_stream(url, steer, headers=None, stream=True):
    """A streamed ``/v1/responses`` request with ``steer``."""
    return requests.post(url + "/v1/responses", stream=stream, timeout=120, headers=headers,
                         json={"model": "tiny", "input": "hi", "max_output_tokens": 3,
                               "temperature": 0, "stream": True, "steer": steer})


def test_a_streamed_responses_request_refused_by_the_plugin_gets_its_status(server):
    """vLLM's responses stream sends ``response.created`` before the request reaches the
    engine: a steer the engine core refuses (unknown, on a server with run-time updates) is
    still an HTTP 400 before any event (a streamed chat completion's and completion's too,
    whose HTTP 200 vLLM sends before the engine's first output), a full bank an HTTP 429
    with ``Retry-After``, never a cut stream; an admitted request streams every event,
    ``response.created`` first."""
    r = responses_stream(server, {"zzz": 1})
    assert r.status_code == 400, r.text
    assert r.headers["content-type"].startswith("application/json"), r.headers
    err = r.json()["error"]
    assert "unknown steer 'zzz'" in err["message"] and err["param"] == "steer", err
    # a streamed chat completion and completion: the same 400, not HTTP 200 and an error event
    for route, body in (("/v1/chat/completions", {"messages": [{"role": "user",
                                                                "content": "hi"}]}),
                        ("/v1/completions", {"prompt": "hi"})):
        r = requests.post(server + route, timeout=120, json={
            "model": "tiny", "max_tokens": 3, "stream": True, "steer": {"zzz": 1}, **body})
        assert r.status_code == 400, (route, r.text)
        err = r.json()["error"]
        assert "unknown steer 'zzz'" in err["message"] and err["param"] == "steer", err
        assert not [k for k in r.headers if k.lower().startswith("x-vllm-steer")], r.headers
    r = responses_stream(server, {"pin": 2})
    assert r.status_code == 200, r.text
    assert r.headers["x-vllm-steer-applied"] == "pin=2"
    events = [line for line in r.iter_lines() if line.startswith(b"event: ")]
    assert events[0] == b"event: response.created", events
    assert events[-1] == b"event: response.completed", events
    for name in ("d3", "d4"):  # loaded, so the holders start at once
        assert complete(server, {name: 1}).status_code == 200
    holders = [Holder(server, "d3"), Holder(server, "d4")]
    try:
        r = responses_stream(server, {"d5": 1})
        assert all(h.running() for h in holders), "the holders ended before the 429: longer"
        assert r.status_code == 429, r.text
        assert r.headers["retry-after"].isdigit(), r.headers
        msg = r.json()["error"]["message"]
        assert ("all 3 steer slots are in use" in msg
                or "only 0 of the 3 steer slots can take one now" in msg), msg
    finally:
        for h in holders:
            h.t.join(timeout=300)
    log = STATE["log"].read_text(errors="replace")
    assert "response already started" not in log
    assert requests.get(server + "/health", timeout=10).status_code == 200


# ---- fault injection ---------------------------------------------------------------------
_REQ = "vllm.entrypoints.openai"
#: Hooks of the frontend and engine groups that run only at start-up (a fault there fails
#: start-up loudly, which is right: nothing is served yet), or install no wrapper.
STARTUP = {
    "vllm.engine.arg_utils:EngineArgs.add_cli_args",
    "vllm.engine.arg_utils:EngineArgs.from_cli_args",
    "vllm.engine.arg_utils:EngineArgs.create_engine_config",
    "vllm.v1.engine.input_processor:InputProcessor.__init__",
    "vllm.v1.engine.input_processor:InputProcessor._build_logits_processors_params_validator",
    "vllm.plugins:load_endpoint_plugins",
    "vllm.v1.engine:EngineCoreOutput.stop_reason",
    # the engine core's steers read as it starts: a file that cannot be read fails the start
    # (tests/integrations/engine/test_binding.py)
    "vllm.v1.engine.core:EngineCore._initialize_kv_caches",
}
#: Hooks that run only with the engine core in the ``LLM``'s process (offline,
#: ``VLLM_ENABLE_V1_MULTIPROCESSING=0``), never in a server: tests/e2e/test_vllm_offline.py
#: refuses requests and plants a fault of the admission code through it.
IN_PROCESS_ONLY = {"vllm.v1.engine.core_client:InprocClient.get_output"}


def _fault_cases():
    """(hook target pattern, the plugin function that raises, the request that meets it)."""
    return [
        ("to_sampling_params", "vllm_steer.integrations.frontend.preset_models:apply_preset",
         "completion"),
        ("to_beam_search_params",
         "vllm_steer.integrations.frontend.request_field:refuse_steered_beam_search", "beam"),
        ("AnthropicServingMessages._build_base_request",
         "vllm_steer.integrations.frontend.request_field:carry_steer", "messages"),
        ("OpenAIModelRegistry.is_base_model",
         "vllm_steer.integrations.frontend.preset_models:pinned_preset", "preset"),
        ("OpenAIModelRegistry.show_available_models",
         "vllm_steer.integrations.frontend.preset_models:presets", "models"),
        ("BaseServing._check_model",
         "vllm_steer.integrations.frontend.preset_models:_runtime_presets_on", "completion"),
        ("AsyncLLM.add_request",
         "vllm_steer.integrations.frontend.async_llm:_preload_dir_steers", "completion"),
        ("AsyncLLM.generate",
         "vllm_steer.integrations.frontend.async_llm:_raise_engine_refusal", "completion"),
        ("OpenAIServingResponses.create_responses",
         "vllm_steer.integrations.frontend.responses_stream:held_box", "responses"),
        ("EngineCore.add_request", "vllm_steer.integrations.engine.core:bind_request",
         "completion"),
        ("EngineCore.collective_rpc", "vllm_steer.integrations.engine.core:run_op", "steers"),
    ]


def test_every_frontend_and_engine_hook_has_a_fault_case_or_runs_at_startup():
    from vllm_steer.integrations.hooks import ENGINE, FRONTEND
    from vllm_steer.integrations.plugin import HOOKS

    cases = [c[0] for c in _fault_cases()]
    for hook in HOOKS:
        if hook.group not in (FRONTEND, ENGINE) or hook.target == WORKER_FAULT_HOOK \
                or hook.target in IN_PROCESS_ONLY:
            continue  # (the worker faults' hook: every worker case runs through it)
        covered = [c for c in cases if hook.target.endswith(c)]
        if hook.target in STARTUP or ".model_fields" in hook.target:
            assert not covered, hook.target
        else:
            assert covered, f"{hook.target}: no fault-injection case and not a start-up hook"


def _send(url, kind, rid):
    h = {"X-Request-Id": rid}
    if kind == "completion":
        return complete(url, {"d1": 2}, headers=h, request_id=rid)
    if kind == "beam":
        return complete(url, None, headers=h, use_beam_search=True, n=2, logprobs=None,
                        return_tokens_as_token_ids=False)
    if kind == "preset":
        return complete(url, None, model="polite", headers=h)
    if kind == "models":
        return requests.get(url + "/v1/models", headers=h, timeout=60)
    if kind == "steers":
        return requests.get(url + "/v1/steers", headers=h, timeout=60)
    if kind == "responses":
        return responses_stream(url, {"d1": 2}, headers=h, stream=False)
    if kind == "messages":  # vLLM's Anthropic Messages API
        return requests.post(url + "/v1/messages", headers=h, timeout=120, json={
            "model": "tiny", "max_tokens": 4, "temperature": 0, "steer": {"d1": 2},
            "messages": [{"role": "user", "content": "Hello"}]})
    raise AssertionError(kind)


@pytest.mark.parametrize("hook,target,kind", _fault_cases(), ids=[c[0] for c in _fault_cases()])
def test_a_fault_in_the_plugin_fails_one_request_and_the_next_is_served(server, hook, target,
                                                                        kind, tiny_model_dir):
    good = _send(server, kind, f"before-{hook}")
    assert good.status_code == 200, good.text
    (STATE["faults"] / target).write_text("")
    rid = f"fault-{hook.replace('.', '-')}"
    bad = _send(server, kind, rid)
    assert not (STATE["faults"] / target).exists(), f"{target} was never called by {kind}"
    assert bad.status_code == 500, (bad.status_code, bad.text)
    text = bad.text
    assert "vllm-steer" in text and "fault injected by the test" in text, text
    if kind in ("completion",):  # the request's id is known where the fault met it
        assert "fault-" in text, text
    after = _send(server, kind, f"after-{hook}")
    assert after.status_code == 200, after.text
    if kind == "completion":
        assert tokens(after) == tokens(good) == reference_tokens(tiny_model_dir, {"d1": 2.0})
    elif kind == "models":
        assert {m["id"] for m in after.json()["data"]} == {m["id"] for m in good.json()["data"]}
    assert requests.get(server + "/health", timeout=10).status_code == 200
    log = STATE["log"].read_text(errors="replace")
    assert log.count(f"fault injected by the test ({target})") >= 1


# ---- faults half-way through a management call that writes -------------------------------
def _steers(url) -> list:
    r = requests.get(url + "/v1/steers", timeout=60)
    assert r.status_code == 200, r.text
    return sorted((s["name"], s["source"], s["bank_slot"], s["load_id"])
                  for s in r.json()["data"])


def _presets(url) -> dict:
    r = requests.get(url + "/v1/steer-presets", timeout=60)
    assert r.status_code == 200, r.text
    return {p["name"]: p["steer"] for p in r.json()["data"]}


def _call(url, method, path, body=None):
    return requests.request(method, url + path, json=body, timeout=120)


def _faulted(url, target, method, path, body=None):
    """The call with ``target`` raising once inside it."""
    (STATE["faults"] / target).write_text("")
    r = _call(url, method, path, body)
    assert not (STATE["faults"] / target).exists(), f"{target} was never called"
    return r


def test_a_fault_half_way_through_a_management_write_changes_nothing(server, tiny_model_dir):
    d2 = str(STATE["dir"] / "d2.safetensors")
    want = reference_tokens(tiny_model_dir, {"d1": 2.0})

    def serves():
        assert requests.get(server + "/health", timeout=10).status_code == 200
        assert tokens(complete(server, {"d1": 2})) == want

    for name, source, _, _ in _steers(server):  # a free slot for the load below
        if source == "steer-dir":
            assert _call(server, "DELETE", f"/v1/steers/{name}").status_code == 200
    serves()  # 'd1' is loaded on its first use here, not half-way through a call below
    # POST /v1/steers: every worker holds the factors, the registry's commit fails
    before = _steers(server)
    r = _faulted(server, "vllm_steer.integrations.engine.registry:SteerRegistry.commit",
                 "POST", "/v1/steers", {"name": "api1", "path": d2})
    assert r.status_code == 500 and "vllm-steer" in r.text, r.text
    assert _steers(server) == before
    serves()
    r = _call(server, "POST", "/v1/steers", {"name": "api1", "path": d2})
    assert r.status_code == 200, r.text
    loaded = _steers(server)
    assert [s[0] for s in loaded] == sorted([*[s[0] for s in before], "api1"]), loaded
    # DELETE /v1/steers/api1: unbound, then a worker fails to empty its slot: done
    r = _faulted(server, "vllm_steer.integrations.worker.management:worker_op",
                 "DELETE", "/v1/steers/api1")
    assert r.status_code == 200, r.text
    assert _steers(server) == before
    serves()
    assert _call(server, "POST", "/v1/steers", {"name": "api1", "path": d2}).status_code == 200
    assert _call(server, "DELETE", "/v1/steers/api1").status_code == 200
    assert _steers(server) == before
    # the preset writes: POST, PUT, DELETE, each failing in the engine core's preset table
    presets = _presets(server)
    add, delete = ("vllm_steer.integrations.engine.presets:PresetTable.add",
                   "vllm_steer.integrations.engine.presets:PresetTable.delete")
    for target, method, path, body, then in (
            (add, "POST", "/v1/steer-presets", {"name": "kind", "steer": {"d1": 2}},
             {**presets, "kind": {"d1": 2.0}}),
            (add, "PUT", "/v1/steer-presets/kind", {"steer": {"d1": 3}},
             {**presets, "kind": {"d1": 3.0}}),
            (delete, "DELETE", "/v1/steer-presets/kind", None, presets)):
        was = _presets(server)
        r = _faulted(server, target, method, path, body)
        assert r.status_code == 500 and "vllm-steer" in r.text, (method, r.text)
        assert _presets(server) == was, method
        serves()
        r = _call(server, method, path, body)
        assert r.status_code == 200, (method, r.text)
        assert _presets(server) == then, method


def test_a_replacement_in_its_own_slot_whose_put_fails_keeps_serving_the_previous_file(
        server, tiny_model_dir):
    """The bank is full (the pinned steer and two loaded over HTTP), so loading one of those
    names again takes its own slot; the worker's put fails there. The call is a 500 that says
    the name serves its previous file again, the listing shows that file (a new load id), and
    a request naming it is served with that file's tokens."""
    d2, d3, d4 = (str(STATE["dir"] / f"{n}.safetensors") for n in ("d2", "d3", "d4"))
    for name, source, _, _ in _steers(server):  # room for exactly the two loads below
        if source == "steer-dir":
            assert _call(server, "DELETE", f"/v1/steers/{name}").status_code == 200
    for name, path in (("api2", d2), ("api3", d3)):
        r = _call(server, "POST", "/v1/steers", {"name": name, "path": path})
        assert r.status_code == 200, r.text
    r = _faulted(server, "vllm_steer.integrations.worker.management:worker_op",
                 "POST", "/v1/steers", {"name": "api2", "path": d4})
    assert r.status_code == 500 and "vllm-steer" in r.text, r.text
    assert "nothing was changed" not in r.text, r.text
    assert f"steer 'api2' serves its previous file {d2} again" in r.text, r.text
    listed = {s["name"]: s["file"] for s in requests.get(server + "/v1/steers",
                                                         timeout=60).json()["data"]}
    assert listed["api2"] == d2 and listed["api3"] == d3, listed
    assert tokens(complete(server, {"api2": 2})) == reference_tokens(tiny_model_dir,
                                                                     {"d2": 2.0})
    for name in ("api2", "api3"):
        assert _call(server, "DELETE", f"/v1/steers/{name}").status_code == 200


# ---- faults of the plugin's worker code ---------------------------------------------------
#: (case, the plugin's worker function that raises, the steer of the request that meets it):
#: the steer op and the step planner behind the head; the V1 runner's row positions (read only
#: for a request with a generation window); one request put into its request slot.
WORKER_CASES = [
    ("steer-op", "vllm_steer.integrations.worker.planner:StepPlanner.steer_rows", {"d1": 2}),
    ("row-positions", "vllm_steer.integrations.worker.v1:v1_batch_positions",
     {"d1": {"strength": 2, "start": 0, "end": 32}}),
    ("request-slot", "vllm_steer.bank:SlotBank.coef_row", {"d1": 2}),
]
#: The engine-core hook that turns a worker fault into the failed requests' HTTP 500: every
#: worker case runs through it.
WORKER_FAULT_HOOK = "vllm.v1.core.sched.scheduler:Scheduler.update_from_output"
PLAIN_TOKENS = 24


def test_every_worker_hook_run_per_step_has_a_fault_case():
    """Each per-step hook of the V1 runner's groups that runs the plugin's code (the head,
    the rows, the per-request state) has a worker case here; the scheduler hook is what
    every worker case goes through."""
    import importlib.util

    # by path: this process may have imported another ``sitecustomize`` at start-up
    spec = importlib.util.spec_from_file_location("faultshim_sitecustomize",
                                                  SHIM / "sitecustomize.py")
    shim = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(shim)
    assert {c[1] for c in WORKER_CASES} <= set(shim.WORKER_TARGETS)
    from vllm_steer.integrations.plugin import HOOKS

    assert any(h.target == WORKER_FAULT_HOOK for h in HOOKS)


@pytest.mark.parametrize("case,target,steer", WORKER_CASES, ids=[c[0] for c in WORKER_CASES])
def test_a_worker_fault_fails_only_the_steered_request_of_its_step(server, case, target, steer,
                                                                  tiny_model_dir):
    """One steered request in a mixed batch meets a fault of the plugin's worker code: it gets
    a 500 naming vllm-steer and the request; the unsteered requests of the same steps get
    exactly plain greedy decoding (torch on the model's own weights); the engine serves on,
    and the next steered request is served correctly."""
    plain = reference_tokens(tiny_model_dir, {}, PLAIN_TOKENS)
    (STATE["faults"] / target).write_text("")
    rid = f"wfault-{case}"
    with cf.ThreadPoolExecutor(4) as pool:
        others = [pool.submit(complete, server, None, max_tokens=PLAIN_TOKENS,
                              headers={"X-Request-Id": f"plain-{case}-{i}"}) for i in range(3)]
        time.sleep(0.2)  # the unsteered requests are running when the steered one comes
        bad = pool.submit(complete, server, steer, headers={"X-Request-Id": rid}).result()
        others = [f.result() for f in others]
    assert not (STATE["faults"] / target).exists(), f"{target} was never called"
    assert bad.status_code == 500, (bad.status_code, bad.text)
    assert "vllm-steer" in bad.text and "fault injected by the test" in bad.text, bad.text
    assert rid in bad.text, bad.text
    assert bad.text.count("This request was not served") == 1, bad.text
    for r in others:
        assert tokens(r) == plain
    after = complete(server, steer, headers={"X-Request-Id": f"after-{rid}"})
    want = {"d1": 2.0}
    assert tokens(after) == reference_tokens(tiny_model_dir, want)
    assert requests.get(server + "/health", timeout=10).status_code == 200
    log = STATE["log"].read_text(errors="replace")
    assert "internal error in" in log and f"fault injected by the test ({target})" in log


def test_a_streamed_request_failed_by_a_worker_fault_gets_none_of_its_steps_tokens(server):
    """Streamed, a steered request whose first step meets a fault of the plugin's worker code
    gets no token of that step (a stream shows what a non-streamed answer's 500 hides): its
    stream ends with an error naming vllm-steer and the request, and carries no text."""
    import json

    case, target, steer = WORKER_CASES[0]
    (STATE["faults"] / target).write_text("")
    rid = f"wfault-stream-{case}"
    r = requests.post(server + "/v1/completions", stream=True, timeout=120,
                      headers={"X-Request-Id": rid},
                      json={"model": "tiny", "prompt": PROMPT, "max_tokens": 6, "temperature": 0,
                            "ignore_eos": True, "stream": True, "steer": steer})
    events = [ln.removeprefix("data: ") for ln in r.iter_lines(decode_unicode=True) if ln]
    assert not (STATE["faults"] / target).exists(), f"{target} was never called"
    assert r.status_code == 200 and events[-1] == "[DONE]", events  # headers went first
    chunks = [json.loads(e) for e in events[:-1]]
    assert [c["choices"][0]["text"] for c in chunks if c.get("choices")] == [], chunks
    (error,) = [c["error"] for c in chunks if "error" in c]
    assert error["code"] == 500, error
    message = error["message"]
    assert message.startswith("vllm-steer: internal error in the steered LM head while serving "
                              f"request cmpl-{rid}"), message
    assert f"fault injected by the test ({target})" in message
    assert message.count("This request was not served") == 1, message  # said once
