"""Presets served as model names, operator defaults and floors, on a real `vllm serve`
driven with the official `openai` client (issue 24). One server for the module.

The server: steers detox, sentiment, formal; `--steer-preset polite=detox:4,sentiment:2`,
`--steer-default formal=2`, `--steer-floor sentiment=-1` (precedence: docs/serving.md,
"Presets, defaults and floors"). Correctness against `helpers.reference.HFReference` (the formula by
hand on the model's own weights in transformers)."""

from __future__ import annotations

import pytest
import requests

from helpers.reference import HFReference
from helpers.steers import random_steer, save_steers

pytestmark = pytest.mark.vllm
N = 8
PROMPT = "Once upon a time"
POLITE = {"detox": 4.0, "sentiment": 2.0}
DEFAULT = {"formal": 2.0}
STEERS = {}


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    from vllm_steer.server.launch import serve

    d = tmp_path_factory.mktemp("presets")
    STEERS.update({name: random_steer(64, 8, name, seed=seed, scale=3.0)
                   for name, seed in (("detox", 1), ("sentiment", 2), ("formal", 3))})
    paths = save_steers(d, STEERS)
    args = [tiny_model_dir, "--served-model-name", "tiny",
            *[a for n, p in paths.items() for a in ("--steer", f"{n}={p}")],
            "--steer-preset", "polite=detox:4,sentiment:2",
            "--steer-default", "formal=2", "--steer-floor", "sentiment=-1",
            "--steer-max-strength", "20",
            "--dtype", "float32", "--max-model-len", "512", "--max-num-seqs", "16",
            "--kv-cache-memory-bytes", 1 << 28, "--enforce-eager"]
    # the lens route too (an endpoint plugin: opt-in), for the highlight against defaults
    with serve(args, d / "server.log", env={"VLLM_PLUGINS": "vllm_steer,vllm_steer_lens"}) as url:
        yield url


@pytest.fixture(scope="module")
def client(server):
    import openai

    return openai.OpenAI(base_url=server + "/v1", api_key="unused")


@pytest.fixture(scope="module")
def ref(server, tiny_model_dir):
    return HFReference(tiny_model_dir, STEERS)


def raw(server, **body):
    """A completion over plain HTTP: (choice, response headers)."""
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": N, "temperature": 0,
            "return_token_ids": True, **body}
    r = requests.post(server + "/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0], r.headers


def test_presets_are_listed_in_v1_models(client):
    cards = {m.id: m for m in client.models.list().data}
    assert set(cards) == {"tiny", "polite"}
    polite = cards["polite"].model_dump()
    assert polite["parent"] == "tiny" and polite["root"] == cards["tiny"].root
    assert polite["steer"] == POLITE


def test_preset_model_name_with_the_plain_client_equals_the_mix(server, client, ref):
    # the official client, no extra_body at all
    by_name = client.completions.create(model="polite", prompt=PROMPT, max_tokens=N,
                                        temperature=0).choices[0].text
    by_body = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=N,
                                        temperature=0, extra_body={"steer": POLITE}
                                        ).choices[0].text
    plain = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=N,
                                      temperature=0).choices[0].text
    assert by_name == by_body != plain
    # the tokens are the formula's (the default formal=2 applies too: the preset does not
    # name it)
    choice, headers = raw(server, model="polite")
    assert choice["text"] == by_name
    assert choice["token_ids"] == ref.greedy(choice["prompt_token_ids"], N,
                                             {**POLITE, **DEFAULT})
    assert headers["x-vllm-steer-applied"] == "detox=4,formal=2,sentiment=2"
    assert "x-vllm-steer-floored" not in headers


def test_preset_in_chat_with_the_plain_client(client):
    msgs = [{"role": "user", "content": "Tell me about your day"}]

    def chat(model, **kw):
        return client.chat.completions.create(model=model, messages=msgs, max_tokens=N,
                                              temperature=0, **kw).choices[0].message.content

    assert chat("polite") == chat("tiny", extra_body={"steer": POLITE}) != chat("tiny")


def test_a_request_steer_replaces_the_presets_value_of_that_steer(server, client, ref):
    got = client.completions.create(model="polite", prompt=PROMPT, max_tokens=N, temperature=0,
                                    extra_body={"steer": {"detox": -2}}).choices[0].text
    want = {"detox": -2.0, "sentiment": 2.0}
    assert got == client.completions.create(model="tiny", prompt=PROMPT, max_tokens=N,
                                            temperature=0, extra_body={"steer": want}
                                            ).choices[0].text
    choice, headers = raw(server, model="polite", steer={"detox": -2})
    assert choice["token_ids"] == ref.greedy(choice["prompt_token_ids"], N, {**want, **DEFAULT})
    assert choice["token_ids"] != raw(server, model="polite")[0]["token_ids"]
    assert headers["x-vllm-steer-applied"] == "detox=-2,formal=2,sentiment=2"


def test_unknown_model_name_is_vllms_404(client):
    import openai

    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="impolite", prompt=PROMPT, max_tokens=2)
    assert e.value.status_code == 404
    assert "The model `impolite` does not exist" in str(e.value)


