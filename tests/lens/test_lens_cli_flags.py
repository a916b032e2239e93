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
