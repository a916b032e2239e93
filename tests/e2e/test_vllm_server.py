"""`vllm serve MODEL --steer ...` as a user runs it, driven with the OpenAI client over loopback.

One server for the module (about a minute to start on this CPU).
"""

from __future__ import annotations

import concurrent.futures as cf
import json

import pytest
import requests

from helpers.reference import HFReference
from helpers.steers import random_steer, random_vectors, save_vector_steer
from vllm_steer.format import save_steer
from vllm_steer.server.launch import serve

pytestmark = pytest.mark.vllm
SERVER_DIR = [None]
CALM = random_vectors(64, [1], seed=21)  # a control vector at block 1 (llama.cpp's GGUF)


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    d = SERVER_DIR[0] = tmp_path_factory.mktemp("srv")
    for name, seed in (("detox", 1), ("sentiment", 2)):
        save_steer(d / f"{name}.safetensors", random_steer(64, 8, name, seed=seed, scale=3.0))
    save_vector_steer(d / "calm.gguf", CALM, "calm")
    args = [tiny_model_dir, "--served-model-name", "tiny",
            "--steer", f"detox={d / 'detox.safetensors'}",
            "--steer", f"calm={d / 'calm.gguf'}",
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


def test_anthropic_messages_take_the_steer_as_chat_completions_do(server):
    """``/v1/messages`` (vLLM's Anthropic Messages API) is served as a chat completion: its
    ``steer`` (the field or ``vllm_xargs``) reaches it, with the same tokens as the same steer
    on ``/v1/chat/completions``; a bad one is a 400 naming it, not dropped."""
    messages = [{"role": "user", "content": "Tell me about your day"}]

    def post(route, **extra):
        body = {"model": "tiny", "messages": messages, "max_tokens": 8, "temperature": 0,
                **extra}
        return requests.post(server + route, json=body, timeout=60)

    def anthropic(**extra):
        r = post("/v1/messages", **extra)
        assert r.status_code == 200, r.text
        return "".join(b.get("text", "") for b in r.json()["content"]), r.headers

    def chat(**extra):
        r = post("/v1/chat/completions", **extra)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["message"]["content"]

    plain, _ = anthropic()
    steered, headers = anthropic(steer={"detox": 5, "sentiment": -3})
    assert plain == chat() and steered == chat(steer={"detox": 5, "sentiment": -3})
    assert steered != plain
    assert headers["x-vllm-steer-applied"] == "detox=5,sentiment=-3"
    assert anthropic(vllm_xargs={"steer": "detox:5,sentiment:-3"})[0] == steered
    r = post("/v1/messages", steer={"toxic": 1})
    assert r.status_code == 400 and "unknown steer 'toxic'" in r.text, r.text


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
    ({"steer": {"toxic": 1}}, "unknown steer 'toxic'; loaded steers: calm, detox, sentiment"),
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


# ---- sampling features with a steer: each works (checked against a hand computation) or is
# refused with HTTP 400 naming the reason -----------------------------------------------------
@pytest.fixture(scope="module")
def ref_model(tiny_model_dir):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def _raw(server, **body):
    body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0,
            "return_token_ids": True, **body}
    return requests.post(server + "/v1/completions", json=body)


def _ok(server, **body):
    r = _raw(server, **body)
    assert r.status_code == 200, r.text
    return r.json()["choices"]


def reference_greedy(model, prompt_ids, n, strength=0.0, adjust=None):
    """Greedy tokens of the tiny model with the detox steer applied by hand
    (``c + s eps (c P1) P2^T`` before the LM head); ``adjust(logits, out)`` edits the logits
    of each step like a sampling feature does."""
    import torch

    from vllm_steer.format import load_steer

    steer = load_steer(SERVER_DIR[0] / "detox.safetensors")
    ids, out = list(prompt_ids), []
    for _ in range(n):
        with torch.no_grad():
            c = model.model(torch.tensor([ids])).last_hidden_state[0, -1]
            c = c + strength * steer.metadata.epsilon * (c @ steer.p1) @ steer.p2.T
            logits = model.lm_head(c).float()
        if adjust is not None:
            logits = adjust(logits, out)
        t = int(logits.argmax())
        out.append(t)
        ids.append(t)
    return out


