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
