"""Tiny random-weight models of every family we steer, made on the fly (no downloads).

Each builder saves an HF folder (transformers and vLLM both load it) with the embedded
model's tokenizer (vocab 49152). Hidden size 128 (the head input of OPT: 96, its
``word_embed_proj_dim``), 2 layers, head_dim 64 (vLLM's CPU attention needs 32/64/128...).
The output embeddings are drawn larger than the default init so that steering moves tokens,
and where a family has a head bias or a final-logit soft-cap they are set so that they
matter (a bias of std 1, a cap of 5 on logits of std ~5).
"""

from __future__ import annotations

from pathlib import Path

from helpers.models import copy_tokenizer

HIDDEN = 128
VOCAB = 49152
SPECIAL = dict(bos_token_id=1, eos_token_id=2, pad_token_id=2)
SOFTCAP = 5.0


def _cfg(name: str):
    import transformers as tf

    common = dict(vocab_size=VOCAB, **SPECIAL)
    llama_like = dict(hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                      max_position_embeddings=512, **common)
    if name == "gpt2":
        return tf.GPT2Config(n_embd=HIDDEN, n_layer=2, n_head=2, n_positions=512, **common)
    if name == "gpt_neox":
        return tf.GPTNeoXConfig(hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
                                num_hidden_layers=2, num_attention_heads=2, rotary_pct=0.25,
                                max_position_embeddings=512, tie_word_embeddings=False, **common)
    if name == "gptj":
        return tf.GPTJConfig(n_embd=HIDDEN, n_layer=2, n_head=2, rotary_dim=32, n_positions=512,
                             tie_word_embeddings=False, **common)
    if name == "opt":  # like facebook/opt-350m: post-norm layers, project_in/out (128 <-> 96)
        return tf.OPTConfig(hidden_size=HIDDEN, word_embed_proj_dim=96, ffn_dim=2 * HIDDEN,
                            num_hidden_layers=2, num_attention_heads=2, do_layer_norm_before=False,
                            max_position_embeddings=512, **common)
    if name == "llama":
        return tf.LlamaConfig(tie_word_embeddings=False, **llama_like)
    if name == "mistral":
        return tf.MistralConfig(tie_word_embeddings=False, sliding_window=None, **llama_like)
    if name == "qwen2":  # tied, like Qwen2/2.5 0.5B-3B
        return tf.Qwen2Config(tie_word_embeddings=True, use_sliding_window=False,
                              **{k: v for k, v in llama_like.items() if k != "head_dim"})
    if name == "qwen3":
        return tf.Qwen3Config(tie_word_embeddings=True, **llama_like)
    if name == "gemma2":
        return tf.Gemma2Config(final_logit_softcapping=SOFTCAP, attn_logit_softcapping=50.0,
                               query_pre_attn_scalar=64, sliding_window=256, **llama_like)
    if name == "gemma3_text":
        return tf.Gemma3TextConfig(final_logit_softcapping=SOFTCAP, query_pre_attn_scalar=64,
                                   sliding_window=256, **llama_like)
    if name == "phi3":
        return tf.Phi3Config(tie_word_embeddings=False,
                             **{k: v for k, v in llama_like.items() if k != "head_dim"})
    if name == "granite":  # logits divided by logits_scaling after the head
        return tf.GraniteConfig(tie_word_embeddings=False, logits_scaling=4.0,
                                embedding_multiplier=2.0, residual_multiplier=0.5,
                                attention_multiplier=0.125, **llama_like)
    if name == "cohere":  # logits multiplied by logit_scale after the (tied) head
        return tf.CohereConfig(logit_scale=0.5, tie_word_embeddings=True,
                               **{k: v for k, v in llama_like.items() if k != "head_dim"})
    raise KeyError(name)


#: family name -> the architecture string its config.json carries
ARCHITECTURES = {
    "gpt2": "GPT2LMHeadModel", "gpt_neox": "GPTNeoXForCausalLM", "gptj": "GPTJForCausalLM",
    "opt": "OPTForCausalLM", "llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM", "phi3": "Phi3ForCausalLM",
    "granite": "GraniteForCausalLM", "cohere": "CohereForCausalLM",
}
FAMILIES = list(ARCHITECTURES)


def make_family_model(name: str, out: Path, seed: int = 0) -> Path:
    """Save a tiny random model of family ``name`` (see :data:`FAMILIES`) to ``out``."""
    import torch
    from transformers import AutoModelForCausalLM

    cfg = _cfg(name)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    assert type(model).__name__ == ARCHITECTURES[name], type(model).__name__
    head = model.get_output_embeddings()
    with torch.no_grad():  # larger logits than the default init, so steering changes tokens
        head.weight.normal_(0, 0.5)
        if getattr(head, "bias", None) is not None:
            head.bias.normal_(0, 1.0)
    model.save_pretrained(out, safe_serialization=True)
    copy_tokenizer(out)
    return out


