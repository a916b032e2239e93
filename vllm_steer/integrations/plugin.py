"""The vLLM general plugin (entry point ``vllm.general_plugins``: ``vllm_steer``).

vLLM calls :func:`register` in every process it starts (API server, engine core, workers),
and in ``vllm serve`` before the CLI parser is built. It installs every hook in :data:`HOOKS`,
the one list of the plugin's patch points into vLLM, each named after what it patches, in
the group that needs it (:data:`~vllm_steer.integrations.hooks.GROUPS`: frontend, engine,
worker, each model runner with its prompt logprobs and its speculative decoding), with the
private vLLM names its wrapper reads (``reads``), the parameters it binds by name
(``params``) and, for a name patched where it is imported, the functions that must still call
it through that name (``called_by``); a method a vLLM release renamed keeps one hook, with the
new name as an :class:`~vllm_steer.integrations.hooks.Alternative` for the releases that have
it; docs/architecture.md shows the request's path through
them. Each wraps the vLLM attribute with a function named after it
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

A hook vLLM moved or removed is reported at registration, with the groups it makes
unavailable; start-up with steers fails only when the configuration uses one of them (naming
the vLLM version, the group and the hook). ``scripts/vllm_surface.py`` writes the names these
hooks need, per vLLM version, to the manifests the tests check them against.

This module imports no torch at import time (nor do the modules it imports).
"""

from __future__ import annotations

import functools

from vllm_steer.integrations.engine import core, worker_faults
from vllm_steer.integrations.frontend import (async_llm, cli_args, endpoints, preset_models,
                                              request_field, responses_stream, startup_checks)
from vllm_steer.integrations.hooks import (ENGINE, FRONTEND, RESOLVE_ATTR, V1, V1_LENS,
                                           V1_SPEC, V2, V2_LENS, V2_SPEC, WORKER, Hook,
                                           install_hooks)
from vllm_steer.integrations.vllm_names import (ANTHROPIC_REQUEST as _ANTHROPIC_REQUEST,
                                                ANTHROPIC_SERVING as _ANTHROPIC_SERVING,
                                                REGISTRY as _REGISTRY, V1_BATCH as _V1_BATCH,
                                                V1_RUNNER as _V1, V2 as _V2,
                                                V2_PROMPT as _V2_PROMPT, V2_RUNNER as _V2_RUNNER,
                                                V2_SPECULATOR as _V2_SPECULATOR)


@functools.cache
def register() -> None:
    """Entry point of the ``vllm.general_plugins`` group. Idempotent."""
    install_hooks(HOOKS)


#: Attribute of a :func:`_worker` wrapper: the ``module:function`` it calls.
WORKER_TARGET_ATTR = "vllm_steer_calls"


def _worker(name: str, attr: str):
    """A worker-side wrapper, imported on its first call (the worker modules import torch:
    never at this module's import, nor in a process that never runs the runner), then called
    directly on every later step (:data:`~vllm_steer.integrations.hooks.RESOLVE_ATTR`: the
    patched method calls the imported function itself). It names what it calls in
    :data:`WORKER_TARGET_ATTR`."""
    module = f"vllm_steer.integrations.worker.{name}"

    @functools.cache
    def target():
        import importlib

        return getattr(importlib.import_module(module), attr)

    def call(orig, *args, **kwargs):
        return target()(orig, *args, **kwargs)

    call.__name__ = attr
    call.__qualname__ = f"_worker.{name}.{attr}"
    setattr(call, WORKER_TARGET_ATTR, f"{module}:{attr}")
    setattr(call, RESOLVE_ATTR, target)  # wrap_method then calls the target directly
    return call


def _install_head(owner) -> None:
    from vllm_steer.integrations.worker.head import register_head

    register_head(owner)


def _install_loader_checks(owner) -> None:
    from vllm_steer.integrations.worker.head import install_loader_checks

    install_loader_checks(owner)


_REQUESTS = request_field.REQUEST_CLASSES
# vLLM's modules and classes the hooks name (targets and the names their wrappers read)




