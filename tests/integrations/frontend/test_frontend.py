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


def test_a_name_at_strength_zero_must_name_a_steer_as_at_any_strength(tmp_path):
    """``{"typo": 0}`` is refused like ``{"typo": 1}``, whether the server's names are fixed
    (``--steer``) or come and go (``--steer-dir``, loads at run time): the same message."""
    (tmp_path / "ondisk.safetensors").write_bytes(b"")
    for cfg, loaded in ((SteerServerConfig(steers={"a": "a.safetensors"}), None),
                        (SteerServerConfig(steers={"a": "a.safetensors"},
                                           steer_dir=str(tmp_path)), ["a"])):
        frontend_state().reset(cfg)
        if loaded:
            frontend_state().set_loaded(loaded)
        try:
            for strength in (1, 0):
                with pytest.raises(frontend.SteerRequestError, match="unknown steer 'typo'"):
                    frontend.check_value({"a": 1, "typo": strength})
            assert frontend.check_value({"a": 0}).named == {"a": 0.0}
            if cfg.steer_dir:  # a --steer-dir file at 0 needs no load and is not read
                assert frontend.check_value({"ondisk": 0}).strengths == {}
        finally:
            frontend_state().reset(None)


def _refused(reason: str, source: str = "api_server") -> float:
    """``vllm_steer:requests_refused_total`` of this process for ``reason`` (the API server's
    own counter, on vLLM's default registry)."""
    from prometheus_client import REGISTRY

    from vllm_steer.metrics import get_metrics

    get_metrics()
    total = 0.0
    for fam in REGISTRY.collect():
        for s in fam.samples:
            if s.name == "vllm_steer:requests_refused_total" and \
                    s.labels.get("reason") == reason and s.labels.get("source") == source:
                total += s.value
    return total


@pytest.mark.parametrize("body, reason", [
    ({"steer": {"toxic": 1}}, "unknown_steer"),
    ({"steer": {"detox": 25}}, "strength_limit"),
    ({"steer": {"detox": "x"}}, "bad_steer"),
    ({"vllm_xargs": {"steer": "detox:5,,"}}, "bad_steer"),
    ({"steer": {"detox": 1, "sentiment": 1}}, "too_many_steers"),  # after the body's check
])
def test_each_refusal_is_counted_once_by_its_reason(app, body, reason):
    """What a client is refused with HTTP 400 shows on this API server's /metrics once, under
    its reason; an admitted request counts nothing."""
    from vllm_steer.request import REFUSAL_REASONS

    old = frontend_state().config
    frontend_state().reset(SteerServerConfig(steers={"detox": "d", "sentiment": "s"},
                                             max_strength=20, max_steers_per_request=1))
    try:
        c = TestClient(app)
        before = {r: _refused(r) for r in REFUSAL_REASONS}
        r = post(c, body)
        assert r.status_code == 400, r.text
        after = {r: _refused(r) for r in REFUSAL_REASONS}
        assert {k: after[k] - before[k] for k in after if after[k] != before[k]} == {reason: 1}
        assert post(c, {"steer": {"detox": 5}}).status_code == 200
        assert {r: _refused(r) for r in REFUSAL_REASONS} == after
    finally:
        frontend_state().reset(old)


def test_an_engine_core_refusal_is_the_clients_400_and_not_counted_again():
    """The engine core counts its own refusals (handed to the API servers by ``list``): the API
    server that turns one into HTTP 400 does not count it a second time."""
    import asyncio
    from types import SimpleNamespace

    from vllm.exceptions import VLLMValidationError

    from vllm_steer.integrations.frontend import async_llm
    from vllm_steer.integrations.protocol import REFUSED_PREFIX

    async def orig(self):
        yield SimpleNamespace(request_id="r1", outputs=[SimpleNamespace(
            finish_reason="error", stop_reason=REFUSED_PREFIX + "steer: no room")])

    async def run():
        async for _ in async_llm.generate(orig, None):
            pass

    before = {s: _refused("bad_steer", s) for s in ("api_server", "engine_core")}
    with pytest.raises(VLLMValidationError, match="no room"):
        asyncio.run(run())
    assert {s: _refused("bad_steer", s) for s in ("api_server", "engine_core")} == before


