"""Sampling continuations through vLLM with the plugin: the conditions of an evaluation.

A :class:`Condition` is one way of generating: unsteered, a steer at some strengths
(LM-Steer ``{"detox": 5}`` or a vector steer ``{"vector-detox": 0.03}``, or two steers at once
for the composition grid), or the soft-blacklist
baseline at some strength. Every condition samples the same prompts with the same seeds
(prompt ``i`` uses seeds ``seed + i*k .. seed + i*k + k-1`` for its ``k`` samples), so
differences between conditions come from the steering, not from the random draws.

All conditions go to the engine in one ``generate`` call (one big mixed batch: steered,
unsteered and baseline requests share batches, which the plugin supports).
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass, field
from typing import Protocol, Sequence

from vllm_steer.logs import get_logger

logger = get_logger()

METHOD_NONE, METHOD_STEER, METHOD_BLACKLIST = "unsteered", "lm-steer", "soft-blacklist"
#: A vector steer (control vector, ``h_k += a * v_k`` at decoder blocks).
METHOD_VECTOR = "vector"


def steer_method(kinds: Sequence[str]) -> str:
    """The method label of a condition that steers with steers of these kinds (``lm-steer``,
    ``vector``; a mix of both is ``lm-steer+vector``)."""
    ks = sorted(set(kinds))
    if not ks:
        raise ValueError("a steered condition needs at least one steer")
    return "+".join(METHOD_VECTOR if k == METHOD_VECTOR else METHOD_STEER for k in ks)



def strength_label(value: float) -> str:
    """A strength as a condition's label writes it (``+5``, ``-0.02``: six significant
    digits, so two strengths that agree to them share a label)."""
    return f"{value:+g}"


@dataclass(frozen=True)
class Condition:
    """One generation setting."""

    method: str
    """``unsteered``, ``lm-steer``, ``vector`` (a vector steer), ``lm-steer+vector`` (a grid
    cell mixing both kinds) or ``soft-blacklist``."""
    steer: dict[str, float] = field(default_factory=dict)
    """Steer name -> strength (``lm-steer``: units of epsilon; ``vector``: the coefficient
    ``a`` of ``h_k += a * v_k``)."""
    blacklist: dict[str, float] = field(default_factory=dict)
    """Soft-blacklist name -> strength (soft-blacklist)."""

    @property
    def strengths(self) -> dict[str, float]:
        return dict(self.steer or self.blacklist)

    @property
    def strength(self) -> float:
        """The (first) strength: the x axis of the plots (0 when unsteered)."""
        s = self.strengths
        return float(next(iter(s.values()))) if s else 0.0

    @property
    def label(self) -> str:
        if self.method == METHOD_NONE:
            return "unsteered"
        return f"{self.method} " + ",".join(f"{k}={strength_label(v)}"
                                            for k, v in self.strengths.items())

    def extra_args(self) -> dict | None:
        from vllm_steer.eval.logits_processor import REQUEST_KEY

        args: dict = {}
        if self.steer:
            args["steer"] = dict(self.steer)
        if self.blacklist:
            args[REQUEST_KEY] = dict(self.blacklist)
        return args or None

    def to_dict(self) -> dict:
        return {"label": self.label, "method": self.method, "strength": self.strength,
                "strengths": self.strengths}


@dataclass
class SamplingConfig:
    """How each prompt is sampled (the paper's protocol by default)."""

    samples: int = 25
    """Samples per prompt."""
    max_tokens: int = 20
    """Longest continuation, tokens."""
    top_p: float = 0.9
    """Nucleus sampling."""
    temperature: float = 1.0
    """Sampling temperature."""
    seed: int = 0
    """Base seed (see the module docstring)."""

    def validate(self) -> None:
        problems = []
        if self.samples < 1:
            problems.append(f"--samples {self.samples}: must be at least 1")
        if self.max_tokens < 1:
            problems.append(f"--max-tokens {self.max_tokens}: must be at least 1")
        if not 0 < self.top_p <= 1:
            problems.append(f"--top-p {self.top_p}: must be in (0, 1]")
        if self.temperature <= 0:
            problems.append(f"--temperature {self.temperature}: must be > 0 (sampling)")
        if problems:
            raise ValueError("; ".join(problems))


#: condition label -> per prompt, its samples
Generations = dict[str, list[list[str]]]
#: A prompt: text the engine tokenises as a completion prompt, or token ids given as they are
#: (a chat-templated prompt, :mod:`vllm_steer.eval.chat`).
Prompt = str | list[int]


class Generator(Protocol):
    """What the harness needs from an engine (a fake one in unit tests)."""

    def generate(self, prompts: Sequence[Prompt], conditions: Sequence[Condition],
                 sampling: SamplingConfig, progress: bool = True) -> Generations: ...

    def close(self) -> None: ...


DEVICE_CUDA, DEVICE_CPU = "cuda", "cpu"

#: What an unset engine setting becomes, per device: bf16 and CUDA graphs on a GPU (vLLM's own
#: choices for the rest); on a CPU the settings the evaluations were measured with.
DEVICE_DEFAULTS: dict[str, dict] = {
    DEVICE_CUDA: {"dtype": "bfloat16", "enforce_eager": False, "max_model_len": None,
                  "max_num_seqs": None, "kv_cache_gib": None},
    DEVICE_CPU: {"dtype": "float32", "enforce_eager": True, "max_model_len": 512,
                 "max_num_seqs": 128, "kv_cache_gib": 1.0},
}


def engine_device() -> str:
    """``cuda`` where vLLM runs on a CUDA (or ROCm) GPU, else ``cpu``."""
    from vllm.platforms import current_platform

    return DEVICE_CUDA if current_platform.is_cuda_alike() else DEVICE_CPU


@dataclass
class EngineConfig:
    """The vLLM engine of an evaluation: vLLM's own engine arguments (``EngineArgs`` fields).
    ``None`` means "the default for the device" (:data:`DEVICE_DEFAULTS`): bfloat16 and
    CUDA graphs on a GPU; float32, eager and a 512-token window on a CPU, where every prompt
    is prefilled whole (no chunked prefill: vLLM's CPU runner cannot rewind a seeded
    request's generator)."""

    dtype: str | None = None
    """Model dtype in vLLM (``None``: ``bfloat16`` on CUDA, ``float32`` on CPU)."""
    max_model_len: int | None = None
    """Context window the engine allocates for, prompt + continuation (``None``: the model's
    own on CUDA, 512 on CPU)."""
    max_num_seqs: int | None = None
    """Sequences decoded together (``None``: vLLM's default on CUDA, 128 on CPU)."""
    kv_cache_gib: float | None = None
    """KV-cache memory (GiB, ``kv_cache_memory_bytes``); ``None``: on CUDA the share
    ``gpu_memory_utilization`` leaves, on CPU 1 GiB."""
    enforce_eager: bool | None = None
    """No CUDA graphs or compilation (``None``: graphs on CUDA, eager on CPU)."""
    extra: dict = field(default_factory=dict)
    """Any other vLLM engine argument (``EngineArgs`` field -> value), e.g.
    ``{"tensor_parallel_size": 2, "gpu_memory_utilization": 0.8, "quantization": "fp8"}``."""

    def resolved(self, device: str) -> dict:
        """The engine arguments for ``device`` (``cuda`` or ``cpu``): the settings given, the
        device's defaults for the others; arguments left to vLLM are not included."""
        if device not in DEVICE_DEFAULTS:
            raise ValueError(f"device {device!r}: choose {' or '.join(DEVICE_DEFAULTS)}")
        kw: dict = {}
        for k, default in DEVICE_DEFAULTS[device].items():
            v = getattr(self, k)
            v = default if v is None else v
            if v is None:
                continue
            if k == "kv_cache_gib":
                kw["kv_cache_memory_bytes"] = int(v * (1 << 30))
            else:
                kw[k] = v
        if "kv_cache_memory_bytes" in self.extra and self.kv_cache_gib is not None:
            raise ValueError(f"--kv-cache-gib {self.kv_cache_gib:g} and "
                             f"--kv-cache-memory-bytes {self.extra['kv_cache_memory_bytes']} "
                             "both size the KV cache: give one of them")
        if device == DEVICE_CPU:
            # every prompt prefilled whole: vLLM 0.32's CPU runner dies when it drops the token
            # sampled for a partly prefilled request that has a seed (a CPU generator has no
            # offset to rewind), and every sample here has one
            kw["enable_chunked_prefill"] = False
        kw.update(self.extra)
        return kw


class VLLMGenerator:
    """An offline ``vllm.LLM`` with the steers and soft blacklists of an evaluation loaded."""

    def __init__(self, model: str, steers: dict[str, str] | None = None,
                 blacklists: dict[str, str] | None = None, engine: EngineConfig | None = None,
                 seed: int = 0, device: str | None = None):
        from vllm import LLM

        from vllm_steer.eval.logits_processor import FQCN, engine_config

        engine = engine or EngineConfig()
        kw = engine.resolved(device or engine_device())
        #: the engine arguments this run used (recorded in results.json)
        self.engine_args = dict(kw)
        additional: dict = dict(kw.pop("additional_config", None) or {})
        if steers:
            additional["vllm_steer"] = {**additional.get("vllm_steer", {}),
                                        "steers": dict(steers)}
        if blacklists:
            additional.update(engine_config(blacklists))
            kw["logits_processors"] = list(kw.get("logits_processors") or []) + [FQCN]
        t0 = time.perf_counter()
        self.llm = LLM(model, additional_config=additional or None, seed=seed, **kw)
        self.startup_s = time.perf_counter() - t0

    def generate(self, prompts: Sequence[Prompt], conditions: Sequence[Condition],
                 sampling: SamplingConfig, progress: bool = True) -> Generations:
        """Samples of every prompt in every condition. A prompt given as token ids (a
        chat-templated prompt) goes to the engine as it is."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        sampling.validate()
        k = sampling.samples
        all_prompts, params, where = [], [], []
        for cond in conditions:
            extra = cond.extra_args()
            for i, p in enumerate(prompts):
                all_prompts.append(p if isinstance(p, str)
                                   else TokensPrompt(prompt_token_ids=list(p)))
                params.append(SamplingParams(n=k, top_p=sampling.top_p,
                                             temperature=sampling.temperature,
                                             max_tokens=sampling.max_tokens,
                                             seed=sampling.seed + i * k, extra_args=extra))
                where.append((cond.label, i))
        outs = self.llm.generate(all_prompts, params, use_tqdm=progress)
        result: Generations = {c.label: [[] for _ in prompts] for c in conditions}
        for (label, i), o in zip(where, outs, strict=True):
            result[label][i] = [c.text for c in sorted(o.outputs, key=lambda c: c.index)]
        return result

    def nll(self, prompts: Sequence[Prompt], continuations: Sequence[str],
            progress: bool = True) -> list:
        """Unsteered log-likelihood of each continuation given its prompt, from the engine's
        prompt logprobs (the same model and weights that generated; prompt and continuation
        tokenised separately and concatenated, as :func:`vllm_steer.hf.token_logprobs`
        does; a text prompt with the special tokens vLLM added when it generated, such as
        Llama's BOS; a prompt given as token ids, a chat-templated one, is used as it is, so
        a chat reply is scored given the templated prompt). Returns
        :class:`~vllm_steer.eval.fluency.SampleNLL` per pair."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        from vllm_steer.eval.fluency import SampleNLL
        from vllm_steer.hf import prompt_ids

        if len(prompts) != len(continuations):
            raise ValueError(f"{len(prompts)} prompts but {len(continuations)} continuations")
        tok = self.llm.get_tokenizer()
        out: list = [SampleNLL(0.0, 0)] * len(prompts)
        reqs, where, starts = [], [], []
        cache: dict[str, list[int]] = {}
        for i, (p, c) in enumerate(zip(prompts, continuations, strict=True)):
            if isinstance(p, str):
                if p not in cache:
                    cache[p] = prompt_ids(tok, p)
                a = cache[p]
            else:
                a = list(p)
            b = tok(c, add_special_tokens=False)["input_ids"]
            if not b:
                continue
            reqs.append(TokensPrompt(prompt_token_ids=a + b))
            where.append(i)
            starts.append(max(len(a), 1))
        params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0)
        outs = self.llm.generate(reqs, params, use_tqdm=progress)
        for i, start, o in zip(where, starts, outs, strict=True):
            ids = o.prompt_token_ids
            lps = [o.prompt_logprobs[k][ids[k]].logprob for k in range(start, len(ids))]
            out[i] = SampleNLL(-float(sum(lps)), len(lps))
        return out

    def close(self) -> None:
        """Stop the engine's processes now (frees the CPU and memory for scoring)."""
        llm = getattr(self, "llm", None)
        if llm is None:
            return
        try:
            llm.llm_engine.engine_core.shutdown()
        except Exception as e:  # pragma: no cover - best effort
            logger.debug("engine shutdown: %s", e)
        self.llm = None
        del llm
        gc.collect()
