"""Vector steers on vLLM's own decoder blocks, without an engine: the vector lands in the
residual stream whatever the block returns. Llama-style blocks return ``(mlp output,
residual)``, summed by the next block's fused add-norm; others (StableLM, EXAONE 4, PhiMoE,
Granite MoE hybrid, HyperCLOVA X, Cohere) return ``(stream, input residual)``, whose second
element the next block and the final norm never read. DeepSeek-style blocks in fp16 divide the
stream by their routed_scaling_factor: the vector is divided by it too."""

from __future__ import annotations

import importlib

import pytest
import torch
from torch import nn

from vllm_steer.integrations.families import (block_returns_stream_first, residual_scaling,
                                               stream_scale)
from vllm_steer.integrations.worker.decoder_layers import (COEFS_BUFFER, VECTORS_BUFFER,
                                                           steered_class)

STREAM_FIRST = [("stablelm", "StablelmDecoderLayer"), ("exaone4", "Exaone4DecoderLayer"),
                ("phimoe", "PhiMoEDecoderLayer"), ("commandr", "CohereDecoderLayer"),
                ("granitemoehybrid", "GraniteMoeHybridAttentionDecoderLayer"),
                ("hyperclovax", "HyperCLOVAXDecoderLayer"),
                ("cohere2_moe", "Cohere2MoeDecoderLayer")]
SUMMED = [("llama", "LlamaDecoderLayer"), ("qwen2", "Qwen2DecoderLayer"),
          ("gemma2", "Gemma2DecoderLayer"), ("mistral", "MistralDecoderLayer"),
          ("qwen3_moe", "Qwen3MoeDecoderLayer"), ("deepseek_v2", "DeepseekV2DecoderLayer")]


def _block_class(module: str, name: str) -> type:
    return getattr(importlib.import_module(f"vllm.model_executor.models.{module}"), name)


@pytest.mark.parametrize("module,name", STREAM_FIRST + SUMMED)
def test_each_vllm_block_is_read_as_its_forward_returns_the_stream(module, name):
    # read from each class's own forward: a block that drops the residual it is given
    # (``residual = hidden_states`` first) returns the stream first
    assert block_returns_stream_first(_block_class(module, name)) is ((module, name)
                                                                     in STREAM_FIRST)


