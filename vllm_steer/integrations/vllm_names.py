"""vLLM's classes as the hooks (:mod:`vllm_steer.integrations.plugin`) and the accessor layer
(:mod:`vllm_steer.integrations.vllm_access`) name them, ``module:Class``: one spelling for
both, so that a class vLLM moves is renamed in one place."""

from __future__ import annotations

CONFIG = "vllm.config:VllmConfig"
MODEL = "vllm.config.model:ModelConfig"
SPEC_CONFIG = "vllm.config.speculative:SpeculativeConfig"
ENGINE_CORE = "vllm.v1.engine.core:EngineCore"
SCHEDULER = "vllm.v1.core.sched.scheduler:Scheduler"
OUTPUT = "vllm.v1.outputs:ModelRunnerOutput"
REGISTRY = "vllm.entrypoints.openai.models.serving:OpenAIModelRegistry"
ANTHROPIC_REQUEST = "vllm.entrypoints.anthropic.protocol:AnthropicMessagesRequest"
"""The Anthropic Messages API's request model (``/v1/messages``)."""
ANTHROPIC_SERVING = "vllm.entrypoints.anthropic.serving:AnthropicServingMessages"
"""What serves ``/v1/messages`` as a chat completion request it builds."""
V1_RUNNER = "vllm.v1.worker.gpu_model_runner:GPUModelRunner"
V1_BATCH = "vllm.v1.worker.gpu_input_batch:InputBatch"
V2 = "vllm.v1.worker.gpu"
"""Model Runner V2's package."""
V2_RUNNER = f"{V2}.model_runner:GPUModelRunner"
V2_BATCH = f"{V2}.input_batch:InputBatch"
V2_STATES = f"{V2}.states:RequestState"
V2_SPECULATOR = f"{V2}.spec_decode.speculator:DraftModelSpeculator"
V2_PROMPT = f"{V2}.sample.prompt_logprob:PromptLogprobsWorker"
