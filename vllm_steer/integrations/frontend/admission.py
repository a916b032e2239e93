"""Admission in the frontend (API server / ``LLM`` process): where a request's ``steer`` value
enters the process, is parsed once into a :class:`~vllm_steer.request.SteerRequest`, and gets
the operator's policy once.

- **The parse** (:func:`check_value`), whichever entry a request meets first:

  - the OpenAI request body's validator (:func:`check_request_fields`, a pydantic validator on
    the request models, so streaming and non-streaming requests get HTTP 400 before anything
    is sent);
  - vLLM's ``InputProcessor`` (:func:`validate`, ``validate_params`` of our logits
    processor): offline ``SamplingParams(extra_args={"steer": ...})`` and other callers of
    ``LLM`` / ``AsyncLLM`` enter here.

  The names a request may use, the limits and the ``--steer-dir`` files are checked against
  what this process knows (:func:`~vllm_steer.integrations.frontend.state.frontend_state`);
  only the header of a steer file is read (no torch).
- **The policy** (:func:`serve`): a preset's mix under the request (an OpenAI request's
  ``model``), then ``--steer-default`` and ``--steer-floor``
  (:func:`vllm_steer.policy.resolve`). The steers the request is served with go to the engine
  core in ``extra_args["steer"]`` (:meth:`~vllm_steer.request.SteerRequest.to_wire`; in this
  process that form holds the typed request, :func:`~vllm_steer.request.admitted`, so later
  steps read it without decoding), and to the response headers.
"""

from __future__ import annotations

import functools
from typing import Any, Mapping

from vllm_steer import REQUEST_FIELD
from vllm_steer.integrations import vllm_access as va
from vllm_steer.integrations.frontend.request_scope import (hold_start, mark_steered,
                                                            record_applied)
from vllm_steer.integrations.frontend.state import frontend_state
from vllm_steer.metrics import count_refusal
from vllm_steer.integrations.protocol import (count_problem, dir_has_file, name_problem,
                                              steer_dir_file)
from vllm_steer.request import (BAD_STEER, SteerRequest, SteerRequestError, SteerWire,
                                 admitted, refusal_reason)


def dir_steer_file(name: str, loaded, where: str = REQUEST_FIELD) -> str:
    """The ``--steer-dir`` file of ``name`` (not loaded), checked as far as this process can
    without torch: it exists (:func:`~vllm_steer.integrations.protocol.steer_dir_file`, the
    engine core's own lookup) and its header fits the model. Raises SteerRequestError."""
    from vllm_steer.format import SteerFileError
    from vllm_steer.kinds import applied_in_layers, read_any_metadata

    st = frontend_state()
    path = steer_dir_file(st.config.steer_dir, name, loaded, where)
    try:  # the header only (no torch): what can be refused before the engine loads it
        meta = read_any_metadata(path)
    except SteerFileError as e:
        raise SteerRequestError(f"{where}: steer {name!r} in --steer-dir: "
                                + " ".join(str(e).split())[:1000], "bad_file") from None
    # (a decoder-layer steer is checked against the model's blocks by the engine core)
    if st.hidden_size and not applied_in_layers(meta) and meta.hidden_size != st.hidden_size:
        raise SteerRequestError(f"{where}: steer {name!r} ({path}) has hidden size "
                                f"{meta.hidden_size} but the model has {st.hidden_size}",
                                "bad_file")
    return path


def _check_unloaded(request: SteerRequest, where: str = REQUEST_FIELD) -> None:
    """Names the request uses that are not loaded: fine if ``--steer-dir`` has them (loaded on
    first use by the engine core), else a SteerRequestError naming the directory."""
    st = frontend_state()
    cfg = st.config
    loaded = st.loaded_names()
    for name in request.named:  # a name at strength 0 too: it must name a steer
        if name in loaded:
            continue
        if cfg.enable_updates and not name_problem(name) \
                and not dir_has_file(cfg.steer_dir, name):
            # POST / DELETE (through any API server) change the names at any moment, and this
            # process's view may be a poll old: the engine core, which holds the one registry,
            # decides; it refuses an unknown name with this same message (HTTP 400 through
            # frontend.async_llm), so no API server refuses a just-loaded steer
            continue
        if name in request.strengths:
            dir_steer_file(name, loaded, where)
        else:  # at strength 0 it is not loaded: it must only name a steer
            steer_dir_file(cfg.steer_dir, name, loaded, where)


def check_value(value: Any, where: str = REQUEST_FIELD) -> SteerRequest:
    """Parse a user's steer value against this server's steers and limits: the one parse of
    the frontend (:meth:`SteerRequest.parse`).

    Raises :class:`SteerRequestError`. A server without steers accepts only values whose
    strengths are all 0.
    """
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
                                "with `vllm serve MODEL --steer NAME=PATH`)", "unknown_steer")
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
        def __init__(self, message: str, reason: str = BAD_STEER,
                     parameter: str = REQUEST_FIELD):
            VLLMValidationError.__init__(self, message, parameter=parameter)
            self.reason = reason

        def __str__(self) -> str:
            return str(self.args[0]) if self.args else ""

    return SteerFieldError


