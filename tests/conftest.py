"""Shared fixtures: tiny random-weight models made on the fly, the embedded model, the data."""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DATA_DIR = Path(os.environ.get("VLLM_STEER_DATA", ROOT.parent / "shared" / "data"))


def _tokenizer_src() -> Path:
    from vllm_steer.models import prepare_embedded

    return prepare_embedded("smollm2", quiet=True)


def _copy_tokenizer(src: Path, out: Path) -> None:
    """The embedded model's tokenizer files, into a tiny model's folder."""
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (src / f).exists():
            shutil.copy(src / f, out / f)


def make_tiny_llama(out: Path, hidden: int = 64, layers: int = 2, tie: bool = False,
                    seed: int = 0, bigram: bool = False) -> Path:
    """A random-weight Llama with the embedded model's tokenizer (vocab 49152), saved as an
    HF folder that both transformers and vLLM load. ``bigram``: every layer adds nothing to
    the residual stream (zero attention and MLP output projections), so the head's input is
    the normalised embedding of the current token: a bigram model whose next token an
    EAGLE head can predict exactly (see tests/e2e/test_vllm_specdec.py)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    src = _tokenizer_src()
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
    _copy_tokenizer(src, out)
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

    src = _tokenizer_src()
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
    _copy_tokenizer(src, Path(out))
    return Path(out)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """Tiny random Llama (hidden 64, 2 layers, untied head), HF folder."""
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The embedded SmolLM2-135M-Instruct as an HF folder (prepared once, cached)."""
    return _tokenizer_src()


@pytest.fixture(scope="session")
def data_dir() -> Path:
    if not DATA_DIR.is_dir():
        pytest.skip(f"data folder {DATA_DIR} not found (set VLLM_STEER_DATA)")
    return DATA_DIR


def save_steers(directory: Path, steers: dict) -> dict[str, str]:
    """Save ``{name: Steer}`` as ``directory/NAME.safetensors``; returns ``{name: path}``."""
    from vllm_steer.format import save_steer

    paths = {}
    for name, steer in steers.items():
        paths[name] = str(Path(directory) / f"{name}.safetensors")
        save_steer(paths[name], steer)
    return paths


def random_steer(hidden: int, rank: int, name: str, seed: int = 0, scale: float = 1.0,
                 base_model: str | None = None):
    """A random steer whose effect at strength ~5 is visible on the tiny models."""
    import torch

    from vllm_steer.format import make_steer

    g = torch.Generator().manual_seed(seed)
    p1 = torch.randn(hidden, rank, generator=g) * scale
    p2 = torch.randn(hidden, rank, generator=g) * scale
    return make_steer(p1, p2, name, base_model=base_model, labels={"positive": name})


@pytest.fixture(scope="session")
def pair_steers(tmp_path_factory):
    """The engine tests' two random steers ``a`` and ``b`` (hidden 64, rank 8, seeds 1 and 2,
    scale 3: strengths of ~5 change the tiny models' greedy tokens): ``(objects, files)``."""
    objs = {"a": random_steer(64, 8, "a", seed=1, scale=3.0),
            "b": random_steer(64, 8, "b", seed=2, scale=3.0)}
    return objs, save_steers(tmp_path_factory.mktemp("pair-steers"), objs)


@pytest.fixture(scope="session")
def pair_ref(tiny_model_dir, pair_steers):
    """:class:`HFReference` of the tiny model with :func:`pair_steers`."""
    return HFReference(tiny_model_dir, pair_steers[0])


@contextlib.contextmanager
def steered_llm(model_dir, steer_files: dict, **engine_kw):
    """An offline ``LLM`` serving ``steer_files`` (``--steer``), whose ``collective_rpc`` may
    carry the test's local functions (to read or set the worker's state)."""
    from vllm import LLM

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
        engine = LLM(str(model_dir), additional_config={"vllm_steer": {"steers": steer_files}},
                     **engine_kw)
        yield engine
        del engine


