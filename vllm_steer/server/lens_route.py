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

import uuid
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, JSONResponse
from pydantic import BaseModel, Field

router = APIRouter()

V2_REFUSAL = ("/v1/steer/highlight needs steered prompt logprobs, which Model Runner V2 computes "
              "unsteered (its scores would all be zero); serve with the V1 model runner "
              "(VLLM_USE_V2_MODEL_RUNNER=0) to use the highlight route")


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


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": "BadRequestError",
                                   "param": "steer", "code": status}}, status_code=status)


async def _prompt_logprobs(engine, ids: list[int], steer: dict | None) -> list[float | None]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0,
                            extra_args={"steer": steer} if steer else None)
    final = None
    async for out in engine.generate(TokensPrompt(prompt_token_ids=ids), params,
                                     f"steer-highlight-{uuid.uuid4().hex}"):
        final = out
    lps = final.prompt_logprobs or []
    return [None if e is None else e[t].logprob for e, t in zip(lps, ids)]


@router.post("/v1/steer/highlight")
async def highlight(body: HighlightRequest, raw: Request):
    from vllm_steer.lens.highlight import best_spans, text_pieces, to_html, to_json

    engine = getattr(raw.app.state, "vllm_steer_engine", None)
    if engine is None:
        return _error(503, "no engine behind this server")
    if getattr(getattr(engine, "vllm_config", None), "use_v2_model_runner", False):
        return _error(501, V2_REFUSAL)
    tokenizer = await engine.get_tokenizer() if _is_coro(engine.get_tokenizer) \
        else engine.get_tokenizer()
    ids, pieces = text_pieces(tokenizer, body.text)
    prefix = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else \
        ([tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else [])
    full = prefix + ids
    try:
        steered = await _prompt_logprobs(engine, full, body.steer)
        base = await _prompt_logprobs(engine, full, body.against)
    except ValueError as e:  # VLLMValidationError: unknown steer, bad strength, ...
        return _error(400, str(e))
    scores = [None if a is None or b is None else a - b
              for a, b in zip(steered[len(prefix):], base[len(prefix):])]
    spans = best_spans([s or 0.0 for s in scores], k=body.k, max_len=body.max_len)
    info = {"steer": body.steer, "against": body.against or {}, "k": body.k,
            "max_len": body.max_len, "source": "engine prompt logprobs"}
    if body.format == "html":
        return HTMLResponse(to_html(pieces, scores, spans, subtitle=(
            f"steer {body.steer} against {body.against or 'the plain model'}")))
    return JSONResponse(to_json(pieces, scores, spans, **info))


def _is_coro(fn) -> bool:
    import inspect

    return inspect.iscoroutinefunction(fn)


class SteerLensEndpoint:
    """vLLM endpoint plugin adding the lens routes."""

    name = "vllm_steer_lens"
    required_tasks = ("generate",)

    def attach_router(self, app) -> None:
        app.include_router(router)

    async def init_state(self, engine_client, state, args) -> None:
        state.vllm_steer_engine = engine_client
