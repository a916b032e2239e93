"""Train a small EAGLE-1 draft head (vLLM ``method: "eagle"``) for SmolLM2-135M-Instruct on CPU.

The head is what vLLM's ``EagleLlamaForCausalLM`` runs (vllm/model_executor/models/llama_eagle.py):

    x   = fc([embed(t_{i+1}), h_i])            # Linear(2d -> d, no bias)
    r   = x;  a = attn(x)                      # layer 0: input_layernorm is the identity
    r   = r + a;  m = mlp(rmsnorm(r))          # post_attention_layernorm, SwiGLU MLP
    out = m + r                                # no final norm

and ``out`` goes to the target's own (tied) LM head, which stays frozen and is not saved: the
file holds ``fc.weight`` and ``layers.0.*`` only, so vLLM shares the target's embedding and LM
head. ``h_i`` is the hidden state the target's forward returns, which for Llama in vLLM is the
output of the final RMSNorm (LlamaModel.forward: ``hidden_states, _ = self.norm(...)``), i.e.
transformers' ``last_hidden_state``; for its later draft steps vLLM feeds the head its own
``out`` as the next ``h``.

Data: the target's own greedy continuations of OpenWebText prompts
(``prompts/sentiment/neutral_prompts.jsonl`` rows from ``--first-prompt`` on; the benchmark
uses the first 16), generated with vLLM offline, and the target's post-norm hidden states of
prompt + continuation from transformers. Training is teacher-forced with EAGLE's loss
(smooth-L1 to the target's next hidden state + ``--ce-weight`` x cross-entropy of the frozen LM
head on ``out`` against the target's greedy next token) and, with ``--ttt-steps S`` > 1, the
"training-time test" unroll: draft step ``s`` at position ``q`` takes step ``s-1``'s output at
``q-1`` as its hidden state and attends to the teacher-forced keys up to ``q-s+1`` and to the
earlier steps' keys of its own chain, exactly as vLLM's KV cache holds them when drafting.

    VLLM_STEER_DATA=../shared/data .venv/bin/python benchmarks/train_eagle_head.py \
        --prompts 1536 --seconds 720 --out ~/.cache/vllm-steer/smollm2-eagle

(the head benchmarks/RESULTS.md measures; the data, ~8 min of generation per 384 prompts on
2 CPU cores, are cached in ``<vllm-steer cache>/eagle-data``). Then:

    .venv/bin/python benchmarks/bench_specdec.py --method eagle \
        --draft ~/.cache/vllm-steer/smollm2-eagle
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]

# ------------------------------------------------------------------ the head (vLLM's layout)


def head_config(target_cfg: dict) -> dict:
    """config.json vLLM loads for the head: the target's sizes, one layer, Llama architecture."""
    keep = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
            "head_dim", "vocab_size", "rms_norm_eps", "max_position_embeddings",
            "bos_token_id", "eos_token_id", "hidden_act", "rope_parameters", "rope_theta",
            "rope_scaling", "attention_bias", "mlp_bias")
    cfg = {k: target_cfg[k] for k in keep if k in target_cfg}
    cfg.setdefault("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"])
    cfg.update(architectures=["LlamaForCausalLM"], model_type="llama", num_hidden_layers=1,
               tie_word_embeddings=False, torch_dtype="float32")
    return cfg


def rope_theta(cfg: dict) -> float:
    rp = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    return float(rp.get("rope_theta", cfg.get("rope_theta", 10000.0)))


def rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """Neox-style rotary embedding (transformers' rotate_half, vLLM's is_neox_style=True).
    x: [..., T, D], pos: [T] or [B, 1, T]-broadcastable."""
    d = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    ang = pos.to(torch.float32)[..., None] * inv
    cos, sin = torch.cat((ang, ang), -1).cos(), torch.cat((ang, ang), -1).sin()
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return x * cos + torch.cat((-x2, x1), -1) * sin