class HFReference:
    """Plain-torch reference from a model's own weights (transformers): the paper's formula
    applied by hand on the LM head's input, ``c + sum_i s_i eps_i (c P1_i) P2_i^T``, with no
    vllm_steer code on the path. For engine tests (greedy tokens, logprobs)."""

    def __init__(self, model_dir, steers: dict):
        import torch
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.steers = steers  # name -> Steer (p1, p2, metadata.epsilon)

    def logprobs(self, ids: list[int], strengths: dict | None = None):
        """log-softmax of the next-token logits at every position of ``ids`` ([len, vocab])."""
        import torch

        def pre_hook(_module, args):
            c = args[0]
            out = c.clone()
            for name, s in (strengths or {}).items():
                st = self.steers[name]
                out = out + s * st.metadata.epsilon * (c @ st.p1.float()) @ st.p2.float().T
            return (out, *args[1:])

        handle = self.model.lm_head.register_forward_pre_hook(pre_hook)
        try:
            with torch.no_grad():
                logits = self.model(torch.tensor([ids])).logits[0].float()
        finally:
            handle.remove()
        return torch.log_softmax(logits, -1)

    def greedy(self, prompt_ids: list[int], n: int, strengths: dict | None = None) -> list[int]:
        """``n`` greedy tokens after ``prompt_ids``."""
        ids = list(prompt_ids)
        for _ in range(n):
            ids.append(int(self.logprobs(ids, strengths)[-1].argmax()))
        return ids[len(prompt_ids):]

    def check_windowed(self, outs, steers: list, max_tokens: int) -> list[bool]:
        """Engine outputs of requests with generation windows (``steers``: one request's
        ``steer`` each, None: unsteered), checked with a hand-written greedy decode loop that
        applies each window's strength at that generated token (``Window.at``): every token
        and its logprob (within 2e-3); ``max_tokens`` None: each request's own length. Returns,
        per steered request, whether the same steers at constant strength decode otherwise (the
        window matters)."""
        import pytest

        from vllm_steer.request import Window

        constant = []
        for o, steer in zip(outs, steers):
            windows = {n: Window(**v) if isinstance(v, dict) else Window(v, base=v)
                       for n, v in (steer or {}).items()}
            ids = list(o.prompt_token_ids)
            for t, (tok, entry) in enumerate(zip(o.outputs[0].token_ids,
                                                 o.outputs[0].logprobs)):
                lp = self.logprobs(ids, {n: w.at(t) for n, w in windows.items()})[-1]
                assert tok == int(lp.argmax()), (steer, t)
                assert entry[tok].logprob == pytest.approx(lp[tok].item(), abs=2e-3), (steer, t)
                ids.append(tok)
            n_out = len(o.outputs[0].token_ids) if max_tokens is None else max_tokens
            assert len(ids) == len(o.prompt_token_ids) + n_out
            if steer:
                full = {n: (v["strength"] if isinstance(v, dict) else v) for n, v in steer.items()}
                constant.append(self.greedy(o.prompt_token_ids, n_out, full)
                                != list(o.outputs[0].token_ids))
        return constant

    def check_generate(self, llm, prompts: list, strengths: list, max_tokens: int,
                       changed=(), tol: float = 2e-3):
        """Greedy ``llm.generate`` of ``prompts`` (one steer mix per prompt, None: unsteered)
        with logprobs: every token equals :meth:`greedy` and every logprob :meth:`logprobs`
        within ``tol``; the requests at the indices in ``changed`` must differ from the
        unsteered reference (the steer has a visible effect). Returns the outputs."""
        import pytest
        from vllm import SamplingParams

        params = [SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=0,
                                 extra_args=None if s is None else {"steer": s})
                  for s in strengths]
        outs = llm.generate(prompts[:len(strengths)], params, use_tqdm=False)
        for k, (o, s) in enumerate(zip(outs, strengths)):
            ids, got = list(o.prompt_token_ids), list(o.outputs[0].token_ids)
            assert got == self.greedy(ids, max_tokens, s), (k, s)
            lp = self.logprobs(ids + got, s)
            for i, (tok, entry) in enumerate(zip(got, o.outputs[0].logprobs)):
                assert entry[tok].logprob == pytest.approx(lp[len(ids) - 1 + i, tok].item(),
                                                           abs=tol), (k, s, i)
            if k in changed:
                assert got != self.greedy(ids, max_tokens), (k, s, "the steer has no effect")
        return outs


