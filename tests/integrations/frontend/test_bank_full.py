"""A full steer bank in the API server, without an engine: a first-use request asks the engine
core again only when a steered request ends (or at the fallback period), never on a timer of
its own; each wait counts once by outcome; a wait that ends without a slot is HTTP 429 with
``Retry-After``, also for a stream that had not begun (the headers middleware), a streamed
``/v1/responses`` included, whose first events vLLM makes before the request reaches the
engine (and an engine-side refusal of its steer is its HTTP 400, not a cut stream)."""

from __future__ import annotations

import asyncio
import json
import time
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from vllm_steer.integrations.frontend import async_llm, request_scope
from vllm_steer.integrations.frontend.state import frontend_state
from vllm_steer.metrics import SteerMetrics

FULL = {"ok": False, "status": 507, "error": "cannot load steer 'c': all 2 steer slots are in "
        "use (2 loaded; --max-steers=2); unload a steer"}


@pytest.fixture
def engine(monkeypatch):
    """A stand-in engine core behind ``manage``: answers 507 until ``free`` is set, and
    records when each ask came; and this process's metrics on their own registry."""
    eng = SimpleNamespace(asks=[], free=False)

    async def manage(engine_, op, **kw):
        assert op == "load" and kw["source"] == "steer-dir" and kw["protect"] == ["c"]
        eng.asks.append(time.monotonic())
        return {"ok": True, "steer": {"name": "c"}} if eng.free else dict(FULL)

    monkeypatch.setattr(async_llm, "manage", manage)
    reg = CollectorRegistry()
    metrics = SteerMetrics(registry=reg)
    monkeypatch.setattr("vllm_steer.metrics.get_metrics", lambda: metrics)
    eng.waits = lambda: {s.labels["outcome"]: s.value for f in text_string_to_metric_families(
        generate_latest(reg).decode()) if f.name == "vllm_steer:bank_full_waits"
        for s in f.samples if s.name.endswith("_total")}
    frontend_state().slot_waiters.clear()
    return eng


def test_no_steered_request_ending_means_no_ask_until_the_deadline(engine, monkeypatch):
    monkeypatch.setenv("VLLM_STEER_FIRST_USE_WAIT_SECONDS", "0.6")
    monkeypatch.setattr(async_llm, "FIRST_USE_POLL_SECONDS", 30.0)
    t0 = time.monotonic()
    res = asyncio.run(async_llm._load_waiting_for_room(None, "c", "/d/c.safetensors", ["c"]))
    took = time.monotonic() - t0
    assert res["status"] == 507 and 0.6 <= took < 3, (res, took)
    # the first ask, and one last at the deadline: no retries in between
    assert len(engine.asks) == 2 and engine.asks[1] - t0 >= 0.6
    assert engine.waits() == {"loaded": 0.0, "retry_after": 1.0}
    assert not frontend_state().slot_waiters  # nothing left behind


def test_each_steered_request_ending_wakes_one_ask_and_the_slot_is_taken(engine, monkeypatch):
    monkeypatch.setenv("VLLM_STEER_FIRST_USE_WAIT_SECONDS", "20")
    monkeypatch.setattr(async_llm, "FIRST_USE_POLL_SECONDS", 30.0)

    async def scenario():
        waiting = asyncio.create_task(
            async_llm._load_waiting_for_room(None, "c", "/d/c.safetensors", ["c"]))
        for i in range(3):  # three steered requests end, 0.3 s apart; the third frees a slot
            await asyncio.sleep(0.3)
            engine.free = i == 2
            frontend_state().slot_may_be_free()
        return await asyncio.wait_for(waiting, 10)

    t0 = time.monotonic()
    res = asyncio.run(scenario())
    assert res["ok"] and time.monotonic() - t0 < 5
    assert len(engine.asks) == 4  # the first, then one per request that ended
    assert engine.waits() == {"loaded": 1.0, "retry_after": 0.0}


