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

from vllm_steer import REQUEST_FIELD
from vllm_steer.config import SteerServerConfig
from vllm_steer.integrations.frontend.startup_checks import _processor_fqcn

REQUEST_CLASSES = (
    ("vllm.entrypoints.openai.completion.protocol", "CompletionRequest"),
    ("vllm.entrypoints.openai.chat_completion.protocol", "ChatCompletionRequest"),
    ("vllm.entrypoints.openai.responses.protocol", "ResponsesRequest"),
)
FIELD_DESCRIPTION = (
    "vllm-steer: steers to apply to this request, as a mapping from steer name (as loaded with "
    "`vllm serve --steer NAME=PATH`) to strength in units of the steer's epsilon, e.g. "
    '{"detox": 5, "sentiment": -3}. Negative strengths steer the other way; omitted or 0 '
    "means unsteered. Equivalent: vllm_xargs={\"steer\": \"detox:5,sentiment:-3\"}."
)


def add_request_field(cls) -> None:
    """Add the ``steer`` field to a pydantic request model, check it (and
    ``vllm_xargs["steer"]``) when the request body is parsed, and carry it to SamplingParams.

    The check is a pydantic model validator, so a bad value is a validation error (HTTP 400,
    ``param: "steer"``) before any endpoint runs, streaming or not.
    """
    from typing import Any, Optional, Union

    from pydantic import Field
    from pydantic._internal._decorators import Decorator, ModelValidatorDecoratorInfo
    from pydantic.fields import FieldInfo

    from vllm_steer.integrations.frontend import admission as frontend

    if REQUEST_FIELD in cls.model_fields:
        return
    ann = Optional[dict[str, Union[float, int, str, Any]]]
    cls.__pydantic_fields__[REQUEST_FIELD] = FieldInfo.from_annotated_attribute(
        ann, Field(default=None, description=FIELD_DESCRIPTION,
                   examples=[{"detox": 5}, {"detox": 5, "sentiment": -3}]))
    cls.__annotations__[REQUEST_FIELD] = ann
    if hasattr(cls, "field_names"):
        cls.field_names = None

    def _vllm_steer_check(self):
        frontend.check_request_fields(getattr(self, REQUEST_FIELD, None),
                                      getattr(self, "vllm_xargs", None))
        return self

    setattr(cls, _VALIDATOR_NAME, _vllm_steer_check)
    cls.__pydantic_decorators__.model_validators[_VALIDATOR_NAME] = Decorator.build(
        cls, cls_var_name=_VALIDATOR_NAME, shim=None,
        info=ModelValidatorDecoratorInfo(mode="after"))
    cls.model_rebuild(force=True)

    orig = cls.to_sampling_params

    def to_sampling_params(self, *a, **kw):
        params = orig(self, *a, **kw)
        value = getattr(self, REQUEST_FIELD, None)
        if value is not None:
            extra = dict(params.extra_args or {})
            if REQUEST_FIELD in extra:  # also refused when the request was parsed
                raise frontend.field_error(f"{REQUEST_FIELD}: given both as a top-level field "
                                           "and in vllm_xargs; use one")
            extra[REQUEST_FIELD] = value
            params.extra_args = extra
        return params

    cls.to_sampling_params = to_sampling_params


_VALIDATOR_NAME = "_vllm_steer_check"


def _hook_refuse_beam_search(request_cls) -> None:
    """vLLM's beam search builds its own per-step ``SamplingParams`` with no ``extra_args``:
    a steer would be dropped silently. Refuse a steered beam-search request (HTTP 400)."""
    orig = request_cls.to_beam_search_params
    if getattr(orig, "_vllm_steer", False):
        return

    def to_beam_search_params(self, *a, **kw):
        refuse_steered_beam_search(self)
        return orig(self, *a, **kw)

    to_beam_search_params._vllm_steer = True
    request_cls.to_beam_search_params = to_beam_search_params


def refuse_steered_beam_search(request) -> None:
    """Raise (HTTP 400) if a beam-search request carries a bad or non-zero steer."""
    from types import SimpleNamespace

    from vllm_steer.config import parse_request_steer
    from vllm_steer.integrations.frontend import admission as frontend

    values = [getattr(request, REQUEST_FIELD, None),
              (getattr(request, "vllm_xargs", None) or {}).get(REQUEST_FIELD)]
    for value in values:
        if value is None:
            continue
        frontend.validate(SimpleNamespace(extra_args={REQUEST_FIELD: value}))  # bad: 400
        if parse_request_steer(value, None, float("inf")):
            msg = (f"{REQUEST_FIELD}: beam search (use_beam_search) cannot be steered: vLLM's "
                   "beam search runs its own per-step sampling without the request's steer, "
                   "so it would be silently dropped; send the request without use_beam_search "
                   "(or without the steer)")
            try:
                from vllm.exceptions import VLLMValidationError
            except ImportError:  # pragma: no cover
                raise ValueError(msg) from None
            raise VLLMValidationError(msg, parameter="use_beam_search")


def _hook_input_processor(input_processor_cls) -> None:
    """Every frontend process (also each of `--api-server-count N`) learns the steer names
    and limits from its own config, for ``validate_params`` at admission. Without our logits
    processor (no steers loaded), the steer field is still checked there: a request asking
    for a non-zero steer is refused, never served unsteered."""
    from vllm_steer.integrations.frontend import admission as frontend

    orig = input_processor_cls.__init__

    def __init__(self, vllm_config, *a, **kw):
        frontend.set_config(SteerServerConfig.from_additional_config(
            vllm_config.additional_config))
        from vllm_steer.integrations.engine.control import _head_input_size

        frontend.set_model_hidden_size(_head_input_size(vllm_config.model_config))
        orig(self, vllm_config, *a, **kw)
        procs = [str(p) for p in (vllm_config.model_config.logits_processors or [])]
        if _processor_fqcn(vllm_config) not in procs:
            inner = self.validate_logits_processors_params

            def validate(params):
                frontend.validate(params)
                inner(params)

            self.validate_logits_processors_params = validate

    input_processor_cls.__init__ = __init__
