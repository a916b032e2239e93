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
from vllm_steer.integrations.hook_check import MissingHookError

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

# "a vLLM without the V1 model runner": its classes and the name patched in its module gone;
# V1's logits-processor module is hidden from the plugin (tests/v2shim,
# STEER_TEST_NO_V1_LOGITSPROCS=1: the plugin importing it raises ImportError)
del v1_runner.GPUModelRunner, v1_runner.build_logitsprocs, v1_batch.InputBatch
vllm.config.vllm.HAS_TRITON = True  # Model Runner V2's config check (no engine starts here)
from vllm_steer.integrations import plugin
from vllm_steer.integrations.hook_check import MissingHookError

try:
    import vllm_steer.integrations.request_state_v1  # the V1 runner's state needs it
    print("V1-STATE-IMPORTED", flush=True)
except ImportError as e:
    print("V1-STATE-UNIMPORTABLE", e, flush=True)
plugin.register()
model, steer, tests_dir = sys.argv[1], sys.argv[2], sys.argv[3]
v2_config = None
for runner, spec in (("1", None), ("0", None), ("1", {"method": "ngram",
        "num_speculative_tokens": 2, "prompt_lookup_max": 2})):
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = runner
    try:
        cfg = EngineArgs(model=model, max_model_len=128, speculative_config=spec,
                         additional_config={"vllm_steer": {"steers": {"a": steer}}}
                         ).create_engine_config()
        print("STEERS", runner, bool(spec), cfg.use_v2_model_runner,
              cfg.model_config.logits_processors, flush=True)
        if runner == "1" and spec is None:
            v2_config = cfg
    except MissingHookError as e:
        print("REFUSED", runner, bool(spec), str(e), flush=True)

# Model Runner V2 steers: vLLM's V2 loader loads the request state start-up named, a steered
# and an unsteered request are added to their slots, and the wrapped sample() steers the
# steered request's row in front of the head (the steer applied by hand: the reference)
import types
import numpy as np
import torch
from vllm import SamplingParams
from vllm.v1.worker.gpu.input_batch import InputBatch, InputBuffers
from vllm.v1.worker.gpu.sample.logits_processor import build_custom_logits_processors

sys.path.insert(0, tests_dir)
from helpers.engines import bound_extra
from vllm_steer.integrations.hooks import wrap_method
from vllm_steer.integrations.worker import v2
from vllm_steer.reference import steer_reference

z = torch.zeros(8, dtype=torch.int32)
req_states = types.SimpleNamespace(device=torch.device("cpu"), max_num_reqs=8,
                                   vocab_size=49152, all_token_ids=None, prompt_len=z,
                                   prefill_len=z, total_len=None)
(state,) = build_custom_logits_processors(v2_config, req_states, False,
                                          v2_config.model_config.logits_processors)
rt = state.runtime
rt.bank_state.load(64, torch.device("cpu"), torch.float32)
state.add_request(3, SamplingParams(extra_args=bound_extra(["a"], {"a": 5})))
state.add_request(1, SamplingParams())
state.apply_staged_writes()


class Runner:  # stands in for V2's GPUModelRunner: sample() calls the LM head
    vllm_config = v2_config

    def sample(self, hidden_states, input_batch, grammar_output):
        return rt.planner.steer_rows(hidden_states)


wrap_method(Runner, "sample", v2.sample)
batch = InputBatch.make_dummy(2, 2, InputBuffers(8, 64, torch.device("cpu")))
batch.idx_mapping_np = np.array([1, 3])  # the step's requests -> slots
batch.expanded_idx_mapping = torch.tensor([1, 3], dtype=torch.int32)  # rows -> slots
h = torch.randn(2, 64)
out = Runner().sample(h, batch, None)
coefs = torch.zeros(2, rt.slots.num_columns)  # one column per steer slot: a first
coefs[1, 0] = 5e-3  # strength 5
want = steer_reference(h, *rt.bank_state.bank.factors, coefs)
print("V2-STEERED", type(state).__qualname__, torch.equal(out[0], h[0]),
      torch.allclose(out, want, atol=1e-5), not torch.equal(out[1], h[1]), flush=True)
"""


def test_without_the_v1_runner_start_up_steers_on_model_runner_v2_and_refuses_v1_naming_it(
        tiny_model_dir, tmp_path):
    """vLLM dropping the V1 runner disables only the configurations that use it: the real
    start-up check (EngineArgs.create_engine_config with steers) accepts Model Runner V2, with
    and without speculative decoding, and refuses V1 naming the group, the hooks and the fix;
    the unavailable groups are logged at registration. With V1's logits-processor module
    unimportable to the plugin, Model Runner V2 still steers: vLLM's V2 loader loads the
    request state start-up named, and a steered request's row is steered in front of the head
    (its unsteered neighbour's is not)."""
    import os
    from pathlib import Path

    from vllm import __version__

    from helpers.engines import V2_SHIM_DIR

    save_steer(tmp_path / "a.safetensors", random_steer(64, 4, "a"))
    path = os.environ.get("PYTHONPATH", "")
    env = dict(os.environ, STEER_TEST_NO_V1_LOGITSPROCS="1",
               PYTHONPATH=os.pathsep.join(p for p in (str(V2_SHIM_DIR), path) if p))
    out = subprocess.run([sys.executable, "-c", V1_RUNNER_GONE, str(tiny_model_dir),
                          str(tmp_path / "a.safetensors"), str(Path(__file__).parents[1])],
                         capture_output=True, text=True, timeout=300, env=env)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith(("STEERS", "REFUSED"))]
    assert len(lines) == 3, out.stdout[-2000:] + out.stderr[-3000:]
    v2, v1, v2_spec = lines
    assert v2 == ("STEERS 1 False True "
                  "['vllm_steer.integrations.request_state_v2:SteerRequestStateV2']"), v2
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
    # the plugin could not import V1's logits-processor module here, yet V2 steered
    assert "V1-STATE-UNIMPORTABLE" in out.stdout, out.stdout[-2000:] + out.stderr[-3000:]
    steered = [ln for ln in out.stdout.splitlines() if ln.startswith("V2-STEERED")]
    assert steered == ["V2-STEERED SteerRequestStateV2 True True True"], \
        out.stdout[-2000:] + out.stderr[-3000:]