HOOKS: tuple[Hook, ...] = (
    # ---- frontend: API server and LLM process (vllm_steer.integrations.frontend) ---------
    Hook("vllm.engine.arg_utils:EngineArgs.add_cli_args", "--steer flags in vllm serve",
         cli_args.add_cli_args, params=("parser",)),
    Hook("vllm.engine.arg_utils:EngineArgs.from_cli_args",
         "--steer carried in additional_config", cli_args.from_cli_args, params=("args",)),
    Hook("vllm.engine.arg_utils:EngineArgs.create_engine_config",
         "start-up checks and our logits processor", startup_checks.create_engine_config),
    Hook("vllm.v1.engine.input_processor:InputProcessor.__init__",
         "refusing bad steers at admission (HTTP 400)", request_field.input_processor_init,
         params=("vllm_config",)),
    Hook("vllm.v1.engine.input_processor:InputProcessor._build_logits_processors_params_"
         "validator", "refusing bad steers at admission (HTTP 400)",
         request_field.params_validator),
    # the field is added by vllm_access.add_request_field (pydantic's private names: there)
    *(Hook(f"{module}:{name}.model_fields", "the `steer` request field (parsed once)",
           install=request_field.add_request_field) for module, name in _REQUESTS),
    *(Hook(f"{module}:{name}.to_sampling_params",
           "the `steer` request field, then a preset's mix for its model name",
           request_field.to_sampling_params) for module, name in _REQUESTS),
    *(Hook(f"{module}:{name}.to_beam_search_params", "refusing steered beam search",
           request_field.to_beam_search_params)
      for module, name in _REQUESTS if name != "ResponsesRequest"),
    Hook(f"{_ANTHROPIC_REQUEST}.model_fields",
         "the `steer` request field on /v1/messages (parsed once)",
         install=request_field.add_request_field),
    Hook(f"{_ANTHROPIC_SERVING}._build_base_request",
         "/v1/messages' `steer` carried into the chat request it is served as",
         request_field.anthropic_to_chat, params=("anthropic_request", "openai_messages")),
    Hook(f"{_REGISTRY}.is_base_model",
         "presets served as model names", preset_models.is_base_model,
         params=("model_name",)),
    Hook(f"{_REGISTRY}.show_available_models",
         "presets listed in /v1/models", preset_models.show_available_models),
    Hook("vllm.entrypoints.serve.engine.serving:BaseServing._check_model",
         "presets added or deleted at run time, seen by every API server",
         preset_models.check_model, params=("request",)),
    Hook("vllm.plugins:load_endpoint_plugins",
         "the /v1/steers and /v1/steer-presets routes, the x-vllm-steer-* headers",
         endpoints.load_endpoint_plugins, params=("supported_tasks",),
         called_by=("vllm.plugins.endpoint_plugins.interface:attach_endpoint_plugins",)),
    Hook("vllm.v1.engine.async_llm:AsyncLLM.add_request",
         "--steer-dir steers loaded before admission (HTTP 400 with the reason, 429 when "
         "the bank stays full)",
         async_llm.add_request, params=("request_id", "prompt", "params")),
    Hook("vllm.v1.engine.async_llm:AsyncLLM.generate",
         "an engine-side steer refusal answered as HTTP 400, not 500; a steered request's "
         "end wakes the requests waiting for a steer slot", async_llm.generate,
         params=("prompt", "sampling_params")),
    Hook("vllm.entrypoints.openai.responses.serving:OpenAIServingResponses.create_responses",
         "a streamed /v1/responses refused by the plugin answered with its status (400, 429 "
         "with Retry-After) before its first event, not cut off after response.created",
         responses_stream.create_responses, params=("request",)),
    # ---- engine core (vllm_steer.integrations.engine) ------------------------------------
    Hook("vllm.v1.engine.core:EngineCore._initialize_kv_caches",
         "the engine core's steers read as it starts, once its workers have read them "
         "(EngineCore.__init__ loads the plugins: a spawned engine core's own call of it is "
         "not patched yet)", core.start, group=ENGINE, params=("vllm_config",)),
    Hook("vllm.v1.engine.core:EngineCore.collective_rpc",
         "loading/unloading steers in the engine core (collective_rpc)", core.collective_rpc,
         group=ENGINE, params=("method", "timeout", "args", "kwargs")),
    Hook("vllm.v1.engine.core:EngineCore.add_request",
         "binding a request's steers to (bank slot, load) at admission",
         core.add_request, group=ENGINE, params=("request", "request_wave")),
    Hook("vllm.v1.engine.core_client:InprocClient.get_output",
         "offline with the engine core in the LLM's process: a request the engine core "
         "refused ends with its error output, not unfinished for ever", core.inproc_get_output,
         group=FRONTEND),  # the LLM's process
    Hook("vllm.v1.core.sched.scheduler:Scheduler.update_from_output",
         "a fault of the plugin's worker code fails only the requests its step steered "
         "(HTTP 500)", worker_faults.update_from_output, group=ENGINE,
         params=("scheduler_output", "model_runner_output")),
    Hook("vllm.v1.engine:EngineCoreOutput.stop_reason",
         "the engine-side steer refusal's message (error output's stop_reason)", group=ENGINE),
    # ---- worker, every runner (vllm_steer.integrations.worker) ---------------------------
    Hook("vllm.model_executor.layers.logits_processor:LogitsProcessor.register_oot",
         "the steered LM head", install=_install_head, group=WORKER,
         # what the head module uses itself: the registry, its base class's own methods
         reads=("vllm.model_executor.custom_op:op_registry_oot",
                *(f"vllm.model_executor.layers.logits_processor:LogitsProcessor.{n}"
                  for n in ("forward", "get_top_tokens")))),
    Hook("vllm.model_executor.model_loader.base_loader:BaseModelLoader.load_model",
         "checking the model's logits layer is the steered head",
         install=_install_loader_checks, group=WORKER, params=("vllm_config",)),
    # ---- V1 model runner ------------------------------------------------------------------
    Hook("vllm.v1.sample.logits_processor:LogitsProcessor", "V1 per-request steer state",
         group=V1, reads=("vllm.v1.sample.logits_processor:BatchUpdate",)),
    Hook("vllm.v1.sample.logits_processor:BatchUpdate", "V1 per-request steer state",
         group=V1),
    Hook(f"{_V1_BATCH}.__init__",
         "no output-token tracking for our processor (V1)", _worker("v1", "input_batch_init"),
         group=V1),
    Hook(f"{_V1}._prepare_inputs",
         "a speculative step's rows start as the batch while a request is steered; the "
         "generated-token positions of the batch rows for generation windows, and the step "
         "mapping of the decoder layers' steers (V1)",
         _worker("v1", "prepare_inputs"), group=V1,
         params=("scheduler_output", "num_scheduled_tokens"),
         gates=("speculative_runtimes", "windowed_slots", "layer_mappings")),
    Hook(f"{_V1}.sample_tokens",
         "the requests a fault of the plugin's worker code failed, named in the step's output "
         "(V1)", _worker("v1", "sample_tokens"), group=V1,
         gates=("worker_faults",), after=True),
    Hook(f"{_V1}._get_prompt_logprobs_dict", "steered prompt logprobs (V1)",
         _worker("v1", "get_prompt_logprobs_dict"), group=V1_LENS,
         params=("hidden_states", "num_scheduled_tokens"), gates=("prompt_logprob_slots",)),
    # ---- speculative decoding on the V1 model runner --------------------------------------
    Hook(f"{_V1}._calc_spec_decode_metadata",
         "speculative decoding: draft-token counts per request (V1)",
         _worker("spec_v1", "calc_spec_decode_metadata"), group=V1_SPEC,
         params=("num_draft_tokens", "cu_num_scheduled_tokens")),
    Hook(f"{_V1}.propose_draft_token_ids",
         "speculative decoding: the drafter's rows -> requests (V1)",
         _worker("spec_v1", "propose_draft_token_ids"), group=V1_SPEC),
    Hook("vllm.v1.worker.gpu_model_runner:build_logitsprocs",
         "speculative decoding: our per-request steer state (V1 refuses custom processors)",
         _worker("spec_v1", "build_logitsprocs"), group=V1_SPEC,
         params=("vllm_config", "device", "is_pin_memory", "is_pooling_model",
                 "custom_logitsprocs"),
         called_by=(f"{_V1}.__init__",)),
    # ---- Model Runner V2 ------------------------------------------------------------------
    Hook(f"{_V2}.sample.logits_processor:LogitsProcessor", "V2 per-request steer state",
         group=V2),
    Hook(f"{_V2_RUNNER}.sample",
         "the step's row -> request mapping (V2; verification rows too)",
         _worker("v2", "sample"), group=V2,
         params=("hidden_states", "input_batch", "grammar_output"), gates=("steered_slots",)),
    Hook(f"{_V2_RUNNER}.prepare_inputs",
         "the step mapping of the decoder layers' steers (V2)",
         _worker("v2", "prepare_inputs"), group=V2,  # the batch: vllm_access.v2_step_tokens
         gates=("layer_mappings",)),
    Hook(f"{_V2_RUNNER}.add_requests",
         "a pipeline stage without the LM head (no sampler): its requests' slots for the "
         "decoder layers' steers (V2)", _worker("v2", "add_requests"), group=V2,
         params=("scheduler_output",), gates=("layer_mappings",)),
    Hook(f"{_V2_RUNNER}.sample_tokens",
         "the requests a fault of the plugin's worker code failed, named in the step's output "
         "(V2)", _worker("v2", "sample_tokens"), group=V2,
         gates=("worker_faults",), after=True),
    Hook(f"{_V2}.sample.batch_shard:BatchSharder.shard_sampler_inputs",
         "rows of batch-sharded sampling (V2, --enable-batch-sharded-sampling)",
         _worker("v2", "shard_sampler_inputs"), group=V2, gates=("steered_slots",)),
    Hook(f"{_V2_PROMPT}.compute_prompt_logprobs",
         "steered prompt logprobs (V2)", _worker("v2", "prompt_logprobs"), group=V2_LENS,
         params=("logits_fn", "hidden_states", "input_batch"), gates=("prompt_logprob_slots",)),
    Hook(f"{_V2_PROMPT}.compute_prompt_token_id_logprobs",
         "steered prompt logprobs (V2, prompt_logprob_token_ids)",
         _worker("v2", "prompt_token_id_logprobs"), group=V2_LENS,
         params=("logits_fn", "hidden_states", "input_batch"), gates=("prompt_logprob_slots",)),
    # ---- speculative decoding on Model Runner V2 ------------------------------------------
    Hook(f"{_V2}.spec_decode.standalone_ar.speculator:StandaloneARSpeculator.propose",
         "speculative decoding: the draft model's rows -> requests (V2)",
         _worker("spec_v2", "propose_standalone_v2"), group=V2_SPEC,
         params=("input_batch",)),
    Hook(f"{_V2_SPECULATOR}.load_model",
         "speculative decoding: EAGLE / EAGLE-3 / MTP drafter heads prepared for CUDA graphs "
         "(V2)", _worker("spec_v2", "speculator_load_model"), group=V2_SPEC),
    Hook(f"{_V2_SPECULATOR}.sample_draft",
         "speculative decoding: the captured draft steps' rows -> requests, on the device (V2)",
         _worker("spec_v2", "sample_draft_v2"), group=V2_SPEC, params=("idx_mapping",)),
)


