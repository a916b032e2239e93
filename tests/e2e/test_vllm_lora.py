"""LoRA adapters with the plugin installed (vLLM's LoRA wraps our LM head).

vLLM's LoRA logits wrapper calls ``type(base_layer).forward(wrapper, ...)``; the head must
work with that ``self``. Two tiny random adapters in peft's on-disk format (written here by
hand; peft is not needed): one on the attention projections, one also on ``lm_head``. The
reference is plain torch: the adapter merged into the weights (``W + alpha/r B A``), the steer
applied by hand (``c + s eps (c P1) P2^T``) before the merged LM head.

vLLM's CPU LoRA has a mixed-batch bug of its own (rows without an adapter use the last slot's
adapter; it reproduces with ``VLLM_PLUGINS=none``), so each request runs alone here.

Two engines: an offline ``LLM`` with steers, and ``vllm serve`` with LoRA and no ``--steer``
(the plugin installed, nothing configured: LoRA must work, a steered request is refused).
"""

from __future__ import annotations

import json

import pytest
import requests
import torch

from helpers.steers import random_steer, random_vectors, save_vector_steer
from vllm_steer.format import load_steer, save_steer
from vllm_steer.server.launch import serve

pytestmark = pytest.mark.vllm

RANK, ALPHA = 8, 16
VECTORS = random_vectors(64, [0, 1], seed=16)  # a vector steer on both blocks
PROMPTS = ["Hello there, my name is", "Once upon a time in a land"]
MAX_TOKENS = 6
ENGINE_KW = dict(dtype="float32", kv_cache_memory_bytes=1 << 27, max_model_len=256,
                 max_num_seqs=4, enforce_eager=True, seed=0, enable_lora=True, max_loras=2,
                 max_lora_rank=RANK)
ADAPTERS = {"attn": ["q_proj", "v_proj"], "head": ["q_proj", "v_proj", "lm_head"]}


def write_adapter(out, model_dir, targets, seed):
    """A random LoRA adapter in peft's format: adapter_config.json + adapter_model.safetensors
    (``base_model.model.<module>.lora_A.weight`` [r, in], ``lora_B.weight`` [out, r])."""
    from safetensors.torch import save_file

    cfg = json.loads((model_dir / "config.json").read_text())
    hidden, layers, vocab = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    head_dim, kv_heads = cfg["head_dim"], cfg["num_key_value_heads"]
    shapes = {"q_proj": (cfg["num_attention_heads"] * head_dim, hidden),
              "v_proj": (kv_heads * head_dim, hidden)}
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for t in targets:
        names = ([f"model.layers.{i}.self_attn.{t}" for i in range(layers)]
                 if t != "lm_head" else ["lm_head"])
        out_f, in_f = shapes.get(t, (vocab, hidden))
        for n in names:
            tensors[f"base_model.model.{n}.lora_A.weight"] = (
                torch.randn(RANK, in_f, generator=g) * 0.3)
            tensors[f"base_model.model.{n}.lora_B.weight"] = (
                torch.randn(out_f, RANK, generator=g) * 0.3)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, out / "adapter_model.safetensors")
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": RANK, "lora_alpha": ALPHA,
        "target_modules": targets, "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False,
        "use_rslora": False, "use_dora": False, "modules_to_save": None,
        "base_model_name_or_path": str(model_dir)}))
    return out


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory):
    d = tmp_path_factory.mktemp("lora")
    return {name: write_adapter(d / name, tiny_model_dir, targets, seed=10 + i)
            for i, (name, targets) in enumerate(ADAPTERS.items())}


@pytest.fixture(scope="module")
def steer_path(tmp_path_factory):  # (the vector steer is written beside it)
    p = tmp_path_factory.mktemp("lora-steer") / "a.safetensors"
    save_steer(p, random_steer(64, 8, "a", seed=1, scale=3.0))
    return p