V2_SHIM_DIR = ROOT / "tests" / "v2shim"


def v2_runner_env() -> dict[str, str]:
    """Environment that puts the vLLM engine processes started from it on Model Runner V2 on
    this CPU, through the test shim tests/v2shim/sitecustomize.py (a stand-in Triton "cpu"
    backend, kernels in the Triton interpreter). Also for subprocesses (``vllm serve``)."""
    path = os.environ.get("PYTHONPATH", "")
    return {"PYTHONPATH": os.pathsep.join(p for p in (str(V2_SHIM_DIR), path) if p),
            "STEER_TEST_V2_SHIM": "1", "VLLM_USE_V2_MODEL_RUNNER": "1", "TRITON_INTERPRET": "1",
            "VLLM_WORKER_MULTIPROC_METHOD": "spawn"}  # sitecustomize runs at process start


@pytest.fixture(scope="module")
def v2_runner():
    """Engines started in this module (offline ``LLM`` or servers that inherit os.environ) run
    Model Runner V2; see :func:`v2_runner_env`. Slow (Triton interpreter): tiny models."""
    with pytest.MonkeyPatch.context() as mp:
        for k, v in v2_runner_env().items():
            mp.setenv(k, v)
        # the test process imported vLLM without the shim; its config check wants Triton too
        mp.setattr("vllm.config.vllm.HAS_TRITON", True)
        yield


def bound_extra(names, steer) -> dict:
    """``extra_args`` of a request whose steers the engine core bound (as
    ``vllm_steer.integrations.engine.binding.bind_request`` does) to a runtime loaded from
    ``--steer`` files ``names`` (slot i, generation i + 1, as at start-up); the raw value too."""
    from vllm_steer.request import BOUND_KEY, BoundSteer, SteerRequest

    if steer is None:
        return {}
    request = SteerRequest.parse(steer)
    names = list(names)
    bound = [BoundSteer(n, names.index(n), names.index(n) + 1, request.named[n])
             for n in request.strengths if n in names]
    return {"steer": steer, BOUND_KEY: BoundSteer.to_wire(bound)}


_STOCK_VLLM = r"""
import json, sys
from vllm import LLM, SamplingParams
if __name__ == "__main__":
    model, prompts, n = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
    llm = LLM(model, **json.loads(sys.argv[4]))
    outs = llm.generate(prompts, SamplingParams(max_tokens=n, temperature=0, logprobs=0))
    print("RESULT" + json.dumps([[list(o.outputs[0].token_ids),
                                  [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs,
                                                                  o.outputs[0].token_ids)]]
                                 for o in outs]))
"""


def stock_vllm(model_dir, prompts: list, max_tokens: int, engine_kw: dict, workdir: Path
               ) -> list:
    """Greedy ``[tokens, logprobs]`` per prompt from stock vLLM with no plugin loaded
    (``VLLM_PLUGINS=none``, a subprocess), the same engine settings: what unsteered requests
    must reproduce."""
    import json
    import subprocess
    import sys

    script = Path(workdir) / "stock_vllm.py"
    script.write_text(_STOCK_VLLM)
    env = dict(os.environ, VLLM_PLUGINS="none")
    out = subprocess.run([sys.executable, str(script), str(model_dir), json.dumps(prompts),
                          str(max_tokens), json.dumps(engine_kw)], env=env, capture_output=True,
                         text=True, timeout=600)
    line = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT")]
    assert line, out.stderr[-3000:]
    return json.loads(line[0][len("RESULT"):])