class EagleHead(nn.Module):
    """EAGLE-1 head; attribute names map 1:1 onto the checkpoint keys (see ``vllm_state``)."""

    def __init__(self, cfg: dict):
        super().__init__()
        d, inter = cfg["hidden_size"], cfg["intermediate_size"]
        self.nh, self.nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
        self.hd = cfg.get("head_dim") or d // self.nh
        self.eps, self.theta = float(cfg["rms_norm_eps"]), rope_theta(cfg)
        self.fc = nn.Linear(2 * d, d, bias=False)
        self.q_proj = nn.Linear(d, self.nh * self.hd, bias=False)
        self.k_proj = nn.Linear(d, self.nkv * self.hd, bias=False)
        self.v_proj = nn.Linear(d, self.nkv * self.hd, bias=False)
        self.o_proj = nn.Linear(self.nh * self.hd, d, bias=False)
        self.gate_proj = nn.Linear(d, inter, bias=False)
        self.up_proj = nn.Linear(d, inter, bias=False)
        self.down_proj = nn.Linear(inter, d, bias=False)
        self.post_attention_layernorm = nn.Parameter(torch.ones(d))
        for lin in (self.q_proj, self.k_proj, self.v_proj, self.o_proj, self.gate_proj,
                    self.up_proj, self.down_proj):
            nn.init.normal_(lin.weight, std=0.02)
        # start near "out = h": fc passes the hidden state half through, the layer adds little
        with torch.no_grad():
            self.fc.weight.normal_(std=0.02)
            self.fc.weight[:, d:] += torch.eye(d)
            self.o_proj.weight.mul_(0.1)
            self.down_proj.weight.mul_(0.1)

    KEYS = {"fc": "fc.weight",
            "post_attention_layernorm": "layers.0.post_attention_layernorm.weight",
            **{p: f"layers.0.self_attn.{p}.weight"
               for p in ("q_proj", "k_proj", "v_proj", "o_proj")},
            **{p: f"layers.0.mlp.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")}}

    def vllm_state(self, dtype=torch.float32) -> dict[str, torch.Tensor]:
        """Tensors under the names vLLM's EagleLlamaForCausalLM.load_weights reads."""
        out = {}
        for attr, key in self.KEYS.items():
            t = getattr(self, attr)
            t = t.weight if isinstance(t, nn.Linear) else t
            out[key] = t.detach().to(dtype).contiguous()
        return out

    def load_vllm_state(self, state: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for attr, key in self.KEYS.items():
                t = getattr(self, attr)
                (t.weight if isinstance(t, nn.Linear) else t).copy_(state[key].float())

    def rmsnorm(self, x):
        rms = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return x * rms * self.post_attention_layernorm

    def qkv(self, x, pos):
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.nh, self.hd).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.nkv, self.hd).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.nkv, self.hd).transpose(1, 2)
        rep = self.nh // self.nkv
        return (rope(q, pos, self.theta), rope(k, pos, self.theta).repeat_interleave(rep, 1),
                v.repeat_interleave(rep, 1))

    def finish(self, x, a):
        B, _, T, _ = a.shape
        r = x + self.o_proj(a.transpose(1, 2).reshape(B, T, -1))
        h = self.rmsnorm(r)
        return self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h)) + r

    def forward(self, emb: torch.Tensor, hid: torch.Tensor, pos: torch.Tensor | None = None):
        """One teacher-forced pass: emb = embed(t_{i+1}), hid = h_i, both [B, T, d]."""
        return self.unroll(emb, hid, 1, pos)[0]

    def unroll(self, emb, hid, steps: int, pos=None):
        """Outputs of draft steps 1..steps, each [B, T, d]; step s at position q is the s-th
        draft of the chain that started at q-s+1 (its first s-1 positions are padding)."""
        B, T, _ = emb.shape
        pos = torch.arange(T) if pos is None else pos
        ks, vs, outs = [], [], []
        h = hid
        big = torch.finfo(emb.dtype).min
        idx = torch.arange(T)
        for s in range(1, steps + 1):
            if s > 1:  # the previous step's output at q-1 is this step's hidden state at q
                h = F.pad(outs[-1][:, :-1], (0, 0, 1, 0))
            x = self.fc(torch.cat((emb, h), -1))
            q, k, v = self.qkv(x, pos)
            ks.append(k)
            vs.append(v)
            scale = 1.0 / math.sqrt(self.hd)
            # teacher-forced keys (step 1) at positions <= q-(s-1)
            sc = (q @ ks[0].transpose(-1, -2)) * scale
            sc = sc.masked_fill(idx[None, :] > idx[:, None] - (s - 1), big)
            diag = []
            for r in range(2, s + 1):  # step r's key of this chain sits at q-(s-r)
                o = s - r
                kr = F.pad(ks[r - 1], (0, 0, o, 0))[:, :, :T]
                diag.append((q * kr).sum(-1, keepdim=True) * scale)
            p = torch.softmax(torch.cat([sc] + diag, -1), -1)
            a = p[..., :T] @ vs[0]
            for j, r in enumerate(range(2, s + 1)):
                a = a + p[..., T + j: T + j + 1] * F.pad(vs[r - 1], (0, 0, s - r, 0))[:, :, :T]
            outs.append(self.finish(x, a))
        return outs


