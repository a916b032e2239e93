"""Several API servers and data-parallel engines: `vllm serve --data-parallel-size 2
--api-server-count 2` (the defaults of DP 2 too) as an operator runs it.

Each API server is a spawned process that builds its engine arguments from the parsed command
line *before* vLLM loads plugins there; the steer configuration must reach it anyway, or it
validates nothing and one bad request kills an engine. Run-time steers (``--steer-dir``,
``--enable-steer-updates``) must reach both engine cores (issue 23). One server for the
module (slow to start: four processes import vLLM on this CPU).
"""

from __future__ import annotations

import concurrent.futures as cf

import pytest
import requests
import torch

from helpers.steers import random_steer
from vllm_steer.format import load_steer, save_steer
from vllm_steer.server.launch import serve

pytestmark = pytest.mark.vllm
MAX_TOKENS = 6
PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def dp_server(tiny_model_dir, tmp_path_factory):
    d = tmp_path_factory.mktemp("dp")
    save_steer(d / "detox.safetensors", random_steer(64, 8, "detox", seed=1, scale=3.0))
    (d / "dir").mkdir()  # run-time steers (issue 23): --steer-dir and --enable-steer-updates
    save_steer(d / "dir" / "first.safetensors", random_steer(64, 8, "first", seed=2, scale=3.0))
    save_steer(d / "dir" / "posted.safetensors", random_steer(64, 8, "p", seed=3, scale=3.0))
    args = [tiny_model_dir, "--served-model-name", "tiny",
            "--steer", f"detox={d / 'detox.safetensors'}", "--steer-max-strength", "20",
            "--steer-dir", d / "dir", "--enable-steer-updates", "--max-steers", "4",
            "--data-parallel-size", "2", "--api-server-count", "2",
            "--dtype", "float32", "--max-model-len", "256", "--max-num-seqs", "4",
            "--kv-cache-memory-bytes", 1 << 27, "--enforce-eager"]
    with serve(args, d / "server.log") as url:
        yield url, d


def _complete(url, **extra):
    return requests.post(url + "/v1/completions", json={
        "model": "tiny", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0,
        "return_token_ids": True, **extra}, timeout=120)


@pytest.mark.parametrize("steer, fragment", [
    ({"nope": 1}, "unknown steer 'nope': not loaded (loaded: detox) and no file "
                  "nope.safetensors in --steer-dir"),
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


def _listings(url, tries=24) -> dict:
    """pid of the answering API server -> its GET /v1/steers answer (new connections)."""
    seen = {}
    for _ in range(tries):
        r = requests.get(url + "/v1/steers")
        assert r.status_code == 200, r.text
        seen[r.json()["api_server"]["pid"]] = r.json()
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
    for pid, listing in _listings(url).items():  # the same answer from every API server
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
