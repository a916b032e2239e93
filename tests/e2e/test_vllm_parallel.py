"""Several API servers and data-parallel engines: `vllm serve --data-parallel-size 2
--api-server-count 2` (the defaults of DP 2 too) as an operator runs it.

Each API server is a spawned process that builds its engine arguments from the parsed command
line *before* vLLM loads plugins there; the steer configuration must reach it anyway, or it
validates nothing and one bad request kills an engine. Run-time steers (``--steer-dir``,
``--enable-steer-updates``) must reach both engine cores (issue 23). The steer metrics on
``/metrics`` count each request once across both API servers and engine cores. One server for
the module (slow to start: four processes import vLLM on this CPU), started as on a host:
``vllm serve`` spawns its engine cores, so that what reaches them is what they are sent, not
what they would inherit from the process that parsed the command line.
"""

from __future__ import annotations

import concurrent.futures as cf
import shutil
import subprocess
import time

import pytest
import requests
import torch
from prometheus_client.parser import text_string_to_metric_families

from helpers.engines import serve_spawns_engines
from helpers.steers import random_steer, random_vectors, save_vector_steer
from vllm_steer.format import load_steer, save_steer
from vllm_steer.server.launch import serve

pytestmark = pytest.mark.vllm
MAX_TOKENS = 6
PROMPT = "Once upon a time"
CALM = random_vectors(64, [1], seed=22)  # a control vector, in --steer-dir as calm.gguf


@pytest.fixture(scope="module")
def dp_server(tiny_model_dir, tmp_path_factory):
    d = tmp_path_factory.mktemp("dp")
    save_steer(d / "detox.safetensors", random_steer(64, 8, "detox", seed=1, scale=3.0))
    (d / "dir").mkdir()  # run-time steers (issue 23): --steer-dir and --enable-steer-updates
    save_steer(d / "dir" / "first.safetensors", random_steer(64, 8, "first", seed=2, scale=3.0))
    save_steer(d / "dir" / "posted.safetensors", random_steer(64, 8, "p", seed=3, scale=3.0))
    save_vector_steer(d / "dir" / "calm.gguf", CALM, "calm")
    args = [tiny_model_dir, "--served-model-name", "tiny",
            "--steer", f"detox={d / 'detox.safetensors'}", "--steer-max-strength", "20",
            "--steer-dir", d / "dir", "--enable-steer-updates", "--max-steers", "5",
            "--steer-vectors",
            "--data-parallel-size", "2", "--api-server-count", "2",
            "--dtype", "float32", "--max-model-len", "256", "--max-num-seqs", "4",
            "--kv-cache-memory-bytes", 1 << 27, "--enforce-eager"]
    with pytest.MonkeyPatch.context() as mp:  # engine cores spawned, as on a host: what
        serve_spawns_engines(mp)  # reaches them is what they are sent, nothing inherited
        with serve(args, d / "server.log") as url:
            yield url, d


def _complete(url, **extra):
    return requests.post(url + "/v1/completions", json={
        "model": "tiny", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0,
        "return_token_ids": True, **extra}, timeout=120)


@pytest.mark.parametrize("steer, fragment", [
    ({"nope": 1}, "unknown steer 'nope': not loaded (loaded: detox) and no file "
                  "nope.safetensors or nope.gguf in --steer-dir"),
    ({"detox": 21}, "exceeds the server's maximum |strength| 20"),
])
def test_bad_steer_is_400_from_every_api_server_and_the_engines_survive(dp_server, steer,
                                                                         fragment):
    url, d = dp_server
    with cf.ThreadPoolExecutor(8) as ex:
        rs = list(ex.map(lambda _: _complete(url, steer=steer), range(24)))
    # 24 fresh connections: the kernel spreads them over the two API servers (SO_REUSEPORT;
    # all on one: 2**-23). The message names the loaded steers, which an API server that did
    # not get the configuration cannot know ("this server has no steers loaded").
    for r in rs:
        assert r.status_code == 400, r.text
        assert fragment in r.json()["error"]["message"]
    assert requests.get(url + "/health").status_code == 200
    assert _complete(url).status_code == 200


