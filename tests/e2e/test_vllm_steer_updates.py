"""Steers loaded and unloaded at run time (issue 15), on real engines on CPU.

One server for the module: ``--api-server-count 2 --steer-dir DIR --enable-steer-updates
--max-steers 4``. (A run-time load reaching both workers of TP=2 is tested on the module engine
of test_vllm_tp.py.)
Correctness is checked against transformers on the same weights; in-flight guarantees with a
streamed request that is still producing tokens when the steer changes.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import re
import threading
import time

import pytest
import requests
import torch

from helpers.steers import random_steer
from vllm_steer.format import load_steer, save_steer

pytestmark = pytest.mark.vllm
CAPACITY = 4
PROMPT = [1, 504, 3458, 314, 253, 655]  # token ids
STATE: dict = {}


# ---- transformers reference ----------------------------------------------------------------
def reference_logprobs(model_dir, prompt, tokens, steer_path, strength):
    """log p(token) at each generated position of the steered model, computed in transformers."""
    from transformers import AutoModelForCausalLM

    from vllm_steer.hf import steering

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad(), steering(model, {"s": load_steer(steer_path)}, {"s": strength}):
        logits = model(torch.tensor([list(prompt) + list(tokens)])).logits[0].float()
    lp = torch.log_softmax(logits, -1)
    n = len(prompt)
    return [lp[n - 1 + i] for i in range(len(tokens))]


def assert_matches_reference(tokens, logprobs, ref):
    for i, (tok, got) in enumerate(zip(tokens, logprobs, strict=True)):
        assert tok == int(ref[i].argmax()), i  # greedy: the steered argmax
        assert got == pytest.approx(ref[i][tok].item(), abs=2e-3), i


# ---- one server for the rest ---------------------------------------------------------------
@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    from vllm_steer.server.launch import serve

    root = tmp_path_factory.mktemp("updates")
    d = root / "steers"
    d.mkdir()
    for name, seed in (("a", 11), ("b", 12), ("c", 13)):
        save_steer(d / f"{name}.safetensors", random_steer(64, 8, name, seed=seed, scale=3.0))
    save_steer(root / "detox.safetensors", random_steer(64, 8, "detox", seed=1, scale=3.0))
    save_steer(d / "small.safetensors", random_steer(32, 4, "small"))  # wrong hidden size
    (d / "corrupt.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    outside = root / "outside.safetensors"
    save_steer(outside, random_steer(64, 8, "outside", seed=3))
    (d / "link.safetensors").symlink_to(outside)
    args = [tiny_model_dir, "--served-model-name", "tiny",
            "--steer", f"detox={root / 'detox.safetensors'}", "--steer-dir", d,
            "--enable-steer-updates", "--max-steers", CAPACITY, "--api-server-count", 2,
            "--dtype", "float32", "--max-model-len", "512", "--max-num-seqs", "16",
            "--kv-cache-memory-bytes", 1 << 28, "--enforce-eager"]
    STATE.update(dir=d, root=root)
    # each API server refreshes its view of the names at start and when it runs a steer op
    # itself, never on a timer: the other API server's view is stale (issue 23) and the
    # answers must not depend on it
    # and a first-use request that finds every slot in use is refused at once, not after
    # waiting for one (test_vllm_faults.py has requests wait)
    with serve(args, root / "server.log", env={"VLLM_STEER_POLL_SECONDS": "3600",
                                                "VLLM_STEER_FIRST_USE_WAIT_SECONDS": "0"}) as url:
        yield url


def complete(url, steer=None, max_tokens=8, logprobs=False, stream=False, **kw):
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, **kw}
    if steer:
        body["steer"] = steer
    if logprobs:
        body.update(logprobs=0, return_tokens_as_token_ids=True)
    if stream:
        body["stream"] = True
    return requests.post(url + "/v1/completions", json=body, stream=stream, timeout=120)


def text(url, steer=None, max_tokens=8):
    r = complete(url, steer, max_tokens)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def steers(url) -> dict:
    r = requests.get(url + "/v1/steers")
    assert r.status_code == 200, r.text
    return {s["name"]: s for s in r.json()["data"]}


def load(url, name, path=None):
    return requests.post(url + "/v1/steers", json={"name": name, **({"path": str(path)}
                                                                     if path else {})})


def wait_admitted_everywhere(url, name, timeout=15.0):
    """Each API server refreshes the loaded names from the engine core once a second (the
    documented guarantee): wait until several requests in a row (spread over the API servers)
    are admitted with ``name``."""
    deadline = time.monotonic() + timeout
    while True:
        codes = [complete(url, {name: 1}, 1).status_code for _ in range(6)]
        if all(c == 200 for c in codes) or time.monotonic() > deadline:
            assert all(c == 200 for c in codes), codes
            return
        time.sleep(0.2)


class Stream:
    """A streamed completion read in a thread; ``after(op)`` runs op once tokens flow and
    records how many chunks came after it returned (> 0: the request was in flight)."""

    def __init__(self, url, steer, max_tokens=200):
        self.chunks, self.after_op, self.op_done = [], 0, False
        self.started = threading.Event()
        self.r = complete(url, steer, max_tokens, stream=True)
        assert self.r.status_code == 200, self.r.text
        self.t = threading.Thread(target=self._read)
        self.t.start()

    def _read(self):
        for line in self.r.iter_lines():
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            choices = json.loads(line[6:])["choices"]
            if not choices:
                continue
            self.chunks.append(choices[0]["text"])
            self.after_op += self.op_done
            self.started.set()

    def after(self, op):
        assert self.started.wait(60)
        res = op()
        self.op_done = True
        return res

    def text(self):
        self.t.join(120)
        assert self.after_op > 0, "the request finished before the steer changed"
        return "".join(self.chunks)


def metric(url, name, labels="") -> float:
    """The value of ``name`` on /metrics: its samples with ``labels`` summed (over the label
    ``engine`` the counters carry); 0 if there is none."""
    from prometheus_client.parser import text_string_to_metric_families

    want = dict(re.findall(r'(\w+)="([^"]*)"', labels))
    body = requests.get(url + "/metrics").text
    return sum(s.value for f in text_string_to_metric_families(body) for s in f.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in want.items()))


def test_get_steers_lists_each_loaded_steer(server):
    detox = steers(server)["detox"]
    assert detox["file"] == str(STATE["root"] / "detox.safetensors")
    assert (detox["hidden_size"], detox["rank"], detox["eps0"]) == (64, 8, 1e-3)
    assert detox["labels"] == {"positive": "detox"} and detox["source"] == "--steer"
    assert detox["recommended_strength"] is None and detox["base_model"] is None
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", detox["loaded_at"])
    served = detox["requests_served"]
    text(server, {"detox": 5})
    assert steers(server)["detox"]["requests_served"] == served + 1
    listing = requests.get(server + "/v1/steers").json()
    assert listing["max_steers"] == CAPACITY and listing["updates_enabled"] is True


def test_steer_dir_loads_on_first_use_and_steers_like_transformers(server):
    assert "c" not in steers(server)
    r = complete(server, {"c": 5}, logprobs=True)
    assert r.status_code == 200, r.text
    lp = r.json()["choices"][0]["logprobs"]
    tokens = [int(t.split(":")[1]) for t in lp["tokens"]]
    ref = reference_logprobs(STATE["tiny"], PROMPT, tokens, STATE["dir"] / "c.safetensors", 5)
    assert_matches_reference(tokens, lp["token_logprobs"], ref)
    c = steers(server)["c"]
    assert c["source"] == "steer-dir" and c["file"] == str(STATE["dir"] / "c.safetensors")


@pytest.fixture(scope="module", autouse=True)
def _model_dir(tiny_model_dir):
    STATE["tiny"] = tiny_model_dir


@pytest.mark.parametrize("steer, fragment", [
    ({"nothere": 1}, "no file nothere.safetensors or nothere.gguf in --steer-dir"),
    ({"nothere": 0}, "no file nothere.safetensors or nothere.gguf in --steer-dir"),
    ({"detox": 1, "nothere": 0}, "unknown steer 'nothere'"),
    ({"../detox": 1}, "may use only"),
    ({"a/b": 1}, "may use only"),
    ({"..": 1}, "steer name"),
    ({"link": 1}, "outside --steer-dir"),
    ({"small": 1}, "hidden size 32"),
    ({"corrupt": 1}, "corrupt"),
])
def test_unknown_unsafe_or_bad_dir_steers_are_400_naming_the_problem(server, steer, fragment):
    r = complete(server, steer)
    assert r.status_code == 400, r.text
    assert fragment in r.json()["error"]["message"]


def test_post_refuses_traversal_outside_paths_and_bad_files_changing_nothing(server):
    before = steers(server)
    for body, status, fragment in [
        ({"name": "../x", "path": str(STATE["dir"] / "a.safetensors")}, 400, "may use only"),
        ({"name": "x", "path": str(STATE["root"] / "outside.safetensors")}, 403,
         "inside --steer-dir"),
        ({"name": "x", "path": str(STATE["dir"] / ".." / "outside.safetensors")}, 403,
         "inside --steer-dir"),
        ({"name": "detox", "path": str(STATE["dir"] / "corrupt.safetensors")}, 400,
         "corrupt.safetensors"),
        ({"name": "detox", "path": str(STATE["dir"] / "small.safetensors")}, 400,
         "hidden size 32 but the model"),
        ({"name": "x", "path": str(STATE["dir"] / "missing.safetensors")}, 400, "missing"),
    ]:
        r = requests.post(server + "/v1/steers", json=body)
        assert r.status_code == status, (body, r.text)
        assert fragment in r.json()["error"]["message"], (body, r.text)
    after = steers(server)
    assert {n: s["load_id"] for n, s in after.items()} == \
        {n: s["load_id"] for n, s in before.items()}
    assert text(server, {"detox": 5}) != text(server)  # detox unchanged, still serving


def test_load_under_traffic_loses_and_changes_no_request(server):
    jobs = [None, {"detox": 5}, {"detox": -3}] * 4
    solo = {json.dumps(s): text(server, s, 16) for s in jobs[:3]}
    with cf.ThreadPoolExecutor(6) as ex:
        futs = [ex.submit(text, server, s, 16) for s in jobs]
        r = load(server, "u", STATE["dir"] / "a.safetensors")
        got = [f.result() for f in futs]
    assert r.status_code == 200, r.text
    assert r.json()["name"] == "u" and r.json()["source"] == "api"
    assert got == [solo[json.dumps(s)] for s in jobs]
    wait_admitted_everywhere(server, "u")
    assert text(server, {"u": 5}) == text(server, {"a": 5}) != text(server)


def test_reload_under_the_same_name_old_requests_keep_the_old_file(server):
    old_gen = steers(server)["u"]["load_id"]
    want_old = text(server, {"a": 5}, 200)  # u is a.safetensors now
    s = Stream(server, {"u": 5})
    r = s.after(lambda: load(server, "u", STATE["dir"] / "b.safetensors"))
    assert r.status_code == 200, r.text
    assert r.json()["load_id"] > old_gen
    new = text(server, {"u": 5})  # admitted after the reload: the new file
    assert s.text() == want_old
    assert new == text(server, {"b": 5}) != text(server, {"a": 5})
    assert steers(server)["u"]["file"] == str(STATE["dir"] / "b.safetensors")


@pytest.mark.parametrize("repeat", range(int(os.environ.get("STEER_TEST_UNLOAD_REPEATS", "1"))))
def test_unload_under_traffic_in_flight_requests_finish_with_the_steer(server, repeat):
    if "u" not in steers(server):  # a repeat: the previous one unloaded it
        assert load(server, "u", STATE["dir"] / "b.safetensors").status_code == 200
    want = text(server, {"u": 5}, 200)
    s = Stream(server, {"u": 5})
    r = s.after(lambda: requests.delete(server + "/v1/steers/u"))
    assert r.status_code == 200 and r.json()["deleted"] is True, r.text
    assert s.text() == want
    after = complete(server, {"u": 5})
    assert after.status_code == 400
    assert "unknown steer 'u'" in after.json()["error"]["message"]
    assert "u" not in steers(server)
    assert requests.delete(server + "/v1/steers/u").status_code == 404


def api_server_views(url, rounds=12, width=6) -> dict:
    """pid -> the names that API-server process admitted, as each GET that reached it saw them
    (before that GET's refresh; so only a process's first answer can be stale).

    The two processes accept from one listening socket, and an idle pair can hand every
    sequential connection to the same one: the GETs go ``width`` at a time (a busy process
    leaves the next connection to the other), for up to ``rounds`` rounds."""
    seen: dict = {}

    def get(_):
        return requests.get(url + "/v1/steers").json()["api_server"]

    with cf.ThreadPoolExecutor(width) as pool:
        for _ in range(rounds):
            for api in pool.map(get, range(width)):
                seen.setdefault(api["pid"], []).append(api["admits"])
            if len(seen) == 2:
                break
    assert len(seen) == 2, "requests reached one API-server process only"
    return seen


def answers(views: dict) -> list:
    return [admits for per_pid in views.values() for admits in per_pid]


def test_no_api_server_admits_a_deleted_steer_or_refuses_a_loaded_one(server):
    """Issue 23: the API server that did not run the DELETE / POST still has the old view of
    the names (no timer refresh here); from the moment DELETE returns every request naming
    the steer is the usual 400 (never a 500), from the moment POST returns every request
    naming it is served with it, whichever API server it reaches, streamed or not."""
    assert load(server, "z", STATE["dir"] / "a.safetensors").status_code == 200
    api_server_views(server)  # both API servers admit z now (each refreshed on its GET)
    assert all("z" in admits for admits in answers(api_server_views(server)))
    assert requests.delete(server + "/v1/steers/z").status_code == 200
    for _ in range(8):
        r = complete(server, {"z": 5})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert "unknown steer 'z'" in err["message"] and err["param"] == "steer", err
        r = complete(server, {"z": 5}, stream=True)  # 400, or the stream's error event
        body = r.text
        assert r.status_code in (200, 400) and "Internal" not in body, body
        err = (r.json() if r.status_code == 400 else
               json.loads(body.split("data: ", 2)[1].strip()))["error"]
        assert "unknown steer 'z'" in err["message"] and err["code"] == 400, err
    views = api_server_views(server)  # a GET refreshes: the first answer shows the old view
    assert any("z" in admits for admits in answers(views)), \
        f"no API server had a stale view, the test proved nothing: {views}"
    # a load through one API server: the other one does not know the name yet
    want = text(server, {"b": 5})
    assert load(server, "z", STATE["dir"] / "b.safetensors").status_code == 200
    assert [text(server, {"z": 5}) for _ in range(8)] == [want] * 8
    views = api_server_views(server)
    assert any("z" not in admits for admits in answers(views)), views
    assert requests.delete(server + "/v1/steers/z").status_code == 200


def test_eviction_at_capacity_takes_the_least_recently_used_unused_dir_steer(server):
    for name in list(steers(server)):
        if name != "detox":
            assert requests.delete(server + f"/v1/steers/{name}").status_code == 200
    assert load(server, "p1", STATE["dir"] / "a.safetensors").status_code == 200
    text(server, {"a": 1})  # 4 of 4 slots: detox, p1 (pinned), a, b (steer-dir)
    text(server, {"b": 1})
    text(server, {"a": 1})  # b is now the least recently used
    evictions = metric(server, "vllm_steer:steer_evictions_total")
    assert text(server, {"c": 1})
    assert set(steers(server)) == {"detox", "p1", "a", "c"}
    # every steer-dir steer in use by a running request, the others pinned: a 429 to retry
    # (this server waits 0 s for a slot), with Retry-After, naming the bank
    requests.get(server + "/v1/steers")
    full = metric(server, "vllm_steer:requests_refused_total", '{reason="bank_full"}')
    s1, s2 = Stream(server, {"a": 1}), Stream(server, {"c": 1})
    r = s1.after(lambda: s2.after(lambda: complete(server, {"b": 1})))
    assert r.status_code == 429, r.text
    assert r.headers["retry-after"].isdigit() and int(r.headers["retry-after"]) >= 1, r.headers
    msg = r.json()["error"]["message"]
    # the API server's first-use load is refused by the registry; a request the API server
    # sends on (its view of the loaded steers a moment old) is refused by the engine core's
    # admission: both say the bank is full, name the limit and the fix
    assert ("all 4 steer slots are in use" in msg
            or "but only 0 of the 4 steer slots can take one now" in msg), msg
    deadline = time.time() + 10  # counted once, as a full bank, where it was refused
    while metric(server, "vllm_steer:requests_refused_total", '{reason="bank_full"}') \
            != full + 1:
        assert time.time() < deadline, "the bank_full refusal was not counted once"
        requests.get(server + "/v1/steers")
        time.sleep(0.5)
    assert "--max-steers=4" in msg and "larger --max-steers" in msg, msg
    r2 = load(server, "p2", STATE["dir"] / "b.safetensors")
    assert r2.status_code == 507 and "--max-steers=4" in r2.json()["error"]["message"]
    s1.text(), s2.text()
    deadline = time.time() + 10
    while metric(server, "vllm_steer:steer_evictions_total") <= evictions:
        assert time.time() < deadline, "evictions counter did not move"
        time.sleep(0.5)


def test_every_api_server_process_sees_a_load(server):
    requests.delete(server + "/v1/steers/p1")
    r = load(server, "q", STATE["dir"] / "c.safetensors")
    assert r.status_code == 200, r.text
    time.sleep(2.5)  # each API server refreshes its admission view once a second
    seen = {}
    for _ in range(24):  # new connections: spread over the two API-server processes
        listing = requests.get(server + "/v1/steers").json()
        assert "q" in {s["name"] for s in listing["data"]}
        seen[listing["api_server"]["pid"]] = listing["api_server"]["admits"]
        assert complete(server, {"q": 2}).status_code == 200
    assert len(seen) == 2, "requests reached one API-server process only"
    assert all("q" in admits for admits in seen.values()), seen


def test_metrics_move(server):
    served = metric(server, "vllm_steer:requests_steered_total", '{steer="detox"}')
    loads = metric(server, "vllm_steer:steer_loads_total")
    unloads = metric(server, "vllm_steer:steer_unloads_total")
    failures = metric(server, "vllm_steer:steer_load_failures_total")
    calls = metric(server, "vllm_steer:steer_op_calls_total")
    text(server, {"detox": 5})
    requests.delete(server + "/v1/steers/q")
    assert load(server, "m", STATE["dir"] / "a.safetensors").status_code == 200
    assert load(server, "m2", STATE["dir"] / "corrupt.safetensors").status_code == 400
    deadline = time.time() + 10
    while True:
        now = (metric(server, "vllm_steer:requests_steered_total", '{steer="detox"}'),
               metric(server, "vllm_steer:steer_loads_total"),
               metric(server, "vllm_steer:steer_unloads_total"),
               metric(server, "vllm_steer:steer_load_failures_total"),
               metric(server, "vllm_steer:steer_op_calls_total"))
        if now[0] > served and now[1] > loads and now[2] > unloads and now[3] > failures \
                and now[4] > calls:
            break
        assert time.time() < deadline, (now, (served, loads, unloads, failures, calls))
        time.sleep(0.5)
    assert metric(server, "vllm_steer:loaded_steers") == len(steers(server))
    assert metric(server, "vllm_steer:steer_op_seconds_total") > 0


def test_refusals_show_once_by_reason_across_both_api_servers(server):
    """Each refused request counts once on /metrics (the two API-server processes summed),
    under the reason it was refused for: a strength over the limit and an unknown model name
    refused by an API server, a steer neither loaded nor in --steer-dir by the engine core
    (handed to the API server whose steer list reads it next)."""
    name = "vllm_steer:requests_refused_total"
    reasons = ("unknown_steer", "strength_limit", "unknown_preset")

    def counts():
        return {r: metric(server, name, f'{{reason="{r}"}}') for r in reasons}

    requests.get(server + "/v1/steers")  # what the engine core counted so far: on /metrics
    before = counts()
    codes = [complete(server, {"nope": 1}).status_code for _ in range(6)]  # both API servers
    codes += [complete(server, {"detox": 1e6}).status_code for _ in range(3)]
    codes += [requests.post(server + "/v1/completions", json={
        "model": "no-such-model", "prompt": PROMPT, "max_tokens": 2}).status_code
        for _ in range(2)]
    assert codes == [400] * 9 + [404] * 2
    want = {"unknown_steer": 6, "strength_limit": 3, "unknown_preset": 2}
    deadline = time.time() + 10
    while True:
        requests.get(server + "/v1/steers")
        now = counts()
        moved = {r: now[r] - before[r] for r in reasons}
        if moved == want or time.time() > deadline:
            break
        time.sleep(0.5)
    assert moved == want
    assert metric(server, name, '{reason="strength_limit",source="api_server"}') >= 3
    assert metric(server, name, '{reason="unknown_steer",source="engine_core"}') >= 6


def test_cli_steers_list_load_unload(server, capsys):
    from vllm_steer.cli import main

    path = STATE["dir"] / "b.safetensors"
    assert main(["steers", "load", "cli-b", str(path), "--url", server]) == 0
    assert "loaded cli-b (rank 8" in capsys.readouterr().out
    assert main(["steers", "list", "--url", server]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^cli-b\s+8\s+64\s+api\s", out, re.M) and f"of {CAPACITY} steer slots" in out
    assert main(["steers", "unload", "cli-b", "--url", server]) == 0
    assert "unloaded cli-b" in capsys.readouterr().out
    assert main(["steers", "unload", "cli-b", "--url", server]) == 1
    assert "HTTP 404: steer 'cli-b' is not loaded" in capsys.readouterr().err


def test_loads_and_unloads_are_logged_through_vllms_logger(server):
    """An operator reads what the engine did in vLLM's own log, in vLLM's format."""
    assert load(server, "logged", STATE["dir"] / "b.safetensors").status_code == 200
    assert requests.delete(server + "/v1/steers/logged").status_code == 200
    log = (STATE["root"] / "server.log").read_text()
    assert re.search(r"^\(EngineCore[^)]*\) INFO \S+ \S+ \[management\.py:\d+\] vllm-steer: "
                     r"loaded steer 'logged' from \S+b\.safetensors \(rank 8, bank slot \d+, "
                     r"load id \d+\) in [0-9.]+ ms", log, re.M), log[-3000:]
    assert re.search(r"^\(EngineCore[^)]*\) INFO .*vllm-steer: unloaded steer 'logged'", log, re.M)


# ---- presets at run time (issue 24): POST / DELETE /v1/steer-presets -------------------------
KIND = {"detox": 4.0, "a": -2.0}  # a --steer steer and a --steer-dir one


def openai_client(url):
    """A new client each time it is used after a pause: a pooled connection left idle for
    uvicorn's 5 s keep-alive may be closed by the server as it is reused, and retries are off."""
    import openai

    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


