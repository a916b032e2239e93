"""The math, once, in pure torch. Everything else says "Semantics: see reference".

A *steer bank* holds K steers with factors concatenated along the rank axis::

    p1            [hidden, total_rank]   columns rank_offsets[k]:rank_offsets[k+1] are steer k's P1
    p2            [hidden, total_rank]   same for P2
    rank_offsets  K + 1 ints, rank_offsets[0] = 0, rank_offsets[K] = total_rank

and each row ``r`` of a batch carries a coefficient per steer, ``coefs[r, k]`` (already
multiplied by the steer's epsilon, so strength ``s`` gives ``s * eps``). The batched
steer operation is::

    out[r] = c[r] + sum_k coefs[r, k] * (c[r] @ P1_k) @ P2_k^T

computed with fp32 accumulation and returned in the dtype of ``c``. A row whose
coefficients are all zero is returned bit-identical to its input.

In the paper's notation (column vectors) this is ``c' = c + sum_i eps_i W_i c`` with
``W_i = P2_i P1_i^T``; the logits are then ``c'^T E`` from the unchanged LM head.

A request's coefficients come from its strengths by :func:`steer_coefficients`: strength
``s`` of a steer with epsilon ``eps`` is ``s * eps``; a steer served with its domain ("dummy")
component adds that component at ``domain_strength * eps`` whenever the steer is applied.

A *vector steer* (:mod:`vllm_steer.vectors`) acts on the residual stream instead: for each
decoder block ``k`` it has a vector ``v_{i,k}`` (or none), and a row steered at strengths
``a_i`` has::

    h_k[t] += sum_i a_i * v_{i,k}          for every position t of the row

added to the output of block ``k`` (its hidden state after the block's last residual add,
before the next block; llama.cpp's ``l_out``), so every later block, and the keys and values
they cache, see the steered state. :func:`vector_steer_reference` is that addition for one
block.
"""

from __future__ import annotations

from typing import Sequence

import torch


def steer_coefficients(strength: float, epsilon: float,
                       domain_strength: float | None = None) -> tuple[float, float]:
    """``(steer coefficient, domain coefficient)`` of one steer at ``strength``.

    ``domain_strength`` None: the steer is served without its domain component (0.0). A zero
    strength applies nothing, the domain component included.
    """
    if strength == 0:
        return 0.0, 0.0
    steer = float(strength) * epsilon
    return steer, (0.0 if domain_strength is None else domain_strength * epsilon)


def steer_coefficient_arrays(strength, epsilon, domain):
    """:func:`steer_coefficients` on numpy arrays that broadcast together: ``(strength *
    epsilon, domain where strength != 0 else 0)``, where ``domain`` is each steer's domain
    coefficient ``domain_strength * epsilon`` (0.0: served without it)."""
    import numpy as np

    strength = np.asarray(strength)
    return strength * epsilon, np.where(strength != 0, domain, 0.0)


def window_strengths(strength, base, start, end, ramp, t):
    """Strengths at generated-token indices ``t`` (numpy arrays that broadcast together):
    the vectorised :class:`vllm_steer.request.Window` rule. ``end < 0``: an open window;
    ``t < 0``: not a generated token (``base``)."""
    import numpy as np

    strength, base, start, end, ramp, t = (np.asarray(x) for x in (strength, base, start, end,
                                                                     ramp, t))
    inside = (t >= 0) & (t >= start) & ((end < 0) | (t < end))
    w = np.where(ramp > 0, np.clip((t - start + 1) / np.maximum(ramp, 1), 0.0, 1.0), 1.0)
    return np.where(inside, base + w * (strength - base), base).astype(np.float64)


def steer_reference(
    hidden: torch.Tensor,  # [num_rows, hidden]
    p1: torch.Tensor,  # [hidden, total_rank]
    p2: torch.Tensor,  # [hidden, total_rank]
    rank_offsets: Sequence[int],  # K + 1
    coefs: torch.Tensor,  # [num_rows, K] float32
) -> torch.Tensor:
    """``out[r] = c[r] + sum_k coefs[r,k] (c[r] P1_k) P2_k^T`` (fp32 math, input dtype out)."""
    offs = [int(o) for o in rank_offsets]
    num_rows, d = hidden.shape
    K = len(offs) - 1
    assert coefs.shape == (num_rows, K), (coefs.shape, (num_rows, K))
    assert p1.shape == p2.shape == (d, offs[-1]), (p1.shape, p2.shape, d, offs[-1])
    acc = torch.promote_types(hidden.dtype, torch.float32)  # fp32 accumulation (fp64 kept)
    c = hidden.to(acc)
    delta = torch.zeros_like(c)
    for k in range(K):
        a, b = offs[k], offs[k + 1]
        down = c @ p1[:, a:b].to(acc)  # [num_rows, r_k]
        delta += (coefs[:, k : k + 1].to(acc) * down) @ p2[:, a:b].to(acc).T
    out = (c + delta).to(hidden.dtype)
    untouched = (coefs == 0).all(dim=1)
    return torch.where(untouched[:, None], hidden, out)


def steer_dense_reference(hidden: torch.Tensor, matrices: Sequence[torch.Tensor],
                          coefs: torch.Tensor) -> torch.Tensor:
    """Same operation from dense ``W_k`` ([hidden, hidden], column form): ``c + sum eps W c``.

    Used by tests to check the factor form against the paper's formula.
    """
    acc = torch.promote_types(hidden.dtype, torch.float32)
    c = hidden.to(acc)
    out = c.clone()
    for k, w in enumerate(matrices):
        out += coefs[:, k : k + 1].to(acc) * (c @ w.to(acc).T)
    return out.to(hidden.dtype)


def steered_logits_reference(hidden: torch.Tensor, lm_head_weight: torch.Tensor,
                             p1, p2, rank_offsets, coefs, bias=None) -> torch.Tensor:
    """Logits ``(c + sum eps W c)^T E`` in fp32: what the serving path must reproduce."""
    h = steer_reference(hidden.float(), p1.float(), p2.float(), rank_offsets, coefs)
    logits = h @ lm_head_weight.float().T
    if bias is not None:
        logits = logits + bias.float()
    return logits


def vector_steer_reference(hidden: torch.Tensor,  # [num_rows, hidden]: block k's output
                           vectors: torch.Tensor,  # [K, hidden]: v_{i,k} (zeros: no vector)
                           coefs: torch.Tensor,  # [num_rows, K]: each row's strength a_i
                           ) -> torch.Tensor:
    """``out[r] = h[r] + sum_i coefs[r, i] * vectors[i]``: vector steers on one decoder
    block's output (fp32 math, input dtype out). A row whose coefficients are all zero is
    returned bit-identical to its input."""
    num_rows, d = hidden.shape
    K = vectors.shape[0]
    assert vectors.shape == (K, d), (vectors.shape, d)
    assert coefs.shape == (num_rows, K), (coefs.shape, (num_rows, K))
    acc = torch.promote_types(hidden.dtype, torch.float32)
    out = (hidden.to(acc) + coefs.to(acc) @ vectors.to(acc)).to(hidden.dtype)
    untouched = (coefs == 0).all(dim=1)
    return torch.where(untouched[:, None], hidden, out)
