"""Transfer: anchors, the ridge fit, the steer rewrite, and the CLI on two tiny models."""

from __future__ import annotations

import json

import pytest
import torch

from helpers.models import make_tiny_llama
from helpers.steers import random_steer
from vllm_steer.format import load_steer, make_steer, save_steer
from vllm_steer.lens.transfer import (fit_map, fit_quality, logit_shift_rms, shared_anchors,
                                      transfer, transfer_factors, transfer_steer)

EPS = 1e-3


def _shift(c, steer_p1, steer_p2, E):
    """Centred logit shift per unit eps: (c P1) P2^T E^T minus its row mean."""
    d = ((c @ steer_p1) @ steer_p2.T) @ E.T
    return d - d.mean(-1, keepdim=True)


def _orthogonal(d, seed):
    g = torch.Generator().manual_seed(seed)
    q, r = torch.linalg.qr(torch.randn(d, d, generator=g, dtype=torch.float64))
    return q * torch.sign(torch.diagonal(r))


def test_shared_anchors_order_markers_and_heldout():
    va = {"<s>": 0, "\u0120the": 1, "a": 2, "\u0120cat": 3, "zz": 4, "only_a": 5}
    vb = {"</s>": 0, "\u2581cat": 5, "a": 9, "\u2581the": 2, "zz": 3, "only_b": 1}
    anc = shared_anchors(va, vb, n_fit=3, n_heldout=1, exclude_a=[0], exclude_b=[0])
    # order by max(id_a, id_b): " the"(2), "zz"(4), " cat"(5), "a"(9)
    assert anc.tokens == [" the", "zz", " cat", "a"]
    assert anc.ids_a == [1, 4, 3, 2] and anc.ids_b == [2, 3, 5, 9]
    assert anc.shared_total == 4
    assert len(anc.heldout) == 1 and len(anc.fit) == 3
    assert not set(anc.heldout) & set(anc.fit)
    # deterministic
    assert shared_anchors(va, vb, 3, 1, [0], [0]) == anc
    with pytest.raises(ValueError, match="share only 1 tokens"):
        shared_anchors({"x": 0, "y": 1}, {"x": 0, "q": 1}, 10, 0)


def _synthetic(seed=0, v=3000, d=32):
    g = torch.Generator().manual_seed(seed)
    E_a = torch.randn(v, d, generator=g, dtype=torch.float64) + 0.5  # shared mean on purpose
    return E_a, g


def test_fit_recovers_a_rotation_and_transfer_reproduces_logits():
    E_a, g = _synthetic()
    R = _orthogonal(32, 1)
    E_b = E_a @ R + 0.01 * torch.randn(E_a.shape, generator=g, dtype=torch.float64) - 2.0
    fit, held = torch.arange(0, 2400), torch.arange(2400, 3000)
    m = fit_map(E_b[fit], E_a[fit], ridge=1e-4)
    # E_a ~= E_b H with H = R^T
    assert torch.linalg.norm(m.H - R.T) / torch.linalg.norm(R) < 0.01
    q = fit_quality(m, E_b[held], E_a[held])
    assert q["r2"] > 0.999 and q["cosine"] > 0.999
    p1 = torch.randn(32, 4, generator=g, dtype=torch.float64)
    p2 = torch.randn(32, 4, generator=g, dtype=torch.float64)
    c_a = torch.randn(20, 32, generator=g, dtype=torch.float64)
    c_b = c_a @ R  # the B context with the same logits
    la, lb = c_a @ E_a.T, c_b @ E_b.T
    la, lb = la - la.mean(-1, keepdim=True), lb - lb.mean(-1, keepdim=True)
    assert float(torch.linalg.norm(la - lb) / torch.linalg.norm(la)) < 0.02
    want = _shift(c_a, p1, p2, E_a)
    for form in ("logit", "congruence"):  # identical for a rotation
        q1, q2 = transfer_factors(p1, p2, m, form)
        got = _shift(c_b, q1.double(), q2.double(), E_b)
        rel = float(torch.linalg.norm(got - want) / torch.linalg.norm(want))
        assert rel < 0.02, (form, rel)