def save_head(head: EagleHead, out: Path, target_cfg: dict, dtype=torch.bfloat16,
              meta: dict | None = None) -> Path:
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_file(head.vllm_state(dtype), str(out / "model.safetensors"),
              metadata={k: str(v) for k, v in (meta or {}).items()})
    cfg = head_config(target_cfg)
    cfg["torch_dtype"] = str(dtype).replace("torch.", "")
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    return out


# ------------------------------------------------------------------ data


def neutral_prompts(first: int, n: int) -> list[str]:
    data = Path(os.environ.get("VLLM_STEER_DATA", ROOT.parent / "shared" / "data"))
    rows = (data / "prompts" / "sentiment" / "neutral_prompts.jsonl").read_text().splitlines()
    return [json.loads(r)["prompt"]["text"] for r in rows[first: first + n]]


def generate_own(model: str, texts: list[str], max_tokens: int) -> list[list[int]]:
    """Prompt + the target's greedy continuation, as token ids (vLLM offline, no steer)."""
    from vllm import LLM, SamplingParams

    llm = LLM(model, dtype="float32", enforce_eager=True, max_model_len=512, seed=0,
              kv_cache_memory_bytes=1 << 29, max_num_seqs=64)
    res = llm.generate(texts, SamplingParams(temperature=0, max_tokens=max_tokens))
    seqs = [list(r.prompt_token_ids) + list(r.outputs[0].token_ids) for r in res]
    del llm
    import gc

    gc.collect()
    return seqs


@torch.no_grad()
def target_states(model_dir: str, seqs: list[list[int]], batch: int = 16):
    """Per sequence: (tokens [T], post-norm hidden states [T, d] as fp16, greedy next token [T]);
    and the target's (input embedding, LM head) weights."""
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    E = model.get_output_embeddings().weight
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
    res = [None] * len(seqs)
    for b in tqdm(range(0, len(order), batch), desc="target hidden states"):
        ids = [order[j] for j in range(b, min(b + batch, len(order)))]
        T = max(len(seqs[i]) for i in ids)
        x = torch.full((len(ids), T), 0, dtype=torch.long)
        m = torch.zeros((len(ids), T), dtype=torch.long)
        for r, i in enumerate(ids):
            x[r, : len(seqs[i])] = torch.tensor(seqs[i])
            m[r, : len(seqs[i])] = 1
        h = model.model(input_ids=x, attention_mask=m).last_hidden_state  # after final norm
        lab = (h @ E.T).argmax(-1)
        for r, i in enumerate(ids):
            n = len(seqs[i])
            res[i] = (x[r, :n].clone(), h[r, :n].to(torch.float16).clone(), lab[r, :n].clone())
    emb = model.get_input_embeddings().weight
    return res, (emb.detach().clone(), E.detach().clone() if E is not emb else None)


# ------------------------------------------------------------------ training


def batches(data, seq_len: int, batch: int, rng: random.Random):
    """Random windows [B, seq_len] of (tokens, hidden, labels) from the sequences."""
    while True:
        tok, hid, lab = [], [], []
        for _ in range(batch):
            t, h, y = data[rng.randrange(len(data))]
            s = rng.randrange(0, max(1, len(t) - seq_len))
            sl = slice(s, s + seq_len)
            tok.append(F.pad(t[sl], (0, seq_len - len(t[sl])), value=-1))
            hid.append(F.pad(h[sl].float(), (0, 0, 0, seq_len - len(t[sl]))))
            lab.append(F.pad(y[sl], (0, seq_len - len(t[sl])), value=-1))
        yield torch.stack(tok), torch.stack(hid), torch.stack(lab)


