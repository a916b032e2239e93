"""What the frontend (API server / ``LLM``) process knows of the steers: names and limits,
read from the steer files' metadata only (no torch). Used to reject bad requests: when an
OpenAI request body is parsed (:func:`check_request_fields`, a pydantic validator on the
request models, so streaming and non-streaming requests get HTTP 400 before anything is
sent) and again at admission (:func:`validate`, ``validate_params`` of our processor).
"""

from __future__ import annotations

from typing import Any

from vllm_steer import REQUEST_FIELD
from vllm_steer.config import SteerRequestError, SteerServerConfig, parse_request_steer

_CONFIG: SteerServerConfig | None = None


def set_config(config: SteerServerConfig | None) -> None:
    global _CONFIG
    _CONFIG = config


def get_config() -> SteerServerConfig | None:
    return _CONFIG


def check_value(value: Any, where: str = REQUEST_FIELD) -> dict[str, float]:
    """Parse a request's steer value against this server's steers and limits.

    Returns name -> strength (zeros dropped); raises :class:`SteerRequestError`. A server
    without steers accepts only values whose strengths are all 0.
    """
    cfg = _CONFIG
    if cfg is None or not cfg.steers:
        try:
            if not parse_request_steer(value, None, float("inf"), where):
                return {}  # well-formed and only zero strengths: nothing to steer
        except SteerRequestError:
            pass  # whatever is wrong with it, no steer can be applied here
        raise SteerRequestError(f"{where}: this server has no steers loaded (start it "
                                "with `vllm serve MODEL --steer NAME=PATH`)")
    return parse_request_steer(value, cfg.steers, cfg.max_strength, where)


def _field_error_class():
    """``SteerRequestError`` that vLLM also reads as a ``VLLMValidationError`` with
    ``param: "steer"`` (pydantic turns only ``ValueError`` into a validation error)."""
    global _FIELD_ERROR
    if _FIELD_ERROR is None:
        try:
            from vllm.exceptions import VLLMValidationError
        except ImportError:  # older vLLM: a ValueError is a 400 too
            _FIELD_ERROR = SteerRequestError
        else:
            class SteerFieldError(SteerRequestError, VLLMValidationError):
                def __init__(self, message: str):
                    VLLMValidationError.__init__(self, message, parameter=REQUEST_FIELD)

                def __str__(self) -> str:
                    return str(self.args[0]) if self.args else ""

            _FIELD_ERROR = SteerFieldError
    return _FIELD_ERROR


_FIELD_ERROR: Any = None


def field_error(message: str) -> SteerRequestError:
    return _field_error_class()(message)


def check_request_fields(steer: Any, xargs: Any) -> None:
    """The parse-time check of an OpenAI request's ``steer`` field and
    ``vllm_xargs["steer"]``: raises a ``ValueError`` that vLLM answers with HTTP 400 and
    ``param: "steer"``."""
    try:
        xs = xargs.get(REQUEST_FIELD) if isinstance(xargs, dict) else None
        if steer is not None and xs is not None:
            raise SteerRequestError(f"{REQUEST_FIELD}: given both as a top-level field and in "
                                    "vllm_xargs; use one")
        if steer is not None:
            check_value(steer)
        elif xs is not None:
            check_value(xs)
    except SteerRequestError as e:
        raise field_error(str(e)) from None


def validate(params: Any) -> None:
    """Raise ``VLLMValidationError`` (HTTP 400, ``param: "steer"``) if the steer field is bad."""
    try:
        _validate(params)
    except SteerRequestError as e:
        try:
            from vllm.exceptions import VLLMValidationError
        except ImportError:  # older vLLM: a ValueError is a 400 too
            raise
        raise VLLMValidationError(str(e), parameter=REQUEST_FIELD) from None


def _validate(params: Any) -> None:
    extra = getattr(params, "extra_args", None) or {}
    value = extra.get(REQUEST_FIELD)
    if value is None:
        return
    check_value(value)
