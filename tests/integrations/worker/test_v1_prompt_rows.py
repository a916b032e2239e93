"""V1 prompt logprobs through the step's prompt view: each ``compute_logits`` call of
``_get_prompt_logprobs_dict`` is a slice of the step's hidden states, steered with its own
request's steer and never with the batch's sampled rows, even when it has as many rows as the
batch has requests; and while no request asks for prompt logprobs the hook reads one count.
Driven through the real runtime, the V1 per-request state's path (``SteerRuntime.assign`` with
vLLM's ``SamplingParams``) and the V1 hook; checked against the reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from helpers.fakes import VllmObject
from helpers.steers import random_steer
from vllm_steer.format import save_steer
from vllm_steer.integrations.worker import v1
from vllm_steer.integrations.worker.gates import GATES
from vllm_steer.integrations.worker.runtime import BINDINGS, V1RunnerBinding, get_runtime
from vllm_steer.reference import steer_reference

pytest.importorskip("vllm")

HIDDEN = 32


def _params(steer: dict | None, prompt_logprobs: int | None):
    """A request's SamplingParams as the engine core hands them to the worker (bound steers)."""
    from vllm import SamplingParams

    from helpers.engines import bound_extra

    return SamplingParams(prompt_logprobs=prompt_logprobs,
                          extra_args=bound_extra(["a"], steer) or None)


@pytest.fixture
def runtime(tmp_path):
    path = str(tmp_path / "a.safetensors")
    save_steer(path, random_steer(HIDDEN, 4, "a", seed=5, scale=3.0))
    rt = get_runtime({"vllm_steer": {"steers": {"a": path}, "max_strength": 10}})
    rt.bank_state.load(HIDDEN, torch.device("cpu"), torch.float32)
    rt.ensure_slots(4, torch.device("cpu"))
    return rt


class _Model:
    """The model's ``compute_logits``: the steered head on its input (logits = the head's
    input, steered), after ``transform`` (MiMo applies its final norm there: the head then
    gets a new tensor, not a slice of the step's hidden states)."""

    def __init__(self, rt, transform=None):
        self.rt, self.transform = rt, transform

    def compute_logits(self, hidden):
        if self.transform is not None:
            hidden = self.transform(hidden)
        return self.rt.planner.steer_rows(hidden)


def _runner(rt, qsl, asks: bool, transform=None):
    runner = VllmObject(num_prompt_logprobs={"r1": 1} if asks else {},
                        input_batch=VllmObject(num_reqs=len(qsl) - 1),
                        query_start_loc=VllmObject(np=np.asarray(qsl)),
                        model=_Model(rt, transform))
    BINDINGS.set(runner, V1RunnerBinding(rt))
    return runner


def test_v1_prompt_rows_get_their_own_requests_steer(runtime, monkeypatch):
    rt = runtime
    from vllm_steer.integrations import vllm_access

    assert vllm_access.asks_prompt_logprobs(_params(None, 1))
    assert not vllm_access.asks_prompt_logprobs(_params(None, None))
    before = GATES.prompt_logprob_slots
    rt.assign(0, _params({"a": 4}, None))  # steered, no prompt logprobs
    rt.assign(1, _params(None, 2))  # plain, asks for prompt logprobs
    rt.slots.flush()
    rt.step.batch_size = 2
    assert GATES.prompt_logprob_slots == before + 1
    qsl = [0, 3, 5]  # request 0: tokens 0-2; request 1: tokens 3-4
    h = torch.randn(5, HIDDEN, generator=torch.Generator().manual_seed(0))
    seen = []

    def orig(self, hidden_states, num_scheduled_tokens):  # vLLM's: one call per request
        out = {}
        for req, (a, b) in enumerate(zip(qsl[:-1], qsl[1:], strict=True)):
            view = hidden_states[a:b]
            seen.append(rt.step.prompt is not None)
            out[req] = self.model.compute_logits(view)  # as vLLM calls it, on the slice
        return out

    got = v1.get_prompt_logprobs_dict(orig, _runner(rt, qsl, asks=True), h, {"r0": 3, "r1": 2})
    assert seen == [True, True] and rt.step.prompt is None
    coefs = torch.from_numpy(rt.slots.host[[0, 0, 0]].copy())
    torch.testing.assert_close(got[0], steer_reference(h[:3], *rt.bank_state.bank.factors,
                                                       coefs))
    assert not torch.equal(got[0], h[:3])
    # request 1's two prompt rows: as many as the batch's requests, yet never the batch's rows
    assert torch.equal(got[1], h[3:5])
    # a model whose compute_logits transforms the rows first (MiMo's norm): the same steers
    runner = _runner(rt, qsl, asks=True, transform=lambda x: x * 2.0)
    got = v1.get_prompt_logprobs_dict(orig, runner, h, {"r0": 3, "r1": 2})
    torch.testing.assert_close(got[0], steer_reference(2.0 * h[:3], *rt.bank_state.bank.factors,
                                                       coefs))
    assert torch.equal(got[1], 2.0 * h[3:5])
    assert "compute_logits" not in vars(runner.model)  # the model as it was

    # slot 1 reused by a request that asks for none: the count goes back
    rt.assign(1, _params(None, None))
    rt.slots.flush()
    assert GATES.prompt_logprob_slots == before and rt.slots.num_prompt_slots == 0
    # in a process where no request asked (other tests' runtimes may count here), the hook
    # reads that count alone: not even vLLM's record of prompt-logprob requests
    monkeypatch.setattr(GATES, "prompt_logprob_slots", 0)

    class Unread(VllmObject):
        @property
        def num_prompt_logprobs(self):
            raise AssertionError("vLLM's record read with no request asking")

    runner = Unread(input_batch=VllmObject(num_reqs=2), query_start_loc=VllmObject(np=qsl),
                    model=_Model(rt))
    BINDINGS.set(runner, V1RunnerBinding(rt))
    seen.clear()
    v1.get_prompt_logprobs_dict(orig, runner, h, {"r0": 3, "r1": 2})
    assert seen == [False, False]
    monkeypatch.undo()
    # the slot table follows V1's moves: the flag goes with its request
    rt.assign(2, _params(None, 1))
    rt.slots.move(2, 3, swap=False)
    assert rt.slots.prompt_logprobs[:4].tolist() == [False, False, False, True]
    assert GATES.prompt_logprob_slots == before + 1
    rt.set_slot(3, None)  # removed
    assert GATES.prompt_logprob_slots == before


def test_a_request_whose_steer_state_failed_still_counts_its_prompt_logprobs(runtime,
                                                                             monkeypatch):
    """A fault of the plugin's code while a request enters its slot leaves the slot unsteered
    (the request fails, or is served plain if it asked for no steer), but the request still
    asked for prompt logprobs: the hooks must keep mapping its prompt rows, never leave them to
    the batch's sampled rows."""
    rt = runtime

    def broken(params):
        raise RuntimeError("injected")

    monkeypatch.setattr(rt, "decode", broken)
    assert rt.assign(2, _params(None, 1)) is None  # the fault: no coefficients
    assert rt.slots.prompt_logprobs[2] and not rt.slots.steered[2]
    monkeypatch.undo()
    rt.assign(2, _params(None, None))  # the slot reused
    assert not rt.slots.prompt_logprobs[2] and rt.slots.num_prompt_slots == 0
