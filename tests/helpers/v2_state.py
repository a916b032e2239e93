"""Model Runner V2's per-request steer state built the way vLLM's V2 runner builds it, without
an engine: an engine config with steers ``a`` and ``b`` (hidden 64, rank 4, seeds 1 and 2),
and the state (``SteerRequestStateV2``) loaded on the CPU. For the V2 unit tests and
``benchmarks/bench_v2_sample.py``."""

from __future__ import annotations

import types
from pathlib import Path

V2_FQCN = "vllm_steer.integrations.request_state_v2:SteerRequestStateV2"


def v2_steer_config(model_dir, workdir: Path):
    """vLLM's engine config of the model in ``model_dir`` with steers ``a`` and ``b`` (files
    written to ``workdir``), strengths up to 10; the plugin's hooks installed."""
    from vllm.engine.arg_utils import EngineArgs

    from helpers.steers import random_steer
    from vllm_steer.format import save_steer
    from vllm_steer.integrations import plugin

    plugin.register()
    steers = {}
    for name, seed in (("a", 1), ("b", 2)):
        steers[name] = str(Path(workdir) / f"{name}.safetensors")
        save_steer(steers[name], random_steer(64, 4, name, seed=seed))
    return EngineArgs(model=str(model_dir), max_model_len=128,
                      additional_config={"vllm_steer": {"steers": steers,
                                                        "max_strength": 10}}
                      ).create_engine_config()


def v2_req_states(max_num_reqs: int = 8):
    """What ``LogitsProcRequestState.from_request_state`` reads of the runner's
    ``RequestState``."""
    import torch

    z = torch.zeros(max_num_reqs, dtype=torch.int32)
    return types.SimpleNamespace(device=torch.device("cpu"), max_num_reqs=max_num_reqs,
                                 vocab_size=49152, all_token_ids=None, prompt_len=z,
                                 prefill_len=z, total_len=None)


def v2_request_state(vllm_config, max_num_reqs: int = 8):
    """The plugin's V2 per-request state, as vLLM's V2 runner builds it from the config, with
    its runtime loaded on the CPU in float32."""
    import torch
    from vllm.v1.worker.gpu.sample.logits_processor import build_custom_logits_processors

    (proc,) = build_custom_logits_processors(vllm_config, v2_req_states(max_num_reqs), False,
                                             [V2_FQCN])
    proc.runtime.bank_state.load(64, torch.device("cpu"), torch.float32)
    return proc