@pytest.mark.parametrize("body, fragment", [
    ({"steer": {"detox": 5}}, "beam search (use_beam_search) cannot be steered"),
    ({"vllm_xargs": {"steer": "detox:5"}}, "beam search (use_beam_search) cannot be steered"),
    ({"steer": {"nope": 1}}, "unknown steer 'nope'"),
    ({"steer": {"detox": "x"}}, "must be a number"),
])
def test_beam_search_with_a_steer_is_refused_naming_the_reason(server, body, fragment):
    r = _raw(server, use_beam_search=True, n=2, **body)
    assert r.status_code == 400, r.text
    assert fragment in r.json()["error"]["message"]
    chat = requests.post(server + "/v1/chat/completions", json={
        "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
        "use_beam_search": True, "n": 2, **body})
    assert chat.status_code == 400 and fragment in chat.json()["error"]["message"]
    # beam search itself, and a zero steer (nothing to steer), still work
    assert _raw(server, use_beam_search=True, n=2).status_code == 200
    assert _raw(server, use_beam_search=True, n=2, steer={"detox": 0}).status_code == 200
    zero_window = {"detox": {"strength": 0, "start": 2}}  # 0 inside and outside its window
    assert _raw(server, use_beam_search=True, n=2, steer=zero_window).status_code == 200


def test_n_greater_than_one_steers_every_choice(server, ref_model):
    one = _ok(server, steer={"detox": 5})[0]
    want = reference_greedy(ref_model, one["prompt_token_ids"], 8, strength=5)
    assert one["token_ids"] == want != _ok(server)[0]["token_ids"]
    # vLLM refuses n > 1 with greedy sampling; top_k=1 samples the argmax
    many = _ok(server, steer={"detox": 5}, n=3, temperature=1.0, top_k=1)
    assert [c["token_ids"] for c in many] == [want] * 3


@pytest.mark.parametrize("kind", ["choice", "regex"])
def test_structured_output_is_decoded_from_the_steered_logits(server, kind):
    import re as _re

    plain = _ok(server, max_tokens=8)[0]["text"]
    steered = _ok(server, max_tokens=8, steer={"detox": 5})[0]["text"]
    assert plain != steered
    options = [plain, steered]
    so = {"choice": options} if kind == "choice" else \
        {"regex": "|".join(f"({_re.escape(o)})" for o in options)}
    # greedy under the constraint follows the (steered or plain) argmax: each picks its own
    assert _ok(server, max_tokens=16, structured_outputs=so)[0]["text"] == plain
    assert _ok(server, max_tokens=16, structured_outputs=so,
               steer={"detox": 5})[0]["text"] == steered


