"""The trainer (vllm_steer.train.module / hidden / trainer) on the tiny model with synthetic,
separable data: the math against the reference, cached-state training against full-model
training, a short real run that steers held-out texts, the steer file, resume and seeds."""

from __future__ import annotations

import json
import os
import random

import pytest
import torch

from vllm_steer.format import load_steer, read_metadata
from vllm_steer.hf import token_logprobs
from vllm_steer.reference import steered_logits_reference
from vllm_steer.train.config import DataConfig, TrainConfig
from vllm_steer.train.hidden import compute_hidden, final_hidden
from vllm_steer.train.module import LMSteer
from vllm_steer.train.trainer import BatchSchedule, pad_batch, prepare, train_steer

POS_WORDS = "happy good great lovely wonderful kind sunny bright joyful nice".split()
NEG_WORDS = "sad bad awful terrible horrible cruel dark gloomy nasty ugly".split()
FILL = "the a day was and it felt very so we".split()


def _texts(words, n, seed):
    rng = random.Random(seed)
    return [" ".join(rng.choice(words) if rng.random() < 0.5 else rng.choice(FILL)
                     for _ in range(8)) for _ in range(n)]


@pytest.fixture(scope="module")
def synth(tmp_path_factory):
    d = tmp_path_factory.mktemp("synth")
    files = {}
    for name, words, n, seed in (("pos", POS_WORDS, 80, 1), ("neg", NEG_WORDS, 80, 2),
                                 ("dev_pos", POS_WORDS, 12, 3), ("dev_neg", NEG_WORDS, 12, 4)):
        files[name] = d / f"{name}.txt"
        files[name].write_text("\n".join(_texts(words, n, seed)))
    return files


def _data(synth) -> DataConfig:
    return DataConfig(positive=[str(synth["pos"])], negative=[str(synth["neg"])],
                      dev_positive=[str(synth["dev_pos"])], dev_negative=[str(synth["dev_neg"])])


def _cfg(model_dir, **kw) -> TrainConfig:
    base = dict(model=str(model_dir), rank=8, domain_rank=8, steps=40, batch_size=8,
                max_length=32, eval_every=20, checkpoint_every=0, check_strengths=(5.0,),
                model_dtype="float32", cache_dtype="float32", head_dtype="float32",
                final_eval_max_texts=40)
    base.update(kw)
    return TrainConfig(**base)


@pytest.fixture(scope="module")
def prep(tiny_model_dir, synth):
    return prepare(_cfg(tiny_model_dir), _data(synth), log=lambda m: None)


def _hidden_batch(prep, n=6):
    ids, att = pad_batch(prep.train_ids[:n], 0)
    h = final_hidden(prep.model, ids, att)
    return h[att.bool()]


def test_steered_logits_equal_reference(prep):
    lm = LMSteer(prep.model, rank=4, domain_rank=3, epsilon=1e-3, init_std=0.5, seed=0)
    c = _hidden_batch(prep)
    signs = torch.tensor([1.0, -1.0]).repeat(c.shape[0])[:c.shape[0]]
    head = prep.model.get_output_embeddings()
    coefs = torch.stack([signs * 1e-3, torch.full_like(signs, 1e-3)], 1)
    want = steered_logits_reference(c, head.weight, torch.cat([lm.p1, lm.q1], 1).detach(),
                                    torch.cat([lm.p2, lm.q2], 1).detach(), [0, 4, 7], coefs)
    with torch.no_grad():
        torch.testing.assert_close(lm.logits(c, signs), want, rtol=1e-5, atol=1e-5)
        # the steer matters at this scale (so the comparison above is not vacuous)
        assert (want - c @ head.weight.T).abs().max() > 0.1


@pytest.mark.parametrize("rank", [4, 64])  # 4: low-rank route, 64 (= hidden): dense route
def test_fused_step_matches_autograd(prep, rank):
    lm = LMSteer(prep.model, rank=rank, epsilon=1e-3, init_std=0.3, seed=1)
    c = _hidden_batch(prep)
    t = torch.randint(0, 49152, (c.shape[0],), generator=torch.Generator().manual_seed(0))
    s = (torch.arange(c.shape[0]) % 2).float() * 2 - 1
    assert lm.route(torch.float32) == ("lowrank" if rank == 4 else "dense")

    def run(fn):
        for p in lm.factor_params():
            p.grad = None
        loss = fn()
        return loss, torch.cat([p.grad.flatten() for p in lm.factor_params()])

    ref_loss, ref_g = run(lambda: lm._loss_backward_autograd(c, t, s, torch.float32, 10**6,
                                                              1.0, True))
    for hd, chunk, tol in ((torch.float32, 10**6, 1e-5), (torch.float32, 7, 1e-5),
                           (torch.bfloat16, 16, 3e-2)):
        loss, g = run(lambda hd=hd, chunk=chunk: lm.loss_backward(c, t, s, head_dtype=hd,
                                                                  chunk_tokens=chunk))
        assert loss == pytest.approx(ref_loss, rel=tol)
        assert float((g - ref_g).norm() / ref_g.norm()) < tol * 10, (hd, chunk)