def test_a_slot_free_at_the_first_ask_counts_no_wait(engine, monkeypatch):
    engine.free = True
    res = asyncio.run(async_llm._load_waiting_for_room(None, "c", "/d/c.safetensors", ["c"]))
    assert res["ok"] and len(engine.asks) == 1
    assert engine.waits() == {"loaded": 0.0, "retry_after": 0.0}


def test_a_steered_request_ending_wakes_the_waiters_and_an_unsteered_one_does_not():
    async def orig(self, prompt, params, request_id):
        yield SimpleNamespace(request_id=request_id, outputs=[])

    async def run(params):
        loop = asyncio.get_running_loop()
        waiter = loop.create_future()
        frontend_state().slot_waiters.add(waiter)
        async for _ in async_llm.generate(orig, None, "p", params, "r1"):
            pass
        frontend_state().slot_waiters.discard(waiter)
        return waiter.done()

    plain = SimpleNamespace(extra_args=None)
    steered = SimpleNamespace(extra_args={"steer": "wire form"})
    assert asyncio.run(run(plain)) is False
    assert asyncio.run(run(steered)) is True


# ---- the HTTP answer: 429 with Retry-After, a stream that had not begun included ------------
def _serve(app, scope=None):
    """Run ``app`` behind the headers middleware for one HTTP request: the messages sent."""
    from vllm_steer.server.presets_route import SteerHeadersMiddleware

    sent = []

    async def send(message):
        sent.append(message)

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    asyncio.run(SteerHeadersMiddleware(app)(scope or {"type": "http"}, receive, send))
    return sent


def _headers(start):
    return {k.decode().lower(): v.decode() for k, v in start["headers"]}


def _stream_app(busy: bool):
    """vLLM's streamed completion as the ASGI app sends it: HTTP 200, then the events; a
    first use that found no slot sets the 429 before the first event (its error)."""

    async def app(scope, receive, send):
        request_scope.record_applied({"d5": 1.0}, [])
        request_scope.hold_start()  # to_sampling_params: a steer-dir server, a steer
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        if busy:  # AsyncLLM.add_request, on the first iteration of the body
            request_scope.refuse_busy("steer: all 3 steer slots are in use", 1)
            await send({"type": "http.response.body", "more_body": True, "body":
                        b'data: {"error": {"code": 429, "message": "steer: all 3"}}\n\n'})
        else:
            await send({"type": "http.response.body", "body": b"data: {}\n\n",
                        "more_body": True})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n",
                    "more_body": False})

    return app


def test_a_stream_that_has_not_begun_is_answered_429_with_retry_after():
    sent = _serve(_stream_app(busy=True))
    assert [m["type"] for m in sent] == ["http.response.start", "http.response.body"]
    assert sent[0]["status"] == 429
    headers = _headers(sent[0])
    assert headers["retry-after"] == "1" and headers["content-type"] == "application/json"
    assert "x-vllm-steer-applied" not in headers  # nothing was served
    body = json.loads(sent[1]["body"])
    assert body["error"]["code"] == 429 and "all 3 steer slots" in body["error"]["message"]
    assert int(headers["content-length"]) == len(sent[1]["body"])
    assert sent[1]["more_body"] is False


def test_a_held_stream_that_gets_its_slot_streams_unchanged():
    sent = _serve(_stream_app(busy=False))
    assert [m.get("status") for m in sent] == [200, None, None]
    assert [m.get("body") for m in sent[1:]] == [b"data: {}\n\n", b"data: [DONE]\n\n"]
    assert "retry-after" not in _headers(sent[0])
    assert _headers(sent[0])["x-vllm-steer-applied"] == "d5=1"  # what was served


def test_a_plain_429_gets_retry_after():
    async def app(scope, receive, send):  # vLLM's JSON error for the busy error
        request_scope.hold_start()
        request_scope.refuse_busy("steer: all 3 steer slots are in use", 1)
        await send({"type": "http.response.start", "status": 429,
                    "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": b"{}", "more_body": False})

    sent = _serve(app)
    assert sent[0]["status"] == 429 and _headers(sent[0])["retry-after"] == "1"
    assert sent[1]["body"] == b"{}"


