"""A streamed request refused by the engine core is answered HTTP 400 (JSON, ``param:
"steer"``), as a non-streamed one is, never an HTTP 200 with an error event and an
``x-vllm-steer-applied`` header: a ``--steer-dir`` first use whose load is refused, and a name
at strength 0 the engine core does not know. A user's own stop string that reads like the
plugin's refusal is no refusal. The plugin's real hooks (the body's check, ``serve``,
``AsyncLLM.add_request`` and ``generate``) and the headers middleware; vLLM's stream generator
and the engine core are stand-ins."""

from __future__ import annotations

import asyncio
import json
import shutil
from types import SimpleNamespace

import pytest
from fastapi.responses import StreamingResponse

from vllm_steer.config import SteerServerConfig
from vllm_steer.integrations.frontend import admission, async_llm
from vllm_steer.integrations.frontend.state import frontend_state
from vllm_steer.integrations.protocol import REFUSED_PREFIX
from vllm_steer.server.presets_route import SteerHeadersMiddleware


class Engine:
    """``AsyncLLM`` with the plugin's hooks around a stand-in engine whose outputs are
    ``outputs`` (vLLM calls ``add_request``, then yields the engine core's outputs)."""

    def __init__(self, outputs):
        self.outputs = outputs

    async def _add_request(self, request_id, prompt, params):
        return None

    async def _generate(self, prompt, params, request_id):
        await async_llm.add_request(Engine._add_request, self, request_id, prompt, params)
        for out in self.outputs:
            yield SimpleNamespace(request_id=request_id, outputs=[out])

    def generate(self, prompt, params, request_id):
        return async_llm.generate(Engine._generate, self, prompt, params, request_id)


def _stream(value, engine, path: str = "/v1/chat/completions") -> list[dict]:
    """One streamed chat completion with ``steer: value`` behind the headers middleware, as
    vLLM's stream generator makes it (an exception becomes an error event): the messages."""

    async def app(scope, receive, send):
        params = SimpleNamespace(extra_args=None)
        admission.serve(params, admission.check_request_fields(value, None))

        async def events():
            try:
                async for _ in engine.generate("p", params, "chatcmpl-1"):
                    yield b'data: {"choices": [{"delta": {"content": "x"}}]}\n\n'
            except Exception as e:
                yield b'data: {"error": %s}\n\n' % json.dumps(str(e)).encode()
            yield b"data: [DONE]\n\n"

        await StreamingResponse(events(), media_type="text/event-stream")(scope, receive, send)

    sent = []

    async def send(message):
        sent.append(message)

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    scope = {"type": "http", "asgi": {"spec_version": "2.4"}, "path": path}
    asyncio.run(SteerHeadersMiddleware(app)(scope, receive, send))
    return sent


def _answer(sent):
    start = sent[0]
    headers = {k.decode().lower(): v.decode() for k, v in start["headers"]}
    return start["status"], headers, b"".join(m.get("body", b"") for m in sent[1:])


@pytest.fixture
def dir_server(tmp_path, monkeypatch):
    """A --steer-dir server holding no steer yet; ``answers``: what the engine core says to a
    first-use load."""
    shutil.copy("steers/smollm2-detox.safetensors", tmp_path / "c.safetensors")
    st = frontend_state()
    st.reset(SteerServerConfig(steers={}, steer_dir=str(tmp_path), max_steers=2))
    st.hidden_size = 0
    answers = []

    async def manage(engine, op, **kw):
        return dict(answers[0])

    monkeypatch.setattr(async_llm, "manage", manage)
    monkeypatch.setenv("VLLM_STEER_FIRST_USE_WAIT_SECONDS", "0.2")
    yield answers
    st.reset(None)


@pytest.mark.parametrize("reason, error", [
    ("bad_file", "steer 'c' has rank 8, over --max-steer-rank=4 (...)"),
    ("too_many_steers", "steer: the request's 3 steers never fit in --max-steers=2")])
def test_a_streamed_first_use_whose_load_is_refused_is_a_400(dir_server, reason, error):
    dir_server.append({"ok": False, "status": 400, "reason": reason, "error": error})
    status, headers, body = _answer(_stream({"c": 3}, Engine([])))
    assert status == 400 and headers["content-type"] == "application/json"
    assert not [k for k in headers if k.startswith("x-vllm-steer")]  # nothing was served
    err = json.loads(body)["error"]
    assert err["message"] == f"steer: {error}" and err["param"] == "steer"
    assert err["code"] == 400


def test_a_streamed_first_use_that_loads_streams_with_its_header(dir_server):
    dir_server.append({"ok": True, "steer": {"name": "c"}})
    status, headers, body = _answer(_stream({"c": 3}, Engine([SimpleNamespace(
        stop_reason=None, finish_reason=None)])))
    assert status == 200 and headers["x-vllm-steer-applied"] == "c=3"
    assert body.startswith(b'data: {"choices"') and body.endswith(b"data: [DONE]\n\n")


@pytest.fixture
def updates_server():
    """An --enable-steer-updates server with steer ``a`` loaded: a name it does not know is
    left to the engine core, which may have it."""
    st = frontend_state()
    st.reset(SteerServerConfig(steers={"a": "/x/a.safetensors"}, enable_updates=True))
    st.set_loaded(["a"])
    yield
    st.reset(None)


@pytest.mark.parametrize("value", [{"typo": 0}, {"typo": 3}, {"a": 1, "typo": 0}])
def test_a_name_the_engine_core_refuses_is_a_400_at_any_strength(updates_server, value):
    refusal = SimpleNamespace(finish_reason="error", stop_reason=REFUSED_PREFIX + (
        "steer: unknown steer 'typo'; loaded steers: a"))
    status, headers, body = _answer(_stream(value, Engine([refusal])))
    assert status == 400 and not [k for k in headers if k.startswith("x-vllm-steer")]
    err = json.loads(body)["error"]
    assert err["message"] == "steer: unknown steer 'typo'; loaded steers: a"
    assert err["param"] == "steer"


def test_a_users_stop_string_that_reads_like_a_refusal_is_text(updates_server):
    """vLLM puts a matched stop string in ``stop_reason`` (finished with ``stop``); only an
    output finished with ``error`` carries the engine core's refusal."""
    stopped = SimpleNamespace(finish_reason="stop", stop_reason=REFUSED_PREFIX)
    status, headers, body = _answer(_stream({"a": 1}, Engine([stopped])))
    assert status == 200 and headers["x-vllm-steer-applied"] == "a=1"
    assert b'"error"' not in body and body.endswith(b"data: [DONE]\n\n")


def test_a_streamed_messages_refusal_has_the_anthropic_error_body(updates_server):
    """``/v1/messages`` (the Anthropic Messages API): the 400 of a stream that had not begun
    has the error body vLLM gives there, as a non-streamed refusal has."""
    refusal = SimpleNamespace(finish_reason="error", stop_reason=REFUSED_PREFIX + (
        "steer: unknown steer 'typo'; loaded steers: a"))
    status, headers, body = _answer(_stream({"typo": 3}, Engine([refusal]), "/v1/messages"))
    assert status == 400 and headers["content-type"] == "application/json"
    assert json.loads(body) == {"type": "error", "error": {
        "type": "BadRequestError", "message": "steer: unknown steer 'typo'; loaded steers: a"}}
