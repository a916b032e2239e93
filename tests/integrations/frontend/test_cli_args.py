"""``--steer`` and its sibling flags (vllm_steer.integrations.frontend.cli_args) without starting an
engine: what `vllm serve` parses and shows, and the configuration carried to the workers."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from helpers.steers import random_steer
from vllm_steer.format import save_steer
from vllm_steer.integrations.frontend import cli_args


@pytest.fixture(scope="module")
def registered():
    """The plugin registered in this process (its hooks installed into vLLM)."""
    from vllm_steer.integrations import plugin

    plugin.register()


def _serve_parser():
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    return make_arg_parser(FlexibleArgumentParser(prog="vllm serve"))


def test_serve_parser_takes_steer_flags_and_carries_them_in_additional_config(registered,
                                                                             tmp_path):
    from vllm.engine.arg_utils import AsyncEngineArgs

    p = tmp_path / "sent.safetensors"
    save_steer(p, random_steer(64, 4, "sentiment"))
    args = _serve_parser().parse_args(["m", "--steer", "detox=/x/detox.safetensors",
                                       "--steer", str(p), "--steer-max-strength", "20"])
    engine_args = AsyncEngineArgs.from_cli_args(args)
    assert engine_args.additional_config["vllm_steer"] == {
        "steers": {"detox": "/x/detox.safetensors", "sentiment": str(p)},
        "max_strength": 20.0, "backend": "auto"}


def test_duplicate_steer_names_are_refused(registered):
    args = _serve_parser().parse_args(["m", "--steer", "a=/x", "--steer", "a=/y"])
    with pytest.raises(ValueError, match=r"the name\(s\) \['a'\] are given more than once"):
        cli_args.config_from_args(args)


def _vllm(*args, timeout=240):
    exe = os.path.join(os.path.dirname(sys.executable), "vllm")
    return subprocess.run([exe, *args], capture_output=True, text=True, timeout=timeout)


def test_vllm_serve_help_shows_the_steer_flags():
    out = _vllm("serve", "--help=vllm-steer")
    assert out.returncode == 0, out.stderr[-2000:]
    assert "--steer NAME=PATH [NAME=PATH ...]" in out.stdout
    assert "--steer-preset NAME=STEER:X[,STEER:X...] [NAME=STEER:X[,STEER:X...] ...]" in out.stdout
    assert "--steer-max-strength" in out.stdout


def test_several_steers_and_presets_after_one_flag_equal_the_repeated_form(registered,
                                                                           tmp_path):
    """`--steer a=A b=B` (like vLLM's --lora-modules) and `--steer a=A --steer b=B` build the
    same configuration, presets too; a later repeated flag adds to a one-flag list."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    paths = {}
    for name in ("detox", "sentiment", "formal"):
        paths[name] = tmp_path / f"{name}.safetensors"
        save_steer(paths[name], random_steer(64, 4, name))
    steers = [f"{n}={p}" for n, p in paths.items()]
    presets = ["polite=detox:4", "kind=detox:4,sentiment:2"]
    one = ["m", "--steer", *steers, "--steer-preset", *presets]
    repeated = ["m"] + [x for s in steers for x in ("--steer", s)] + \
        [x for p in presets for x in ("--steer-preset", p)]
    mixed = ["m", "--steer", *steers[:2], "--steer", steers[2], "--steer-preset", presets[0],
             "--steer-preset", presets[1]]
    configs = []
    for argv in (one, repeated, mixed):
        args = _serve_parser().parse_args(argv)
        assert args.model_tag == "m"  # the model is not taken as a steer
        configs.append(AsyncEngineArgs.from_cli_args(args).additional_config["vllm_steer"])
    assert configs[0] == configs[1] == configs[2]
    assert configs[0]["steers"] == {n: str(p) for n, p in paths.items()}
    assert configs[0]["presets"] == {"polite": {"detox": 4.0},
                                     "kind": {"detox": 4.0, "sentiment": 2.0}}


def test_enable_steer_updates_names_both_route_families_in_its_help_and_warning(monkeypatch):
    import argparse

    parser = argparse.ArgumentParser()
    cli_args.add_steer_args(parser)
    flag = next(a for a in parser._actions if "--enable-steer-updates" in a.option_strings)
    warned = []
    monkeypatch.setattr(cli_args.logger, "warning", lambda msg, *a: warned.append(msg % a))
    cli_args._runtime_args(argparse.Namespace(enable_steer_updates=True))
    assert len(warned) == 1
    for text in (flag.help, warned[0]):
        for route in ("POST /v1/steers", "DELETE /v1/steers/NAME", "POST /v1/steer-presets",
                      "DELETE /v1/steer-presets/NAME"):
            assert route in text, (route, text)


def test_no_steer_drafter_help_does_not_show_default_true_and_the_drafter_is_steered_unless_given():
    """vLLM's help formatter appends "(default: True)" to a store_false flag, which reads as
    if --no-steer-drafter were on; its help says what happens without it instead."""
    import argparse

    from vllm.utils.argparse_utils import SortedHelpFormatter

    parser = argparse.ArgumentParser(prog="vllm serve", formatter_class=SortedHelpFormatter)
    cli_args.add_steer_args(parser)
    text = " ".join(parser.format_help().split())
    entry = text[text.index("--no-steer-drafter Speculative"):].split(" --steer ")[0]
    assert "(default: True)" not in entry and "Without this flag the drafter is steered." \
        in entry, entry
    assert cli_args.config_from_args(parser.parse_args(["--steer", "a=/x"])).steer_drafter
    assert not cli_args.config_from_args(
        parser.parse_args(["--steer", "a=/x", "--no-steer-drafter"])).steer_drafter


def test_the_steer_admin_key_is_hidden_in_logs_and_joins_the_api_keys_once(monkeypatch):
    """--steer-admin-key (or VLLM_STEER_ADMIN_KEY): its repr is masked (vLLM logs the
    non-default arguments), it joins vLLM's API keys only when there are some (from
    --api-key, or VLLM_API_KEY as vLLM reads it), once however often the engine arguments
    are built, and never when it equals an API key."""
    import argparse

    parser = argparse.ArgumentParser()
    cli_args.add_steer_args(parser)
    flag = next(a for a in parser._actions if "--steer-admin-key" in a.option_strings)
    assert "VLLM_STEER_ADMIN_KEY" in flag.help and flag.default is None
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    monkeypatch.delenv("VLLM_STEER_ADMIN_KEY", raising=False)
    args = parser.parse_args(["--steer-admin-key", "k-0x51"])
    assert repr(args.steer_admin_key) == "'***'" and "k-0x51" not in repr(vars(args))
    args.api_key = None  # no API key: vLLM checks nothing, nothing to join
    cli_args.admit_admin_key(args)
    assert args.api_key is None
    args.api_key = ["inf"]
    for _ in range(2):
        cli_args.admit_admin_key(args)
        assert args.api_key == ["inf", "k-0x51"]
    # the key from the environment, the API key from VLLM_API_KEY
    monkeypatch.setenv("VLLM_STEER_ADMIN_KEY", "adm2")
    monkeypatch.setenv("VLLM_API_KEY", "inf2")
    env_args = argparse.Namespace(api_key=None, steer_admin_key=None)
    cli_args.admit_admin_key(env_args)
    assert env_args.api_key == ["inf2", "adm2"]
    same = argparse.Namespace(api_key=["adm2"], steer_admin_key=None)
    with pytest.raises(ValueError, match="give the admin key a value of its own"):
        cli_args.admit_admin_key(same)