def test_a_default_applies_unless_the_request_names_the_steer(server, ref):
    plain, headers = raw(server)
    assert plain["token_ids"] == ref.greedy(plain["prompt_token_ids"], N, DEFAULT)
    assert headers["x-vllm-steer-applied"] == "formal=2"
    off, headers = raw(server, steer={"formal": 0})  # overridden with 0: the plain model
    assert off["token_ids"] == ref.greedy(off["prompt_token_ids"], N, {})
    assert off["token_ids"] != plain["token_ids"]
    assert "x-vllm-steer-applied" not in headers
    other, _ = raw(server, steer={"formal": 5})
    assert other["token_ids"] == ref.greedy(other["prompt_token_ids"], N, {"formal": 5})


def test_a_floor_raises_a_request_below_it_and_the_header_says_so(server, ref):
    low, headers = raw(server, steer={"sentiment": -6, "formal": 0})
    assert low["token_ids"] == ref.greedy(low["prompt_token_ids"], N, {"sentiment": -1})
    assert low["token_ids"] != ref.greedy(low["prompt_token_ids"], N, {"sentiment": -6})
    assert headers["x-vllm-steer-floored"] == "sentiment"
    assert headers["x-vllm-steer-applied"] == "sentiment=-1"
    # streaming: the same headers, the same tokens
    r = requests.post(server + "/v1/completions", stream=True, json={
        "model": "tiny", "prompt": PROMPT, "max_tokens": N, "temperature": 0, "stream": True,
        "steer": {"sentiment": -6, "formal": 0}})
    assert r.status_code == 200
    assert r.headers["x-vllm-steer-floored"] == "sentiment"
    text = "".join(__import__("json").loads(line[6:])["choices"][0]["text"]
                   for line in r.iter_lines(decode_unicode=True)
                   if line.startswith("data: {"))
    assert text == low["text"]
    # at or above the floor: served as asked, not floored
    fine, headers = raw(server, steer={"sentiment": -1, "formal": 0})
    assert fine["token_ids"] == low["token_ids"] and "x-vllm-steer-floored" not in headers


def test_steer_presets_route_lists_presets_defaults_and_floors(server):
    got = requests.get(server + "/v1/steer-presets").json()
    assert got["data"] == [{"name": "polite", "steer": POLITE, "source": "--steer-preset"}]
    assert got["defaults"] == DEFAULT and got["floors"] == {"sentiment": -1.0}
    assert got["updates_enabled"] is False


def test_presets_cannot_be_added_or_deleted_without_enable_steer_updates(server, client):
    """(Presets at run time are tested on the --enable-steer-updates server of
    test_vllm_steer_updates.py.)"""
    for r in (requests.post(server + "/v1/steer-presets",
                            json={"name": "kind", "steer": {"detox": 1}}),
              requests.delete(server + "/v1/steer-presets/polite")):
        assert r.status_code == 403, r.text
        assert "--enable-steer-updates" in r.json()["error"]["message"]
        assert r.json()["error"]["type"] == "PermissionError"
    assert {m.id for m in client.models.list().data} == {"tiny", "polite"}
    assert [p["name"] for p in requests.get(server + "/v1/steer-presets").json()["data"]] == \
        ["polite"]


@pytest.mark.parametrize("body, fragment", [
    ({"model": "polite"}, "the preset 'polite' (detox=4,sentiment=2) cannot be served with "
                          "beam search"),
    ({"steer": {"formal": 0}}, "beam search (use_beam_search) serves only the server's "
                               "defaults and floors (formal=2), not the request's formal=0"),
])
def test_beam_search_refuses_a_preset_or_a_value_replacing_a_default(server, body, fragment):
    """vLLM's beam search serves every step with the defaults and floors alone: a preset's
    steers, or a 0 that opts out of a default, would be dropped silently. Refused, for
    completions and chat; a beam search the defaults serve as asked still runs."""
    r = requests.post(server + "/v1/completions", json={
        "model": "tiny", "prompt": PROMPT, "max_tokens": 2, "use_beam_search": True, "n": 2,
        **body})
    assert r.status_code == 400 and fragment in r.json()["error"]["message"], r.text
    assert "x-vllm-steer-applied" not in r.headers
    chat = requests.post(server + "/v1/chat/completions", json={
        "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
        "use_beam_search": True, "n": 2, **body})
    assert chat.status_code == 400 and fragment in chat.json()["error"]["message"], chat.text
    for same in ({}, {"steer": {"formal": 2}}, {"steer": {"detox": 0}}):
        ok = requests.post(server + "/v1/completions", json={
            "model": "tiny", "prompt": PROMPT, "max_tokens": 2, "use_beam_search": True,
            "n": 2, **same})
        assert ok.status_code == 200, (same, ok.text)


def test_the_highlight_compares_against_the_plain_model_whatever_the_defaults(server,
                                                                              tiny_model_dir):
    """``--steer-default formal=2`` is for generation requests: a highlight of ``detox=5``
    is the steered model against the plain one (transformers' lens on the same steer), not
    both with ``formal`` added."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from vllm_steer.lens.highlight import token_scores

    text = "You are a wonderful person and I like the way you talk"
    r = requests.post(server + "/v1/steer/highlight",
                      json={"text": text, "steer": {"detox": 5}, "k": 2, "max_len": 4})
    assert r.status_code == 200, r.text
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    pieces, want = token_scores(model, tok, text, STEERS["detox"], 5.0)
    got = r.json()
    assert got["tokens"] == pieces
    assert got["scores"] == pytest.approx(want, abs=2e-3)
    assert "x-vllm-steer-applied" not in r.headers