def merged_model(model_dir, adapter_dir):
    """The base model with the adapter merged into its weights, in plain torch."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if adapter_dir is None:
        return model
    w = load_file(adapter_dir / "adapter_model.safetensors")
    with torch.no_grad():
        for key, a in w.items():
            if not key.endswith(".lora_A.weight"):
                continue
            name = key[len("base_model.model."):-len(".lora_A.weight")]
            b = w[key.replace("lora_A", "lora_B")]
            model.get_submodule(name).weight += (ALPHA / RANK) * b @ a
    return model


def reference_logprobs(model, ids, steer=None, strength=0.0):
    """log_softmax of ``lm_head(c + s eps (c P1) P2^T)`` at every position, by hand."""
    with torch.no_grad():
        c = model.model(torch.tensor([ids])).last_hidden_state[0]
        if steer is not None and strength:
            c = c + strength * steer.metadata.epsilon * (c @ steer.p1) @ steer.p2.T
        return torch.log_softmax(model.lm_head(c).float(), -1)


def assert_matches(out, lp):
    n = len(out.prompt_token_ids)
    for i, (tok, entry) in enumerate(zip(out.outputs[0].token_ids, out.outputs[0].logprobs,
                                         strict=True)):
        assert tok == int(lp[n - 1 + i].argmax()), i
        assert entry[tok].logprob == pytest.approx(lp[n - 1 + i, tok].item(), abs=2e-3), i


@pytest.fixture(scope="module")
def lora_llm(tiny_model_dir, steer_path):
    from vllm import LLM

    vec = save_vector_steer(steer_path.parent / "v.safetensors", VECTORS, "v")
    engine = LLM(str(tiny_model_dir), additional_config={"vllm_steer": {"steers": {
        "a": str(steer_path), "v": vec}}}, **ENGINE_KW)
    yield engine
    del engine


def _generate(llm, prompt, adapter, name, steer=None):
    from vllm import SamplingParams
    from vllm.lora.request import LoRARequest

    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, logprobs=0,
                            extra_args=None if steer is None else {"steer": steer})
    lora = None if adapter is None else LoRARequest(name, list(ADAPTERS).index(name) + 1,
                                                    str(adapter))
    return llm.generate([prompt], params, lora_request=lora)[0]


@pytest.mark.parametrize("name", list(ADAPTERS))
def test_lora_alone_equals_the_merged_model(lora_llm, adapters, tiny_model_dir, name):
    model = merged_model(tiny_model_dir, adapters[name])
    base = merged_model(tiny_model_dir, None)
    for prompt in PROMPTS:
        out = _generate(lora_llm, prompt, adapters[name], name)
        ids = list(out.prompt_token_ids) + list(out.outputs[0].token_ids)
        assert_matches(out, reference_logprobs(model, ids))
        # the adapter is applied (the merged model is not the base model)
        assert not torch.allclose(reference_logprobs(base, ids), reference_logprobs(model, ids),
                                  atol=1e-2)


@pytest.mark.parametrize("name", list(ADAPTERS))
def test_lora_plus_steer_is_the_papers_formula_on_the_lora_model(lora_llm, adapters,
                                                                 tiny_model_dir, steer_path,
                                                                 name):
    model = merged_model(tiny_model_dir, adapters[name])
    steer = load_steer(steer_path)
    for prompt in PROMPTS:
        plain = _generate(lora_llm, prompt, adapters[name], name)
        out = _generate(lora_llm, prompt, adapters[name], name, steer={"a": 5})
        ids = list(out.prompt_token_ids) + list(out.outputs[0].token_ids)
        assert_matches(out, reference_logprobs(model, ids, steer, 5.0))
        assert out.outputs[0].token_ids != plain.outputs[0].token_ids



@pytest.mark.parametrize("name", list(ADAPTERS))
def test_lora_plus_a_vector_steer_is_the_lora_model_with_the_vector_added(lora_llm, adapters,
                                                                         tiny_model_dir, name):
    """A LoRA adapter and a vector steer in one request: the merged model with the vector
    added to its blocks' outputs by forward hooks."""
    model = merged_model(tiny_model_dir, adapters[name])

    def add(delta):
        return lambda _m, _a, out: ((out[0] + delta, *out[1:]) if isinstance(out, tuple)
                                    else out + delta)

    for prompt in PROMPTS[:2]:
        plain = _generate(lora_llm, prompt, adapters[name], name)
        out = _generate(lora_llm, prompt, adapters[name], name, steer={"v": 1.0})
        ids = list(out.prompt_token_ids) + list(out.outputs[0].token_ids)
        hooks = [model.model.layers[k].register_forward_hook(add(v)) for k, v in VECTORS.items()]
        try:
            lp = reference_logprobs(model, ids)
        finally:
            for h in hooks:
                h.remove()
        assert_matches(out, lp)
        assert out.outputs[0].token_ids != plain.outputs[0].token_ids

# ---- the plugin installed, no steers configured: `vllm serve --enable-lora` -----------------
@pytest.fixture(scope="module")
def nosteer_server(tiny_model_dir, adapters, tmp_path_factory):
    log = tmp_path_factory.mktemp("lora-srv") / "server.log"
    args = [tiny_model_dir, "--served-model-name", "tiny", "--enable-lora", "--max-loras", "2",
            "--max-lora-rank", RANK, "--lora-modules",
            *(f"{n}={p}" for n, p in adapters.items()),
            "--dtype", "float32", "--max-model-len", "256", "--max-num-seqs", "4",
            "--kv-cache-memory-bytes", 1 << 27, "--enforce-eager"]
    with serve(args, log) as url:
        yield url


def _complete(url, model, prompt, **extra):
    return requests.post(url + "/v1/completions", json={
        "model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
        "logprobs": 0, "return_token_ids": True, **extra})


@pytest.mark.parametrize("name", list(ADAPTERS))
def test_lora_serves_unchanged_with_the_plugin_and_no_steers(nosteer_server, adapters,
                                                             tiny_model_dir, name):
    model = merged_model(tiny_model_dir, adapters[name])
    r = _complete(nosteer_server, name, PROMPTS[0])
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    ids = r.json()["choices"][0]["prompt_token_ids"] + choice["token_ids"]
    lp = reference_logprobs(model, ids)
    n = len(choice["prompt_token_ids"])
    assert choice["token_ids"] == [int(lp[n - 1 + i].argmax()) for i in
                                   range(len(choice["token_ids"]))]
    assert choice["logprobs"]["token_logprobs"] == pytest.approx(
        [lp[n - 1 + i, t].item() for i, t in enumerate(choice["token_ids"])], abs=2e-3)


@pytest.mark.parametrize("steer, fragment", [
    ({"detox": 5}, "this server has no steers loaded"),
    ({"detox": "abc"}, "this server has no steers loaded"),
])
def test_server_without_steers_refuses_a_steered_request(nosteer_server, steer, fragment):
    for model in ("tiny", "head"):
        r = _complete(nosteer_server, model, PROMPTS[0], steer=steer)
        assert r.status_code == 400, r.text
        assert fragment in r.json()["error"]["message"]
    # a zero strength asks for nothing: served
    plain = _complete(nosteer_server, "tiny", PROMPTS[0])
    zero = _complete(nosteer_server, "tiny", PROMPTS[0], steer={"detox": 0})
    assert zero.status_code == 200 and \
        zero.json()["choices"][0]["token_ids"] == plain.json()["choices"][0]["token_ids"]
