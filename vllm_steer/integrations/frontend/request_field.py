"""The ``steer`` request field of the OpenAI API, and its checks at admission.

:func:`add_request_field` adds the top-level ``steer`` field to the OpenAI request models
(completions, chat, responses), so it shows in the OpenAPI schema, is checked when the body
is parsed (HTTP 400) and reaches ``SamplingParams.extra_args``. Offline, pass it yourself::

    SamplingParams(extra_args={"steer": {"detox": 5}})

A steered beam-search request is refused (vLLM's beam search would drop the steer), and every
frontend process checks a request's steers at admission (``InputProcessor``).

This module imports no torch (the frontend imports it).
"""

from __future__ import annotations

import weakref

from vllm_steer import REQUEST_FIELD
from vllm_steer.config import SteerServerConfig
from vllm_steer.integrations import guard
from vllm_steer.integrations import vllm_access as va
from vllm_steer.integrations.frontend import admission
from vllm_steer.integrations.frontend.state import (bind_engine, engine_scope, frontend_state,
                                                     new_engine)
from vllm_steer.integrations.frontend.startup_checks import processor_fqcn
from vllm_steer.metrics import count_refusal
from vllm_steer.request import SteerRequestError

REQUEST_CLASSES = va.REQUEST_CLASSES
FIELD_DESCRIPTION = (
    "vllm-steer: steers to apply to this request, as a mapping from steer name (as loaded with "
    "`vllm serve --steer NAME=PATH`) to strength in units of the steer's epsilon, e.g. "
    '{"detox": 5, "sentiment": -3}. Negative strengths steer the other way; omitted or 0 '
    "means unsteered. Equivalent: vllm_xargs={\"steer\": \"detox:5,sentiment:-3\"}."
)


def add_request_field(cls) -> None:
    """Add the ``steer`` field to a pydantic request model and check it (and
    ``vllm_xargs["steer"]``) when the request body is parsed: the API server's one parse.

    The check is a pydantic model validator, so a bad value is a validation error (HTTP 400,
    ``param: "steer"``) before any endpoint runs, streaming or not. It leaves the parsed
    request's serialised form in the ``steer`` field (a ``vllm_xargs`` steer moves there), which
    holds the typed request for :func:`to_sampling_params` (no second parse).
    """
    from typing import Any, Optional, Union

    from pydantic import Field
    from pydantic.fields import FieldInfo

    ann = Optional[dict[str, Union[float, int, str, Any]]]
    field = FieldInfo.from_annotated_attribute(
        ann, Field(default=None, description=FIELD_DESCRIPTION,
                   examples=[{"detox": 5}, {"detox": 5, "sentiment": -3}]))
    va.add_request_field(cls, REQUEST_FIELD, ann, field, _VALIDATOR_NAME, _vllm_steer_check)


def _vllm_steer_check(self):
    """The request models' "after" validator (:func:`add_request_field`): the body's one
    parse of the ``steer`` field and of ``vllm_xargs["steer"]``."""
    xargs = va.request_xargs(self)
    try:
        request = admission.check_request_fields(va.request_value(self, REQUEST_FIELD), xargs)
    except SteerRequestError as e:  # the body's check: this API server's refusal
        count_refusal(e, guard.CLIENT_STATUS)
        raise
    if request is not None:
        if isinstance(xargs, dict) and REQUEST_FIELD in xargs:
            va.set_request_xargs(self, {k: v for k, v in xargs.items() if k != REQUEST_FIELD})
        va.set_request_value(self, REQUEST_FIELD, request.to_wire())
    return self


def to_sampling_params(orig, self, *a, **kw):
    """``to_sampling_params`` of an OpenAI request model, in this order: vLLM's own; then the
    request's steers (parsed by the body's validator, carried in the ``steer`` field) with the
    preset its ``model`` names under them, defaults and floors, into ``extra_args["steer"]``
    and the response headers (:func:`vllm_steer.integrations.frontend.preset_models.
    apply_preset`)."""
    from vllm_steer.integrations.frontend.preset_models import apply_preset

    params = orig(self, *a, **kw)
    with guard.frontend("to_sampling_params", va.request_id(self)):
        value = va.request_value(self, REQUEST_FIELD)
        extra = va.extra_args(params)
        if value is not None and REQUEST_FIELD in extra:  # also refused when it was parsed
            raise admission.field_error(admission.BOTH_GIVEN)
        if value is None:  # a vllm_xargs steer the validator did not see, if any
            value = extra.get(REQUEST_FIELD)
        request = None if value is None else admission.check_request_fields(value, None)
        apply_preset(params, va.request_model(self), request)
    return params


def anthropic_to_chat(orig, cls, anthropic_request, *a, **kw):
    """``AnthropicServingMessages._build_base_request``: ``/v1/messages`` is served as a chat
    completion request built field by field; the ``steer`` its body's validator parsed
    (:func:`add_request_field`, from the field or ``vllm_xargs``) is carried across as parsed,
    so it is neither dropped nor parsed twice."""
    req = orig(cls, anthropic_request, *a, **kw)
    with guard.frontend("AnthropicServingMessages._build_base_request"):
        carry_steer(anthropic_request, req)
    return req


