"""The steer field as an HTTP client sees it, without an engine: the OpenAI request models
patched by the plugin, behind vLLM's own validation-error handler. A bad value is HTTP 400
with ``param: "steer"`` when the body is parsed, streaming or not (issue 14)."""


import argparse

import pytest

pytest.importorskip("vllm")
from fastapi import FastAPI  # noqa: E402
from fastapi.testclient import TestClient  # noqa: E402

from vllm_steer.config import SteerServerConfig  # noqa: E402
from vllm_steer.integrations.frontend import admission as frontend
from vllm_steer.integrations.frontend.state import frontend_state
from vllm_steer.integrations import hooks
from vllm_steer.integrations import plugin
from vllm_steer.integrations.frontend import request_field  # noqa: E402


@pytest.fixture(scope="module")
def app():
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest
    from vllm.entrypoints.serve.exception_handling.register import init_exception_handler

    hooks.install_hooks([h for h in plugin.HOOKS if h.install is request_field.add_request_field
                        or h.wrapper is request_field.to_sampling_params])
    app = FastAPI()
    app.state.args = argparse.Namespace(log_error_stack=False)
    init_exception_handler(app)

    @app.post("/v1/completions")
    async def completions(request: CompletionRequest):
        params = request.to_sampling_params(max_tokens=4, default_sampling_params={})
        return {"extra_args": params.extra_args, "stream": request.stream}

    @app.post("/v1/chat/completions")
    async def chat(request: ChatCompletionRequest):
        return {"steer": request.steer}

    return app


@pytest.fixture
def client(app):
    old = frontend_state().config
    frontend_state().reset(SteerServerConfig(steers={"detox": "d", "sentiment": "s"},
                                          max_strength=20))
    yield TestClient(app)
    frontend_state().reset(old)


def post(client, body, route="/v1/completions"):
    base = {"model": "m", "prompt": "hi"} if route == "/v1/completions" else \
        {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    return client.post(route, json={**base, **body})


def test_good_steer_reaches_the_sampling_params(client):
    """The steers reach ``extra_args["steer"]`` parsed, in their versioned serialised form (the
    engine decodes it; nothing downstream parses the grammar again), from either field."""
    from vllm_steer.request import WIRE_KEY, WIRE_VERSION, SteerRequest

    r = post(client, {"steer": {"detox": 5}})
    assert r.status_code == 200, r.text
    wire = r.json()["extra_args"]["steer"]
    assert wire[WIRE_KEY] == WIRE_VERSION
    assert SteerRequest.from_wire(wire).named == {"detox": 5.0}
    r = post(client, {"vllm_xargs": {"steer": "detox:5,sentiment:-3"}})
    assert r.status_code == 200, r.text
    assert list(r.json()["extra_args"]) == ["steer"]
    assert SteerRequest.from_wire(r.json()["extra_args"]["steer"]).named == \
        {"detox": 5.0, "sentiment": -3.0}


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("body, fragment", [
    ({"steer": {"toxic": 1}}, "unknown steer 'toxic'; loaded steers: detox, sentiment"),
    ({"steer": {"detox": int("9" * 400)}}, "exceeds the server's maximum |strength| 20"),
    ({"steer": {"detox": "1_0"}}, "must be a number, got '1_0'"),
    ({"steer": {"detox": "\uff15"}}, "must be a number"),
    ({"steer": {"detox": True}}, "must be a number"),
    ({"vllm_xargs": {"steer": "detox:5,,"}}, "empty entry"),
    ({"vllm_xargs": {"steer": ",,,"}}, "empty entry"),
    ({"vllm_xargs": {"steer": 5}}, "expected an object mapping steer names"),
    ({"steer": {"detox": 1}, "vllm_xargs": {"steer": "detox:1"}}, "given both"),
])
def test_bad_steer_is_400_with_param_steer(client, route, stream, body, fragment):
    r = post(client, {**body, "stream": stream}, route)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "steer" and fragment in err["message"], err


def test_unknown_name_is_echoed_only_as_a_prefix(client):
    r = post(client, {"steer": {"x" * 1_000_000: 1}})
    assert r.status_code == 400 and len(r.content) < 3000
    assert "xxxxxxxxxx'... (1000000 characters)" in r.json()["error"]["message"]


def test_server_without_steers(app):
    old = frontend_state().config
    try:
        for cfg in (None, SteerServerConfig()):
            frontend_state().reset(cfg)
            c = TestClient(app)
            for value in ({"detox": 5}, {"detox": int("9" * 400)}, {"detox": "x"}):
                r = post(c, {"steer": value})
                assert r.status_code == 400 and r.json()["error"]["param"] == "steer"
                assert "this server has no steers loaded" in r.json()["error"]["message"]
            assert post(c, {"steer": {"detox": 0}}).status_code == 200
    finally:
        frontend_state().reset(old)


def test_a_new_engine_configuration_forgets_run_time_loads_of_the_last_one():
    # Offline, several engines can live in one process one after the other: steers loaded at
    # run time into an earlier one must not stand in for the next engine's --steer names.
    frontend_state().reset(SteerServerConfig(steers={"a": "a.safetensors"}))
    frontend_state().set_loaded(["x"])  # e.g. vllm_steer.offline.load_steer on the first engine
    frontend_state().reset(SteerServerConfig(steers={"a": "a.safetensors"}))
    assert frontend.check_value({"a": 2}).strengths == {"a": 2.0}
    frontend_state().reset(None)