def plain_client_text(client, model, **kw):
    """A completion with the official client and no extra_body unless given."""
    return client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0,
                                     **kw).choices[0].text


def model_cards(url, tries=8) -> list[dict]:
    """/v1/models, once per new connection (spread over the two API-server processes)."""
    return [{m.id: m.model_dump() for m in openai_client(url).models.list().data}
            for _ in range(tries)]


def test_a_preset_added_at_run_time_is_a_model_name_on_every_api_server(server):
    from helpers.reference import HFReference

    client = openai_client(server)
    want = plain_client_text(client, "tiny", extra_body={"steer": KIND})
    assert want != plain_client_text(client, "tiny")
    r = requests.post(server + "/v1/steer-presets", json={"name": "kind", "steer": KIND})
    assert r.status_code == 200, r.text
    assert r.json() == {"object": "steer_preset", "name": "kind", "steer": KIND,
                        "source": "api"}
    # from the moment POST returns, whichever API server a request reaches: the plain client
    # (no extra_body) with "model": "kind" gets the mix
    assert [plain_client_text(openai_client(server), "kind") for _ in range(8)] == [want] * 8
    msgs = [{"role": "user", "content": "Tell me about your day"}]
    chat = [openai_client(server).chat.completions.create(
        model=m, messages=msgs, max_tokens=8, temperature=0, **kw).choices[0].message.content
            for m, kw in (("kind", {}), ("tiny", {"extra_body": {"steer": KIND}}))]
    assert chat[0] == chat[1]
    # the tokens are the formula's, computed by hand on the model's weights
    out = complete(server, model="kind", logprobs=True)
    assert out.status_code == 200, out.text
    assert out.headers["x-vllm-steer-applied"] == "a=-2,detox=4"
    tokens = [int(t.split(":")[1]) for t in out.json()["choices"][0]["logprobs"]["tokens"]]
    ref = HFReference(STATE["tiny"], {"detox": load_steer(STATE["root"] / "detox.safetensors"),
                                      "a": load_steer(STATE["dir"] / "a.safetensors")})
    assert tokens == ref.greedy(PROMPT, 8, KIND)
    # listed in /v1/models like a --steer-preset preset, by every API server
    for cards in model_cards(server):
        assert set(cards) == {"tiny", "kind"}
        assert cards["kind"]["parent"] == "tiny" and cards["kind"]["steer"] == KIND
        assert cards["kind"]["root"] == cards["tiny"]["root"]
    got = requests.get(server + "/v1/steer-presets").json()
    assert got["data"] == [{"name": "kind", "steer": KIND, "source": "api"}]
    assert got["updates_enabled"] is True


