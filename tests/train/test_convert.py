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
    # the args say no dummy steer was trained (dummy_steer=None): none is applied
    st = convert_checkpoint(str(ckpt), allow_pickle=True)
    assert st.metadata.source["dummy_index"] is None and st.metadata.domain == "none"
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


# ---- hostile inputs (issue 14) --------------------------------------------------------------

def _one_line_error(capsys, argv):
    rc = main(argv)
    err = capsys.readouterr().err.strip()
    assert rc != 0 and err.count("\n") == 0 and err.startswith("vllm-steer convert:"), err
    return err


def test_unreadable_inputs_get_one_line_and_a_nonzero_exit(tmp_path, capsys):
    import os

    good = tmp_path / "good.pt"
    _paper_checkpoint(good)
    data = good.read_bytes()
    cases = {"random.pt": os.urandom(4096), "empty.pt": b"", "truncated.pt": data[:len(data) // 2],
             "pickle-head.pt": b"\x80\x02" + os.urandom(64), "tiny.pt": b"\x80"}
    for fname, raw in cases.items():
        path = tmp_path / fname
        path.write_bytes(raw)
        out = tmp_path / "x.safetensors"
        err = _one_line_error(capsys, ["convert", str(path), "--out", str(out),
                                       "--unsafe-allow-pickle"])
        assert str(path) in err and not out.exists()
    assert "empty" in _one_line_error(capsys, ["convert", str(tmp_path / "empty.pt"), "--out",
                                               str(tmp_path / "x.safetensors"),
                                               "--unsafe-allow-pickle"])
    steer = tmp_path / "s.safetensors"
    assert main(["convert", str(good), "--out", str(steer), "--unsafe-allow-pickle"]) == 0
    capsys.readouterr()
    assert "already an LM-Steer file in this project's format" in _one_line_error(
        capsys, ["convert", str(steer), "--out", str(tmp_path / "y.safetensors"),
                 "--unsafe-allow-pickle"])


class _Planted:
    """A pickle payload that creates a file when unpickled (it must never be)."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_restricted_loader_refusal_is_final_without_the_second_flag(tmp_path, capsys):
    marker = tmp_path / "code-ran"
    evil = tmp_path / "evil.pt"
    state = {"projector1": torch.zeros(2, 4, 2), "projector2": torch.zeros(2, 4, 2)}
    torch.save([argparse.Namespace(), state, 1, _Planted(marker)], evil)
    err = _one_line_error(capsys, ["convert", str(evil), "--out", str(tmp_path / "x.safetensors"),
                                   "--unsafe-allow-pickle"])
    assert not marker.exists()
    assert "restricted loader" in err and "--unsafe-full-unpickle" in err and "open" in err


def test_dummy_follows_the_checkpoint_args(tiny, tmp_path):
    model, ids, hidden = tiny
    head = output_head(model)
    ckpt = tmp_path / "nodummy.pt"
    state = _paper_checkpoint(ckpt, num_steers=2, dummy_steer=None, seed=5)
    st = convert_checkpoint(str(ckpt), allow_pickle=True)
    assert st.domain_p1 is None and st.metadata.domain == "none"
    # the paper without a dummy steer: only the style steer, at S
    torch.testing.assert_close(_steered_logits(model, ids, st, 4.0),
                               _paper_logits(hidden, state, [4.0, 0.0], 1e-3, head),
                               rtol=1e-4, atol=1e-4)
    # training_steer=1, no dummy: steer 1 alone
    ckpt1 = tmp_path / "t1.pt"
    state1 = _paper_checkpoint(ckpt1, num_steers=2, dummy_steer=None, training_steer=1, seed=6)
    st1 = convert_checkpoint(str(ckpt1), allow_pickle=True)
    torch.testing.assert_close(_steered_logits(model, ids, st1, 3.0),
                               _paper_logits(hidden, state1, [0.0, 3.0], 1e-3, head),
                               rtol=1e-4, atol=1e-4)
    # no args at all: the dummy defaults to index 1 when there are several steers
    bare = tmp_path / "bare.pt"
    torch.save([None, state, 7], bare)
    assert convert_checkpoint(str(bare), allow_pickle=True).metadata.source["dummy_index"] == 1
    with pytest.raises(ValueError, match="--no-dummy"):
        convert_checkpoint(str(bare), allow_pickle=True, steer_index=1)
    assert convert_checkpoint(str(bare), allow_pickle=True, steer_index=1,
                              no_dummy=True).domain_p1 is None


def test_converted_name_follows_the_name_rule(tmp_path):
    ckpt = tmp_path / "my ckpt, v2.pt"
    _paper_checkpoint(ckpt)
    assert convert_checkpoint(str(ckpt), allow_pickle=True).metadata.name == "my-ckpt-v2"


def test_self_referencing_args_are_recorded_not_a_crash(tmp_path, capsys):
    loop = []
    loop.append(loop)
    ckpt = tmp_path / "loop.pt"
    state = {"projector1": torch.randn(2, HIDDEN, RANK), "projector2": torch.randn(2, HIDDEN, RANK)}
    torch.save([argparse.Namespace(dummy_steer=1, training_steer=0, notes=loop), state, 1], ckpt)
    out = tmp_path / "loop.safetensors"
    assert main(["convert", str(ckpt), "--out", str(out), "--unsafe-allow-pickle"]) == 0
    assert read_metadata(out).source["args"]["notes"][0][0][0] == [[[[[[[[[[[[["'list'"]]]]]]]]]]]]]
