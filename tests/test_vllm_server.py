"""`vllm serve MODEL --steer ...` as a user runs it, driven with the OpenAI client over loopback.

One server for the module (about a minute to start on this CPU).
"""

from __future__ import annotations

import concurrent.futures as cf
import json

import pytest
import requests

from conftest import random_steer
from vllm_steer.format import save_steer
from vllm_steer.server.launch import serve

pytestmark = pytest.mark.vllm
SERVER_DIR = [None]


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    d = SERVER_DIR[0] = tmp_path_factory.mktemp("srv")
    for name, seed in (("detox", 1), ("sentiment", 2)):
        save_steer(d / f"{name}.safetensors", random_steer(64, 8, name, seed=seed, scale=3.0))
    args = [tiny_model_dir, "--served-model-name", "tiny",
            "--steer", f"detox={d / 'detox.safetensors'}",
            "--steer", d / "sentiment.safetensors",  # name taken from the file
            "--steer-max-strength", "20",
            "--dtype", "float32", "--max-model-len", "512", "--max-num-seqs", "16",
            "--kv-cache-memory-bytes", 1 << 28, "--enforce-eager"]
    # endpoint plugins are opt-in: name ours (and the general plugin) in VLLM_PLUGINS
    with serve(args, d / "server.log", env={"VLLM_PLUGINS": "vllm_steer,vllm_steer_lens"}) as url:
        yield url


@pytest.fixture(scope="module")
def client(server):
    import openai

    return openai.OpenAI(base_url=server + "/v1", api_key="unused")


def complete(client, prompt="Once upon a time", **extra):
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0,
                                  extra_body=extra or None)
    return r.choices[0].text


def test_extra_body_steer_changes_completions_and_sign_flips(client):
    plain = complete(client)
    pos, neg = complete(client, steer={"detox": 5}), complete(client, steer={"detox": -5})
    assert len({plain, pos, neg}) == 3
    assert complete(client, steer={"detox": 0}) == plain
    assert complete(client, steer={"detox": 5}) == pos  # deterministic


def test_vllm_xargs_string_form_is_equivalent(client):
    both = {"detox": 5, "sentiment": -3}
    assert complete(client, vllm_xargs={"steer": "detox:5,sentiment:-3"}) == \
        complete(client, steer=both)


def test_chat_completions_take_two_steers(client):
    def chat(**extra):
        r = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Tell me about your day"}],
            max_tokens=8, temperature=0, extra_body=extra or None)
        return r.choices[0].message.content

    plain, steered = chat(), chat(steer={"detox": 5, "sentiment": -3})
    assert plain != steered and chat(steer={"detox": 5, "sentiment": -3}) == steered


def test_concurrent_mixed_requests_match_their_solo_results(client):
    prompts = ["The city at night", "My favourite food is", "In the beginning"]
    strengths = [None, {"detox": 5}, {"sentiment": -4}, {"detox": 3, "sentiment": 3}]
    jobs = [(p, s) for p in prompts for s in strengths] * 2
    solo = {(p, json.dumps(s)): complete(client, p, **({"steer": s} if s else {}))
            for p in prompts for s in strengths}
    with cf.ThreadPoolExecutor(12) as ex:
        got = list(ex.map(lambda j: complete(client, j[0], **({"steer": j[1]} if j[1] else {})),
                          jobs))
    assert got == [solo[(p, json.dumps(s))] for p, s in jobs]


@pytest.mark.parametrize("body, fragment", [
    ({"steer": {"toxic": 1}}, "unknown steer 'toxic'; loaded steers: detox, sentiment"),
    ({"steer": {"detox": "strong"}}, "strength of steer 'detox' must be a number"),
    ({"steer": {"detox": 21}}, "exceeds the server's maximum |strength| 20"),
    ({"vllm_xargs": {"steer": "detox=5"}}, "malformed entry 'detox=5'"),
    ({"steer": {"detox": 1}, "vllm_xargs": {"steer": "detox:1"}}, "given both"),
])
def test_bad_steer_is_http_400_naming_field_and_problem(server, body, fragment):
    r = requests.post(server + "/v1/completions",
                      json={"model": "tiny", "prompt": "hi", "max_tokens": 2, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert "steer" in err["message"] and fragment in err["message"]


def test_non_finite_strength_is_400_and_server_keeps_serving(server, client):
    # JSON has no NaN literal, but Python's json (and many clients) send one
    r = requests.post(server + "/v1/completions", data='{"model": "tiny", "prompt": "hi", '
                      '"max_tokens": 2, "steer": {"detox": NaN}}',
                      headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and "must be finite" in r.text
    assert requests.get(server + "/health").status_code == 200
    assert complete(client, steer={"detox": 5}) == complete(client, steer={"detox": 5.0})


def test_openapi_schema_documents_the_steer_field(server):
    schema = requests.get(server + "/openapi.json").json()["components"]["schemas"]
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        prop = schema[name]["properties"]["steer"]
        assert "vllm-steer" in prop["description"] and "--steer" in prop["description"]


def test_highlight_route_matches_the_transformers_lens(server, tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from vllm_steer.format import load_steer
    from vllm_steer.lens.highlight import best_spans, token_scores

    text = "You are a wonderful person and I like the way you talk"
    r = requests.post(server + "/v1/steer/highlight",
                      json={"text": text, "steer": {"detox": 5}, "k": 2, "max_len": 4})
    assert r.status_code == 200, r.text
    got = r.json()
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    steer = load_steer(SERVER_DIR[0] / "detox.safetensors")
    pieces, want = token_scores(model, tok, text, steer, 5.0)
    assert got["tokens"] == pieces and "".join(got["tokens"]) == text
    assert got["scores"] == pytest.approx(want, abs=2e-3)
    spans = best_spans(want, k=2, max_len=4)
    assert [(s["start"], s["end"]) for s in got["spans"]] == [(s.start, s.end) for s in spans]
    html = requests.post(server + "/v1/steer/highlight",
                         json={"text": text, "steer": {"detox": 5}, "format": "html"})
    assert html.status_code == 200 and html.text.lstrip().lower().startswith("<!doctype html")
    bad = requests.post(server + "/v1/steer/highlight", json={"text": text, "steer": {"x": 1}})
    assert bad.status_code == 400 and "unknown steer 'x'" in bad.json()["error"]["message"]


def test_steer_updates_are_off_by_default_and_the_list_is_on(server):
    listing = requests.get(server + "/v1/steers").json()
    assert sorted(s["name"] for s in listing["data"]) == ["detox", "sentiment"]
    assert listing["updates_enabled"] is False
    path = str(SERVER_DIR[0] / "detox.safetensors")
    for r in (requests.post(server + "/v1/steers", json={"name": "x", "path": path}),
              requests.delete(server + "/v1/steers/detox")):
        assert r.status_code == 403 and "--enable-steer-updates" in r.json()["error"]["message"]
    assert sorted(s["name"] for s in requests.get(server + "/v1/steers").json()["data"]) == \
        ["detox", "sentiment"]
