"""The process-wide gates of the worker's hot paths: the counts each per-step hook reads
before anything else, so that a step with nothing to steer costs one attribute read, or
nothing at all where the hook is gated by them (vLLM's method then runs without it).

A worker process may hold several runtimes (tests run several engines in one process); the
counts are over all of them:

- ``steered_slots``: request slots holding a steered request, as of each request-slot table's
  last flush (Model Runner V2's ``sample`` hook and the head read it: zero, the head has
  nothing to do, but for a drafter's head recorded into CUDA graphs);
- ``windowed_slots``: request slots holding a request with a generation window (the V1
  runner's ``_prepare_inputs`` hook reads it);
- ``prompt_logprob_slots``: request slots whose request asked for prompt logprobs, steered or
  not (Model Runner V2 never says that a request left, so its slots count until reused): the
  prompt-logprob hooks of both runners read it first;
- ``layer_mappings``: runtimes whose model's decoder layers have the op of decoder-layer
  steers (:mod:`~vllm_steer.integrations.worker.decoder_layers`): the runners' input hooks
  then build each step's mapping (:mod:`~vllm_steer.integrations.worker.step_mapping`);
- ``speculative_runtimes``: runtimes whose engine speculates (a ``speculative_config``), counted
  once each when its V1 per-request state is made and never taken back: the V1 runner's
  ``_prepare_inputs`` hook asks its runner whether it speculates only while it is not zero;
- ``worker_faults``: runtimes with a fault of the plugin's worker code waiting for the step's
  output (:mod:`~vllm_steer.integrations.worker.step_faults`; the runners' ``sample_tokens``
  hooks run, after vLLM's method, only while it is open).

The request-slot tables (:class:`~vllm_steer.integrations.worker.request_slots.RequestSlots`),
the runtimes (their decoder-layer ops, whether they speculate) and step faults keep them;
nothing else writes them.

A count that leaves or reaches zero opens or closes the gate of that name
(:func:`~vllm_steer.integrations.hooks.set_gate`): the per-step hooks declared gated by it
(:attr:`~vllm_steer.integrations.hooks.Hook.gates`) then call the plugin's wrapper, or vLLM's
own method with no call of the plugin's at all.
"""

from __future__ import annotations

from vllm_steer.integrations.hooks import set_gate


class ProcessGates:
    """The counts the worker's hot paths read first (see the module docstring)."""

    __slots__ = ("steered_slots", "windowed_slots", "prompt_logprob_slots", "worker_faults",
                 "layer_mappings", "speculative_runtimes")

    def __init__(self) -> None:
        self.steered_slots = 0
        self.windowed_slots = 0
        self.prompt_logprob_slots = 0
        self.worker_faults = 0
        self.layer_mappings = 0
        self.speculative_runtimes = 0

    def __setattr__(self, name: str, value: int) -> None:
        was = getattr(self, name, 0)
        object.__setattr__(self, name, value)
        if bool(was) != bool(value):
            set_gate(name, bool(value))

    def __repr__(self) -> str:
        return (f"ProcessGates(steered_slots={self.steered_slots}, windowed_slots="
                f"{self.windowed_slots}, prompt_logprob_slots={self.prompt_logprob_slots}, "
                f"worker_faults={self.worker_faults}, layer_mappings={self.layer_mappings}, "
                f"speculative_runtimes={self.speculative_runtimes})")


#: This process's gates.
GATES = ProcessGates()

__all__ = ["ProcessGates", "GATES"]
