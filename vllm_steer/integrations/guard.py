"""The one guard around the plugin's request-scoped work in the frontend and the engine core.

Nothing a request or a management call brings may take a replica down. Every hook of the
``frontend`` and ``engine`` groups that runs per request or per management call runs the
plugin's own code inside this guard (never vLLM's: the wrapped original is called outside
it, so vLLM's own errors keep vLLM's handling):

- a **client's error** (:func:`is_client_error`: a bad ``steer`` value, a refused steer,
  over a limit) becomes that request's HTTP 400, with the message that names the problem;
- a request that found **no room now** (every steer slot held by running requests, after
  waiting) becomes HTTP 429 with ``Retry-After`` (:func:`busy_error`): a client retries it;
- **anything else** is a fault of the plugin: its traceback is logged once, and the request
  (only that one) fails with HTTP 500 and a message naming vllm-steer, the hook and the
  request id (:func:`internal_message`). The engine core keeps stepping and every other
  request is served.

The engine core cannot raise into vLLM's busy loop (an exception there ends the engine): it
answers a refused request with an error output whose ``stop_reason`` carries
:data:`~vllm_steer.integrations.protocol.REFUSED_PREFIX` (400),
:data:`~vllm_steer.integrations.protocol.BUSY_PREFIX` (429: no room in the bank now) or
:data:`~vllm_steer.integrations.protocol.FAILED_PREFIX` (500), and a failed management call
with an error answer (:func:`management_failure`). The frontend raises vLLM's own exception
types, which vLLM's exception handlers answer with that status (:func:`frontend`).

Worker-step hooks (the steered LM head, the runners' rows, the per-request steer state) serve
a whole batch at once: a fault there fails the step's steered requests with the same HTTP 500
message (:mod:`vllm_steer.integrations.worker.step_faults`, finished by the engine core's
scheduler hook, :mod:`vllm_steer.integrations.engine.worker_faults`), the step's other requests
get vLLM's plain logits, and the engine goes on. Admission still refuses everything from
request data that could reach them (names, strengths, windows, counts).

Light: standard library only (vLLM's exception types are imported when a guard fires).
"""

from __future__ import annotations

import contextlib
import functools
from typing import Iterator

from vllm_steer.logs import get_logger
from vllm_steer.request import SteerRequestError

logger = get_logger()

#: The HTTP status of a client's error, and of a fault of the plugin.
CLIENT_STATUS, INTERNAL_STATUS = 400, 500
#: The HTTP status of a request that found no room now and may retry (a full steer bank).
BUSY_STATUS = 429


def is_client_error(exc: BaseException) -> bool:
    """Whether ``exc`` is the client's error (HTTP 400): a :class:`~vllm_steer.request.
    SteerRequestError` (every refusal of request data, the engine core's admission refusals
    included) or vLLM's own client error types."""
    if isinstance(exc, SteerRequestError):
        return True
    try:
        from vllm.exceptions import VLLMClientError
    except ImportError:  # pragma: no cover - every supported vLLM has it
        return False
    return isinstance(exc, VLLMClientError)


#: The attribute of an exception that records what the plugin's code it ended had changed
#: already (:func:`note_outcome`).
OUTCOME_ATTR = "vllm_steer_outcome"


def note_outcome(exc: BaseException, text: str) -> None:
    """Record on ``exc`` what the failed step had changed already (a sentence: "steer 'a' is
    unloaded"): the failure's message says it (:func:`management_failure`,
    :func:`internal_message`) instead of "nothing was changed"."""
    setattr(exc, OUTCOME_ATTR, text)  # every exception instance takes attributes


def outcome_of(exc: BaseException) -> str | None:
    """What the step ``exc`` ended had changed already (:func:`note_outcome`), or None."""
    return getattr(exc, OUTCOME_ATTR, None)


def internal_message(where: str, request_id: object, exc: BaseException) -> str:
    """The message of a fault of the plugin: names vllm-steer, the hook, the request id and
    the error, and what it had changed already (:func:`note_outcome`); the traceback is in
    the server's log."""
    text = " ".join(str(exc).split())[:500]
    rid = f"request {request_id}" if request_id is not None else "a request"
    changed = outcome_of(exc)
    return (f"vllm-steer: internal error in {where} while serving {rid}: "
            f"{type(exc).__name__}{': ' + text if text else ''}. This request was not served"
            f"{'; ' + changed if changed else ''}; the server goes on serving others (the "
            "traceback is in the server log)")


def classify(exc: BaseException, where: str, request_id: object) -> tuple[int, str]:
    """``(status, message)`` of ``exc`` raised by the plugin's code at hook ``where`` for
    ``request_id``; a fault of the plugin is logged here, once, with its traceback."""
    if is_client_error(exc):
        return CLIENT_STATUS, str(exc.args[0]) if exc.args else str(exc)
    logger.error("vllm-steer: internal error in %s for request %s", where, request_id,
                 exc_info=(type(exc), exc, exc.__traceback__))
    return INTERNAL_STATUS, internal_message(where, request_id, exc)


