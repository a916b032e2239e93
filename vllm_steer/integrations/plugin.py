"""The vLLM general plugin (entry point ``vllm.general_plugins``: ``vllm_steer``).

vLLM calls :func:`register` in every process it starts (API server, engine core, workers),
and in ``vllm serve`` before the CLI parser is built. It installs every hook in :data:`HOOKS`,
the one list of the plugin's patch points into vLLM, each named after what it patches. The
hooks themselves live in modules named after what they do:

- :mod:`~vllm_steer.integrations.hooks`: the machinery (:class:`~vllm_steer.integrations.
  hooks.Hook`, installing, reporting a hook vLLM moved or removed);
- :mod:`~vllm_steer.integrations.frontend.cli_args`: ``--steer NAME=PATH`` and its sibling flags in
  ``vllm serve``, carried to the workers in ``additional_config["vllm_steer"]``;
- :mod:`~vllm_steer.integrations.frontend.startup_checks`: on engine config creation, the steer files,
  model, speculative decoding and parallelism are checked and our per-request logits
  processor is installed; the LM head is swapped for :class:`~vllm_steer.integrations.worker.head.
  SteeredLogitsProcessor` and checked once the model is loaded;
- :mod:`~vllm_steer.integrations.frontend.request_field`: the top-level ``steer`` field of the OpenAI
  request models (completions, chat, responses), checked at admission;
- :mod:`~vllm_steer.integrations.engine.core`: run-time steer management and admission in the
  engine core, and their API-server halves;
- :mod:`~vllm_steer.integrations.frontend.preset_models`: presets served as model names (defaults
  and floors are applied in the engine core's admission);
- :mod:`~vllm_steer.integrations.frontend.endpoints`: ``/v1/steers``, ``/v1/steer-presets`` and the
  response headers on every API server that steers.

Offline, pass the same configuration yourself::

    LLM(model, additional_config={"vllm_steer": {"steers": {"detox": "detox.safetensors"}}})
    SamplingParams(extra_args={"steer": {"detox": 5}})

A hook vLLM moved or removed is reported at registration: start-up fails when steers are
configured (naming the vLLM version and the hook), and a warning is logged otherwise.

This module imports no torch at import time (nor do the modules it imports).
"""

from __future__ import annotations

from vllm_steer.integrations.frontend import cli_args
from vllm_steer.integrations.frontend import endpoints
from vllm_steer.integrations.engine import core as engine_core
from vllm_steer.integrations.frontend import preset_models
from vllm_steer.integrations.frontend import request_field
from vllm_steer.integrations.frontend import startup_checks
from vllm_steer.integrations.hooks import Hook, install_hooks
from vllm_steer.integrations.frontend.request_field import REQUEST_CLASSES

_REGISTERED = False


def register() -> None:
    """Entry point of the ``vllm.general_plugins`` group. Idempotent."""
    global _REGISTERED
    if _REGISTERED:
        return
    _REGISTERED = True
    install_hooks(HOOKS)


# ---- the hook list -----------------------------------------------------------
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
    Hook("vllm.plugins:load_endpoint_plugins",
         "the /v1/steers and /v1/steer-presets routes, the x-vllm-steer-* headers",
         endpoints._hook_endpoint_plugins),
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
    # presets served as model names (preset_models.py)
    Hook("vllm.entrypoints.openai.models.serving:OpenAIModelRegistry.is_base_model",
         "presets served as model names", preset_models._hook_model_registry),
    Hook("vllm.entrypoints.openai.models.serving:OpenAIModelRegistry.show_available_models",
         "presets listed in /v1/models"),
    *(Hook(f"{module}:{name}.to_sampling_params", "a preset's mix for its model name",
           preset_models._hook_preset_request)
      for module, name in REQUEST_CLASSES),
    Hook("vllm.entrypoints.serve.engine.serving:BaseServing._check_model",
         "presets added or deleted at run time, seen by every API server",
         preset_models._hook_check_model),
)
