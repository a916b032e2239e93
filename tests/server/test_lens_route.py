"""``POST /v1/steer/highlight`` without an engine: a stand-in engine whose prompt logprobs
are known, behind the real route. Limits (context length, concurrency), the request-field
check of ``steer``/``against`` and the labels of errors (issue 14). The route on a real
server: tests/e2e/test_vllm_server.py."""

import asyncio
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")
import httpx  # noqa: E402
from fastapi import FastAPI  # noqa: E402

from vllm_steer.config import SteerServerConfig  # noqa: E402
from vllm_steer.integrations.frontend.state import frontend_state  # noqa: E402
from vllm_steer.request import SteerRequest  # noqa: E402
from vllm_steer.server import lens_route  # noqa: E402

CONTEXT = 64


class StandInEngine:
    """Prompt logprob of token t: -1 plain, -1 + strength/10 * (t % 2 ? 1 : -1) steered."""

    def __init__(self, tokenizer, gate: asyncio.Event | None = None):
        self.tokenizer, self.gate = tokenizer, gate
        self.model_config = SimpleNamespace(max_model_len=CONTEXT)
        self.started = 0
        self.sent = []

    async def get_tokenizer(self):
        return self.tokenizer

    async def generate(self, prompt, params, request_id):
        self.started += 1
        if self.gate is not None:
            await self.gate.wait()
        ids = prompt["prompt_token_ids"]
        # the route sends the mix it wants admitted already (the frontend's serialised form),
        # so the operator's defaults and floors do not change it
        request = SteerRequest.from_wire((params.extra_args or {})["steer"])
        self.sent.append(dict(request.strengths))
        s = sum(request.strengths.values())
        lps = [None] + [{t: SimpleNamespace(logprob=-1.0 + s / 10 * (1 if t % 2 else -1))}
                        for t in ids[1:]]
        yield SimpleNamespace(prompt_logprobs=lps)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(autouse=True)
def steers():
    old = frontend_state().config
    frontend_state().reset(SteerServerConfig(steers={"detox": "d"}, max_strength=20))
    yield
    frontend_state().reset(old)


def _app(engine):
    app = FastAPI()
    lens_route.SteerLensEndpoint().attach_router(app)
    app.state.vllm_steer_engine = engine
    return app


async def _post(app, bodies):
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
        return await asyncio.gather(*(c.post("/v1/steer/highlight", json=b) for b in bodies))


def post(app, body):
    return asyncio.run(_post(app, [body]))[0]


def test_scores_are_the_logprob_difference(tokenizer):
    text = "one two three four"
    r = post(_app(StandInEngine(tokenizer)), {"text": text, "steer": {"detox": 5}, "k": 1})
    assert r.status_code == 200, r.text
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert r.json()["scores"] == pytest.approx([0.5 if t % 2 else -0.5 for t in ids])


def test_a_highlight_is_sent_past_the_operators_defaults_and_floors(tokenizer):
    # --steer-default and --steer-floor are for generation: the steered side is exactly the
    # request's mix and the base the plain model (an admitted form the engine serves as is)
    frontend_state().reset(SteerServerConfig(steers={"detox": "d", "calm": "c"},
                                             max_strength=20, defaults={"calm": 2.0},
                                             floors={"detox": 1.0}))
    engine = StandInEngine(tokenizer)
    r = post(_app(engine), {"text": "one two three four", "steer": {"detox": -5}, "k": 1})
    assert r.status_code == 200, r.text
    assert engine.sent == [{"detox": -5.0}, {}]


def test_text_longer_than_the_context_is_400_on_text(tokenizer):
    engine = StandInEngine(tokenizer)
    r = post(_app(engine), {"text": "word " * 200, "steer": {"detox": 5}})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "text" and f"context is {CONTEXT} tokens" in err["message"]
    assert "at most" in err["message"] and engine.started == 0
    r = post(_app(engine), {"text": "x" * (40 * CONTEXT), "steer": {"detox": 5}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "text"


@pytest.mark.parametrize("body, param, fragment", [
    ({"steer": {"toxic": 1}}, "steer", "unknown steer 'toxic'"),
    ({"steer": {"detox": int("9" * 400)}}, "steer", "exceeds"),
    ({"steer": {"detox": 1}, "against": {"detox": "1_0"}}, "against", "must be a number"),
    # a window applies to generated tokens: on the text's own tokens it would be its base
    # (0 here: every score 0, answered 200 before)
    ({"steer": {"detox": {"strength": 5, "start": 0, "end": 32}}}, "steer",
     "steer 'detox' is given a generation window, which applies to generated tokens only"),
    ({"steer": {"detox": 2}, "against": {"detox": {"strength": 5, "base": 1}}}, "against",
     "give a strength (a number)"),
])
def test_bad_strengths_are_400_before_the_engine(tokenizer, body, param, fragment):
    engine = StandInEngine(tokenizer)
    r = post(_app(engine), {"text": "hello there", **body})
    assert r.status_code == 400 and engine.started == 0
    err = r.json()["error"]
    assert err["param"] == param and fragment in err["message"] and len(r.content) < 2000


def test_concurrent_highlights_are_bounded(tokenizer):
    async def run():
        gate = asyncio.Event()
        engine = StandInEngine(tokenizer, gate)
        app = _app(engine)
        body = {"text": "hello there", "steer": {"detox": 5}}
        n = lens_route.MAX_CONCURRENT_HIGHLIGHTS
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            held = [asyncio.create_task(c.post("/v1/steer/highlight", json=body))
                    for _ in range(n)]
            while engine.started < n:
                await asyncio.sleep(0.01)
            extra = await c.post("/v1/steer/highlight", json=body)
            gate.set()
            done = await asyncio.gather(*held)
            after = await c.post("/v1/steer/highlight", json=body)
        return extra, done, after

    extra, done, after = asyncio.run(run())
    assert extra.status_code == 429 and "at most" in extra.json()["error"]["message"]
    assert extra.headers["Retry-After"] == "1"  # as a completion's 429 says when to retry
    assert [r.status_code for r in done] == [200] * lens_route.MAX_CONCURRENT_HIGHLIGHTS
    assert after.status_code == 200


@pytest.mark.parametrize("body", [{"steer": {"detox": 3}, "against": {"detox": 3}},
                                  {"steer": {}}, {"steer": {"detox": 0}}])
def test_a_highlight_whose_two_sides_are_the_same_mix_is_refused(tokenizer, body):
    engine = StandInEngine(tokenizer)
    r = post(_app(engine), {"text": "one two three four", **body})
    assert r.status_code == 400 and engine.started == 0
    assert "are the same mix: every score would be 0" in r.json()["error"]["message"]
