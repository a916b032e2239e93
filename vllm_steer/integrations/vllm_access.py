"""Where the plugin reads and writes vLLM's objects, its hook wrappers included: one small
named function per access (the configuration, the OpenAI request models, a request's sampling
parameters, the pipeline-parallel group, the engine client of the HTTP routes, the engine
core's scheduler and outputs, the model runners' batches and rows, the drafters).

Each function is declared in :data:`ACCESSES` as an :class:`Access`: the vLLM names it reads
or sets, ``module:Class.name`` as vLLM defines them (and pydantic's private names it edits
the request models with), for the vLLM releases in :attr:`Access.versions`, and where vLLM
moved a name, the names of the other releases (:class:`Release`). The start-up check
(:func:`vllm_steer.integrations.hook_check.check_hooks`) looks every declared name up on the
installed vLLM's surface, as it does the hooks' (the committed manifest in
``vllm_steer/integrations/surfaces/`` when there is one, else vLLM's source), so a release that
renamed one is refused at start-up, naming the access. ``tests/integrations/
test_declared_reads.py`` keeps the rule: outside this module the plugin touches no attribute
of a vLLM object.

This module imports neither torch nor vLLM at import time (the frontend imports it).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable

from vllm_steer.integrations.hooks import (ENGINE, FRONTEND, V1, V1_LENS, V1_SPEC, V2,
                                           V2_LENS, V2_SPEC, WORKER, Alternative, HookGroup,
                                           reads_of)
from vllm_steer.integrations.vllm_names import (CONFIG as _CONFIG, ENGINE_CORE as _CORE,
                                                MODEL as _MODEL, OUTPUT as _OUTPUT,
                                                REGISTRY as _REGISTRY, SCHEDULER as _SCHEDULER,
                                                SPEC_CONFIG as _SPEC, V1_BATCH as _V1_BATCH,
                                                V1_RUNNER as _V1, V2 as _V2, V2_BATCH as _V2_BATCH,
                                                V2_PROMPT as _V2_PROMPT, V2_RUNNER as _V2_RUNNER,
                                                V2_SPECULATOR as _V2_SPECULATOR,
                                                V2_STATES as _V2_STATES)


@dataclass(frozen=True)
class Release:
    """The names an access touches in some vLLM releases (where vLLM moved one)."""

    versions: str
    """The releases, a pip version specifier (``">=0.33"``)."""
    reads: tuple[str, ...] = ()
    """What the access reads there (as :attr:`Access.reads`)."""
    sets: tuple[str, ...] = ()
    """What it sets there (as :attr:`Access.sets`)."""


@dataclass(frozen=True)
class Access:
    """One function of this module that touches vLLM objects, and what it touches."""

    function: Callable
    """The accessor (a function of this module)."""
    purpose: str
    """What the plugin needs it for (shown when the installed vLLM lacks a name)."""
    group: HookGroup
    """The hook group whose configurations call it (checked at start-up with that group)."""
    reads: tuple[str, ...] = ()
    """Every name it reads, ``module:Class.name`` (checked on the vLLM surface; names of
    another package, pydantic's, on that package's installed source)."""
    sets: tuple[str, ...] = ()
    """Every name it assigns on a vLLM object (checked like :attr:`reads`)."""
    versions: str = ""
    """The vLLM releases these names hold for, a pip specifier (empty: every release)."""
    releases: tuple[Release, ...] = ()
    """The names in other releases, where vLLM moved one: the first whose releases hold the
    installed vLLM is checked (:meth:`names_for`); on a release none holds, the start-up
    check refuses the group, naming the access."""

    @property
    def names(self) -> tuple[str, ...]:
        """:attr:`reads` then :attr:`sets`."""
        return (*self.reads, *self.sets)

    @property
    def all_names(self) -> tuple[str, ...]:
        """Every name of every release (what a manifest records)."""
        return (*self.names, *(n for r in self.releases for n in (*r.reads, *r.sets)))

    def names_for(self, version: str) -> tuple[str, ...] | None:
        """The names touched on vLLM ``version`` (None: no release declared for it)."""
        if self.holds(version):
            return self.names
        return next(((*r.reads, *r.sets) for r in self.releases
                     if Alternative("", r.versions).holds(version)), None)

    # what the manifest writer (vllm_steer.integrations.manifest.needed) asks of a hook
    targets: tuple[Alternative, ...] = ()
    """Always empty: an access patches nothing (present so the manifest reads it as a hook)."""
    called_by: tuple[str, ...] = ()
    """Always empty (as :attr:`targets`)."""

    def holds(self, version: str) -> bool:
        """Whether vLLM ``version`` is one of :attr:`versions`."""
        return Alternative("", self.versions).holds(version)


# vLLM's classes the accesses name
_PARALLEL = "vllm.config.parallel:ParallelConfig"
_ENGINE_ARGS = "vllm.engine.arg_utils:EngineArgs"
_INPUT_PROCESSOR = "vllm.v1.engine.input_processor:InputProcessor"
_PARAMS = "vllm.sampling_params:SamplingParams"
_ASYNC_LLM = "vllm.v1.engine.async_llm:AsyncLLM"
_PYDANTIC = "pydantic._internal._decorators"
_V1_BUFFER = "vllm.v1.utils:CpuGpuBuffer"  # the runner's _make_buffer: .np (host), .gpu
_BASE_PATH = "vllm.entrypoints.openai.models.protocol:BaseModelPath"
_LOGITS_LAYER = "vllm.model_executor.layers.logits_processor:LogitsProcessor"
_TEXT_MODEL = "vllm.model_executor.models.interfaces_base:VllmModelForTextGeneration"
_LORA_PATH = "vllm.entrypoints.openai.models.protocol:LoRAModulePath"
#: Where vLLM's API server fills ``app.state`` (``args``, ``openai_serving_models``, ...).
_APP_STATE = "vllm.entrypoints.launchers.api_server.app_state"
_V2_STANDALONE = f"{_V2}.spec_decode.standalone_ar.speculator:StandaloneARSpeculator"
_RESPONSES_REQUEST = "vllm.entrypoints.openai.responses.protocol:ResponsesRequest"
#: The OpenAI request models that carry the ``steer`` field, ``(module, class)``.
REQUEST_CLASSES = (
    ("vllm.entrypoints.openai.completion.protocol", "CompletionRequest"),
    ("vllm.entrypoints.openai.chat_completion.protocol", "ChatCompletionRequest"),
    ("vllm.entrypoints.openai.responses.protocol", "ResponsesRequest"),
)


def _each_request(*names: str) -> tuple[str, ...]:
    return tuple(f"{m}:{c}.{n}" for m, c in REQUEST_CLASSES for n in names)


# ---- the configuration (VllmConfig, ModelConfig), in every process ------------------------
def additional_config(config) -> dict | None:
    """``additional_config`` of a ``VllmConfig`` or of ``EngineArgs`` (and the CLI namespace
    they are built from): where ``--steer`` travels."""
    return getattr(config, "additional_config", None)


def set_additional_config(config, value: dict) -> None:
    """Write ``additional_config`` of ``EngineArgs`` or of the CLI namespace."""
    config.additional_config = value


def model_config(vllm_config):
    """The ``ModelConfig`` of a ``VllmConfig``."""
    return vllm_config.model_config


def uses_v2_runner(vllm_config) -> bool:
    """Whether the engine runs Model Runner V2 (vLLM's ``use_v2_model_runner``)."""
    return bool(getattr(vllm_config, "use_v2_model_runner", False))


def speculative_config(vllm_config):
    """The ``SpeculativeConfig`` (None: no speculative decoding)."""
    return getattr(vllm_config, "speculative_config", None)


def speculative_method(vllm_config) -> str | None:
    """The speculative-decoding method (``ngram``, ``eagle``, ...), None without one."""
    return getattr(speculative_config(vllm_config), "method", None)


def adaptive_verification(vllm_config) -> bool:
    """Whether speculative decoding verifies an adaptive share of the drafts
    (``enable_adaptive_verification``: Model Runner V2 splits the draft budget between the
    requests on the device, and its host ``query_start_loc_np`` / ``cu_num_logits_np`` are
    placeholders)."""
    return bool(getattr(speculative_config(vllm_config), "enable_adaptive_verification", False))


def rejection_sample_method(vllm_config) -> str:
    """How speculative decoding verifies the drafts (``rejection_sample_method``:
    ``"standard"`` when unset or without speculative decoding)."""
    return getattr(speculative_config(vllm_config), "rejection_sample_method",
                   None) or "standard"


#: ``additional_config["decode_backend"]`` of the models with a specialized decode executor
#: (vLLM 0.33: DeepSeek-V4.1 and Kimi-K3 on NVIDIA, Kimi-K3 on ROCm); "auto": vLLM's decode.
DECODE_BACKEND_KEY = "decode_backend"


def decode_backend(vllm_config) -> str:
    """The decode backend asked for in ``additional_config`` (``"auto"`` when not given)."""
    extra = additional_config(vllm_config)
    value = extra.get(DECODE_BACKEND_KEY) if isinstance(extra, dict) else None
    return "auto" if value is None else str(value)


def monokernel(vllm_config) -> bool:
    """``--monokernel`` (vLLM 0.33's ``KernelConfig.monokernel``: fused decode layers of some
    models on ROCm); False on a vLLM without it."""
    return bool(getattr(getattr(vllm_config, "kernel_config", None), "monokernel", False))


def data_parallel_size(vllm_config) -> int:
    """``--data-parallel-size`` (1 without a parallel config)."""
    pc = getattr(vllm_config, "parallel_config", None)
    return getattr(pc, "data_parallel_size", 1) or 1


#: ``ParallelConfig`` flags of the data-parallel modes that refuse run-time steers.
DATA_PARALLEL_MODES = ("data_parallel_external_lb", "data_parallel_hybrid_lb",
                       "enable_elastic_ep")


def data_parallel_modes(vllm_config) -> dict[str, bool]:
    """Each flag of :data:`DATA_PARALLEL_MODES` (False when unset)."""
    pc = getattr(vllm_config, "parallel_config", None)
    return {name: bool(getattr(pc, name, False)) for name in DATA_PARALLEL_MODES}


def model_name(model_config) -> str:
    """The model's name or path (``ModelConfig.model``)."""
    return getattr(model_config, "model", "?")


def served_model_names(model_config) -> list[str]:
    """``--served-model-name``, as a list of strings (empty: not given)."""
    served = getattr(model_config, "served_model_name", None)
    return [str(n) for n in ([served] if isinstance(served, str) else served or [])]


def is_pooling(model_config) -> bool:
    """Whether the model runs as a pooling model (``runner_type == "pooling"``): nothing is
    sampled, so nothing is steered."""
    return getattr(model_config, "runner_type", "generate") == "pooling"


def enforce_eager(model_config) -> bool:
    """``--enforce-eager``: vLLM captures no CUDA graphs (nor does the head's op)."""
    return bool(getattr(model_config, "enforce_eager", False))


def logits_processors(model_config) -> list:
    """The custom logits processors vLLM loads in its workers (a copy)."""
    return list(model_config.logits_processors or [])


def set_logits_processors(model_config, procs: list) -> None:
    """Write ``ModelConfig.logits_processors`` (how our per-request state reaches the
    workers)."""
    model_config.logits_processors = procs


def architectures(model_config) -> list[str]:
    """The model's architectures: vLLM's, then the Hugging Face config's others."""
    archs = list(getattr(model_config, "architectures", None) or [])
    hf = getattr(model_config, "hf_config", None)
    archs += [a for a in (getattr(hf, "architectures", None) or []) if a not in archs]
    return archs


def text_config_value(model_config, name: str):
    """A field of the model's text config (``hf_text_config``, else ``hf_config``), or None."""
    cfg = getattr(model_config, "hf_text_config", None) or getattr(model_config, "hf_config",
                                                                   None)
    return getattr(cfg, name, None)


def hidden_size(model_config) -> int:
    """vLLM's hidden size of the model."""
    return model_config.get_hidden_size()


def input_processor_config(processor):
    """The ``VllmConfig`` an ``InputProcessor`` was built with."""
    return processor.vllm_config


# ---- the engine core ---------------------------------------------------------------------
def engine_config(core):
    """The ``VllmConfig`` of an engine core."""
    return core.vllm_config


def engine_index(core) -> int:
    """An engine core's data-parallel rank (0 without data parallelism)."""
    return int(getattr(core, "engine_index", 0) or 0)


def sampling_params(request):
    """The ``SamplingParams`` of an engine-core ``Request`` (None: a pooling request)."""
    return getattr(request, "sampling_params", None)


def extra_args(params) -> dict:
    """``SamplingParams.extra_args`` (empty when unset)."""
    return getattr(params, "extra_args", None) or {}


def asks_prompt_logprobs(params) -> bool:
    """Whether a request (its ``SamplingParams``) asks for prompt logprobs, or for the
    logprobs of given prompt tokens (a pooling request's parameters have neither)."""
    return getattr(params, "prompt_logprobs", None) is not None \
        or getattr(params, "prompt_logprob_token_ids", None) is not None


def set_extra_args(params, extra: dict) -> None:
    """Write ``SamplingParams.extra_args`` (the bound steers travel there to the workers)."""
    params.extra_args = extra


def put_extra_arg(params, key: str, value) -> None:
    """Set ``SamplingParams.extra_args[key]`` in the dict the params hold, when they hold one
    (a caller's own, reused across calls: its later changes reach the next admission), else
    in a new one."""
    extra = getattr(params, "extra_args", None)
    if isinstance(extra, dict):
        extra[key] = value
    else:
        params.extra_args = {key: value}


def cache_salt(request) -> str | None:
    """An engine-core ``Request``'s ``cache_salt`` (None: unsalted)."""
    return getattr(request, "cache_salt", None)


def aborts_immediately(request) -> bool:
    """Whether an engine-core ``Request`` is only a clean-up marker that vLLM adds to abort it
    at once (``abort_immediately``: the connector's ``request_finished`` frees the KV-transfer
    resources held for it). vLLM 0.33's paused engine re-adds a client's rejected request this
    way, its sampling params (and steer) included; it never runs."""
    return bool(getattr(request, "abort_immediately", False))


def prompt_tokens(request) -> int:
    """An engine-core ``Request``'s prompt length in tokens."""
    return request.num_prompt_tokens


def resalt_request(request, salt: str) -> None:
    """Give an engine-core ``Request`` a new ``cache_salt`` and compute its block hashes again
    (vLLM computed them from the old salt when it made the request; the hasher continues
    from the hashes it finds, so they are cleared first)."""
    request.cache_salt = salt
    hashes = getattr(request, "block_hashes", None)
    if hashes:
        hashes.clear()
        request.update_block_hashes()


# ---- the model, for steers inside its decoder layers -------------------------------------
def num_hidden_layers(mc) -> int:
    """The model's decoder blocks (its text config's ``num_hidden_layers``)."""
    return int(text_config_value(mc, "num_hidden_layers"))


def model_type(mc) -> str | None:
    """The model's architecture name (its text config's ``model_type``)."""
    return text_config_value(mc, "model_type")


def max_step_tokens(vllm_config) -> int:
    """The most tokens one step's forward runs: ``max_num_batched_tokens``, or the largest
    CUDA-graph capture size when that is larger."""
    capture = getattr(vllm_config.compilation_config, "max_cudagraph_capture_size", None) or 0
    return max(int(vllm_config.scheduler_config.max_num_batched_tokens), int(capture))


def sequence_parallelism(vllm_config) -> bool:
    """Whether vLLM's sequence-parallelism pass is on (its name differs between releases)."""
    pc = getattr(vllm_config.compilation_config, "pass_config", None)
    return any(bool(getattr(pc, flag, False)) for flag in _SEQUENCE_PARALLEL_FLAGS)


#: The pass-config flag of sequence parallelism, by the names releases gave it.
_SEQUENCE_PARALLEL_FLAGS = ("enable_sp", "enable_sequence_parallelism")


def token_splitting(vllm_config) -> dict[str, bool]:
    """Whether each step's tokens are split before the model's blocks run: micro-batching
    (``--enable-dbo``, or ``ubatch_size`` above 1: the blocks run once per slice of the step)
    and prefill context parallelism (``--prefill-context-parallel-size`` above 1: each rank's
    blocks run a reordered share of the step)."""
    pc = getattr(vllm_config, "parallel_config", None)
    return {"micro-batching (--enable-dbo / ubatch_size)":
            bool(getattr(pc, "enable_dbo", False)) or int(getattr(pc, "ubatch_size", 0) or 0) > 1,
            "prefill context parallelism (--prefill-context-parallel-size)":
            int(getattr(pc, "prefill_context_parallel_size", 1) or 1) > 1}


# ---- the runners' adapters of the step mapping -------------------------------------------
def v1_step_tokens(input_batch, num_scheduled, computed=None):
    """V1's step (the persistent batch: request slot ``i`` is batch row ``i``, its tokens
    consecutive in batch order): ``(req_slots, counts, gen_first)``, each request's slot, its
    number of tokens in the step and the generated-token index its first token's row samples
    (negative: a prompt token). ``computed``: the true computed-token counts when the batch's
    host counts are optimistic (:func:`v1_corrected_computed_tokens`). Host arrays only."""
    import numpy as np

    n = input_batch.num_reqs
    counts = np.asarray(num_scheduled[:n], dtype=np.int64)
    if computed is None:
        computed = input_batch.num_computed_tokens_cpu[:n]
    computed = np.asarray(computed, dtype=np.int64)
    gen_first = computed + 1 - np.asarray(input_batch.num_prompt_tokens[:n], dtype=np.int64)
    return np.arange(n, dtype=np.int64), counts, gen_first


def v1_input_batch(runner):
    """V1's persistent batch (row ``i``: request slot ``i``)."""
    return runner.input_batch


def v1_num_reqs(input_batch) -> int:
    """The requests in V1's persistent batch (its rows ``0 .. num_reqs - 1``)."""
    return input_batch.num_reqs


def v1_batch_positions(input_batch, num_scheduled, computed=None):
    """The generated-token index each row of V1's persistent batch samples: ``computed +
    scheduled - prompt`` (0: the first generated token). ``computed``: the true
    computed-token counts when the batch's host counts are optimistic
    (:func:`v1_corrected_computed_tokens`). Host arrays only."""
    import numpy as np

    n = input_batch.num_reqs
    if computed is None:
        computed = input_batch.num_computed_tokens_cpu[:n]
    return (np.asarray(computed, dtype=np.int64) + np.asarray(num_scheduled[:n], dtype=np.int64)
            - np.asarray(input_batch.num_prompt_tokens[:n], dtype=np.int64))


def v1_step_output(out):
    """``(ModelRunnerOutput, its request ids)`` of what V1's ``sample_tokens`` returned (an
    async output holds the step's ``ModelRunnerOutput``)."""
    output = getattr(out, "_model_runner_output", out)
    return output, getattr(output, "req_ids", None) or ()


def v1_untrack_output_token_ids(input_batch) -> bool:
    """Turn V1's tracking of output token ids off when every custom logits processor of
    ``input_batch`` declares ``needs_output_token_ids = False`` (vLLM's built-in ones keep
    theirs: penalties, bad words). True when it was turned off."""
    procs = input_batch.logitsprocs
    if not input_batch.logitsprocs_need_output_token_ids or procs is None:
        return False
    from vllm.v1.sample.logits_processor import BUILTIN_LOGITS_PROCESSORS

    custom = [lp for lp in procs.all if type(lp) not in BUILTIN_LOGITS_PROCESSORS]
    if custom and all(getattr(lp, "needs_output_token_ids", True) is False for lp in custom):
        input_batch.logitsprocs_need_output_token_ids = False
        return True
    return False


def v1_has_prompt_logprobs(runner) -> bool:
    """Whether a request of V1's batch asks for prompt logprobs."""
    return bool(runner.num_prompt_logprobs)


def v1_query_start_loc(runner):
    """The token offset of each request of V1's step (``[requests + 1]``, a host copy)."""
    n = runner.input_batch.num_reqs
    return runner.query_start_loc.np[: n + 1].copy()


@contextlib.contextmanager
def v1_model_compute_logits(runner, wrap):
    """V1's model's ``compute_logits`` replaced by ``wrap(compute_logits)`` while the block
    runs (the runner calls ``self.model.compute_logits``): an attribute of the model instance,
    removed afterwards."""
    model = runner.model
    own = "compute_logits" in getattr(model, "__dict__", {})
    old = model.compute_logits
    model.compute_logits = wrap(old)
    try:
        yield
    finally:
        if own:
            model.compute_logits = old
        else:
            del model.compute_logits


def v1_speculates(runner) -> bool:
    """Whether V1's runner speculates (has a ``speculative_config``)."""
    return runner.speculative_config is not None


def v1_token_counts(input_batch):
    """``(computed, prompt)``: V1's per-row computed-token and prompt-token counts (host
    arrays, the persistent batch's rows)."""
    return input_batch.num_computed_tokens_cpu, input_batch.num_prompt_tokens


def v1_corrected_computed_tokens(runner, n: int):
    """The computed-token counts of V1's first ``n`` batch rows, corrected for the drafts the
    previous step rejected.

    Under async scheduling with speculative decoding, the engine core schedules a step before
    the previous one's accepted-draft count is back, and the V1 runner counts every draft of
    the previous step as accepted (``prev_num_draft_tokens``: the optimistic count per
    previous batch index) until it corrects ``num_computed_tokens_cpu`` after this step's
    forward is launched (``correct_spec_decode_token_counts``). A generation window needs the
    true count now: read the previous step's valid-token counts
    (``_get_valid_sampled_token_count``, the runner's own read, which waits for the previous
    step's sampling) and apply vLLM's correction, ``optimistic - (valid - 1)``, to a copy.
    Only steps with a windowed request pay that wait; without async scheduling, or when no
    request carries an optimistic count, the counts are returned as they are."""
    import numpy as np

    ib = runner.input_batch
    computed = np.asarray(ib.num_computed_tokens_cpu[:n], dtype=np.int64)
    if not getattr(runner, "use_async_spec_decode", False):
        return computed
    prev_index = getattr(ib, "prev_req_id_to_index", None) or {}
    optimistic = runner.prev_num_draft_tokens.np
    pairs = [(i, prev_index.get(req_id)) for i, req_id in enumerate(ib.req_ids[:n])]
    pairs = [(i, j) for i, j in pairs if j is not None and optimistic[j] > 0]
    if not pairs:
        return computed
    valid = runner._get_valid_sampled_token_count()
    computed = computed.copy()
    for i, j in pairs:
        if j < len(valid):
            computed[i] -= int(optimistic[j]) - (int(valid[j]) - 1)
    return computed


def v1_add_logits_processor(procs, proc, argmax_invariant: bool) -> None:
    """Add ``proc`` to V1's built ``LogitsProcessors`` ``procs``, in its argmax-invariant
    list or the other, as vLLM sorts them."""
    (procs.argmax_invariant if argmax_invariant else procs.non_argmax_invariant).append(proc)


def v2_has_sampler(runner) -> bool:
    """Whether Model Runner V2 has a sampler (the last pipeline stage; its logits processors,
    ours included, get each request's ``add_request`` there only)."""
    return getattr(runner, "sampler", None) is not None


def v2_new_request_slots(runner, scheduler_output):
    """``(request-state slot, SamplingParams)`` of each request V2's ``add_requests`` added
    in this step (those with sampling params)."""
    index = runner.req_states.req_id_to_index
    return [(index[r.req_id], r.sampling_params) for r in scheduler_output.scheduled_new_reqs
            if r.sampling_params is not None and r.req_id in index]


def v2_step_tokens(runner, input_batch, computed=None):
    """Model Runner V2's step (request ``i`` in request-state slot ``idx_mapping[i]``, its
    tokens from ``query_start_loc[i]``): ``(req_slots, counts, gen_first)`` as
    :func:`v1_step_tokens`. Host arrays only; ``computed``: the requests' computed-token
    counts read from the device (:func:`v2_device_computed_tokens`; a generation window under
    speculative decoding, where the host's are an upper bound), None: the host's."""
    import numpy as np

    n = input_batch.num_reqs
    idx = np.asarray(input_batch.idx_mapping_np[:n], dtype=np.int64)
    qsl = np.asarray(input_batch.query_start_loc_np[:n + 1], dtype=np.int64)
    counts = np.diff(qsl)
    req_states = getattr(runner, "req_states", None)
    if req_states is None:
        return idx, counts, None
    if computed is None:
        computed = input_batch.num_computed_tokens_np
    computed = np.asarray(computed[:n], dtype=np.int64)
    prompt_len = np.asarray(req_states.prompt_len.np, dtype=np.int64)
    return idx, counts, computed + 1 - prompt_len[idx]


def logits_as_input(head) -> bool:
    """Whether a ``LogitsProcessor`` takes logits, not hidden states (nothing to steer)."""
    return bool(head.logits_as_input)


def head_dtype(head):
    """A ``LogitsProcessor``'s own dtype of the head (None: the model's)."""
    return getattr(head, "head_dtype", None)


def model_dtype(model_config):
    """The model's dtype."""
    return getattr(model_config, "dtype", None)


def model_head_dtype(model_config):
    """The LM head's dtype as vLLM resolves it (``ModelConfig.head_dtype``: the model's, or
    ``--hf-overrides '{"head_dtype": ...}'``); the model's where this vLLM has none."""
    return getattr(model_config, "head_dtype", None) or model_dtype(model_config)


def platform_device_type() -> str:
    """vLLM's current platform's device type (``"cuda"``, ``"cpu"``, ...)."""
    from vllm.platforms import current_platform

    return current_platform.device_type


def current_vllm_config():
    """The ``VllmConfig`` vLLM is building a model with (read while a layer is constructed)."""
    from vllm.config import get_current_vllm_config

    return get_current_vllm_config()


def worker_vllm_config(worker):
    """The ``VllmConfig`` a vLLM worker was built with."""
    return worker.vllm_config


def v1_runner_vllm_config(runner):
    """The ``VllmConfig`` of V1's runner."""
    return runner.vllm_config


def v2_runner_vllm_config(runner):
    """The ``VllmConfig`` of Model Runner V2."""
    return runner.vllm_config


def speculator_vllm_config(speculator):
    """The ``VllmConfig`` of a Model Runner V2 speculator."""
    return speculator.vllm_config


def speculative_tokens(vllm_config) -> int:
    """The draft tokens a request verifies per step (0: no speculative decoding)."""
    spec = getattr(vllm_config, "speculative_config", None)
    k = getattr(spec, "num_speculative_tokens", None) if spec is not None else None
    return int(k) if isinstance(k, int) and k > 0 else 0


def v2_req_ids(input_batch) -> list:
    """The request ids of Model Runner V2's step, in batch order (vLLM's own list)."""
    return input_batch.req_ids


def v2_batch_slots(input_batch):
    """Each request's request-state slot in V2's step (``idx_mapping``'s host copy,
    ``[num_reqs]``; vLLM's own array)."""
    return input_batch.idx_mapping_np


def v2_drafter_batch_slots(input_batch):
    """The slots of the requests a V2 draft model proposes for (``idx_mapping``'s host copy,
    its first ``num_reqs``; empty when the batch has none)."""
    import numpy as np

    num_reqs = getattr(input_batch, "num_reqs", 0)
    slots = getattr(input_batch, "idx_mapping_np", None)
    if not num_reqs or slots is None:
        return np.zeros(0, dtype=np.int64)
    return np.asarray(slots[:num_reqs], dtype=np.int64)


def v2_row_mapping(input_batch):
    """Each sampled row's request-state slot on the device (``expanded_idx_mapping``)."""
    return input_batch.expanded_idx_mapping


def v2_logits_offsets(input_batch):
    """The sampled rows' offsets per request (``cu_num_logits``'s host copy, ``[num_reqs +
    1]`` or shorter where vLLM keeps none)."""
    return input_batch.cu_num_logits_np


def v2_token_slots(input_batch):
    """The request-state slot of every scheduled token of V2's step (host arrays only)."""
    import numpy as np

    n = input_batch.num_reqs
    qsl = np.asarray(input_batch.query_start_loc_np[: n + 1])
    return np.repeat(np.asarray(input_batch.idx_mapping_np[:n], dtype=np.int64), np.diff(qsl))


def v2_logits_tokens(input_batch):
    """The token each sampled row of V2's step is computed from, in batch order: request
    ``i``'s ``cu_num_logits[i + 1] - cu_num_logits[i]`` rows are its last tokens (the rule
    of V2's ``logits_indices`` and of its batch sharder's ``sorted_logits_indices``). Host
    arrays only."""
    import numpy as np

    n = input_batch.num_reqs
    ends = np.asarray(input_batch.query_start_loc_np[1:n + 1], dtype=np.int64)
    cu = np.asarray(input_batch.cu_num_logits_np[:n + 1], dtype=np.int64)
    if len(cu) < n + 1 or int(cu[n] - cu[0]) == n:  # one row per request: the common case
        return ends - 1
    counts = np.diff(cu)
    local = np.arange(int(cu[n] - cu[0])) - np.repeat(cu[:-1] - cu[0], counts)
    return np.repeat(ends - counts, counts) + local


def v2_last_positions(runner, input_batch, computed=None):
    """The generated-token index each request of V2's step samples last (``computed +
    scheduled - prompt``; None where the runner keeps no request states). ``computed``: the
    computed-token counts read from the device (:func:`v2_device_computed_tokens`), None: the
    host mirror's."""
    import numpy as np

    req_states = getattr(runner, "req_states", None)
    if req_states is None:
        return None
    idx = input_batch.idx_mapping_np  # [num_reqs]
    n = len(idx)
    if computed is None:
        computed = input_batch.num_computed_tokens_np[:n]
    return (computed + input_batch.num_scheduled_tokens[:n]
            - req_states.prompt_len.np[idx]).astype(np.int64)


def v2_device_computed_tokens(runner, idx):
    """The computed-token counts of request-state slots ``idx`` from V2's device state.

    With speculative decoding V2's host mirror (``num_computed_tokens_np``) is an upper bound:
    the scheduler counts every draft of the previous step as accepted, and V2 corrects only
    its device copy (``post_update``, after ``sample()``). A generation window needs the true
    count: read the device copy, which at ``sample()`` holds this step's starting count. This
    read waits for the step's forward (a device-to-host copy): only steps that hold a
    windowed request under speculative decoding pay it."""
    import numpy as np
    import torch

    index = torch.as_tensor(np.asarray(idx, dtype=np.int64))
    gpu = runner.req_states.num_computed_tokens.gpu
    return gpu.index_select(0, index.to(gpu.device)).cpu().numpy().astype(np.int64)


def v2_batch_sharder(runner):
    """V2's ``BatchSharder`` (None: no batch-sharded sampling)."""
    return getattr(runner, "batch_sharder", None)


def v2_speculator(runner):
    """V2's speculator (None: no speculative decoding)."""
    return getattr(runner, "speculator", None)


def v2_eager_speculator(speculator) -> bool:
    """Whether a V2 speculator runs its drafter eagerly (``StandaloneARSpeculator``, a draft
    model: no CUDA graph; its rows are mapped as it proposes), by its class."""
    return type(speculator).__name__ == _V2_STANDALONE.rpartition(":")[2]


def v2_step_output(out):
    """``(ModelRunnerOutput, its request ids)`` of what V2's ``sample_tokens`` returned (an
    async output holds the step's ``ModelRunnerOutput``)."""
    output = getattr(out, "model_runner_output", out)
    return output, getattr(output, "req_ids", None) or ()


def v2_request_slots(runner, req_ids) -> list[int]:
    """The request-state slot of each of ``req_ids`` (-1: none)."""
    index = runner.req_states.req_id_to_index
    return [index.get(r, -1) for r in req_ids]


def v2_prompt_logprobs_pending(worker) -> bool:
    """Whether a running request asked V2's prompt-logprob worker for prompt logprobs."""
    return bool(worker.in_progress_prompt_logprobs)


def v2_prompt_token_ids_pending(worker) -> bool:
    """Whether a running request asked V2's prompt-logprob worker for the logprobs of given
    prompt tokens (``prompt_logprob_token_ids``)."""
    return bool(worker.token_id_scores)


def v2_request_states_size(req_states) -> tuple[int, Any]:
    """``(max_num_reqs, device)`` of V2's request states (what our per-request state sizes
    its slots by)."""
    return req_states.max_num_reqs, req_states.device


def v1_drafter_model(runner):
    """V1's drafter model, ``runner.drafter.model`` (None for n-gram)."""
    model = getattr(getattr(runner, "drafter", None), "model", None)
    return model if model is not None and hasattr(model, "named_modules") else None


def v2_drafter_model(runner):
    """Model Runner V2's drafter model, ``runner.speculator.model`` (None: none loaded)."""
    model = getattr(getattr(runner, "speculator", None), "model", None)
    return model if model is not None and hasattr(model, "named_modules") else None


def speculator_model(speculator):
    """A V2 speculator's drafter model (None before it is loaded)."""
    return getattr(speculator, "model", None)


def v1_runner_speculative_config(runner):
    """V1's runner's ``SpeculativeConfig``."""
    return runner.speculative_config


def v2_runner_speculative_config(runner):
    """Model Runner V2's ``SpeculativeConfig``."""
    return runner.speculative_config


def draft_model_config(spec):
    """The drafter's ``ModelConfig`` (None: n-gram and the like)."""
    return getattr(spec, "draft_model_config", None)


def spec_method(spec) -> str | None:
    """A ``SpeculativeConfig``'s method (``"eagle"``, ``"ngram"``, ...)."""
    return getattr(spec, "method", None)


# ---- the engine core: its scheduler, executor and outputs ---------------------------------
def core_output_queue(core):
    """An engine core's output queue (None: the engine core runs in the caller's process)."""
    return getattr(core, "output_queue", None)


def core_requests(core) -> list:
    """Every request the engine core's scheduler holds (waiting or running)."""
    return list(core.scheduler.requests.values())


def streaming_session(core, request):
    """The streaming-input session that ``request`` continues or ends: the unfinished request
    of its id that the engine core's scheduler holds, made resumable (vLLM's streaming input:
    each later input chunk, and the end of the input, reach the engine core as a new request
    of the session's id); None for any other request."""
    session = core.scheduler.requests.get(getattr(request, "request_id", None))
    if session is None or session.is_finished() or not session.resumable:
        return None
    return session


def is_resumable(request) -> bool:
    """Whether an engine-core ``Request`` is an input chunk of a streaming-input session
    (``resumable``); the request that ends a session's input is not."""
    return bool(getattr(request, "resumable", False))


def core_run_in_workers(core, fn, args: tuple) -> list:
    """``fn(worker, *args)`` in every worker, through the engine core's executor."""
    return core.model_executor.collective_rpc(fn, args=args)


def core_model_config(core):
    """The engine core's ``ModelConfig``."""
    return core.vllm_config.model_config


def error_output(request_id: str, stop_reason: str):
    """vLLM's output that finishes a request with an error (``FinishReason.ERROR``), its
    ``stop_reason`` carrying the plugin's message (as ``EngineCore._send_error_outputs_to_
    client`` builds it)."""
    from vllm.v1.engine import EngineCoreOutput, FinishReason

    return EngineCoreOutput(request_id, [], finish_reason=FinishReason.ERROR,
                            stop_reason=stop_reason)


def send_error_output(core, request, stop_reason: str) -> None:
    """Finish ``request`` (not yet scheduled) at once with :func:`error_output`, put on the
    engine core's output queue for its client."""
    from vllm.v1.engine import EngineCoreOutputs

    out = error_output(request.request_id, stop_reason)
    core.output_queue.put_nowait(
        (request.client_index, EngineCoreOutputs(finished_requests={request.request_id},
                                                 outputs=[out])))


def inproc_engine_core(client):
    """The engine core an ``InprocClient`` steps in the caller's process (offline ``LLM``
    with ``VLLM_ENABLE_V1_MULTIPROCESSING=0``)."""
    return client.engine_core


def extend_outputs(outputs, more: list) -> None:
    """Append ``more`` (``EngineCoreOutput``) to one client's ``EngineCoreOutputs``."""
    outputs.outputs = [*outputs.outputs, *more]


def step_failures(output) -> dict | None:
    """The requests the plugin's worker code failed in a step, ``{request id: message}``,
    attached to the step's ``ModelRunnerOutput`` (:func:`attach_step_failures`)."""
    from vllm_steer.integrations.protocol import STEP_FAILED_ATTR

    return getattr(output, STEP_FAILED_ATTR, None)


def attach_step_failures(output, failed: dict) -> None:
    """Attach ``{request id: message}`` to a step's ``ModelRunnerOutput`` (pickled with it to
    the engine core); never to vLLM's shared empty output (a step with requests has its
    own)."""
    from vllm_steer.integrations.protocol import STEP_FAILED_ATTR

    if failed and getattr(output, "req_ids", None):
        setattr(output, STEP_FAILED_ATTR, failed)


def fail_running_requests(scheduler, failed: dict) -> list[tuple[str, int]]:
    """Finish the scheduler's unfinished requests among ``failed`` (``FINISHED_ERROR``):
    their ``(request id, client index)``."""
    from vllm.v1.request import RequestStatus

    running = [r for r in map(scheduler.requests.get, failed)
               if r is not None and not r.is_finished()]
    scheduler.finish_requests([r.request_id for r in running], RequestStatus.FINISHED_ERROR)
    return [(r.request_id, r.client_index) for r in running]


def add_error_output(outputs: dict, client_index: int, request_id: str,
                     stop_reason: str) -> None:
    """Add :func:`error_output` to a step's outputs per client (``{client index:
    EngineCoreOutputs}``, what ``Scheduler.update_from_output`` returns)."""
    from vllm.v1.engine import EngineCoreOutputs

    out = error_output(request_id, stop_reason)
    eco = outputs[client_index] if client_index in outputs else None
    if eco is None:
        outputs[client_index] = EngineCoreOutputs(outputs=[out])
    else:
        eco.outputs = [*eco.outputs, out]


def max_num_seqs(vllm_config) -> int:
    """The most requests in one step (``--max-num-seqs``)."""
    return vllm_config.scheduler_config.max_num_seqs


def is_swap(direction) -> bool:
    """Whether a V1 batch move is a swap (``MoveDirectionality.SWAP``), not a one-way move."""
    from vllm.v1.sample.logits_processor import MoveDirectionality

    return direction == MoveDirectionality.SWAP


# ---- the API server's model registry ---------------------------------------------------------
def registry_model_names(models) -> tuple[list[str], list[str]]:
    """The names an ``OpenAIModelRegistry`` serves itself: ``(its base models', its LoRA
    adapters')``."""
    return ([b.name for b in getattr(models, "base_model_paths", None) or ()],
            list(getattr(models, "lora_requests", None) or {}))


def serving_models(serving):
    """The model registry of an OpenAI route's serving object."""
    return serving.models


def registry_base_model(models) -> tuple[str, str, int]:
    """``(name, path, max_model_len)`` of the registry's first base model."""
    base = models.base_model_paths[0]
    return base.name, base.model_path, models.model_config.max_model_len


def add_model_cards(models, cards: list) -> None:
    """Add model cards to a ``/v1/models`` answer (``ModelList``)."""
    models.data.extend(cards)


def request_model_field(request) -> str | None:
    """The ``model`` an OpenAI request names (None: none)."""
    return getattr(request, "model", None)


def has_extra_args(params) -> bool:
    """Whether ``params`` is a ``SamplingParams`` (which carries ``extra_args``; pooling
    parameters do not)."""
    return hasattr(params, "extra_args")


# ---- the OpenAI request models (API server) ----------------------------------------------
def add_request_field(cls, name: str, annotation, field, validator_name: str,
                      validator: Callable) -> bool:
    """Add field ``name`` (a pydantic ``FieldInfo`` ``field`` of type ``annotation``) and an
    "after" model validator to the pydantic request model ``cls``, then rebuild it. False
    when the field is there already (nothing changed)."""
    from pydantic._internal._decorators import Decorator, ModelValidatorDecoratorInfo

    if name in cls.model_fields:
        return False
    cls.__pydantic_fields__[name] = field
    cls.__annotations__[name] = annotation
    if hasattr(cls, "field_names"):  # vLLM's cache of the field names
        cls.field_names = None
    setattr(cls, validator_name, validator)
    cls.__pydantic_decorators__.model_validators[validator_name] = Decorator.build(
        cls, cls_var_name=validator_name, shim=None,
        info=ModelValidatorDecoratorInfo(mode="after"))
    cls.model_rebuild(force=True)
    return True


def request_value(request, name: str):
    """A field the plugin added to an OpenAI request model (``steer``), None when unset."""
    return getattr(request, name, None)


def set_request_value(request, name: str, value) -> None:
    """Write a field the plugin added to an OpenAI request model."""
    setattr(request, name, value)


def request_xargs(request):
    """``vllm_xargs`` of an OpenAI request (None when unset or absent)."""
    return getattr(request, "vllm_xargs", None)


def set_request_xargs(request, xargs: dict) -> None:
    """Write ``vllm_xargs`` of an OpenAI request."""
    request.vllm_xargs = xargs


def request_id(request) -> str | None:
    """An OpenAI request's ``request_id`` (None when it has none)."""
    return getattr(request, "request_id", None)


def request_model(request) -> str | None:
    """The ``model`` an OpenAI request names."""
    return getattr(request, "model", None)


def responses_streamed_in_foreground(request) -> bool:
    """Whether a ``/v1/responses`` request is streamed to its HTTP response (``stream``, not
    ``background``)."""
    return bool(request.stream) and not request.background


# ---- the API server's engine client (AsyncLLM; LLM offline) -------------------------------
def engine_vllm_config(engine):
    """The ``VllmConfig`` of an engine client (None: a client without one)."""
    return getattr(engine, "vllm_config", None)


def engine_model_config(engine):
    """The ``ModelConfig`` of an engine client (None: a client without one)."""
    return getattr(engine, "model_config", None)


def max_model_len(model_config) -> int:
    """The model's context length (0: unknown)."""
    return int(getattr(model_config, "max_model_len", 0) or 0)


def served_model_name(model_config) -> str | None:
    """The first served model name, else the model's name (None: neither)."""
    name = getattr(model_config, "served_model_name", None) or getattr(model_config, "model",
                                                                       None)
    if isinstance(name, (list, tuple)):
        name = name[0] if name else None
    return name


async def engine_tokenizer(engine):
    """The engine client's tokenizer (``get_tokenizer``, a coroutine in recent vLLM)."""
    import inspect

    get = engine.get_tokenizer
    return await get() if inspect.iscoroutinefunction(get) else get()


def engine_generate(engine, prompt, params, request_id: str):
    """``engine.generate``: the request's outputs, an async iterator."""
    return engine.generate(prompt, params, request_id)


def prompt_token_logprobs(output, ids: list[int]) -> list[float | None]:
    """The log-probability of each prompt token ``ids[i]`` in a ``RequestOutput``'s
    ``prompt_logprobs`` (None where vLLM gives none: the first token)."""
    lps = output.prompt_logprobs or []
    return [None if e is None else e[t].logprob for e, t in zip(lps, ids, strict=False)]


async def collective_rpc_every_core(engine, method: str, args: tuple) -> list:
    """``collective_rpc(method, args)`` in every engine core the client manages, the first
    worker's answer of each. vLLM's load-balancing data-parallel client sends each utility
    call to every engine core but returns the first answer
    (``DPLBAsyncMPClient.call_utility_async``); its ``call_utility_all_async`` gives them all.
    A single engine core: ``collective_rpc``, its first answer."""
    if engine_core_count(engine) < 2:
        return list(await engine.collective_rpc(method, args=args))[:1]
    return [r[0] for r in await engine.engine_core.call_utility_all_async(
        "collective_rpc", method, None, args, None)]


def engine_core_count(engine) -> int:
    """How many engine cores the API server's client sends a management op to (data
    parallelism with vLLM's load-balancing client: every one; else 1)."""
    client = getattr(engine, "engine_core", None)
    if getattr(client, "call_utility_all_async", None) is None:
        return 1
    return max(1, len(getattr(client, "core_engines", ()) or ()))


def llm_collective_rpc(llm, method: str, args: tuple) -> list:
    """``LLM.collective_rpc`` offline: each worker's answer."""
    return llm.collective_rpc(method, args=args)


def engine_input_processor(engine):
    """The ``InputProcessor`` of an ``AsyncLLM`` (None: another engine client)."""
    return getattr(engine, "input_processor", None)


def llm_input_processor(llm):
    """The ``InputProcessor`` of an offline ``LLM``'s engine (None: not found)."""
    return getattr(getattr(llm, "llm_engine", None), "input_processor", None)


def api_keys(args) -> list | None:
    """``--api-key`` of the API server's arguments (None: not given)."""
    return getattr(args, "api_key", None)



def api_key_arg(args) -> bool:
    """Whether the API server's arguments have ``--api-key`` (vLLM's ``FrontendArgs``)."""
    return hasattr(args, "api_key")


def set_api_keys(args, keys: list) -> None:
    """Write ``--api-key`` of the API server's arguments (vLLM's list of accepted keys)."""
    args.api_key = keys


def cli_served_model_names(args) -> list:
    """``--served-model-name`` of the CLI namespace vLLM's parser built (a name or a list),
    else ``[model]`` (``model`` None when absent)."""
    return getattr(args, "served_model_name", None) or [getattr(args, "model", None)]


def cli_lora_module_names(args) -> list:
    """The name of each ``--lora-modules`` entry of the CLI namespace (vLLM's
    ``LoRAModulePath``, or its ``NAME=PATH`` text; None where neither names one)."""
    return [getattr(m, "name", None) or (str(m).split("=", 1)[0] if m else None)
            for m in getattr(args, "lora_modules", None) or []]


# ---- the API server's application state (``app.state``, set by vLLM's api_server) --------
def app_state_args(state):
    """The API server's arguments vLLM keeps on ``app.state`` (None: not vLLM's server)."""
    return getattr(state, "args", None)


def app_state_serving_models(state):
    """The model registry (``OpenAIServingModels``) vLLM keeps on ``app.state`` (None: none)."""
    return getattr(state, "openai_serving_models", None)


# ---- the engine's outputs (API server) ---------------------------------------------------
def output_stop_reasons(out) -> list:
    """The ``stop_reason`` of each completion of a ``RequestOutput`` that vLLM finished with an
    error (where the engine core's refusals travel: :func:`error_output`); None elsewhere (a
    user's stop string is a ``stop_reason`` too, of a completion finished with ``stop``)."""
    return [getattr(o, "stop_reason", None) if getattr(o, "finish_reason", None) == "error"
            else None for o in getattr(out, "outputs", None) or ()]


# ---- the worker --------------------------------------------------------------------------
def is_last_pp_rank() -> bool:
    """Whether this worker is the last pipeline-parallel stage (the one with the LM head);
    True outside a pipeline group (a model built outside vLLM)."""
    try:
        from vllm.distributed.parallel_state import get_pp_group

        return get_pp_group().is_last_rank
    except (ImportError, AssertionError):  # no pipeline group
        return True



# ---- the model's decoder blocks (vector steers) -------------------------------------------
def layer_range(module) -> tuple[int, int] | None:
    """``(start_layer, end_layer)`` of a module laid out by vLLM's ``make_layers`` (this
    pipeline stage's blocks), None when it has no such integer pair."""
    start, end = getattr(module, "start_layer", None), getattr(module, "end_layer", None)
    return (start, end) if isinstance(start, int) and isinstance(end, int) else None


def is_pp_missing_layer(module) -> bool:
    """Whether ``module`` is vLLM's ``PPMissingLayer`` (a block another pipeline stage runs),
    by its class name (nothing of vLLM imported)."""
    return type(module).__name__ == "PPMissingLayer"


def steer_block(block, cls: type | None, buffers) -> None:
    """Make one of vLLM's decoder blocks an instance of ``cls`` (its steered subclass; None:
    it is one already) and register ``buffers`` (``(name, tensor)`` pairs) on it,
    non-persistent."""
    if cls is not None:
        block.__class__ = cls
    for name, tensor in buffers:
        block.register_buffer(name, tensor, persistent=False)


def block_forward_value(block, block_cls: type, expression: str, hidden_dtype):
    """The value of ``expression``, an expression of ``block_cls.forward`` (``block``'s own
    class; :func:`vllm_steer.integrations.families.residual_scaling` reads it from that
    forward's source), evaluated as the forward would: in its module's globals, with ``self``
    the block and ``hidden_states`` an empty tensor of ``hidden_dtype`` (the model's dtype).
    Whatever it reads of the block, vLLM's own code reads in that release."""
    import torch

    forward = block_cls.forward
    scope = {"self": block, "hidden_states": torch.empty(0, dtype=hidden_dtype, device="meta")}
    return eval(compile(expression, f"<{block_cls.__qualname__}.forward>", "eval"),
                dict(forward.__globals__), scope)


#: Every accessor and what it touches, checked at start-up with its group.
ACCESSES: tuple[Access, ...] = (
    Access(additional_config, "the --steer configuration", FRONTEND,
           reads=(f"{_CONFIG}.additional_config", f"{_ENGINE_ARGS}.additional_config")),
    Access(set_additional_config, "--steer carried in additional_config", FRONTEND,
           sets=(f"{_ENGINE_ARGS}.additional_config",)),
    Access(model_config, "the model's configuration", FRONTEND,
           reads=(f"{_CONFIG}.model_config",)),
    Access(decode_backend, "refusing a model's specialized decode executor", FRONTEND,
           reads=(f"{_CONFIG}.additional_config",)),
    Access(monokernel, "refusing vector steers with fused decode layers (--monokernel)",
           FRONTEND, versions="<0.33", reads=(f"{_CONFIG}.kernel_config",),
           releases=(Release(">=0.33", reads=(f"{_CONFIG}.kernel_config",
                                               "vllm.config.kernel:KernelConfig.monokernel")),)),
    Access(uses_v2_runner, "the model runner's hook groups and per-request state", FRONTEND,
           reads=(f"{_CONFIG}.use_v2_model_runner",)),
    Access(speculative_config, "speculative decoding's hook groups", FRONTEND,
           reads=(f"{_CONFIG}.speculative_config",)),
    Access(speculative_method, "refusing an unsupported speculative method", FRONTEND,
           reads=(f"{_CONFIG}.speculative_config", f"{_SPEC}.method")),
    Access(adaptive_verification, "refusing adaptive draft verification", FRONTEND,
           reads=(f"{_CONFIG}.speculative_config", f"{_SPEC}.enable_adaptive_verification")),
    Access(rejection_sample_method, "refusing draft verification that does not keep the "
           "steered model's distribution", FRONTEND,
           reads=(f"{_CONFIG}.speculative_config", f"{_SPEC}.rejection_sample_method")),
    Access(data_parallel_size, "run-time steers under data parallelism", FRONTEND,
           reads=(f"{_CONFIG}.parallel_config", f"{_PARALLEL}.data_parallel_size")),
    Access(data_parallel_modes, "run-time steers under data parallelism", FRONTEND,
           reads=(f"{_CONFIG}.parallel_config",
                  *(f"{_PARALLEL}.{n}" for n in DATA_PARALLEL_MODES))),
    Access(model_name, "naming the model in messages", FRONTEND, reads=(f"{_MODEL}.model",)),
    Access(served_model_names, "presets never shadow the served model name", FRONTEND,
           reads=(f"{_MODEL}.served_model_name",)),
    Access(is_pooling, "refusing a pooling model", FRONTEND, reads=(f"{_MODEL}.runner_type",)),
    Access(enforce_eager, "no CUDA graphs of the head's op under --enforce-eager", WORKER,
           reads=(f"{_MODEL}.enforce_eager",)),
    Access(logits_processors, "our per-request steer state", FRONTEND,
           reads=(f"{_MODEL}.logits_processors",)),
    Access(set_logits_processors, "our per-request steer state", FRONTEND,
           sets=(f"{_MODEL}.logits_processors",)),
    Access(architectures, "the model family", FRONTEND,
           reads=(f"{_MODEL}.architectures", f"{_MODEL}.hf_config")),
    Access(text_config_value, "the head's input size (a family's own field)", FRONTEND,
           reads=(f"{_MODEL}.hf_text_config", f"{_MODEL}.hf_config")),
    Access(hidden_size, "the head's input size", FRONTEND,
           reads=(f"{_MODEL}.get_hidden_size",)),
    Access(input_processor_config, "refusing bad steers at admission (HTTP 400)", FRONTEND,
           reads=(f"{_INPUT_PROCESSOR}.vllm_config",)),
    Access(engine_config, "the engine core's steer state", ENGINE,
           reads=(f"{_CORE}.vllm_config",)),
    Access(engine_index, "the engine core's data-parallel rank", ENGINE,
           reads=("vllm.v1.engine.core:EngineCoreProc.engine_index",)),
    Access(sampling_params, "binding a request's steers at admission", ENGINE,
           reads=("vllm.v1.request:Request.sampling_params",)),
    Access(extra_args, "a request's steers", ENGINE, reads=(f"{_PARAMS}.extra_args",)),
    Access(asks_prompt_logprobs, "which request slots may compute prompt logprobs", WORKER,
           reads=(f"{_PARAMS}.prompt_logprobs", f"{_PARAMS}.prompt_logprob_token_ids")),
    Access(set_extra_args, "a request's bound steers", ENGINE,
           sets=(f"{_PARAMS}.extra_args",)),
    Access(put_extra_arg, "a request's admitted steers, in the caller's own extra_args",
           FRONTEND, reads=(f"{_PARAMS}.extra_args",), sets=(f"{_PARAMS}.extra_args",)),
    Access(cache_salt, "the prefix cache salted by a request's vector mix", ENGINE,
           reads=("vllm.v1.request:Request.cache_salt",)),
    Access(aborts_immediately, "no steer bound for a request vLLM adds only to abort it",
           ENGINE, reads=("vllm.v1.request:Request.abort_immediately",)),
    Access(prompt_tokens, "the prefix cache salted by a windowed vector mix's prompt length",
           ENGINE, reads=("vllm.v1.request:Request.num_prompt_tokens",)),
    Access(resalt_request, "the prefix cache salted by a request's vector mix", ENGINE,
           reads=("vllm.v1.request:Request.block_hashes",
                  "vllm.v1.request:Request.update_block_hashes"),
           sets=("vllm.v1.request:Request.cache_salt",)),
    Access(num_hidden_layers, "vector steers checked against the model's blocks", FRONTEND,
           reads=(f"{_MODEL}.hf_text_config",)),
    Access(model_type, "vector steers checked against the model's architecture", FRONTEND,
           reads=(f"{_MODEL}.hf_text_config",)),
    Access(max_step_tokens, "the step mapping's buffers sized for a step", WORKER,
           reads=(f"{_CONFIG}.scheduler_config", f"{_CONFIG}.compilation_config",
                  "vllm.config.scheduler:SchedulerConfig.max_num_batched_tokens",
                  "vllm.config.compilation:CompilationConfig.max_cudagraph_capture_size")),
    Access(sequence_parallelism, "refusing vector steers under sequence parallelism",
           FRONTEND, reads=(f"{_CONFIG}.compilation_config",
                            "vllm.config.compilation:CompilationConfig.pass_config")),
    Access(token_splitting, "refusing vector steers where a step's tokens are split",
           FRONTEND, reads=(f"{_CONFIG}.parallel_config", f"{_PARALLEL}.enable_dbo",
                            f"{_PARALLEL}.ubatch_size",
                            f"{_PARALLEL}.prefill_context_parallel_size")),
    Access(v1_step_tokens, "the step mapping of the decoder layers' steers (V1)", V1,
           reads=tuple(f"vllm.v1.worker.gpu_input_batch:InputBatch.{n}" for n in
                       ("num_reqs", "num_computed_tokens_cpu", "num_prompt_tokens"))),
    Access(v1_input_batch, "the step's rows (V1)", V1, reads=(f"{_V1}.input_batch",)),
    Access(v1_num_reqs, "the step's requests (V1)", V1, reads=(f"{_V1_BATCH}.num_reqs",)),
    Access(v1_batch_positions, "generated-token positions of the batch rows for generation "
           "windows (V1)", V1, reads=reads_of(_V1_BATCH, "num_reqs", "num_computed_tokens_cpu",
                                            "num_prompt_tokens")),
    Access(v1_step_output, "the requests a fault failed, named in the step's output (V1)", V1,
           reads=("vllm.v1.worker.gpu_model_runner:AsyncGPUModelRunnerOutput."
                  "_model_runner_output", f"{_OUTPUT}.req_ids")),
    Access(v1_untrack_output_token_ids, "no output-token tracking for our processor (V1)", V1,
           reads=(*reads_of(_V1_BATCH, "logitsprocs", "logitsprocs_need_output_token_ids"),
                  "vllm.v1.sample.logits_processor:BUILTIN_LOGITS_PROCESSORS",
                  "vllm.v1.sample.logits_processor.state:LogitsProcessors.all"),
           sets=(f"{_V1_BATCH}.logitsprocs_need_output_token_ids",)),
    Access(v1_has_prompt_logprobs, "steered prompt logprobs (V1)", V1_LENS,
           reads=(f"{_V1}.num_prompt_logprobs",)),
    Access(v1_query_start_loc, "steered prompt logprobs (V1)", V1_LENS,
           reads=(*reads_of(_V1, "input_batch", "query_start_loc"), f"{_V1_BATCH}.num_reqs",
                  f"{_V1_BUFFER}.np")),
    Access(v1_model_compute_logits, "steered prompt logprobs (V1): each call's rows as the "
           "model's compute_logits gets them", V1_LENS,
           reads=(f"{_V1}.model", f"{_TEXT_MODEL}.compute_logits"),
           sets=(f"{_TEXT_MODEL}.compute_logits",)),
    Access(v1_speculates, "speculative decoding: the step's verification rows (V1)", V1_SPEC,
           reads=(f"{_V1}.speculative_config",)),
    Access(v1_token_counts, "speculative decoding: the verification rows' positions (V1)",
           V1_SPEC, reads=reads_of(_V1_BATCH, "num_computed_tokens_cpu", "num_prompt_tokens")),
    Access(v1_corrected_computed_tokens, "speculative decoding under async scheduling: the "
           "verification rows' positions (V1)", V1_SPEC,
           reads=(*reads_of(_V1, "input_batch", "use_async_spec_decode", "prev_num_draft_tokens",
                          "_get_valid_sampled_token_count"),
                  *reads_of(_V1_BATCH, "num_computed_tokens_cpu", "req_ids",
                          "prev_req_id_to_index"), f"{_V1_BUFFER}.np")),
    Access(v1_add_logits_processor, "speculative decoding: our per-request steer state (V1)",
           V1_SPEC, reads=reads_of("vllm.v1.sample.logits_processor.state:LogitsProcessors",
                                 "argmax_invariant", "non_argmax_invariant")),
    Access(v2_step_tokens, "the step mapping of the decoder layers' steers (V2)", V2,
           reads=(*(f"vllm.v1.worker.gpu.input_batch:InputBatch.{n}" for n in
                    ("num_reqs", "idx_mapping_np", "query_start_loc_np",
                     "num_computed_tokens_np")),
                  "vllm.v1.worker.gpu.model_runner:GPUModelRunner.req_states",
                  "vllm.v1.worker.gpu.states:RequestState.prompt_len",
                  "vllm.v1.worker.gpu.buffer_utils:UvaBackedTensor.np")),
    Access(logits_as_input, "the steered head: hidden states in, or logits", WORKER,
           reads=(f"{_LOGITS_LAYER}.logits_as_input",)),
    Access(head_dtype, "the steered head's dtype", WORKER,
           reads=(f"{_LOGITS_LAYER}.head_dtype",)),
    Access(model_dtype, "the steers' dtype on the device", WORKER,
           reads=(f"{_MODEL}.dtype",)),
    Access(model_head_dtype, "the steer bank's size in vLLM's KV-cache memory error", ENGINE,
           reads=(f"{_MODEL}.head_dtype",)),
    Access(platform_device_type, "the steers' device when the model loads on meta", WORKER,
           reads=("vllm.platforms:current_platform", "vllm.platforms.interface:Platform."
                  "device_type")),
    Access(current_vllm_config, "the steered head's configuration as vLLM builds it", WORKER,
           reads=("vllm.config:get_current_vllm_config",)),
    Access(worker_vllm_config, "the worker's runtime (run-time loads)", WORKER,
           reads=("vllm.v1.worker.worker_base:WorkerBase.vllm_config",)),
    Access(v1_runner_vllm_config, "the runner's runtime (V1)", V1,
           reads=(f"{_V1}.vllm_config",)),
    Access(v2_runner_vllm_config, "the runner's runtime (V2)", V2,
           reads=(f"{_V2_RUNNER}.vllm_config",)),
    Access(speculator_vllm_config, "the speculator's runtime (V2)", V2_SPEC,
           reads=(f"{_V2_SPECULATOR}.vllm_config", f"{_V2_STANDALONE}.vllm_config")),
    Access(speculative_tokens, "the head's rows per step: verification rows too", WORKER,
           reads=(f"{_CONFIG}.speculative_config", f"{_SPEC}.num_speculative_tokens")),
    Access(v2_req_ids, "the step's rows: a steady batch (V2)", V2,
           reads=(f"{_V2_BATCH}.req_ids",)),
    Access(v2_batch_slots, "the step's requests' slots (V2)", V2,
           reads=(f"{_V2_BATCH}.idx_mapping_np",)),
    Access(v2_drafter_batch_slots, "speculative decoding: the draft model's rows (V2)",
           V2_SPEC, reads=reads_of(_V2_BATCH, "num_reqs", "idx_mapping_np")),
    Access(v2_row_mapping, "the step's rows on the device (V2)", V2,
           reads=(f"{_V2_BATCH}.expanded_idx_mapping",)),
    Access(v2_logits_offsets, "the step's verification rows (V2)", V2,
           reads=(f"{_V2_BATCH}.cu_num_logits_np",)),
    Access(v2_token_slots, "each token's slot: prompt logprobs, batch-sharded sampling (V2)",
           V2, reads=reads_of(_V2_BATCH, "num_reqs", "query_start_loc_np", "idx_mapping_np")),
    Access(v2_logits_tokens, "the tokens of the sampled rows: batch-sharded sampling (V2)",
           V2, reads=reads_of(_V2_BATCH, "num_reqs", "query_start_loc_np", "cu_num_logits_np")),
    Access(v2_last_positions, "generated-token positions of the rows for generation windows "
           "(V2)", V2,
           reads=(f"{_V2_RUNNER}.req_states",
                  *reads_of(_V2_BATCH, "idx_mapping_np", "num_computed_tokens_np",
                            "num_scheduled_tokens"),
                  f"{_V2_STATES}.prompt_len", f"{_V2}.buffer_utils:UvaBackedTensor.np")),
    Access(v2_device_computed_tokens, "generation windows under speculative decoding: the "
           "true computed-token counts (V2)", V2,
           reads=(f"{_V2_RUNNER}.req_states", f"{_V2_STATES}.num_computed_tokens",
                  f"{_V2}.buffer_utils:StagedWriteTensor.gpu")),
    Access(v2_batch_sharder, "rows of batch-sharded sampling (V2)", V2,
           reads=(f"{_V2_RUNNER}.batch_sharder",)),
    Access(v2_speculator, "speculative decoding's rows and drafter (V2)", V2,
           reads=(f"{_V2_RUNNER}.speculator",)),
    Access(v2_eager_speculator, "a draft model's rows, mapped as it proposes (V2)", V2_SPEC,
           reads=(_V2_STANDALONE,)),
    Access(v2_step_output, "the requests a fault failed, named in the step's output (V2)", V2,
           reads=(f"{_V2}.async_utils:AsyncOutput.model_runner_output", f"{_OUTPUT}.req_ids")),
    Access(v2_has_sampler, "a pipeline stage without the LM head: its requests' slots (V2)",
           V2, reads=(f"{_V2_RUNNER}.sampler",)),
    Access(v2_new_request_slots, "a pipeline stage without the LM head: its requests' slots "
           "(V2)", V2, reads=(f"{_V2_RUNNER}.req_states", f"{_V2_STATES}.req_id_to_index",
                               "vllm.v1.core.sched.output:SchedulerOutput.scheduled_new_reqs",
                               *(f"vllm.v1.core.sched.output:NewRequestData.{n}"
                                 for n in ("req_id", "sampling_params")))),
    Access(v2_request_slots, "the requests a fault failed, named in the step's output (V2)",
           V2, reads=(f"{_V2_RUNNER}.req_states", f"{_V2_STATES}.req_id_to_index")),
    Access(v2_prompt_logprobs_pending, "steered prompt logprobs (V2)", V2_LENS,
           reads=(f"{_V2_PROMPT}.in_progress_prompt_logprobs",)),
    Access(v2_prompt_token_ids_pending, "steered prompt logprobs (V2, "
           "prompt_logprob_token_ids)", V2_LENS, reads=(f"{_V2_PROMPT}.token_id_scores",)),
    Access(v2_request_states_size, "V2 per-request steer state sized by the request states",
           V2, reads=reads_of(_V2_STATES, "max_num_reqs", "device")),
    Access(v1_drafter_model, "speculative decoding: the drafter's heads (V1)", V1_SPEC,
           reads=(f"{_V1}.drafter", "vllm.v1.spec_decode.eagle:SpecDecodeBaseProposer.model")),
    Access(v2_drafter_model, "speculative decoding: the drafter's heads (V2)", V2_SPEC,
           reads=(f"{_V2_RUNNER}.speculator", f"{_V2_SPECULATOR}.model")),
    Access(speculator_model, "speculative decoding: EAGLE / EAGLE-3 / MTP drafter heads (V2)",
           V2_SPEC, reads=(f"{_V2_SPECULATOR}.model",)),
    Access(v1_runner_speculative_config, "speculative decoding: the drafter steered or not "
           "(V1)", V1_SPEC, reads=(f"{_V1}.speculative_config",)),
    Access(v2_runner_speculative_config, "speculative decoding: the drafter steered or not "
           "(V2)", V2_SPEC, reads=(f"{_V2_RUNNER}.speculative_config",)),
    Access(draft_model_config, "speculative decoding: the drafter's head input size", FRONTEND,
           reads=(f"{_SPEC}.draft_model_config",)),
    Access(spec_method, "speculative decoding: the method, logged", FRONTEND,
           reads=(f"{_SPEC}.method",)),
    Access(core_output_queue, "refusals answered from the engine core's process", ENGINE,
           reads=(f"{_CORE}Proc.output_queue",)),
    Access(core_requests, "steers in use by requests are never evicted", ENGINE,
           reads=(f"{_CORE}.scheduler", f"{_SCHEDULER}.requests")),
    Access(streaming_session, "a streaming-input session's later chunks and its end",
           ENGINE, reads=(f"{_CORE}.scheduler", f"{_SCHEDULER}.requests",
                          *reads_of("vllm.v1.request:Request", "request_id", "is_finished",
                                    "resumable"))),
    Access(is_resumable, "a streaming-input session's later chunks and its end", ENGINE,
           reads=("vllm.v1.request:Request.resumable",)),
    Access(core_run_in_workers, "a management op in every worker", ENGINE,
           reads=(f"{_CORE}.model_executor",
                  "vllm.v1.executor.abstract:Executor.collective_rpc")),
    Access(core_model_config, "the served model of the engine core's management ops", ENGINE,
           reads=(f"{_CORE}.vllm_config", f"{_CONFIG}.model_config")),
    Access(error_output, "a request finished with the plugin's error", ENGINE,
           reads=("vllm.v1.engine:EngineCoreOutput", "vllm.v1.engine:FinishReason.ERROR")),
    Access(send_error_output, "a request refused at admission", ENGINE,
           reads=(f"{_CORE}Proc.output_queue", "vllm.v1.engine:EngineCoreOutputs",
                  "vllm.v1.engine:EngineCoreOutputs.finished_requests",
                  *reads_of("vllm.v1.request:Request", "request_id", "client_index"))),
    Access(inproc_engine_core, "a request refused by an engine core in the LLM's process",
           FRONTEND, reads=("vllm.v1.engine.core_client:InprocClient.engine_core",)),
    Access(extend_outputs, "a request refused by an engine core in the LLM's process",
           FRONTEND, reads=("vllm.v1.engine:EngineCoreOutputs.outputs",),
           sets=("vllm.v1.engine:EngineCoreOutputs.outputs",)),
    Access(step_failures, "the requests a fault of the worker failed", ENGINE),
    Access(attach_step_failures, "the requests a fault of the worker failed", WORKER,
           reads=(f"{_OUTPUT}.req_ids",)),
    Access(fail_running_requests, "the requests a fault of the worker failed", ENGINE,
           reads=(*reads_of(_SCHEDULER, "requests", "finish_requests"),
                  *reads_of("vllm.v1.request:Request", "request_id", "client_index",
                            "is_finished"),
                  "vllm.v1.request:RequestStatus.FINISHED_ERROR")),
    Access(add_error_output, "the requests a fault of the worker failed", ENGINE,
           reads=("vllm.v1.engine:EngineCoreOutputs",
                  "vllm.v1.engine:EngineCoreOutputs.outputs"),
           sets=("vllm.v1.engine:EngineCoreOutputs.outputs",)),
    Access(max_num_seqs, "V1 per-request steer state sized by the batch", V1,
           reads=(f"{_CONFIG}.scheduler_config",
                  "vllm.config.scheduler:SchedulerConfig.max_num_seqs")),
    Access(is_swap, "V1 per-request steer state: batch moves", V1,
           reads=("vllm.v1.sample.logits_processor:MoveDirectionality.SWAP",)),
    Access(registry_model_names, "presets never shadow served models or LoRA adapters",
           FRONTEND, reads=(f"{_REGISTRY}.base_model_paths", f"{_REGISTRY}.lora_requests",
                            f"{_BASE_PATH}.name")),
    Access(serving_models, "presets as model names", FRONTEND,
           reads=("vllm.entrypoints.serve.engine.serving:BaseServing.models",)),
    Access(registry_base_model, "presets listed in /v1/models", FRONTEND,
           reads=(f"{_REGISTRY}.base_model_paths", f"{_REGISTRY}.model_config",
                  *reads_of(_BASE_PATH, "name", "model_path"), f"{_MODEL}.max_model_len")),
    Access(add_model_cards, "presets listed in /v1/models", FRONTEND,
           reads=("vllm.entrypoints.serve.engine.protocol:ModelList.data",)),
    Access(request_model_field, "presets as model names", FRONTEND,
           reads=_each_request("model")),
    Access(has_extra_args, "steers preloaded from --steer-dir", FRONTEND,
           reads=(f"{_PARAMS}.extra_args",)),
    Access(add_request_field, "the `steer` request field (parsed once)", FRONTEND,
           reads=(*_each_request("model_fields", "field_names", "model_rebuild"),
                  f"{_PYDANTIC}:Decorator", f"{_PYDANTIC}:Decorator.build",
                  f"{_PYDANTIC}:ModelValidatorDecoratorInfo",
                  f"{_PYDANTIC}:DecoratorInfos.model_validators",
                  "pydantic.main:BaseModel.__pydantic_fields__",
                  "pydantic.main:BaseModel.__pydantic_decorators__"),
           sets=_each_request("field_names")),
    Access(request_value, "the `steer` request field", FRONTEND),
    Access(set_request_value, "the `steer` request field", FRONTEND),
    Access(request_xargs, "a steer in vllm_xargs", FRONTEND,
           reads=_each_request("vllm_xargs")),
    Access(set_request_xargs, "a steer in vllm_xargs moved to the `steer` field", FRONTEND,
           sets=_each_request("vllm_xargs")),
    Access(request_id, "the request named in a fault's log", FRONTEND,
           reads=_each_request("request_id")),
    Access(request_model, "a preset served as a model name", FRONTEND,
           reads=_each_request("model")),
    Access(responses_streamed_in_foreground, "a streamed /v1/responses request refused with "
           "its status before its first event", FRONTEND,
           reads=reads_of(_RESPONSES_REQUEST, "stream", "background")),
    Access(engine_vllm_config, "the steer configuration of the HTTP routes", FRONTEND,
           reads=("vllm.engine.protocol:EngineClient.vllm_config",)),
    Access(engine_model_config, "the served model of the HTTP routes", FRONTEND,
           reads=("vllm.engine.protocol:EngineClient.model_config",)),
    Access(max_model_len, "the highlight route's bound on the text", FRONTEND,
           reads=(f"{_MODEL}.max_model_len",)),
    Access(served_model_name, "the served model in /v1/steer/info", FRONTEND,
           reads=(f"{_MODEL}.served_model_name", f"{_MODEL}.model")),
    Access(engine_tokenizer, "the highlight route's tokens", FRONTEND,
           reads=(f"{_ASYNC_LLM}.get_tokenizer",)),
    Access(engine_generate, "the highlight route's prompt logprobs", FRONTEND,
           reads=("vllm.engine.protocol:EngineClient.generate",)),
    Access(prompt_token_logprobs, "the highlight route's prompt logprobs", FRONTEND,
           reads=("vllm.outputs:RequestOutput.prompt_logprobs", "vllm.logprobs:Logprob.logprob")),
    Access(collective_rpc_every_core, "a management op in every engine core", FRONTEND,
           reads=(f"{_ASYNC_LLM}.engine_core", f"{_ASYNC_LLM}.collective_rpc",
                  "vllm.v1.engine.core_client:DPLBAsyncMPClient.call_utility_all_async")),
    Access(engine_core_count, "a change of a name ordered in every engine core", FRONTEND,
           reads=(f"{_ASYNC_LLM}.engine_core",
                  "vllm.v1.engine.core_client:DPLBAsyncMPClient.call_utility_all_async",
                  "vllm.v1.engine.core_client:MPClient.core_engines")),
    Access(llm_collective_rpc, "a management op offline", FRONTEND,
           reads=("vllm.entrypoints.llm:LLM.collective_rpc",)),
    Access(engine_input_processor, "each engine of a process admits by its own steers",
           FRONTEND, reads=(f"{_ASYNC_LLM}.input_processor",)),
    Access(llm_input_processor, "each engine of a process admits by its own steers", FRONTEND,
           reads=("vllm.entrypoints.llm:LLM.llm_engine",
                  "vllm.v1.engine.llm_engine:LLMEngine.input_processor")),
    Access(api_keys, "API keys never pass as the steer admin key", FRONTEND,
           reads=("vllm.entrypoints.launchers.cli_args:FrontendArgs.api_key",),
           versions="<0.33", releases=(Release(">=0.33", reads=(
               "vllm.entrypoints.common.cli_args:FrontendArgs.api_key",)),)),
    Access(is_last_pp_rank, "only the last pipeline stage has the LM head", WORKER,
           reads=("vllm.distributed.parallel_state:get_pp_group",
                  "vllm.distributed.parallel_state:GroupCoordinator.is_last_rank")),
    Access(api_key_arg, "API keys never pass as the steer admin key", FRONTEND,
           reads=("vllm.entrypoints.launchers.cli_args:FrontendArgs.api_key",),
           versions="<0.33", releases=(Release(">=0.33", reads=(
               "vllm.entrypoints.common.cli_args:FrontendArgs.api_key",)),)),
    Access(set_api_keys, "the steer admin key among vLLM's API keys", FRONTEND,
           sets=("vllm.entrypoints.launchers.cli_args:FrontendArgs.api_key",),
           versions="<0.33", releases=(Release(">=0.33", sets=(
               "vllm.entrypoints.common.cli_args:FrontendArgs.api_key",)),)),
    Access(cli_served_model_names, "presets never shadow the served model name", FRONTEND,
           reads=reads_of(_ENGINE_ARGS, "served_model_name", "model")),
    Access(cli_lora_module_names, "presets never shadow a LoRA module", FRONTEND,
           reads=("vllm.entrypoints.launchers.cli_args:FrontendArgs.lora_modules",
                  f"{_LORA_PATH}.name"),
           versions="<0.33", releases=(Release(">=0.33", reads=(
               "vllm.entrypoints.common.cli_args:FrontendArgs.lora_modules",
               f"{_LORA_PATH}.name")),)),
    Access(app_state_args, "the API keys the admin routes refuse", FRONTEND,
           reads=(f"{_APP_STATE}:init_app_state.args",)),
    Access(app_state_serving_models, "presets never shadow served models or LoRA adapters",
           FRONTEND, reads=(f"{_APP_STATE}:init_app_state.openai_serving_models",)),
    Access(output_stop_reasons, "an engine-side refusal answered by the API server", FRONTEND,
           reads=("vllm.outputs:RequestOutput.outputs", "vllm.outputs:CompletionOutput."
                  "stop_reason", "vllm.outputs:CompletionOutput.finish_reason")),
    Access(layer_range, "vector steers: the decoder blocks of this pipeline stage", WORKER,
           reads=("vllm.model_executor.models.utils:make_layers",
                  *reads_of("vllm.model_executor.models.llama:LlamaModel", "start_layer",
                            "end_layer"))),
    Access(is_pp_missing_layer, "vector steers: the blocks of this pipeline stage "
           "(Transformers backend)", WORKER,
           reads=("vllm.model_executor.models.utils:PPMissingLayer",)),
    Access(steer_block, "vector steers: the op in each decoder block", WORKER,
           reads=("torch.nn.modules.module:Module.register_buffer",)),
    Access(block_forward_value, "vector steers: a block's own scaling of the residual stream "
           "(fp16 DeepSeek-style blocks)", WORKER,
           reads=("torch.nn.modules.module:Module.forward",)),
)


def access_problems(access: Access, surface: Any) -> list[str]:
    """What ``surface`` (a vLLM release's, as :func:`vllm_steer.integrations.hook_check.
    surface_problems` reads it) lacks of ``access``."""
    where = f"vllm_steer.integrations.vllm_access.{access.function.__name__} ({access.purpose})"
    names = access.names_for(surface.version)
    if names is None:
        declared = "; ".join(v for v in (access.versions, *(r.versions for r in access.releases)))
        return [f"{where}: declared for vLLM {declared}, not {surface.version}"]
    out = []
    for name in names:
        if surface.lookup(name) is None:
            pkg = "vLLM" if name.partition(":")[0].partition(".")[0] == "vllm" else \
                f"installed {name.partition('.')[0]}"
            out.append(f"{where}: reads {name}, which this {pkg} does not have")
    return out
