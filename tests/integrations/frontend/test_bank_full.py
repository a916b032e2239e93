"""A full steer bank in the API server, without an engine: a first-use request asks the engine
core again only when a steered request ends (or at the fallback period), never on a timer of
its own; each wait counts once by outcome; a wait that ends without a slot is HTTP 429 with
``Retry-After``, also for a stream that had not begun (the headers middleware)."""

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
def _serve(app):
    """Run ``app`` behind the headers middleware for one HTTP request: the messages sent."""
    from vllm_steer.server.presets_route import SteerHeadersMiddleware

    sent = []

    async def send(message):
        sent.append(message)

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    asyncio.run(SteerHeadersMiddleware(app)({"type": "http"}, receive, send))
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
