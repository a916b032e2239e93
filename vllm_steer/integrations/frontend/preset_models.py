"""Presets served as model names, on the API server (the mix, defaults and floors:
:mod:`vllm_steer.policy`; the run-time table: :mod:`vllm_steer.integrations.engine.presets`).

- ``OpenAIModelRegistry``: a preset name is a served model name and has its own card in
  ``/v1/models`` (:func:`_hook_model_registry`);
- ``BaseServing._check_model``: with ``--enable-steer-updates``, a name that may be a
  run-time preset is read from the engine core first (:func:`_hook_check_model`);
- ``to_sampling_params`` of every OpenAI request model: the preset's mix under the request's
  own ``steer`` (:func:`_hook_preset_request`, :func:`apply_preset`).

Installed from :data:`vllm_steer.integrations.plugin.HOOKS`. No torch at import time.
"""

from __future__ import annotations

from vllm_steer import REQUEST_FIELD


def presets() -> dict[str, dict[str, float]]:
    """The presets this process serves as model names: its ``--steer-preset`` ones and the
    run-time ones as it last read them (:mod:`vllm_steer.integrations.engine.presets`)."""
    from vllm_steer.integrations.frontend import admission as frontend
    from vllm_steer.integrations.engine import presets as runtime

    cfg = frontend.get_config()
    if cfg is None or not cfg.enabled:
        return {}
    return {**cfg.presets, **runtime.view()} if cfg.enable_updates else dict(cfg.presets)


def _runtime_presets_on() -> bool:
    from vllm_steer.integrations.frontend import admission as frontend

    cfg = frontend.get_config()
    return cfg is not None and cfg.enabled and cfg.enable_updates


def _hook_check_model(serving_cls) -> None:
    """``BaseServing._check_model`` (every OpenAI route's model check): with
    ``--enable-steer-updates``, a ``model`` that is not the served model, a ``--steer-preset``
    preset or a LoRA adapter may be a preset added (or deleted) at run time through any API
    server: read the engine core's table first (one utility call), and pin the mix read for
    this request's ``to_sampling_params``."""
    orig = serving_cls._check_model
    if getattr(orig, "_vllm_steer", False):
        return

    async def _check_model(self, request, *a, **kw):
        name = getattr(request, "model", None)
        if isinstance(name, str) and name and _runtime_presets_on():
            from vllm_steer.integrations.frontend import admission as frontend
            from vllm_steer.integrations.engine import presets as runtime
            from vllm_steer.server.presets_route import pin_preset

            models = self.models
            static = (name in frontend.get_config().presets
                      or any(b.name == name for b in models.base_model_paths)
                      or name in (getattr(models, "lora_requests", None) or {}))
            if not static:
                pin_preset(name, (await runtime.refresh()).get(name))
        return await orig(self, request, *a, **kw)

    _check_model._vllm_steer = True
    serving_cls._check_model = _check_model


def _hook_model_registry(registry_cls) -> None:
    """``OpenAIModelRegistry`` (behind ``OpenAIServingModels``): a preset name is a served
    model name (``is_base_model``, so every route's model check admits it) and is listed in
    ``/v1/models`` as its own card (parent: the base model; its mix in a ``steer`` field),
    like vLLM lists ``--lora-modules``."""
    orig_is_base, orig_show = registry_cls.is_base_model, registry_cls.show_available_models
    if getattr(orig_is_base, "_vllm_steer", False):
        return

    def is_base_model(self, model_name):
        if orig_is_base(self, model_name):
            return True
        if not isinstance(model_name, str):
            return False
        from vllm_steer.server.presets_route import pinned_preset

        pinned, mix = pinned_preset(model_name)  # what this request's model check read
        return bool(mix) if pinned else model_name in presets()

    async def show_available_models(self):
        from vllm.entrypoints.serve.engine.protocol import ModelCard, ModelPermission

        if _runtime_presets_on():  # run-time presets: the engine core's table as of now
            from vllm_steer.integrations.engine import presets as runtime

            await runtime.refresh()
        models = await orig_show(self)
        base = self.base_model_paths[0]
        models.data.extend(ModelCard(id=name, root=base.model_path, parent=base.name,
                                     max_model_len=self.model_config.max_model_len,
                                     permission=[ModelPermission()], steer=dict(mix))
                           for name, mix in presets().items())
        return models

    is_base_model._vllm_steer = True
    registry_cls.is_base_model = is_base_model
    registry_cls.show_available_models = show_available_models


def _hook_preset_request(cls) -> None:
    """``to_sampling_params`` of an OpenAI request model: a request whose ``model`` is a preset
    gets the preset's mix under its own ``steer`` (precedence: :mod:`vllm_steer.policy`), and
    the response headers (:mod:`vllm_steer.server.presets_route`) learn what is applied after
    defaults and floors. (The engine core applies defaults and floors itself:
    :func:`vllm_steer.integrations.engine.control.apply_policy`.)"""
    orig = cls.to_sampling_params
    if getattr(orig, "_vllm_steer_preset", False):
        return

    def to_sampling_params(self, *a, **kw):
        params = orig(self, *a, **kw)
        apply_preset(params, getattr(self, "model", None))
        return params

    to_sampling_params._vllm_steer_preset = True
    cls.to_sampling_params = to_sampling_params


def apply_preset(params, model: str | None) -> None:
    """Write ``model``'s preset (if it is one) under the request's steer, and record the
    applied steers for the response headers."""
    from vllm_steer import policy
    from vllm_steer.integrations.frontend import admission as frontend

    cfg = frontend.get_config()
    if cfg is None or not cfg.enabled:
        return
    extra = dict(params.extra_args or {})
    value = extra.get(REQUEST_FIELD)
    preset = None
    if isinstance(model, str):
        from vllm_steer.server.presets_route import pinned_preset

        pinned, preset = pinned_preset(model)  # what this request's model check read
        if not pinned:
            preset = presets().get(model)
    if preset:
        value = policy.with_preset(value, preset)
        extra[REQUEST_FIELD] = value
        params.extra_args = extra
    from vllm_steer.server.presets_route import record_applied

    record_applied(*policy.resolve(value, None, cfg.defaults, cfg.floors))