def field_error(message: str, reason: str = BAD_STEER,
                parameter: str = REQUEST_FIELD) -> SteerRequestError:
    """A refusal of the request (HTTP 400, ``param``: ``parameter``) for ``reason`` (a key of
    :data:`~vllm_steer.request.REFUSAL_REASONS`)."""
    if _field_error_class() is SteerRequestError:
        return SteerRequestError(message, reason)
    return _field_error_class()(message, reason, parameter)


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
        return None if value is None else request_of(value)
    except SteerRequestError as e:
        raise field_error(str(e), refusal_reason(e)) from None


def request_of(value: Any, where: str = REQUEST_FIELD) -> SteerRequest:
    """The request a steer value stands for in this process: the one this frontend admitted
    (its serialised form holds it), else the user's value parsed (:func:`check_value`)."""
    request = admitted(value)
    return request if request is not None else check_value(value, where)


def serve(params: Any, request: SteerRequest | None,
          preset: Mapping[str, float] | None = None) -> SteerRequest:
    """The frontend's one application of the operator's policy: ``preset``'s mix under the
    request's own steers, then ``--steer-default`` and ``--steer-floor``
    (:func:`vllm_steer.policy.resolve`). Writes the steers the request is served with into
    ``params.extra_args["steer"]`` (their serialised form, which the engine core binds; nothing
    when the request has no steer value and none applies) and records them for the response
    headers. Returns them."""
    from vllm_steer import policy

    st = frontend_state()
    given = request is not None
    served = request if given else SteerRequest()
    if st.enabled:
        cfg = st.config
        if preset:
            served = policy.with_preset(served, preset)
        served, floored = policy.resolve(served, None, cfg.defaults, cfg.floors)
        problem = count_problem(list(served.strengths), cfg.per_request, cfg.capacity,
                                REQUEST_FIELD)
        if problem:  # the engine core would refuse it: say so before it is sent
            raise field_error(problem, "too_many_steers")
        record_applied(served.named, floored)
        if served.named:  # a name at strength 0 too: the engine core may refuse it (unknown)
            mark_steered()  # its start waits for its admission (the middleware, responses_stream)
        if cfg.steer_dir and served.strengths:
            hold_start()  # a first use may wait for a slot, then answer 429 (async_llm)
    if given or served.entries:
        va.put_extra_arg(params, REQUEST_FIELD, served.to_wire())
    return served


def validate(params: Any) -> None:
    """Admission (``validate_params``, every request of every frontend): a request this
    frontend has not admitted yet (a user's value, offline or from another ``LLM`` /
    ``AsyncLLM`` caller; or none, under ``--steer-default`` / ``--steer-floor``) is parsed and
    gets the policy (:func:`serve`). Raises ``VLLMValidationError`` (HTTP 400,
    ``param: "steer"``) if it is bad, counted as this process's refusal."""
    try:
        _validate(params)
    except SteerRequestError as e:
        count_refusal(e, 400)
        raise


#: ``SteerWire.origin`` of a form no caller's value made (the OpenAI request's own).
_NO_ORIGIN = object()

#: The refusal of a serialised form changed after admission wrote it.
CHANGED_FORM = (f"{REQUEST_FIELD}: the serialised form vllm-steer wrote into these "
                f"SamplingParams was changed; set extra_args[{REQUEST_FIELD!r}] to a new value "
                "(e.g. {'detox': 5}) instead of editing it")


#: The refusal of a preset named as the model of a route that never applies it.
PRESET_ROUTE = ("model: {name!r} is a steer preset, served as a model name by the completions, "
                "chat completions, responses and messages routes; this route builds its own "
                "sampling parameters and would serve it without the preset's steers. Send the "
                "request to the served model instead")


def _validate(params: Any) -> None:
    value = va.extra_args(params).get(REQUEST_FIELD)
    if value is None:
        from vllm_steer.integrations.frontend.request_scope import unserved_preset

        preset = unserved_preset()  # its model check admitted a preset no route applied
        if preset is not None:
            raise field_error(PRESET_ROUTE.format(name=preset), "preset_route", "model")
    request = admitted(value)
    if request is not None:
        if value != request.to_wire():
            raise field_error(CHANGED_FORM)
        origin = getattr(value, "origin", _NO_ORIGIN)
        if origin is _NO_ORIGIN:
            return  # admitted by this frontend already (the OpenAI request's to_sampling_params)
        value = origin  # the caller's params again: its own value, as it is now, admitted again
    if value is None:
        st = frontend_state()
        if not (st.enabled and (st.config.defaults or st.config.floors)):
            return
    try:
        request = None if value is None else check_value(value)
    except SteerRequestError as e:
        raise field_error(str(e), refusal_reason(e)) from None
    serve(params, request)
    wire = va.extra_args(params).get(REQUEST_FIELD)
    if isinstance(wire, SteerWire):  # written into the caller's params: may come again
        wire.origin = value
