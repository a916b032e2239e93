"""Every model family, served, trained, transferred and converted (docs/compatibility.md, "Model
families").

For each family of tests/helpers/families.py a tiny random model is made on the fly and four steers
are made for it with the command line: ``rand`` (random), ``train`` (``vllm-steer train`` on a
synthetic task), ``xfer`` (``vllm-steer transfer`` from a tiny Llama of hidden size 64) and
``conv`` (``vllm-steer convert`` of a checkpoint in the paper's format). One subprocess
starts one small vLLM engine per family, one after another (engine core in-process,
``VLLM_ENABLE_V1_MULTIPROCESSING=0``: one Python start, one vLLM import), first stock vLLM
(no plugin) for a few families, then with the plugin for all, and records prompt and
generated logprobs of steered and unsteered requests. It starts as soon as the models exist
and each family's engine waits for that family's steers, so training and transfer overlap
the engine starts.

Every logprob is checked against the paper's formula written out here in plain torch from
the transformers model's own final hidden state ``c`` (the input of its output embeddings)
and head weights, including what the family does after the head:

    log_softmax(post((c + sum_i eps s_i (c P1_i) P2_i^T) E^T + b))

Tolerance: absolute 1e-3 on fp32 logprobs (observed differences are ~1e-5).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers.models import make_tiny_llama
from helpers.reference import decoder_blocks
from helpers.steers import random_steer
from helpers.families import ARCHITECTURES, FAMILIES, make_family_model

pytestmark = pytest.mark.vllm

TOL = 1e-3
RANK = 4
#: families also run on stock vLLM (no plugin), for exact equality of unsteered requests:
#: those with something around the head (bias, project_out, soft-cap, logit scale).
VANILLA = ["gptj", "opt", "gemma2", "cohere"]
PROMPT = [1, 504, 3458, 314, 253, 1345, 5026, 30]
MAX_TOKENS = 2
REQUESTS = [None, {"rand": 4}, {"rand": -3}, {"train": 5}, {"xfer": 5}, {"conv": 5},
            {"rand": 2, "conv": -2}, {"vec": 2.0}, {"vec": -1.5, "rand": 2}]
POS_WORDS = "happy good great lovely wonderful kind sunny bright joyful nice".split()
NEG_WORDS = "sad bad awful terrible horrible cruel dark gloomy nasty ugly".split()
FILL = "the a day was and it felt very so we".split()


def _texts(words, n, seed):
    rng = random.Random(seed)
    return [" ".join(rng.choice(words) if rng.random() < 0.5 else rng.choice(FILL)
                     for _ in range(8)) for _ in range(n)]


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """Tiny matmuls: one torch thread is as fast, and much faster on a loaded machine."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# ---- the paper's formula, written out -------------------------------------------------------
@functools.lru_cache(maxsize=None)
def load_hf(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def head_input(model, ids: list[int], vectors=None) -> torch.Tensor:
    """The final hidden state ``c`` [T, d]: the input of the model's output embeddings.
    ``vectors``: ``{block k: a * v_k}`` added to block ``k``'s output at every position (the
    stream the block returns: a tuple's first element), by forward hooks written here."""
    store = []
    hooks = [model.get_output_embeddings().register_forward_pre_hook(
        lambda m, a: store.append(a[0].detach()))]

    def add(delta):
        def hook(_m, _a, out):
            return (out[0] + delta, *out[1:]) if isinstance(out, tuple) else out + delta
        return hook

    for k, delta in (vectors or {}).items():
        hooks.append(decoder_blocks(model)[k].register_forward_hook(add(delta)))
    try:
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0]
    finally:
        for h in hooks:
            h.remove()
    return store[0][0], logits


def paper_logits(fam: str, model, c: torch.Tensor, terms) -> torch.Tensor:
    """``post((c + sum_i a_i (c P1_i) P2_i^T) E^T + b)`` for ``terms = [(a_i, P1_i, P2_i)]``
    (``a_i = eps_i * strength_i``), with the family's own post-head operation."""
    head = model.get_output_embeddings()
    E, b = head.weight.detach(), getattr(head, "bias", None)
    cs = c.clone()
    for a, p1, p2 in terms:
        cs = cs + a * (c @ p1) @ p2.T
    logits = cs @ E.T
    if b is not None:
        logits = logits + b.detach()
    cfg = model.config
    if fam in ("gemma2", "gemma3_text") and cfg.final_logit_softcapping:
        cap = cfg.final_logit_softcapping
        logits = cap * torch.tanh(logits / cap)
    if fam == "granite":
        logits = logits / cfg.logits_scaling
    if fam == "cohere":
        logits = logits * cfg.logit_scale
    return logits