def test_logit_form_keeps_the_shift_when_the_map_also_scales():
    """E_B = 3 E_A R: the logit form keeps the shift; the paper's congruence form gives 1/9."""
    E_a, g = _synthetic(seed=2)
    R = _orthogonal(32, 3)
    E_b = 3.0 * E_a @ R
    m = fit_map(E_b, E_a, ridge=0.0)
    p1 = torch.randn(32, 3, generator=g, dtype=torch.float64)
    p2 = torch.randn(32, 3, generator=g, dtype=torch.float64)
    c_a = torch.randn(10, 32, generator=g, dtype=torch.float64)
    c_b = c_a @ R / 3.0  # same logits as c_a on A
    want = _shift(c_a, p1, p2, E_a)
    ratios = {}
    for form in ("logit", "congruence"):
        q1, q2 = transfer_factors(p1, p2, m, form)
        got = _shift(c_b, q1.double(), q2.double(), E_b)
        ratios[form] = float((got * want).sum() / (want * want).sum())
        if form == "logit":
            assert torch.allclose(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))
    assert ratios["logit"] == pytest.approx(1.0, abs=1e-4)
    assert ratios["congruence"] == pytest.approx(1 / 9, rel=1e-3)


def _narrower_pair(seed, v=600, d_a=12, d_b=8):
    """E_A = E_B H_true + a mean: B is narrower, so H^T H [d_a, d_a] is singular."""
    g = torch.Generator().manual_seed(seed)
    E_b = torch.randn(v, d_b, generator=g, dtype=torch.float64)
    H_true = torch.randn(d_b, d_a, generator=g, dtype=torch.float64)
    E_a = E_b @ H_true + torch.randn(d_a, generator=g, dtype=torch.float64)
    return E_a, E_b, g


def test_ridge_0_is_the_least_norm_map_when_the_target_is_narrower():
    """ridge 0 on a narrower target: G is the least-norm solution of c_A H^T = c_B, so the
    logit form reproduces A's centred logit shift at corresponding contexts; the A-context
    is computed independently from the embeddings (pseudo-inverse of centred E_A)."""
    E_a, E_b, g = _narrower_pair(seed=7)
    m = fit_map(E_b.float(), E_a.float(), ridge=0.0)
    H = torch.linalg.lstsq(E_b - E_b.mean(0), E_a - E_a.mean(0)).solution  # [d_b, d_a]
    assert torch.allclose(m.H, H, atol=1e-5)
    g_star = torch.linalg.solve(H @ H.T, H)  # (H H^T)^-1 H: least norm, d_b <= d_a
    assert float(torch.linalg.norm(m.context_map() - g_star) / torch.linalg.norm(g_star)) < 1e-5
    p1 = torch.randn(12, 3, generator=g, dtype=torch.float64)
    p2 = torch.randn(12, 3, generator=g, dtype=torch.float64)
    q1, q2 = transfer_factors(p1, p2, m, "logit")
    c_b = torch.randn(6, 8, generator=g, dtype=torch.float64)
    Ea_c, Eb_c = E_a - E_a.mean(0), E_b - E_b.mean(0)
    c_a = (torch.linalg.pinv(Ea_c) @ (Eb_c @ c_b.T)).T  # same centred logits as c_b on B
    want, got = _shift(c_a, p1, p2, E_a), _shift(c_b, q1.double(), q2.double(), E_b)
    assert float(torch.linalg.norm(got - want) / torch.linalg.norm(want)) < 1e-5
    # the default ridge is close to it; both are finite and of the same size
    q1r, _ = transfer_factors(p1, p2, fit_map(E_b.float(), E_a.float()), "logit")
    assert float(torch.linalg.norm(q1r - q1) / torch.linalg.norm(q1)) < 1e-2


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf")])
def test_a_ridge_that_is_not_a_finite_number_ge_0_is_refused(bad):
    E_a, E_b, _ = _narrower_pair(seed=1, v=100)
    with pytest.raises(ValueError, match=rf"ridge {bad} is not a finite number >= 0.*"
                                         r"default 0.0001 \(0 = no regularisation\)"):
        fit_map(E_b, E_a, ridge=bad)
    from vllm_steer.lens.transfer import TransferConfig

    with pytest.raises(ValueError, match=rf"ridge {bad} is not a finite number >= 0"):
        TransferConfig(ridge=bad)


