"""The lens: a learned steer read as a lens on the model (docs/lens.md).

- :mod:`~vllm_steer.lens.transfer`  move a steer to another model through the output embeddings
- :mod:`~vllm_steer.lens.highlight` per-token evidence of a steer in a text and its best spans
  (the span search and renderers import neither torch nor transformers)
- :mod:`~vllm_steer.lens.explain`   tokens along the steer's top singular directions
- :mod:`~vllm_steer.lens.score`     which strength best explains a text (zero-shot classifier)
- :mod:`~vllm_steer.lens.lm`        loading, final hidden states, log-likelihoods at strengths
- :mod:`~vllm_steer.lens.cli`       ``vllm-steer transfer | highlight | explain | score``

Importing this package imports nothing heavy.
"""
