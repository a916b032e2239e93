"""The trainable LM-Steer around a frozen Hugging Face causal LM.

Semantics: see :mod:`vllm_steer.reference`. Training treats the style steer ``W = P2 P1^T``
and the domain ("dummy") steer ``D = Q2 Q1^T`` as a two-steer bank; a final hidden state
row ``c`` of a text on side ``s`` (+1 positive, -1 negative) becomes::

    c' = c + eps0 * s * (c @ P1) @ P2.T + eps0 * (c @ Q1) @ Q2.T      (coefs [s*eps0, eps0])

and the logits are ``head(c')`` (the model's own output head: untied weights and a bias are
kept; known logit post-processing, softcapping and scaling, is applied as the model does).

Two ways to compute the same loss:

- :meth:`LMSteer.full_loss`: through the whole model (a forward pre-hook on the output head,
  as the paper's code), for checking and for the benchmark baseline;
- :meth:`LMSteer.loss_backward`: from cached final hidden states (the body is frozen, so
  they never change); a step then costs only the head. The steer's part of the logits is
  computed as ``U @ (P2^T E^T)`` with ``U = [s eps0 c P1, eps0 c Q1]`` when the rank is small
  (re-association of the same product), and the base logits ``c E^T`` optionally in
  bfloat16 (fp32 accumulate and sum).
"""

from __future__ import annotations

