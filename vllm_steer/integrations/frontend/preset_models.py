"""Presets served as model names, on the API server (the mix, defaults and floors:
:mod:`vllm_steer.policy`; the run-time table: :mod:`vllm_steer.integrations.engine.presets`).

- ``OpenAIModelRegistry``: a preset name is a served model name and has its own card in
  ``/v1/models`` (:func:`is_base_model`, :func:`show_available_models`);
- ``BaseServing._check_model``: with ``--enable-steer-updates`` or ``--steer-presets-file``,
  a name that may be a
  run-time preset is read from the engine core first (:func:`check_model`);
- ``to_sampling_params`` of every OpenAI request model: the preset's mix under the request's
  own ``steer``, with the operator's defaults and floors (:func:`apply_preset`, called by
  :func:`vllm_steer.integrations.frontend.request_field.to_sampling_params`).

Installed from :data:`vllm_steer.integrations.plugin.HOOKS`. No torch at import time.
"""

from __future__ import annotations

from vllm_steer.integrations import guard, vllm_access
from vllm_steer.integrations.frontend.admission import serve
from vllm_steer.integrations.frontend.engine_client import refresh_presets
from vllm_steer.integrations.frontend import request_scope
from vllm_steer.integrations.frontend.request_scope import (note_policy_applied,
                                                             note_preset_model, pin_preset,
                                                             pinned_preset)
from vllm_steer.integrations.frontend.state import frontend_state
from vllm_steer.request import SteerRequest


def presets() -> dict[str, dict[str, float]]:
    """The presets this process serves as model names: its ``--steer-preset`` ones and the
    run-time ones as it last read them."""
    st = frontend_state()
    if not st.enabled:
        return {}
    cfg = st.config
    return {**cfg.presets, **st.presets_view()} if cfg.presets_change else dict(cfg.presets)


def _runtime_presets_on() -> bool:
    st = frontend_state()
    return st.enabled and st.config.presets_change


async def check_model(orig, self, request, *a, **kw):
    """``BaseServing._check_model`` (every OpenAI route's model check): with
    ``--enable-steer-updates`` or ``--steer-presets-file``, a ``model`` that is not the served
    model, a ``--steer-preset`` preset or a LoRA adapter may be a preset added, replaced or
    deleted at run time (through any API server, or the presets file): read the engine core's
    table first (one utility call), and pin the mix read for this request's
    ``to_sampling_params``."""
    with guard.frontend("BaseServing._check_model", vllm_access.request_id(request)):
        name = vllm_access.request_model_field(request)
        if isinstance(name, str) and name and _runtime_presets_on():
            base, lora = vllm_access.registry_model_names(vllm_access.serving_models(self))
            static = name in frontend_state().config.presets or name in base or name in lora
            if not static:
                pin_preset(name, (await refresh_presets()).get(name))
    error = await orig(self, request, *a, **kw)
    if error is not None and frontend_state().enabled:  # vLLM's 404: no such model name
        count_unknown_model()
    elif error is None and frontend_state().enabled:
        with guard.frontend("BaseServing._check_model", vllm_access.request_id(request)):
            note_if_preset(self, vllm_access.request_model_field(request))
    return error


def note_if_preset(serving, name) -> None:
    """Record in this HTTP request's scope that its model check admitted ``name`` as a preset
    with steers (not a served model name nor a LoRA adapter): a route that never applies it
    (:func:`apply_preset`) is refused when the request reaches the engine
    (:func:`vllm_steer.integrations.frontend.admission.validate`), instead of serving the
    preset's name without its steers."""
    if not isinstance(name, str) or not name or request_scope.current() is None:
        return  # outside an HTTP request (offline): nothing to record
    base, lora = vllm_access.registry_model_names(vllm_access.serving_models(serving))
    if name in base or name in lora:
        return
    if preset_of(name):
        note_preset_model(name)


def count_unknown_model() -> None:
    """A request refused for its model name (vLLM's HTTP 404) on a server that serves
    presets as model names: counted as this API server's ``unknown_preset`` refusal."""
    from vllm_steer.metrics import get_metrics

    try:
        get_metrics().refused_here(404, "unknown_preset")
    except Exception:  # noqa: BLE001 - metrics never break serving
        pass


def is_base_model(orig, self, model_name):
    """``OpenAIModelRegistry.is_base_model``: a preset name is a served model name (so every
    route's model check admits it)."""
    if orig(self, model_name):
        return True
    if not isinstance(model_name, str):
        return False
    with guard.frontend("OpenAIModelRegistry.is_base_model"):
        pinned, mix = pinned_preset(model_name)  # what this request's model check read
        return bool(mix) if pinned else model_name in presets()


async def show_available_models(orig, self):
    """``OpenAIModelRegistry.show_available_models``: each preset listed in ``/v1/models`` as
    its own card (parent: the base model; its mix in a ``steer`` field), like vLLM lists
    ``--lora-modules``."""
    from vllm.entrypoints.serve.engine.protocol import ModelCard, ModelPermission

    with guard.frontend("OpenAIModelRegistry.show_available_models"):
        if _runtime_presets_on():  # run-time presets: the engine core's table as of now
            await refresh_presets()
    models = await orig(self)
    with guard.frontend("OpenAIModelRegistry.show_available_models"):
        base, path, max_len = vllm_access.registry_base_model(self)
        vllm_access.add_model_cards(models, [
            ModelCard(id=name, root=path, parent=base, max_model_len=max_len,
                      permission=[ModelPermission()], steer=dict(mix))
            for name, mix in presets().items()])
    return models


def apply_preset(params, model: str | None, request: SteerRequest | None) -> None:
    """Serve ``request`` (the OpenAI request's steers, None: it has none) with ``model``'s
    preset (if it is one) under its own steers, and the operator's defaults and floors: the
    frontend's one application of the policy
    (:func:`vllm_steer.integrations.frontend.admission.serve`), which writes the steers into
    ``params.extra_args`` for the engine core and records them for the response headers."""
    note_policy_applied()  # this route serves presets: its model check's preset is applied
    serve(params, request, preset_of(model))


def preset_of(model: str | None) -> dict[str, float] | None:
    """The mix of the preset a request's ``model`` names (None: not a preset): the one its
    model check read, else this process's presets."""
    preset = None
    if frontend_state().enabled and isinstance(model, str):
        pinned, preset = pinned_preset(model)  # what this request's model check read
        if not pinned:
            preset = presets().get(model)
    return preset