@pytest.mark.parametrize("status", [400, 429, 500])
def test_a_refused_request_carries_no_applied_steer_header(status):
    # the header says what was served; a refusal (an unknown steer: 400, a full bank: 429)
    # served nothing
    async def app(scope, receive, send):
        request_scope.record_applied({"b": 1.0, "zzz": 1.0}, [])
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": b"{}", "more_body": False})

    sent = _serve(app)
    assert sent[0]["status"] == status
    assert not [k for k in _headers(sent[0]) if k.startswith("x-vllm-steer")]


def test_the_busy_error_is_vllms_429_and_passes_the_guard():
    """vLLM answers a ``GracefulHTTPError`` with its own status (HTTP 429 here; through a real
    server: tests/e2e/test_vllm_faults.py); the guard lets it through, not as a 500."""
    from http import HTTPStatus

    from vllm.exceptions import GracefulHTTPError, VLLMClientError

    from vllm_steer.integrations import guard

    with pytest.raises(Exception) as e:
        with guard.frontend("AsyncLLM.add_request", "r1"):
            raise guard.busy_error("steer: no steer slot freed")
    assert isinstance(e.value, GracefulHTTPError) and not isinstance(e.value, VLLMClientError)
    assert e.value.http_status == HTTPStatus.TOO_MANY_REQUESTS == 429
    assert e.value.message == "steer: no steer slot freed"


@pytest.mark.parametrize("answer,status", [
    ({"ok": False, "status": 500, "error": "vllm-steer: the steer management op 'load' failed: "
      "RuntimeError: fault injected in worker 1; nothing was changed"}, 500),
    ({"ok": False, "status": 400, "reason": "bad_file",
      "error": "steer 'c' in --steer-dir: rank 99 is over --max-steer-rank 64"}, 400)])
def test_a_first_use_load_that_fails_in_the_plugin_is_a_500_and_a_refused_file_a_400(
        monkeypatch, answer, status):
    """The first use of a ``--steer-dir`` steer loads it before the request is admitted: a
    load the engine core refused (the file) is the request's 400 naming the file's problem; a
    load that failed in the plugin's own code (a worker's fault) is a 500 with that message,
    not a 400 blaming the request's steer."""
    from vllm.exceptions import VLLMValidationError

    async def manage(engine_, op, **kw):
        return dict(answer)

    monkeypatch.setattr(async_llm, "manage", manage)
    monkeypatch.setattr(async_llm, "admitted", lambda value: SimpleNamespace(strengths={"c": 1}))
    monkeypatch.setattr(async_llm.admission, "dir_steer_file", lambda name, loaded: "/d/c")
    monkeypatch.setattr(frontend_state(), "loaded_names", lambda: set())
    params = SimpleNamespace(extra_args={"steer": {"c": 1}})
    with pytest.raises(Exception) as e:
        asyncio.run(async_llm._preload_dir_steers(None, None, params))
    if status == 500:
        assert getattr(e.value, "http_status", None) == 500 or type(e.value).__name__ == \
            "SteerPluginError", repr(e.value)
        assert not isinstance(e.value, VLLMValidationError)
    else:
        assert isinstance(e.value, VLLMValidationError), repr(e.value)
    assert answer["error"] in str(e.value)


# ---- a streamed /v1/responses: its first events come before the request reaches the engine --
RESPONSES_EVENTS = [b"response.created", b"response.in_progress", b"response.output_text.delta",
                    b"response.completed"]


