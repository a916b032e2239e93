"""Admission in the frontend (API server / ``LLM`` process): where a request's ``steer`` value
enters the process and is parsed, once, into a :class:`~vllm_steer.request.SteerRequest`.

Two entries, one parse each (whichever a request meets first; the other then decodes the
serialised form the first wrote back into the value, :meth:`SteerRequest.to_wire`):

- the OpenAI request body's validator (:func:`check_request_fields`, a pydantic validator on
  the request models, so streaming and non-streaming requests get HTTP 400 before anything
  is sent);
- admission in vLLM's ``InputProcessor`` (:func:`validate`, ``validate_params`` of our logits
  processor): offline ``SamplingParams(extra_args={"steer": ...})`` and ``vllm_xargs`` enter
  here.

The names a request may use, the limits and the ``--steer-dir`` files are checked against
what this process knows (:func:`~vllm_steer.integrations.frontend.state.frontend_state`);
only the header of a steer file is read (no torch).
"""

from __future__ import annotations

import functools
import os
from typing import Any

from vllm_steer import REQUEST_FIELD
from vllm_steer.integrations.engine.registry import SteerNameError, dir_path, name_problem
from vllm_steer.integrations.frontend.state import frontend_state
from vllm_steer.request import SteerRequest, SteerRequestError, is_wire, unknown_steer


def _check_unloaded(request: SteerRequest, where: str = REQUEST_FIELD) -> dict:
    """Names the request uses that are not loaded: fine if ``--steer-dir`` has them (loaded on
    first use by the engine core), else a SteerRequestError naming the directory. Returns the
    names the request may use."""
    from vllm_steer.format import SteerFileError, read_metadata

    st = frontend_state()
    cfg = st.config
    loaded = st.loaded_names()
    known = {n: True for n in loaded}
    for name in request.strengths:
        if name in loaded:
            continue
        if cfg.enable_updates and not name_problem(name) and not (
                cfg.steer_dir and os.path.lexists(os.path.join(cfg.steer_dir,
                                                               name + ".safetensors"))):
            # POST / DELETE (through any API server) change the names at any moment, and this
            # process's view may be a poll old: the engine core, which holds the one registry,
            # decides; it refuses an unknown name with this same message (HTTP 400 through
            # frontend.async_llm), so no API server refuses a just-loaded steer
            known[name] = True
            continue
        if not cfg.steer_dir:
            raise SteerRequestError(unknown_steer(where, name, loaded))
        problem = name_problem(name)
        try:
            path = None if problem else dir_path(cfg.steer_dir, name)
        except SteerNameError as e:
            problem = str(e)
        if problem:
            raise SteerRequestError(f"{where}: {problem}")
        if not os.path.isfile(path):
            raise SteerRequestError(unknown_steer(where, name, loaded, cfg.steer_dir))
        try:  # the header only (no torch): what can be refused before the engine loads it
            meta = read_metadata(path)
        except SteerFileError as e:
            raise SteerRequestError(f"{where}: steer {name!r} in --steer-dir: "
                                    + " ".join(str(e).split())[:1000]) from None
        if st.hidden_size and meta.hidden_size != st.hidden_size:
            raise SteerRequestError(f"{where}: steer {name!r} ({path}) has hidden size "
                                    f"{meta.hidden_size} but the model has {st.hidden_size}")
        known[name] = True
    return known


def check_value(value: Any, where: str = REQUEST_FIELD) -> SteerRequest:
    """Parse a request's steer value against this server's steers and limits: the one parse
    of the frontend (a serialised form, already parsed in this process, is decoded).

    Raises :class:`SteerRequestError`. A server without steers accepts only values whose
    strengths are all 0.
    """
    if is_wire(value):
        return SteerRequest.from_wire(value, where)
    st = frontend_state()
    cfg = st.config
    if cfg is not None and cfg.enabled and (cfg.steer_dir or cfg.enable_updates
                                            or st.loaded is not None):  # steers come and go
        request = SteerRequest.parse(value, None, cfg.max_strength, where)  # names, limits
        _check_unloaded(request, where)
        return request
    if cfg is None or not cfg.steers:
        try:
            request = SteerRequest.parse(value, None, float("inf"), where)
            if not request:
                return request  # well-formed and only zero strengths: nothing to steer
        except SteerRequestError:
            pass  # whatever is wrong with it, no steer can be applied here
        raise SteerRequestError(f"{where}: this server has no steers loaded (start it "
                                "with `vllm serve MODEL --steer NAME=PATH`)")
    return SteerRequest.parse(value, cfg.steers, cfg.max_strength, where)


@functools.cache
def _field_error_class():
    """``SteerRequestError`` that vLLM also reads as a ``VLLMValidationError`` with
    ``param: "steer"`` (pydantic turns only ``ValueError`` into a validation error)."""
    try:
        from vllm.exceptions import VLLMValidationError
    except ImportError:  # older vLLM: a ValueError is a 400 too
        return SteerRequestError

    class SteerFieldError(SteerRequestError, VLLMValidationError):
        def __init__(self, message: str):
            VLLMValidationError.__init__(self, message, parameter=REQUEST_FIELD)

        def __str__(self) -> str:
            return str(self.args[0]) if self.args else ""

    return SteerFieldError


def field_error(message: str) -> SteerRequestError:
    return _field_error_class()(message)


BOTH_GIVEN = (f"{REQUEST_FIELD}: given both as a top-level field and in vllm_xargs; use one")


def check_request_fields(steer: Any, xargs: Any) -> SteerRequest | None:
    """The parse-time check of an OpenAI request's ``steer`` field and
    ``vllm_xargs["steer"]``: the request's steers (None: neither is given); a bad value raises
    a ``ValueError`` that vLLM answers with HTTP 400 and ``param: "steer"``."""
    try:
        xs = xargs.get(REQUEST_FIELD) if isinstance(xargs, dict) else None
        if steer is not None and xs is not None:
            raise SteerRequestError(BOTH_GIVEN)
        value = steer if steer is not None else xs
        return None if value is None else check_value(value)
    except SteerRequestError as e:
        raise field_error(str(e)) from None


def validate(params: Any) -> None:
    """Admission (``validate_params``): parse the request's steer value if no frontend entry
    parsed it yet, and write its serialised form back into ``extra_args`` for the engine.
    Raises ``VLLMValidationError`` (HTTP 400, ``param: "steer"``) if it is bad."""
    extra = getattr(params, "extra_args", None) or {}
    value = extra.get(REQUEST_FIELD)
    if value is None or is_wire(value):
        return
    try:
        request = check_value(value)
    except SteerRequestError as e:
        try:
            from vllm.exceptions import VLLMValidationError
        except ImportError:  # older vLLM: a ValueError is a 400 too
            raise e from None
        raise VLLMValidationError(str(e), parameter=REQUEST_FIELD) from None
    params.extra_args = {**extra, REQUEST_FIELD: request.to_wire()}