@functools.cache
def _plugin_error_class() -> type:
    """:class:`PluginError`'s class: a vLLM ``GenerationError`` (HTTP 500 with its message)."""
    try:
        from vllm.exceptions import GenerationError
    except ImportError:  # pragma: no cover - every supported vLLM has it
        GenerationError = RuntimeError

    class SteerPluginError(GenerationError):
        """A fault of the vllm-steer plugin while serving one request (HTTP 500)."""

    return SteerPluginError


def internal_error(message: str) -> Exception:
    """The exception the frontend raises for a fault of the plugin: a vLLM
    ``GenerationError`` (HTTP 500 with ``message``)."""
    return _plugin_error_class()(message)


@functools.cache
def _busy_error_class() -> type:
    """:func:`busy_error`'s class: a vLLM ``GracefulHTTPError`` (HTTP 429 with its message)."""
    from vllm.exceptions import GracefulHTTPError

    class SteerBankFullError(GracefulHTTPError):
        """No steer slot could be had in time for this request (HTTP 429, retry later)."""

        reason = "bank_full"  # vllm_steer.request.REFUSAL_REASONS

    return SteerBankFullError


def busy_error(message: str) -> Exception:
    """The exception the frontend raises for a request that may succeed when retried (a full
    steer bank): a vLLM ``GracefulHTTPError`` with HTTP 429 and ``message``; its
    ``Retry-After`` header comes from the request's scope
    (:func:`vllm_steer.integrations.frontend.request_scope.refuse_busy`)."""
    from http import HTTPStatus

    return _busy_error_class()(message, HTTPStatus(BUSY_STATUS))


def is_busy_error(exc: BaseException) -> bool:
    """Whether ``exc`` is :func:`busy_error`'s (it passes the guard as it is)."""
    try:
        return isinstance(exc, _busy_error_class())
    except ImportError:  # pragma: no cover - every supported vLLM has it
        return False


def plugin_error_in(exc: BaseException) -> BaseException | None:
    """The plugin's own error that ``exc`` carries, if any: vLLM's ``AsyncLLM.generate``
    re-raises a failure of ``add_request`` as an ``EngineGenerateError`` without its
    message, the plugin's error as its cause."""
    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, _plugin_error_class()):
            return exc
        exc, seen = exc.__cause__, seen + 1
    return None


@contextlib.contextmanager
def frontend(where: str, request_id: object = None, count: bool = True) -> Iterator[None]:
    """Run the plugin's code of frontend hook ``where`` (API server or ``LLM`` process) for
    one request: a client's error passes as it is (vLLM answers it with HTTP 400), and so
    do :func:`busy_error`'s (HTTP 429) and :func:`internal_error`'s (HTTP 500 with the message
    already made, as for a fault the engine core reported); anything
    else is logged once and raised as vLLM's ``GenerationError`` (HTTP 500) naming
    vllm-steer, the hook and ``request_id``. Either is counted as this process's refusal
    (:func:`vllm_steer.metrics.count_refusal`) unless ``count`` is False (a refusal the
    engine core counted already)."""
    from vllm_steer.metrics import count_refusal

    try:
        yield
    except Exception as e:
        if is_busy_error(e):
            if count:
                count_refusal(e, BUSY_STATUS)
            raise
        if isinstance(e, _plugin_error_class()):  # the plugin's 500, its message already made
            if count:                              # (a fault the engine core reported)
                count_refusal(e, INTERNAL_STATUS)
            raise
        status, message = classify(e, where, request_id)
        if status == CLIENT_STATUS:
            if count:
                count_refusal(e, status)
            raise
        err = internal_error(message)
        if count:
            count_refusal(err, status)
        raise err from None


def management_failure(op: str, exc: BaseException) -> dict:
    """The answer of a management call whose op failed in the plugin's code: HTTP 500 naming
    vllm-steer and the op (the traceback is logged once); the op changed nothing, but what
    the error records (:func:`note_outcome`: a load that failed after a worker wrote over
    another steer's slot), which the message says."""
    status, message = classify(exc, f"the steer management op {op!r}", None)
    if status == CLIENT_STATUS:
        return {"ok": False, "status": status, "error": message}
    changed = outcome_of(exc)
    return {"ok": False, "status": status,
            "error": (f"vllm-steer: the steer management op {op!r} failed: "
                      f"{type(exc).__name__}: {' '.join(str(exc).split())[:500]}; "
                      + (f"{changed}; nothing else was changed" if changed else
                         "nothing was changed") + " (the traceback is in the server log)")}
