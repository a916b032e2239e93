"""The lens commands' count and strength flags are refused at parse time (exit 2, before any
model is loaded), naming the flag, the value and what to give: not an internal error after the
model loaded (``range() arg 3 must not be zero``) nor a silent slice (``--directions -1``)."""

from __future__ import annotations

import pytest

from vllm_steer.cli import main


@pytest.mark.parametrize("command, flag, value", [
    ("explain", "--directions", "-1"),
    ("explain", "--top", "0"),
    ("highlight", "--spans", "-2"),
    ("highlight", "--max-span", "0"),
    ("score", "--batch-size", "0"),
    ("score", "--limit", "-5"),
    ("score", "--strengths", "abc"),
    ("transfer", "--anchors", "-5"),
    ("transfer", "--heldout", "-1"),
])
def test_bad_count_or_strength_is_a_usage_error_naming_the_flag(command, flag, value, capsys):
    argv = [command, "--steer", "no-such.safetensors", f"{flag}={value}"]
    argv += (["--from", "a", "--to", "b", "--out", "o.safetensors"] if command == "transfer"
             else ["--text", "hello"] if command in ("highlight", "score") else [])
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}" in err and repr(value) in err


@pytest.mark.parametrize("command, given, said", [
    ("highlight", [], "one of the arguments --text --file is required"),
    ("highlight", ["--text", "x", "--file", "f.txt"], "argument --file: not allowed with "
                                                      "argument --text"),
    ("score", [], "one of the arguments --text --file --dataset is required"),
    ("score", ["--text", "x", "--file", "f.txt"], "argument --file: not allowed with "
                                                  "argument --text"),
    ("score", ["--file", "f.txt", "--dataset", "sst2"], "argument --dataset: not allowed with "
                                                        "argument --file"),
])
def test_the_texts_to_read_are_one_source_refused_at_parse_time(command, given, said, capsys,
                                                                tmp_path):
    """``--text``, ``--file`` (and ``score``'s ``--dataset``): exactly one, a usage error
    (exit 2) before the steer or the model is read; two of them were taken silently (the
    text won over the file) or refused only after the model had loaded."""
    steer = tmp_path / "missing.safetensors"  # never read: the parser refuses first
    with pytest.raises(SystemExit) as e:
        main([command, "--steer", str(steer), *given])
    assert e.value.code == 2
    assert said in capsys.readouterr().err


@pytest.mark.parametrize("command", ["transfer", "highlight", "explain", "score"])
@pytest.mark.parametrize("suffix", [".gguf", ".safetensors"])
def test_a_control_vector_is_refused_naming_what_the_lens_reads(command, suffix, tmp_path,
                                                                capsys):
    """A control vector (llama.cpp's GGUF or ours) given to a lens command: one line naming
    the file, its kind and what the lens reads; it was the LM-Steer reader's advice to call a
    Python function (``vllm_steer.vectors.load_vector``) or to convert the file."""
    from helpers.steers import random_vectors, save_vector_steer

    path = save_vector_steer(tmp_path / f"cv{suffix}", random_vectors(16, range(1, 3), 0), "cv")
    argv = [command, "--steer", path]
    argv += (["--from", "a", "--to", "b", "--out", str(tmp_path / "o.safetensors")]
             if command == "transfer" else ["--text", "hello"]
             if command in ("highlight", "score") else [])
    assert main(argv) == 1
    err = capsys.readouterr().err.strip()
    assert err == (f"vllm-steer {command}: error: --steer {path}: a vector steer, not an "
                   "LM-Steer; the lens reads LM-Steer files, whose matrix W it transfers, "
                   f"highlights, explains and scores (`vllm-steer info {path}` shows this "
                   "file)"), err
    assert not (tmp_path / "o.safetensors").exists()
