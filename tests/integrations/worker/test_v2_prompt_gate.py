"""Model Runner V2's prompt-logprob hooks cost one check per step until a running request asks
for prompt logprobs: vLLM calls ``compute_prompt_logprobs`` and
``compute_prompt_token_id_logprobs`` at every step, and its own ``PromptLogprobsWorker``
records the requests that need them (``add_request`` / ``remove_request``). Driven through
vLLM's real ``PromptLogprobsWorker``; the steered rows are checked against the reference."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch

from helpers.steers import random_steer
from vllm_steer.format import save_steer
from vllm_steer.integrations.worker import v2
from vllm_steer.integrations.worker.runtime import get_runtime
from vllm_steer.reference import steer_reference

HIDDEN = 32


def _steered_runtime(tmp_path):
    path = str(tmp_path / "a.safetensors")
    save_steer(path, random_steer(HIDDEN, 4, "a", seed=3, scale=3.0))
    rt = get_runtime({"vllm_steer": {"steers": {"a": path}, "max_strength": 10}})
    rt.bank_state.load(HIDDEN, torch.device("cpu"), torch.float32)
    rt.ensure_slots(4, torch.device("cpu"))
    row = np.zeros(rt.slots.num_columns, np.float32)
    row[0] = 4e-3
    rt.set_slot(1, row)
    rt.slots.flush()
    return rt, row


def test_v2_prompt_logprob_hooks_wrap_nothing_until_a_request_asks_for_prompt_logprobs(tmp_path):
    from vllm import SamplingParams
    from vllm.v1.worker.gpu.sample.prompt_logprob import PromptLogprobsWorker

    rt, row = _steered_runtime(tmp_path)
    worker = PromptLogprobsWorker(4, torch.device("cpu"))
    batch = SimpleNamespace(num_reqs=2, idx_mapping_np=np.array([1, 0]),
                            query_start_loc_np=np.array([0, 3, 5]))
    h = torch.randn(5, HIDDEN, generator=torch.Generator().manual_seed(0))
    given = []

    def orig(self, logits_fn, hidden_states, input_batch):  # records what vLLM would call
        given.append((logits_fn, rt.step.prompt))
        return logits_fn(hidden_states)

    def logits_fn(x):  # the model's compute_logits: the steered head, logits = its input
        return rt.planner.steer_rows(x).clone()

    for hook in (v2.prompt_logprobs, v2.prompt_token_id_logprobs):
        given.clear()
        assert torch.equal(hook(orig, worker, logits_fn, h, batch), h)
        assert given == [(logits_fn, None)], \
            f"{hook.__name__} gave the step prompt rows with no request asking"

    worker.add_request("r1", 1, SamplingParams(prompt_logprobs=1))
    rt.set_slot(1, row, prompt_logprobs=True)  # as the per-request state puts the same request
    rt.slots.flush()
    given.clear()
    out = v2.prompt_logprobs(orig, worker, logits_fn, h.clone(), batch)
    # the step's prompt rows, and the model's compute_logits recording each call's rows
    assert given[0][0] is not logits_fn and given[0][1] is not None
    assert rt.step.prompt is None  # only for the call
    coefs = torch.tensor(np.stack([row] * 3 + [np.zeros_like(row)] * 2))
    want = steer_reference(h, *rt.bank_state.bank.factors, coefs)
    torch.testing.assert_close(out, want)
    assert not torch.equal(out[:3], h[:3])  # slot 1's rows steered, slot 0's (unsteered) not
    torch.testing.assert_close(out[3:], h[3:])

    worker.remove_request("r1")
    given.clear()
    v2.prompt_logprobs(orig, worker, logits_fn, h, batch)
    assert given == [(logits_fn, None)]
