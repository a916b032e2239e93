"""Steers applied inside the model's decoder blocks (vector steers: ``h_k += a v_k``), in the
forward vLLM compiles. Semantics: see :func:`vllm_steer.reference.vector_steer_reference`.

Once a worker's model is loaded (before vLLM compiles it or captures CUDA graphs), each of its
decoder blocks gets a subclass of its own class (:func:`install`) whose ``forward`` calls the
block's and adds the block's vectors to its output
(:func:`~vllm_steer.kernels.layer_vectors.add_to_block_output`), reading two persistent
buffers registered on the block (non-persistent module buffers: never in a state dict):
the step mapping's per-token coefficients and the vector bank's rows of that block
(:class:`~vllm_steer.integrations.worker.step_mapping.LayerVectors`). torch.compile traces the
op into the model's graph like the block's own code; CUDA graphs replay it reading the
buffers in place. No custom op, no graph split, no eager fallback.

Only an engine configured for decoder-layer steers gets the op (a vector steer among its
``--steer`` files, or ``--steer-vectors``): any other engine's model is left as vLLM built it.

The blocks are found the way vLLM lays them out (``make_layers``): the module with
``start_layer`` / ``end_layer`` and a ``ModuleList`` of as many entries as the model's
``num_hidden_layers`` (GPT-2's ``h``, the others' ``layers``); a pipeline stage's blocks are
its ``start_layer`` to ``end_layer``.
"""

from __future__ import annotations

import torch

from vllm_steer.integrations import vllm_access as va
from vllm_steer.integrations.families import block_returns_stream_first, stream_scale
from vllm_steer.kernels.layer_vectors import add_to_block_output

#: The buffers registered on each steered block.
COEFS_BUFFER = "vllm_steer_token_coefs"
VECTORS_BUFFER = "vllm_steer_vectors"

_CLASSES: dict[type, type] = {}


class DecoderLayersNotFoundError(RuntimeError):
    """The model's decoder blocks could not be found (or read): decoder-layer steers cannot be
    served."""


def find_blocks(model: torch.nn.Module, num_blocks: int) -> tuple[list[int], list]:
    """``(block indices, block modules)`` of this worker's decoder blocks (0-based indices of
    the model's ``num_blocks``)."""
    for _, module in model.named_modules():
        layers = va.layer_range(module)
        if layers is None:
            continue
        start, end = layers
        for child in module.children():
            if isinstance(child, torch.nn.ModuleList) and len(child) == num_blocks:
                idx = list(range(start, end))
                return idx, [child[k] for k in idx]
    # vLLM's Transformers backend (GPT-NeoX and others): the transformers model's own list,
    # this stage's blocks being those not replaced by vLLM's PPMissingLayer
    for _, module in model.named_modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) == num_blocks:
            idx = [k for k, b in enumerate(module) if not va.is_pp_missing_layer(b)]
            if idx and all(_is_block(module[k]) for k in idx):
                return idx, [module[k] for k in idx]
    raise DecoderLayersNotFoundError(
        f"vllm-steer: the decoder blocks of {type(model).__name__} could not be found (no "
        f"module with start_layer/end_layer and a list of its {num_blocks} blocks), so vector "
        "steers cannot be applied to this model; serve it without vector steers")


def _is_block(m: torch.nn.Module) -> bool:
    """A decoder block (it has parameters of its own, unlike a list of norms or caches)."""
    return any(True for _ in m.parameters()) and len(list(m.children())) > 1


def steered_class(cls: type) -> type:
    """``cls`` with its output steered (one subclass per block class, made once)."""
    sub = _CLASSES.get(cls)
    if sub is None:
        base_forward = cls.forward
        stream_first = block_returns_stream_first(cls)  # (stream, ...) or (mlp, residual)

        def forward(self, *args, **kwargs):
            out = base_forward(self, *args, **kwargs)
            return add_to_block_output(out, getattr(self, COEFS_BUFFER),
                                       getattr(self, VECTORS_BUFFER), stream_first)

        forward.__doc__ = f"{cls.__qualname__}.forward, then its vector steers (see the module)."
        sub = type(f"Steered{cls.__name__}", (cls,), {"forward": forward,
                                                       "__module__": __name__})
        _CLASSES[cls] = sub
    return sub


def install(model: torch.nn.Module, layers, num_blocks: int,
            model_dtype: torch.dtype | None = None) -> int:
    """Give each of ``model``'s decoder blocks in this worker the op reading ``layers``
    (:class:`~vllm_steer.integrations.worker.step_mapping.LayerVectors`), and set each block's
    stream scale in ``layers`` (:func:`~vllm_steer.integrations.families.stream_scale`: not 1
    in an fp16 DeepSeek-style model, whose residual stream vLLM scales). ``model_dtype``: the
    dtype of its hidden states (None: its first floating-point parameter's). Returns the
    number of blocks steered."""
    blocks, modules = find_blocks(model, num_blocks)
    if blocks != layers.blocks:
        raise DecoderLayersNotFoundError(
            f"vllm-steer: this worker's decoder blocks are {blocks[:1]}..{blocks[-1:]} but the "
            f"vector bank was made for {layers.blocks[:1]}..{layers.blocks[-1:]}")
    if model_dtype is None:
        model_dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()),
                           torch.float32)
    scales = []
    for block in modules:
        own = type(block).__bases__[0] if type(block) in _CLASSES.values() else type(block)
        scale = stream_scale(block, own, model_dtype)
        if scale is None:
            raise DecoderLayersNotFoundError(
                f"vllm-steer: {own.__qualname__} scales its residual stream under a condition "
                "vllm-steer cannot evaluate, so a vector steer's strength there is unknown; "
                "serve this model without vector steers (or in bfloat16)")
        scales.append(scale)
    layers.set_stream_scales(scales)
    for k, block in zip(blocks, modules, strict=True):
        cls = None if type(block) in _CLASSES.values() else steered_class(type(block))
        va.steer_block(block, cls, ((COEFS_BUFFER, layers.token_coefs),
                                    (VECTORS_BUFFER, layers.block_vectors(k))))
    return len(modules)


def local_blocks(model: torch.nn.Module, num_blocks: int) -> list[int]:
    """This worker's decoder blocks (0-based)."""
    return find_blocks(model, num_blocks)[0]


__all__ = ["install", "find_blocks", "local_blocks", "steered_class",
           "DecoderLayersNotFoundError", "COEFS_BUFFER", "VECTORS_BUFFER"]
