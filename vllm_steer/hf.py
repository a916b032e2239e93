"""Steers in plain transformers, for users who do not serve with vLLM (and for the lens tools).

Semantics: see :mod:`vllm_steer.reference`. The steer acts on the input of the model's output
head (``model.get_output_embeddings()``), i.e. the final post-norm hidden state, so head bias
and untied heads are kept as they are.

    with steering(model, {"detox": steer}, {"detox": 5}):
        out = model.generate(**inputs)

    lp = token_logprobs(model, tok, ["some text"], steers={"detox": steer}, strengths={"detox": 5})

    texts = generate(model, tok, ["The weather today"], {"detox": steer}, {"detox": 5})
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Mapping, Sequence

import torch

from vllm_steer.bank import SteerBank
from vllm_steer.format import Steer

if TYPE_CHECKING:  # pragma: no cover
    from vllm_steer.vectors import VectorSteer


def output_head(model) -> torch.nn.Module:
    """The module computing logits from the final hidden state."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is None:
        raise ValueError(f"{type(model).__name__} has no output embeddings "
                         "(get_output_embeddings() returned None): not a causal LM?")
    return head


def text_config(config):
    """A model config's language model's: a multimodal checkpoint's text config (Gemma 3 4B
    and up, Mistral 3: their hidden size and window are there), else the config itself."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def logit_postprocess(model):
    """The model's processing of its head's output, as a function on float32 logits, or None
    where the logits are the head's (most models): Cohere's ``* logit_scale``, Granite's
    ``/ logits_scaling``, Gemma 2/3's final soft-cap ``cap * tanh(l / cap)`` -- what the
    model's forward applies after the head. The one place this processing is written
    (training, the lens)."""
    cfg = text_config(getattr(model, "config", None))
    softcap = getattr(cfg, "final_logit_softcapping", None)
    scale = getattr(cfg, "logit_scale", None)
    divide = getattr(cfg, "logits_scaling", None)
    if softcap is None and scale is None and divide is None:
        return None

    def post(logits: torch.Tensor) -> torch.Tensor:
        if scale is not None:
            logits = logits * float(scale)
        if divide is not None:
            logits = logits / float(divide)
        if softcap is not None:
            logits = torch.tanh(logits / float(softcap)) * float(softcap)
        return logits

    return post


def _as_bank(steers, model) -> SteerBank:
    if isinstance(steers, SteerBank):
        return steers
    if isinstance(steers, Steer):
        steers = {steers.name: steers}
    head = output_head(model)
    w = head.weight
    return SteerBank(steers, device=w.device, dtype=w.dtype)


@contextlib.contextmanager
def steering(model, steers: "Mapping[str, Steer] | Steer | SteerBank",
             strengths: "Mapping[str, float] | float", backend: str | None = None):
    """Apply steers at the given strengths (units of epsilon) inside the ``with`` block.

    ``strengths`` may be a float when a single steer is given. Undone on exit, also on error.
    """
    bank = _as_bank(steers, model)
    if not isinstance(strengths, Mapping):
        if len(bank.names) != 1:
            raise ValueError("a bare strength needs exactly one steer; pass {name: strength}")
        strengths = {bank.names[0]: float(strengths)}
    unknown = set(strengths) - set(bank.names)
    if unknown:
        raise KeyError(f"unknown steers {sorted(unknown)}; loaded: {bank.names}")
    head = output_head(model)
    if bank.hidden_size and head.weight.shape[-1] != bank.hidden_size:
        raise ValueError(f"steer hidden size {bank.hidden_size} does not fit the model's head "
                         f"(input size {head.weight.shape[-1]})")
    row = bank.coef_row(strengths)

    def pre_hook(_module, args):
        (h, *rest) = args
        flat = h.reshape(-1, h.shape[-1])
        coefs = torch.tensor(row, dtype=torch.float32, device=h.device).expand(flat.shape[0], -1)
        return (bank.apply(flat, coefs, backend=backend).reshape(h.shape), *rest)

    handle = head.register_forward_pre_hook(pre_hook) if any(row) else None
    try:
        yield model
    finally:
        if handle is not None:
            handle.remove()


#: Where each supported family keeps its decoder blocks (attribute paths from the causal LM).
DECODER_LAYER_PATHS = ("model.layers", "model.decoder.layers", "transformer.h",
                       "gpt_neox.layers", "model.language_model.layers")


def decoder_layers(model) -> torch.nn.ModuleList:
    """The model's decoder blocks, in order (block ``k`` is ``decoder_layers(model)[k]``)."""
    for path in DECODER_LAYER_PATHS:
        obj = model
        for part in path.split("."):
            obj = getattr(obj, part, None)
            if obj is None:
                break
        if isinstance(obj, torch.nn.ModuleList) and len(obj):
            return obj
    raise ValueError(f"{type(model).__name__}: no decoder blocks found (looked for "
                     f"{', '.join(DECODER_LAYER_PATHS)})")