def carry_steer(src, dst) -> None:
    """The parsed ``steer`` of the request model ``src``, set on the request model ``dst``
    (nothing when ``src`` has none)."""
    value = va.request_value(src, REQUEST_FIELD)
    if value is not None:
        va.set_request_value(dst, REQUEST_FIELD, value)


_VALIDATOR_NAME = "_vllm_steer_check"


def to_beam_search_params(orig, self, *a, **kw):
    """vLLM's beam search builds its own per-step ``SamplingParams`` with no ``extra_args``:
    each step is served with the operator's defaults and floors only, and the request's own
    steers and its preset's would be dropped silently. Refuse such a request (HTTP 400)."""
    with guard.frontend("to_beam_search_params", va.request_id(self)):
        refuse_steered_beam_search(self)
    return orig(self, *a, **kw)


def refuse_steered_beam_search(request) -> None:
    """Raise (HTTP 400) if a beam-search request would be served with other steers than
    beam search serves (the server's defaults and floors alone): a non-zero steer of its own,
    a preset (its ``model``) with steers, or a value (a 0 too) that replaces a default (a bad
    value was refused when the body was parsed)."""
    from vllm_steer import policy
    from vllm_steer.integrations.frontend.preset_models import preset_of
    from vllm_steer.request import SteerRequest

    own = SteerRequest()
    for value in (va.request_value(request, REQUEST_FIELD),
                  (va.request_xargs(request) or {}).get(REQUEST_FIELD)):
        if value is None:
            continue
        try:
            own = admission.request_of(value)
        except Exception as e:  # noqa: BLE001 - a request built without the body's validator
            raise admission.field_error(str(e)) from None
        if own.entries:
            break
    st = frontend_state()
    cfg = st.config if st.enabled else None
    model = va.request_model(request)
    preset = preset_of(model)
    defaults, floors = (cfg.defaults, cfg.floors) if cfg is not None else ({}, {})
    wanted, _ = policy.resolve(policy.with_preset(own, preset), None, defaults, floors)
    served, _ = policy.resolve(SteerRequest(), None, defaults, floors)
    if _non_zero(wanted) == _non_zero(served):
        return
    if own:
        why = (f"{REQUEST_FIELD}: beam search (use_beam_search) cannot be steered: vLLM's "
               "beam search runs its own per-step sampling without the request's steer, so "
               "it would be silently dropped; send the request without use_beam_search (or "
               "without the steer)")
    elif preset and _non_zero(preset):
        why = (f"the preset {model!r} ({_mix_text(preset)}) cannot be served with beam search "
               "(use_beam_search): vLLM's beam search runs its own per-step sampling without "
               "a request's steers, so it would be silently dropped; send the request to the "
               "base model, or without use_beam_search")
    else:
        why = (f"{REQUEST_FIELD}: beam search (use_beam_search) serves only the server's "
               f"defaults and floors ({_mix_text(_non_zero(served))}), not the request's "
               f"{_mix_text(own.named)}: vLLM's beam search runs its own per-step sampling "
               "without the request's steer; send the request without use_beam_search (or "
               "without the steer)")
    raise admission.field_error(why, "beam_search", "use_beam_search")


def _non_zero(request_or_values) -> dict:
    """The steers of a resolved request (or a mapping) that change anything."""
    named = getattr(request_or_values, "named", request_or_values)
    return {n: v for n, v in named.items() if not _zero(v)}


def _zero(value) -> bool:
    """A strength, or a window whose strength and base are both 0: no change at any token."""
    if isinstance(value, (int, float)):
        return value == 0
    return getattr(value, "strength", None) == 0 and getattr(value, "base", None) == 0


def _mix_text(values) -> str:
    return ",".join(f"{n}={v:g}" if isinstance(v, (int, float)) else f"{n}={v}"
                    for n, v in values.items()) or "none"


def input_processor_init(orig, self, vllm_config, *a, **kw):
    """``InputProcessor.__init__``: every frontend process (also each of `--api-server-count N`)
    learns the steer names and limits from its own config, for admission; each engine client
    of a process (one ``InputProcessor`` each) keeps its own (``state.bind_engine``)."""
    from vllm_steer.integrations.families import head_input_size

    st = new_engine(SteerServerConfig.from_additional_config(va.additional_config(vllm_config)))
    st.hidden_size = int(head_input_size(va.model_config(vllm_config)) or 0)
    bind_engine(self)
    orig(self, vllm_config, *a, **kw)


def params_validator(orig, self, *a, **kw):
    """``InputProcessor._build_logits_processors_params_validator``: without our logits
    processor (no steers loaded), the steer field is still checked at admission: a request
    asking for a non-zero steer is refused, never served unsteered. Either way a request is
    admitted by its own engine's configuration (``state.engine_scope``), whichever engine of
    the process was built last."""
    inner = orig(self, *a, **kw)
    vllm_config = va.input_processor_config(self)
    procs = [str(p) for p in va.logits_processors(va.model_config(vllm_config))]
    ours = processor_fqcn(vllm_config) in procs  # our state's validate_params admits it
    processor = weakref.ref(self)  # the validator lives as long as the processor

    def validate(params):
        with engine_scope(processor()):
            if not ours:
                admission.validate(params)
            if inner is not None:
                inner(params)

    return validate
