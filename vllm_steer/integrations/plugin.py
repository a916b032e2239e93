"""The vLLM general plugin (entry point ``vllm.general_plugins``: ``vllm_steer``).

vLLM calls :func:`register` in every process it starts (API server, engine core, workers),
and in ``vllm serve`` before the CLI parser is built. It installs every hook in :data:`HOOKS`,
the one list of the plugin's patch points into vLLM, each named after what it patches,
grouped by the process that needs it (docs/architecture.md shows the request's path through
them). Each wraps the vLLM attribute with a function named after it
(:func:`~vllm_steer.integrations.hooks.wrap_method`), or installs something there:

- frontend (API server and ``LLM`` process, :mod:`vllm_steer.integrations.frontend`): the
  ``--steer`` flags, start-up checks, the ``steer`` request field (parsed once, into a
  :class:`~vllm_steer.request.SteerRequest`), presets as model names, the management routes,
  the engine-side refusal as HTTP 400;
- engine core (:mod:`vllm_steer.integrations.engine`): run-time management and admission
  (defaults, floors, binding each steer to its slot);
- worker (:mod:`vllm_steer.integrations.worker`): the steered LM head, the rows of each step
  (V1, Model Runner V2, prompt logprobs, speculative decoding).

Offline, pass the same configuration yourself::

    LLM(model, additional_config={"vllm_steer": {"steers": {"detox": "detox.safetensors"}}})
    SamplingParams(extra_args={"steer": {"detox": 5}})

A hook vLLM moved or removed is reported at registration: start-up fails when steers are
configured (naming the vLLM version and the hook), and a warning is logged otherwise.

This module imports no torch at import time (nor do the modules it imports).
"""

from __future__ import annotations

import functools

from vllm_steer.integrations.engine import core
from vllm_steer.integrations.frontend import (async_llm, cli_args, endpoints, preset_models,
                                              request_field, startup_checks)
from vllm_steer.integrations.hooks import Hook, install_hooks


@functools.cache
def register() -> None:
    """Entry point of the ``vllm.general_plugins`` group. Idempotent."""
    install_hooks(HOOKS)


def _worker(name: str, attr: str):
    """A worker-side wrapper, imported on its first call (the worker modules import torch:
    never at this module's import, nor in a process that never runs the runner), then called
    directly on every later step."""
    @functools.cache
    def target():
        import importlib

        return getattr(importlib.import_module(f"vllm_steer.integrations.worker.{name}"), attr)

    def call(orig, *args, **kwargs):
        return target()(orig, *args, **kwargs)

    call.__name__ = call.__qualname__ = f"{name}.{attr}"
    return call


def _install_head(owner) -> None:
    from vllm_steer.integrations.worker.head import register_head

    register_head(owner)


def _install_loader_checks(owner) -> None:
    from vllm_steer.integrations.worker.head import install_loader_checks

    install_loader_checks(owner)


_REQUESTS = request_field.REQUEST_CLASSES
_V1 = "vllm.v1.worker.gpu_model_runner:GPUModelRunner"
_V2 = "vllm.v1.worker.gpu"