def steer_terms(path: str, strength: float):
    """``[(eps * strength, P1, P2)]`` read straight from the safetensors file, plus the domain
    steer at its strength when the file says it is served with the steer."""
    from safetensors import safe_open

    with safe_open(path, framework="pt") as f:
        meta = json.loads(f.metadata()["vllm_steer"])
        t = {k: f.get_tensor(k).float() for k in f.keys()}
    eps = meta["epsilon"]
    terms = [(eps * strength, t["steer.P1"], t["steer.P2"])]
    if strength != 0 and meta.get("domain") == "with_steer":
        terms.append((eps * meta.get("domain_strength", 1.0), t["domain.P1"], t["domain.P2"]))
    return terms


# ---- fixtures: models, steers (made with the command line), the engine pass ---------------
@pytest.fixture(scope="module")
def synth(tmp_path_factory):
    d = tmp_path_factory.mktemp("synth")
    out = {}
    for name, words, seed in (("pos", POS_WORDS, 1), ("neg", NEG_WORDS, 2)):
        out[name] = d / f"{name}.txt"
        out[name].write_text("\n".join(_texts(words, 12, seed)))
    out["calibration"] = d / "calibration.txt"  # for transfer's strength rule; short = fast
    out["calibration"].write_text("The weather was mild in the morning.\n"
                                  "She opened the letter and read it twice.\n")
    return out


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """The transfer source: a tiny Llama of hidden size 64 and a random steer on it."""
    from vllm_steer.format import save_steer

    d = tmp_path_factory.mktemp("source")
    model = make_tiny_llama(d / "model", hidden=64)
    path = d / "src.safetensors"
    save_steer(path, random_steer(64, RANK, "xfer", seed=7, scale=3.0, base_model=str(model)))
    return model, path


def _paper_checkpoint(path, d, seed):
    """A checkpoint as the paper's train.py writes it: [args, {projector1/2}, step]."""
    g = torch.Generator().manual_seed(seed)
    args = argparse.Namespace(model_name="tiny", adaptor_class="multiply", num_steers=2,
                              rank=RANK, epsilon=1e-3, dummy_steer=1, training_steer=0)
    state = {"projector1": torch.randn(2, d, RANK, generator=g) * 3,
             "projector2": torch.randn(2, d, RANK, generator=g) * 3}
    torch.save([args, state, 100], path)
    return state


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """family -> {"model", "d", "dir", "steers": {"rand", "conv"}, "paper": checkpoint state,
    "convert_rc"}: the models, a random steer and the converted paper checkpoint."""
    from vllm_steer.cli import main
    from vllm_steer.format import save_steer
    from vllm_steer.vectors import make_vector_steer, save_vector

    root = tmp_path_factory.mktemp("families")
    out = {}
    for i, fam in enumerate(FAMILIES):
        d = root / fam
        model_dir = make_family_model(fam, d / "model", seed=i)
        cfg = json.loads((model_dir / "config.json").read_text())
        dim = cfg.get("word_embed_proj_dim") or cfg.get("hidden_size") or cfg["n_embd"]
        steers = {name: str(d / f"{name}.safetensors") for name in ("rand", "train", "xfer",
                                                                    "conv", "vec")}
        save_steer(steers["rand"], random_steer(dim, RANK, "rand", seed=i, scale=3.0))
        # a vector steer on every decoder block (of the model's hidden size, which OPT's
        # projected head input is not)
        hidden = cfg.get("hidden_size") or cfg["n_embd"]
        blocks = cfg.get("num_hidden_layers") or cfg["n_layer"]
        g = torch.Generator().manual_seed(50 + i)
        save_vector(steers["vec"], make_vector_steer(
            {k: torch.randn(hidden, generator=g) for k in range(blocks)}, "vec"))
        rec = {"model": str(model_dir), "d": dim, "dir": d, "steers": steers}
        rec["paper"] = _paper_checkpoint(d / "paper.pt", dim, seed=100 + i)
        rec["convert_rc"] = main(["convert", str(d / "paper.pt"), "--unsafe-allow-pickle",
                                  "--out", steers["conv"]])
        out[fam] = rec
    return out