def test_a_preset_replaced_at_run_time_serves_the_new_mix_on_every_api_server(server):
    """Every API server has heard of kind's old mix; after DELETE + POST through one of them,
    every request gets the new mix (an API server serving the mix it last heard of would
    answer 200 with the old tokens)."""
    for _ in range(6):  # both API servers read the table (the old mix)
        assert requests.get(server + "/v1/steer-presets").json()["data"][0]["steer"] == KIND
    new = {"detox": -4.0}
    assert requests.delete(server + "/v1/steer-presets/kind").status_code == 200
    r = requests.post(server + "/v1/steer-presets", json={"name": "kind", "steer": new})
    assert r.status_code == 200, r.text
    client = openai_client(server)
    want = plain_client_text(client, "tiny", extra_body={"steer": new})
    assert want != plain_client_text(client, "tiny", extra_body={"steer": KIND})
    assert [plain_client_text(openai_client(server), "kind") for _ in range(8)] == [want] * 8


def test_a_deleted_preset_is_vllms_404_model_error_on_every_api_server(server):
    import openai

    for _ in range(6):  # both API servers have heard of kind
        assert requests.get(server + "/v1/steer-presets").json()["data"]
    r = requests.delete(server + "/v1/steer-presets/kind")
    assert r.status_code == 200, r.text
    assert r.json() == {"object": "steer_preset", "deleted": True, "name": "kind",
                        "steer": {"detox": -4.0}, "source": "api"}
    for _ in range(8):
        with pytest.raises(openai.NotFoundError) as e:
            plain_client_text(openai_client(server), "kind")
        assert e.value.status_code == 404
        assert "The model `kind` does not exist" in str(e.value)
        s = complete(server, model="kind", stream=True)
        assert s.status_code == 404 and "The model `kind` does not exist" in s.text, s.text
    assert all(set(cards) == {"tiny"} for cards in model_cards(server))
    assert requests.get(server + "/v1/steer-presets").json()["data"] == []
    again = requests.delete(server + "/v1/steer-presets/kind")
    assert again.status_code == 404, again.text
    assert again.json()["error"]["message"] == ("preset 'kind' does not exist; presets added "
                                                "at run time: none")


