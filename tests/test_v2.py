"""Model Runner V2 integration, driven through vLLM's own V2 interfaces with real objects.

V2 cannot run an engine here (it needs triton-cpu), so this drives the pieces vLLM itself
calls: the V2 loader and params validator, ``add_request(slot, params)`` with slot reuse,
``apply_staged_writes()``, and a step's real ``InputBatch`` whose ``expanded_idx_mapping``
the wrapped ``sample()`` scopes around the LM-head call.
"""

from __future__ import annotations

import types

import pytest
import torch

from conftest import random_steer
from vllm_steer.format import save_steer
from vllm_steer.reference import steer_reference

V2_FQCN = "vllm_steer.integrations.v2:SteerLogitsProcessorV2"


@pytest.fixture(scope="module")
def vllm_config(tiny_model_dir, tmp_path_factory):
    from vllm.engine.arg_utils import EngineArgs

    from vllm_steer.integrations import plugin

    plugin.register()
    d = tmp_path_factory.mktemp("v2")
    steers = {}
    for name, seed in (("a", 1), ("b", 2)):
        steers[name] = str(d / f"{name}.safetensors")
        save_steer(steers[name], random_steer(64, 4, name, seed=seed))
    return EngineArgs(model=str(tiny_model_dir), max_model_len=128,
                      additional_config={"vllm_steer": {"steers": steers,
                                                        "max_strength": 10}}
                      ).create_engine_config()


def _req_states(max_num_reqs=8):
    # what LogitsProcRequestState.from_request_state reads of the runner's RequestState
    z = torch.zeros(max_num_reqs, dtype=torch.int32)
    return types.SimpleNamespace(device=torch.device("cpu"), max_num_reqs=max_num_reqs,
                                 vocab_size=49152, all_token_ids=None, prompt_len=z,
                                 prefill_len=z, total_len=None)


@pytest.fixture()
def processor(vllm_config):
    from vllm.v1.worker.gpu.sample.logits_processor import build_custom_logits_processors

    procs = build_custom_logits_processors(vllm_config, _req_states(), False, [V2_FQCN])
    (proc,) = procs
    proc.runtime.load(64, torch.device("cpu"), torch.float32)
    return proc


def _params(steer=None):
    from vllm import SamplingParams

    return SamplingParams(extra_args=None if steer is None else {"steer": steer})


def test_v2_loader_accepts_the_processor_and_validator_rejects_bad_requests(vllm_config):
    from vllm.exceptions import VLLMValidationError
    from vllm.v1.worker.gpu.sample.logits_processor import (
        LogitsProcessor, build_custom_logits_processors_params_validator,
    )

    from vllm_steer.integrations.v2 import SteerLogitsProcessorV2

    assert issubclass(SteerLogitsProcessorV2, LogitsProcessor)
    validate = build_custom_logits_processors_params_validator([V2_FQCN])
    validate(_params({"a": 5, "b": -10}))
    validate(_params())
    with pytest.raises(VLLMValidationError, match="unknown steer 'c'"):
        validate(_params({"c": 1}))
    with pytest.raises(VLLMValidationError, match="exceeds the server's maximum"):
        validate(_params({"a": 11}))


def test_slots_are_fully_reset_when_reused(processor):
    rt = processor.runtime
    assert processor.add_request(3, _params({"a": 5, "b": 2})) is False  # apply() not needed
    processor.apply_staged_writes()
    assert rt.slot_coefs[3, :2].tolist() == pytest.approx([5e-3, 2e-3])  # slots of a, b
    assert not rt.slot_coefs[3, 2:].any()
    assert rt.active
    processor.add_request(3, _params())  # a new request in the same slot, unsteered
    processor.apply_staged_writes()
    assert not rt.slot_coefs[3].any() and not rt.active


def test_wrapped_sample_maps_rows_to_slots_through_expanded_idx_mapping(processor, vllm_config):
    from vllm.v1.worker.gpu.input_batch import InputBatch, InputBuffers

    from vllm_steer.integrations.v2 import wrap_sample

    rt = processor.runtime
    assert rt.backend == "torch"  # resolved (kernels imported) at load, not in a request's step
    processor.add_request(0, _params({"a": 4}))
    processor.add_request(5, _params({"b": -3}))
    processor.add_request(2, _params())
    processor.apply_staged_writes()

    batch = InputBatch.make_dummy(3, 3, InputBuffers(8, 64, torch.device("cpu")))
    batch.expanded_idx_mapping = torch.tensor([5, 2, 0], dtype=torch.int32)  # rows -> slots

    class Runner:  # stands in for V2's GPUModelRunner: sample() calls the LM head
        def sample(self, hidden_states, input_batch, grammar_output):
            return rt.steer_rows(hidden_states)

    Runner.vllm_config = vllm_config
    wrap_sample(Runner)
    h = torch.randn(3, 64)
    out = Runner().sample(h, batch, None)
    coefs = torch.zeros(3, rt.num_columns)  # one column per steer slot: a, b first
    coefs[:, :2] = torch.tensor([[0.0, -3e-3], [0.0, 0.0], [4e-3, 0.0]])
    want = steer_reference(h, rt.bank.p1, rt.bank.p2, rt.bank.rank_offsets, coefs)
    torch.testing.assert_close(out, want)
    assert torch.equal(out[1], h[1])
    # outside sample() (e.g. V2 prompt logprobs) rows have no slot: left unsteered
    assert torch.equal(rt.steer_rows(h), h)
