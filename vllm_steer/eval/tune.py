"""Choosing a steer's recommended strength like the paper: by generating, not by a loss proxy.

    vllm-steer tune steers/smollm2-detox.safetensors --task toxicity \\
        --prompts ../shared/data/prompts/toxicity/rtp_toxic_dev_598.jsonl

samples continuations of a development prompt set through vLLM with the plugin (one
:func:`vllm_steer.eval.harness.evaluate` run: unsteered plus the steer at each candidate
strength, the same prompts and seeds for every condition), measures the perplexity of each
condition, and takes the **strongest strength whose perplexity stays within a budget**
(default +15% over unsteered) — the paper's way of picking a strength that steers without
breaking fluency. Every weaker candidate must stay within the budget too (a curve that
dips back under it after an excursion does not count).

Which strengths: ``toxicity`` steers towards the label that means non-toxic (``+s`` for the
shipped detox steer, ``-s`` when the labels say the opposite); ``sentiment`` is used both
ways, so ``+s`` and ``-s`` must both stay within the budget. The recommendation is stored as
a magnitude, as ``recommended_strength`` always is.

The result goes into the steer file's metadata (readable JSON, ``vllm-steer info FILE``):
``recommended_strength`` and ``metrics.tune`` = the rule, the budget, the prompts file and
its sha256, the sampling, the measured curve (perplexity and the task's headline metrics
per strength) and the command. Nothing else in the file changes.
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
    """Candidate magnitudes (units of epsilon), tried in the steering direction(s)."""
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
    """Toxicity scorer (registered name or ``module:Class``)."""
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
    """Signs the steer is used with: toxicity towards the non-toxic label, sentiment both."""
    from vllm_steer.eval.report import _sign_for

    if task == "toxicity":
        return [_sign_for(labels, "non-toxic", "toxic")]
    return [1, -1]


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


def _sha256(path: str) -> str:
    from vllm_steer.train.data import file_sha256

    return file_sha256(path)


def tune(cfg: TuneConfig, generator_factory: Callable | None = None,
         log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run the evaluation, choose the strength, (optionally) write it into the steer file.
    Returns the ``metrics.tune`` record."""
    from vllm_steer.eval.harness import EvalConfig, _log, evaluate
    from vllm_steer.format import load_steer, read_metadata, save_steer

    log = log or _log
    cfg.validate()
    meta = read_metadata(cfg.steer)
    signs = directions(cfg.task, meta.labels)
    strengths = [0.0] + [sg * float(m) for m in sorted(cfg.strengths) for sg in signs]
    out = cfg.out or os.path.join("eval_out", f"tune-{cfg.task}-{meta.name}")
    ecfg = EvalConfig(task=cfg.task, model=cfg.model, steers=[cfg.steer], strengths=strengths,
                      baseline="none", num_prompts=cfg.num_prompts, prompt_file=cfg.prompts,
                      sampling=cfg.sampling, data_dir=cfg.data_dir, out=out,
                      toxicity_scorer=cfg.toxicity_scorer,
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
    chosen, rule = choose(curve, cfg.ppl_budget, signs)
    record: dict[str, Any] = {
        "recommended_strength": chosen, "rule": rule, "ppl_budget": cfg.ppl_budget,
        "task": cfg.task, "directions": signs,
        "prompts": {"file": os.path.abspath(cfg.prompts), "sha256": _sha256(cfg.prompts),
                    "num_prompts": results["num_prompts"]},
        "sampling": dataclasses.asdict(cfg.sampling), "model": cfg.model,
        "mode": cfg.mode, "instruction": results.get("instruction"),
        "scorers": {"toxicity": cfg.toxicity_scorer, "sentiment": list(cfg.sentiment_scorers),
                    "perplexity": results["scorers"]["perplexity"]},
        "curve": curve, "previous_recommended_strength": meta.recommended_strength,
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
    for p in curve:
        log("tune:   s=%+g  ppl %.2f (%+.1f%%)%s" % (
            p["strength"], p["ppl"], 100 * p["ppl_relative"],
            "".join(f"  {k} {p[k]:.3f}" for k in ("avg_max_toxicity", "toxicity_prob",
                                                  "positivity") if k in p)))
    if cfg.write:
        steer = load_steer(cfg.steer)
        metrics = dict(steer.metadata.metrics)
        metrics["tune"] = record
        if chosen is not None:
            metrics["recommended_strength_rule"] = "vllm-steer tune: " + rule
        new_meta = dataclasses.replace(
            steer.metadata, metrics=json.loads(json.dumps(metrics, default=str)),
            recommended_strength=chosen if chosen is not None
            else steer.metadata.recommended_strength)
        save_steer(cfg.steer, dataclasses.replace(steer, metadata=new_meta))
        log(f"tune: wrote the strength and the curve into {cfg.steer} (metrics.tune)")
    return record