def test_cached_training_equals_full_model_training(prep):
    """Same seed, same batches, 4 Adam steps: training on cached hidden states (float32) and
    training through the whole model give the same steer. Tolerance: the step-0 gradients
    agree to 1e-4 relative and the final W = P2 P1^T to 1e-3 relative (Frobenius)."""
    cfg = prep.cfg
    hs = compute_hidden(prep.model, prep.tokenizer, prep.train_ids, prep.train_sides,
                        cache_dtype=torch.float32, progress=False)
    sched = BatchSchedule(hs.num_texts, cfg.batch_size, cfg.seed)
    lms = [LMSteer(prep.model, 8, 8, cfg.epsilon, cfg.init_std, cfg.seed) for _ in range(2)]
    opts = [torch.optim.Adam(lm.factor_params(), lr=cfg.lr) for lm in lms]
    grads0 = []
    for step in range(4):
        idx = sched.indices(step)
        c, t, s = hs.batch(idx)
        for k, (lm, opt) in enumerate(zip(lms, opts, strict=True)):
            opt.zero_grad()
            if k == 0:
                lm.loss_backward(c, t, s, head_dtype=torch.float32)
            else:
                ids, att = pad_batch([prep.train_ids[i] for i in idx], 0)
                signs = torch.tensor([float(prep.train_sides[i]) for i in idx])
                lm.full_loss(ids, att, signs).backward()
            if step == 0:
                grads0.append(torch.cat([p.grad.flatten() for p in lm.factor_params()]))
            opt.step()
    assert float((grads0[0] - grads0[1]).norm() / grads0[1].norm()) < 1e-4
    w = [(lm.p2 @ lm.p1.T).detach() for lm in lms]
    moved = [(w_ - (LMSteer(prep.model, 8, 8, cfg.epsilon, cfg.init_std, cfg.seed).p2 @
                    LMSteer(prep.model, 8, 8, cfg.epsilon, cfg.init_std, cfg.seed).p1.T)
              ).norm() for w_ in w]
    assert all(m > 0.1 for m in moved)  # training moved the steer
    assert float((w[0] - w[1]).norm() / w[1].norm()) < 1e-3


@pytest.fixture(scope="module")
def trained(prep, tmp_path_factory):
    out = tmp_path_factory.mktemp("out") / "syn.safetensors"
    res = train_steer(prep.cfg, _data_from(prep), str(out), name="syn",
                      labels={"positive": "upbeat", "negative": "gloomy"}, progress=False,
                      log=lambda m: None, prepared=prep)
    return res, out


def _data_from(prep):
    return prep.dataset


def test_trained_steer_steers_held_out_texts(trained, prep):
    """The user-visible claim, measured with the saved file through hf.token_logprobs on
    the dev texts (never trained on): +s lowers the positive texts' loss, -s the negative
    texts', relative to s = 0."""
    res, out = trained
    steer = load_steer(out)
    pos = [e.text for e in prep.dataset.dev if e.side > 0]
    neg = [e.text for e in prep.dataset.dev if e.side < 0]

    def nll(texts, s):
        lps = token_logprobs(prep.model, prep.tokenizer, texts, steers=steer, strengths=s)
        return -float(torch.cat(lps).mean())

    p0, pp, pn = nll(pos, 0.0), nll(pos, 5.0), nll(pos, -5.0)
    n0, np_, nn_ = nll(neg, 0.0), nll(neg, 5.0), nll(neg, -5.0)
    assert pp < p0 < pn, (pp, p0, pn)
    assert nn_ < n0 < np_, (nn_, n0, np_)
    # the metadata's own dev check says the same, with the same numbers
    chk = res.metrics["dev_check"]
    assert chk["positive"]["+5"] < chk["positive"]["0"]
    assert chk["negative"]["-5"] < chk["negative"]["0"]
    assert chk["positive"]["0"] == pytest.approx(p0, rel=1e-3)
    assert chk["negative"]["-5"] == pytest.approx(nn_, rel=1e-3)
    # and training lowered the held-out objective
    assert res.metrics["dev_loss"] < res.metrics["dev_loss_initial"]


