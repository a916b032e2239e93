"""The vLLM general plugin (entry point ``vllm.general_plugins``: ``vllm_steer``).

vLLM calls :func:`register` in every process it starts (API server, engine core, workers),
and in ``vllm serve`` before the CLI parser is built. It installs every hook in :data:`HOOKS`,
the one list of the plugin's patch points into vLLM, each named after what it patches. The
hooks themselves live in modules named after what they do:

- :mod:`~vllm_steer.integrations.hooks`: the machinery (:class:`~vllm_steer.integrations.
  hooks.Hook`, installing, reporting a hook vLLM moved or removed);
- :mod:`~vllm_steer.integrations.cli_args`: ``--steer NAME=PATH`` and its sibling flags in
  ``vllm serve``, carried to the workers in ``additional_config["vllm_steer"]``;
- :mod:`~vllm_steer.integrations.startup_checks`: on engine config creation, the steer files,
  model, speculative decoding and parallelism are checked and our per-request logits
  processor is installed; the LM head is swapped for :class:`~vllm_steer.integrations.head.
  SteeredLogitsProcessor` and checked once the model is loaded;
- :mod:`~vllm_steer.integrations.request_field`: the top-level ``steer`` field of the OpenAI
  request models (completions, chat, responses), checked at admission;
- :mod:`~vllm_steer.integrations.engine_core`: run-time steer management and admission in the
  engine core, and their API-server halves;
- presets as model names, defaults and floors: below (section 7).

Offline, pass the same configuration yourself::

    LLM(model, additional_config={"vllm_steer": {"steers": {"detox": "detox.safetensors"}}})
    SamplingParams(extra_args={"steer": {"detox": 5}})

A hook vLLM moved or removed is reported at registration: start-up fails when steers are
configured (naming the vLLM version and the hook), and a warning is logged otherwise.

This module imports no torch at import time (nor do the modules it imports).
"""

from __future__ import annotations

from vllm_steer import REQUEST_FIELD
from vllm_steer.integrations import cli_args, engine_core, request_field, startup_checks
from vllm_steer.integrations.hooks import Hook, install_hooks
from vllm_steer.integrations.request_field import REQUEST_CLASSES

_REGISTERED = False


def register() -> None:
    """Entry point of the ``vllm.general_plugins`` group. Idempotent."""
    global _REGISTERED
    if _REGISTERED:
        return
    _REGISTERED = True
    install_hooks(HOOKS)


# ---- 7. presets as model names, defaults and floors (vllm_steer.policy) --------------------
def presets() -> dict[str, dict[str, float]]:
    """The presets this process serves as model names (from its steer configuration)."""
    from vllm_steer.integrations import frontend

    cfg = frontend.get_config()
    return dict(cfg.presets) if cfg is not None and cfg.enabled else {}


