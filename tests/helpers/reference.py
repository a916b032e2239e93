"""The independent reference the engine tests compare against: the paper's formula applied
by hand in plain torch on a transformers model's own weights."""

from __future__ import annotations

import pytest


def decoder_blocks(model):
    """A transformers model's decoder blocks, found by hand by each family's own attribute
    path (no vllm_steer code)."""
    for path in ("transformer.h", "gpt_neox.layers", "model.decoder.layers", "model.layers"):
        obj = model
        try:
            for part in path.split("."):
                obj = getattr(obj, part)
        except AttributeError:
            continue
        return obj
    raise AssertionError(f"no decoder blocks in {type(model).__name__}")


class HFReference:
    """Plain-torch reference from a model's own weights (transformers): the paper's formula
    applied by hand on the LM head's input, ``c + sum_i s_i eps_i (c P1_i) P2_i^T``, with no
    vllm_steer code on the path. For engine tests (greedy tokens, logprobs)."""

    def __init__(self, model_dir, steers: dict, vectors: dict | None = None):
        import torch
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.steers = steers  # name -> Steer (p1, p2, metadata.epsilon)
        # name -> {decoder block k (0-based): [hidden] vector added to block k's output}
        self.vectors = vectors or {}

    def logprobs(self, ids: list[int], strengths: dict | None = None):
        """log-softmax of the next-token logits at every position of ``ids`` ([len, vocab]).
        A vector steer's strength is a number (every position) or a list (one per position
        of ``ids``): ``a * v_k`` is added to the output of block ``k`` at that position."""
        import torch

        strengths = strengths or {}
        head = {n: s for n, s in strengths.items() if n in self.steers}

        def pre_hook(_module, args):
            c = args[0]
            out = c.clone()
            for name, s in head.items():
                st = self.steers[name]
                out = out + s * st.metadata.epsilon * (c @ st.p1.float()) @ st.p2.float().T
            return (out, *args[1:])

        def block_hook(k):
            def hook(_module, _args, output):
                h = output[0] if isinstance(output, tuple) else output
                delta = torch.zeros(h.shape[-2], h.shape[-1])
                for name, a in strengths.items():
                    v = self.vectors.get(name, {}).get(k)
                    if v is None:
                        continue
                    a = torch.tensor(a if isinstance(a, list) else [a] * h.shape[-2],
                                     dtype=torch.float32)
                    delta = delta + a[:, None] * v.float()[None, :]
                h = h + delta
                return (h, *output[1:]) if isinstance(output, tuple) else h
            return hook

        handles = [self.model.lm_head.register_forward_pre_hook(pre_hook)]
        if any(n in self.vectors for n in strengths):
            handles += [b.register_forward_hook(block_hook(k))
                        for k, b in enumerate(decoder_blocks(self.model))]
        try:
            with torch.no_grad():
                logits = self.model(torch.tensor([ids])).logits[0].float()
        finally:
            for h in handles:
                h.remove()
        return torch.log_softmax(logits, -1)

    def greedy(self, prompt_ids: list[int], n: int, strengths: dict | None = None) -> list[int]:
        """``n`` greedy tokens after ``prompt_ids``."""
        ids = list(prompt_ids)
        for _ in range(n):
            ids.append(int(self.logprobs(ids, strengths)[-1].argmax()))
        return ids[len(prompt_ids):]

    def check_windowed(self, outs, steers: list, max_tokens: int) -> list[bool]:
        """Engine outputs of requests with generation windows (``steers``: one request's
        ``steer`` each, None: unsteered), checked with a hand-written greedy decode loop that
        applies each window's strength at that generated token (``Window.at``): every token
        and its logprob (within 2e-3); ``max_tokens`` None: each request's own length. Returns,
        per steered request, whether the same steers at constant strength decode otherwise (the
        window matters)."""

        from vllm_steer.request import Window

        constant = []
        for o, steer in zip(outs, steers, strict=False):
            windows = {n: Window(**v) if isinstance(v, dict) else Window(v, base=v)
                       for n, v in (steer or {}).items()}
            ids = list(o.prompt_token_ids)
            for t, (tok, entry) in enumerate(zip(o.outputs[0].token_ids,
                                                 o.outputs[0].logprobs, strict=False)):
                lp = self.logprobs(ids, {n: w.at(t) for n, w in windows.items()})[-1]
                assert tok == int(lp.argmax()), (steer, t)
                assert entry[tok].logprob == pytest.approx(lp[tok].item(), abs=2e-3), (steer, t)
                ids.append(tok)
            n_out = len(o.outputs[0].token_ids) if max_tokens is None else max_tokens
            assert len(ids) == len(o.prompt_token_ids) + n_out
            if steer:
                full = {n: (v["strength"] if isinstance(v, dict) else v) for n, v in steer.items()}
                constant.append(self.greedy(o.prompt_token_ids, n_out, full)
                                != list(o.outputs[0].token_ids))
        return constant

    def check_generate(self, llm, prompts: list, strengths: list, max_tokens: int,
                       changed=(), tol: float = 2e-3):
        """Greedy ``llm.generate`` of ``prompts`` (one steer mix per prompt, None: unsteered)
        with logprobs: every token equals :meth:`greedy` and every logprob :meth:`logprobs`
        within ``tol``; the requests at the indices in ``changed`` must differ from the
        unsteered reference (the steer has a visible effect). Returns the outputs."""
        from vllm import SamplingParams

        params = [SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=0,
                                 extra_args=None if s is None else {"steer": s})
                  for s in strengths]
        outs = llm.generate(prompts[:len(strengths)], params, use_tqdm=False)
        for k, (o, s) in enumerate(zip(outs, strengths, strict=False)):
            ids, got = list(o.prompt_token_ids), list(o.outputs[0].token_ids)
            assert got == self.greedy(ids, max_tokens, s), (k, s)
            lp = self.logprobs(ids + got, s)
            for i, (tok, entry) in enumerate(zip(got, o.outputs[0].logprobs, strict=False)):
                assert entry[tok].logprob == pytest.approx(lp[len(ids) - 1 + i, tok].item(),
                                                           abs=tol), (k, s, i)
            if k in changed:
                assert got != self.greedy(ids, max_tokens), (k, s, "the steer has no effect")
        return outs
