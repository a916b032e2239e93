"""The hook machinery (vllm_steer.integrations.hooks): a vLLM that moved one of the plugin's
patch points gets a warning without steers and a refusal with them, naming the version and
the hook."""

from __future__ import annotations

import subprocess
import sys

from helpers.steers import random_steer
from vllm_steer.format import save_steer

MISSING_HOOK = r"""
import sys
from vllm.engine.arg_utils import EngineArgs
from vllm.v1.engine.input_processor import InputProcessor

del InputProcessor._build_logits_processors_params_validator  # "a vLLM that moved it"
from vllm_steer.integrations import plugin
from vllm_steer.integrations.hooks import MissingHookError

plugin.register()
model, steer = sys.argv[1], sys.argv[2]
EngineArgs(model=model, max_model_len=128).create_engine_config()  # no steers: only warns
print("NO-STEERS-OK", flush=True)
for how in ("additional_config", "cli"):
    try:
        if how == "cli":
            from vllm.entrypoints.launchers.cli_args import make_arg_parser
            from vllm.utils.argparse_utils import FlexibleArgumentParser

            args = make_arg_parser(FlexibleArgumentParser()).parse_args(
                [model, "--steer", "a=" + steer])
            EngineArgs.from_cli_args(args)
        else:
            EngineArgs(model=model, max_model_len=128, additional_config={
                "vllm_steer": {"steers": {"a": steer}}}).create_engine_config()
    except MissingHookError as e:
        print("REFUSED " + how + " " + str(e), flush=True)
"""


def test_a_missing_patch_point_warns_and_refuses_steers_naming_version_and_hook(tiny_model_dir,
                                                                               tmp_path):
    from vllm import __version__

    save_steer(tmp_path / "a.safetensors", random_steer(64, 4, "a"))
    out = subprocess.run([sys.executable, "-c", MISSING_HOOK, str(tiny_model_dir),
                          str(tmp_path / "a.safetensors")], capture_output=True, text=True,
                         timeout=300)
    hook = "vllm.v1.engine.input_processor:InputProcessor._build_logits_processors_params_" \
           "validator"
    assert "NO-STEERS-OK" in out.stdout, out.stderr[-3000:]
    assert f"vLLM {__version__} lacks 1 patch point" in out.stderr and hook in out.stderr
    refused = [ln for ln in out.stdout.splitlines() if ln.startswith("REFUSED")]
    assert [ln.split()[1] for ln in refused] == ["additional_config", "cli"], out.stderr[-3000:]
    for ln in refused:
        assert f"cannot steer on vLLM {__version__}" in ln and hook in ln
        assert "supports vllm>=0.32,<0.34" in ln