import contextlib
import functools
import os
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from vllm_steer.format import Steer, make_steer
from vllm_steer.hf import logit_postprocess, output_head
from vllm_steer.reference import steer_reference

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@functools.lru_cache(maxsize=None)
def cpu_has_fast_bf16() -> bool:
    """AVX512-BF16 or AMX-BF16 on this CPU (Linux ``/proc/cpuinfo``)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {name}: CUDA is not available here; use --device cpu")
    return dev


def resolve_dtype(name: str, device: torch.device, what: str = "dtype") -> torch.dtype:
    """``auto`` = bfloat16 where bf16 matmuls are fast (CUDA, AVX512-BF16/AMX CPUs), else fp32."""
    if name == "auto":
        fast = (torch.cuda.is_bf16_supported() if device.type == "cuda"
                else device.type == "cpu" and cpu_has_fast_bf16())
        return torch.bfloat16 if fast else torch.float32
    if name not in _DTYPES:
        raise ValueError(f"{what}={name!r}: choose auto, float32, bfloat16 or float16")
    return _DTYPES[name]


def dtype_name(dt: torch.dtype) -> str:
    return str(dt).replace("torch.", "")


class Head:
    """The model's output head as a function of the final hidden state (frozen)."""

    def __init__(self, model):
        head = output_head(model)
        self.module = head
        self.weight: torch.Tensor = head.weight.detach()  # [vocab, hidden]
        b = getattr(head, "bias", None)
        self.bias: torch.Tensor | None = None if b is None else b.detach().float()
        #: the model's soft-cap or logit scaling (None: none)
        self.postprocess = logit_postprocess(model)
        self._w: dict[torch.dtype, torch.Tensor] = {}

    @property
    def hidden_size(self) -> int:
        return int(self.weight.shape[1])

    @property
    def vocab_size(self) -> int:
        return int(self.weight.shape[0])

    def w(self, dtype: torch.dtype) -> torch.Tensor:
        if dtype not in self._w:
            self._w[dtype] = self.weight.to(dtype).contiguous()
        return self._w[dtype]

    def post(self, logits: torch.Tensor) -> torch.Tensor:
        """Bias and the model's logit post-processing, on float32 logits."""
        if self.bias is not None:
            logits = logits + self.bias
        return logits if self.postprocess is None else self.postprocess(logits)

    def logits(self, c: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Unsteered logits, float32."""
        return self.post(F.linear(c.to(dtype), self.w(dtype)).float())


class LMSteer(nn.Module):
    """A frozen causal LM with a trainable style steer (P1, P2) and domain steer (Q1, Q2)
    acting on the output head's input. Factors are float32, ``[hidden, rank]``, row
    convention ``c' = c + eps0 * (c @ P1) @ P2.T``."""

    def __init__(self, model, rank: int | None = None, domain_rank: int | None = None,
                 epsilon: float = 1e-3, init_std: float = 1e-2, seed: int = 0):
        super().__init__()
        for p in model.parameters():
            p.requires_grad_(False)
        self.model = model
        self.head = Head(model)
        d = self.head.hidden_size
        r = d if rank is None else min(int(rank), d)
        rd = r if domain_rank is None else min(int(domain_rank), d)
        self.epsilon = float(epsilon)
        dev = self.head.weight.device
        g = torch.Generator().manual_seed(int(seed))
        mk = lambda k: nn.Parameter((torch.randn(d, k, generator=g) * init_std).to(dev))  # noqa
        self.p1, self.p2 = mk(r), mk(r)
        if rd > 0:
            self.q1, self.q2 = mk(rd), mk(rd)
        else:
            self.q1 = self.q2 = None

    # ------------------------------------------------------------------ shapes and factors
    @property
    def hidden_size(self) -> int:
        return self.head.hidden_size

    @property
    def rank(self) -> int:
        return int(self.p1.shape[1])

    @property
    def domain_rank(self) -> int:
        return 0 if self.q1 is None else int(self.q1.shape[1])

    def factor_params(self) -> list[nn.Parameter]:
        return [p for p in (self.p1, self.p2, self.q1, self.q2) if p is not None]

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:  # the steer only
        return iter(self.factor_params())

    def bank(self) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """``(p1, p2, rank_offsets)`` of the two-steer bank [style, domain]."""
        if self.q1 is None:
            return self.p1, self.p2, [0, self.rank]
        return (torch.cat([self.p1, self.q1], 1), torch.cat([self.p2, self.q2], 1),
                [0, self.rank, self.rank + self.domain_rank])

    def coefs(self, signs: torch.Tensor, domain: "float | torch.Tensor" = 1.0) -> torch.Tensor:
        """Per-row bank coefficients ``[s * eps0, domain * eps0]`` (float32); ``domain`` is
        a number or a per-row tensor."""
        s = signs.float().reshape(-1, 1) * self.epsilon
        if self.q1 is None:
            return s
        if torch.is_tensor(domain):
            dcol = domain.to(s.device).float().reshape(-1, 1) * self.epsilon
        else:
            dcol = torch.full_like(s, domain * self.epsilon)
        return torch.cat([s, dcol], 1)

    def steer_hidden(self, c: torch.Tensor, signs: torch.Tensor, domain: float = 1.0
                     ) -> torch.Tensor:
        """``c'`` for rows ``c`` [N, hidden] with per-row style strengths ``signs`` [N]
        (float32 out). Semantics: see reference."""
        p1, p2, offs = self.bank()
        return steer_reference(c.float(), p1, p2, offs, self.coefs(signs.to(c.device), domain))

    # --------------------------------------------------------------------- cached-state path
    def route(self, head_dtype: torch.dtype) -> str:
        """How a step computes the steered logits (same values, different association):

        ``lowrank``: ``[c, U] @ [E, M^T]^T`` with ``U = [s eps0 c P1, eps0 c Q1]`` and
        ``M = [P2, Q2]^T E^T`` (cheap when the total rank R is small);
        ``dense``: through ``dc = U [P2, Q2]^T``: ``(c + dc) E^T`` in float32, or
        ``[c, dc] @ [E, E]^T`` in bfloat16 so that the small ``dc`` is not rounded into ``c``.
        Cost in units of ``tokens x vocab`` multiply-adds: lowrank d + 3R, dense 2d (fp32) or
        3d (bf16)."""
        R, d = self.rank + self.domain_rank, self.hidden_size
        dense_cost = 2 * d if head_dtype == torch.float32 else 3 * d
        return "lowrank" if d + 3 * R < dense_cost else "dense"

    def _u(self, c32: torch.Tensor, signs: torch.Tensor, domain: float) -> torch.Tensor:
        coefs = self.coefs(signs, domain)
        parts = [(c32 @ self.p1) * coefs[:, :1]]
        if self.q1 is not None:
            parts.append((c32 @ self.q1) * coefs[:, 1:2])
        return torch.cat(parts, 1) if len(parts) > 1 else parts[0]

    def _p2cat(self) -> torch.Tensor:
        return self.p2 if self.q2 is None else torch.cat([self.p2, self.q2], 1)

    def steer_logits_matrix(self, head_dtype: torch.dtype) -> torch.Tensor:
        """``M = [P2, Q2]^T E^T`` [rank_total, vocab] (differentiable w.r.t. P2, Q2)."""
        return self._p2cat().T.to(head_dtype) @ self.head.w(head_dtype).T

    def logits(self, c: torch.Tensor, signs: torch.Tensor, head_dtype: torch.dtype = torch.float32,
               domain: float = 1.0) -> torch.Tensor:
        """Steered logits (float32, differentiable) of rows ``c`` [N, hidden]: the plain
        autograd form ``head(steer_hidden(c))``, with the base logits in ``head_dtype``."""
        if head_dtype == torch.float32:
            return self.head.post(F.linear(self.steer_hidden(c, signs, domain),
                                           self.head.w(torch.float32)))
        with torch.no_grad():
            base = F.linear(c.to(head_dtype), self.head.w(head_dtype)).float()
        dc = self._u(c.float(), signs, domain) @ self._p2cat().T
        delta = F.linear(dc.to(head_dtype), self.head.w(head_dtype)).float()
        return self.head.post(base + delta)

    def strength_nll(self, c: torch.Tensor, targets: torch.Tensor, strengths, *,
                     head_dtype: torch.dtype = torch.float32, chunk_tokens: int = 512
                     ) -> list[float]:
        """Summed NLL of ``targets`` given rows ``c`` with the style steer alone (no domain,
        as served) at each of ``strengths`` (one float per strength; no gradient).

        The steered hidden state is linear in the strength, so the pre-processing logits are
        ``c E^T + s (eps c P1 P2^T) E^T``: two head GEMMs per chunk serve every strength (a
        dev check at 11 strengths costs about 2 forward passes, not 11)."""
        sums = [0.0] * len(strengths)
        hd = head_dtype
        w = self.head.w(hd)
        with torch.no_grad():
            for a in range(0, int(c.shape[0]), chunk_tokens):
                cc, tt = c[a:a + chunk_tokens], targets[a:a + chunk_tokens]
                dc = ((cc.float() @ self.p1) * self.epsilon) @ self.p2.T
                base = F.linear(cc.to(hd), w).float()
                delta = F.linear(dc.to(hd), w).float()
                for k, st in enumerate(strengths):
                    z = self.head.post(torch.add(base, delta, alpha=float(st)))
                    nll = torch.logsumexp(z, 1) - z.gather(1, tt[:, None])[:, 0]
                    sums[k] += float(nll.double().sum())
        return sums

    def _fusable(self) -> bool:
        return self.head.postprocess is None

    def loss_backward(self, c: torch.Tensor, targets: torch.Tensor, signs: torch.Tensor, *,
                      head_dtype: torch.dtype = torch.float32, chunk_tokens: int = 1024,
                      domain: float = 1.0, backward: bool = True) -> float:
        """Token-mean cross-entropy of ``targets`` [N] given rows ``c`` [N, hidden]; with
        ``backward`` the gradient is accumulated into the factors. Returns the loss.

        Chunked over rows (the same gradient for any chunk size). The [rows, vocab] work is
        done by hand, in place, in ``head_dtype`` (one GEMM, max, exp, fp32 row sums, the
        softmax gradient) and only the small tensors go through autograd."""
        n = int(c.shape[0])
        if n == 0:
            return float("nan")
        if not self._fusable():
            return self._loss_backward_autograd(c, targets, signs, head_dtype, chunk_tokens,
                                                domain, backward)
        hd = head_dtype
        route = self.route(hd)
        w = self.head.w(hd)
        bias = None if self.head.bias is None else self.head.bias.to(hd)
        total = 0.0
        with torch.set_grad_enabled(backward):
            m = None
            if route == "lowrank":
                m = self.steer_logits_matrix(hd)  # [R, V], graph to P2/Q2
                m_hd = m.detach()
                b_mat = torch.cat([w, m_hd.T], 1)  # [V, d + R]
                dm = (torch.zeros(m.shape, dtype=torch.float32, device=m.device) if backward
                      else None)
            elif hd == torch.float32:
                b_mat = w
            else:
                b_mat = torch.cat([w, w], 1)  # [V, 2d]: c and dc kept apart in bf16
            for a in range(0, n, chunk_tokens):
                e = min(n, a + chunk_tokens)
                cc, tt = c[a:e], targets[a:e]
                dom = domain[a:e] if torch.is_tensor(domain) else domain
                u = self._u(cc.float(), signs[a:e], dom)  # [n, R] fp32, graph to P1/Q1
                if route == "lowrank":
                    small = u
                    u_hd = u.detach().to(hd)
                    a_mat = torch.cat([cc.to(hd), u_hd], 1)
                else:
                    small = u @ self._p2cat().T  # dc [n, d], graph to P1/Q1/P2/Q2
                    if hd == torch.float32:
                        a_mat = cc.float() + small.detach()
                    else:
                        a_mat = torch.cat([cc.to(hd), small.detach().to(hd)], 1)
                with torch.no_grad():
                    z = a_mat @ b_mat.T  # [n, V] logits in hd
                    if bias is not None:
                        z += bias
                    zt = z.gather(1, tt[:, None]).float()[:, 0]
                    mx = z.amax(1, keepdim=True)
                    z.sub_(mx).exp_()
                    se = z.sum(1).float()  # accumulated in fp32 inside; rounded once to hd
                    total += float((mx.float()[:, 0] + se.log() - zt).sum()) / n
                if not backward:
                    continue
                with torch.no_grad():
                    z.mul_((1.0 / se).to(hd)[:, None])  # softmax
                    z[torch.arange(e - a, device=z.device), tt] -= 1  # dloss_sum / dlogits
                    if route == "lowrank":
                        g_small = (z @ m_hd.T).float() / n
                        dm += u_hd.T @ z
                    else:
                        g_small = (z @ w).float() / n
                torch.autograd.backward(small, g_small)
            if backward and m is not None:
                torch.autograd.backward(m, (dm / n).to(m.dtype))
        return total

    def _loss_backward_autograd(self, c, targets, signs, head_dtype, chunk_tokens, domain,
                                backward) -> float:
        n = int(c.shape[0])
        total = 0.0
        with torch.set_grad_enabled(backward):
            for a in range(0, n, chunk_tokens):
                b = min(n, a + chunk_tokens)
                dom = domain[a:b] if torch.is_tensor(domain) else domain
                lg = self.logits(c[a:b], signs[a:b], head_dtype, dom)
                loss = F.cross_entropy(lg, targets[a:b], reduction="sum") / n
                if backward:
                    loss.backward()
                total += float(loss.detach())
        return total

    def regularization(self) -> torch.Tensor:
        return sum(p.pow(2).sum() for p in self.factor_params())

    # ------------------------------------------------------------------- full-model path
    @contextlib.contextmanager
    def hooked(self, row_signs: torch.Tensor, domain: float = 1.0):
        """Inside the block the model's forward applies the steer, per batch row."""
        def pre_hook(_module, args):
            (h, *rest) = args
            B, d = h.shape[0], h.shape[-1]
            per_row = h[0].numel() // d
            s = row_signs.to(h.device).float().reshape(B, 1).expand(B, per_row).reshape(-1)
            out = self.steer_hidden(h.reshape(-1, d), s, domain).to(h.dtype).reshape(h.shape)
            return (out, *rest)

        handle = self.head.module.register_forward_pre_hook(pre_hook)
        try:
            yield self.model
        finally:
            handle.remove()

    def full_loss(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                  row_signs: torch.Tensor, domain: float = 1.0) -> torch.Tensor:
        """Token-mean causal-LM cross-entropy through the whole model (padding masked)."""
        with self.hooked(row_signs, domain):
            logits = self.model(input_ids=input_ids, attention_mask=attention_mask).logits
        lg = logits[:, :-1].float()
        tgt = input_ids[:, 1:]
        mask = attention_mask[:, 1:].bool()
        return F.cross_entropy(lg[mask], tgt[mask], reduction="mean")

    # ---------------------------------------------------------------------------- export
    def to_steer(self, name: str, **meta) -> Steer:
        f = lambda t: None if t is None else t.detach().float().cpu().contiguous()  # noqa
        return make_steer(f(self.p1), f(self.p2), name, epsilon=self.epsilon,
                          domain_p1=f(self.q1), domain_p2=f(self.q2), **meta)

    def load_factors(self, state: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for k in ("p1", "p2", "q1", "q2"):
                p = getattr(self, k)
                if p is None:
                    continue
                if state[k].shape != p.shape:
                    raise ValueError(f"checkpoint factor {k} has shape {tuple(state[k].shape)}, "
                                     f"the steer being trained {tuple(p.shape)}")
                p.copy_(state[k])

    def factor_state(self) -> dict[str, torch.Tensor]:
        return {k: getattr(self, k).detach().cpu().clone()
                for k in ("p1", "p2", "q1", "q2") if getattr(self, k) is not None}


def load_model(name_or_path: str, device: torch.device, dtype: torch.dtype):
    """(model, tokenizer, resolved path) for a name, path or ``smollm2``; frozen, eval mode."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from vllm_steer.models import looks_like_a_path, resolve_model

    path = resolve_model(name_or_path)
    if not os.path.exists(path) and looks_like_a_path(name_or_path):
        raise FileNotFoundError(f"--model {name_or_path}: no such folder")
    if os.path.isfile(path) or (os.path.isdir(path)
                                and not os.path.isfile(os.path.join(path, "config.json"))):
        raise FileNotFoundError(f"--model {name_or_path}: not a model folder (no config.json "
                                "in it); give a Hugging Face model folder or id")
    if os.path.isdir(path):  # recorded in the steer as its base model: valid from any folder
        path = os.path.abspath(path)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model, tok, path
