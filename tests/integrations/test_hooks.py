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


V1_RUNNER_GONE = r"""
import os, sys
import vllm.config.vllm
import vllm.v1.worker.gpu.model_runner  # Model Runner V2 stays
import vllm.v1.worker.gpu_input_batch as v1_batch
import vllm.v1.worker.gpu_model_runner as v1_runner
from vllm.engine.arg_utils import EngineArgs

# "a vLLM without the V1 model runner": its classes and the name patched in its module gone
del v1_runner.GPUModelRunner, v1_runner.build_logitsprocs, v1_batch.InputBatch
vllm.config.vllm.HAS_TRITON = True  # Model Runner V2's config check (no engine starts here)
from vllm_steer.integrations import plugin
from vllm_steer.integrations.hooks import MissingHookError

plugin.register()
model, steer = sys.argv[1], sys.argv[2]
for runner, spec in (("1", None), ("0", None), ("1", {"method": "ngram",
        "num_speculative_tokens": 2, "prompt_lookup_max": 2})):
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = runner
    try:
        cfg = EngineArgs(model=model, max_model_len=128, speculative_config=spec,
                         additional_config={"vllm_steer": {"steers": {"a": steer}}}
                         ).create_engine_config()
        print("STEERS", runner, bool(spec), cfg.use_v2_model_runner,
              cfg.model_config.logits_processors, flush=True)
    except MissingHookError as e:
        print("REFUSED", runner, bool(spec), str(e), flush=True)
"""


def test_without_the_v1_runner_start_up_steers_on_model_runner_v2_and_refuses_v1_naming_it(
        tiny_model_dir, tmp_path):
    """vLLM dropping the V1 runner disables only the configurations that use it: the real
    start-up check (EngineArgs.create_engine_config with steers) accepts Model Runner V2, with
    and without speculative decoding, and refuses V1 naming the group, the hooks and the fix;
    the unavailable groups are logged at registration."""
    from vllm import __version__

    save_steer(tmp_path / "a.safetensors", random_steer(64, 4, "a"))
    out = subprocess.run([sys.executable, "-c", V1_RUNNER_GONE, str(tiny_model_dir),
                          str(tmp_path / "a.safetensors")], capture_output=True, text=True,
                         timeout=300)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith(("STEERS", "REFUSED"))]
    assert len(lines) == 3, out.stdout[-2000:] + out.stderr[-3000:]
    v2, v1, v2_spec = lines
    assert v2 == ("STEERS 1 False True "
                  "['vllm_steer.integrations.processors:SteerLogitsProcessorV2']"), v2
    assert v2_spec.startswith("STEERS 1 True True"), v2_spec
    assert v1.startswith(f"REFUSED 0 False vllm-steer: cannot steer on vLLM {__version__}"), v1
    assert "hook group 'v1', for the V1 model runner" in v1
    assert "vllm.v1.worker.gpu_model_runner:GPUModelRunner._prepare_inputs" in v1
    assert "supports vllm>=0.32,<0.34" in v1
    assert "serve on Model Runner V2 (VLLM_USE_V2_MODEL_RUNNER=1)" in v1
    assert f"vLLM {__version__} lacks 7 patch point(s)" in out.stderr
    assert "unavailable: v1 (the V1 model runner" in out.stderr
    assert "v1-lens (steered prompt logprobs on the V1 model runner" in out.stderr
    assert "v1-spec (speculative decoding on the V1 model runner)" in out.stderr
