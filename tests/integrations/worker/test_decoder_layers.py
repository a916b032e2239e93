"""Vector steers on vLLM's own decoder blocks, without an engine: the vector lands in the
residual stream whatever the block returns. Llama-style blocks return ``(mlp output,
residual)``, summed by the next block's fused add-norm; others (StableLM, EXAONE 4, PhiMoE,
Granite MoE hybrid, HyperCLOVA X, Cohere) return ``(stream, input residual)``, whose second
element the next block and the final norm never read."""

from __future__ import annotations

import importlib

import pytest
import torch
from torch import nn

from vllm_steer.integrations.families import block_returns_stream_first
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