def _hook_model_registry(registry_cls) -> None:
    """``OpenAIModelRegistry`` (behind ``OpenAIServingModels``): a preset name is a served
    model name (``is_base_model``, so every route's model check admits it) and is listed in
    ``/v1/models`` as its own card (parent: the base model; its mix in a ``steer`` field),
    like vLLM lists ``--lora-modules``."""
    orig_is_base, orig_show = registry_cls.is_base_model, registry_cls.show_available_models
    if getattr(orig_is_base, "_vllm_steer", False):
        return

    def is_base_model(self, model_name):
        return orig_is_base(self, model_name) or (
            isinstance(model_name, str) and model_name in presets())

    async def show_available_models(self):
        from vllm.entrypoints.serve.engine.protocol import ModelCard, ModelPermission

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
    :func:`vllm_steer.integrations.control.apply_policy`.)"""
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
    from vllm_steer.integrations import frontend

    cfg = frontend.get_config()
    if cfg is None or not cfg.enabled:
        return
    extra = dict(params.extra_args or {})
    value = extra.get(REQUEST_FIELD)
    preset = presets().get(model) if isinstance(model, str) else None
    if preset:
        value = policy.with_preset(value, preset)
        extra[REQUEST_FIELD] = value
        params.extra_args = extra
    from vllm_steer.server.presets_route import record_applied

    record_applied(*policy.resolve(value, None, cfg.defaults, cfg.floors))


def _hook_endpoint_presets(plugins) -> None:
    """The response headers (a middleware) and ``GET /v1/steer-presets``
    (vllm_steer.server.presets_route) on every API server that steers."""
    orig = plugins.load_endpoint_plugins
    if getattr(orig, "_vllm_steer_presets", False):
        return

    def load_endpoint_plugins(supported_tasks=None):
        found = list(orig(supported_tasks))
        from vllm_steer.integrations import frontend

        cfg = frontend.get_config()
        if cfg is not None and cfg.enabled and not any(
                getattr(p, "name", None) == "vllm_steer_presets" for p in found):
            from vllm_steer.server.presets_route import PresetsEndpoint

            found.append(PresetsEndpoint())
        return found

    load_endpoint_plugins._vllm_steer_presets = True
    plugins.load_endpoint_plugins = load_endpoint_plugins


# ---- the hook list (section 0) -----------------------------------------------------------
# Patched lazily in the worker (v1.py, v2.py) but checked here, in every process.
_WORKER_HOOKS = (
    ("vllm.v1.sample.logits_processor:LogitsProcessor", "V1 per-request steer state"),
    ("vllm.v1.sample.logits_processor:BatchUpdate", "V1 per-request steer state"),
    ("vllm.v1.worker.gpu_model_runner:GPUModelRunner._get_prompt_logprobs_dict",
     "steered prompt logprobs (V1)"),
    ("vllm.v1.worker.gpu_model_runner:GPUModelRunner._prepare_inputs",
     "generated-token positions of the batch rows for generation windows (V1)"),
    ("vllm.v1.worker.gpu_input_batch:InputBatch.__init__",
     "no output-token tracking for our processor (V1)"),
    ("vllm.v1.worker.gpu.sample.logits_processor:LogitsProcessor",
     "V2 per-request steer state"),
    ("vllm.v1.worker.gpu.model_runner:GPUModelRunner.sample",
     "the step's row -> request mapping (V2)"),
    ("vllm.v1.worker.gpu.sample.prompt_logprob:PromptLogprobsWorker.compute_prompt_logprobs",
     "steered prompt logprobs (V2)"),
    ("vllm.v1.worker.gpu.sample.prompt_logprob:PromptLogprobsWorker."
     "compute_prompt_token_id_logprobs", "steered prompt logprobs (V2, prompt_logprob_token_ids)"),
    ("vllm.v1.worker.gpu.sample.batch_shard:BatchSharder.shard_sampler_inputs",
     "rows of batch-sharded sampling (V2, --enable-batch-sharded-sampling)"),
)

HOOKS: tuple[Hook, ...] = (
    Hook("vllm.engine.arg_utils:EngineArgs.add_cli_args", "--steer flags in vllm serve",
         cli_args._hook_add_cli_args),
    Hook("vllm.engine.arg_utils:EngineArgs.from_cli_args",
         "--steer carried in additional_config", cli_args._hook_from_cli_args),
    Hook("vllm.engine.arg_utils:EngineArgs.create_engine_config",
         "start-up checks and our logits processor",
         startup_checks._hook_create_engine_config),
    Hook("vllm.v1.engine.input_processor:InputProcessor.__init__",
         "refusing bad steers at admission (HTTP 400)",
         request_field._hook_input_processor),
    Hook("vllm.v1.engine.input_processor:InputProcessor._build_logits_processors_params_"
         "validator", "refusing bad steers at admission (HTTP 400)"),
    Hook("vllm.model_executor.layers.logits_processor:LogitsProcessor.register_oot",
         "the steered LM head", startup_checks._hook_register_head),
    Hook("vllm.model_executor.model_loader.base_loader:BaseModelLoader.load_model",
         "checking the model's logits layer is the steered head",
         startup_checks._hook_model_loaders),
    *(Hook(f"{module}:{name}.to_sampling_params", "the `steer` request field",
           request_field.add_request_field)
      for module, name in REQUEST_CLASSES),
    *(Hook(f"{module}:{name}.to_beam_search_params", "refusing steered beam search",
           request_field._hook_refuse_beam_search)
      for module, name in REQUEST_CLASSES if name != "ResponsesRequest"),
    *(Hook(target, purpose) for target, purpose in _WORKER_HOOKS),
    # steers at run time, admission in the engine core (engine_core.py)
    Hook("vllm.v1.engine.core:EngineCore.collective_rpc",
         "loading/unloading steers in the engine core (collective_rpc)",
         engine_core._hook_engine_core),
    Hook("vllm.v1.engine.core:EngineCore.add_request",
         "binding a request's steers to (slot, generation) at admission"),
    Hook("vllm.plugins:load_endpoint_plugins", "the /v1/steers routes",
         engine_core._hook_endpoint_plugins),
    # speculative decoding (startup_checks.py, spec_decode.py)
    Hook("vllm.v1.worker.gpu_model_runner:GPUModelRunner.execute_model",
         "speculative decoding: the step's verification rows -> requests (V1)",
         startup_checks._hook_spec_decode),
    Hook("vllm.v1.worker.gpu_model_runner:build_logitsprocs",
         "speculative decoding: our per-request steer state (V1 refuses custom processors)",
         startup_checks._hook_spec_decode_logitsprocs),
    Hook("vllm.v1.worker.gpu_model_runner:GPUModelRunner._calc_spec_decode_metadata",
         "speculative decoding: draft-token counts per request (V1)"),
    Hook("vllm.v1.worker.gpu_model_runner:GPUModelRunner.propose_draft_token_ids",
         "speculative decoding: the drafter's rows -> requests (V1)"),
    Hook("vllm.v1.engine.async_llm:AsyncLLM.add_request",
         "--steer-dir steers loaded before admission (HTTP 400 with the reason)",
         engine_core._hook_async_llm),
    Hook("vllm.v1.engine.async_llm:AsyncLLM.generate",
         "an engine-side steer refusal answered as HTTP 400, not 500",
         engine_core._hook_async_llm_generate),
    Hook("vllm.v1.engine:EngineCoreOutput.stop_reason",
         "the engine-side steer refusal's message (error output's stop_reason)"),
    # presets, defaults and floors (section 7)
    Hook("vllm.entrypoints.openai.models.serving:OpenAIModelRegistry.is_base_model",
         "presets served as model names", _hook_model_registry),
    Hook("vllm.entrypoints.openai.models.serving:OpenAIModelRegistry.show_available_models",
         "presets listed in /v1/models"),
    *(Hook(f"{module}:{name}.to_sampling_params", "a preset's mix for its model name",
           _hook_preset_request)
      for module, name in REQUEST_CLASSES),
    Hook("vllm.plugins:load_endpoint_plugins", "the x-vllm-steer-applied response headers",
         _hook_endpoint_presets),
)
