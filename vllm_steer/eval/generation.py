"""Sampling continuations through vLLM with the plugin: the conditions of an evaluation.

A :class:`Condition` is one way of generating: unsteered, LM-Steer at some strengths
(``{"detox": 5}``, or two steers at once for the composition grid), or the soft-blacklist
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


@dataclass(frozen=True)
class Condition:
    """One generation setting."""

    method: str
    """``unsteered``, ``lm-steer`` or ``soft-blacklist``."""
    steer: dict[str, float] = field(default_factory=dict)
    """Steer name -> strength (lm-steer)."""
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
        return f"{self.method} " + ",".join(f"{k}={v:+g}" for k, v in self.strengths.items())

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


class Generator(Protocol):
    """What the harness needs from an engine (a fake one in unit tests)."""

    def generate(self, prompts: Sequence[str], conditions: Sequence[Condition],
                 sampling: SamplingConfig, progress: bool = True) -> Generations: ...

    def close(self) -> None: ...


@dataclass
class EngineConfig:
    """The vLLM engine of an evaluation (defaults fit this project's CPU tests)."""

    dtype: str = "float32"
    """Model dtype in vLLM (``float32`` on CPU; ``auto``/``bfloat16`` on GPU)."""
    max_model_len: int = 512
    """Context window the engine allocates for (prompt + continuation)."""
    max_num_seqs: int = 128
    """Sequences decoded together (larger batches are faster per token)."""
    kv_cache_gib: float = 1.0
    """KV-cache memory (GiB) reserved on the CPU (``kv_cache_memory_bytes``)."""
    enforce_eager: bool = True
    """No graph capture/compilation (faster start-up; required on this CPU build)."""
    extra: dict = field(default_factory=dict)
    """Any other ``vllm.LLM`` keyword arguments."""


class VLLMGenerator:
    """An offline ``vllm.LLM`` with the steers and soft blacklists of an evaluation loaded."""

    def __init__(self, model: str, steers: dict[str, str] | None = None,
                 blacklists: dict[str, str] | None = None, engine: EngineConfig | None = None,
                 seed: int = 0):
        from vllm import LLM

        from vllm_steer.eval.logits_processor import FQCN, engine_config

        engine = engine or EngineConfig()
        additional: dict = {}
        if steers:
            additional["vllm_steer"] = {"steers": dict(steers)}
        kw = dict(dtype=engine.dtype, max_model_len=engine.max_model_len,
                  max_num_seqs=engine.max_num_seqs, enforce_eager=engine.enforce_eager,
                  kv_cache_memory_bytes=int(engine.kv_cache_gib * (1 << 30)), seed=seed)
        if blacklists:
            additional.update(engine_config(blacklists))
            kw["logits_processors"] = [FQCN]
        kw.update(engine.extra)
        t0 = time.perf_counter()
        self.llm = LLM(model, additional_config=additional or None, **kw)
        self.startup_s = time.perf_counter() - t0

    def generate(self, prompts: Sequence[str], conditions: Sequence[Condition],
                 sampling: SamplingConfig, progress: bool = True) -> Generations:
        from vllm import SamplingParams

        sampling.validate()
        k = sampling.samples
        all_prompts, params, where = [], [], []
        for cond in conditions:
            extra = cond.extra_args()
            for i, p in enumerate(prompts):
                all_prompts.append(p)
                params.append(SamplingParams(n=k, top_p=sampling.top_p,
                                             temperature=sampling.temperature,
                                             max_tokens=sampling.max_tokens,
                                             seed=sampling.seed + i * k, extra_args=extra))
                where.append((cond.label, i))
        outs = self.llm.generate(all_prompts, params, use_tqdm=progress)
        result: Generations = {c.label: [[] for _ in prompts] for c in conditions}
        for (label, i), o in zip(where, outs):
            result[label][i] = [c.text for c in sorted(o.outputs, key=lambda c: c.index)]
        return result

    def nll(self, prompts: Sequence[str], continuations: Sequence[str],
            progress: bool = True) -> list:
        """Unsteered log-likelihood of each continuation given its prompt, from the engine's
        prompt logprobs (the same model and weights that generated; prompt and continuation
        tokenised separately and concatenated, as :func:`vllm_steer.hf.token_logprobs`
        does). Returns :class:`~vllm_steer.eval.fluency.SampleNLL` per pair."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        from vllm_steer.eval.fluency import SampleNLL

        if len(prompts) != len(continuations):
            raise ValueError(f"{len(prompts)} prompts but {len(continuations)} continuations")
        tok = self.llm.get_tokenizer()
        out: list = [SampleNLL(0.0, 0)] * len(prompts)
        reqs, where, starts = [], [], []
        cache: dict[str, list[int]] = {}
        for i, (p, c) in enumerate(zip(prompts, continuations)):
            if p not in cache:
                cache[p] = tok(p, add_special_tokens=False)["input_ids"]
            a, b = cache[p], tok(c, add_special_tokens=False)["input_ids"]
            if not b:
                continue
            reqs.append(TokensPrompt(prompt_token_ids=a + b))
            where.append(i)
            starts.append(max(len(a), 1))
        params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0)
        outs = self.llm.generate(reqs, params, use_tqdm=progress)
        for i, start, o in zip(where, starts, outs):
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