def test_transfer_steer_metadata_and_domain():
    E_a, g = _synthetic(seed=4, v=500, d=16)
    m = fit_map(E_a[:, :12].clone(), E_a)  # B = first 12 coordinates of A
    s = make_steer(torch.randn(16, 2), torch.randn(16, 2), "x", base_model="A",
                   domain_p1=torch.randn(16, 1), domain_p2=torch.randn(16, 1),
                   recommended_strength=5.0, labels={"positive": "nice"})
    out = transfer_steer(s, m, source={"kind": "transfer"}, base_model="B",
                         recommended_strength=0.7)
    assert out.p1.shape == (12, 2) and out.domain_p1.shape == (12, 1)
    assert out.metadata.hidden_size == 12 and out.metadata.base_model == "B"
    assert out.metadata.labels == {"positive": "nice"}
    assert out.metadata.source == {"kind": "transfer"}
    assert out.metadata.recommended_strength == 0.7
    with pytest.raises(ValueError, match="hidden size 12"):
        transfer_factors(torch.randn(12, 2), torch.randn(12, 2), m)


@pytest.fixture(scope="module")
def tiny_pair(tiny_model_dir, tmp_path_factory):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    small = make_tiny_llama(tmp_path_factory.mktemp("tiny-32"), hidden=32, seed=1)
    a = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    return tiny_model_dir, small, a, tok


def test_transfer_to_the_same_model_gives_back_the_logits(tiny_pair):
    from vllm_steer.hf import steering

    _, _, model, tok = tiny_pair
    steer = random_steer(64, 4, "s", seed=3)
    steer.metadata.recommended_strength = 4.0
    out, rep = transfer(steer, model, tok, model, tok, name_a="A", name_b="A")
    assert rep.heldout_fit["r2"] > 0.999
    x = torch.tensor([tok("Hello there, this is a test of the steer.")["input_ids"]])
    with torch.no_grad():
        with steering(model, steer, 5.0):
            want = model(x).logits
        with steering(model, out, 5.0):
            got = model(x).logits
        plain = model(x).logits
    shift_w, shift_g = want - plain, got - plain
    assert float((shift_w - shift_g).abs().max()) < 0.01 * float(shift_w.abs().max())
    assert rep.recommended_strength == pytest.approx(4.0, rel=0.01)
    assert out.metadata.source["kind"] == "transfer"


def test_transfer_cli_between_two_tiny_models(tiny_pair, tmp_path, capsys):
    from vllm_steer.cli import main

    big, small, _, _ = tiny_pair
    src = tmp_path / "s.safetensors"
    save_steer(src, random_steer(64, 4, "detox", seed=5, base_model=str(big)))
    out = tmp_path / "s-small.safetensors"
    rc = main(["transfer", "--steer", str(src), "--from", str(big), "--to", str(small),
               "--out", str(out), "--anchors", "2000", "--heldout", "500"])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "fit (held out): R^2" in printed and "recommended strength" in printed
    assert "warning: held-out R^2 below 0.3" in printed  # two unrelated random models
    st = load_steer(out)
    assert st.p1.shape == (32, 4) and st.name == "detox"
    src_meta = st.metadata.source
    assert src_meta["kind"] == "transfer" and src_meta["from_model"] == str(big)
    assert src_meta["anchors"] == 2000 and src_meta["heldout"] == 500
    assert src_meta["shared_tokens"] > 40000  # same tokenizer: nearly the whole vocabulary
    assert isinstance(src_meta["heldout_r2"], float)
    assert st.metadata.recommended_strength > 0
    assert st.metadata.base_model == str(small)
    json.dumps(src_meta)
    # the recommended strength equalises the RMS logit shift on calibration contexts
    assert st.metadata.recommended_strength == pytest.approx(
        5.0 * src_meta["logit_shift_rms_source"] / src_meta["logit_shift_rms_target"],
        rel=1e-3)