def block_hidden(output) -> torch.Tensor:
    """The hidden state a decoder block returns (a tensor, or the first of a tuple)."""
    return output[0] if isinstance(output, (tuple, list)) else output


@contextlib.contextmanager
def vector_steering(model, vectors: "Mapping[str, VectorSteer] | VectorSteer",
                    strengths: "Mapping[str, float] | float"):
    """Apply vector steers inside the ``with`` block: ``a_i * v_{i,k}`` is added to the
    output of decoder block ``k`` at every position (semantics:
    :func:`vllm_steer.reference.vector_steer_reference`). Undone on exit, also on error."""
    from vllm_steer.reference import vector_steer_reference
    from vllm_steer.vectors import VectorSteer, model_fit_problems

    if isinstance(vectors, VectorSteer):
        vectors = {vectors.name: vectors}
    if not isinstance(strengths, Mapping):
        if len(vectors) != 1:
            raise ValueError("a bare strength needs exactly one vector steer; pass "
                             "{name: strength}")
        strengths = {next(iter(vectors)): float(strengths)}
    unknown = set(strengths) - set(vectors)
    if unknown:
        raise KeyError(f"unknown vector steers {sorted(unknown)}; given: {sorted(vectors)}")
    layers = decoder_layers(model)
    hidden = int(text_config(model.config).hidden_size)
    for name, vs in vectors.items():
        problems = model_fit_problems(vs.metadata, hidden_size=hidden, num_layers=len(layers))
        if problems:
            raise ValueError(f"vector steer {name!r}: " + "; ".join(problems))
    names = [n for n in strengths if strengths[n] != 0]
    handles = []

    def hook_for(k: int, stack: torch.Tensor, coefs: torch.Tensor):
        def hook(_module, _args, output):
            h = block_hidden(output)
            flat = h.reshape(-1, h.shape[-1])
            c = coefs.to(h.device).expand(flat.shape[0], -1)
            new = vector_steer_reference(flat, stack.to(h.device), c).reshape(h.shape)
            if isinstance(output, tuple):
                return (new, *output[1:])
            if isinstance(output, list):
                return [new, *output[1:]]
            return new
        return hook

    try:
        for k, block in enumerate(layers):
            here = [n for n in names if k in vectors[n].directions]
            if not here:
                continue
            stack = torch.stack([vectors[n].directions[k].float() for n in here])
            coefs = torch.tensor([[float(strengths[n]) for n in here]], dtype=torch.float32)
            handles.append(block.register_forward_hook(hook_for(k, stack, coefs)))
        yield model
    finally:
        for h in handles:
            h.remove()


def tokenize_scored(tokenizer, text: str, prefix: str | Sequence[int] | None = None,
                    max_length: int | None = None, max_text_tokens: int | None = None
                    ) -> tuple[list[int], int]:
    """Token ids of ``prefix + text`` (no special tokens) and the index of the first scored
    token: the first text token after a prefix, else token 1 (token 0 has no context).

    A prefix given as token ids is used as it is (a prompt as the model was given it, with
    the special tokens its tokenizer adds, such as Llama's BOS); only the text is tokenised.
    ``max_length`` cuts prefix and text together to that many tokens; ``max_text_tokens``
    keeps the text's first that many tokens, whatever the prefix's length.
    """
    if prefix is not None and not isinstance(prefix, str):
        a = [int(t) for t in prefix]
    else:
        a = tokenizer(prefix, add_special_tokens=False)["input_ids"] if prefix else []
    b = tokenizer(text, add_special_tokens=False)["input_ids"]
    if max_text_tokens is not None:
        b = b[:max(int(max_text_tokens), 0)]
    ids = a + b
    if max_length:
        ids = ids[:max_length]
    return ids, max(len(a), 1)


def prompt_ids(tokenizer, prompt: str) -> list[int]:
    """The token ids a model is given for a text prompt: the tokenizer's default encoding,
    with the special tokens it adds (Llama's and Mistral's BOS; none for GPT-2 or SmolLM2),
    as vLLM tokenises a text prompt."""
    return list(tokenizer(prompt)["input_ids"])


