"""A streamed ``/v1/responses`` request refused by the plugin is answered with the refusal's
status before any event: HTTP 400 for a steer the engine core refused, HTTP 429 with
``Retry-After`` for a full bank (as a streamed completion's full bank is).

vLLM's responses stream sends ``response.created`` and ``response.in_progress`` before the
request reaches the engine (``AsyncLLM.add_request`` runs when the stream is asked for its
third event), and catches only vLLM's ``GenerationError`` there: a refusal of the plugin met
after those events would end the HTTP response half-way (no error event, no status). So for
a steered request the hook on ``OpenAIServingResponses.create_responses`` takes the stream's
events itself until the engine's first output passed the plugin's checks
(:func:`~vllm_steer.integrations.frontend.request_scope.mark_admitted`, set by
:func:`vllm_steer.integrations.frontend.async_llm.generate`), before vLLM builds the HTTP
response: a refusal then raises from ``create_responses`` and vLLM's exception handlers answer
it as for a request that is not streamed; an admitted request's stream is the same events in
the same order, its first ones sent with its first token (as a chat completion's first chunk).
A request served unsteered, not streamed or run in the background is left as vLLM made it.

This module imports no torch (the frontend imports it).
"""

from __future__ import annotations

import contextlib
import inspect

from vllm_steer.integrations import guard, vllm_access
from vllm_steer.integrations.frontend import request_scope

#: The hook's name in the guard's messages.
WHERE = "OpenAIServingResponses.create_responses"


async def create_responses(orig, self, request, *args, **kwargs):
    """``OpenAIServingResponses.create_responses``: a steered streamed request's stream is
    returned once the engine admitted its steers (:func:`_until_admitted`); a refusal before
    that raises here, answered by vLLM with its status."""
    out = await orig(self, request, *args, **kwargs)
    if not inspect.isasyncgen(out):  # an error, or a response that is not streamed
        return out
    with guard.frontend(WHERE, vllm_access.request_id(request)):
        box = held_box(request)
    if box is None:
        return out
    return await _until_admitted(out, box)


def held_box(request) -> dict | None:
    """The HTTP request's box (:mod:`~vllm_steer.integrations.frontend.request_scope`) if the
    stream of ``request`` waits for its admission: a steered request streamed in the
    foreground; else None."""
    box = request_scope.current()
    if box is None or not request_scope.steered(box):
        return None
    return box if vllm_access.responses_streamed_in_foreground(request) else None


async def _until_admitted(events, box: dict):
    """``events`` (vLLM's responses stream), its first events taken until the request is
    admitted (or the stream ends): a refusal met meanwhile raises here. Returns the stream,
    those events first."""
    first: list = []
    while not request_scope.admitted(box):
        try:
            first.append(await anext(events))
        except StopAsyncIteration:
            break
    return _replay(first, events)


async def _replay(first: list, events):
    """``first``, then the rest of ``events`` (closed with this stream)."""
    async with contextlib.aclosing(events) as rest:
        for event in first:
            yield event
        async for event in rest:
            yield event