def test_steer_file_records_the_recipe(trained, prep):
    res, out = trained
    meta = read_metadata(out)
    steer = load_steer(out)
    assert meta.name == "syn" and meta.hidden_size == 64 and meta.rank == 8
    assert meta.epsilon == 1e-3 and meta.domain == "none" and meta.recommended_strength == 5.0
    assert meta.labels == {"positive": "upbeat", "negative": "gloomy"}
    assert meta.base_model == prep.model_path
    assert steer.domain_p1.shape == (64, 8) and steer.p1.shape == (64, 8)
    assert meta.recipe["lr"] == 1e-2 and meta.recipe["steps"] == 40 and meta.recipe["seed"] == 0
    assert meta.recipe["init_std"] == 1e-2 and meta.recipe["batch_size"] == 8
    assert set(meta.data["sha256"]) == set(prep.dataset.sha256)
    assert all(len(h) == 64 for h in meta.data["sha256"].values())
    assert meta.data["counts"]["train"] == {"positive": 80, "negative": 80}
    for k in ("train_loss", "dev_loss", "dev_loss_initial"):
        assert isinstance(meta.metrics[k], float) and 0 < meta.metrics[k] < 100
    assert [h["step"] for h in meta.metrics["history"]] == [0, 20, 40]
    # steered forward of the file equals the trained module's factors
    torch.testing.assert_close(steer.p1, res.steer.p1)


def test_resume_equals_uninterrupted_and_seed_repeats(prep, tmp_path):
    cfg6 = _cfg(prep.cfg.model, steps=6, checkpoint_every=3, eval_every=3)
    kw = dict(progress=False, log=lambda m: None, prepared=prep)
    full = train_steer(cfg6, prep.dataset, str(tmp_path / "full.safetensors"), **kw)
    again = train_steer(cfg6, prep.dataset, None, **kw)
    assert torch.equal(full.steer.p1, again.steer.p1)
    other = train_steer(_cfg(prep.cfg.model, steps=6, seed=1, checkpoint_every=0),
                        prep.dataset, None, progress=False, log=lambda m: None)
    assert not torch.allclose(full.steer.p1, other.steer.p1)
    # "interrupted" after 3 steps (checkpoint kept), then resumed to 6
    out = str(tmp_path / "part.safetensors")
    cfg3 = _cfg(prep.cfg.model, steps=3, checkpoint_every=3, eval_every=3)
    train_steer(cfg3, prep.dataset, out, keep_checkpoint=True, **kw)
    assert (tmp_path / "part.safetensors.ckpt" / "state.pt").exists()
    assert (tmp_path / "part.safetensors.ckpt" / "hidden-train.safetensors").exists()
    logs = []
    resumed = train_steer(cfg6, prep.dataset, out, resume=True, progress=False,
                          log=logs.append, prepared=prep)
    assert any("resuming from step 3" in m for m in logs)
    assert any("reusing the hidden states" in m for m in logs)
    assert torch.equal(resumed.steer.p1, full.steer.p1)
    assert torch.equal(resumed.steer.domain_p2, full.steer.domain_p2)
    assert resumed.metrics["dev_loss"] == full.metrics["dev_loss"]
    assert not (tmp_path / "part.safetensors.ckpt").exists()  # removed after success
    # a checkpoint folder the user named keeps the user's files: only the run's are removed
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    train_steer(cfg3, prep.dataset, str(tmp_path / "m.safetensors"), checkpoint_dir=str(mine),
                **kw)
    assert sorted(p.name for p in mine.iterdir()) == ["notes.txt"]


def test_resume_refuses_a_different_recipe(prep, tmp_path):
    out = str(tmp_path / "s.safetensors")
    kw = dict(progress=False, log=lambda m: None, prepared=prep)
    train_steer(_cfg(prep.cfg.model, steps=2, checkpoint_every=2), prep.dataset, out,
                keep_checkpoint=True, **kw)
    with pytest.raises(ValueError, match=r"(?s)cannot resume.*lr: checkpoint 0.01, now 0.05"):
        train_steer(_cfg(prep.cfg.model, steps=4, lr=0.05, checkpoint_every=2), prep.dataset,
                    out, resume=True, **kw)
    with pytest.raises(ValueError, match=r"checkpoint is at step 2, past --steps 1 \(--steps "
                                         r"may grow, not shrink: give --steps 2 or more\)"):
        train_steer(_cfg(prep.cfg.model, steps=1, checkpoint_every=2), prep.dataset, out,
                    resume=True, **kw)
    with pytest.raises(FileNotFoundError, match="--resume: no checkpoint"):
        train_steer(_cfg(prep.cfg.model, steps=4), prep.dataset, str(tmp_path / "x.safetensors"),
                    resume=True, **kw)


