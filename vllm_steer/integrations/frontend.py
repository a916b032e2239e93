"""What the frontend (API server / ``LLM``) process knows of the steers: names and limits,
read from the steer files' metadata only (no torch). Used to reject bad requests at admission.
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
    cfg = _CONFIG
    if cfg is None or not cfg.steers:
        if not parse_request_steer(value, None, float("inf")):
            return  # only zero strengths: nothing to steer
        raise SteerRequestError(f"{REQUEST_FIELD}: this server has no steers loaded (start it "
                                "with `vllm serve MODEL --steer NAME=PATH`)")
    parse_request_steer(value, cfg.steers, cfg.max_strength)
