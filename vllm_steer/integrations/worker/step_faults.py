"""A fault of the plugin's worker code fails only the requests its step steered.

The worker's per-step code (the steered LM head's op and the step planner behind it, the
runners' row mapping, the per-request steer state) runs for a whole batch. An exception there
is caught where it happens and recorded here; that code then does what vLLM would do without
the plugin (the head returns the hidden states as they came, so every row gets vLLM's plain
logits, bit for bit: the steer op never touches an unsteered row anyway). At the end of the
step the runner's ``sample_tokens`` hook names the requests that fail
(:meth:`StepFaults.take`): every request of the step whose request slot is steered, for a
fault of the step's code, and the request itself, for a fault in putting one request into its
slot. They travel with the step's ``ModelRunnerOutput`` (attribute
:data:`~vllm_steer.integrations.protocol.STEP_FAILED_ATTR`, pickled with it across processes)
to the engine core, whose scheduler hook finishes each with the plugin's HTTP 500
(:func:`vllm_steer.integrations.engine.core.update_from_output`) before vLLM serves the token
it sampled; every other request of the step is served.

The traceback is logged once per fault. Nothing is caught while a CUDA graph is being
captured: a graph recorded without the op would serve unsteered at every replay, so a fault
there fails start-up (or the run-time load that captures) loudly.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Sequence

from vllm_steer.integrations.guard import internal_message
from vllm_steer.integrations import vllm_access
from vllm_steer.integrations.worker.gates import GATES
from vllm_steer.kernels.staging import capturing
from vllm_steer.logs import get_logger

logger = get_logger()

#: Where a fault happened, as its message names it.
HEAD = "the steered LM head"
ROWS = "the step's row mapping"
REQUEST_STATE = "the per-request steer state"


class StepFaults:
    """The faults of one runtime's worker code since its runner's last step output."""

    __slots__ = ("step", "slots")

    def __init__(self) -> None:
        self.step: tuple[str, BaseException] | None = None
        """The first fault of the step's code (``(where, exception)``): every request of the
        step whose slot is steered fails."""
        self.slots: dict[int, tuple[str, BaseException]] = {}
        """Request slot -> the fault in putting its request there: that request fails."""

    @property
    def pending(self) -> bool:
        """Whether a fault waits for the step's output."""
        return self.step is not None or bool(self.slots)

    def log(self, where: str, exc: BaseException, whom: str) -> None:
        """Log a fault at ``where`` once, with its traceback, and ``whom`` it fails."""
        logger.error("vllm-steer: internal error in %s (worker): %s (HTTP 500); the step's "
                     "other requests are served", where, whom,
                     exc_info=(type(exc), exc, exc.__traceback__))

    def record(self, where: str, exc: BaseException) -> None:
        """A fault of the step's code at ``where``: the step's steered requests fail. While no
        request slot of the process is steered (a drafter's head recorded into CUDA graphs
        runs its op all the same) there is none to fail: logged, and nothing waits for the
        step's output."""
        if not GATES.steered_slots:
            self.log(where, exc, "no request of the step is steered, none fails")
            return
        self.log(where, exc, "the step's steered requests fail")
        if not self.pending:
            GATES.worker_faults += 1
        if self.step is None:
            self.step = (where, exc)

    def record_slot(self, slot: int, where: str, exc: BaseException) -> None:
        """A fault in putting the request of request slot ``slot`` there: it fails."""
        self.log(where, exc, f"the request entering slot {slot} fails")
        if not self.pending:
            GATES.worker_faults += 1
        self.slots[slot] = (where, exc)

    def clear_slot(self, slot: int) -> None:
        """Request slot ``slot`` holds a new request, put there without a fault."""
        if self.slots.pop(slot, None) is not None and not self.pending:
            GATES.worker_faults -= 1

    def move(self, src: int, dst: int, swap: bool) -> None:
        """The V1 persistent batch moved (or swapped) a request slot's request."""
        a, b = self.slots.pop(src, None), self.slots.pop(dst, None)
        if a is not None:
            self.slots[dst] = a
        if swap and b is not None:
            self.slots[src] = b

    @contextlib.contextmanager
    def guard(self, where: str) -> Iterator[None]:
        """Run the step's plugin code at ``where``: a fault is recorded (:meth:`record`), not
        raised; the caller goes on as vLLM would without the plugin."""
        try:
            yield
        except Exception as e:
            self.record(where, e)

    def take(self, req_ids: Sequence[Any], slots: Sequence[int] | None,
             steered) -> dict[str, str]:
        """``{request id: message}`` of the step's requests that fail, and forget the faults.
        ``req_ids[i]`` is in request slot ``slots[i]`` (None: slot i, V1's batch order; -1:
        none); ``steered[slot]``: whether that slot is steered (the request-slot table's)."""
        failed: dict[str, str] = {}
        step, was_pending = self.step, self.pending
        for i, rid in enumerate(req_ids):
            slot = i if slots is None else int(slots[i])
            if rid is None or slot < 0:
                continue
            fault = self.slots.pop(slot, None)
            if fault is None and step is not None and steered is not None \
                    and slot < len(steered) and steered[slot]:
                fault = step
            if fault is not None:
                failed[rid] = internal_message(fault[0], rid, fault[1])
        if was_pending:
            GATES.worker_faults -= 1
        self.step = None
        self.slots.clear()
        return failed


def attach(output: Any, failed: dict[str, str]) -> None:
    """Put ``failed`` on the step's ``ModelRunnerOutput`` ``output`` (never on vLLM's shared
    empty output: a step with requests has its own)."""
    vllm_access.attach_step_failures(output, failed)


__all__ = ["StepFaults", "attach", "capturing", "HEAD", "ROWS", "REQUEST_STATE"]
