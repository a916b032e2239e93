"""Model Runner V2 with pipeline parallelism: a stage without the LM head has no sampler
(vLLM builds it on the last stage only), so its per-request steer state never gets
``add_request``; its decoder blocks must still add each request's vectors. Driven through
vLLM's own ``GPUModelRunner.add_requests`` (as installed, hooks included) on a stand-in
runner, then the plugin's ``prepare_inputs`` hook."""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch

from helpers.steers import random_steer
from vllm_steer.config import SteerServerConfig
from vllm_steer.format import save_steer
from vllm_steer.integrations import plugin
from vllm_steer.integrations.request_state_v2 import SteerRequestStateV2
from vllm_steer.integrations.worker import v2
from vllm_steer.integrations.worker.gates import GATES
from vllm_steer.integrations.worker.runtime import BINDINGS, SteerRuntime, V2RunnerBinding
from vllm_steer.integrations.worker.step_mapping import LayerVectors, TokenCoefs
from vllm_steer.request import BOUND_KEY, BoundSteer
from vllm_steer.vectors import make_vector_steer

H = 16
CPU = torch.device("cpu")


class _Runner(types.SimpleNamespace):
    """What V2's ``add_requests`` reads of its runner (weak-referenceable, as a runner is)."""


def _runtime(tmp_path) -> SteerRuntime:
    p = tmp_path / "a.safetensors"
    save_steer(p, random_steer(H, 4, "a", seed=1))
    rt = SteerRuntime(SteerServerConfig.from_additional_config(
        {"vllm_steer": {"steers": {"a": str(p)}, "max_steers": 4}}))
    rt.ensure_slots(8, CPU)
    rt.bank_state.load(H, CPU, torch.float32)
    layers = LayerVectors([0], 1, 4, H, max_tokens=16, device=CPU)
    rt.layers, rt.step.tokens = layers, TokenCoefs(layers, rt.slots)
    rt.bank_state.bank.layers = layers
    rt.slots.use_layers(layers)
    rt.put_steer(1, 7, "v", make_vector_steer({0: torch.ones(H)}, "v"))
    return rt


def _stage(tmp_path, monkeypatch, last_stage: bool):
    """A runtime and a stand-in V2 runner of a pipeline stage (with a sampler on the last
    stage only, as vLLM builds them), and one new request steered by vector ``v`` at 2."""
    from vllm import SamplingParams

    plugin.register()
    monkeypatch.setattr(GATES, "layer_mappings", GATES.layer_mappings + 1)
    rt = _runtime(tmp_path)
    proc = SteerRequestStateV2.__new__(SteerRequestStateV2)  # built on every stage by vLLM
    proc.runtime, proc.slots, proc.declare_steered = rt, rt.slots, False
    params = SamplingParams(extra_args={"steer": {"v": 2.0}, BOUND_KEY: BoundSteer.to_wire(
        [BoundSteer("v", 1, 7, 2.0)])})

    states = types.SimpleNamespace(req_id_to_index={}, apply_staged_writes=lambda: None,
                                   prompt_len=types.SimpleNamespace(
                                       np=np.full(8, 4, dtype=np.int32)))
    states.add_request = lambda req_id, **kw: states.req_id_to_index.__setitem__(req_id, 3)
    noop = lambda *a, **k: None  # noqa: E731
    runner = _Runner(
        _remove_request=lambda r: False, req_states=states, adaptive_verification=None,
        pooling_runner=None, encoder_cache=None,
        model_state=types.SimpleNamespace(add_request=noop, apply_staged_writes=noop),
        block_tables=types.SimpleNamespace(append_block_ids=noop),
        lora_state=types.SimpleNamespace(add_request=noop),
        is_last_pp_rank=last_stage,
        sampler=types.SimpleNamespace(add_request=proc.add_request,
                                      apply_staged_writes=proc.apply_staged_writes)
        if last_stage else None,  # vLLM's V2 runner: a sampler on the last stage only
        prompt_logprobs_worker=types.SimpleNamespace(add_request=noop))
    BINDINGS.set(runner, V2RunnerBinding(rt))
    new = types.SimpleNamespace(
        req_id="r0", prefill_token_ids=[1, 2, 3, 4], prompt_token_ids=[1, 2, 3, 4],
        prompt_len=4, sampling_params=params, num_computed_tokens=0, block_ids=([0],),
        mm_features=[], lora_request=None, pooling_params=None)
    return rt, runner, types.SimpleNamespace(scheduled_new_reqs=[new])


@pytest.mark.parametrize("last_stage", [True, False])
def test_a_v2_stage_without_the_lm_head_adds_its_requests_vectors(tmp_path, monkeypatch,
                                                                   last_stage):
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner

    rt, runner, scheduler_output = _stage(tmp_path, monkeypatch, last_stage)
    GPUModelRunner.add_requests(runner, scheduler_output)

    batch = types.SimpleNamespace(num_reqs=1, idx_mapping_np=np.array([3]),
                                  query_start_loc_np=np.array([0, 4], dtype=np.int32),
                                  num_computed_tokens_np=np.array([0]))
    v2.prepare_inputs(lambda self, *a, **k: batch, runner)
    # every prompt token of the request carries its vector's strength in this stage's blocks
    assert rt.layers.token_coefs[:4, 1].tolist() == [2.0] * 4


def test_a_fault_adding_a_stages_requests_fails_the_steered_request_not_the_step(
        tmp_path, monkeypatch):
    """The hook's device copy breaks: vLLM's ``add_requests`` still returns (no exception
    leaves the step), and the steered request is failed by name."""
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner

    from vllm_steer.kernels import staging

    rt, runner, scheduler_output = _stage(tmp_path, monkeypatch, last_stage=False)

    def broken(*_a, **_k):
        raise RuntimeError("the callee broke")

    monkeypatch.setattr(staging.StagedCopy, "copy_", broken)
    assert GPUModelRunner.add_requests(runner, scheduler_output) is None
    failed = rt.faults.take(["r0"], [3], rt.slots.steered)
    assert list(failed) == ["r0"], failed
    assert failed["r0"].startswith("vllm-steer: internal error in the per-request steer state "
                                   "while serving request r0: RuntimeError: the callee broke")