def wrapper_name(hook: Hook) -> str:
    """What the hook installs, as the table shows it: the wrapper's ``module.function`` (a
    lazily imported worker wrapper: the function it calls), ``install: module.function``, or
    ``(checked only)``; modules relative to ``vllm_steer.integrations``."""
    if hook.wrapper is not None:
        fn = getattr(hook.wrapper, WORKER_TARGET_ATTR, None) or \
            f"{hook.wrapper.__module__}:{hook.wrapper.__qualname__}"
        prefix = ""
    elif hook.install is not None:
        fn = f"{hook.install.__module__}:{hook.install.__qualname__}"
        prefix = "install: "
    else:
        return "(checked only)"
    return prefix + fn.replace("vllm_steer.integrations.", "").replace(":", ".")


def hooks_table() -> str:
    """:data:`HOOKS` as the Markdown table of docs/architecture.md (a test keeps them equal;
    regenerate with ``python -c "from vllm_steer.integrations.plugin import hooks_table;
    print(hooks_table())"``)."""
    rows = ["| group | vLLM attribute | our function | why |", "|---|---|---|---|"]
    for h in HOOKS:
        names = f"`{h.target}`" + (f" (vLLM {h.versions})" if h.versions else "") + "".join(
            f"<br>or `{t.target}` (vLLM {t.versions})" for t in h.alternatives)
        gated = ("<br>after, " if h.after else "<br>") + "while " + " or ".join(
            f"`{g}`" for g in h.gates) if h.gates else ""
        rows.append(f"| {h.group.name} | {names} | `{wrapper_name(h)}`{gated} | {h.purpose} |")
    return "\n".join(rows)
