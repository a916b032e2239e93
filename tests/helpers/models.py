"""Tiny random-weight models made on the fly (no download), with the embedded model's
tokenizer: a Llama, an EAGLE / EAGLE-3 head, a MiMo-style model with an MTP layer. Every
family we steer: :mod:`helpers.families`."""

from __future__ import annotations

import shutil
from pathlib import Path


def tokenizer_src() -> Path:
    """The embedded model's folder (prepared once, cached): its tokenizer serves every tiny
    model."""
    from vllm_steer.models import prepare_embedded

    return prepare_embedded("smollm2", quiet=True)


def copy_tokenizer(out: Path) -> None:
    """The embedded model's tokenizer files, into a tiny model's folder."""
    src = tokenizer_src()
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (src / f).exists():
            shutil.copy(src / f, Path(out) / f)


def add_bos(folder: Path) -> Path:
    """Make ``folder``'s tokenizer add its BOS token (``<|im_start|>``) before every text, as
    Llama's, Mistral's and Gemma's do (the embedded model's adds nothing)."""
    import json

    path = Path(folder) / "tokenizer.json"
    spec = json.loads(path.read_text())
    bos = {"SpecialToken": {"id": "<|im_start|>", "type_id": 0}}
    spec["post_processor"]["single"] = [bos, *spec["post_processor"]["single"]]
    ids = [t["id"] for t in spec["added_tokens"] if t["content"] == "<|im_start|>"]
    spec["post_processor"]["special_tokens"] = {
        "<|im_start|>": {"id": "<|im_start|>", "ids": ids, "tokens": ["<|im_start|>"]}}
    path.write_text(json.dumps(spec))
    return Path(folder)


