"""vLLM objects built by hand for unit tests of the plugin's engine-core side."""

from __future__ import annotations

from types import SimpleNamespace


class VllmObject(SimpleNamespace):
    """A vLLM object (engine core, worker, runner) built by hand: the attributes the plugin
    reads, weakly referenceable as vLLM's objects are (the plugin keeps its state for one
    beside it, never on it)."""


def engine_core(steer_state=None, **attrs) -> VllmObject:
    """A hand-built engine core holding ``attrs``, with ``steer_state`` (an
    ``EngineSteerState``) as the plugin's state for it when given."""
    from vllm_steer.integrations.engine.state import attach

    core = VllmObject(**attrs)
    if steer_state is not None:
        attach(core, steer_state)
    return core


def fake_lm_head(weight):
    """A stand-in for vLLM's ParallelLMHead (unquantized, one device) holding ``weight``."""
    import torch

    class FakeLMHead(torch.nn.Module):
        class _Linear:
            def apply(self, layer, x, bias=None):
                return x @ layer.weight.T

        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(weight, requires_grad=False)
            self.quant_method = self._Linear()
            self.tp_size = 1
            self.shard_indices = SimpleNamespace(num_org_vocab_padding=0,
                                                 org_vocab_start_index=0)

    return FakeLMHead()


def v1_spec_runner_class() -> type:
    """A stand-in for V1's runner as its speculative-decoding hooks read it: 2 requests (5 and
    7 computed tokens, 3 prompt tokens each) whose step verifies 2 and 0 draft tokens over 3
    and 1 scheduled tokens (``_prepare_inputs`` calls ``_calc_spec_decode_metadata``, which
    returns ``"meta"``). A new class at each call: a test wraps its methods on its own."""
    import numpy as np

    class Runner:
        speculative_config = object()
        input_batch = SimpleNamespace(num_computed_tokens_cpu=np.array([5, 7]),
                                      num_prompt_tokens=np.array([3, 3]))

        def _calc_spec_decode_metadata(self, num_draft_tokens, cu_num_scheduled_tokens):
            return "meta"

        def _prepare_inputs(self, scheduler_output, num_scheduled_tokens):
            return self._calc_spec_decode_metadata(np.array([2, 0]), np.array([3, 4]))

    return Runner
