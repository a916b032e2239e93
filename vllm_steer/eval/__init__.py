"""Paper-style evaluation of steers through vLLM (see docs/eval.md).

- :mod:`~vllm_steer.eval.harness`: one run (prompts -> conditions -> samples -> metrics -> files)
- :mod:`~vllm_steer.eval.generation`: conditions and sampling through ``vllm.LLM`` with the plugin
- :mod:`~vllm_steer.eval.toxicity`, :mod:`~vllm_steer.eval.sentiment`: scorers and metrics
- :mod:`~vllm_steer.eval.fluency` (perplexity), :mod:`~vllm_steer.eval.diversity` (dist-n)
- :mod:`~vllm_steer.eval.scorers`: the pluggable scorer registry (:func:`register_scorer`)
- :mod:`~vllm_steer.eval.minilm` (and :mod:`~vllm_steer.eval.minilm_train`): the
  ``minilm-jigsaw`` toxicity scorer and the training of its file
- :mod:`~vllm_steer.eval.agreement`: toxicity scorers against Perspective's scores
- :mod:`~vllm_steer.eval.rescore`: a finished run's samples scored by another scorer
- :mod:`~vllm_steer.eval.soft_blacklist` and :mod:`~vllm_steer.eval.logits_processor`: the
  soft-blacklist baseline and its vLLM logits processor
- :mod:`~vllm_steer.eval.report`, :mod:`~vllm_steer.eval.plots`: Markdown, comparison, figures
"""

from vllm_steer.eval.scorers import available, get_scorer, register_scorer

__all__ = ["register_scorer", "get_scorer", "available"]
