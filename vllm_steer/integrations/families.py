"""What each model family does around the LM head, and which ones we refuse.

Semantics: see :mod:`vllm_steer.reference`. The steer acts on the input ``c`` of the one
LM-head matmul (``model.get_output_embeddings()`` in transformers; the ``hidden_states``
vLLM's ``LogitsProcessor`` layer receives), so the served logits are

    logits = post((c + sum_i eps_i W_i c)^T E + b)

where ``b`` is the head bias (GPT-J; none elsewhere) and ``post`` is what the family applies
to the logits after the head, unchanged by the steer: Gemma 2/3's final soft-capping
``cap * tanh(l / cap)``, Granite's ``l / logits_scaling``, Cohere's ``l * logit_scale``.
Tied heads (GPT-2, OPT, Qwen2 small, Gemma, Cohere) steer the same way: ``E`` is the
(tied) output embedding. OPT's ``project_out`` (``hidden_size`` -> ``word_embed_proj_dim``,
e.g. opt-350m) runs before the head, so its steers have the head's input size
``word_embed_proj_dim``, not ``hidden_size``: :func:`head_input_size`.

``check_model`` is called once at engine configuration (frontend, before the engine starts)
and refuses an architecture whose sampled logits do not go through the layer we replace (the
steer would be silently ignored). Light: no torch, no vLLM at import time.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from vllm_steer.integrations import vllm_access as va
from vllm_steer.logs import get_logger

logger = get_logger()


@dataclass(frozen=True)
class Family:
    """One model family as vLLM serves it."""

    name: str
    """Human name, as in the docs' table."""
    after_head: str = ""
    """What the family does to the logits after the head (the steer sits before it)."""
    head_input: str = "hidden_size"
    """Config attribute giving the head's input size (the steer's hidden size)."""


#: vLLM architecture -> family; the ones proven by tests/e2e/test_vllm_families.py.
FAMILIES: dict[str, Family] = {
    "GPT2LMHeadModel": Family("GPT-2", "none (head tied to the input embeddings)"),
    "GPTNeoXForCausalLM": Family("GPT-NeoX (Pythia)", "none (served by vLLM's Transformers "
                                                       "backend)"),
    "GPTJForCausalLM": Family("GPT-J", "head bias b added after the steered matmul"),
    "OPTForCausalLM": Family("OPT", "none; project_out runs before the head, so the steer has "
                                    "the head's input size word_embed_proj_dim",
                             head_input="word_embed_proj_dim"),
    "LlamaForCausalLM": Family("Llama"),
    "MistralForCausalLM": Family("Mistral"),
    "Qwen2ForCausalLM": Family("Qwen2"),
    "Qwen3ForCausalLM": Family("Qwen3"),
    "Gemma2ForCausalLM": Family("Gemma 2", "final soft-capping cap*tanh(l/cap)"),
    "Gemma3ForCausalLM": Family("Gemma 3 (text)", "final soft-capping cap*tanh(l/cap) when "
                                                  "configured"),
    "Phi3ForCausalLM": Family("Phi-3"),
    "GraniteForCausalLM": Family("Granite", "logits divided by logits_scaling"),
    "CohereForCausalLM": Family("Cohere (Command-R)", "logits multiplied by logit_scale"),
}

_SUBCLASSED_HEAD = ("its logits layer is vLLM's InklingLogitsProcessor, a subclass of "
                    "LogitsProcessor that vLLM instantiates by its own name, so the plugin's "
                    "replacement of LogitsProcessor never runs and steered requests would be "
                    "served unsteered")

#: vLLM architecture -> why it cannot be steered correctly (refused at start-up).
REFUSED: dict[str, str] = {
    "InklingForCausalLM": _SUBCLASSED_HEAD,
    "InklingForConditionalGeneration": _SUBCLASSED_HEAD,
}


class UnsupportedModelError(ValueError):
    """The model's architecture cannot be steered correctly."""


def head_input_size(model_config) -> int:
    """Input size of the model's LM head (the hidden size a steer must have)."""
    for arch in va.architectures(model_config):
        fam = FAMILIES.get(arch)
        if fam is not None and fam.head_input != "hidden_size":
            size = va.text_config_value(model_config, fam.head_input)
            if isinstance(size, int) and size > 0:
                return size
    return va.hidden_size(model_config)


def check_model(model_config) -> int:
    """Refuse an architecture we cannot steer correctly (naming it and the reason); else
    return the head's input size. Architectures not in :data:`FAMILIES` are served (the steer
    acts on the input of vLLM's logits layer like for the tested ones) with a log line."""
    archs = va.architectures(model_config)
    for arch in archs:
        if arch in REFUSED:
            raise UnsupportedModelError(
                f"vllm-steer: the architecture {arch} ({va.model_name(model_config)}) "
                f"cannot be steered: {REFUSED[arch]}. Serve it without --steer, or use a model "
                "of a supported family (docs/compatibility.md, 'Model families')")
    if not any(a in FAMILIES for a in archs):
        logger.info("vllm-steer: architecture %s is not among the families proven by our tests "
                    "(%s); the steer acts on the input of vLLM's LM-head layer as for them",
                    archs, ", ".join(sorted({f.name for f in FAMILIES.values()})))
    return head_input_size(model_config)


def model_identity(mc) -> dict:
    """The served model (vLLM's ``ModelConfig``) as
    :func:`vllm_steer.vectors.model_fit_problems` checks a vector steer against it: hidden
    size, decoder blocks, name (its path or id, and its ``--served-model-name``) and
    architecture."""
    return dict(hidden_size=va.hidden_size(mc), num_layers=va.num_hidden_layers(mc),
                model_name=str(va.model_name(mc)), model_type=va.model_type(mc),
                served_names=tuple(va.served_model_names(mc)))


