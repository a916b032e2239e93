"""The decoder layers' op: per-token vector steers added to a block's output, inside the
model's compiled forward. Semantics: see :func:`vllm_steer.reference.vector_steer_reference`.

``out[t] = h[t] + token_coefs[t] @ vectors`` for the ``n`` tokens of the call, where
``token_coefs`` is the step mapping's persistent ``[max_tokens, bank slots]`` float32 buffer
(row ``t``: token ``t``'s strength of each vector steer; zero for unsteered and padding tokens)
and ``vectors`` the vector bank's ``[bank slots, hidden]`` rows of this block, both float32
(or, on CUDA, the model's 16-bit dtype: the GEMM runs on the tensor cores, accumulating in
fp32).

Capture-safe by construction: it reads the two persistent buffers in place (their storage
never changes), its shapes depend only on the number of tokens, and nothing goes back to the
host; so the graph vLLM compiles and captures computes each step's tokens with that step's
coefficients. A token whose row is all zeros keeps ``h``, the same bits (``-0.0`` too), in
fp32, bf16 and fp16.
"""

from __future__ import annotations

import torch


def add_vectors(hidden: torch.Tensor,  # [..., n, hidden]: a block's output (or residual)
                token_coefs: torch.Tensor,  # [>= n, slots] fp32 (or 16-bit): per-token strengths
                vectors: torch.Tensor,  # [slots, hidden], token_coefs' dtype: this block's
                ) -> torch.Tensor:
    """``hidden + token_coefs[:n] @ vectors``, accumulated in fp32, in ``hidden``'s dtype
    (``hidden`` may have leading dimensions, as a transformers block's ``[1, n, hidden]``:
    its rows are the step's tokens in order)."""
    flat = hidden.reshape(-1, hidden.shape[-1])
    n = flat.shape[0]
    coefs = token_coefs[:n]
    delta = torch.mm(coefs, vectors)  # fp32, or the model's 16-bit dtype on CUDA
    out = (flat.float() + delta.float()).to(hidden.dtype)
    # an unsteered token keeps its very bits (h + 0.0 would turn -0.0 into +0.0); fused with
    # the add by the compiler, it costs no extra pass there
    steered = (coefs != 0).any(dim=1, keepdim=True)
    return torch.where(steered, out, flat).reshape(hidden.shape)


def add_to_block_output(out, token_coefs: torch.Tensor, vectors: torch.Tensor,
                        stream_first: bool = False):
    """The op on a decoder block's return value, whatever its family returns: the residual
    stream after the block is ``hidden_states + residual`` for a vLLM block that returns the
    pair (Llama, Qwen, Gemma 2: the vector goes into the residual, which the next block's fused
    add-norm sums), and the tensor itself for one that returns the stream (GPT-2, GPT-J, OPT).
    ``stream_first``: a transformers block (vLLM's Transformers backend), whose tuple starts
    with the stream (the rest: attention weights, caches)."""
    if isinstance(out, tuple) and stream_first:
        return (add_vectors(out[0], token_coefs, vectors), *out[1:])
    if isinstance(out, tuple):
        if len(out) >= 2 and isinstance(out[1], torch.Tensor):
            return (out[0], add_vectors(out[1], token_coefs, vectors), *out[2:])
        return (add_vectors(out[0], token_coefs, vectors), *out[1:])
    return add_vectors(out, token_coefs, vectors)


__all__ = ["add_vectors", "add_to_block_output"]
