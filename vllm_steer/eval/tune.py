"""Choosing a steer's recommended strength like the paper: by generating, not by a loss proxy.

    vllm-steer tune steers/smollm2-detox.safetensors --task toxicity \\
        --prompts ../shared/data/prompts/toxicity/rtp_toxic_dev_598.jsonl
    vllm-steer tune steers/smollm2-vector-detox.safetensors --task toxicity \\
        --prompts ../shared/data/prompts/toxicity/rtp_toxic_dev_598.jsonl --strengths=0.02,0.04

Any kind of steer file: LM-Steer, or a vector steer (its safetensors file or a llama.cpp
control-vector GGUF, rewritten in its own format).

samples continuations of a development prompt set through vLLM with the plugin (one
:func:`vllm_steer.eval.harness.evaluate` run: unsteered plus the steer at each candidate
strength, the same prompts and seeds for every condition), measures the perplexity of each
condition, finds the strengths whose perplexity stays within a budget (default +15% over
unsteered; every weaker candidate must stay within it too: a curve that dips back under it
after an excursion does not count) — the paper's way of keeping fluency — and among them
takes the one that **moves the target metric most** (:func:`target_effects`: the drop in
avg max toxicity, or the positive-share spread between +s and -s; the stronger of equal
ones). It warns when no strength within the budget moves the target beyond noise: the mean
paired per-prompt difference must exceed :data:`NOISE_Z` = 1.96 standard errors (its 95%
confidence interval excludes 0), which a steer that does nothing (or does nothing on these
prompts, in this mode) never does.

Which strengths: ``toxicity`` steers towards the label that means non-toxic (``+s`` for the
shipped detox steer, ``-s`` when the labels say the opposite); ``sentiment`` is used both
ways, so ``+s`` and ``-s`` must both stay within the budget. The recommendation is stored as
a magnitude, as ``recommended_strength`` always is.

The result goes into the steer file's metadata (readable JSON, ``vllm-steer info FILE``):
``recommended_strength`` and ``metrics.tune`` = the rule, the budget, the prompts file and
its sha256, the sampling, the mode, the measured curve (perplexity and the task's headline
metrics per strength), the target's effects with their confidence intervals and the
command. Nothing else in the file changes.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any, Callable

from vllm_steer.eval.generation import EngineConfig, SamplingConfig

TASKS = ("toxicity", "sentiment")
DEFAULT_STRENGTHS = (1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 8.0, 10.0)
#: A vector steer's default candidates, as multiples of its ``recommended_strength``.
VECTOR_STRENGTH_FACTORS = (0.25, 0.5, 1.0, 1.5, 2.0, 3.0)
#: Metrics recorded per point of the curve (those the run has).
CURVE_KEYS = ("ppl", "ppl_tokens", "avg_max_toxicity", "toxicity_prob", "positivity",
              "positivity_vader", "dist-2")


@dataclass
class TuneConfig:
    """One tuning run (recorded in the steer file's ``metrics.tune``)."""

    steer: str
    """The steer file to tune (rewritten in place unless ``write`` is off)."""
    task: str
    """``toxicity`` (steer towards non-toxic) or ``sentiment`` (both directions)."""
    prompts: str
    """Development prompts (JSONL, ``prompt.text`` per line), e.g.
    ``prompts/toxicity/rtp_toxic_dev_598.jsonl``."""
    strengths: list[float] = field(default_factory=lambda: list(DEFAULT_STRENGTHS))
    """Candidate magnitudes, tried in the steering direction(s): units of epsilon for an
    LM-Steer file, the coefficient ``a`` for a vector steer (:func:`default_strengths`)."""
    ppl_budget: float = 0.15
    """Largest allowed relative perplexity increase over unsteered (0.15 = +15%)."""
    num_prompts: int | None = 100
    """First N prompts of the file (``None``: all)."""
    sampling: SamplingConfig = field(default_factory=lambda: SamplingConfig(samples=4))
    """Samples per prompt, tokens, top-p, temperature, seed."""
    model: str = "smollm2"
    """Model to generate with (HF folder or id, or ``smollm2``)."""
    data_dir: str | None = None
    """Data folder (only the ``sst2`` sentiment scorer needs it)."""
    out: str | None = None
    """Folder of the evaluation run (default ``eval_out/tune-TASK-NAME``)."""
    toxicity_scorer: str = "profanity-check"
    """Toxicity scorer (registered name or ``module:Class``): the target's."""
    extra_toxicity_scorers: list[str] = field(default_factory=list)
    """Further toxicity scorers, reported in the evaluation run beside it."""
    sentiment_scorers: list[str] = field(default_factory=lambda: ["sst2", "vader"])
    """Sentiment scorers; the first is the headline one."""
    engine: EngineConfig = field(default_factory=EngineConfig)
    """vLLM engine settings."""
    mode: str = "plain"
    """``plain``, ``chat`` or ``chat-instruct``: how the prompts reach the model
    (:mod:`vllm_steer.eval.chat`)."""
    instruction: str | None = None
    """``chat-instruct``: the user turn, ``{prompt}`` where the prompt goes."""
    write: bool = True
    """Write the chosen strength and the curve into the steer file."""
    progress: bool = True
    """Progress bars."""
    command: str | None = None
    """The command line (for the record)."""

    def validate(self) -> None:
        problems = []
        if self.task not in TASKS:
            problems.append(f"--task {self.task!r}: choose toxicity or sentiment")
        if not self.strengths or any(not (s > 0 and math.isfinite(s)) for s in self.strengths):
            problems.append(f"--strengths {self.strengths}: give positive magnitudes, e.g. "
                            "1,2,3,5 (the direction comes from the task and the labels)")
        if not (self.ppl_budget >= 0 and math.isfinite(self.ppl_budget)):
            problems.append(f"--ppl-budget {self.ppl_budget}: must be >= 0 (0.15 = +15%)")
        if not os.path.exists(self.steer):
            problems.append(f"{self.steer}: no such steer file")
        if not os.path.exists(self.prompts):
            problems.append(f"--prompts {self.prompts}: no such file")
        if problems:
            raise ValueError("; ".join(problems))


def directions(task: str, labels: dict) -> list[int]:
    """Signs the steer is used with: toxicity towards the non-toxic label; sentiment both,
    the one towards the positive label first (the file's labels say which)."""
    from vllm_steer.eval.report import _sign_for

    if task == "toxicity":
        return [_sign_for(labels, "non-toxic", "toxic")]
    s = _sign_for(labels, "positive", "negative")  # the sign that moves towards positive
    return [s, -s]


def choose(curve: list[dict], budget: float, signs: list[int]) -> tuple[float | None, str]:
    """The largest magnitude ``m`` such that, for every candidate magnitude up to ``m`` and
    every sign in ``signs``, ``ppl(sign * m) <= (1 + budget) * ppl(0)``; ``None`` if even the
    smallest exceeds it. ``curve``: points ``{"strength", "ppl"}`` including strength 0."""
    by = {float(p["strength"]): p for p in curve}
    if 0.0 not in by:
        raise ValueError("the curve has no unsteered point (strength 0)")
    p0 = by[0.0]["ppl"]
    mags = sorted({abs(s) for s in by if s != 0})
    chosen = None
    for m in mags:
        pts = [by.get(sg * m) for sg in signs]
        if any(p is None for p in pts):
            continue
        if all(p["ppl"] <= (1 + budget) * p0 for p in pts):
            chosen = m
        else:
            break
    way = "+s" if signs == [1] else "-s" if signs == [-1] else "both +s and -s"
    rule = (f"strongest strength s (tried {', '.join(f'{m:g}' for m in mags)}) at which "
            f"generations steered with {way} keep a mean per-sample perplexity within "
            f"+{100 * budget:g}% of unsteered, every weaker strength too")
    return chosen, rule


#: A strength moves the target beyond noise when its mean per-prompt effect exceeds this many
#: standard errors (1.96: the two-sided 95% confidence interval of the effect excludes 0).
NOISE_Z = 1.96


def target_effects(conditions: list[dict], task: str, signs: list[int]) -> list[dict]:
    """Per candidate magnitude ``m``: how far the steer moves the task's target metric, as the
    mean over prompts of a paired per-prompt difference (every condition samples the same
    prompts with the same seeds), with its standard error and 95% confidence interval.

    - ``toxicity``: ``max_tox(0)[i] - max_tox(sign * m)[i]``, prompt ``i``'s highest sample
      toxicity unsteered minus steered (the drop in avg max toxicity);
    - ``sentiment``: ``pos(sign * m)[i] - pos(-sign * m)[i]``, the share of prompt ``i``'s
      samples judged positive steered towards positive minus towards negative (the spread
      the steer opens; ``signs[0]``: the sign towards positive, from the file's labels).
    """
    key = "max_toxicity" if task == "toxicity" else "positive_share"
    by = {float(c["strength"]): (c.get("per_prompt") or {}).get(key) for c in conditions}
    mags = sorted({abs(s) for s in by if s != 0})
    out = []
    for m in mags:
        if task == "toxicity":
            a, b = by.get(0.0), by.get(signs[0] * m)
        else:  # towards positive minus towards negative
            a, b = by.get(signs[0] * m), by.get(-signs[0] * m)
        if a is None or b is None:
            continue
        d = ([x - y for x, y in zip(a, b, strict=False)] if task == "sentiment" else
             [x - y for x, y in zip(a, b, strict=False)])
        n = len(d)
        mean = sum(d) / n
        se = (math.sqrt(sum((x - mean) ** 2 for x in d) / (n - 1) / n) if n > 1
              else float("inf"))
        out.append({"strength": m, "effect": mean, "se": se, "prompts": n,
                    "ci95": [mean - NOISE_Z * se, mean + NOISE_Z * se],
                    "beyond_noise": mean > NOISE_Z * se})
    return out


def pick_by_effect(effects: list[dict], allowed_up_to: float | None) -> dict | None:
    """Among the magnitudes up to ``allowed_up_to`` (those within the perplexity budget), the
    one with the largest effect (the stronger of equal ones); ``None`` when none is allowed."""
    ok = [e for e in effects if allowed_up_to is not None and e["strength"] <= allowed_up_to]
    return max(ok, key=lambda e: (e["effect"], e["strength"])) if ok else None


def _sha256(path: str) -> str:
    from vllm_steer.train.data import file_sha256

    return file_sha256(path)


def tune(cfg: TuneConfig, generator_factory: Callable | None = None,
         log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run the evaluation, choose the strength, (optionally) write it into the steer file.
    Returns the ``metrics.tune`` record."""
    from vllm_steer.eval.harness import EvalConfig, _log, evaluate
    from vllm_steer.kinds import read_any_metadata

    log = log or _log
    cfg.validate()
    meta = read_any_metadata(cfg.steer)
    signs = directions(cfg.task, meta.labels)
    strengths = [0.0] + [sg * float(m) for m in sorted(cfg.strengths) for sg in signs]
    out = cfg.out or os.path.join("eval_out", f"tune-{cfg.task}-{meta.name}")
    ecfg = EvalConfig(task=cfg.task, model=cfg.model, steers=[cfg.steer], strengths=strengths,
                      baseline="none", num_prompts=cfg.num_prompts, prompt_file=cfg.prompts,
                      sampling=cfg.sampling, data_dir=cfg.data_dir, out=out,
                      toxicity_scorer=cfg.toxicity_scorer,
                      extra_toxicity_scorers=list(cfg.extra_toxicity_scorers),
                      sentiment_scorers=list(cfg.sentiment_scorers), engine=cfg.engine,
                      mode=cfg.mode, instruction=cfg.instruction,
                      progress=cfg.progress, command=cfg.command)
    results = evaluate(ecfg, generator_factory=generator_factory, log=log)
    curve = []
    for c in results["conditions"]:
        m = c["metrics"]
        curve.append({"strength": c["strength"],
                      **{k: m[k] for k in CURVE_KEYS if k in m
                         and isinstance(m[k], (int, float))}})
    curve.sort(key=lambda p: p["strength"])
    p0 = next(p for p in curve if p["strength"] == 0)["ppl"]
    for p in curve:
        p["ppl_relative"] = (p["ppl"] - p0) / p0 if p0 else float("nan")
    allowed, rule = choose(curve, cfg.ppl_budget, signs)
    effects = target_effects(results["conditions"], cfg.task, signs)
    best = pick_by_effect(effects, allowed)
    chosen = best["strength"] if best is not None else allowed
    target_name = ("avg max toxicity (drop vs unsteered)" if cfg.task == "toxicity" else
                   f"positive share by {cfg.sentiment_scorers[0]} (+s minus -s)")
    if allowed is not None:
        rule = (f"among the strengths up to the strongest within the perplexity budget "
                f"({rule}), the one that moves {target_name} most")
    moves = any(e["beyond_noise"] for e in effects
                if allowed is not None and e["strength"] <= allowed)
    target = {"metric": target_name, "effects": effects,
              "chosen_effect": best, "moves_beyond_noise": moves,
              "noise": f"mean paired per-prompt difference > {NOISE_Z} standard errors "
                       "(its 95% confidence interval excludes 0)"}
    record: dict[str, Any] = {
        "recommended_strength": chosen, "rule": rule, "ppl_budget": cfg.ppl_budget,
        "task": cfg.task, "directions": signs,
        "prompts": {"file": os.path.abspath(cfg.prompts), "sha256": _sha256(cfg.prompts),
                    "num_prompts": results["num_prompts"]},
        "sampling": dataclasses.asdict(cfg.sampling), "model": cfg.model,
        "mode": cfg.mode, "instruction": results.get("instruction"),
        "scorers": {"toxicity": cfg.toxicity_scorer, "sentiment": list(cfg.sentiment_scorers),
                    "perplexity": results["scorers"]["perplexity"]},
        "curve": curve, "target": target,
        "previous_recommended_strength": meta.recommended_strength,
        "eval_out": os.path.abspath(out), "command": cfg.command,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }
    if chosen is None:
        log(f"tune: even strength {min(cfg.strengths):g} raises perplexity by more than "
            f"{100 * cfg.ppl_budget:g}%; the recommended strength is left at "
            f"{meta.recommended_strength} (try smaller --strengths)")
    else:
        log(f"tune: recommended strength {chosen:g} (was {meta.recommended_strength}); "
            f"{rule}")
    if allowed is not None and not moves:
        top = max((e for e in effects if e["strength"] <= allowed),
                  key=lambda e: e["effect"], default=None)
        log(f"tune: warning: no strength within the perplexity budget moves {target_name} "
            "beyond noise" + (f" (largest: s={top['strength']:g}, {top['effect']:+.3f}, 95% "
                              f"CI {top['ci95'][0]:+.3f} .. {top['ci95'][1]:+.3f}, "
                              f"{top['prompts']} prompts)" if top else "")
            + "; the steer may do nothing here: check it, or measure on more prompts")
    for p in curve:
        log("tune:   s=%+g  ppl %.2f (%+.1f%%)%s" % (
            p["strength"], p["ppl"], 100 * p["ppl_relative"],
            "".join(f"  {k} {p[k]:.3f}" for k in ("avg_max_toxicity", "toxicity_prob",
                                                  "positivity") if k in p)))
    for e in effects:
        log(f"tune:   target s={e['strength']:g}: {target_name} {e['effect']:+.3f}, 95% CI "
            f"{e['ci95'][0]:+.3f} .. {e['ci95'][1]:+.3f} ({e['prompts']} prompts)"
            + ("" if e["beyond_noise"] else ", within noise"))
    if cfg.write:
        _write_record(cfg.steer, record, rule if chosen is not None else None, chosen)
        log(f"tune: wrote the strength and the curve into {cfg.steer} (metrics.tune)")
    return record


def _write_record(path: str, record: dict, rule: str | None, chosen: float | None) -> None:
    """The steer file rewritten in its own kind and format (an LM-Steer file, a vector steer's
    safetensors file or its llama.cpp GGUF), with ``metrics.tune`` and, when a strength was
    chosen, ``recommended_strength``; nothing else changes."""
    from vllm_steer.kinds import VECTOR, kind_of_file, load_any

    steer = load_any(path)
    metrics = dict(steer.metadata.metrics)
    metrics["tune"] = record
    if rule is not None:
        metrics["recommended_strength_rule"] = "vllm-steer tune: " + rule
    new_meta = dataclasses.replace(
        steer.metadata, metrics=json.loads(json.dumps(metrics, default=str)),
        recommended_strength=chosen if chosen is not None
        else steer.metadata.recommended_strength)
    new = dataclasses.replace(steer, metadata=new_meta)
    if kind_of_file(path) is VECTOR:
        from vllm_steer.vectors import is_gguf, save_gguf, save_vector

        (save_gguf if is_gguf(path) else save_vector)(path, new)
    else:
        from vllm_steer.format import save_steer

        save_steer(path, new)


def default_strengths(meta: Any, task: str) -> list[float]:
    """Candidate magnitudes when ``--strengths`` is not given: :data:`DEFAULT_STRENGTHS` (units
    of epsilon) for an LM-Steer file; for a vector steer, whose strength is the raw coefficient
    ``a`` of ``h_k += a * v_k`` and so has no common scale, :data:`VECTOR_STRENGTH_FACTORS`
    times its ``recommended_strength``."""
    if getattr(meta, "kind", "lm-steer") != "vector":
        return list(DEFAULT_STRENGTHS)
    r = meta.recommended_strength
    if not r:
        raise ValueError(f"the vector steer {meta.name!r} records no recommended_strength, so "
                         "there is no scale to try strengths on: give --strengths (magnitudes "
                         "of the coefficient a, e.g. --strengths=0.01,0.02,0.04,0.08)")
    return [round(abs(r) * f, 6) for f in VECTOR_STRENGTH_FACTORS]