def test_transfer_cli_ridge_0_to_a_narrower_model_writes_the_least_norm_steer(
        tiny_pair, tmp_path, capsys):
    """--ridge 0 from hidden 64 to hidden 32: the file holds P1_B = (H H^T)^-1 H P1 and
    P2_B = H P2, with H the plain least-squares fit on the same anchor tokens."""
    from vllm_steer.cli import main
    from vllm_steer.lens.lm import load_lm, output_embeddings

    big, small, _, _ = tiny_pair
    steer = random_steer(64, 4, "detox", seed=5, base_model=str(big))
    src, out = tmp_path / "s.safetensors", tmp_path / "s0.safetensors"
    save_steer(src, steer)
    assert main(["transfer", "--steer", str(src), "--from", str(big), "--to", str(small),
                 "--out", str(out), "--anchors", "2000", "--heldout", "500",
                 "--ridge", "0"]) == 0
    assert f"wrote {out}" in capsys.readouterr().out
    st = load_steer(out)
    assert st.metadata.source["ridge"] == 0.0
    (ma, ta), (mb, tb) = load_lm(str(big)), load_lm(str(small))
    E_a, E_b = output_embeddings(ma).double(), output_embeddings(mb).double()
    anc = shared_anchors(ta.get_vocab(), tb.get_vocab(), 2000, 500, ta.all_special_ids,
                         tb.all_special_ids, rows_a=E_a.shape[0], rows_b=E_b.shape[0])
    ia = torch.tensor([anc.ids_a[i] for i in anc.fit])
    ib = torch.tensor([anc.ids_b[i] for i in anc.fit])
    X, Y = E_b[ib] - E_b[ib].mean(0), E_a[ia] - E_a[ia].mean(0)
    H = torch.linalg.lstsq(X, Y).solution  # [32, 64]
    p1_b = torch.linalg.solve(H @ H.T, H) @ steer.p1.double()
    assert torch.allclose(st.p1.double(), p1_b, rtol=1e-3, atol=1e-4 * float(p1_b.abs().max()))
    assert torch.allclose(st.p2.double(), H @ steer.p2.double(), rtol=1e-3,
                          atol=1e-4 * float(steer.p2.abs().max()))


@pytest.mark.parametrize("bad", ["-1", "nan", "inf", "x"])
def test_transfer_cli_refuses_a_ridge_below_0_or_not_finite(bad, tmp_path, capsys):
    from vllm_steer.cli import main

    with pytest.raises(SystemExit) as e:
        main(["transfer", "--steer", str(tmp_path / "none.safetensors"), "--from", "a",
              "--to", "b", "--out", str(tmp_path / "o.safetensors"), f"--ridge={bad}"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert (f"argument --ridge: '{bad}' is not a finite number >= 0: give the relative ridge "
            "strength, e.g. the default 0.0001 (0 = no regularisation)") in err
    assert not (tmp_path / "o.safetensors").exists()


def test_logit_shift_rms_scales_linearly():
    g = torch.Generator().manual_seed(0)
    E = torch.randn(100, 8, generator=g)
    h = torch.randn(5, 8, generator=g)
    s = make_steer(torch.randn(8, 2, generator=g), torch.randn(8, 2, generator=g), "x")
    r1 = logit_shift_rms(h, E, s)
    assert r1 > 0
    assert logit_shift_rms(h, E, s.scaled(3.0)) == pytest.approx(3 * r1, rel=1e-5)


def test_cli_help_defaults_match_the_config_and_parser_is_light():
    import subprocess
    import sys

    from vllm_steer.lens import cli
    from vllm_steer.lens.transfer import TransferConfig

    c = TransferConfig()
    assert (cli.DEFAULT_ANCHORS, cli.DEFAULT_HELDOUT, cli.DEFAULT_RIDGE) == (
        c.anchors, c.heldout, c.ridge)
    code = ("import argparse, sys; from vllm_steer.lens.cli import add_commands; "
            "add_commands(argparse.ArgumentParser().add_subparsers()); "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("family", ["granite", "cohere"])
def test_logit_shift_rms_is_the_models_own_logit_shift(family, tmp_path):
    """Granite divides its logits by logits_scaling and Cohere multiplies them by
    logit_scale after the head: the RMS (and so the recommended strength of a transfer to
    or from such a model) is that of the model's own logits."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from helpers.families import HIDDEN, make_family_model
    from vllm_steer.hf import steering
    from vllm_steer.lens.lm import CALIBRATION_TEXTS

    path = make_family_model(family, tmp_path / family)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    tok = AutoTokenizer.from_pretrained(path)
    steer = random_steer(HIDDEN, 4, "s", seed=7)
    tot = n = 0
    for text in CALIBRATION_TEXTS:
        x = torch.tensor([tok(text, add_special_tokens=False)["input_ids"]])
        with torch.no_grad():
            plain = model(input_ids=x).logits[0, :-1].float()
            with steering(model, {"s": steer}, {"s": 1.0}):
                steered = model(input_ids=x).logits[0, :-1].float()
        d = steered - plain
        d = d - d.mean(-1, keepdim=True)
        tot, n = tot + float((d ** 2).sum()), n + d.numel()
    want = (tot / n) ** 0.5
    _, report = transfer(steer, model, tok, model, tok)
    assert report.rms_source == pytest.approx(want, rel=1e-3)
    assert report.rms_target == pytest.approx(want, rel=1e-2)