def test_a_model_given_as_a_relative_path_is_recorded_as_its_absolute_path(
        tiny_model_dir, synth, tmp_path, monkeypatch):
    # the steer names its base model for the lens commands and the server's checks, run
    # from any folder later
    from vllm_steer.cli import main

    monkeypatch.chdir(tiny_model_dir.parent)
    out = tmp_path / "rel.safetensors"
    assert main(["train", "--model", f"./{tiny_model_dir.name}", "--positive",
                 str(synth["pos"]), "--negative", str(synth["neg"]), "--out", str(out),
                 "--rank", "2", "--steps", "1", "--batch-size", "4", "--max-examples", "4",
                 "--dev-fraction", "0", "--quiet"]) == 0
    assert read_metadata(out).base_model == str(tiny_model_dir.resolve())


def test_cli_train_writes_a_steer_and_reports_bad_input(tiny_model_dir, synth, tmp_path, capsys):
    from vllm_steer.cli import main

    out = tmp_path / "cli.safetensors"
    rc = main(["train", "--model", str(tiny_model_dir), "--positive", str(synth["pos"]),
               "--negative", str(synth["neg"]), "--out", str(out), "--rank", "4", "--steps", "3",
               "--batch-size", "4", "--max-examples", "12", "--check-strengths", "5",
               "--positive-means", "upbeat", "--quiet", "--head-dtype", "float32"])
    assert rc == 0
    err = capsys.readouterr().err
    assert "it/s]" not in err and "Loading" not in err, err  # --quiet: no bar, transformers' too
    meta = read_metadata(out)
    assert meta.rank == 4 and meta.labels == {"positive": "upbeat"}
    assert meta.data["counts"]["train"] == {"positive": 12, "negative": 12}
    assert json.loads(meta.to_json())["recipe"]["steps"] == 3
    # no dev set at all: trains, no dev metrics, the paper's strength 5 recommended
    nodev = tmp_path / "nodev.safetensors"
    assert main(["train", "--model", str(tiny_model_dir), "--positive", str(synth["pos"]),
                 "--negative", str(synth["neg"]), "--out", str(nodev), "--rank", "4",
                 "--steps", "2", "--batch-size", "4", "--max-examples", "8",
                 "--dev-fraction", "0", "--quiet"]) == 0
    meta = read_metadata(nodev)
    assert meta.recommended_strength == 5.0 and "dev_loss" not in meta.metrics
    assert meta.data["counts"]["dev"] == {"positive": 0, "negative": 0}
    rc = main(["train", "--model", str(tiny_model_dir), "--positive", str(synth["pos"]),
               "--negative", str(tmp_path / "missing.txt"), "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == 1 and "missing.txt: no such file" in err
    rc = main(["train", "--model", str(tiny_model_dir), "--positive", str(synth["pos"]),
               "--negative", str(synth["neg"]), "--out", str(out), "--max-length", "100000"])
    assert rc == 1 and "exceeds the model's context window of 512" in capsys.readouterr().err
    gguf = tmp_path / "s.GGUF"  # an LM-Steer is no control vector, in any case of the suffix
    rc = main(["train", "--model", str(tiny_model_dir), "--positive", str(synth["pos"]),
               "--negative", str(synth["neg"]), "--out", str(gguf)])
    assert rc == 2 and "llama.cpp's GGUF holds vector steers only" in capsys.readouterr().err
    assert not gguf.exists()


def test_recommended_strength_rule():
    from vllm_steer.train.trainer import recommend_strength

    check = {"positive": {"0": 4.00, "+1": 3.99, "-1": 4.1, "+2": 4.04, "-2": 4.3,
                          "+5": 4.20, "-5": 5.0},
             "negative": {"0": 5.00, "+1": 5.1, "-1": 4.95, "+2": 5.3, "-2": 4.97,
                          "+5": 6.0, "-5": 5.02}}
    rec, rule = recommend_strength(check, (1.0, 2.0, 5.0), budget=0.05)
    assert rec == 2.0 and "0.05 nats/token" in rule  # +5 costs the positive texts 0.20
    assert recommend_strength(check, (1.0, 2.0, 5.0), budget=0.5)[0] == 5.0
    assert recommend_strength(check, (5.0,), budget=0.01)[0] is None


def test_domain_dropout_mask_is_per_text_and_repeatable(prep):
    from vllm_steer.train.trainer import domain_mask

    hs = compute_hidden(prep.model, prep.tokenizer, prep.train_ids[:40], prep.train_sides[:40],
                        progress=False)
    idx = torch.arange(40)
    cfg = _cfg(prep.cfg.model, domain_dropout=0.5)
    m = domain_mask(hs, idx, cfg, step=3, device="cpu")
    assert torch.equal(m, domain_mask(hs, idx, cfg, step=3, device="cpu"))
    assert not torch.equal(m, domain_mask(hs, idx, cfg, step=4, device="cpu"))
    n_rows = hs.lengths() - 1
    per_text = torch.split(m, n_rows.tolist())
    assert all(len(set(x.tolist())) == 1 for x in per_text)  # one value per text
    kept = sum(float(x[0]) for x in per_text)
    assert 8 <= kept <= 32  # about half of 40 texts keep the domain steer
    assert domain_mask(hs, idx, _cfg(prep.cfg.model), step=3, device="cpu") == 1.0


# ------------------------------------------------------------------ what a run computes

def _spy_hidden(monkeypatch, prep):
    """Record the texts (as training-split indices) whose hidden states the trainer computes."""
    import vllm_steer.train.trainer as tr

    by_ids = {tuple(x): i for i, x in enumerate(prep.train_ids)}
    computed: list[list[int]] = []
    real = tr.compute_hidden

    def spy(model, tok, ids_list, sides, **kw):
        computed.append([by_ids.get(tuple(x), -1) for x in ids_list])
        return real(model, tok, ids_list, sides, **kw)

    monkeypatch.setattr(tr, "compute_hidden", spy)
    return computed


def _manual_steer(prep, steps):
    """The steer of ``steps`` Adam steps on the hidden states of *every* training text (the
    old behaviour), batches from the same schedule."""
    cfg = prep.cfg
    hs = compute_hidden(prep.model, prep.tokenizer, prep.train_ids, prep.train_sides,
                        cache_dtype=torch.float32, progress=False)
    sched = BatchSchedule(hs.num_texts, cfg.batch_size, cfg.seed)
    lm = LMSteer(prep.model, cfg.rank, cfg.domain_rank, cfg.epsilon, cfg.init_std, cfg.seed)
    opt = torch.optim.Adam(lm.factor_params(), lr=cfg.lr)
    for step in range(steps):
        c, t, s = hs.batch(sched.indices(step))
        opt.zero_grad()
        lm.loss_backward(c, t, s, head_dtype=torch.float32)
        opt.step()
    return lm.p1.detach(), sched


def test_a_short_run_computes_only_the_texts_its_steps_use(prep, tmp_path, monkeypatch):
    """`--steps 3` of batch 8 over 160 texts computes the hidden states of the (at most) 24
    texts its batches draw, not of all 160, and trains the same steer as a run that had
    every text's states; resuming to 6 steps computes only the texts not computed before."""
    computed = _spy_hidden(monkeypatch, prep)
    out = str(tmp_path / "short.safetensors")
    cfg3 = _cfg(prep.cfg.model, steps=3, checkpoint_every=3, eval_every=0)
    logs: list[str] = []
    res = train_steer(cfg3, prep.dataset, out, keep_checkpoint=True, progress=False,
                      log=logs.append, prepared=prep)
    want_p1, sched = _manual_steer(prep, 3)
    drawn = {int(i) for step in range(3) for i in sched.indices(step)}
    train_calls = [c for c in computed if -1 not in c]  # the dev texts are not training texts
    assert len(train_calls) == 1 and set(train_calls[0]) == drawn
    assert len(drawn) <= 24 < len(prep.train_ids)
    assert res.metrics["train_texts_used"] == len(drawn)
    assert any(f"the {len(drawn)} of {len(prep.train_ids)} texts this run uses" in m
               for m in logs)
    torch.testing.assert_close(res.steer.p1, want_p1, rtol=1e-5, atol=1e-6)

    computed.clear()
    cfg6 = _cfg(prep.cfg.model, steps=6, checkpoint_every=3, eval_every=0)
    res6 = train_steer(cfg6, prep.dataset, out, resume=True, progress=False,
                       log=lambda m: None, prepared=prep)
    drawn6 = {int(i) for step in range(6) for i in sched.indices(step)}
    assert [set(c) for c in computed] == [drawn6 - drawn]  # only the new texts, once
    torch.testing.assert_close(res6.steer.p1, _manual_steer(prep, 6)[0], rtol=1e-5, atol=1e-6)


def test_step_tokens_samples_that_many_target_tokens(prep, monkeypatch):
    seen: list[int] = []
    real = LMSteer.loss_backward

    def spy(self, c, targets, signs, **kw):
        if kw.get("backward", True):
            seen.append(int(targets.shape[0]))
        return real(self, c, targets, signs, **kw)

    monkeypatch.setattr(LMSteer, "loss_backward", spy)
    kw = dict(progress=False, log=lambda m: None, prepared=prep)
    res = train_steer(_cfg(prep.cfg.model, steps=3, step_tokens=10, eval_every=0),
                      prep.dataset, None, **kw)
    assert seen == [10, 10, 10]
    assert res.metrics["train_loss"] < 100
    seen.clear()
    # a budget above the batch's tokens keeps them all: the default run's steer exactly
    big = train_steer(_cfg(prep.cfg.model, steps=3, step_tokens=10**6, eval_every=0),
                      prep.dataset, None, **kw)
    assert min(seen) > 10
    torch.testing.assert_close(big.steer.p1, _manual_steer(prep, 3)[0], rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="step_tokens=0: must be a positive integer"):
        _cfg(prep.cfg.model, step_tokens=0).validate()


def test_dev_check_losses_equal_plain_cross_entropy_at_every_strength(prep):
    """All strengths of the dev check come from two GEMMs per chunk; each equals plain
    cross-entropy of the reference's steered logits (style steer alone, as served)."""
    import torch.nn.functional as F

    from vllm_steer.train.trainer import steer_check

    lm = LMSteer(prep.model, rank=4, domain_rank=3, epsilon=1e-3, init_std=0.5, seed=2)
    pick = list(range(15)) + list(range(len(prep.train_ids) - 15, len(prep.train_ids)))
    hs = compute_hidden(prep.model, prep.tokenizer, [prep.train_ids[i] for i in pick],
                        [prep.train_sides[i] for i in pick], cache_dtype=torch.float32,
                        progress=False)
    assert set(hs.sides.tolist()) == {1, -1}
    chk = steer_check(lm, hs, (2.0, 5.0), batch_texts=7)
    head = prep.model.get_output_embeddings().weight
    for side_name, side in (("positive", 1), ("negative", -1)):
        idx = torch.nonzero(hs.sides == side).flatten()
        c, t, _ = hs.batch(idx)
        for key, st in (("0", 0.0), ("+2", 2.0), ("-5", -5.0), ("+5", 5.0)):
            coefs = torch.full((len(t), 1), st * 1e-3)
            lg = steered_logits_reference(c, head, lm.p1.detach(), lm.p2.detach(), [0, 4], coefs)
            want = float(F.cross_entropy(lg, t))
            assert chk[side_name][key] == pytest.approx(want, rel=1e-5), (side_name, key)
    assert chk["positive"]["+5"] != pytest.approx(chk["positive"]["0"], rel=1e-4)


def test_train_strengths_are_drawn_per_text_and_scale_the_steer_like_epsilon(prep):
    """`train_strengths` (m,) trains W at +-m*eps0: without a domain steer that is the same
    loss as a run with epsilon m*eps0, so the same factors; a mixture draws one magnitude per
    text (repeatable per step)."""
    from vllm_steer.train.trainer import strength_scale

    kw = dict(progress=False, log=lambda m: None, prepared=prep)
    base = dict(steps=3, eval_every=0, domain_rank=0)
    doubled = train_steer(_cfg(prep.cfg.model, train_strengths=(2.0,), **base), prep.dataset,
                          None, **kw)
    eps2 = train_steer(_cfg(prep.cfg.model, epsilon=2 * prep.cfg.epsilon, **base),
                       prep.dataset, None, **kw)
    torch.testing.assert_close(doubled.steer.p1, eps2.steer.p1, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(doubled.steer.p2, eps2.steer.p2, rtol=1e-4, atol=1e-6)
    paper = train_steer(_cfg(prep.cfg.model, **base), prep.dataset, None, **kw)
    assert not torch.allclose(doubled.steer.p1, paper.steer.p1)

    hs = compute_hidden(prep.model, prep.tokenizer, prep.train_ids[:40], prep.train_sides[:40],
                        progress=False)
    idx = torch.arange(40)
    cfg = _cfg(prep.cfg.model, train_strengths=(1.0, 4.0))
    m = strength_scale(hs, idx, cfg, step=2, device="cpu")
    assert torch.equal(m, strength_scale(hs, idx, cfg, step=2, device="cpu"))
    per_text = torch.split(m, (hs.lengths() - 1).tolist())
    firsts = [float(x[0]) for x in per_text]
    assert all(len(set(x.tolist())) == 1 for x in per_text) and set(firsts) == {1.0, 4.0}
    assert strength_scale(hs, idx, _cfg(prep.cfg.model), step=2, device="cpu") is None
    for bad in ((), (0.0,), (float("nan"),), (-1.0, 2.0)):
        with pytest.raises(ValueError, match="train_strengths=.*give 1 to 64 magnitudes"):
            _cfg(prep.cfg.model, train_strengths=bad).validate()


def test_cli_train_prints_its_estimate_first_and_the_cache_size_is_right(tiny_model_dir, synth,
                                                                        tmp_path, capsys):
    """The estimate line comes before the hidden-state pass, and its cache size is what the
    cache files take on disk (within 20%)."""
    import re

    from vllm_steer.cli import main

    out = tmp_path / "est.safetensors"
    assert main(["train", "--model", str(tiny_model_dir), "--positive", str(synth["pos"]),
                 "--negative", str(synth["neg"]), "--out", str(out), "--steps", "3",
                 "--batch-size", "4", "--quiet", "--keep-checkpoint",
                 "--cache-dtype", "float32", "--train-strengths", "1", "2,4"]) == 0
    err = capsys.readouterr().err
    lines = [ln for ln in err.split("\n") if ln.startswith("[train]")]
    m = re.match(r"\[train\] estimate: hidden states of ([\d,]+) tokens \(cache ([\d.]+) "
                 r"(KiB|MiB|GiB), ~[\d.]+ (?:s|min) at [\d,]+ tokens/s unless already "
                 r"cached\), 3 steps \(~[\d.]+ "
                 r"(?:s|min)\); peak memory about [\d.]+ (?:KiB|MiB|GiB)", lines[0])
    assert m, lines[:2]
    est = float(m.group(2)) * {"KiB": 2**10, "MiB": 2**20, "GiB": 2**30}[m.group(3)]
    ckpt = tmp_path / "est.safetensors.ckpt"
    real = sum(f.stat().st_size for f in ckpt.glob("hidden-*.safetensors"))
    assert real > 0 and abs(est - real) <= 0.2 * real, (est, real)
    meta = read_metadata(out)
    assert json.loads(meta.to_json())["recipe"]["train_strengths"] == [1.0, 2.0, 4.0]
    assert meta.rank == 16  # the default
    # the estimate is for the model given: its parameters, hidden size, vocabulary, dtype,
    # device (read here from the model's own files)
    from safetensors import safe_open

    with safe_open(str(tiny_model_dir / "model.safetensors"), "pt") as f:
        params = sum(f.get_slice(k).get_shape()[0] * (f.get_slice(k).get_shape() + [1])[1]
                     for k in f.keys())
    cfg = json.loads((tiny_model_dir / "config.json").read_text())
    m = re.search(r"; the model: (.+) parameters, hidden size (\d+), vocabulary ([\d,]+), "
                  r"(float32|bfloat16) on cpu \((.+) MiB\)$", lines[0])
    assert m and m.groups() == (
        f"{params / 1e6:.3g}M", str(cfg["hidden_size"]), f"{cfg['vocab_size']:,}", m[4],
        f"{params * {'float32': 4, 'bfloat16': 2}[m[4]] / 2**20:.3g}"), lines[0]
    # the model's tokenizer has a chat template: the run says the texts are read as plain text
    has_template = "chat_template" in (tiny_model_dir / "tokenizer_config.json").read_text() \
        or (tiny_model_dir / "chat_template.jinja").exists()
    note = [ln for ln in lines if "has a chat template" in ln]
    assert has_template and note and "read as plain text" in note[0], lines[:3]


def test_cli_train_requires_a_model_outside_the_demo_presets(tmp_path, capsys):
    from vllm_steer.cli import main

    (tmp_path / "p.txt").write_text("good\n")
    assert main(["train", "--positive", str(tmp_path / "p.txt"), "--negative",
                 str(tmp_path / "p.txt"), "--out", str(tmp_path / "x.safetensors")]) == 2
    err = capsys.readouterr().err
    assert "vllm-steer train: error: --model is required" in err
    assert "--preset detox, --preset sentiment" in err and "default to smollm2" in err
    assert not (tmp_path / "x.safetensors").exists()
    from vllm_steer.train.cli import train_model

    assert train_model(None, "detox") == "smollm2" and train_model("m", None) == "m"


def test_a_hugging_face_id_is_read_from_the_cache_and_a_folder_without_a_model_refused(
        tiny_model_dir, tmp_path):
    """``--model org/name`` is a Hugging Face id (read from the local cache, offline here),
    not a missing folder; a folder with no model in it is named as such."""
    import shutil
    import subprocess
    import sys

    from vllm_steer.train.module import load_model

    snap = tmp_path / "hub" / "models--org--tiny" / "snapshots" / "0123abcd"
    shutil.copytree(tiny_model_dir, snap)
    (tmp_path / "hub" / "models--org--tiny" / "refs").mkdir()
    (tmp_path / "hub" / "models--org--tiny" / "refs" / "main").write_text("0123abcd")
    code = ("import torch; from vllm_steer.train.module import load_model; "
            "m, t, p = load_model('org/tiny', torch.device('cpu'), torch.float32); "
            "print(type(m).__name__, p)")
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == ["LlamaForCausalLM", "org/tiny"]
    empty = tmp_path / "not-a-model"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="not a model folder \\(no config.json in it\\)"):
        load_model(str(empty), torch.device("cpu"), torch.float32)
    with pytest.raises(FileNotFoundError, match="no such folder"):
        load_model(str(tmp_path / "missing" / "x"), torch.device("cpu"), torch.float32)


@pytest.mark.parametrize("extra, fragment", [
    (["--check-strengths", "0"], "check_strengths=(0.0,): give strengths in (0, 10000]"),
    (["--check-strengths=-2,1"], "give strengths in (0, 10000]"),
    (["--max-examples", "-3"], "--max-examples -3: must be an integer >= 1"),
    (["--dev-max", "0"], "--dev-max 0: must be an integer >= 1"),
    (["--dev-fraction", "-0.5"], "--dev-fraction -0.5: must be in [0, 1)"),
    (["--lr", "inf"], "lr=inf: must be a positive finite number"),
    (["--init-std", "nan"], "init_std=nan: must be a positive finite number"),
    (["--regularization", "nan"], "regularization=nan: must be a finite number >= 0"),
    (["--fluency-budget", "nan"], "fluency_budget=nan: must be a finite number >= 0"),
    (["--recommended-strength", "nan"], "--recommended-strength nan: give a finite strength"),
    (["--recommended-strength", "1e6"], "of at most 10000 in size"),
    (["--kind", "vector", "--dev-fraction", "-0.5"], "--dev-fraction -0.5"),
    (["--kind", "vector", "--max-examples", "0"], "--max-examples 0"),
])
def test_cli_train_refuses_bad_numbers_before_any_work(tmp_path, capsys, extra, fragment):
    """Refused naming the flag and the rule before the model or a file is read (the model
    here does not exist: a later check would say so instead), never after the training."""
    from vllm_steer.cli import main

    (tmp_path / "p.txt").write_text("good\n")
    out = tmp_path / "x.safetensors"
    assert main(["train", "--model", str(tmp_path / "no-model"), "--positive",
                 str(tmp_path / "p.txt"), "--negative", str(tmp_path / "p.txt"), "--out",
                 str(out), *extra]) == 2
    err = capsys.readouterr().err
    assert fragment in err and "no-model" not in err, err
    assert not out.exists()


def test_cli_train_vector_pairs_refuse_unused_and_bad_data_flags(tmp_path, capsys):
    from vllm_steer.cli import main

    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text('{"positive": "good", "negative": "bad"}\n' * 4)
    base = ["train", "--kind", "vector", "--model", str(tmp_path / "no-model"), "--pairs",
            str(pairs), "--out", str(tmp_path / "v.gguf")]
    for extra, fragment in ((["--max-examples", "2"], "--max-examples and --pairs"),
                            (["--dev-fraction", "-0.5"], "--dev-fraction -0.5")):
        assert main([*base, *extra]) == 2
        err = capsys.readouterr().err
        assert fragment in err and "no-model" not in err, err


def test_an_explicit_check_strength_list_equal_to_the_lm_steer_default_is_kept(monkeypatch,
                                                                              tmp_path):
    """``--kind vector --check-strengths 1,2,3,5,10`` is what the user asked for, though it
    equals an LM-Steer's default; without the flag a vector steer uses its own default."""
    from vllm_steer.cli import main
    from vllm_steer.train import vector

    seen = []
    monkeypatch.setattr(vector, "train_vector", lambda cfg, *a, **k: seen.append(cfg))
    (tmp_path / "p.txt").write_text("good\n")
    base = ["train", "--kind", "vector", "--model", "m", "--positive", str(tmp_path / "p.txt"),
            "--negative", str(tmp_path / "p.txt"), "--out", str(tmp_path / "v.gguf")]
    assert main([*base, "--check-strengths", "1,2,3,5,10"]) == 0
    assert main(base) == 0
    assert seen[0].check_strengths == (1.0, 2.0, 3.0, 5.0, 10.0)
    assert seen[1].check_strengths is None


def test_a_long_loss_history_is_thinned_to_what_a_steer_file_holds():
    """``--eval-every 1`` over thousands of steps: the file keeps 500 evaluations, the first
    and the last among them, in order, and its metadata stays under the reader's limit."""
    from vllm_steer.format import MAX_METADATA_BYTES
    from vllm_steer.train.trainer import MAX_HISTORY_POINTS, thin_history

    history = [{"step": k, "dev_loss": 4.0 + 1.0 / (k + 1)} for k in range(4001)]
    thin = thin_history(history)
    assert len(thin) == MAX_HISTORY_POINTS == 500
    assert thin[0] == history[0] and thin[-1] == history[-1]
    steps = [h["step"] for h in thin]
    gaps = [b - a for a, b in zip(steps, steps[1:], strict=False)]
    assert steps == sorted(set(steps)) and max(gaps) <= 9
    assert len(json.dumps(thin)) < MAX_METADATA_BYTES // 4
    assert thin_history(history[:10]) == history[:10]
