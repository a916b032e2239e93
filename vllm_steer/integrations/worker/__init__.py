"""The worker process (vLLM's model runner): the steered LM head, the per-slot coefficients,
the rows of each step (V1, Model Runner V2, prompt logprobs, speculative decoding).
Semantics: see :mod:`vllm_steer.reference`."""