def _responses_app(stop_reason, steered=True, log=None):
    """vLLM's streamed ``/v1/responses`` route, as far as the plugin meets it:
    ``create_responses`` (the plugin's hook around a stand-in for vLLM's) returns the stream,
    which yields ``response.created`` and ``response.in_progress`` before it iterates
    ``AsyncLLM.generate`` (the plugin's hook around a stand-in engine whose one output carries
    ``stop_reason``); an exception out of ``create_responses`` is answered by vLLM's handler
    with the error's status, else a ``StreamingResponse`` sends HTTP 200, then each event; an
    exception out of the stream ends the HTTP response half-way, as in vLLM (the bug: vLLM's
    responses stream catches only its ``GenerationError``)."""
    from starlette.responses import JSONResponse, StreamingResponse
    from vllm.exceptions import GracefulHTTPError

    from vllm_steer.integrations.frontend import responses_stream

    log = [] if log is None else log
    params = SimpleNamespace(extra_args={"steer": "wire form"} if steered else None)

    async def engine(self, prompt, params, request_id):
        log.append("add_request")
        yield SimpleNamespace(request_id=request_id, outputs=[SimpleNamespace(
            stop_reason=stop_reason, finish_reason="error" if stop_reason else None)])

    async def vllm_create_responses(self, request, raw_request=None):
        if steered:  # to_sampling_params: the policy served the request a steer
            request_scope.record_applied({"d5": 1.0}, [])
            request_scope.mark_steered()
            request_scope.hold_start()  # a --steer-dir server

        async def events():
            yield b"response.created"
            yield b"response.in_progress"
            async for _ in async_llm.generate(engine, None, "p", params, "resp-1_0"):
                yield b"response.output_text.delta"
            yield b"response.completed"

        return events()

    async def app(scope, receive, send):
        request = SimpleNamespace(stream=True, background=False, request_id="resp-1")
        try:
            events = await responses_stream.create_responses(vllm_create_responses, None,
                                                             request)
        except Exception as e:  # vLLM's exception handlers (create_error_response)
            status = e.http_status if isinstance(e, GracefulHTTPError) else 400
            log.append(type(e).__name__)
            response = JSONResponse({"error": {"message": str(e), "code": status}},
                                    status_code=status)
        else:
            async def sse():
                async for event in events:
                    log.append(event.decode())
                    yield b"event: " + event + b"\n\n"

            response = StreamingResponse(sse(), media_type="text/event-stream")
        await response(scope, receive, send)

    return app


ASGI = {"type": "http", "asgi": {"spec_version": "2.4"}}


def test_a_streamed_responses_request_found_no_slot_is_a_429_before_any_event():
    from vllm_steer.integrations.protocol import BUSY_PREFIX

    log: list = []
    sent = _serve(_responses_app(BUSY_PREFIX + "steer: all 3 steer slots are in use", log=log),
                  ASGI)
    assert [m["type"] for m in sent] == ["http.response.start", "http.response.body"], sent
    assert sent[0]["status"] == 429
    headers = _headers(sent[0])
    assert headers["retry-after"] == "1", headers
    assert not [k for k in headers if k.startswith("x-vllm-steer")]  # nothing was served
    body = json.loads(sent[-1]["body"])
    assert body["error"]["code"] == 429 and "all 3 steer slots" in body["error"]["message"]
    assert b"response.created" not in b"".join(m.get("body", b"") for m in sent)
    # the engine was asked, then vLLM's handler answered the busy error (no event streamed)
    assert log == ["add_request", "SteerBankFullError"], log


def test_a_streamed_responses_request_whose_steer_the_engine_refused_is_a_400():
    from vllm_steer.integrations.protocol import REFUSED_PREFIX

    log: list = []
    sent = _serve(_responses_app(REFUSED_PREFIX + "steer: unknown steer 'zzz'; loaded steers: "
                                 "a", log=log), ASGI)
    assert sent[0]["status"] == 400, sent
    body = json.loads(sent[-1]["body"])
    assert "unknown steer 'zzz'" in body["error"]["message"], body
    assert "retry-after" not in _headers(sent[0])
    assert log == ["add_request", "VLLMValidationError"], log


