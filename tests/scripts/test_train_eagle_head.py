"""benchmarks/train_eagle_head.py: the head's layout, maths and a training step (CPU, no engine)."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import pytest  # noqa: E402
import torch  # noqa: E402
import train_eagle_head as te  # noqa: E402
from helpers.models import make_tiny_eagle  # noqa: E402

TINY = dict(hidden_size=64, intermediate_size=128, num_attention_heads=1, num_key_value_heads=1,
            head_dim=64, vocab_size=49152, rms_norm_eps=1e-5, max_position_embeddings=512,
            rope_parameters={"rope_theta": 10000.0, "rope_type": "default"},
            architectures=["LlamaForCausalLM"], model_type="llama", num_hidden_layers=2)


@pytest.fixture(autouse=True)
def _threads():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _random_head(cfg, seed=0):
    torch.manual_seed(seed)
    head = te.EagleHead(te.head_config(cfg))
    for p in head.parameters():
        p.data.normal_(std=0.1)
    return head


def test_saved_head_has_the_layout_vllm_loads(tmp_path):
    """Same keys, shapes and config fields as the conftest head the EAGLE engine tests load."""
    from safetensors.torch import load_file
    from vllm.transformers_utils.configs.eagle import EAGLEConfig

    out = te.save_head(_random_head(TINY), tmp_path / "head", TINY, torch.bfloat16)
    ref = make_tiny_eagle(tmp_path / "ref", "eagle", hidden=64)
    got = load_file(str(out / "model.safetensors"))
    want = load_file(str(ref / "model.safetensors"))
    assert {k: v.shape for k, v in got.items()} == {k: v.shape for k, v in want.items()}
    assert all(v.dtype == torch.bfloat16 for v in got.values())
    assert not any("embed" in k or "lm_head" in k for k in got)  # vLLM shares the target's
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 1 and cfg["architectures"] == ["LlamaForCausalLM"]
    for k in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
              "vocab_size", "rms_norm_eps", "rope_parameters"):
        assert cfg[k] == TINY[k], k
    # how vLLM reads the folder for method "eagle": EagleLlamaForCausalLM, one layer
    ec = EAGLEConfig(model=cfg, method="eagle")
    assert ec.architectures == ["EagleLlamaForCausalLM"]
    assert ec.model.num_hidden_layers == 1 and ec.model.hidden_size == 64
    # the saved tensors load back into the module they came from
    head2 = te.EagleHead(te.head_config(TINY))
    head2.load_vllm_state(got)
    assert torch.equal(head2.fc.weight, got["fc.weight"].float())


def test_head_is_a_llama_layer_without_input_norm_and_without_final_norm():
    """forward == fc, then transformers' LlamaDecoderLayer with input_layernorm = identity
    (what vLLM does to layer 0 of an EAGLE head), whose output is hidden + residual."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    head = _random_head(TINY)
    lc = LlamaConfig(**{k: v for k, v in TINY.items() if k != "architectures"})
    lc._attn_implementation = "eager"
    layer = LlamaDecoderLayer(lc, 0).eval()
    sd = {k.removeprefix("layers.0."): v for k, v in head.vllm_state().items() if k != "fc.weight"}
    layer.load_state_dict(sd | {"input_layernorm.weight": torch.full((64,), 3.0)})
    layer.input_layernorm = torch.nn.Identity()
    emb, hid = torch.randn(2, 12, 64), torch.randn(2, 12, 64)
    x = head.fc(torch.cat((emb, hid), -1))
    pos = torch.arange(12)[None]
    mask = torch.full((12, 12), float("-inf")).triu(1)[None, None]
    ref = layer(x, attention_mask=mask, position_ids=pos,
                position_embeddings=LlamaRotaryEmbedding(lc)(x, pos))
    ref = ref[0] if isinstance(ref, tuple) else ref
    torch.testing.assert_close(head(emb, hid), ref, atol=1e-5, rtol=1e-5)


def test_unrolled_step_matches_a_pass_with_the_drafts_own_hidden_state():
    """Draft step s at q sees the teacher keys up to q-s+1 and its own chain's earlier steps:
    the same as a plain causal pass whose last s-1 hidden states are the previous outputs."""
    head = _random_head(TINY, seed=1)
    emb, hid = torch.randn(1, 10, 64), torch.randn(1, 10, 64)
    outs = head.unroll(emb, hid, 3)
    torch.testing.assert_close(outs[0], head(emb, hid))
    q = 6
    h2 = hid.clone()
    h2[:, q] = outs[0][:, q - 1]
    torch.testing.assert_close(outs[1][:, q], head(emb[:, : q + 1], h2[:, : q + 1])[:, q])
    h3 = hid.clone()
    h3[:, q - 1], h3[:, q] = outs[0][:, q - 2], outs[1][:, q - 1]
    torch.testing.assert_close(outs[2][:, q], head(emb[:, : q + 1], h3[:, : q + 1])[:, q])


def test_one_training_step_on_a_tiny_llama_lowers_the_loss(tiny_model_dir):
    seqs = [[random.Random(i).randrange(3, 49152) for _ in range(24)] for i in range(4)]
    data, W = te.target_states(str(tiny_model_dir), seqs, batch=4)
    assert W[1] is not None  # the tiny Llama's head is untied: embedding and head differ
    t, h, y = data[0]
    assert h.shape == (24, 64) and y.shape == (24,) and torch.equal(t, torch.tensor(seqs[0]))
    # h is what the LM head sees (after the final norm): its logits are the model's
    from transformers import AutoModelForCausalLM

    with torch.no_grad():
        model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
        logits = model(input_ids=t[None]).logits[0]
    torch.testing.assert_close(h.float() @ W[1].T, logits, atol=2e-2, rtol=1e-2)
    assert torch.equal(y, logits.argmax(-1))
    batch = next(te.batches(data, 16, 4, random.Random(0)))
    cfg = json.loads((Path(tiny_model_dir) / "config.json").read_text())
    for vocab in (None, torch.unique(torch.cat([d[2] for d in data]))):
        torch.manual_seed(0)
        head = te.EagleHead(te.head_config(cfg))
        opt = torch.optim.SGD(head.parameters(), lr=0.05)
        before, _ = te.step_loss(head, W, *batch, steps=2, ce_weight=0.1, vocab=vocab)
        opt.zero_grad()
        before.backward()
        opt.step()
        after, stats = te.step_loss(head, W, *batch, steps=2, ce_weight=0.1, vocab=vocab)
        assert after.item() < before.item()
        assert {"acc1", "acc2", "reg", "ce"} <= set(stats)
    rate = te.simulate_acceptance(head, W, data, k=3)
    assert 0.0 <= rate <= 1.0