def step_loss(head, W, tok, hid, lab, steps: int, ce_weight: float, noise: float = 0.0,
              vocab: torch.Tensor | None = None, step_weights=(1.0, 0.8, 0.6, 0.5)):
    """EAGLE loss on a batch: inputs at q are (embed(t_{q+1}), h_q), targets are h_{q+1} and the
    target's greedy token after q+1. ``vocab`` (sorted token ids): the cross-entropy is taken
    over these tokens only, at the positions whose label is one of them (the full 49k-token
    head costs ~8x more on CPU). ``W``: the target's (input embedding, LM head or None when
    tied). Returns (loss, {metric: value})."""
    E = W[0] if W[1] is None else W[1]
    emb = F.embedding(tok[:, 1:].clamp(min=0), W[0])
    h_in, h_tgt, y = hid[:, :-1], hid[:, 1:], lab[:, 1:]
    valid = (tok[:, 1:] >= 0)
    if noise:
        h_in = h_in + (torch.rand_like(h_in) - 0.5) * 2 * noise
    outs = head.unroll(emb, h_in, steps)
    total, stats = 0.0, {}
    for s, o in enumerate(outs, 1):
        v = valid.clone()
        v[:, : s - 1] = False
        reg = F.smooth_l1_loss(o[v], h_tgt[v])
        if vocab is None:
            logits, yv = o[v] @ E.T, y[v]
        else:
            yi = torch.searchsorted(vocab, y.clamp(min=0))
            inv = v & (vocab[yi.clamp(max=len(vocab) - 1)] == y)
            logits, yv = o[inv] @ E[vocab].T, yi[inv]
        ce = F.cross_entropy(logits, yv)
        w = step_weights[min(s, len(step_weights)) - 1]
        total = total + w * (reg + ce_weight * ce)
        stats[f"acc{s}"] = (logits.argmax(-1) == yv).float().mean().item()
        if s == 1:
            stats["reg"], stats["ce"] = reg.item(), ce.item()
    return total, stats


@torch.no_grad()
def evaluate(head, W, data, seq_len: int, steps: int) -> dict:
    """Top-1 agreement with the target's greedy token of draft steps 1..steps, teacher chain."""
    head.eval()
    E = W[0] if W[1] is None else W[1]
    hits = [0] * steps
    n = [0] * steps
    for t, h, y in data:
        t, h, y = t[:seq_len][None], h[:seq_len].float()[None], y[:seq_len][None]
        outs = head.unroll(F.embedding(t[:, 1:], W[0]), h[:, :-1], steps)
        for s, o in enumerate(outs):
            pred = (o[0, s:] @ E.T).argmax(-1)
            hits[s] += (pred == y[0, 1 + s:]).sum().item()
            n[s] += pred.numel()
    head.train()
    return {f"acc{s + 1}": hits[s] / max(1, n[s]) for s in range(steps)}


@torch.no_grad()
def simulate_acceptance(head, W, data, k: int = 3, skip: int = 0) -> float:
    """Greedy speculative decoding replayed on the sequences (from token ``skip`` on): at each
    verify step the chain of k drafts is accepted up to its first miss, then decoding moves on
    by accepted + 1. Returns accepted / drafted, what vLLM's acceptance rate counts."""
    head.eval()
    E = W[0] if W[1] is None else W[1]
    acc = tot = 0
    for t, h, y in data:
        outs = head.unroll(F.embedding(t[None, 1:], W[0]), h[None, :-1].float(), k)
        hit = [(o[0] @ E.T).argmax(-1) == y[1:] for o in outs]  # hit[s][q]: step s+1 at q
        p = min(skip, len(t))
        while p + k < len(t) - 1:
            n = 0
            while n < k and hit[n][p + n]:
                n += 1
            acc, tot, p = acc + n, tot + k, p + n + 1
    head.train()
    return acc / max(1, tot)