@pytest.fixture(scope="module")
def engine_pass(models, tmp_path_factory):
    """Starts the engine pass (one subprocess) early: stock vLLM needs only the models; each
    family's plugin engine waits for its ``ready`` file, written once its steers are."""
    d = tmp_path_factory.mktemp("engines")
    spec = {"families": [{"name": f, "model": r["model"], "steers": r["steers"],
                          "ready": str(r["dir"] / "ready")} for f, r in models.items()],
            "requests": [{"ids": PROMPT, "steer": s} for s in REQUESTS],
            "vanilla": VANILLA, "max_tokens": MAX_TOKENS}
    (d / "spec.json").write_text(json.dumps(spec))
    tests_dir = str(Path(__file__).resolve().parents[1])  # helpers.families, run as a module
    env = dict(os.environ, VLLM_PLUGINS="none", VLLM_ENABLE_V1_MULTIPROCESSING="0",
               PYTHONPATH=os.pathsep.join(p for p in (tests_dir, os.environ.get("PYTHONPATH"))
                                          if p))
    log = open(d / "log.txt", "w")
    proc = subprocess.Popen([sys.executable, "-m", "helpers.families", str(d / "spec.json"),
                             str(d / "out.json")], env=env, stdout=log, stderr=subprocess.STDOUT)
    yield proc, d
    if proc.poll() is None:
        proc.kill()
    log.close()


@pytest.fixture(scope="module")
def built(models, engine_pass, synth, source):
    """``models`` plus the steers made by ``vllm-steer train`` and ``vllm-steer transfer``
    ("train_rc", "transfer_rc"), made while the engines start."""
    from vllm_steer.cli import main

    src_model, src_steer = source
    for _fam, rec in models.items():
        steers, model_dir = rec["steers"], rec["model"]
        rec["train_rc"] = main(["train", "--model", model_dir, "--positive", str(synth["pos"]),
                                "--negative", str(synth["neg"]), "--out", steers["train"],
                                "--rank", str(RANK), "--domain-rank", "0", "--steps", "4",
                                "--batch-size", "4", "--lr", "0.3", "--max-length", "16",
                                "--dev-fraction", "0", "--quiet", "--model-dtype", "float32",
                                "--cache-dtype", "float32", "--head-dtype", "float32"])
        rec["transfer_rc"] = main(["transfer", "--steer", str(src_steer), "--from",
                                   str(src_model), "--to", model_dir, "--out", steers["xfer"],
                                   "--anchors", "1000", "--heldout", "100",
                                   "--calibration-file", str(synth["calibration"])])
        (rec["dir"] / "ready").touch()
    return models


@pytest.fixture(scope="module")
def engines(built, engine_pass):
    """Per family, the vLLM outputs of :data:`REQUESTS` (stock vLLM for :data:`VANILLA`)."""
    proc, d = engine_pass
    try:
        rc = proc.wait(timeout=1800)
    except subprocess.TimeoutExpired:
        proc.kill()
        rc = "timeout"
    assert rc == 0, (d / "log.txt").read_text()[-4000:]
    return json.loads((d / "out.json").read_text())


def _served(engines, fam):
    res = engines["steered"][fam]
    assert "error" not in res, res.get("error")
    return res["requests"]


def _expected(fam, model, req, built):
    """Expected logprobs [positions, vocab] for one served request."""
    ids = req["ids"] + req["tokens"][:-1]
    vectors = None
    if "vec" in (req["steer"] or {}):  # read straight from the file: a * v_k per block
        from safetensors import safe_open

        with safe_open(built[fam]["steers"]["vec"], framework="pt") as f:
            vectors = {int(k.split(".")[1]): req["steer"]["vec"] * f.get_tensor(k).float()
                       for k in f.keys()}
    c, hf_logits = head_input(model, ids, vectors)
    terms = []
    for name, s in (req["steer"] or {}).items():
        if name == "vec":
            continue
        if name == "conv":  # the paper's own formula, from the checkpoint: dummy steer at 1
            st = built[fam]["paper"]
            eps = 1e-3
            terms += [(eps * s, st["projector1"][0], st["projector2"][0])]
            if s != 0:
                terms += [(eps * 1.0, st["projector1"][1], st["projector2"][1])]
        else:
            terms += steer_terms(built[fam]["steers"][name], s)
    return torch.log_softmax(paper_logits(fam, model, c, terms).double(), -1), hf_logits


def _check(lp_expected, req):
    worst = 0.0
    for pos, entries in enumerate(req["logprobs"]):
        for tok, got in entries.items():
            worst = max(worst, abs(got - float(lp_expected[pos, int(tok)])))
    # greedy: each generated token is the argmax of the expected distribution
    n = len(req["ids"]) - 1
    for j, tok in enumerate(req["tokens"]):
        assert tok == int(lp_expected[n + j].argmax()), (j, tok)
    return worst


