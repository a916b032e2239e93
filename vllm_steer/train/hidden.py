"""Final hidden states of the training texts, computed once.

The model body is frozen, so the input of the output head (the final post-norm hidden state)
of every training token never changes: compute it once (no grad, length-sorted batches, a
progress bar), store it compactly (bfloat16 by default) and train the steer on it. The
states are captured by a forward pre-hook on ``model.get_output_embeddings()`` that stops the
forward there, so the head itself is never computed and any architecture works.

Storage (:class:`HiddenStates`), all texts concatenated::

    hidden   [total_tokens, hidden]  cache dtype
    ids      [total_tokens]          token ids
    offsets  [num_texts + 1]         text i is rows offsets[i]:offsets[i+1]
    sides    [num_texts]             +1 positive, -1 negative
    texts    [num_texts]             optional: which texts of the split these are (a run
                                     computes only the texts its steps use; see
                                     vllm_steer.train.trainer.hidden_states)
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from dataclasses import dataclass, field
from typing import Sequence

import torch

from vllm_steer.hf import output_head, text_config
from vllm_steer.logs import warn_once


class _Stop(Exception):
    pass


@contextlib.contextmanager
def capture_head_input(model, store: list):
    """Inside the block a forward stops at the output head, appending its input to ``store``."""
    def pre_hook(_module, args):
        store.append(args[0].detach())
        raise _Stop

    handle = output_head(model).register_forward_pre_hook(pre_hook)
    try:
        yield
    finally:
        handle.remove()


def final_hidden(model, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                 **forward) -> torch.Tensor:
    """The head's input [B, T, hidden] for a padded batch (the head is not computed).
    ``forward``: more arguments of the model's forward (default ``use_cache=False``)."""
    store: list[torch.Tensor] = []
    forward.setdefault("use_cache", False)
    with capture_head_input(model, store), torch.no_grad():
        try:
            model(input_ids=input_ids, attention_mask=attention_mask, **forward)
        except _Stop:
            pass
    if not store:
        raise RuntimeError(f"{type(model).__name__}: the forward never reached the output head")
    return store[0]


def model_window(model) -> int | None:
    cfg = text_config(model.config)
    for k in ("max_position_embeddings", "n_positions", "n_ctx", "seq_length"):
        v = getattr(cfg, k, None)
        if isinstance(v, int) and v > 0:
            return v
    return None


@dataclass
class TokenizeReport:
    texts: int = 0
    truncated: int = 0
    too_short: int = 0
    """Texts of fewer than 2 tokens (nothing to predict), dropped."""
    max_tokens_seen: int = 0
    examples_truncated: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"texts": self.texts, "truncated": self.truncated, "dropped_too_short":
                self.too_short, "max_tokens_before_truncation": self.max_tokens_seen}


def tokenize(tokenizer, texts: Sequence[str], max_length: int, window: int | None,
             where: Sequence[str] | None = None, keep_end: bool = False
             ) -> tuple[list[list[int]], list[int], TokenizeReport]:
    """Token ids per text (truncated to ``max_length``), the indices kept, and a report.
    ``keep_end``: a longer text keeps its end (its first token too when that is the
    tokenizer's beginning-of-sequence token), so that its last token is its own (what a
    vector steer's training reads); else its start."""
    if window is not None and max_length > window:
        raise ValueError(f"--max-length {max_length} exceeds the model's context window of "
                         f"{window} tokens; use --max-length {window} or less")
    rep = TokenizeReport(texts=len(texts))
    enc = tokenizer(list(texts), add_special_tokens=True)["input_ids"] if len(texts) else []
    bos = getattr(tokenizer, "bos_token_id", None) if keep_end else None
    ids_out, kept = _truncated(enc, max_length, 2, where, rep, keep_end, bos)
    return ids_out, kept, rep