def make_tiny_llama(out: Path, hidden: int = 64, layers: int = 2, tie: bool = False,
                    seed: int = 0, bigram: bool = False) -> Path:
    """A random-weight Llama with the embedded model's tokenizer (vocab 49152), saved as an
    HF folder that both transformers and vLLM load. ``bigram``: every layer adds nothing to
    the residual stream (zero attention and MLP output projections), so the head's input is
    the normalised embedding of the current token: a bigram model whose next token an
    EAGLE head can predict exactly (see tests/e2e/test_vllm_specdec.py)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=max(1, hidden // 64), num_key_value_heads=1,
                      head_dim=64,  # vLLM's CPU attention needs head_dim 32/64/128...
                      vocab_size=49152, max_position_embeddings=512, tie_word_embeddings=tie,
                      bos_token_id=1, eos_token_id=2, pad_token_id=2)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():  # larger logits than the default init, so steering changes tokens
        model.lm_head.weight.normal_(0, 0.5)
        if bigram:
            for layer in model.model.layers:
                layer.self_attn.o_proj.weight.zero_()
                layer.mlp.down_proj.weight.zero_()
    model.save_pretrained(out, safe_serialization=True)
    copy_tokenizer(out)
    return out


def make_tiny_eagle(out: Path, method: str = "eagle", hidden: int = 64, seed: int = 0,
                    draft_vocab: int | None = None, weights: dict | None = None) -> Path:
    """A random EAGLE (``method="eagle"``) or EAGLE-3 (``"eagle3"``) head for a tiny Llama of
    hidden size ``hidden``, one decoder layer, saved in the layout of the public checkpoints
    that vLLM's ``EagleLlamaForCausalLM`` / ``Eagle3LlamaForCausalLM`` load:

    - EAGLE: ``fc`` ([hidden, 2 hidden]: token embedding and target hidden state) and
      ``layers.0.*``; the embedding and LM head are the target's (not in the file).
    - EAGLE-3: ``fc`` ([hidden, 3 hidden]: three target layers' hidden states), ``midlayer.*``
      (attention over [embedding, hidden]), ``norm``, its own ``lm_head`` over ``draft_vocab``
      tokens with the ``d2t`` offsets to the target's vocabulary (the first ``draft_vocab``
      token ids here).

    ``weights`` (name -> tensor) replaces random tensors (a trained head)."""
    import json

    import torch
    from safetensors.torch import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    heads, hd, inter, vocab = max(1, hidden // 64), 64, 2 * hidden, 49152
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, std=0.1):
        return torch.randn(*shape, generator=g) * std

    layer = "layers.0." if method == "eagle" else "midlayer."
    attn_in = hidden if method == "eagle" else 2 * hidden
    w = {layer + "self_attn.q_proj.weight": rnd(heads * hd, attn_in),
         layer + "self_attn.k_proj.weight": rnd(hd, attn_in),
         layer + "self_attn.v_proj.weight": rnd(hd, attn_in),
         layer + "self_attn.o_proj.weight": rnd(hidden, heads * hd),
         layer + "mlp.gate_proj.weight": rnd(inter, hidden),
         layer + "mlp.up_proj.weight": rnd(inter, hidden),
         layer + "mlp.down_proj.weight": rnd(hidden, inter),
         layer + "post_attention_layernorm.weight": torch.ones(hidden)}
    cfg = dict(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=1,
               num_attention_heads=heads, num_key_value_heads=1, head_dim=hd, vocab_size=vocab,
               max_position_embeddings=512, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
               tie_word_embeddings=False, model_type="llama", torch_dtype="float32")
    if method == "eagle":
        w["fc.weight"] = rnd(hidden, 2 * hidden)
        cfg["architectures"] = ["LlamaForCausalLM"]
    elif method == "eagle3":
        draft_vocab = draft_vocab or vocab
        w.update({layer + "input_layernorm.weight": torch.ones(hidden),
                  layer + "hidden_norm.weight": torch.ones(hidden),
                  "fc.weight": rnd(hidden, 3 * hidden), "norm.weight": torch.ones(hidden),
                  "lm_head.weight": rnd(draft_vocab, hidden, std=0.5)})
        if draft_vocab != vocab:
            w["d2t"] = torch.zeros(draft_vocab, dtype=torch.int64)  # draft id i -> target id i
        # the target's hidden states before its first layer, between and after its two layers
        cfg.update(architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=draft_vocab,
                   eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 1, 2]},
                   eagle_aux_hidden_state_layer_ids=[0, 1, 2])  # where V2 reads them
    else:
        raise ValueError(f"unknown EAGLE method {method!r}")
    for k, v in (weights or {}).items():
        w[k] = v
    save_file({k: v.contiguous() for k, v in w.items()}, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    return out


def make_tiny_mimo(out: Path, hidden: int = 64, layers: int = 2, seed: int = 0) -> Path:
    """A random MiMo-style model (a Qwen2 with one multi-token-prediction layer,
    ``model.mtp_layers.0.*``, ``num_nextn_predict_layers: 1``): vLLM serves it as the target
    and, with ``{"method": "mtp"}``, its MTP layer as the drafter. transformers loads it as
    the Qwen2 it is (the MTP weights unused)."""
    import json

    import torch
    from safetensors.torch import load_file, save_file
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=max(1, hidden // 64), num_key_value_heads=1,
                      head_dim=64, vocab_size=49152, max_position_embeddings=512,
                      tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(cfg)
    with torch.no_grad():
        model.lm_head.weight.normal_(0, 0.5)
    model.save_pretrained(out, safe_serialization=True)
    weights = load_file(str(Path(out) / "model.safetensors"))
    g = torch.Generator().manual_seed(seed + 1)
    mtp = "model.mtp_layers.0."
    for k, v in list(weights.items()):  # the MTP block: a decoder layer of its own
        if k.startswith("model.layers.0."):
            weights[mtp + k[len("model.layers.0."):]] = (
                torch.randn(v.shape, generator=g) * 0.1 if v.dim() > 1 else v.clone())
    for norm in ("token_layernorm", "hidden_layernorm", "final_layernorm"):
        weights[mtp + norm + ".weight"] = torch.ones(hidden)
    weights[mtp + "input_proj.weight"] = torch.randn(hidden, 2 * hidden, generator=g) * 0.1
    save_file(weights, str(Path(out) / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((Path(out) / "config.json").read_text())
    config.update(architectures=["MiMoForCausalLM"], num_nextn_predict_layers=1)
    (Path(out) / "config.json").write_text(json.dumps(config, indent=1))
    copy_tokenizer(out)
    return Path(out)