def _parser() -> argparse.ArgumentParser:
    """The command line's options."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2", help="embedded name or HF folder")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "heads" / "smollm2-eagle"))
    ap.add_argument("--cache", default=None,
                    help="where the generated data are kept "
                    "(default: <vllm-steer cache>/eagle-data)")
    ap.add_argument("--first-prompt", type=int, default=1000)
    ap.add_argument("--prompts", type=int, default=384)
    ap.add_argument("--chunk", type=int, default=384,
                    help="prompts generated (and cached) per engine run")
    ap.add_argument("--gen-tokens", type=int, default=128)
    ap.add_argument("--heldout", type=int, default=16, help="sequences kept out of training")
    ap.add_argument("--seconds", type=float, default=360,
                    help="training time budget (the learning rate decays over it)")
    ap.add_argument("--max-steps", type=int, default=100000,
                    help="step budget; with --seconds 1e9 a run repeats a step count exactly")
    ap.add_argument("--seq-len", type=int, default=96)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--ce-weight", type=float, default=0.1)
    ap.add_argument("--ce-vocab", type=int, default=8192,
                    help="cross-entropy over the N most frequent target tokens of the data "
                    "(0: all)")
    ap.add_argument("--ttt-steps", type=int, default=2)
    ap.add_argument("--noise", type=float, default=0.0)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    return ap


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    from tqdm import tqdm

    from vllm_steer.models import cache_dir, resolve_model

    model = resolve_model(args.model)
    target_cfg = json.loads((Path(model) / "config.json").read_text())
    cache = Path(args.cache or cache_dir() / "eagle-data")
    data = []
    for first in range(args.first_prompt, args.first_prompt + args.prompts, args.chunk):
        n = min(args.chunk, args.first_prompt + args.prompts - first)
        key = f"{Path(model).name}-p{first}-{n}-g{args.gen_tokens}.pt"
        if (cache / key).exists():
            part, W = torch.load(cache / key)
            print(f"data: {cache / key} (cached)")
        else:
            t0 = time.perf_counter()
            seqs = generate_own(model, neutral_prompts(first, n), args.gen_tokens)
            print(f"generated {sum(map(len, seqs))} tokens in {time.perf_counter() - t0:.0f} s")
            part, W = target_states(model, seqs)
            cache.mkdir(parents=True, exist_ok=True)
            torch.save((part, W), cache / key)
        data += part
    heldout, train = data[: args.heldout], data[args.heldout:]
    print(f"{len(train)} training sequences, {sum(len(t) for t, _, _ in train)} tokens; "
          f"{len(heldout)} held out")

    head = EagleHead(head_config(target_cfg))
    vocab = None
    if args.ce_vocab:
        freq = torch.bincount(torch.cat([y for _, _, y in train]), minlength=W[0].shape[0])
        vocab = freq.topk(min(args.ce_vocab, int((freq > 0).sum()))).indices.sort().values
        print(f"cross-entropy over {len(vocab)} tokens: {freq[vocab].sum() / freq.sum():.1%} "
              f"of the training labels")
    opt = torch.optim.AdamW(head.parameters(), lr=args.lr, weight_decay=0.0, betas=(0.9, 0.95))
    it = batches(train, args.seq_len + 1, args.batch, random.Random(args.seed))
    t0 = time.perf_counter()
    bar = tqdm(total=int(args.seconds), desc="train (s)", unit="s")
    step, ema = 0, {}
    while step < args.max_steps and (el := time.perf_counter() - t0) < args.seconds:
        frac = max(el / args.seconds, step / args.max_steps)
        for g in opt.param_groups:  # warmup then cosine, over the time (or step) budget
            g["lr"] = args.lr * min(1.0, (step + 1) / 50) * 0.5 * (1 + math.cos(math.pi * frac))
        loss, st = step_loss(head, W, *next(it), steps=args.ttt_steps, ce_weight=args.ce_weight,
                             noise=args.noise, vocab=vocab)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 0.5)
        opt.step()
        step += 1
        ema = {k: v if k not in ema else 0.95 * ema[k] + 0.05 * v for k, v in st.items()}
        bar.n = int(min(el, args.seconds))
        bar.set_postfix(step=step, **{k: f"{v:.3f}" for k, v in ema.items()})
    bar.close()
    print(f"{step} steps in {time.perf_counter() - t0:.0f} s")
    ev = evaluate(head, W, heldout, 256, 3)
    print("held-out top-1 agreement with the target (teacher-forced chain):",
          {k: round(v, 3) for k, v in ev.items()})
    sim = simulate_acceptance(head, W, heldout)
    print(f"held-out replay of greedy speculative decoding, k=3: acceptance {sim:.3f}")
    ev["replay_acceptance_k3"] = sim
    dtype = getattr(torch, args.dtype)
    if dtype != torch.float32:
        q = EagleHead(head_config(target_cfg))
        q.load_vllm_state(head.vllm_state(dtype))
        evq = evaluate(q, W, heldout, 256, 3)
        evq["replay_acceptance_k3"] = simulate_acceptance(q, W, heldout)
        print(f"after rounding to {args.dtype}:", {k: round(v, 3) for k, v in evq.items()})
    out = save_head(head, Path(args.out), target_cfg, dtype,
                    meta={"steps": step, **{f"heldout_{k}": round(v, 4) for k, v in ev.items()},
                          **{k: v for k, v in vars(args).items() if k not in ("out", "cache")}})
    print(f"saved {out} ({(out / 'model.safetensors').stat().st_size / 1e6:.1f} MB)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