def _truncated(enc, max_length: int, min_length: int, where: Sequence[str] | None,
               rep: TokenizeReport, keep_end: bool = False, bos: int | None = None
               ) -> tuple[list[list[int]], list[int]]:
    """Each sequence of ``enc`` cut to ``max_length`` tokens (its end kept with ``keep_end``,
    after a leading ``bos``), those under ``min_length`` dropped; the kept sequences and
    their indices, counted in ``rep``."""
    ids_out, kept = [], []
    for i, ids in enumerate(enc):
        rep.max_tokens_seen = max(rep.max_tokens_seen, len(ids))
        if len(ids) > max_length:
            rep.truncated += 1
            if where is not None and len(rep.examples_truncated) < 3:
                rep.examples_truncated.append(where[i])
            if not keep_end:
                ids = ids[:max_length]
            elif bos is not None and ids[0] == bos and max_length > 1:
                ids = [ids[0], *ids[len(ids) - max_length + 1:]]
            else:
                ids = ids[len(ids) - max_length:]
        if len(ids) < min_length:
            rep.too_short += 1
            continue
        ids_out.append(list(ids))
        kept.append(i)
    return ids_out, kept


#: The user turn every training text answers under ``--chat-template`` (a neutral request,
#: so that the reply's tokens are conditioned as a served chat reply is).
CHAT_USER_TURN = "Write a short text."


def chat_prefix(tokenizer) -> list[int]:
    """Token ids of the templated conversation up to the assistant's reply: the fixed user
    turn :data:`CHAT_USER_TURN` and the generation prompt (the template's default system turn
    included), tokenised without added special tokens, as a chat endpoint does."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"{getattr(tokenizer, 'name_or_path', 'the model')}: --chat-template "
                         "needs a tokenizer with a chat template (an instruct model); this "
                         "one has none: train without --chat-template")
    text = tokenizer.apply_chat_template([{"role": "user", "content": CHAT_USER_TURN}],
                                         tokenize=False, add_generation_prompt=True)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def tokenize_chat(tokenizer, texts: Sequence[str], max_length: int, window: int | None,
                  where: Sequence[str] | None = None
                  ) -> tuple[list[list[int]], list[int], list[int], TokenizeReport]:
    """Each text as the assistant's reply after :func:`chat_prefix`: token ids (the prefix's,
    then the reply's, tokenised on its own as generated tokens are), the index of each
    sequence's first target (the reply's first token), the indices kept and a report.
    ``max_length`` counts the reply's tokens; replies of no token are dropped."""
    prefix = chat_prefix(tokenizer)
    if window is not None and len(prefix) + max_length > window:
        raise ValueError(f"--max-length {max_length} plus the chat prefix's {len(prefix)} "
                         f"tokens exceeds the model's context window of {window} tokens; use "
                         f"--max-length {window - len(prefix)} or less")
    rep = TokenizeReport(texts=len(texts))
    enc = tokenizer(list(texts), add_special_tokens=False)["input_ids"] if len(texts) else []
    replies, kept = _truncated(enc, max_length, 1, where, rep)
    return [prefix + ids for ids in replies], [len(prefix)] * len(replies), kept, rep