def test_a_worker_fault_the_engine_core_reported_is_its_500_once_not_wrapped_again():
    """A fault of the plugin's worker code fails the step's steered request with the engine
    core's message (HTTP 500, naming vllm-steer, the hook and the request): the API server
    raises that message as it is, not wrapped in a second "internal error" of its own hook."""
    import asyncio
    from types import SimpleNamespace

    from vllm.exceptions import GenerationError

    from vllm_steer.integrations.frontend import async_llm
    from vllm_steer.integrations.guard import internal_message
    from vllm_steer.integrations.protocol import FAILED_PREFIX

    engine = internal_message("the steered LM head", "r1-abc", RuntimeError("boom"))

    async def orig(self):
        yield SimpleNamespace(request_id="r1", outputs=[SimpleNamespace(
            finish_reason="error", stop_reason=FAILED_PREFIX + engine)])

    async def run():
        async for _ in async_llm.generate(orig, None):
            pass

    with pytest.raises(GenerationError) as e:
        asyncio.run(run())
    assert str(e.value) == engine
    assert str(e.value).count("This request was not served") == 1


def test_an_unknown_model_name_is_an_unknown_preset_404_counted_once():
    """vLLM answers a model name it does not serve with 404; on a steering server (presets are
    model names) it is counted as ``unknown_preset``; a served name counts nothing."""
    import asyncio
    from types import SimpleNamespace

    from vllm_steer.integrations.frontend import preset_models

    old = frontend_state().config
    frontend_state().reset(SteerServerConfig(steers={"detox": "d"},
                                             presets={"polite": {"detox": 4.0}}))
    try:
        async def orig(self, request):
            return None if request.model in ("m", "polite") else "404 response"

        async def check(name):
            return await preset_models.check_model(orig, None, SimpleNamespace(model=name))

        before = _refused("unknown_preset")
        assert asyncio.run(check("polite")) is None and asyncio.run(check("m")) is None
        assert _refused("unknown_preset") == before
        assert asyncio.run(check("politte")) == "404 response"
        assert _refused("unknown_preset") == before + 1
    finally:
        frontend_state().reset(old)


def test_a_preset_named_on_a_route_that_builds_its_own_sampling_params_is_refused():
    """Routes such as vLLM 0.33's ``/v1/decisions`` (and ``/v1/systemone``,
    ``/generative_scoring``) run vLLM's model check, which admits a preset's name, but build
    their ``SamplingParams`` themselves (no ``to_sampling_params``): the preset's steers would
    be dropped and its name served by the plain model. Such a request is refused (HTTP 400,
    ``param: "model"``) when it reaches the engine's admission; the routes that apply the
    preset, a served model name and a request outside an HTTP request are not."""
    import asyncio
    from types import SimpleNamespace

    from vllm.sampling_params import SamplingParams

    from vllm_steer.integrations.frontend import preset_models, request_scope
    from vllm_steer.request import SteerRequestError

    old = frontend_state().config
    frontend_state().reset(SteerServerConfig(steers={"detox": "d"},
                                             presets={"polite": {"detox": 4.0}}))
    serving = SimpleNamespace(models=SimpleNamespace(
        base_model_paths=[SimpleNamespace(name="m")], lora_requests={"adapter": object()}))

    async def orig(self, request):
        return None  # vLLM's model check admits each of these names

    def http_request(model, route_applies_policy):
        box, token = request_scope.open_scope()
        try:
            assert asyncio.run(preset_models.check_model(
                orig, serving, SimpleNamespace(model=model))) is None
            params = SamplingParams(max_tokens=1)
            if route_applies_policy:  # what to_sampling_params does
                preset_models.apply_preset(params, model, None)
            frontend.validate(params)  # the engine's admission (InputProcessor)
            return params
        finally:
            request_scope.close_scope(token)

    try:
        with pytest.raises(SteerRequestError, match="'polite' is a steer preset") as e:
            http_request("polite", route_applies_policy=False)
        assert e.value.reason == "preset_route"
        assert getattr(e.value, "parameter", "model") == "model"
        served = http_request("polite", route_applies_policy=True)  # completions, chat, ...
        assert "steer" in served.extra_args
        for name in ("m", "adapter"):  # not presets: served as vLLM serves them
            assert http_request(name, route_applies_policy=False).extra_args is None
        frontend.validate(SamplingParams(max_tokens=1))  # outside an HTTP request: no scope
    finally:
        frontend_state().reset(old)