@pytest.mark.parametrize("steered", [True, False])
def test_an_admitted_responses_stream_sends_every_event_in_order(steered):
    log: list = []
    sent = _serve(_responses_app(None, steered=steered, log=log), ASGI)
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 200
    bodies = [m["body"] for m in sent[1:] if m.get("body")]
    assert bodies == [b"event: " + e + b"\n\n" for e in RESPONSES_EVENTS]
    if steered:  # its first events were taken before the HTTP response began: the engine first
        assert log[0] == "add_request", log
        assert _headers(sent[0])["x-vllm-steer-applied"] == "d5=1"
    else:  # left as vLLM made it: the events stream before the request reaches the engine
        assert log[:3] == ["response.created", "response.in_progress", "add_request"], log


def _chat_stream_app(stop_reason, log: list):
    """vLLM's streamed chat completion as its API server sends it, on a server without
    ``--steer-dir`` (no first-use wait): HTTP 200 at once, then one event per engine output;
    an exception of the engine's outputs is caught by the stream and sent as an error event
    after the 200 (vLLM's ``chat_completion_stream_generator``)."""
    from fastapi.responses import StreamingResponse

    async def engine(self, prompt, params, request_id):
        log.append("add_request")
        yield SimpleNamespace(request_id=request_id, outputs=[SimpleNamespace(
            stop_reason=stop_reason, finish_reason="error" if stop_reason else None)])

    async def app(scope, receive, send):
        request_scope.record_applied({"a": 2.0}, [])
        request_scope.mark_steered()  # to_sampling_params: the request is steered

        async def chunks():
            try:
                async for _ in async_llm.generate(engine, None, "p", SimpleNamespace(
                        extra_args={"steer": "wire form"}), "chatcmpl-1"):
                    yield b'data: {"choices": [{"delta": {"role": "assistant"}}]}\n\n'
            except Exception as e:  # noqa: BLE001 - vLLM's stream: an error event
                log.append(type(e).__name__)
                yield b'data: {"error": {"message": "%s", "code": 400}}\n\n' % str(e).encode()
            yield b"data: [DONE]\n\n"

        await StreamingResponse(chunks(), media_type="text/event-stream")(scope, receive, send)

    return app


def test_a_stream_whose_steer_the_engine_core_refused_is_a_400_not_an_error_event():
    # a server with run-time updates sends a steer it does not know to the engine core (it
    # may be loaded there); the core's refusal reaches the stream after vLLM's HTTP 200
    from vllm_steer.integrations.protocol import REFUSED_PREFIX

    log: list = []
    sent = _serve(_chat_stream_app(REFUSED_PREFIX + "steer: unknown steer 'zzz'; loaded "
                                   "steers: a", log), ASGI)
    assert [m["type"] for m in sent] == ["http.response.start", "http.response.body"], sent
    assert sent[0]["status"] == 400
    headers = _headers(sent[0])
    assert headers["content-type"] == "application/json"
    assert not [k for k in headers if k.startswith("x-vllm-steer")]  # nothing was served
    body = json.loads(sent[1]["body"])
    assert body["error"]["code"] == 400 and body["error"]["param"] == "steer", body
    assert body["error"]["message"] == "steer: unknown steer 'zzz'; loaded steers: a", body
    assert int(headers["content-length"]) == len(sent[1]["body"])
    assert log == ["add_request", "VLLMValidationError"], log


def test_an_admitted_steered_stream_is_sent_unchanged():
    log: list = []
    sent = _serve(_chat_stream_app(None, log), ASGI)
    assert sent[0]["status"] == 200
    assert _headers(sent[0])["x-vllm-steer-applied"] == "a=2"
    assert [m["body"] for m in sent[1:] if m.get("body")] == [
        b'data: {"choices": [{"delta": {"role": "assistant"}}]}\n\n', b"data: [DONE]\n\n"]
    assert log == ["add_request"], log