@dataclass
class HiddenStates:
    hidden: torch.Tensor
    ids: torch.Tensor
    offsets: torch.Tensor
    sides: torch.Tensor
    texts: torch.Tensor | None = None
    """Indices (in the split) of the texts stored here, in storage order; ``None`` = all
    texts of the split, in order."""
    starts: torch.Tensor | None = None
    """Per text, the index of its first target token (a chat reply's first token after the
    templated prompt); ``None`` = 1 for every text (every token but the first is a target)."""

    @property
    def num_texts(self) -> int:
        return int(self.sides.shape[0])

    @property
    def num_targets(self) -> int:
        return int(self.targets_per_text().sum())

    def lengths(self) -> torch.Tensor:
        return self.offsets[1:] - self.offsets[:-1]

    def first_targets(self) -> torch.Tensor:
        """Per text, the index of its first target token."""
        return (self.starts.long() if self.starts is not None
                else torch.ones(self.num_texts, dtype=torch.long))

    def targets_per_text(self) -> torch.Tensor:
        """Per text, how many of its tokens are predicted (the rows a step sees)."""
        return self.lengths() - self.first_targets()

    def rows(self, text_idx: torch.Tensor | Sequence[int]) -> tuple[torch.Tensor, torch.Tensor,
                                                                     torch.Tensor]:
        """``(input_rows, target_rows, text_of_row)`` for texts ``text_idx``: each target
        token (from the text's first target on) is predicted from the position before it."""
        idx = torch.as_tensor(text_idx, dtype=torch.long)
        starts = self.offsets[idx] + self.first_targets()[idx] - 1
        n = self.targets_per_text()[idx]
        text_of_row = torch.repeat_interleave(idx, n)
        base = torch.repeat_interleave(starts, n)
        within = torch.arange(int(n.sum())) - torch.repeat_interleave(torch.cumsum(n, 0) - n, n)
        inp = base + within
        return inp, inp + 1, text_of_row

    def batch(self, text_idx, device=None, signs: torch.Tensor | None = None):
        """``(c [N, hidden], targets [N], row_signs [N])`` for texts ``text_idx``; the signs are
        the texts' sides unless ``signs`` (per text of ``text_idx``) is given."""
        inp, tgt, text_of_row = self.rows(text_idx)
        c = self.hidden.index_select(0, inp)
        t = self.ids.index_select(0, tgt).long()
        s = self.sides.index_select(0, text_of_row).float()
        return c.to(device), t.to(device), s.to(device)

    def save(self, path: str, key: str) -> None:
        from safetensors.torch import save_file

        tmp = path + ".tmp"
        tensors = {"hidden": self.hidden.contiguous(), "ids": self.ids,
                   "offsets": self.offsets, "sides": self.sides}
        if self.texts is not None:
            tensors["texts"] = self.texts
        if self.starts is not None:
            tensors["starts"] = self.starts
        save_file(tensors, tmp, metadata={"key": key})
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str, key: str) -> "HiddenStates | None":
        """The states saved at ``path`` if their key matches, else ``None``."""
        from safetensors import safe_open

        if not os.path.exists(path):
            return None
        try:
            with safe_open(path, framework="pt") as f:
                if (f.metadata() or {}).get("key") != key:
                    return None
                parts = [f.get_tensor(k) for k in ("hidden", "ids", "offsets", "sides")]
                texts = f.get_tensor("texts") if "texts" in f.keys() else None
                starts = f.get_tensor("starts") if "starts" in f.keys() else None
                return cls(*parts, texts=texts, starts=starts)
        except Exception:  # a truncated cache is simply recomputed
            return None

    def text_indices(self) -> torch.Tensor:
        """The split's indices of the stored texts (storage order)."""
        return self.texts if self.texts is not None else torch.arange(self.num_texts)

    @classmethod
    def concat(cls, a: "HiddenStates", b: "HiddenStates") -> "HiddenStates":
        """The texts of ``a`` then those of ``b`` (disjoint subsets of one split)."""
        off_b = b.offsets[1:] + a.offsets[-1]
        starts = (None if a.starts is None and b.starts is None else
                  torch.cat([a.first_targets(), b.first_targets()]))
        return cls(torch.cat([a.hidden, b.hidden]), torch.cat([a.ids, b.ids]),
                   torch.cat([a.offsets, off_b]), torch.cat([a.sides, b.sides]),
                   torch.cat([a.text_indices(), b.text_indices()]), starts)


def cache_key(model_path: str, model, texts: Sequence[str], sides: Sequence[int],
              max_length: int, model_dtype: torch.dtype, cache_dtype: torch.dtype) -> str:
    h = hashlib.sha256()
    h.update(json.dumps({"model": str(model_path), "config": model.config.to_json_string(),
                         "max_length": max_length, "model_dtype": str(model_dtype),
                         "cache_dtype": str(cache_dtype), "v": 1}, sort_keys=True).encode())
    for t, s in zip(texts, sides, strict=True):
        h.update(f"{s}\x00{t}\x01".encode("utf-8", "replace"))
    return h.hexdigest()


def shared_prefix(ids_list: Sequence[Sequence[int]], starts: Sequence[int] | None) -> int:
    """How many leading tokens every text shares before its first target (``--chat-template``:
    the templated user turn), 0 when they do not all share one."""
    if not starts or not ids_list or len(set(starts)) != 1:
        return 0
    P = int(starts[0])
    first = list(ids_list[0][:P])
    if P < 1 or any(len(x) <= P or list(x[:P]) != first for x in ids_list):
        return 0
    return P


