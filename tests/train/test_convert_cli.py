"""What ``vllm-steer convert`` tells a user whose output path or input file is not what it
expects: the exit status, the one-line message on stderr, and the files left on disk. The
inputs are made here in a moment (a control vector of 4 blocks, a paper checkpoint of hidden
size 8); no model is loaded."""

from __future__ import annotations

import argparse
import os

import numpy as np
import pytest
import torch

from vllm_steer.cli import main
from vllm_steer.format import make_steer, save_steer
from vllm_steer.vectors import load_vector, make_vector_steer, save_gguf

pytest.importorskip("gguf")

HIDDEN = 8


@pytest.fixture()
def cv(tmp_path):
    """A llama.cpp control vector for blocks 1-4 (no block 0, as llama.cpp's files)."""
    rng = np.random.default_rng(0)
    path = tmp_path / "cv.gguf"
    save_gguf(path, make_vector_steer({k: rng.standard_normal(HIDDEN) for k in range(1, 5)},
                                      "cv"))
    return path


@pytest.fixture()
def paper(tmp_path):
    """A checkpoint as the paper's train.py writes it."""
    path = tmp_path / "paper.pt"
    state = {"projector1": torch.randn(2, HIDDEN, 2), "projector2": torch.randn(2, HIDDEN, 2)}
    torch.save([argparse.Namespace(model_name="tiny", epsilon=1e-3, dummy_steer=1,
                                   training_steer=0), state, 10], path)
    return path


def usage_error(err: str) -> str:
    """The error line of a usage error's stderr: the command's usage, then one line."""
    assert err.startswith("usage: vllm-steer "), err
    return err.strip().splitlines()[-1]


def _error(capsys, argv, rc=1):
    """Run the command; its exit status is ``rc`` and stderr is one line of
    ``vllm-steer convert: error: ...`` (no traceback), after the command's usage for a usage
    error (flags that do not go together: exit status 2, as argparse's). Returns that line."""
    assert main(argv) == rc
    cap = capsys.readouterr()
    err = usage_error(cap.err) if rc == 2 else cap.err.strip()
    assert "Traceback" not in cap.err and err.count("\n") == 0, err
    assert err.startswith("vllm-steer convert: error: "), err
    return err


def _files(folder):
    return sorted(os.listdir(folder))


# ---- the output path --------------------------------------------------------------------

@pytest.mark.parametrize("flags", [[], ["--unsafe-allow-pickle"]], ids=["vector", "lm-steer"])
def test_out_a_directory_is_refused_by_name_and_leaves_nothing(tmp_path, capsys, cv, paper,
                                                               flags):
    src = cv if not flags else paper
    outdir = tmp_path / "outdir"
    outdir.mkdir()
    before = _files(tmp_path)
    for out in (str(outdir), str(outdir) + "/"):
        err = _error(capsys, ["convert", str(src), "--out", out, *flags], rc=2)
        assert f"'{out}' is a directory, not a file" in err
        assert f"e.g. {os.path.join(out, 'NAME.safetensors')}" in err
    assert _files(tmp_path) == before and _files(outdir) == []  # no OUT.tmp, no OUT/.tmp


def test_out_below_a_file_is_refused_by_name(tmp_path, capsys, cv):
    blocker = tmp_path / "afile"
    blocker.write_text("x")
    before = _files(tmp_path)
    for out in ("/dev/null/x.gguf", str(blocker / "sub" / "x.gguf")):
        err = _error(capsys, ["convert", str(cv), "--out", out], rc=2)
        assert f"cannot write '{out}'" in err and "is not a directory" in err
    assert _files(tmp_path) == before and blocker.read_text() == "x"


def test_a_failed_write_names_the_file_and_leaves_no_temporary(tmp_path, capsys, cv,
                                                              monkeypatch):
    """A write the operating system fails half-way (here: the disk fills) is one line naming
    the file, with nothing half-written left behind."""
    import safetensors.torch

    def disk_full(tensors, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"half")
        raise OSError(28, "No space left on device", filename)

    monkeypatch.setattr(safetensors.torch, "save_file", disk_full)
    out = tmp_path / "x.safetensors"
    err = _error(capsys, ["convert", str(cv), "--out", str(out)])
    assert err == f"vllm-steer convert: error: cannot write '{out}' (No space left on device)"
    assert _files(tmp_path) == ["cv.gguf"]


