"""The V1 integration's hooks into vLLM's own V1 objects (engine-level behaviour: test_vllm_*)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

from vllm.v1.sample.logits_processor import LogitsProcessor, LogitsProcessors  # noqa: E402
from vllm.v1.worker.gpu_input_batch import InputBatch  # noqa: E402

from vllm_steer.integrations.hooks import wrap_method  # noqa: E402
from vllm_steer.integrations.request_state_v1 import SteerRequestStateV1  # noqa: E402
from vllm_steer.integrations.worker.v1 import input_batch_init  # noqa: E402


class _Proc(LogitsProcessor):
    def __init__(self, *a):
        pass

    def is_argmax_invariant(self):
        return True

    def apply(self, logits):
        return logits

    def update_state(self, batch_update):
        pass


class _Quiet(_Proc):
    needs_output_token_ids = False


def _batch(procs):
    return InputBatch(max_num_reqs=4, max_model_len=32, max_num_batched_tokens=64,
                      device=torch.device("cpu"), vocab_size=100, block_sizes=[16],
                      max_num_blocks_per_req=[2], logitsprocs=LogitsProcessors(procs),
                      logitsprocs_need_output_token_ids=True)


def test_output_token_ids_not_tracked_for_processors_that_do_not_read_them():
    assert SteerRequestStateV1.needs_output_token_ids is False
    wrap_method(InputBatch, "__init__", input_batch_init)
    wrap_method(InputBatch, "__init__", input_batch_init)  # idempotent: wrapped once
    assert getattr(InputBatch.__init__, "_vllm_steer", False)
    # only processors declaring they never read output ids: tracking off
    assert _batch([_Quiet()]).logitsprocs_need_output_token_ids is False
    # any other custom processor (a user's): vLLM's conservative default stays
    assert _batch([_Quiet(), _Proc()]).logitsprocs_need_output_token_ids is True
    assert _batch([_Proc()]).logitsprocs_need_output_token_ids is True