class _Prefix:
    """The templated prompt every chat text shares, run through the model once: its head
    inputs (``hidden`` [P, hidden]) and its key/value cache, which each batch of replies
    continues instead of running the prompt again (about half the tokens of a chat run)."""

    def __init__(self, model, ids: Sequence[int], device, dtype: torch.dtype):
        from transformers import DynamicCache

        self.model, self.ids, self.P = model, list(ids), len(ids)
        self.cache = DynamicCache(config=model.config)
        inp = torch.as_tensor([self.ids], device=device)
        self.hidden = final_hidden(model, inp, torch.ones_like(inp), past_key_values=self.cache,
                                   use_cache=True)[0].to("cpu", dtype)

    def continued(self, inp: torch.Tensor, att: torch.Tensor) -> torch.Tensor:
        """Head inputs [B, T, hidden] of right-padded replies ``inp`` after the prompt."""
        import copy

        cache = copy.deepcopy(self.cache)
        cache.batch_repeat_interleave(inp.shape[0])
        mask = torch.cat([torch.ones(inp.shape[0], self.P, dtype=att.dtype, device=att.device),
                          att], 1)
        pos = torch.arange(self.P, self.P + inp.shape[1], device=inp.device).expand_as(inp)
        return final_hidden(self.model, inp, mask, position_ids=pos, past_key_values=cache,
                            use_cache=True)

    def agrees(self, h: torch.Tensor, inp: torch.Tensor, att: torch.Tensor) -> bool:
        """Whether ``h`` (:meth:`continued` of the first batch) equals the batch's first text
        run whole without the cache (to the dtype's rounding)."""
        n = int(att[0].sum())
        whole = torch.as_tensor([self.ids + inp[0, :n].tolist()], device=inp.device)
        ref = final_hidden(self.model, whole, torch.ones_like(whole))[0, self.P:].to("cpu")
        ref, got = ref.float(), h[0, :n].float()
        tol = 1e-3 if h.dtype == torch.float32 else 5e-2
        return bool(torch.allclose(got, ref, rtol=tol, atol=tol * float(ref.abs().max())))


