"""What one HTTP request of the API server carries between vLLM's hooks and our response
headers: the steers it is served with (for ``x-vllm-steer-*``), the run-time preset its
model check read, whether it is steered and its steers were admitted by the engine, and
whether it may wait for a steer slot or was refused with HTTP 429 (``Retry-After``) or by the
engine core (HTTP 400). One
mutable box per HTTP request, opened by the headers middleware
(:class:`vllm_steer.server.presets_route.SteerHeadersMiddleware`, :func:`open_scope`); outside
an HTTP request (offline) every function here is a no-op.

Light: standard library only.
"""

from __future__ import annotations

from contextvars import ContextVar
from typing import Any

# One mutable box per HTTP request, set by the middleware; mutated (never re-set) by
# record_applied, so it is seen across the context copies of tasks and threads.
_BOX: ContextVar[dict | None] = ContextVar("vllm_steer_applied", default=None)


def open_scope() -> tuple[dict, Any]:
    """A new box for this HTTP request: ``(box, token)``; :func:`close_scope` with the token."""
    box: dict = {}
    return box, _BOX.set(box)


def close_scope(token) -> None:
    _BOX.reset(token)


def record_applied(values: dict[str, Any], floored: list[str]) -> None:
    """Remember the steers this HTTP request is served with (no-op outside a request)."""
    box = _BOX.get()
    if box is None:
        return
    from vllm_steer.policy import APPLIED_HEADER, header_values

    headers = header_values(values, floored)
    if headers.get(APPLIED_HEADER) or len(headers) > 1:
        box["headers"] = headers


def pin_preset(name: str, mix: dict | None) -> None:
    """Remember the preset mix this HTTP request's model check read (no-op outside a
    request): :func:`pinned_preset` gives it to ``to_sampling_params`` even if the view
    changes in between."""
    box = _BOX.get()
    if box is not None:
        box["preset"] = (name, mix)


def pinned_preset(name: str) -> tuple[bool, dict | None]:
    """``(True, mix)`` if this HTTP request's model check read ``name``'s preset (mix None:
    none of that name), else ``(False, None)``."""
    box = _BOX.get()
    got = box.get("preset") if box is not None else None
    if got is not None and got[0] == name:
        return True, got[1]
    return False, None


def note_preset_model(name: str) -> None:
    """This HTTP request's model check admitted ``name`` as a preset (a model name that is
    neither a served model nor a LoRA adapter). No-op outside a request."""
    box = _BOX.get()
    if box is not None:
        box["preset_model"] = name


def note_policy_applied() -> None:
    """A ``to_sampling_params`` of this HTTP request applied the policy (its preset, defaults,
    floors): the route serves presets. No-op outside a request."""
    box = _BOX.get()
    if box is not None:
        box["policy_applied"] = True


def unserved_preset() -> str | None:
    """The preset this HTTP request names as its model when no ``to_sampling_params`` of the
    request applied it (a route that builds its own sampling parameters); None otherwise, or
    outside a request."""
    box = _BOX.get()
    if box is None or box.get("policy_applied"):
        return None
    return box.get("preset_model")


def current() -> dict | None:
    """This HTTP request's box (None outside one)."""
    return _BOX.get()


def mark_steered() -> None:
    """This HTTP request is served with a steer (its admission may refuse it: an unknown
    steer the engine core knows nothing of, a full bank). No-op outside a request."""
    box = _BOX.get()
    if box is not None:
        box["steered"] = True


def mark_admitted() -> None:
    """The engine's first output for this HTTP request passed the plugin's checks: its steers
    were admitted, nothing of the plugin refuses it any more. No-op outside a request."""
    box = _BOX.get()
    if box is not None:
        box["admitted"] = True


def steered(box: dict) -> bool:
    """Whether the request ``box`` belongs to is served with a steer (:func:`mark_steered`)."""
    return bool(box.get("steered"))


def admitted(box: dict) -> bool:
    """Whether the request ``box`` belongs to was admitted (:func:`mark_admitted`)."""
    return bool(box.get("admitted"))


def hold_start() -> None:
    """This HTTP request may wait for a steer slot (a steer it names is loaded on first use):
    the response's start is held until its first body, so a stream that has not begun can
    still be answered with HTTP 429 (:func:`refuse_busy`). No-op outside a request."""
    box = _BOX.get()
    if box is not None:
        box["hold"] = True


def refuse_busy(message: str, retry_after: int) -> None:
    """This HTTP request is refused with HTTP 429: ``message``, and ``Retry-After:
    retry_after`` (seconds) on its response (no-op outside a request)."""
    box = _BOX.get()
    if box is not None:
        box["busy"] = (message, int(retry_after))


def refuse_steer(message: str) -> None:
    """The engine core refused this HTTP request's steer (HTTP 400, ``param: "steer"``):
    ``message`` (no-op outside a request). A stream that has not begun is answered with it
    (:class:`vllm_steer.server.presets_route.SteerHeadersMiddleware`)."""
    box = _BOX.get()
    if box is not None:
        box["refused"] = message


def refused(box: dict) -> str | None:
    """The engine core's refusal of the request ``box`` belongs to (:func:`refuse_steer`)."""
    return box.get("refused")


def held(box: dict) -> bool:
    """Whether the response of the request ``box`` belongs to waits for its first body."""
    return bool(box.get("hold"))


def busy(box: dict) -> tuple[str, int] | None:
    """``(message, retry_after)`` if the request ``box`` belongs to was refused with 429."""
    return box.get("busy")