# ---- the engine pass: several small engines, one after another, in one process -----------
ENGINE_KW = dict(dtype="float32", max_model_len=64, max_num_seqs=8, enforce_eager=True, seed=0,
                 kv_cache_memory_bytes=1 << 24, enable_prefix_caching=False)
TOP = 5  # logprobs returned per position (prompt and generated)


def _run_engines(spec: dict, plugin: bool) -> dict:
    """Per family: for each request (prompt ids, steer), the generated tokens and, at every
    prompt and generated position, ``{token: logprob}`` of the top ``TOP`` and the actual
    token. ``plugin=False``: stock vLLM (no plugin loaded), unsteered requests only."""
    import gc

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    results = {}
    for fam in spec["families"]:
        kw = dict(ENGINE_KW)
        if plugin:
            kw["additional_config"] = {"vllm_steer": {"steers": fam["steers"]}}
        if not plugin and fam["name"] not in spec.get("vanilla", []):
            continue
        if plugin and fam.get("ready"):  # the test process is still writing its steers
            _wait_for(fam["ready"], spec.get("wait_s", 900))
        reqs = [r for r in spec["requests"] if plugin or not r["steer"]]
        gc.freeze()  # vLLM's gc.collect() calls as an engine starts (1-2 s) skip what exists now
        try:
            llm = LLM(fam["model"], **kw)
        except Exception as e:  # noqa: BLE001 -- reported to the test, which asserts on it
            results[fam["name"]] = {"error": f"{type(e).__name__}: {e}"}
            continue
        params = [SamplingParams(temperature=0, max_tokens=spec["max_tokens"], logprobs=TOP,
                                 prompt_logprobs=TOP,
                                 extra_args={"steer": r["steer"]} if r["steer"] else None)
                  for r in reqs]
        outs = llm.generate([TokensPrompt(prompt_token_ids=r["ids"]) for r in reqs], params,
                            use_tqdm=False)
        fam_out = []
        for r, o in zip(reqs, outs, strict=False):
            c = o.outputs[0]
            pos = [{str(t): e.logprob for t, e in d.items()} for d in o.prompt_logprobs[1:]]
            pos += [{str(t): e.logprob for t, e in d.items()} for d in c.logprobs]
            fam_out.append({"steer": r["steer"], "ids": r["ids"], "tokens": list(c.token_ids),
                            "logprobs": pos})
        results[fam["name"]] = {"requests": fam_out}
        del llm, outs
        gc.collect()
    return results


def _wait_for(path: str, timeout: float) -> None:
    import os
    import time

    t0 = time.time()
    while not os.path.exists(path):
        if time.time() - t0 > timeout:
            raise TimeoutError(f"{path} did not appear within {timeout:.0f} s")
        time.sleep(0.2)


def _check_refusals(spec: dict) -> dict:
    """Start-up of each refused model: the error message (no engine is built)."""
    from vllm.engine.arg_utils import EngineArgs

    out = {}
    for fam in spec.get("refused", []):
        try:
            EngineArgs(fam["model"], additional_config={"vllm_steer": {"steers": fam["steers"]}},
                       **ENGINE_KW).create_engine_config()
            out[fam["name"]] = "accepted"
        except Exception as e:  # noqa: BLE001
            out[fam["name"]] = f"{type(e).__name__}: {e}"
    return out


def _inspect_in_process(archs: list[str]) -> None:
    """Register the native model classes by class: vLLM then inspects them in this process
    instead of spawning one Python per architecture (cached on disk after the first run, but
    a fresh machine would pay ~10-30 s per architecture). The Transformers-backend ones stay
    as they are."""
    import importlib

    from vllm import ModelRegistry

    for arch in archs:
        entry = ModelRegistry.models.get(arch)
        module = getattr(entry, "module_name", "")
        if not module or module.endswith(".transformers"):
            continue
        ModelRegistry.register_model(
            arch, getattr(importlib.import_module(module), entry.class_name))


def main(argv: list[str]) -> None:
    """``python -m helpers.families SPEC.json OUT.json`` (``tests`` on the path): stock vLLM
    first (plugins off by
    VLLM_PLUGINS=none), then the plugin registered by hand, in one process (engine core
    in-process: VLLM_ENABLE_V1_MULTIPROCESSING=0)."""
    import json
    import os
    import time

    assert os.environ.get("VLLM_PLUGINS") == "none"
    assert os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0"
    spec = json.loads(Path(argv[0]).read_text())
    t0 = time.time()
    _inspect_in_process([ARCHITECTURES[f["name"]] for f in spec["families"]])
    vanilla = _run_engines(spec, plugin=False)
    t1 = time.time()
    from vllm_steer.integrations.plugin import register

    register()
    steered = _run_engines(spec, plugin=True)
    refusals = _check_refusals(spec)
    t2 = time.time()
    Path(argv[1]).write_text(json.dumps({"vanilla": vanilla, "steered": steered,
                                         "refusals": refusals,
                                         "seconds": {"vanilla": t1 - t0, "steered": t2 - t1}}))


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