def test_a_stream_first_blocks_vector_reaches_the_models_output():
    """vLLM's real StableLM model and block code (stand-in attention and MLP, fp32): the
    steered block's vector is in the model's output as a hook adding it to that block's
    output stream puts it (llama.cpp's build_cvec, transformers' output_hidden_states); it
    was added to the dropped second element before, and the output was the unsteered one."""
    sl = importlib.import_module("vllm.model_executor.models.stablelm")
    torch.manual_seed(0)
    d, tokens = 16, 5

    class Attn(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(d, d)

        def forward(self, positions, hidden_states):
            return self.proj(hidden_states)

    def block():
        b = sl.StablelmDecoderLayer.__new__(sl.StablelmDecoderLayer)
        nn.Module.__init__(b)
        b.input_layernorm, b.post_attention_layernorm = nn.LayerNorm(d), nn.LayerNorm(d)
        b.self_attn, b.mlp = Attn(), nn.Linear(d, d)
        return b

    model = sl.StableLMEpochModel.__new__(sl.StableLMEpochModel)
    nn.Module.__init__(model)
    model.layers = nn.ModuleList([block(), block()])
    model.start_layer, model.end_layer = 0, 2
    model.norm = nn.LayerNorm(d)

    class OnePipelineStage:
        is_first_rank = is_last_rank = True

    x, pos = torch.randn(tokens, d), torch.arange(tokens)
    v, strength = torch.randn(d) * 3, 0.7
    orig = sl.get_pp_group
    sl.get_pp_group = lambda: OnePipelineStage()
    try:
        with torch.no_grad():
            plain = model.forward(None, pos, None, inputs_embeds=x)
            hook = model.layers[0].register_forward_hook(
                lambda mod, args, out: (out[0] + strength * v, out[1]))
            want = model.forward(None, pos, None, inputs_embeds=x)
            hook.remove()
            steered = model.layers[0]
            steered.__class__ = steered_class(sl.StablelmDecoderLayer)
            steered.register_buffer(COEFS_BUFFER, torch.full((64, 1), strength),
                                    persistent=False)
            steered.register_buffer(VECTORS_BUFFER, v[None].clone(), persistent=False)
            got = model.forward(None, pos, None, inputs_embeds=x)
    finally:
        sl.get_pp_group = orig
    assert (want - plain).abs().max() > 0.1  # the vector changes the output
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


# ---- DeepSeek-style blocks in fp16: vLLM scales the residual stream ------------------------
RSF = 4.0  # routed_scaling_factor (2.5 in DeepSeek-V3, 16 in DeepSeek-V2)
#: vLLM's blocks that divide the residual stream by their routed_scaling_factor in fp16
SCALED = [("deepseek_v2", "DeepseekV2DecoderLayer"), ("AXK1", "AXK1DecoderLayer"),
          ("openpangu", "OpenPanguDecoderLayer")]


def _bare_block(module: str, name: str, attention: type = nn.Module, rsf=RSF):
    """One of vLLM's blocks (``__new__``) with what its fp16 test reads: its attention (of
    class ``attention``) and routed_scaling_factor."""
    cls = _block_class(module, name)
    b = cls.__new__(cls)
    nn.Module.__init__(b)
    b.self_attn, b.routed_scaling_factor, b.layer_idx = attention(), rsf, 1
    return b


@pytest.mark.parametrize("module,name", STREAM_FIRST + SUMMED + SCALED)
def test_only_deepseek_style_blocks_in_fp16_scale_the_stream(module, name):
    """Read from each block's forward and evaluated as it would be: 1 / routed_scaling_factor
    for the DeepSeek-V2/V3, AXK1 and openPangu blocks in fp16; 1.0 for them in bf16 and fp32,
    and for every other block whatever the dtype."""
    cls = _block_class(module, name)
    scaled = (module, name) in SCALED
    assert (residual_scaling(cls) is not None) is scaled
    block = _bare_block(module, name) if scaled else None
    assert stream_scale(block, cls, torch.float16) == (1 / RSF if scaled else 1.0)
    assert stream_scale(block, cls, torch.bfloat16) == 1.0
    assert stream_scale(block, cls, torch.float32) == 1.0


def test_deepseek_blocks_not_scaled_without_mla_or_a_scaling_factor():
    """DeepSeek (V1)'s MHA attention (``DeepseekAttention``) keeps the stream unscaled in fp16
    (vLLM's test: ``not isinstance(self.self_attn, DeepseekAttention)``); so does an openPangu
    block without a routed_scaling_factor (``self.routed_scaling_factor is not None``)."""
    ds = importlib.import_module("vllm.model_executor.models.deepseek_v2")
    for module, name in SCALED[:2]:
        block = _bare_block(module, name, attention=lambda: ds.DeepseekAttention.__new__(
            ds.DeepseekAttention))
        assert stream_scale(block, type(block), torch.float16) == 1.0
    pangu = _bare_block(*SCALED[2], rsf=None)
    assert stream_scale(pangu, type(pangu), torch.float16) == 1.0


def _deepseek_model(dtype: torch.dtype, d: int = 16):
    """Three of vLLM's real ``DeepseekV2DecoderLayer`` (layer_idx 0, 1, 2; their own forward),
    with stand-ins for what a worker builds around them: an attention that is not
    ``DeepseekAttention`` (MLA's place), a dense MLP of class ``DeepseekV2MLP`` in block 0 and
    an MoE in blocks 1 and 2 that, in fp16, returns its output divided by the
    routed_scaling_factor as vLLM's MoE runner does (shared experts / rsf, routed experts not
    multiplied by it), fused add-RMSNorms as vLLM's ``RMSNorm(x, residual)``, and the final
    norm. Weights: seed 0, cast to ``dtype``."""
    ds = importlib.import_module("vllm.model_executor.models.deepseek_v2")
    torch.manual_seed(0)

    class AddRMSNorm(nn.Module):  # vLLM's RMSNorm: x, or (normed x + residual, x + residual)
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(1 + 0.1 * torch.randn(d))

        def forward(self, x, residual=None):
            if residual is not None:
                x = x + residual
                residual = x
            xf = x.float()
            out = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)
                   * self.weight.float()).to(x.dtype)
            return out if residual is None else (out, residual)

    class Attn(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(d, d)

        def forward(self, positions, hidden_states, llama_4_scaling=None):
            return self.proj(hidden_states)

    class MLP(ds.DeepseekV2MLP):
        def __init__(self):
            nn.Module.__init__(self)
            self.up, self.down = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

        def forward(self, x):
            return self.down(torch.nn.functional.silu(self.up(x)))

    class MoE(nn.Module):
        def __init__(self):
            super().__init__()
            self.shared, self.routed = nn.Linear(d, d), nn.Linear(d, d)

        def forward(self, x):
            if x.dtype == torch.float16:
                return self.shared(x) * (1.0 / RSF) + self.routed(x)
            return self.shared(x) + self.routed(x) * RSF

    def block(idx):
        b = ds.DeepseekV2DecoderLayer.__new__(ds.DeepseekV2DecoderLayer)
        nn.Module.__init__(b)
        b.layer_idx, b.routed_scaling_factor, b.hidden_size = idx, RSF, d
        b.use_mha = b.use_sequence_parallel_moe = False
        b.self_attn, b.mlp = Attn(), MLP() if idx == 0 else MoE()
        b.input_layernorm, b.post_attention_layernorm = AddRMSNorm(), AddRMSNorm()
        return b

    model = nn.Module()
    model.layers = nn.ModuleList([block(i) for i in range(3)])
    model.start_layer, model.end_layer = 0, 3
    model.norm = AddRMSNorm()
    return model.to(dtype)


def _deepseek_forward(model, x):
    """What ``DeepseekV2Model.forward`` does with the blocks (one pipeline stage)."""
    hidden, residual = x, None
    pos = torch.arange(x.shape[0])
    for layer in model.layers:
        hidden, residual = layer(pos, hidden, residual)
    return model.norm(hidden, residual)[0]


def test_a_deepseek_fp16_models_vector_acts_as_strongly_as_in_the_unscaled_model():
    """vLLM's real DeepSeek-V2/V3 block code in fp16 divides the residual stream by its
    routed_scaling_factor (block 0 its residual, every block its attention and MLP outputs; the
    final norm undoes it). The served vector steer (through ``install`` and the vector bank,
    in fp16) equals the reference: the same blocks in fp32, where vLLM does not scale, with a
    plain hook adding ``a v_k`` to block k's output stream, then the final norm. Unsteered
    tokens keep the unsteered model's bits. fp16 on the CPU, tiny sizes."""
    from vllm_steer.integrations.worker.decoder_layers import install
    from vllm_steer.integrations.worker.step_mapping import LayerVectors
    from vllm_steer.vectors import make_vector_steer

    d, tokens, a = 16, 5, 0.8
    x = torch.randn(tokens, d, generator=torch.Generator().manual_seed(1))
    v = {0: torch.randn(d, generator=torch.Generator().manual_seed(2)) * 2,
         2: torch.randn(d, generator=torch.Generator().manual_seed(3)) * 2}
    steered_tokens = torch.tensor([1.0, 1.0, 0.0, 1.0, 1.0])  # token 2 unsteered
    ref = _deepseek_model(torch.float32, d)

    def add_at(k):  # the llama.cpp / transformers reference: the stream is hidden + residual
        return lambda mod, args, out: (out[0], out[1] + a * steered_tokens[:, None] * v[k])

    with torch.no_grad():
        plain32 = _deepseek_forward(ref, x)
        hooks = [ref.layers[k].register_forward_hook(add_at(k)) for k in v]
        want = _deepseek_forward(ref, x)
        for h in hooks:
            h.remove()

        served = _deepseek_model(torch.float16, d)
        plain16 = _deepseek_forward(served, x.half())
        layers = LayerVectors([0, 1, 2], 3, 2, d, max_tokens=8, device=torch.device("cpu"))
        install(served, layers, 3)
        layers.put(1, make_vector_steer(v, "v"))
        layers.token_coefs[:tokens, 1] = a * steered_tokens
        got = _deepseek_forward(served, x.half())

    # vLLM's fp16 scaling is invisible after the final norm (the unsteered models agree)
    torch.testing.assert_close(plain16.float(), plain32, rtol=0, atol=2e-2)
    effect = (want - plain32).abs().max()
    assert effect > 0.5, effect  # the vector changes the output
    served_error = (got.float() - want).abs().max()
    assert served_error < 3e-2, (f"served fp16 output differs from the reference by "
                                 f"{served_error:.3f} (the vector's effect: {effect:.3f})")
    assert torch.equal(got[2], plain16[2])  # an unsteered token: the same bits
