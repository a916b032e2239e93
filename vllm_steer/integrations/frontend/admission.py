"""What the frontend (API server / ``LLM``) process knows of the steers: names and limits,
read from the steer files' metadata only (no torch). Used to reject bad requests: when an
OpenAI request body is parsed (:func:`check_request_fields`, a pydantic validator on the
request models, so streaming and non-streaming requests get HTTP 400 before anything is
sent) and again at admission (:func:`validate`, ``validate_params`` of our processor).
"""

from __future__ import annotations

import os
from typing import Any

from vllm_steer import REQUEST_FIELD
from vllm_steer.config import SteerRequestError, SteerServerConfig, parse_request_steer

_CONFIG: SteerServerConfig | None = None


def set_config(config: SteerServerConfig | None) -> None:
    """A new engine configuration for this process: it starts from its own ``--steer``
    names (run-time loads of an earlier engine in the same process are forgotten)."""
    global _CONFIG, _LOADED
    _CONFIG = config
    _LOADED = None


def get_config() -> SteerServerConfig | None:
    return _CONFIG


# Names of the steers the engine serves, as this process last heard (run-time loading: the
# steers route refreshes it from the engine core; None: the configured --steer names).
_LOADED: set[str] | None = None


def set_loaded(names) -> None:
    global _LOADED
    _LOADED = None if names is None else set(names)


def loaded_names() -> set[str]:
    if _LOADED is not None:
        return set(_LOADED)
    return set(_CONFIG.steers) if _CONFIG is not None else set()


def _check_unloaded(value: Any, cfg: SteerServerConfig, where: str = REQUEST_FIELD) -> dict:
    """Names the request uses that are not loaded: fine if ``--steer-dir`` has them (loaded on
    first use by the engine core), else a SteerRequestError naming the directory."""
    from vllm_steer.integrations.engine.registry import SteerNameError, dir_path, name_problem

    from vllm_steer.config import _names_list

    loaded = loaded_names()
    strengths = parse_request_steer(value, None, cfg.max_strength, where)
    known = {n: True for n in loaded}
    for name in strengths:
        if name in loaded:
            continue
        if cfg.enable_updates and not name_problem(name) and not (
                cfg.steer_dir and os.path.lexists(os.path.join(cfg.steer_dir,
                                                               name + ".safetensors"))):
            # POST / DELETE (through any API server) change the names at any moment, and this
            # process's view may be a poll old: the engine core, which holds the one registry,
            # decides; it refuses an unknown name with this same message (HTTP 400 through
            # engine_core._hook_async_llm_generate), so no API server refuses a just-loaded steer
            known[name] = True
            continue
        if not cfg.steer_dir:
            raise SteerRequestError(f"{where}: unknown steer {name!r}; loaded steers: "
                                    f"{_names_list(loaded)}")
        problem = name_problem(name)
        try:
            path = None if problem else dir_path(cfg.steer_dir, name)
        except SteerNameError as e:
            problem = str(e)
        if problem:
            raise SteerRequestError(f"{where}: {problem}")
        if not os.path.isfile(path):
            raise SteerRequestError(f"{where}: unknown steer {name!r}: not loaded "
                                    f"(loaded: {_names_list(loaded)}) and no file "
                                    f"{name}.safetensors in "
                                    f"--steer-dir {cfg.steer_dir}")
        from vllm_steer.format import SteerFileError, read_metadata

        try:  # the header only (no torch): what can be refused before the engine loads it
            meta = read_metadata(path)
        except SteerFileError as e:
            raise SteerRequestError(f"{where}: steer {name!r} in --steer-dir: "
                                    + " ".join(str(e).split())[:1000]) from None
        if _HIDDEN and meta.hidden_size != _HIDDEN:
            raise SteerRequestError(f"{where}: steer {name!r} ({path}) has hidden size "
                                    f"{meta.hidden_size} but the model has {_HIDDEN}")
        known[name] = True
    return known


_HIDDEN = 0  # the served model's hidden size (checked for --steer-dir files at admission)


def set_model_hidden_size(hidden: int) -> None:
    global _HIDDEN
    _HIDDEN = int(hidden or 0)


def check_value(value: Any, where: str = REQUEST_FIELD) -> dict[str, float]:
    """Parse a request's steer value against this server's steers and limits.

    Returns name -> strength (zeros dropped); raises :class:`SteerRequestError`. A server
    without steers accepts only values whose strengths are all 0.
    """
    cfg = _CONFIG
    if cfg is not None and cfg.enabled and (cfg.steer_dir or cfg.enable_updates
                                            or _LOADED is not None):  # steers come and go
        return parse_request_steer(value, _check_unloaded(value, cfg, where), cfg.max_strength,
                                   where)
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