def test_train_refuses_an_out_directory_before_loading_anything(tmp_path, capsys):
    err_argv = ["train", "--model", str(tmp_path / "no-such-model"), "--positive", "p.txt",
                "--negative", "n.txt", "--out", str(tmp_path)]
    assert main(err_argv) == 2
    err = usage_error(capsys.readouterr().err)
    assert err.startswith(f"vllm-steer train: error: --out: '{tmp_path}' is a directory"), err


def test_train_refuses_the_same_out_file_twice_before_loading_anything(tmp_path, capsys):
    out = tmp_path / "v.safetensors"
    argv = ["train", "--kind", "vector", "--model", str(tmp_path / "no-such-model"),
            "--positive", "p.txt", "--negative", "n.txt", "--out", str(out),
            str(tmp_path / "." / "v.safetensors")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "is given twice" in err and "no-such-model" not in err, err


# ---- the .gguf suffix -------------------------------------------------------------------

def test_gguf_suffix_in_any_case_writes_gguf(tmp_path, capsys, cv):
    out = tmp_path / "c.GGUF"
    assert main(["convert", str(cv), "--out", str(out)]) == 0
    assert "(llama.cpp GGUF)" in capsys.readouterr().out
    assert out.read_bytes()[:4] == b"GGUF"
    assert load_vector(out).layers == [1, 2, 3, 4]


def test_an_lm_steer_is_not_written_as_gguf(tmp_path, capsys, paper):
    for out in ("p.gguf", "p.GGUF"):
        err = _error(capsys, ["convert", str(paper), "--unsafe-allow-pickle", "--out",
                              str(tmp_path / out)])
        assert "an LM-Steer cannot be written as llama.cpp's GGUF" in err
        assert "write a .safetensors file" in err
        assert not (tmp_path / out).exists()


# ---- what the input is ------------------------------------------------------------------

def test_a_steer_file_of_ours_is_named_as_one_not_as_a_pickle(tmp_path, capsys):
    steer = tmp_path / "detox.safetensors"
    save_steer(steer, make_steer(torch.randn(HIDDEN, 2), torch.randn(HIDDEN, 2), "detox"))
    for flags in ([], ["--unsafe-allow-pickle"]):
        err = _error(capsys, ["convert", str(steer), "--out", str(tmp_path / "y.gguf"),
                              *flags])
        assert "already an LM-Steer file in this project's format" in err
        assert "nothing to convert" in err
        assert "an LM-Steer cannot be written as llama.cpp's GGUF" in err  # both reasons
        assert "is a torch.save pickle" not in err and "--unsafe" not in err
    assert not (tmp_path / "y.gguf").exists()


@pytest.mark.parametrize("raw, says", [
    (b"", "the file is empty"),
    (b"GGU", "the file is 3 bytes, too short"),  # a GGUF's magic cut short
    (b"hello\n", "the file is 6 bytes, too short"),
    (b"hello world, some text\n", "this one starts with b'hello wo'"),
], ids=["empty", "3-byte-gguf", "short-text", "text"])
def test_what_is_no_checkpoint_is_not_called_a_pickle(tmp_path, capsys, raw, says):
    path = tmp_path / "in.pt"  # (a short or empty .gguf is refused as a GGUF: test_vectors.py)
    path.write_bytes(raw)
    for flags in ([], ["--unsafe-allow-pickle"]):
        err = _error(capsys, ["convert", str(path), "--out", str(tmp_path / "y.safetensors"),
                              *flags])
        assert err.startswith(f"vllm-steer convert: error: {path}: ") and says in err, err
        assert "is a torch.save pickle" not in err and "--unsafe" not in err
    assert _files(tmp_path) == ["in.pt"]


def test_only_a_torch_checkpoint_gets_the_pickle_advice(tmp_path, capsys, paper):
    assert main(["convert", str(paper), "--out", str(tmp_path / "y.safetensors")]) == 2
    err = capsys.readouterr().err
    assert "is a torch.save pickle" in err and "--unsafe-allow-pickle" in err


# ---- --layers on a file -----------------------------------------------------------------

def test_layers_name_the_files_blocks_not_a_model(tmp_path, capsys, cv):
    out = tmp_path / "c.gguf"
    err = _error(capsys, ["convert", str(cv), "--out", str(out), "--layers", "1-40"])
    assert (f"--layers 1-40: {cv} has no vector for blocks 5-40; it has vectors for blocks "
            "1-4") in err
    assert "decoder blocks" not in err and "model" not in err
    assert not out.exists()
    assert main(["convert", str(cv), "--out", str(out), "--layers", "all"]) == 0
    assert load_vector(out).layers == [1, 2, 3, 4]
    assert main(["convert", str(cv), "--out", str(out), "--layers", "2-3"]) == 0
    assert load_vector(out).layers == [2, 3]


def test_block_0_to_gguf_suggests_layers_that_work_when_the_blocks_have_gaps(tmp_path,
                                                                                 capsys):
    """A steer for blocks 0, 1, 2 and 5 cannot go to GGUF with block 0; the ``--layers`` the
    error suggests is run as given and keeps exactly the other blocks, and the summary line
    names the blocks written as the errors do (``1-2,5``, not ``1-5``)."""
    import re

    from vllm_steer.vectors import save_vector

    rng = np.random.default_rng(1)
    dirs = {k: rng.standard_normal(HIDDEN).astype(np.float32) for k in (0, 1, 2, 5)}
    src = tmp_path / "gaps.safetensors"
    save_vector(src, make_vector_steer(dirs, "gaps"))
    out = tmp_path / "gaps.gguf"
    assert main(["convert", str(src), "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("vllm-steer convert: error: ") and "Traceback" not in err
    assert "keep blocks from 1 on (--layers 1-2,5)" in err and not out.exists()
    hint = re.search(r"\(--layers ([^)]+)\)", err).group(1)
    assert main(["convert", str(src), "--out", str(out), "--layers", hint]) == 0
    assert capsys.readouterr().out.strip() == (
        f"wrote {out} (llama.cpp GGUF): gaps, hidden size {HIDDEN}, blocks 1-2,5 (3 vectors)")
    back = load_vector(out)
    assert back.layers == [1, 2, 5]
    for k in (1, 2, 5):
        assert np.array_equal(back.directions[k].numpy(), dirs[k])
    assert main(["convert", str(src), "--out", str(tmp_path / "same.safetensors")]) == 0
    assert capsys.readouterr().out.strip().endswith("blocks 0-2,5 (4 vectors)")


def test_a_checkpoints_zero_epsilon_is_refused_not_made_the_default(tmp_path, capsys):
    """``args.epsilon = 0`` in a checkpoint (a steer that does nothing) is refused naming it
    and the fix, not silently served at 1e-3; ``--epsilon`` then converts it."""
    path = tmp_path / "zero.pt"
    state = {"projector1": torch.randn(2, HIDDEN, 2), "projector2": torch.randn(2, HIDDEN, 2)}
    torch.save([argparse.Namespace(model_name="tiny", epsilon=0.0, dummy_steer=1,
                                   training_steer=0), state, 10], path)
    out = tmp_path / "z.safetensors"
    argv = ["convert", str(path), "--out", str(out), "--unsafe-allow-pickle"]
    err = _error(capsys, argv)
    assert "the checkpoint's args.epsilon=0.0 is outside 1e-09 to 1" in err
    assert "give --epsilon" in err and not out.exists()
    assert main([*argv, "--epsilon", "2e-3"]) == 0


def test_a_vector_steer_refuses_the_lm_steer_domain_flag(tmp_path, capsys, cv):
    err = _error(capsys, ["convert", str(cv), "--out", str(tmp_path / "x.gguf"),
                          "--domain", "none"], rc=2)
    assert "--domain: flags of LM-Steer checkpoints" in err