def compute_hidden(model, tokenizer, ids_list: Sequence[Sequence[int]], sides: Sequence[int], *,
                   cache_dtype: torch.dtype = torch.bfloat16, batch_tokens: int = 4096,
                   progress: bool = True, desc: str = "hidden states",
                   starts: Sequence[int] | None = None) -> HiddenStates:
    """Run the frozen model once over every text (length-sorted batches, right padding).
    ``starts``: per text, the index of its first target token (default 1)."""
    from tqdm.auto import tqdm

    device = output_head(model).weight.device
    d = output_head(model).weight.shape[1]
    lens = torch.tensor([len(x) for x in ids_list], dtype=torch.long)
    offsets = torch.zeros(len(ids_list) + 1, dtype=torch.long)
    offsets[1:] = torch.cumsum(lens, 0)
    total = int(offsets[-1])
    hidden = torch.empty(total, d, dtype=cache_dtype)
    ids = torch.empty(total, dtype=torch.int32)
    for i, x in enumerate(ids_list):
        ids[offsets[i]:offsets[i + 1]] = torch.as_tensor(x, dtype=torch.int32)
    order = sorted(range(len(ids_list)), key=lambda i: -len(ids_list[i]))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    P = shared_prefix(ids_list, starts)
    prefix = _Prefix(model, ids_list[order[0]][:P], device, cache_dtype) if P else None
    bar = tqdm(total=total, desc=desc, unit="tok", disable=not progress, leave=False)
    i = 0
    while i < len(order):
        T = len(ids_list[order[i]]) - P
        B = max(1, batch_tokens // (T + P))
        chunk = order[i:i + B]
        inp = torch.full((len(chunk), T), pad, dtype=torch.long)
        att = torch.zeros((len(chunk), T), dtype=torch.long)
        for j, k in enumerate(chunk):
            x = ids_list[k][P:]
            inp[j, :len(x)] = torch.as_tensor(x)
            att[j, :len(x)] = 1
        if prefix is None:
            h = final_hidden(model, inp.to(device), att.to(device)).to("cpu")
        else:
            h = prefix.continued(inp.to(device), att.to(device)).to("cpu")
            if i == 0 and not prefix.agrees(h, inp, att):
                # this model's forward does not continue a cache as expected: run whole texts
                warn_once(f"{type(model).__name__}: the chat prompt's cache did not reproduce "
                          "the whole texts' hidden states; computing each text whole")
                prefix, P = None, 0
                continue
        for j, k in enumerate(chunk):
            L = len(ids_list[k])
            if P:  # the shared prompt's states, then the reply's
                hidden[offsets[k]:offsets[k] + P] = prefix.hidden
            hidden[offsets[k] + P:offsets[k] + L] = h[j, :L - P].to(cache_dtype)
        bar.update(int(att.sum()) + P * len(chunk))
        i += len(chunk)
    bar.close()
    return HiddenStates(hidden, ids, offsets, torch.as_tensor(list(sides), dtype=torch.int8),
                        starts=None if starts is None
                        else torch.as_tensor(list(starts), dtype=torch.long))


@contextlib.contextmanager
def capture_blocks(model, layers: Sequence[int], store: dict):
    """Inside the block a forward records the output of each decoder block in ``layers``
    (``store[k]``: [B, T, hidden]) and stops after the last of them (later blocks and the
    head are never computed)."""
    from vllm_steer.hf import block_hidden, decoder_layers

    blocks = decoder_layers(model)
    last = max(layers)
    handles = []

    def hook_for(k: int):
        def hook(_module, _args, output):
            store[k] = block_hidden(output).detach()
            if k == last:
                raise _Stop
        return hook

    try:
        for k in sorted(set(layers)):
            handles.append(blocks[k].register_forward_hook(hook_for(k)))
        yield
    finally:
        for h in handles:
            h.remove()


def block_outputs_at_last(model, tokenizer, ids_list: Sequence[Sequence[int]],
                          layers: Sequence[int], *, batch_tokens: int = 4096,
                          progress: bool = True, desc: str = "block outputs") -> torch.Tensor:
    """``[len(layers), num_texts, hidden]`` float32: the output of each decoder block in
    ``layers`` (0-based; ``output_hidden_states[k + 1]`` in transformers' numbering) at the
    last token of each text, in the order of ``layers`` and ``ids_list``. Length-sorted,
    right-padded batches; the forward stops after the last block asked for."""
    from tqdm.auto import tqdm

    from vllm_steer.hf import decoder_layers

    layers = list(layers)
    if not layers:
        raise ValueError("no layers to read")
    n_blocks = len(decoder_layers(model))
    bad = [k for k in layers if not 0 <= k < n_blocks]
    if bad:
        raise ValueError(f"blocks {bad} do not exist: the model has {n_blocks} decoder blocks "
                         f"(0 to {n_blocks - 1})")
    device = output_head(model).weight.device
    d = int(text_config(model.config).hidden_size)
    out = torch.empty(len(layers), len(ids_list), d, dtype=torch.float32)
    order = sorted(range(len(ids_list)), key=lambda i: -len(ids_list[i]))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    bar = tqdm(total=len(ids_list), desc=desc, unit="text", disable=not progress, leave=False)
    i = 0
    while i < len(order):
        T = len(ids_list[order[i]])
        chunk = order[i:i + max(1, batch_tokens // T)]
        inp = torch.full((len(chunk), T), pad, dtype=torch.long)
        att = torch.zeros((len(chunk), T), dtype=torch.long)
        for j, k in enumerate(chunk):
            inp[j, :len(ids_list[k])] = torch.as_tensor(list(ids_list[k]))
            att[j, :len(ids_list[k])] = 1
        store: dict[int, torch.Tensor] = {}
        with capture_blocks(model, layers, store), torch.no_grad():
            try:
                model(input_ids=inp.to(device), attention_mask=att.to(device), use_cache=False)
            except _Stop:
                pass
        last = att.sum(1) - 1
        rows = torch.arange(len(chunk))
        idx = torch.as_tensor(chunk)
        for li, k in enumerate(layers):
            out[li, idx] = store[k].to("cpu")[rows, last].float()
        bar.update(len(chunk))
        i += len(chunk)
    bar.close()
    return out