#: vLLM decoder blocks that return ``(stream, input residual)``: the residual stream after the
#: block is the first element (the next block starts again from it, ``residual =
#: hidden_states``), not the sum of the two as in Llama-style blocks (``(mlp output,
#: residual)``, summed by the next block's fused add-norm). A vector steer is added to the
#: stream: the first element here, the residual there. Named here: those checked by hand; any
#: other block whose ``forward`` overwrites its ``residual`` before reading it (or has none) is
#: found by :func:`block_returns_stream_first`.
STREAM_FIRST_BLOCKS = frozenset({"CohereDecoderLayer"})


@functools.cache
def block_returns_stream_first(block_cls: type) -> bool:
    """Whether a decoder block class's tuple starts with the residual stream itself: the
    blocks of :data:`STREAM_FIRST_BLOCKS`, every transformers block (vLLM's Transformers
    backend, whose blocks return ``(hidden_states, ...)``), and every block whose ``forward``
    ignores the residual it is given (:func:`ignores_residual`: StableLM, EXAONE 4, PhiMoE,
    Granite MoE hybrid, HyperCLOVA X, Cohere 2 MoE, whose next block and final norm read the
    first element alone). A Llama-style block reads it (``if residual is None: ...``, a
    fused add-norm of the two): the stream is their sum."""
    if block_cls.__name__ in STREAM_FIRST_BLOCKS \
            or block_cls.__module__.startswith("transformers."):
        return True
    forward = getattr(block_cls, "forward", None)
    return forward is not None and ignores_residual(forward) is True


def ignores_residual(forward) -> bool | None:
    """Whether a block's ``forward`` overwrites a ``residual`` parameter before any read of it,
    or has no such parameter (its model then carries the whole stream in the block's first
    output); None when its source cannot be read. Read from the source's syntax tree: the
    first top-level statement of the body that names ``residual`` reads it (False) or assigns
    it without reading it (True)."""
    import ast

    fn = _forward_def(forward)
    if fn is None:
        return None
    args = fn.args
    if "residual" not in {a.arg for a in args.posonlyargs + args.args + args.kwonlyargs}:
        return True
    for stmt in fn.body:
        names = [n for n in ast.walk(stmt) if isinstance(n, ast.Name) and n.id == "residual"]
        if any(isinstance(n.ctx, ast.Load) for n in names):
            return False
        if names:  # assigned, not read: the given residual is dropped
            return True
    return True


def _forward_def(forward):
    """The syntax tree of a block's ``forward`` (its ``def``), None when its source cannot be
    read."""
    import ast
    import inspect
    import textwrap

    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(forward)))
    except (OSError, TypeError, SyntaxError):
        return None
    fn = tree.body[0] if tree.body else None
    return fn if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) else None


@functools.cache
def residual_scaling(block_cls: type) -> tuple[str, str] | None:
    """``(test, factor)`` when a decoder block class's ``forward`` scales the residual stream
    it carries under a condition: its outermost ``if`` whose body multiplies ``residual`` in
    place (``residual *= factor``, or divides it). vLLM's DeepSeek-V2/V3 blocks (and AXK1's,
    openPangu's) do so in fp16 against overflow: ``hidden_states *= 1.0 /
    self.routed_scaling_factor`` in every block, ``residual`` too in block 0 (the test of the
    outer ``if``: fp16 and no ``DeepseekAttention``, or a ``routed_scaling_factor``); the
    final norm undoes it. None: no such ``if`` (every other block), or no readable source."""
    import ast

    forward = getattr(block_cls, "forward", None)
    fn = None if forward is None else _forward_def(forward)
    if fn is None:
        return None
    for node in ast.walk(fn):  # breadth first: the outermost ``if`` first
        if not isinstance(node, ast.If):
            continue
        for stmt in (n for s in node.body for n in ast.walk(s)):
            if isinstance(stmt, ast.AugAssign) and isinstance(stmt.target, ast.Name) \
                    and stmt.target.id == "residual" and isinstance(stmt.op, (ast.Mult, ast.Div)):
                factor = ast.unparse(stmt.value)
                if isinstance(stmt.op, ast.Div):
                    factor = f"1.0 / ({factor})"
                return ast.unparse(node.test), factor
    return None


def stream_scale(block, block_cls: type, dtype) -> float | None:
    """The factor by which the served model's residual stream after ``block`` (an instance of
    vLLM's ``block_cls``, its own class before any steered subclass) differs from the unscaled
    model's (transformers', llama.cpp's, vLLM's in another dtype), in a model of ``dtype``:
    1.0 for every block but those of :func:`residual_scaling` when its test holds (fp16
    DeepSeek-style blocks: ``1 / routed_scaling_factor``). A vector steer's vector is
    multiplied by it, so that it acts as strongly as in the unscaled model. The test and factor
    are evaluated as the block's ``forward`` would (:func:`vllm_access.block_forward_value`).
    None: they cannot be evaluated (the strength would be unknown)."""
    found = residual_scaling(block_cls)
    if found is None:
        return 1.0
    test, factor = found
    try:
        if not va.block_forward_value(block, block_cls, test, dtype):
            return 1.0
        return float(va.block_forward_value(block, block_cls, factor, dtype))
    except Exception:  # any error of vLLM's expression: the strength is unknown
        logger.warning("vllm-steer: cannot evaluate %s.forward's scaling of the residual stream "
                       "(if %s: residual *= %s)", block_cls.__qualname__, test, factor,
                       exc_info=True)
        return None
