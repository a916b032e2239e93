"""Offline steer training (no vLLM import anywhere here).

- :mod:`~vllm_steer.train.config`: the recipe and data dataclasses;
- :mod:`~vllm_steer.train.data`: JSONL/CSV/TSV/text inputs, presets, dev split;
- :mod:`~vllm_steer.train.hidden`: final hidden states computed once and cached;
- :mod:`~vllm_steer.train.module`: the trainable steer around a frozen HF causal LM;
- :mod:`~vllm_steer.train.trainer`: the training loop, checkpoints, the steer file;
- :mod:`~vllm_steer.train.convert`: import of checkpoints of the paper's code;
- :mod:`~vllm_steer.train.cli`: ``vllm-steer train`` and ``vllm-steer convert``.
"""
