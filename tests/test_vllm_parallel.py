"""Several API servers and data-parallel engines: `vllm serve --data-parallel-size 2
--api-server-count 2` (the defaults of DP 2 too) as an operator runs it.

Each API server is a spawned process that builds its engine arguments from the parsed command
line *before* vLLM loads plugins there; the steer configuration must reach it anyway, or it
validates nothing and one bad request kills an engine. One server for the module (slow to
start: four processes import vLLM on this CPU).
"""

from __future__ import annotations

import concurrent.futures as cf

import pytest
import requests
import torch

from conftest import random_steer
from vllm_steer.format import load_steer, save_steer
from vllm_steer.server.launch import serve

pytestmark = pytest.mark.vllm
MAX_TOKENS = 6
PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def dp_server(tiny_model_dir, tmp_path_factory):
    d = tmp_path_factory.mktemp("dp")
    save_steer(d / "detox.safetensors", random_steer(64, 8, "detox", seed=1, scale=3.0))
    args = [tiny_model_dir, "--served-model-name", "tiny",
            "--steer", f"detox={d / 'detox.safetensors'}", "--steer-max-strength", "20",
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
    ({"nope": 1}, "unknown steer 'nope'; loaded steers: detox"),
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