def test_good_steer_steers_on_every_engine(dp_server, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    url, d = dp_server
    with cf.ThreadPoolExecutor(8) as ex:
        steered = list(ex.map(lambda _: _complete(url, steer={"detox": 5}), range(12)))
        plain = list(ex.map(lambda _: _complete(url), range(4)))
    assert all(r.status_code == 200 for r in steered + plain)
    choice = steered[0].json()["choices"][0]
    toks = [r.json()["choices"][0]["token_ids"] for r in steered]
    assert all(t == toks[0] for t in toks)
    assert toks[0] != plain[0].json()["choices"][0]["token_ids"]
    # greedy tokens = argmax of lm_head(c + 5 eps (c P1) P2^T), by hand on the model's weights
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    steer = load_steer(d / "detox.safetensors")
    ids = choice["prompt_token_ids"] + toks[0]
    with torch.no_grad():
        c = model.model(torch.tensor([ids])).last_hidden_state[0]
        c = c + 5 * steer.metadata.epsilon * (c @ steer.p1) @ steer.p2.T
        want = model.lm_head(c).argmax(-1).tolist()
    n = len(choice["prompt_token_ids"])
    assert toks[0] == want[n - 1:n - 1 + MAX_TOKENS]


# ---- run-time steers with data parallelism (issue 23) ---------------------------------------
def _spread(url, n=16, **extra):
    """``n`` concurrent requests (the load balancer spreads them over both engine cores)."""
    with cf.ThreadPoolExecutor(8) as ex:
        return list(ex.map(lambda _: _complete(url, **extra), range(n)))


def _listings(url, rounds=6, width=8) -> dict:
    """pid of the answering API server -> its GET /v1/steers answer (new connections, ``width``
    at a time: the API servers share one listening socket, and an idle one could otherwise
    accept every connection made one after another)."""
    seen = {}

    def get(_):
        r = requests.get(url + "/v1/steers")
        assert r.status_code == 200, r.text
        return r.json()

    with cf.ThreadPoolExecutor(width) as ex:
        for _ in range(rounds):
            for answer in ex.map(get, range(width)):
                seen[answer["api_server"]["pid"]] = answer
            if len(seen) == 2:
                break
    assert len(seen) == 2, "GETs reached one API-server process only"
    return seen


def _steered_tokens_match_reference(rs, model_dir, steer_path, strength):
    from helpers.reference import HFReference

    assert all(r.status_code == 200 for r in rs), [r.text for r in rs if r.status_code != 200]
    ref = HFReference(model_dir, {"s": load_steer(steer_path)})
    choice = rs[0].json()["choices"][0]
    want = ref.greedy(choice["prompt_token_ids"], MAX_TOKENS, {"s": strength})
    assert want != ref.greedy(choice["prompt_token_ids"], MAX_TOKENS)  # the steer matters
    assert [r.json()["choices"][0]["token_ids"] for r in rs] == [want] * len(rs)


def _served_per_engine(url, name) -> dict:
    entry = {s["name"]: s for s in requests.get(url + "/v1/steers").json()["data"]}[name]
    return {p["engine"]: p["requests_served"] for p in entry["per_engine"]}


def test_run_time_load_steers_on_both_engines_and_unload_reaches_both(dp_server,
                                                                      tiny_model_dir):
    url, d = dp_server
    # a name with no file of its own in --steer-dir: once unloaded, nothing loads it again
    r = requests.post(url + "/v1/steers",
                      json={"name": "run", "path": str(d / "dir" / "posted.safetensors")})
    assert r.status_code == 200, r.text
    assert sorted(p["engine"] for p in r.json()["per_engine"]) == [0, 1]
    rs = _spread(url, steer={"run": 5})
    _steered_tokens_match_reference(rs, tiny_model_dir, d / "dir" / "posted.safetensors", 5)
    served = _served_per_engine(url, "run")
    assert sorted(served) == [0, 1] and all(n > 0 for n in served.values()), served
    for _pid, listing in _listings(url).items():  # the same answer from every API server
        run = {s["name"]: s for s in listing["data"]}["run"]
        assert run["state"] == "loaded" and len(run["per_engine"]) == 2, listing
        assert {s["name"] for s in listing["data"]} >= {"detox", "run"}
    assert requests.delete(url + "/v1/steers/run").status_code == 200
    for r in _spread(url, steer={"run": 5}):  # unknown on every API server and engine
        assert r.status_code == 400, r.text
        assert "unknown steer 'run'" in r.json()["error"]["message"]
    for listing in _listings(url).values():
        assert "run" not in {s["name"] for s in listing["data"]}, listing
    assert requests.delete(url + "/v1/steers/run").status_code == 404


def test_steer_dir_first_use_loads_on_both_engines(dp_server, tiny_model_dir):
    url, d = dp_server
    rs = _spread(url, steer={"first": -4})
    _steered_tokens_match_reference(rs, tiny_model_dir, d / "dir" / "first.safetensors", -4)
    served = _served_per_engine(url, "first")
    assert sorted(served) == [0, 1] and all(n > 0 for n in served.values()), served
    for listing in _listings(url).values():
        first = {s["name"]: s for s in listing["data"]}["first"]
        assert (first["source"], first["state"]) == ("steer-dir", "loaded"), first


def test_a_run_time_preset_is_served_by_every_api_server_and_engine(dp_server):
    """Presets at run time (issue 24) with data parallelism: the table is in every engine
    core (engine core 0's is read); each request naming the preset gets the mix."""
    url, _ = dp_server
    mix = {"detox": 5.0}
    r = requests.post(url + "/v1/steer-presets", json={"name": "dp-kind", "steer": mix})
    assert r.status_code == 200, r.text
    try:
        with cf.ThreadPoolExecutor(8) as ex:
            by_name = list(ex.map(lambda _: _complete(url, model="dp-kind"), range(12)))
        want = _complete(url, steer=mix).json()["choices"][0]["token_ids"]
        assert want != _complete(url).json()["choices"][0]["token_ids"]
        assert [r.json()["choices"][0]["token_ids"] if r.status_code == 200 else r.text
                for r in by_name] == [want] * 12
        assert {m["id"] for m in requests.get(url + "/v1/models").json()["data"]} == \
            {"tiny", "dp-kind"}
    finally:
        assert requests.delete(url + "/v1/steer-presets/dp-kind").status_code == 200
    for _ in range(8):
        r = _complete(url, model="dp-kind")
        assert r.status_code == 404 and "The model `dp-kind` does not exist" in r.text, r.text


# ---- /metrics: typed for Prometheus, each request counted once ------------------------------
COUNTERS = ("vllm_steer:requests_steered_total", "vllm_steer:steer_loads_total",
            "vllm_steer:steer_unloads_total", "vllm_steer:steer_evictions_total",
            "vllm_steer:steer_load_failures_total", "vllm_steer:steer_op_seconds_total",
            "vllm_steer:steer_op_host_seconds_total", "vllm_steer:steer_op_calls_total")


def _scrape(url) -> tuple[str, dict]:
    """``/metrics``: its text and {name as exposed (a counter with ``_total``): family}."""
    r = requests.get(url + "/metrics", timeout=30)
    assert r.status_code == 200, r.text
    fams = {f.name + "_total" if f.type == "counter" else f.name: f
            for f in text_string_to_metric_families(r.text)}
    return r.text, fams


def _samples(fams, name) -> dict:
    return {tuple(sorted(s.labels.items())): s.value
            for s in (fams[name].samples if name in fams else ()) if s.name == name}


def _detox_counted(url) -> tuple[dict, dict, str]:
    """Wait until ``vllm_steer:requests_steered_total{steer="detox"}`` per engine equals what
    each engine core served (GET /v1/steers); the scrape then, and the text."""
    deadline = time.time() + 20
    while True:
        served = {str(e): n for e, n in _served_per_engine(url, "detox").items() if n}
        text, fams = _scrape(url)
        counted = {dict(k)["engine"]: v for k, v in
                   _samples(fams, "vllm_steer:requests_steered_total").items()
                   if dict(k)["steer"] == "detox"}
        if counted == served:
            return fams, served, text
        # twice the engine's count would be each API server counting every request
        assert time.time() < deadline, f"counted {counted}, engine cores served {served}"
        time.sleep(0.5)


def test_metrics_are_typed_and_each_request_counts_once(dp_server):
    url, d = dp_server
    before, served0, _ = _detox_counted(url)
    rs = _spread(url, n=12, steer={"detox": 5})
    assert all(r.status_code == 200 for r in rs), [r.text for r in rs if r.status_code != 200]
    (d / "dir" / "broken.safetensors").write_bytes(b"not a steer file")
    r = requests.post(url + "/v1/steers", json={"name": "broken"})  # refused: a bad file
    assert r.status_code == 400, r.text
    after, served, text = _detox_counted(url)
    steer_fams = {n: f for n, f in after.items() if n.startswith("vllm_steer:")}
    for name, f in steer_fams.items():
        assert f.documentation, f"{name}: no HELP"
        assert f.type in ("counter", "gauge"), f"{name}: TYPE {f.type}"
        assert (f.type == "counter") == name.endswith("_total"), (name, f.type)
    assert set(COUNTERS) <= set(steer_fams), sorted(steer_fams)
    assert after["vllm_steer:loaded_steers"].type == "gauge"
    assert after["vllm_steer:max_steers"].samples[0].value == 5
    # 12 requests, each counted once (two API servers, two engine cores), on both engines
    assert sum(served.values()) - sum(served0.values()) == 12
    assert set(served) == {"0", "1"}
    for name in COUNTERS:  # counters only go up between two scrapes
        old = _samples(before, name)
        new = _samples(after, name)
        assert set(old) <= set(new), name
        assert all(new[k] >= v for k, v in old.items()), (name, old, new)
    fail = lambda fams: {dict(k)["engine"]: v for k, v in  # noqa: E731
                         _samples(fams, "vllm_steer:steer_load_failures_total").items()}
    assert {e: n - fail(before).get(e, 0) for e, n in fail(after).items()} == \
        {"0": 1, "1": 1}  # the bad file, refused by each engine core once
    calls = _samples(after, "vllm_steer:steer_op_calls_total")
    device = _samples(after, "vllm_steer:steer_op_seconds_total")
    host = _samples(after, "vllm_steer:steer_op_host_seconds_total")
    assert all(calls[k] > _samples(before, "vllm_steer:steer_op_calls_total").get(k, 0)
               for k in calls) and len(calls) == 2
    assert all(device[k] > 0 and device[k] == pytest.approx(host[k]) for k in calls)  # CPU


@pytest.mark.skipif(shutil.which("promtool") is None,
                    reason="promtool is not installed (scripts/install.sh installs Debian's)")
def test_promtool_accepts_the_steer_metrics(dp_server):
    url, _ = dp_server
    text, _ = _scrape(url)
    ours = "\n".join(line for line in text.splitlines() if "vllm_steer:" in line) + "\n"
    res = subprocess.run(["promtool", "check", "metrics"], input=ours, text=True,
                         capture_output=True, timeout=60)
    # the one complaint left is the ':' in every vLLM metric name (vllm:..., vllm_steer:...)
    problems = [p for p in (res.stdout + res.stderr).splitlines()
                if p.strip() and not p.endswith("metric names should not contain ':'")]
    assert res.returncode in (0, 3) and problems == [], (res.returncode, problems)


def test_a_control_vector_in_the_steer_dir_steers_on_both_engines(dp_server, tiny_model_dir):
    """``--steer-vectors`` with data parallelism: ``calm.gguf`` found in ``--steer-dir`` at its
    first use, loaded into both engine cores, and every engine's answer is the model's with
    the vector added by forward hooks."""
    from helpers.reference import HFReference

    url, _ = dp_server
    rs = _spread(url, steer={"calm": 1.0})
    toks = {tuple(r.json()["choices"][0]["token_ids"]) for r in rs}
    assert len(toks) == 1
    choice = rs[0].json()["choices"][0]
    ref = HFReference(tiny_model_dir, {}, vectors={"calm": CALM})
    want = ref.greedy(choice["prompt_token_ids"], MAX_TOKENS, {"calm": 1.0})
    assert list(toks.pop()) == want != ref.greedy(choice["prompt_token_ids"], MAX_TOKENS)
    listing = requests.get(url + "/v1/steers").json()["data"]
    assert {s["name"]: s["kind"] for s in listing}["calm"] == "vector"
