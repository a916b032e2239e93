"""Scorer registries: text -> number, pluggable by name.

Two kinds, each a registry of factories (called once, lazily, when a run needs the scorer):

- ``toxicity``: ``score(texts) -> list[float]``, the probability that each text is toxic
  (built in: ``profanity-check``, see :mod:`vllm_steer.eval.toxicity`, and
  ``minilm-jigsaw``, see :mod:`vllm_steer.eval.minilm`);
- ``sentiment``: ``score(texts) -> list[float]``, the probability that each text is positive
  (built in: ``sst2`` and ``vader``; see :mod:`vllm_steer.eval.sentiment`).

Plugging in your own scorer is one call::

    from vllm_steer.eval import register_scorer

    class Perspective:
        name = "perspective"
        def score(self, texts):          # -> list[float] in [0, 1]
            ...

    register_scorer("toxicity", "perspective", Perspective)

and then ``vllm-steer eval toxicity --toxicity-scorer perspective`` (or, without writing a
registration, ``--toxicity-scorer my_module:Perspective``, which imports and registers it).
"""

from __future__ import annotations

import importlib
from typing import Callable, Protocol, Sequence, runtime_checkable

KINDS = ("toxicity", "sentiment")


@runtime_checkable
class TextScorer(Protocol):
    """What every scorer is: a name and a batch ``score``."""

    name: str

    def score(self, texts: Sequence[str]) -> list[float]:
        """One probability in [0, 1] per text (toxic, or positive), in order."""
        ...


Factory = Callable[[], TextScorer]
_REGISTRY: dict[str, dict[str, Factory]] = {k: {} for k in KINDS}
_INSTANCES: dict[tuple[str, str], TextScorer] = {}


def _check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"unknown scorer kind {kind!r}; choose one of {', '.join(KINDS)}")


def register_scorer(kind: str, name: str, factory: Factory, *, overwrite: bool = False) -> None:
    """Register ``factory`` (a class or a zero-argument callable returning an object with
    ``score(texts) -> list[float]``) as scorer ``name`` of ``kind``."""
    _check_kind(kind)
    if not callable(factory):
        raise TypeError(f"scorer {name!r}: the factory must be callable (a class or a function "
                        f"returning a scorer), got {type(factory).__name__}")
    if name in _REGISTRY[kind] and _REGISTRY[kind][name] is not factory and not overwrite:
        raise ValueError(f"a {kind} scorer named {name!r} is already registered; pass "
                         "overwrite=True to replace it")
    _REGISTRY[kind][name] = factory
    _INSTANCES.pop((kind, name), None)


def available(kind: str) -> list[str]:
    """Registered scorer names of ``kind``."""
    _check_kind(kind)
    _load_builtins()
    return sorted(_REGISTRY[kind])


class UnknownScorerError(KeyError, ValueError):
    """A scorer name that is not registered (a ``KeyError`` of the registry, and the bad
    value of a command-line flag: the CLI prints its message as one line)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


def get_scorer(kind: str, name: str) -> TextScorer:
    """The scorer ``name`` of ``kind`` (built once, then reused). ``module:attr`` imports
    ``attr`` from ``module`` and registers it under that name first."""
    _check_kind(kind)
    _load_builtins()
    if name not in _REGISTRY[kind] and ":" in name:
        mod_name, _, attr = name.partition(":")
        try:
            factory = getattr(importlib.import_module(mod_name), attr)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"{kind} scorer {name!r}: cannot import {attr!r} from module "
                             f"{mod_name!r} ({e})") from None
        register_scorer(kind, name, factory)
    if name not in _REGISTRY[kind]:
        raise UnknownScorerError(f"unknown {kind} scorer {name!r}; registered: "
                       f"{', '.join(sorted(_REGISTRY[kind])) or 'none'} (register yours with "
                       f"vllm_steer.eval.register_scorer({kind!r}, {name!r}, Factory), or give "
                       "module:Class)")
    key = (kind, name)
    if key not in _INSTANCES:
        scorer = _REGISTRY[kind][name]()
        if not callable(getattr(scorer, "score", None)):
            raise TypeError(f"{kind} scorer {name!r}: the factory returned "
                            f"{type(scorer).__name__}, which has no score(texts) method")
        _INSTANCES[key] = scorer
    return _INSTANCES[key]


def score_texts(kind: str, name: str, texts: Sequence[str]) -> list[float]:
    """Score ``texts`` with scorer ``name``; checks the scorer returned one number per text."""
    scorer = get_scorer(kind, name)
    out = [float(x) for x in scorer.score(list(texts))]
    if len(out) != len(texts):
        raise ValueError(f"{kind} scorer {name!r} returned {len(out)} scores for {len(texts)} "
                         "texts; score(texts) must return one number per text")
    return out


#: The built-in scorers, by kind and name: ``module:attribute`` of their factories, imported
#: only when a run first builds one. The registry imports its scorers lazily and they do not
#: import it (no import cycle).
BUILTINS: dict[str, dict[str, str]] = {
    "toxicity": {"profanity-check": "vllm_steer.eval.toxicity:ProfanityCheckScorer",
                 "minilm-jigsaw": "vllm_steer.eval.minilm:minilm_jigsaw_scorer"},
    "sentiment": {"sst2": "vllm_steer.eval.sentiment:sst2_scorer",
                  "vader": "vllm_steer.eval.sentiment:VaderScorer"},
}


class _Lazy:
    """A factory that imports the built-in ``module:attribute`` when first called."""

    def __init__(self, target: str):
        self.target = target

    def __call__(self) -> TextScorer:
        module, _, attr = self.target.partition(":")
        return getattr(importlib.import_module(module), attr)()


def _load_builtins() -> None:
    """Register the built-ins that are not registered yet (a few dict entries: cheap)."""
    for kind, table in BUILTINS.items():
        for name, target in table.items():
            _REGISTRY[kind].setdefault(name, _Lazy(target))
