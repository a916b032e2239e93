"""``POST /v1/steer/highlight`` on the vLLM server (entry point ``vllm.endpoint_plugins``).

The lens's highlight computed by the engine: the text's prompt log-probabilities with the
steer and without it (two ``max_tokens=1`` requests with ``prompt_logprobs=0``; steered
prompt logprobs: see ``docs/serving.md``), their per-token difference, and the best spans by
:func:`vllm_steer.lens.highlight.best_spans`. Same JSON as ``vllm-steer highlight --json``.

vLLM loads endpoint plugins only when named in ``VLLM_PLUGINS``::

    VLLM_PLUGINS=vllm_steer,vllm_steer_lens vllm serve MODEL --steer detox=detox.safetensors

    curl localhost:8000/v1/steer/highlight -H 'Content-Type: application/json' \
        -d '{"text": "you are an idiot", "steer": {"detox": -5}, "k": 2}'
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, JSONResponse
from pydantic import BaseModel, Field

from vllm_steer.integrations import vllm_access as va
from vllm_steer.integrations.frontend.async_llm import RETRY_AFTER_SECONDS
from vllm_steer.server.errors import error_response, error_type

router = APIRouter()

#: Highlight requests served at once per API-server process; more get HTTP 429.
MAX_CONCURRENT_HIGHLIGHTS = 4
#: Characters of text per token of the model's context accepted before tokenising.
MAX_CHARS_PER_TOKEN = 32
_in_flight = 0


class HighlightRequest(BaseModel):
    """Body of ``POST /v1/steer/highlight``."""

    text: str = Field(..., min_length=1, description="Text to analyse.")
    steer: dict[str, Any] = Field(..., description="Steer strengths, e.g. {\"detox\": 5}: the "
                                  "side whose evidence is highlighted.")
    against: dict[str, Any] | None = Field(None, description="Strengths to compare with "
                                           "(default: the plain model).")
    k: int = Field(3, ge=1, le=64, description="At most k spans.")
    max_len: int = Field(8, ge=1, le=512, description="At most max_len tokens per span.")
    format: Literal["json", "html"] = "json"
    model: str | None = Field(None, description="Ignored (the served model is used).")


def _error(status: int, message: str, param: str | None = "steer") -> JSONResponse:
    kind = "NotImplementedError" if status == 501 else error_type(status)
    return error_response(status, message, kind, param)


def _check_strengths(body: HighlightRequest) -> JSONResponse | None:
    """The request-field check of the completions routes, on ``steer`` and ``against``."""
    from vllm_steer.integrations.frontend.admission import check_value
    from vllm_steer.request import SteerRequestError, Window

    mixes = []
    for where in ("steer", "against"):
        try:
            named = check_value(getattr(body, where), where).named
        except SteerRequestError as e:
            return _error(400, str(e), where)
        windows = sorted(n for n, v in named.items() if isinstance(v, Window))
        if windows:  # a text's own tokens are no generated tokens: a window would be its base
            return _error(400, f"{where}: steer {', '.join(map(repr, windows))} is given a "
                          "generation window, which applies to generated tokens only; a "
                          "highlight scores the text's own tokens: give a strength (a number)",
                          where)
        mixes.append({n: v for n, v in named.items() if v != 0.0})
    if mixes[0] == mixes[1]:
        plain = "none (the plain model)"
        return _error(400, f"steer {mixes[0] or plain} and against {mixes[1] or plain} are the "
                      "same mix: every score would be 0; give a steer to compare with the plain "
                      "model, or another against")
    return None


async def _prompt_logprobs(engine, ids: list[int], steer: dict | None) -> list[float | None]:
    """The prompt logprobs of ``ids`` served with exactly ``steer`` (None: the plain model):
    admitted here, so the operator's ``--steer-default`` and ``--steer-floor`` (which are for
    generation requests) apply to neither side of a highlight."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from vllm_steer.integrations.frontend.admission import check_value
    from vllm_steer.request import SteerRequest

    request = check_value(steer) if steer else SteerRequest()
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0,
                            extra_args={"steer": request.to_wire()})
    final = None
    async for out in va.engine_generate(engine, TokensPrompt(prompt_token_ids=ids), params,
                                        f"steer-highlight-{uuid.uuid4().hex}"):
        final = out
    return va.prompt_token_logprobs(final, ids)


