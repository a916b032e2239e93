"""The soft-blacklist baseline: its definition, its file, and its trainer on a tiny model."""

import pytest
import torch

from vllm_steer.eval.soft_blacklist import (SoftBlacklist, SoftBlacklistConfig, describe,
                                            load_soft_blacklist, save_soft_blacklist,
                                            train_soft_blacklist)

POS = ["what a good and lovely day", "good people doing good things", "lovely, good, kind",
       "a kind and lovely neighbour", "good food and good friends", "kind words, good deeds"]
NEG = ["what a bad and awful day", "bad people doing bad things", "awful, bad, cruel",
       "a cruel and awful neighbour", "bad food and bad friends", "cruel words, bad deeds"]


def test_apply_adds_strength_times_epsilon_times_bias():
    b = torch.tensor([1000.0, -2000.0, 0.0])
    sb = SoftBlacklist(b, "bl", epsilon=1e-3)
    logits = torch.tensor([[0.5, 0.5, 0.5], [1.0, 2.0, 3.0]])
    out = sb.apply(logits, 2.0)
    assert torch.allclose(out, logits + torch.tensor([2.0, -4.0, 0.0]))
    assert torch.equal(sb.apply(logits, 0.0), logits)
    with pytest.raises(ValueError, match="4 columns but the soft blacklist 'bl' covers 3"):
        sb.apply(torch.zeros(1, 4), 1.0)


def test_file_round_trip_and_refusals(tmp_path):
    sb = SoftBlacklist(torch.randn(10), "bl", 2e-3, torch.randn(10), "smollm2",
                       {"positive": "non-toxic"}, {"steps": 3}, {}, {"dev_loss": 1.0})
    p = str(tmp_path / "bl.safetensors")
    save_soft_blacklist(p, sb)
    back = load_soft_blacklist(p)
    assert torch.equal(back.bias, sb.bias) and torch.equal(back.domain, sb.domain)
    assert (back.name, back.epsilon, back.labels, back.recipe) == ("bl", 2e-3,
                                                                  {"positive": "non-toxic"},
                                                                  {"steps": 3})
    from safetensors.torch import save_file

    other = str(tmp_path / "steer.safetensors")
    save_file({"steer.P1": torch.zeros(4, 2)}, other)
    with pytest.raises(ValueError, match="not a soft-blacklist file"):
        load_soft_blacklist(other)
    with pytest.raises(FileNotFoundError, match="no such file"):
        load_soft_blacklist(str(tmp_path / "missing.safetensors"))


def test_trainer_lowers_the_loss_on_a_tiny_model(tiny_model_dir, tmp_path):
    from vllm_steer.train.config import DataConfig

    (tmp_path / "pos.txt").write_text("\n".join(POS * 4))
    (tmp_path / "neg.txt").write_text("\n".join(NEG * 4))
    data = DataConfig(positive=[str(tmp_path / "pos.txt")], negative=[str(tmp_path / "neg.txt")],
                      dev_fraction=0.25)
    cfg = SoftBlacklistConfig(model=str(tiny_model_dir), steps=25, batch_size=8, lr=0.1,
                              max_length=16, model_dtype="float32", head_dtype="float32",
                              check_strengths=(1.0,))
    out = str(tmp_path / "bl.safetensors")
    sb = train_soft_blacklist(cfg, data, out, name="bl", labels={"positive": "good"},
                              progress=False, log=lambda m: None)
    m = sb.metrics
    assert m["dev_loss"] < m["dev_loss_initial"] - 0.5
    assert m["history"][-1]["train_loss"] < m["history"][0]["train_loss"]
    # +s moves towards the positive texts, -s towards the negative ones
    pos, neg = m["dev_check"]["positive"], m["dev_check"]["negative"]
    assert pos["+1"] < pos["0"] < pos["-1"] and neg["-1"] < neg["0"] < neg["+1"]
    assert sb.vocab_size == 49152 and load_soft_blacklist(out).recipe["steps"] == 25
    from transformers import AutoTokenizer

    d = describe(sb, k=5, tokenizer=AutoTokenizer.from_pretrained(tiny_model_dir))
    assert any(w.strip() in {"good", "lovely", "kind"} for w in d["raised"])
    assert any(w.strip() in {"bad", "awful", "cruel"} for w in d["lowered"])


def test_bad_recipe_is_refused():
    with pytest.raises(ValueError, match="steps=0: must be a positive integer"):
        SoftBlacklistConfig(steps=0).validate()