HOOKS: tuple[Hook, ...] = (
    # ---- frontend: API server and LLM process (vllm_steer.integrations.frontend) ---------
    Hook("vllm.engine.arg_utils:EngineArgs.add_cli_args", "--steer flags in vllm serve",
         cli_args.add_cli_args),
    Hook("vllm.engine.arg_utils:EngineArgs.from_cli_args",
         "--steer carried in additional_config", cli_args.from_cli_args),
    Hook("vllm.engine.arg_utils:EngineArgs.create_engine_config",
         "start-up checks and our logits processor", startup_checks.create_engine_config),
    Hook("vllm.v1.engine.input_processor:InputProcessor.__init__",
         "refusing bad steers at admission (HTTP 400)", request_field.input_processor_init),
    Hook("vllm.v1.engine.input_processor:InputProcessor._build_logits_processors_params_"
         "validator", "refusing bad steers at admission (HTTP 400)"),
    *(Hook(f"{module}:{name}.model_fields", "the `steer` request field (parsed once)",
           install=request_field.add_request_field) for module, name in _REQUESTS),
    *(Hook(f"{module}:{name}.to_sampling_params",
           "the `steer` request field, then a preset's mix for its model name",
           request_field.to_sampling_params) for module, name in _REQUESTS),
    *(Hook(f"{module}:{name}.to_beam_search_params", "refusing steered beam search",
           request_field.to_beam_search_params)
      for module, name in _REQUESTS if name != "ResponsesRequest"),
    Hook("vllm.entrypoints.openai.models.serving:OpenAIModelRegistry.is_base_model",
         "presets served as model names", preset_models.is_base_model),
    Hook("vllm.entrypoints.openai.models.serving:OpenAIModelRegistry.show_available_models",
         "presets listed in /v1/models", preset_models.show_available_models),
    Hook("vllm.entrypoints.serve.engine.serving:BaseServing._check_model",
         "presets added or deleted at run time, seen by every API server",
         preset_models.check_model),
    Hook("vllm.plugins:load_endpoint_plugins",
         "the /v1/steers and /v1/steer-presets routes, the x-vllm-steer-* headers",
         endpoints.load_endpoint_plugins),
    Hook("vllm.v1.engine.async_llm:AsyncLLM.add_request",
         "--steer-dir steers loaded before admission (HTTP 400 with the reason)",
         async_llm.add_request),
    Hook("vllm.v1.engine.async_llm:AsyncLLM.generate",
         "an engine-side steer refusal answered as HTTP 400, not 500", async_llm.generate),
    # ---- engine core (vllm_steer.integrations.engine) ------------------------------------
    Hook("vllm.v1.engine.core:EngineCore.collective_rpc",
         "loading/unloading steers in the engine core (collective_rpc)", core.collective_rpc,
         process="engine"),
    Hook("vllm.v1.engine.core:EngineCore.add_request",
         "defaults, floors and binding a request's steers to (slot, generation) at admission",
         core.add_request, process="engine"),
    Hook("vllm.v1.engine:EngineCoreOutput.stop_reason",
         "the engine-side steer refusal's message (error output's stop_reason)",
         process="engine"),
    # ---- worker (vllm_steer.integrations.worker) -----------------------------------------
    Hook("vllm.model_executor.layers.logits_processor:LogitsProcessor.register_oot",
         "the steered LM head", install=_install_head, process="worker"),
    Hook("vllm.model_executor.model_loader.base_loader:BaseModelLoader.load_model",
         "checking the model's logits layer is the steered head",
         install=_install_loader_checks, process="worker"),
    Hook("vllm.v1.sample.logits_processor:LogitsProcessor", "V1 per-request steer state",
         process="worker"),
    Hook("vllm.v1.sample.logits_processor:BatchUpdate", "V1 per-request steer state",
         process="worker"),
    Hook("vllm.v1.worker.gpu_input_batch:InputBatch.__init__",
         "no output-token tracking for our processor (V1)", _worker("v1", "input_batch_init"),
         process="worker"),
    Hook(f"{_V1}._prepare_inputs",
         "generated-token positions of the batch rows for generation windows (V1)",
         _worker("v1", "prepare_inputs"), process="worker"),
    Hook(f"{_V1}._get_prompt_logprobs_dict", "steered prompt logprobs (V1)",
         _worker("v1", "get_prompt_logprobs_dict"), process="worker"),
    Hook(f"{_V1}.execute_model",
         "speculative decoding: the step's verification rows -> requests (V1)",
         _worker("spec_v1", "execute_model"), process="worker"),
    Hook(f"{_V1}._calc_spec_decode_metadata",
         "speculative decoding: draft-token counts per request (V1)",
         _worker("spec_v1", "calc_spec_decode_metadata"), process="worker"),
    Hook(f"{_V1}.propose_draft_token_ids",
         "speculative decoding: the drafter's rows -> requests (V1)",
         _worker("spec_v1", "propose_draft_token_ids"), process="worker"),
    Hook("vllm.v1.worker.gpu_model_runner:build_logitsprocs",
         "speculative decoding: our per-request steer state (V1 refuses custom processors)",
         _worker("spec_v1", "build_logitsprocs"), process="worker"),
    Hook(f"{_V2}.sample.logits_processor:LogitsProcessor", "V2 per-request steer state",
         process="worker"),
    Hook(f"{_V2}.model_runner:GPUModelRunner.sample",
         "the step's row -> request mapping (V2; verification rows too)",
         _worker("v2", "sample"), process="worker"),
    Hook(f"{_V2}.sample.prompt_logprob:PromptLogprobsWorker.compute_prompt_logprobs",
         "steered prompt logprobs (V2)", _worker("v2", "prompt_logprobs"), process="worker"),
    Hook(f"{_V2}.sample.prompt_logprob:PromptLogprobsWorker.compute_prompt_token_id_logprobs",
         "steered prompt logprobs (V2, prompt_logprob_token_ids)",
         _worker("v2", "prompt_logprobs"), process="worker"),
    Hook(f"{_V2}.sample.batch_shard:BatchSharder.shard_sampler_inputs",
         "rows of batch-sharded sampling (V2, --enable-batch-sharded-sampling)",
         process="worker"),
    Hook(f"{_V2}.spec_decode.standalone_ar.speculator:StandaloneARSpeculator.propose",
         "speculative decoding: the draft model's rows -> requests (V2)",
         _worker("spec_v2", "propose_standalone_v2"), process="worker"),
    Hook(f"{_V2}.spec_decode.speculator:DraftModelSpeculator.load_model",
         "speculative decoding: EAGLE / EAGLE-3 / MTP drafter heads prepared for CUDA graphs "
         "(V2)", _worker("spec_v2", "speculator_load_model"), process="worker"),
    Hook(f"{_V2}.spec_decode.speculator:DraftModelSpeculator.sample_draft",
         "speculative decoding: the captured draft steps' rows -> requests, on the device (V2)",
         _worker("spec_v2", "sample_draft_v2"), process="worker"),
)


def hooks_table() -> str:
    """:data:`HOOKS` as the Markdown table of docs/architecture.md (a test keeps them equal;
    regenerate with ``python -c "from vllm_steer.integrations.plugin import hooks_table;
    print(hooks_table())"``)."""
    rows = ["| process | vLLM attribute | our function | why |", "|---|---|---|---|"]
    for h in HOOKS:
        if h.wrapper is not None:
            fn = getattr(h.wrapper, "__module__", "") + "." + h.wrapper.__qualname__
            fn = fn.replace("vllm_steer.integrations.plugin._worker.<locals>.call",
                            "worker." + h.wrapper.__name__)
            if "<locals>" not in fn and not fn.startswith("worker."):
                fn = fn.replace("vllm_steer.integrations.", "")
        elif h.install is not None:
            fn = "install: " + h.install.__module__.replace("vllm_steer.integrations.", "") + \
                "." + h.install.__qualname__
        else:
            fn = "(checked only)"
        rows.append(f"| {h.process} | `{h.target}` | `{fn}` | {h.purpose} |")
    return "\n".join(rows)