@router.post("/v1/steer/highlight")
async def highlight(body: HighlightRequest, raw: Request):
    """Bounded: the text fits the model's context, at most ``MAX_CONCURRENT_HIGHLIGHTS`` run
    at once, and tokenising, the span search and rendering run off the event loop."""
    global _in_flight

    engine = getattr(raw.app.state, "vllm_steer_engine", None)
    if engine is None:
        return _error(503, "no engine behind this server", None)
    bad = _check_strengths(body)
    if bad is not None:
        return bad
    if _in_flight >= MAX_CONCURRENT_HIGHLIGHTS:
        busy = _error(429, f"too many highlight requests at once (at most "
                           f"{MAX_CONCURRENT_HIGHLIGHTS}); retry after {RETRY_AFTER_SECONDS} s",
                      None)
        busy.headers["Retry-After"] = str(RETRY_AFTER_SECONDS)  # as the completions' 429
        return busy
    _in_flight += 1
    try:
        return await _highlight(body, engine)
    finally:
        _in_flight -= 1


async def _highlight(body: HighlightRequest, engine):
    from vllm_steer.lens.highlight import best_spans, text_pieces, to_html, to_json

    max_model_len = va.max_model_len(va.engine_model_config(engine))
    if max_model_len and len(body.text) > MAX_CHARS_PER_TOKEN * max_model_len:
        return _error(400, f"text is {len(body.text)} characters; this server's context is "
                           f"{max_model_len} tokens (max_model_len), so at most "
                           f"{MAX_CHARS_PER_TOKEN * max_model_len} characters are read", "text")
    tokenizer = await va.engine_tokenizer(engine)
    ids, pieces = await asyncio.to_thread(text_pieces, tokenizer, body.text)
    prefix = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else \
        ([tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else [])
    full = prefix + ids
    if max_model_len and len(full) + 1 > max_model_len:
        limit = max_model_len - 1 - len(prefix)
        return _error(400, f"text is {len(ids)} tokens; this server's context is "
                           f"{max_model_len} tokens (max_model_len), so a highlighted text may "
                           f"have at most {limit} tokens", "text")
    try:
        steered = await _prompt_logprobs(engine, full, body.steer)
        base = await _prompt_logprobs(engine, full, body.against)
    except Exception as e:  # noqa: BLE001 -- VLLMValidationError is not a ValueError
        if not (isinstance(e, ValueError) or type(e).__name__ == "VLLMValidationError"):
            raise
        msg = str(e.args[0]) if e.args else type(e).__name__
        return _error(400, msg[:1000], getattr(e, "parameter", None))
    scores = [None if a is None or b is None else a - b
              for a, b in zip(steered[len(prefix):], base[len(prefix):], strict=False)]
    spans = await asyncio.to_thread(best_spans, [s or 0.0 for s in scores], body.k,
                                    body.max_len)
    info = {"steer": body.steer, "against": body.against or {}, "k": body.k,
            "max_len": body.max_len, "source": "engine prompt logprobs"}
    if body.format == "html":
        page = await asyncio.to_thread(to_html, pieces, scores, spans, subtitle=(
            f"steer {body.steer} against {body.against or 'the plain model'}"))
        return HTMLResponse(page)
    return JSONResponse(await asyncio.to_thread(to_json, pieces, scores, spans, **info))


class SteerLensEndpoint:
    """vLLM endpoint plugin adding the lens routes (and the playground page, ``/steer/``)."""

    name = "vllm_steer_lens"
    required_tasks = ("generate",)

    def attach_router(self, app) -> None:
        from vllm_steer.server.playground import router as playground_router

        app.include_router(router)
        app.include_router(playground_router)

    async def init_state(self, engine_client, state, args) -> None:
        state.vllm_steer_engine = engine_client