# ---- serve ---------------------------------------------------------------------------------
@pytest.mark.parametrize("fam", FAMILIES)
def test_serve_steered_logprobs_equal_the_paper_formula(fam, built, engines):
    model = load_hf(built[fam]["model"])
    reqs = _served(engines, fam)
    assert [r["steer"] for r in reqs] == REQUESTS
    plain = None
    for req in reqs:
        lp, hf_logits = _expected(fam, model, req, built)
        if req["steer"] is None:
            # the written-out formula with no steer is the family's own transformers logits
            assert torch.allclose(paper_logits(fam, model, head_input(model, req["ids"])[0],
                                               []), hf_logits[:len(req["ids"])], atol=1e-4)
            plain = req
        worst = _check(lp, req)
        assert worst < TOL, (fam, req["steer"], worst)
        if req["steer"] is not None:  # and the steer moved the distribution
            moved = max(abs(v - plain["logprobs"][p].get(t, v))
                        for p, e in enumerate(req["logprobs"]) for t, v in e.items())
            assert moved > (0.05 if "rand" in req["steer"] else 1e-3), (fam, req["steer"],
                                                                          moved)


@pytest.mark.parametrize("fam", VANILLA)
def test_serve_unsteered_requests_equal_stock_vllm(fam, engines):
    stock = engines["vanilla"][fam]
    assert "error" not in stock, stock.get("error")
    plugin = [r for r in _served(engines, fam) if r["steer"] is None]
    assert len(stock["requests"]) == len(plugin) == 1
    a, b = stock["requests"][0], plugin[0]
    assert a["tokens"] == b["tokens"]
    assert len(a["logprobs"]) == len(b["logprobs"]) == len(PROMPT) - 1 + MAX_TOKENS
    # Same tokens and top-k; logprobs equal to fp32 rounding (the two engines run in one
    # process one after the other, and the CPU GEMMs may block the vocabulary differently:
    # a few units in the last place at |logprob| ~ 20, relative 2e-7, were seen).
    for x, y in zip(a["logprobs"], b["logprobs"], strict=True):
        assert x.keys() == y.keys()
        assert [x[k] for k in x] == pytest.approx([y[k] for k in x], rel=1e-6, abs=1e-6)


# ---- train ---------------------------------------------------------------------------------
_TOKENIZER = []


def _tokenizer(model_dir):
    from transformers import AutoTokenizer

    if not _TOKENIZER:
        _TOKENIZER.append(AutoTokenizer.from_pretrained(model_dir))
    return _TOKENIZER[0]


@pytest.mark.parametrize("fam", FAMILIES)
def test_train_lowers_the_positive_side_loss(fam, built, synth):
    rec = built[fam]
    assert rec["train_rc"] == 0
    model = load_hf(rec["model"])
    tok = _tokenizer(rec["model"])  # the same for every family
    terms = steer_terms(rec["steers"]["train"], 5)
    pos = synth["pos"].read_text().splitlines()
    rows = []  # (c [T, d], next-token ids) per positive text
    for t in pos:
        ids = tok(t)["input_ids"][:16]
        rows.append((head_input(model, ids)[0][:-1], torch.tensor(ids[1:])))

    def loss(terms):
        nll = [-torch.log_softmax(paper_logits(fam, model, c, terms), -1)[
            torch.arange(len(y)), y] for c, y in rows]
        return float(torch.cat(nll).mean())

    assert loss(terms) < loss([]) - 0.02


# ---- transfer ------------------------------------------------------------------------------
@pytest.mark.parametrize("fam", FAMILIES)
def test_transfer_gives_a_file_the_target_server_accepts_and_that_steers(fam, built, engines):
    from safetensors import safe_open

    rec = built[fam]
    assert rec["transfer_rc"] == 0
    with safe_open(rec["steers"]["xfer"], framework="pt") as f:
        assert f.get_tensor("steer.P1").shape == (rec["d"], RANK) != (64, RANK)
    # served (the engine accepted the file) and checked against the formula above
    req = [r for r in _served(engines, fam) if r["steer"] == {"xfer": 5}]
    assert len(req) == 1


# ---- convert -------------------------------------------------------------------------------
@pytest.mark.parametrize("fam", FAMILIES)
def test_convert_matches_the_paper_formula(fam, built, engines):
    from safetensors import safe_open

    rec = built[fam]
    assert rec["convert_rc"] == 0
    with safe_open(rec["steers"]["conv"], framework="pt") as f:
        assert torch.equal(f.get_tensor("steer.P1"), rec["paper"]["projector1"][0])
        assert torch.equal(f.get_tensor("domain.P2"), rec["paper"]["projector2"][1])
    # served at strengths 5 and -2 (with another steer) and matched to the checkpoint's formula
    assert sum("conv" in (r["steer"] or {}) for r in _served(engines, fam)) == 2


def test_every_family_is_known_to_the_plugin():
    from vllm_steer.integrations.families import FAMILIES as KNOWN

    assert set(ARCHITECTURES.values()) <= set(KNOWN)