@pytest.mark.parametrize("body, fragment", [
    ({"name": "tiny", "steer": {"detox": 1}},
     "preset name 'tiny' is already the served model name; give the preset another name"),
    ({"name": "x y", "steer": {"detox": 1}}, "preset name 'x y' may use only"),
    ({"name": "p", "steer": {"toxic": 1}},
     "preset 'p': unknown steer 'toxic'; loaded steers (and --steer-dir files): "),
    ({"name": "p", "steer": {"detox": 51}},
     "preset 'p': strength 51 of steer 'detox' exceeds the server's maximum |strength| 50"),
    ({"name": "p", "steer": {"detox": "strong"}},
     "preset 'p': strength 'strong' of steer 'detox' is not a number"),
    ({"name": "p", "steer": {}}, "preset 'p': \"steer\" names no steer"),
    ({"name": "p"}, "preset 'p': \"steer\" must map steer names to strengths, got None"),
    ({"name": "p", "strength": 3}, "unknown field(s) 'strength'"),
    ("not json", "the body is not JSON"),
])
def test_bad_presets_are_400_naming_the_problem_and_change_nothing(server, body, fragment):
    r = (requests.post(server + "/v1/steer-presets", json=body) if isinstance(body, dict)
         else requests.post(server + "/v1/steer-presets", data=body))
    assert r.status_code == 400, r.text
    assert fragment in r.json()["error"]["message"], r.text
    assert requests.get(server + "/v1/steer-presets").json()["data"] == []


def test_a_preset_name_cannot_be_taken_twice(server):
    assert requests.post(server + "/v1/steer-presets",
                         json={"name": "once", "steer": {"detox": 2}}).status_code == 200
    try:
        for _ in range(4):  # through either API server
            r = requests.post(server + "/v1/steer-presets",
                              json={"name": "once", "steer": {"detox": 3}})
            assert r.status_code == 400, r.text
            assert "preset name 'once' is already a preset added at run time" in \
                r.json()["error"]["message"]
        assert requests.get(server + "/v1/steer-presets").json()["data"] == [
            {"name": "once", "steer": {"detox": 2.0}, "source": "api"}]
    finally:
        assert requests.delete(server + "/v1/steer-presets/once").status_code == 200
