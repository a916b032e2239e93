"""``vllm-steer``'s command line as a user meets it: the top-level help, the ``serve`` hint,
and every flag of every sub-command documented with its default once."""

from __future__ import annotations

import argparse
import re

import pytest

from vllm_steer.cli import STATES_DEFAULT, HelpFormatter, build_parser, main, walk_parsers


def _help_problems(parser: argparse.ArgumentParser) -> list[str]:
    problems = []
    for q in walk_parsers(parser):
        fmt = q._get_formatter()
        for a in q._actions:
            if isinstance(a, (argparse._HelpAction, argparse._SubParsersAction)):
                continue
            name = "/".join(a.option_strings) or a.dest
            if not a.help or a.help == argparse.SUPPRESS:
                problems.append(f"{q.prog} {name}: no help text")
                continue
            text = fmt._expand_help(a)
            n = len(re.findall(STATES_DEFAULT, text, re.I))  # "repeng's default" says none
            meaningful = a.option_strings and not (a.default is None or a.default is False
                                                   or a.default in ([], argparse.SUPPRESS))
            if n > 1 or (meaningful and n == 0):
                problems.append(f"{q.prog} {name}: the default is shown {n} times: {text!r}")
    return problems


def test_every_flag_of_every_command_has_help_with_its_default_once():
    problems = _help_problems(build_parser())
    assert not problems, "\n".join(problems)


def test_help_check_catches_missing_help_and_a_default_shown_twice():
    p = argparse.ArgumentParser(prog="x", formatter_class=HelpFormatter)
    p.add_argument("--steps", type=int, default=3, help="optimiser steps")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    assert _help_problems(p) == []
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--rank", type=int, default=16, help="rank (default 16)")
    p.add_argument("--method", default="pca", help="pca (repeng's default)")
    p.add_argument("--l2", type=float, default=0.0, help="penalty")
    p.formatter_class = argparse.HelpFormatter
    got = _help_problems(p)
    assert got == ["x --steps: the default is shown 0 times: 'optimiser steps'",
                   "x --lr: no help text", "x --method: the default is shown 0 times: "
                   "\"pca (repeng's default)\"", "x --l2: the default is shown 0 times: "
                   "'penalty'"], got
    p.formatter_class = argparse.ArgumentDefaultsHelpFormatter
    got = _help_problems(p)
    assert got[1].startswith("x --rank: the default is shown 2 times"), got


def test_the_help_shows_each_default_and_points_to_vllm_serve(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "vllm serve MODEL --steer NAME=PATH" in out
    for cmd in ("train", "tune", "info", "steers", "presets"):
        assert re.search(rf"^\s+{cmd}\s", out, re.M), cmd
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = capsys.readouterr().out
    assert re.search(r"--rank R\s+rank of the steer.*\(default: 16\)", out, re.S)
    assert re.search(r"--steps STEPS\s+.*\(default: 1000\)", out, re.S)


def test_serve_is_answered_with_the_vllm_serve_command(capsys):
    assert main(["serve", "my-model", "--steer", "detox=d.safetensors"]) == 2
    err = capsys.readouterr().err
    assert "invalid choice" not in err
    assert "vllm serve MODEL --steer NAME=PATH" in err
    assert "vllm serve my-model --steer detox=d.safetensors" in err


def test_a_reader_that_stops_early_gets_no_traceback():
    """``vllm-steer info FILE | head``: when the reader has gone, no BrokenPipeError
    traceback on stderr, and exit status 1 (here the reader closes the pipe before the first
    write, so every write fails)."""
    import subprocess
    import sys
    from pathlib import Path

    steer = Path(__file__).resolve().parents[2] / "steers" / "smollm2-vector-detox.safetensors"
    code = ("import sys; from vllm_steer.cli import main; sys.exit(main(['info', "
            f"{str(steer)!r}]))")
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    p.stdout.close()  # the reader is gone before the command writes
    err = p.stderr.read()
    assert p.wait(timeout=120) == 1
    assert err == "", err


@pytest.mark.parametrize("shipped", ["smollm2-detox.safetensors",
                                     "smollm2-vector-detox.safetensors"])
def test_info_refuses_a_file_that_serving_refuses(tmp_path, capsys, shipped):
    """``vllm-steer info`` is the check before a steer is published: a file whose header is
    right but which holds a NaN (serving refuses it) fails there too, naming the tensor."""
    from pathlib import Path

    from safetensors import safe_open
    from safetensors.torch import save_file

    src = Path(__file__).resolve().parents[2] / "steers" / shipped
    with safe_open(str(src), framework="pt") as f:
        meta = f.metadata()
        tensors = {k: f.get_tensor(k).clone() for k in f.keys()}
    assert main(["info", str(src)]) == 0
    capsys.readouterr()
    name = sorted(tensors)[0]
    tensors[name].view(-1)[3] = float("nan")
    bad = tmp_path / shipped
    save_file(tensors, str(bad), metadata=meta)
    assert main(["info", str(bad)]) == 1
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith("vllm-steer info: error: ") and "NaN" in err and name in err, err


def test_an_os_error_is_one_line_naming_the_file(capsys, monkeypatch):
    """An OSError a command lets through ends as ``vllm-steer CMD: error: FILE: why`` with
    exit status 1, not a traceback."""
    import vllm_steer.cli as cli

    def fails(args):
        raise IsADirectoryError(21, "Is a directory", "some/dir")

    monkeypatch.setattr(cli, "_cmd_info", fails)
    assert main(["info", "x"]) == 1
    assert capsys.readouterr().err == "vllm-steer info: error: some/dir: Is a directory\n"


def test_train_help_says_each_kinds_defaults(capsys):
    """``--method`` shows its default although its help names repeng's; a vector steer's
    check strengths and its recorded strength without a dev set are said, not the
    LM-Steer's alone."""
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert re.search(r"--method \{pca,caa\} .*? caa = their mean \(default: pca\)", out), out
    assert ("--check-strengths S,S,... strengths of the final dev check (+-s versus 0), "
            "comma-separated (default: 1,2,3,5,10; for --kind vector: fractions 0.01, 0.02, "
            "0.03, 0.05, 0.1 of one mean difference per block)") in out
    assert ("(default: measured, see --fluency-budget; with no dev set, 5 (the paper's) for "
            "an LM-Steer and none for --kind vector)") in out
    assert re.search(r"--regularization REGULARIZATION .*? \(default: 0\)", out)


def test_ctrl_c_is_one_line_and_status_130(capsys, monkeypatch):
    """Ctrl-C in a command: no KeyboardInterrupt traceback; ``train`` says how to go on."""
    import vllm_steer.cli as cli

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_cmd_info", interrupted)
    assert main(["info", "x"]) == 130
    assert capsys.readouterr().err == "\nvllm-steer info: interrupted\n"
    from vllm_steer.train import cli as train_cli

    monkeypatch.setattr(train_cli, "cmd_train", interrupted)
    assert main(["train", "--preset", "detox", "--out", "x.safetensors"]) == 130
    assert "vllm-steer train: interrupted; --resume continues from its last checkpoint" in \
        capsys.readouterr().err
