"""Import of checkpoints of the paper's code (vllm_steer.train.convert, `vllm-steer convert`):
refused without --unsafe-allow-pickle, and the converted steer gives the logits of the
paper's formula h + eps * sum_i v_i (h P1_i) P2_i^T."""

from __future__ import annotations

import argparse

import pytest
import torch

from vllm_steer.cli import main
from vllm_steer.format import SteerFileError, load_steer, read_metadata
from vllm_steer.hf import output_head, steering
from vllm_steer.train.convert import convert_checkpoint

HIDDEN, RANK = 64, 6


def _paper_checkpoint(path, num_steers=2, dummy_steer=1, training_steer=0, epsilon=1e-3,
                      seed=0, scale=0.3):
    """A checkpoint exactly as the paper's train.py writes it."""
    g = torch.Generator().manual_seed(seed)
    args = argparse.Namespace(model_name="tiny-llama", adaptor_class="multiply",
                              num_steers=num_steers, rank=RANK, epsilon=epsilon, init_var=1e-2,
                              lr=1e-2, n_steps=1000, batch_size=32, dummy_steer=dummy_steer,
                              training_steer=training_steer, regularization=0.0, seed=0,
                              ckpt_name=str(path))
    state = {"projector1": torch.randn(num_steers, HIDDEN, RANK, generator=g) * scale,
             "projector2": torch.randn(num_steers, HIDDEN, RANK, generator=g) * scale}
    torch.save([args, state, 1000], path)
    return state


def _paper_logits(hidden, state, values, epsilon, head):
    """The paper's Projected_Adaptor.forward ("multiply"), written out independently;
    ``hidden`` is [batch, tokens, hidden] as in the paper's code."""
    p1, p2 = state["projector1"], state["projector2"]
    v = torch.tensor(values, dtype=torch.float32)[None]  # [1, num_steers]
    delta = hidden[:, None].matmul(p1[None]) * v[:, :, None, None]
    delta = delta.matmul(p2.transpose(1, 2)[None]).sum(1)
    out = (hidden + epsilon * delta).matmul(head.weight.detach().transpose(0, 1))
    return out if getattr(head, "bias", None) is None else out + head.bias


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    ids = torch.tensor([tok("The paper's steer, converted and served.")["input_ids"]])
    store = []
    h = output_head(model).register_forward_pre_hook(lambda m, a: store.append(a[0].detach()))
    with torch.no_grad():
        model(input_ids=ids)
    h.remove()
    return model, ids, store[0]


def _steered_logits(model, ids, steer, s):
    with steering(model, steer, s), torch.no_grad():
        return model(input_ids=ids).logits.float()


def test_refused_without_the_flag(tmp_path, capsys):
    ckpt = tmp_path / "ref.pt"
    _paper_checkpoint(ckpt)
    out = tmp_path / "x.safetensors"
    rc = main(["convert", str(ckpt), "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == 2 and not out.exists()
    assert "--unsafe-allow-pickle" in err and "arbitrary code" in err
    # and the loader's own message points to this exact command
    with pytest.raises(SteerFileError, match="vllm-steer convert FILE --unsafe-allow-pickle"):
        load_steer(ckpt)


@pytest.mark.parametrize("s", [5.0, -3.0])
def test_converted_steer_gives_the_paper_logits(tiny, tmp_path, capsys, s):
    model, ids, hidden = tiny
    ckpt = tmp_path / "ref.pt"
    state = _paper_checkpoint(ckpt)
    out = tmp_path / "x.safetensors"
    assert main(["convert", str(ckpt), "--out", str(out), "--unsafe-allow-pickle"]) == 0
    assert "wrote" in capsys.readouterr().out
    steer = load_steer(out)
    head = output_head(model)
    # default: the dummy steer served with the steer, like the paper's --steer_values S 1
    want = _paper_logits(hidden, state, [s, 1.0], 1e-3, head)
    got = _steered_logits(model, ids, steer, s)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert (want - _paper_logits(hidden, state, [0.0, 0.0], 1e-3, head)).abs().max() > 0.05
    # --domain none: --steer_values S 0
    out2 = tmp_path / "y.safetensors"
    assert main(["convert", str(ckpt), "--out", str(out2), "--unsafe-allow-pickle",
                 "--domain", "none"]) == 0
    got2 = _steered_logits(model, ids, load_steer(out2), s)
    torch.testing.assert_close(got2, _paper_logits(hidden, state, [s, 0.0], 1e-3, head),
                               rtol=1e-4, atol=1e-4)


def test_metadata_records_the_source(tmp_path):
    ckpt = tmp_path / "detox-ref.pt"
    _paper_checkpoint(ckpt, epsilon=2e-3)
    steer = convert_checkpoint(str(ckpt), allow_pickle=True)
    m = steer.metadata
    assert m.name == "detox-ref" and m.hidden_size == HIDDEN and m.rank == RANK
    assert m.epsilon == 2e-3 and m.base_model == "tiny-llama" and m.domain == "with_steer"
    assert m.source["step"] == 1000 and m.source["num_steers"] == 2
    assert m.source["steer_index"] == 0 and m.source["dummy_index"] == 1
    assert len(m.source["sha256"]) == 64 and m.source["args"]["adaptor_class"] == "multiply"
    assert m.recipe["lr"] == 1e-2 and m.recipe["n_steps"] == 1000


def test_steer_and_dummy_indices(tiny, tmp_path):
    model, ids, hidden = tiny
    ckpt = tmp_path / "three.pt"
    state = _paper_checkpoint(ckpt, num_steers=3, dummy_steer=None, seed=3)
    out = tmp_path / "z.safetensors"
    assert main(["convert", str(ckpt), "--out", str(out), "--unsafe-allow-pickle",
                 "--steer-index", "2", "--dummy-index", "0"]) == 0
    got = _steered_logits(model, ids, load_steer(out), 4.0)
    want = _paper_logits(hidden, state, [1.0, 0.0, 4.0], 1e-3, output_head(model))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    # no dummy_steer recorded and several steers: the dummy defaults to index 1
    assert convert_checkpoint(str(ckpt), allow_pickle=True).metadata.source["dummy_index"] == 1
    meta = read_metadata(out)
    assert meta.source["steer_index"] == 2 and meta.source["dummy_index"] == 0
    with pytest.raises(ValueError, match="--steer-index 3 is out of range: the checkpoint "
                                         "holds 3 steers"):
        convert_checkpoint(str(ckpt), allow_pickle=True, steer_index=3)
    single = tmp_path / "one.pt"
    _paper_checkpoint(single, num_steers=1, dummy_steer=None)
    st = convert_checkpoint(str(single), allow_pickle=True)
    assert st.domain_p1 is None and st.metadata.domain == "none"


def test_not_a_paper_checkpoint(tmp_path):
    bad = tmp_path / "bad.pt"
    torch.save([argparse.Namespace(adaptor_class="add"), {"add_vec": torch.zeros(2, 8)}, 5], bad)
    with pytest.raises(ValueError, match="only the 'multiply' adaptor.*can be converted"):
        convert_checkpoint(str(bad), allow_pickle=True)
    other = tmp_path / "other.pt"
    torch.save({"weights": torch.zeros(3)}, other)
    with pytest.raises(ValueError, match=r"expected \[args, state_dict, step\]"):
        convert_checkpoint(str(other), allow_pickle=True)