def test_stop_strings_cut_the_steered_text(server):
    steered = _ok(server, steer={"detox": 5})[0]["text"]
    stop = steered[len(steered) // 2:len(steered) // 2 + 3]
    got = _ok(server, steer={"detox": 5}, stop=[stop])[0]
    assert got["finish_reason"] == "stop" and got["text"] == steered[:steered.index(stop)]


def test_min_tokens_with_a_steer_suppresses_the_stop_token_like_vllm(server, ref_model):
    base = _ok(server, steer={"detox": 5})[0]
    stop_id = base["token_ids"][2]
    short = _ok(server, steer={"detox": 5}, stop_token_ids=[stop_id])[0]
    assert short["token_ids"] == base["token_ids"][:3] and short["finish_reason"] == "stop"

    def ban_until_min(logits, out):
        if len(out) < 5:
            logits[[stop_id, 2]] = float("-inf")  # the stop token and EOS (id 2)
        return logits

    got = _ok(server, steer={"detox": 5}, stop_token_ids=[stop_id], min_tokens=5)[0]
    want = reference_greedy(ref_model, base["prompt_token_ids"], 8, 5, ban_until_min)
    if stop_id in want[5:]:
        want = want[:want.index(stop_id, 5) + 1]
    assert got["token_ids"] == want
    assert got["token_ids"] != _ok(server, stop_token_ids=[stop_id], min_tokens=5)[0][
        "token_ids"]


def test_penalties_apply_to_the_steered_logits(server, ref_model):
    import torch

    pen = dict(repetition_penalty=1.5, frequency_penalty=1.0, presence_penalty=0.5)
    got = _ok(server, steer={"detox": 5}, max_tokens=12, **pen)[0]
    prompt = got["prompt_token_ids"]

    def penalise(logits, out):  # vLLM's order: repetition, then frequency and presence
        seen = torch.zeros_like(logits, dtype=torch.bool)
        seen[list(prompt) + out] = True
        p = torch.where(seen, torch.tensor(pen["repetition_penalty"]), torch.tensor(1.0))
        logits = torch.where(logits > 0, logits / p, logits * p)
        counts = torch.bincount(torch.tensor(out, dtype=torch.long),
                                minlength=logits.shape[0]).float() if out else 0
        logits = logits - pen["frequency_penalty"] * counts
        return logits - pen["presence_penalty"] * (torch.as_tensor(counts) > 0).float()

    assert got["token_ids"] == reference_greedy(ref_model, prompt, 12, 5, penalise)
    assert got["token_ids"] != _ok(server, max_tokens=12, **pen)[0]["token_ids"]


# ---- hostile requests (issue 14) --------------------------------------------------------------
CHAT_BASE = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
COMPLETION_BASE = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
ROUTES = [("/v1/completions", COMPLETION_BASE), ("/v1/chat/completions", CHAT_BASE)]


@pytest.mark.parametrize("route, base", ROUTES)
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("body, fragment", [
    ({"steer": {"toxic": 1}}, "unknown steer 'toxic'"),
    ({"steer": {"detox": int("9" * 400)}}, "exceeds the server's maximum |strength| 20"),
    ({"steer": {"detox": "1_0"}}, "must be a number"),
    ({"vllm_xargs": {"steer": "detox:5,,"}}, "empty entry"),
    ({"steer": {"detox": 1}, "vllm_xargs": {"steer": "detox:1"}}, "given both"),
    # generation windows (issue 24)
    ({"steer": {"detox": {"strength": 5, "stop": 3}}},
     "window of steer 'detox' has unknown key(s) 'stop'; allowed: strength, start, end, ramp"),
    ({"steer": {"detox": {"strength": 5, "start": 8, "end": 4}}},
     "'end' 4 must be greater than 'start' 8"),
    ({"steer": {"detox": {"strength": 5, "start": -1}}}, "'start' is -1; it must be at least 0"),
    ({"steer": {"detox": {"strength": 5, "ramp": 2.5}}},
     "'ramp' must be an integer token index, got 2.5"),
    ({"steer": {"detox": {"strength": 5, "end": 1 << 21}}}, "at most 1048576 (1<<20)"),
    ({"steer": {"detox": {"start": 0}}}, "window of steer 'detox' has no 'strength'"),
    ({"steer": {"detox": {"strength": 5, "x": "y" * 5000}}},
     "characters as JSON; at most 4096 are allowed"),
    ({"vllm_xargs": {"steer": "detox:5@0-32"}}, "has no generation windows; send the steer as "
                                                "a JSON object in the top-level 'steer' field"),
])
def test_bad_steer_is_400_before_anything_is_sent(server, route, base, stream, body, fragment):
    """Streaming too: the field is checked when the body is parsed, not after the stream
    has started (it used to be HTTP 200 and an error event)."""
    r = requests.post(server + route, json={**base, **body, "stream": stream}, timeout=60)
    assert r.status_code == 400, r.text[:300]
    err = r.json()["error"]
    assert err["param"] == "steer" and fragment in err["message"]


def test_windows_are_accepted_and_a_whole_window_is_the_plain_strength(server, client):
    """A window covering every token at once (start 0, no end, no ramp) is its strength; one
    whose strength and base are 0 is no steer (the exact schedule is pinned against a
    hand-written decode loop elsewhere)."""
    plain, steered = complete(client), complete(client, steer={"detox": 5})
    assert steered != plain
    assert complete(client, steer={"detox": {"strength": 5}}) == steered
    assert complete(client, steer={"detox": {"strength": "5", "start": 0.0, "end": None,
                                             "ramp": 0}}) == steered
    assert complete(client, steer={"detox": {"strength": 0, "end": 3}}) == plain
    r = requests.post(server + "/v1/chat/completions", timeout=60, json={
        **CHAT_BASE, "stream": True, "steer": {"detox": {"strength": 5, "end": 4, "ramp": 2}}})
    assert r.status_code == 200 and "data: [DONE]" in r.text


def test_error_bodies_are_bounded(server):
    r = requests.post(server + "/v1/completions",
                      json={**COMPLETION_BASE, "steer": {"x" * 1_000_000: 1}}, timeout=60)
    assert r.status_code == 400 and len(r.content) < 4000
    assert "1000000 characters" in r.json()["error"]["message"]


def _text_of(tokenizer, n_tokens: int) -> str:
    from vllm_steer.lens.highlight import text_pieces

    words = "the quick brown fox jumps over a lazy dog while rain falls softly ".split()
    text = " ".join(words[i % len(words)] for i in range(2 * n_tokens))
    while True:
        ids, pieces = text_pieces(tokenizer, text)
        if len(ids) <= n_tokens:
            return text
        text = "".join(pieces[:n_tokens - (len(ids) - n_tokens > 0)])


def test_health_answers_while_a_maximal_highlight_runs(server, tiny_model_dir):
    """The longest text the context allows, k=64, max_len=512: /health keeps answering
    within a second (the span search used to block the event loop for seconds)."""
    import threading
    import time

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    text = _text_of(tok, 510)  # + BOS + the one generated token = 512, the context
    result = {}

    def run():
        result["r"] = requests.post(server + "/v1/steer/highlight", timeout=300, json={
            "text": text, "steer": {"detox": 5}, "against": {"detox": -5}, "k": 64,
            "max_len": 512})

    t = threading.Thread(target=run)
    t.start()
    waits = []
    while t.is_alive():
        t0 = time.monotonic()
        assert requests.get(server + "/health", timeout=30).status_code == 200
        waits.append(time.monotonic() - t0)
        time.sleep(0.05)
    t.join()
    r = result["r"]
    assert r.status_code == 200, r.text[:300]
    assert len(r.json()["tokens"]) >= 500 and waits
    assert max(waits) < 1.0, waits
    # one token more than the context holds: a 400 on the text, saying the limit
    long = requests.post(server + "/v1/steer/highlight", timeout=60,
                         json={"text": text + " and more words", "steer": {"detox": 5}})
    assert long.status_code == 400, long.text[:300]
    err = long.json()["error"]
    assert err["param"] == "text" and "context is 512 tokens" in err["message"]


def _resolve(node, components):
    """Inline the ``#/components/schemas/...`` references of an OpenAPI schema."""
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#/components/schemas/"):
            return _resolve(components[ref.rsplit("/", 1)[1]], components)
        return {k: _resolve(v, components) for k, v in node.items()}
    if isinstance(node, list):
        return [_resolve(v, components) for v in node]
    return node


def _from_schema(schema):
    """A hypothesis strategy for the values a JSON schema (as FastAPI writes it) allows:
    enough of JSON Schema for request bodies (hypothesis-jsonschema no longer runs on
    current hypothesis)."""
    from hypothesis import strategies as st

    any_json = st.recursive(st.none() | st.booleans() | st.integers() | st.floats()
                            | st.text(max_size=20),
                            lambda inner: st.lists(inner, max_size=3)
                            | st.dictionaries(st.text(max_size=8), inner, max_size=3),
                            max_leaves=6)
    if not isinstance(schema, dict) or not schema.keys() - {"title", "description",
                                                            "examples", "default"}:
        return any_json
    if "const" in schema:
        return st.just(schema["const"])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    if "anyOf" in schema or "oneOf" in schema:
        return st.one_of([_from_schema(s) for s in schema.get("anyOf", schema.get("oneOf"))])
    kind = schema.get("type")
    if kind == "null":
        return st.none()
    if kind == "boolean":
        return st.booleans()
    if kind == "integer":
        return st.integers(schema.get("minimum"), schema.get("maximum"))
    if kind == "number":
        return st.floats(schema.get("minimum"), schema.get("maximum"))
    if kind == "string":
        return st.text(min_size=schema.get("minLength", 0),
                       max_size=min(schema.get("maxLength", 40), 40))
    if kind == "array":
        return st.lists(_from_schema(schema.get("items", {})), max_size=3)
    if kind == "object":
        props = schema.get("properties", {})
        required = set(schema.get("required", []))
        extra = schema.get("additionalProperties")
        fixed = st.fixed_dictionaries(
            {k: _from_schema(v) for k, v in props.items() if k in required},
            optional={k: _from_schema(v) for k, v in props.items() if k not in required})
        if not extra:
            return fixed
        more = st.dictionaries(st.text(max_size=10), _from_schema(extra), max_size=3)
        return st.builds(lambda a, b: {**b, **a}, fixed, more)
    return any_json


def test_api_fuzz_from_the_openapi_schema(server, client):
    """Bodies generated from the server's own OpenAPI schema (the `steer` and `vllm_xargs`
    properties of the completions routes, the whole highlight body), plus hostile JSON:
    never a 5xx, error bodies bounded, and the server keeps serving."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from_schema = _from_schema
    spec = requests.get(server + "/openapi.json", timeout=30).json()
    comps = spec["components"]["schemas"]

    def body_schema(path):
        content = spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]
        return _resolve(content["schema"], comps)

    hostile = st.recursive(
        st.none() | st.booleans() | st.integers(-10**500, 10**500) | st.floats()
        | st.text(max_size=30),
        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
            st.sampled_from(["detox", "sentiment", "x" * 300]) | st.text(max_size=10), inner,
            max_size=3), max_leaves=6)
    seen = []

    def check(r):
        seen.append(r.status_code)
        assert r.status_code < 500, r.text[:500]
        if r.status_code >= 400:
            assert len(r.content) < 8000

    fuzz = settings(max_examples=25, deadline=None, derandomize=True, database=None,
                    suppress_health_check=list(HealthCheck))
    for path, base in ROUTES:
        props = body_schema(path)["properties"]
        assert "vllm-steer" in props["steer"]["description"]
        steer = from_schema(props["steer"]) | hostile
        xargs = from_schema(props["vllm_xargs"]["anyOf"][0]["additionalProperties"]) | hostile

        @fuzz
        @given(steer=steer, xarg=st.none() | xargs, stream=st.booleans())
        def one(steer, xarg, stream):
            body = {**base, "max_tokens": 1, "stream": stream, "steer": steer}  # noqa: B023 (run below)
            if xarg is not None:
                body["vllm_xargs"] = {"steer": xarg}
            check(requests.post(server + path,  # noqa: B023 (run below, in this iteration)
                                data=json.dumps(body, allow_nan=True),
                                headers={"Content-Type": "application/json"}, timeout=120))

        one()

    highlight = body_schema("/v1/steer/highlight")
    hl_props = highlight["properties"]

    @fuzz
    @given(body=from_schema(highlight), steer=hostile, against=hostile, which=st.integers(0, 2))
    def one_highlight(body, steer, against, which):
        body["text"] = body["text"][:200]
        if which == 1:
            body["steer"] = steer
        elif which == 2:
            body["against"] = against
        check(requests.post(server + "/v1/steer/highlight", timeout=120,
                            data=json.dumps(body, allow_nan=True),
                            headers={"Content-Type": "application/json"}))

    assert {"text", "steer", "k", "max_len"} <= set(hl_props)
    one_highlight()
    assert 200 in seen and 400 in seen
    assert requests.get(server + "/health", timeout=30).status_code == 200
    assert complete(client, steer={"detox": 5}) == complete(client, steer={"detox": 5.0})


def test_steer_updates_are_off_by_default_and_the_list_is_on(server):
    listing = requests.get(server + "/v1/steers").json()
    assert sorted(s["name"] for s in listing["data"]) == ["calm", "detox", "sentiment"]
    assert {s["name"]: s["kind"] for s in listing["data"]} == {
        "calm": "vector", "detox": "lm-steer", "sentiment": "lm-steer"}
    assert listing["updates_enabled"] is False
    path = str(SERVER_DIR[0] / "detox.safetensors")
    for r in (requests.post(server + "/v1/steers", json={"name": "x", "path": path}),
              requests.delete(server + "/v1/steers/detox")):
        assert r.status_code == 403 and "--enable-steer-updates" in r.json()["error"]["message"]
    assert sorted(s["name"] for s in requests.get(server + "/v1/steers").json()["data"]) == \
        ["calm", "detox", "sentiment"]


def test_a_control_vector_and_an_lm_steer_steer_in_one_request_over_http(server, tiny_model_dir):
    """``extra_body={"steer": {"calm": a, "detox": s}}``: a llama.cpp control vector and an
    LM-Steer steer mixed in one request, through the OpenAI route, each request's tokens equal
    to the model with the vector added by forward hooks and the steer applied by hand."""
    from vllm_steer.format import load_steer

    ref = HFReference(tiny_model_dir, {"detox": load_steer(SERVER_DIR[0] / "detox.safetensors")},
                      vectors={"calm": CALM})
    plain = _ok(server)[0]
    for steer in ({"calm": 1.0}, {"calm": -1.0, "detox": 4}):
        got = _ok(server, steer=steer)[0]
        want = ref.greedy(plain["prompt_token_ids"], 8, steer)
        assert got["token_ids"] == want != plain["token_ids"], steer
    assert plain["token_ids"] == ref.greedy(plain["prompt_token_ids"], 8)
