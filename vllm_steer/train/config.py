"""Configuration of offline steer training: the recipe (:class:`TrainConfig`) and the data
(:class:`DataConfig`). Light: no torch import. Both dataclasses are recorded in full in the
steer file's metadata (``recipe`` and ``data``), so a steer says how it was made.

Defaults follow the paper's code (Adam, lr 1e-2, epsilon 1e-3, factors initialised as
``randn * 1e-2``, batch 32, max length 256, 1000 steps) except the rank: 16 (the paper uses
1000, i.e. the full hidden size of its models; on the embedded model rank 16 detoxified more
per unit of perplexity than rank 64, steers/README.md). ``rank=None`` is the full hidden size.

"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

ENV_DATA = "VLLM_STEER_DATA"

DTypeName = Literal["auto", "float32", "bfloat16", "float16"]


def default_data_dir() -> str:
    """``$VLLM_STEER_DATA``, else ``../shared/data`` relative to the repository root."""
    if os.environ.get(ENV_DATA):
        return os.environ[ENV_DATA]
    return str(Path(__file__).resolve().parents[3] / "shared" / "data")


@dataclass
class TrainConfig:
    """The training recipe. Every field is written to the steer file's ``recipe``."""

    model: str = "smollm2"
    """Base model: a Hugging Face folder or id, or ``smollm2`` (the embedded model)."""
    rank: int | None = 16
    """Rank of the style steer ``W = P2 P1^T``; ``None`` = full (the hidden size, the
    paper's). Values above the hidden size are capped at it."""
    domain_rank: int | None = None
    """Rank of the domain ("dummy") steer ``D`` trained alongside; ``None`` = same as
    ``rank``; 0 = no domain steer."""
    epsilon: float = 1e-3
    """Unit of strength ``eps0``: training applies ``c + eps0 (s W + D) c`` with s = +1 for
    positive and -1 for negative texts."""
    init_std: float = 1e-2
    """Standard deviation of the initial factors (the paper's ``init_var``: ``randn * 1e-2``).
    Both factors start small, so the steer starts near zero; Adam's normalised updates move
    it anyway (see docs/training.md)."""
    lr: float = 1e-2
    """Adam learning rate."""
    steps: int = 1000
    """Optimiser steps (one batch each)."""
    batch_size: int = 32
    """Texts per step, drawn from both sides shuffled together."""
    max_length: int = 256
    """Tokens kept per text; longer texts are truncated (counted and reported). Must not
    exceed the model's context window."""
    domain_dropout: float = 0.0
    """Probability that a training text is seen without the domain steer (D off for that
    text), so that W also learns to work alone, as it is served (``domain="none"``).
    0 = the paper's recipe (D always on)."""
    regularization: float = 0.0
    """L2 penalty on all factors (the paper's ``--regularization``; 0 = off)."""
    seed: int = 0
    """Seed of the initial factors, the data split/subset and the batch order: the same seed
    gives the same steer."""
    device: str = "auto"
    """``auto`` (CUDA if available, else CPU), ``cpu``, ``cuda``, ``cuda:1``, ..."""
    model_dtype: DTypeName = "auto"
    """dtype of the frozen model when computing the hidden states once. ``auto`` = bfloat16
    where bf16 matmuls are fast (CUDA, a CPU with AVX512-BF16/AMX), else float32."""
    cache_dtype: DTypeName = "bfloat16"
    """dtype the cached hidden states are stored in (halves memory vs float32)."""
    head_dtype: DTypeName = "auto"
    """dtype of the output-head matmuls of each training step (accumulated and summed in
    float32). ``auto`` = bfloat16 where the hardware has fast bf16 matmuls (CUDA, or a CPU
    with AVX512-BF16/AMX), else float32. ``float32`` reproduces full-model training to
    rounding."""
    step_tokens: int | None = None
    """Target tokens per step: when a batch has more, a seeded uniform sample of this many of
    its target positions (a function of seed and step). The loss is their mean: an unbiased
    estimate of the batch's token-mean loss at a fraction of the head cost (the head matmul
    over the vocabulary dominates a step); more steps buy back the variance. ``None`` =
    every token (the paper's)."""
    train_strengths: tuple[float, ...] = (1.0,)
    """Strength magnitudes a training text is seen at, in units of ``epsilon``: each text of
    a step draws one of them uniformly (a function of seed and step), and is trained at
    ``+m`` (positive side) or ``-m`` (negative side). ``(1.0,)`` = the paper's recipe. Steers
    are served at several times the training strength (the paper generates at 5); a spread
    such as ``(1, 2, 4)`` also fits the file to the stronger settings, where the paper's
    recipe only extrapolates."""
    chunk_tokens: int = 1024
    """Tokens per head chunk inside a step (bounds the memory of the [tokens, vocab] logits;
    the gradient is the same for any value)."""
    cache_batch_tokens: int = 4096
    """Padded tokens per forward batch when computing the hidden states."""
    eval_every: int = 100
    """Steps between dev-loss evaluations (0 = only at the end)."""
    checkpoint_every: int = 100
    """Steps between checkpoints (0 = none; resume then restarts from the beginning)."""
    final_eval_max_texts: int = 256
    """Texts trained on (seeded sample) on which the final train loss is measured."""
    check_strengths: tuple[float, ...] = (1.0, 2.0, 3.0, 5.0, 10.0)
    """Strengths at which the final report measures dev losses (positive and negative texts
    at +s and -s versus s = 0, without the domain steer, as served)."""
    fluency_budget: float = 0.05
    """Rule for the recommended strength: the largest of ``check_strengths`` at which the dev
    texts of the side steered towards (positive at +s, negative at -s) lose at most this
    much (nats per token, 0.05 = about 5% perplexity) against s = 0."""
    chat_template: bool = False
    """Train on texts as chat replies: each text becomes the assistant turn of a one-turn
    conversation under the model's chat template, after the fixed user turn
    :data:`vllm_steer.train.hidden.CHAT_USER_TURN`; only the reply's tokens are targets (the
    templated prompt is context, its positions carry no loss). ``max_length`` then counts
    the reply's tokens. ``False`` = plain text, the paper's recipe."""

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["check_strengths"] = list(self.check_strengths)
        d["train_strengths"] = [float(m) for m in self.train_strengths]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "TrainConfig":
        d = dict(d)
        for k in ("check_strengths", "train_strengths"):
            if k in d:
                d[k] = tuple(d[k])
        return cls(**d)

    def validate(self) -> None:
        problems = []
        for name in ("steps", "batch_size", "max_length", "chunk_tokens", "cache_batch_tokens"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                problems.append(f"{name}={v!r}: must be a positive integer")
        if self.step_tokens is not None and (not isinstance(self.step_tokens, int)
                                             or self.step_tokens < 1):
            problems.append(f"step_tokens={self.step_tokens!r}: must be a positive integer "
                            "or None (every token)")
        if (not self.train_strengths or len(self.train_strengths) > 64
                or not all(isinstance(m, (int, float)) and math.isfinite(m) and 0 < m <= 100
                           for m in self.train_strengths)):
            problems.append(f"train_strengths={self.train_strengths!r}: give 1 to 64 "
                            "magnitudes in (0, 100], e.g. (1, 2, 4)")
        for name in ("eval_every", "checkpoint_every"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 0:
                problems.append(f"{name}={v!r}: must be an integer >= 0")
        if self.rank is not None and self.rank < 1:
            problems.append(f"rank={self.rank}: must be >= 1 (or None for full rank)")
        if self.domain_rank is not None and self.domain_rank < 0:
            problems.append(f"domain_rank={self.domain_rank}: must be >= 0 (0 = no domain steer)")
        problems += self._number_problems()
        if not 0 <= self.domain_dropout < 1:
            problems.append(f"domain_dropout={self.domain_dropout}: must be in [0, 1)")
        for name in ("model_dtype", "cache_dtype", "head_dtype"):
            v = getattr(self, name)
            if v not in ("auto", "float32", "bfloat16", "float16"):
                problems.append(f"{name}={v!r}: choose auto, float32, bfloat16 or float16")
        if problems:
            raise ValueError("invalid training configuration:\n" +
                             "\n".join(f"  - {p}" for p in problems))

    def _number_problems(self) -> list[str]:
        """What is wrong with the numbers of the recipe (finite, in range)."""
        # a recommended strength is one of the check strengths: what a steer file may hold
        from vllm_steer.format import MAX_EPSILON, MAX_META_STRENGTH, MIN_EPSILON

        problems = []
        for name in ("epsilon", "lr", "init_std"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and 0 < v < math.inf):
                problems.append(f"{name}={v!r}: must be a positive finite number")
        if not (self.check_strengths and all(
                isinstance(v, (int, float)) and 0 < v <= MAX_META_STRENGTH
                for v in self.check_strengths)):
            problems.append(f"check_strengths={self.check_strengths!r}: give strengths in "
                            f"(0, {MAX_META_STRENGTH:g}], e.g. (1, 2, 3, 5, 10): each is "
                            "checked at +s and -s, and the recommended strength is one of "
                            "them")
        if isinstance(self.epsilon, (int, float)) and self.epsilon > 0 and not (
                MIN_EPSILON <= self.epsilon <= MAX_EPSILON):
            problems.append(f"epsilon={self.epsilon!r}: must be from {MIN_EPSILON:g} to "
                            f"{MAX_EPSILON:g}, the range a steer file may hold")
        for name in ("fluency_budget", "regularization"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and 0 <= v < math.inf):
                problems.append(f"{name}={v!r}: must be a finite number >= 0")
        return problems


@dataclass
class DataConfig:
    """Where the texts come from and which side (positive = +strength, negative = -strength)
    each belongs to. Recorded in the steer file's ``data`` with each file's sha256."""

    positive: list[str] = field(default_factory=list)
    """Sources whose every text is positive (JSONL, CSV/TSV, Parquet, a Hugging Face dataset,
    or plain text)."""
    negative: list[str] = field(default_factory=list)
    """Files whose every text is negative."""
    labelled: list[str] = field(default_factory=list)
    """Sources with a text and a label per example: CSV/TSV/JSONL/Parquet files, or a Hugging
    Face dataset (a ``save_to_disk`` folder, or a name in the local cache; read offline).
    Labels map to sides by ``positive_labels`` / ``negative_labels`` / ``ignore_labels``."""
    dev_positive: list[str] = field(default_factory=list)
    """Held-out positive files (else the dev split is taken from the training texts)."""
    dev_negative: list[str] = field(default_factory=list)
    """Held-out negative files."""
    dev_labelled: list[str] = field(default_factory=list)
    """Held-out labelled files (same label rule)."""
    format: Literal["auto", "jsonl", "csv", "tsv", "parquet", "hf", "txt"] = "auto"
    """Source format; ``auto`` goes by extension (.jsonl/.json, .csv, .tsv, .parquet; a folder
    or a name that is no file = a Hugging Face dataset; any other file = plain text, one
    example per line)."""
    text_field: str | None = None
    """JSONL key or CSV/TSV column (name, or 0-based index) of the text. ``None``: ``text``
    (JSONL, CSV/TSV with header) or column 0 (no header)."""
    label_field: str | None = None
    """JSONL key or CSV/TSV column of the label (labelled files). ``None``: ``label`` or
    column 1 (no header)."""
    header: bool = True
    """CSV/TSV files start with a header row."""
    split: str = "train"
    """Split of a Hugging Face dataset with several (a ``DatasetDict``) read for training."""
    dev_split: str = "validation"
    """Split of the dev sources (``dev_labelled`` etc.) when they are such datasets."""
    positive_labels: list[str] = field(default_factory=list)
    """Label values (as strings) that make an example positive; also comparisons of numeric
    labels (``<0.1``, ``>=0.5``) and ``*`` (any)."""
    negative_labels: list[str] = field(default_factory=list)
    """Label values that make an example negative."""
    ignore_labels: list[str] = field(default_factory=list)
    """Label values skipped on purpose (e.g. SST-5's neutral 2). Any other label is an error."""
    dev_fraction: float = 0.1
    """Fraction of each side held out for the dev loss when no dev files are given."""
    dev_max_per_side: int = 200
    """At most this many dev texts per side (keeps evaluation cheap)."""
    max_examples: int | None = None
    """Training texts per side (seeded random subset); ``None`` = all."""
    preset: str | None = None
    """Name of the preset that filled this config (``detox``, ``sentiment``), for the record."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def validate(self) -> None:
        """Refuse the split and subset settings before any file is read, each naming its
        flag, the value and the rule."""
        problems = []
        f = self.dev_fraction
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0 <= f < 1:
            problems.append(f"--dev-fraction {f!r}: must be in [0, 1) (0: no dev split)")
        n = self.dev_max_per_side
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            problems.append(f"--dev-max {n!r}: must be an integer >= 1 (use --dev-fraction 0 "
                            "for no dev split)")
        m = self.max_examples
        if m is not None and (isinstance(m, bool) or not isinstance(m, int) or m < 1):
            problems.append(f"--max-examples {m!r}: must be an integer >= 1 (omit it for all "
                            "the texts)")
        if problems:
            raise ValueError("invalid training data settings:\n" +
                             "\n".join(f"  - {p}" for p in problems))


@dataclass
class VectorConfig:
    """The recipe of a vector steer (``vllm-steer train --kind vector``). Every field is
    written to the file's ``recipe``."""

    model: str = "smollm2"
    """Base model: a Hugging Face folder or id, or ``smollm2`` (the embedded model)."""
    method: Literal["pca", "caa"] = "pca"
    """``pca``: the first principal component of the paired differences (centred, unit
    norm, signed so that the positive side projects higher: repeng's default ``pca_diff``);
    ``caa``: the mean paired difference (contrastive activation addition; its norm is the
    separation's)."""
    layers: str | None = None
    """Decoder blocks (0-based) to make vectors for: ``1-29``, ``5,10,12-14`` or ``all``;
    ``None`` = every block but block 0 (1 to n-1: what llama.cpp can steer, repeng's
    default)."""
    max_length: int = 256
    """Tokens kept per text. The state is read at each text's own last token: a longer text
    keeps its end (and its beginning-of-sequence token), counted and reported."""
    max_pairs: int | None = None
    """Training pairs at most (a seeded subset); ``None`` = as many as the smaller side has."""
    seed: int = 0
    """Seed of the data split and subset."""
    device: str = "auto"
    """``auto`` (CUDA if available, else CPU), ``cpu``, ``cuda``, ``cuda:1``, ..."""
    model_dtype: DTypeName = "auto"
    """dtype of the frozen model's forward passes (``auto``: as for LM-Steer training)."""
    batch_tokens: int = 4096
    """Padded tokens per forward batch."""
    check_strengths: tuple[float, ...] | None = None
    """Strengths of the final dev check (dev texts' loss at +-s against 0, the vectors
    applied at every position); ``None``: fractions 0.01 to 0.1 of one mean difference per
    block (:func:`vllm_steer.train.vector.default_check_strengths`)."""
    fluency_budget: float | None = 0.05
    """Rule for the recommended strength, as for LM-Steer: the largest check strength at
    which the dev texts steered towards lose at most this many nats/token; ``None``: no dev
    check."""

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        if self.check_strengths is not None:
            d["check_strengths"] = [float(s) for s in self.check_strengths]
        return d

    def validate(self) -> None:
        problems = []
        if self.method not in ("pca", "caa"):
            problems.append(f"method={self.method!r}: choose pca or caa")
        for name in ("max_length", "batch_tokens"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                problems.append(f"{name}={v!r}: must be a positive integer")
        if self.max_pairs is not None and (not isinstance(self.max_pairs, int)
                                           or self.max_pairs < 2):
            problems.append(f"max_pairs={self.max_pairs!r}: must be an integer >= 2 or None")
        if self.model_dtype not in ("auto", "float32", "bfloat16", "float16"):
            problems.append(f"model_dtype={self.model_dtype!r}: choose auto, float32, bfloat16 "
                            "or float16")
        if self.check_strengths is not None and not (
                self.check_strengths and all(isinstance(s, (int, float)) and math.isfinite(s)
                                             and s > 0 for s in self.check_strengths)):
            problems.append(f"check_strengths={self.check_strengths!r}: give positive "
                            "strengths, e.g. (0.1, 0.2)")
        if self.fluency_budget is not None and not self.fluency_budget >= 0:
            problems.append(f"fluency_budget={self.fluency_budget}: must be >= 0")
        if problems:
            raise ValueError("invalid vector training configuration:\n" +
                             "\n".join(f"  - {p}" for p in problems))