@torch.no_grad()
def token_logprobs(model, tokenizer, texts: Sequence[str], steers=None, strengths=None,
                   prefixes: Sequence[str | Sequence[int]] | None = None, batch_size: int = 8,
                   max_length: int | None = None) -> list[torch.Tensor]:
    """Per-token log-likelihood of each text (steered if ``steers`` given).

    Returns, per text, a float32 tensor ``[num_tokens - 1]``: ``log p(t_i | t_<i)`` for tokens
    1..n-1 (or for the text's tokens after ``prefixes[i]`` when prefixes are given; a prefix
    is a string, tokenised without special tokens, or token ids used as they are).
    """
    ctx = steering(model, steers, strengths) if steers is not None else contextlib.nullcontext()
    device = output_head(model).weight.device
    results: list[torch.Tensor] = []
    with ctx:
        for i in range(0, len(texts), batch_size):
            chunk = texts[i:i + batch_size]
            pre = prefixes[i:i + batch_size] if prefixes is not None else [None] * len(chunk)
            ids_list, starts = [], []
            for text, p in zip(chunk, pre, strict=False):
                ids, start = tokenize_scored(tokenizer, text, p, max_length)
                ids_list.append(ids), starts.append(start)
            T = max(len(x) for x in ids_list)
            if T < 2:  # nothing has a context: no token to score (and nothing to run)
                results += [torch.zeros(0) for _ in ids_list]
                continue
            pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
            inp = torch.full((len(ids_list), T), pad, dtype=torch.long)
            att = torch.zeros((len(ids_list), T), dtype=torch.long)
            for j, ids in enumerate(ids_list):
                inp[j, :len(ids)] = torch.tensor(ids)
                att[j, :len(ids)] = 1
            logits = model(input_ids=inp.to(device), attention_mask=att.to(device)).logits.float()
            lp = torch.log_softmax(logits[:, :-1], dim=-1)
            tgt = inp[:, 1:].to(device)
            tok_lp = lp.gather(-1, tgt[..., None])[..., 0]
            for j, ids in enumerate(ids_list):
                # tokens start..len-1 (none for a text shorter than that, never the padding)
                results.append(tok_lp[j, starts[j] - 1:max(len(ids) - 1, starts[j] - 1)].cpu())
    return results


@torch.no_grad()
def generate(model, tokenizer, prompts: Sequence[str], steers=None, strengths=None, *,
             max_new_tokens: int = 40, do_sample: bool = False, temperature: float = 1.0,
             top_p: float = 1.0, seed: int | None = None, chat: bool = False,
             batch_size: int = 8, **generate_kwargs) -> list[str]:
    """Continuations of ``prompts`` (new text only), steered if ``steers`` given.

    Greedy by default; ``do_sample=True`` with ``temperature``/``top_p`` samples (``seed``
    makes it repeatable). ``chat=True`` wraps each prompt in the tokenizer's chat template as
    a user turn (for instruct models). Extra keyword arguments go to ``model.generate``.
    """
    ctx = steering(model, steers, strengths) if steers is not None else contextlib.nullcontext()
    device = output_head(model).weight.device
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    side, pad_token = tokenizer.padding_side, tokenizer.pad_token
    tokenizer.padding_side = "left"
    if pad_token is None:  # GPT-2's, GPT-NeoX's: batches are padded with end-of-text
        tokenizer.pad_token = tokenizer.eos_token
    outs: list[str] = []
    try:
        with ctx:
            for i in range(0, len(prompts), batch_size):
                chunk = list(prompts[i:i + batch_size])
                if chat:
                    chunk = [tokenizer.apply_chat_template([{"role": "user", "content": p}],
                                                           tokenize=False,
                                                           add_generation_prompt=True)
                             for p in chunk]
                enc = tokenizer(chunk, return_tensors="pt", padding=True,
                                add_special_tokens=not chat).to(device)
                if seed is not None:
                    torch.manual_seed(seed + i)
                kw = dict(max_new_tokens=max_new_tokens, do_sample=do_sample, pad_token_id=pad)
                if do_sample:
                    kw.update(temperature=temperature, top_p=top_p)
                kw.update(generate_kwargs)
                out = model.generate(**enc, **kw)
                new = out[:, enc["input_ids"].shape[1]:]
                outs += tokenizer.batch_decode(new, skip_special_tokens=True)
    finally:
        tokenizer.padding_side = side
        if pad_token is None:
            tokenizer.pad_token = None
    return outs
