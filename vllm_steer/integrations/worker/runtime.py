"""Per-worker steer state shared by the LM-head hook, the per-request steer state and the
runner hooks, and how each runner finds it. Semantics: see :mod:`vllm_steer.reference`.

One :class:`SteerRuntime` per worker process and steer configuration, made of three parts,
one concept each:

- the bank (:class:`~vllm_steer.integrations.worker.bank_state.BankState`): the
  :class:`~vllm_steer.bank.SlotBank` on the model's device and dtype, loaded once, with its
  bank slots filled and emptied at run time, and the backend resolved once;
- the request slots (:class:`~vllm_steer.integrations.worker.request_slots.RequestSlots`):
  the coefficients (and generation windows) of the request in each batch slot (V1:
  persistent-batch index; V2: request-state slot), written by the per-request steer state
  when requests enter, leave or move, fully reset when a slot is reused;
- the step planner (:class:`~vllm_steer.integrations.worker.rows.StepPlanner`): the typed row
  source of the next ``compute_logits`` call (which request slot each row belongs to) and the
  steer op on those rows, planned from host data only (sync-free).

The head does no work at all while no request *of the current step* is steered (host-side
flags, no device sync): V1 zeroes a finished request's slot (``BatchUpdate.removed``); V2 has
no removal callback, so its runner hook asks :meth:`SteerRuntime.any_steered` about the slots
of the step's batch (``idx_mapping``) and a finished request's stale slot costs nothing.
:attr:`SteerRuntime.stats` reads the planner's counts of steer-op calls and rows (cheap host
counters).

Each runner (and V2 speculator) finds its runtime once: :func:`runtime_of` looks it up from the
engine's configuration at the runner's first hooked call and keeps it, with the runner's other
steer state, in one :class:`RunnerBinding` (kept beside the runner, in :data:`BINDINGS`), as
vLLM's runner keeps ``self.lora_manager``; every later step reads it from there (no configuration rebuilt,
nothing serialised, nothing imported).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from vllm_steer.config import SteerServerConfig
from vllm_steer.integrations.side_table import SideTable
from vllm_steer.integrations.worker.bank_state import BankState
from vllm_steer.integrations.worker.request_slots import (RequestCoefs, RequestSlots,
                                                          decode_request)
from vllm_steer.integrations.worker.rows import RowSource, StepPlanner


@dataclass
class SteerStats:
    """Counts of the worker's steer op (host-side integers, no device sync): a copy of
    the step planner's (:attr:`StepPlanner.op_calls`, :attr:`StepPlanner.op_rows`)."""

    calls: int = 0  # steer-op calls (one per ``compute_logits`` with steered rows)
    rows: int = 0  # hidden-state rows passed through the steer op

    def as_dict(self) -> dict[str, int]:
        return {"calls": self.calls, "rows": self.rows}


class SteerRuntime:
    """State of one worker: its bank, its request slots and its step planner. Created by
    whichever of head / per-request steer state comes first."""

    def __init__(self, config: SteerServerConfig):
        self.config = config
        self.banks = BankState(config)
        self.slots = RequestSlots(config.capacity)
        self.planner = StepPlanner(self.banks, self.slots)

    # ---- the parts' names, read by the hooks and tests -----------------------------------
    names = property(lambda self: self.banks.names, doc="The start-up steers' names.")
    bank = property(lambda self: self.banks.bank, doc="The SlotBank (None until loaded).")
    graphs = property(lambda self: self.banks.graphs,
                      lambda self, g: setattr(self.banks, "graphs", g),
                      doc="CUDA: the head's op replayed from CUDA graphs (None: the eager op).")
    backend = property(lambda self: self.banks.backend, doc="The resolved backend.")
    capacity = property(lambda self: self.banks.capacity, doc="Bank slots (--max-steers).")
    num_columns = property(lambda self: self.banks.num_columns,
                           doc="Coefficient columns: two per bank slot (steer, domain).")
    slot_coefs = property(lambda self: self.slots.table,
                          doc="``[max_slots, K]`` fp32 on the device: each request slot's row.")
    num_active_slots = property(lambda self: self.slots.num_active_slots)
    num_window_slots = property(lambda self: self.slots.num_window_slots)
    head_calls = property(lambda self: self.planner.head_calls)
    stats = property(lambda self: SteerStats(self.planner.op_calls, self.planner.op_rows),
                     doc="The steer op's counts so far (a copy: :class:`SteerStats`).")
    op_timer = property(lambda self: self.planner.op_timer,
                        doc="The steer op's time (:class:`~vllm_steer.metrics.OpTimer`).")
    active = property(lambda self: self.planner.active,
                      doc="Whether the head has steer work for the next compute_logits' rows.")

    @property
    def row_source(self) -> RowSource:
        return self.planner.row_source

    @row_source.setter
    def row_source(self, source: RowSource) -> None:
        self.planner.row_source = source

    @property
    def batch_size(self) -> int:
        return self.planner.batch_size

    @batch_size.setter
    def batch_size(self, n: int) -> None:
        self.planner.batch_size = n

    @property
    def batch_positions(self) -> np.ndarray | None:
        return self.planner.batch_positions

    @batch_positions.setter
    def batch_positions(self, positions: np.ndarray | None) -> None:
        self.planner.batch_positions = positions

    # ---- the bank ------------------------------------------------------------------------
    def load(self, hidden_size: int, device: torch.device, dtype: torch.dtype,
             model_id: str | None = None, cuda_graphs: bool = True) -> None:
        """Load every steer on the model's device/dtype (:meth:`BankState.load`)."""
        self.banks.load(hidden_size, device, dtype, model_id=model_id, cuda_graphs=cuda_graphs)

    def model_loaded(self, activation_dtype: torch.dtype | None = None) -> None:
        """The worker's model is built and its weights loaded (vLLM's loader, before it sizes
        the KV cache): capture the head's CUDA graphs now (:meth:`StepPlanner.capture_graphs`)
        for hidden states of ``activation_dtype`` (the model's dtype; the bank's when None)."""
        self.banks.model_loaded = True
        self.banks.activation_dtype = activation_dtype
        self.planner.capture_graphs()

    def put_steer(self, bank_slot: int, load_id: int, name: str, steer) -> None:
        """Load a steer into a bank slot no request uses (the engine core picked it)."""
        self.banks.put(bank_slot, load_id, name, steer)
        self.slots.version += 1
        self.planner.capture_graphs()  # again, if the load changed the bank's layout

    def drop_slots(self, bank_slots) -> None:
        """Empty these bank slots."""
        self.banks.drop(bank_slots)
        self.slots.version += 1
        self.planner.capture_graphs()

    def warm_up(self) -> None:
        """Compile the backend's kernels for the bank's layout now (CUDA only)."""
        self.banks.warm_up()

    def enable_fixed_drafter(self) -> float:
        """The bank's fixed-layout copy for drafters in CUDA graphs (MiB allocated)."""
        mib = self.banks.enable_fixed_drafter()
        self.planner.capture_graphs()  # a new copy drops the head's graphs
        return mib

    # ---- the request slots ---------------------------------------------------------------
    def ensure_slots(self, max_slots: int, device: torch.device,
                     max_rows: int | None = None) -> None:
        """Size the request-slot table for ``max_slots`` (vLLM's ``max_num_seqs``); a step
        steers at most ``max_rows`` rows (:func:`max_step_rows`; ``max_slots`` when None): the
        kernels are compiled and the head's graphs captured for that many."""
        if self.slots.ensure(max_slots, device):
            self.banks.max_rows = max(max_rows or 0, max_slots)
            self.banks.warm_up()
            self.planner.capture_graphs()

    def decode(self, params: Any) -> RequestCoefs:
        """A request's row and windows, decoded once from its bound form."""
        return decode_request(params, self.banks.bank, self.banks.num_columns)

    def set_slot(self, slot: int, row: np.ndarray | None, windows: dict | None = None) -> None:
        """(Re)initialise request slot ``slot`` fully (:meth:`RequestSlots.set`)."""
        self.slots.set(slot, row, windows, self.banks.bank)

    def move_slot(self, src: int, dst: int, swap: bool) -> None:
        self.slots.move(src, dst, swap)

    def flush(self) -> None:
        """Copy changed request-slot coefficients to the device (:meth:`RequestSlots.flush`)."""
        self.slots.flush()

    @property
    def has_steered_slots(self) -> bool:
        """Some request slot holds a steered request (V2: possibly one that has finished)."""
        return self.banks.bank is not None and self.slots.num_active_slots > 0

    def any_steered(self, slots: np.ndarray) -> bool:
        """Whether any of these request slots (a step's ``idx_mapping``) is steered."""
        return self.banks.bank is not None and self.slots.any_steered(slots)

    def any_windowed(self, slots: np.ndarray) -> bool:
        """Whether any of these request slots holds a request with a generation window."""
        return self.slots.any_windowed(slots)

    # ---- the step ------------------------------------------------------------------------
    def rows(self, source: RowSource):
        """Scope a row source to the calls inside the block (:meth:`StepPlanner.rows`)."""
        return self.planner.rows(source)

    def steer_rows(self, hidden: torch.Tensor) -> torch.Tensor:
        """Steer the rows of one ``compute_logits`` call (:meth:`StepPlanner.steer_rows`)."""
        return self.planner.steer_rows(hidden)

    def steer_fixed(self, hidden: torch.Tensor, mapping: torch.Tensor | None) -> torch.Tensor:
        """The capture-safe op on rows mapped on the device (:meth:`StepPlanner.steer_fixed`)."""
        return self.planner.steer_fixed(hidden, mapping)


def max_step_rows(vllm_config: Any, max_slots: int) -> int:
    """The most rows one ``compute_logits`` call of a runner with ``max_slots`` request slots
    steers: a row per request, and with speculative decoding the draft tokens each request
    verifies too (``max_num_seqs x (1 + num_speculative_tokens)``, as Model Runner V2 sizes its
    logits)."""
    spec = getattr(vllm_config, "speculative_config", None)
    k = getattr(spec, "num_speculative_tokens", None) if spec is not None else None
    return max_slots * (1 + (int(k) if isinstance(k, int) and k > 0 else 0))


# One runtime per process and configuration (tests may run several engines in one process);
# under the key None, the one used last (current_runtime).
_RUNTIMES: dict[str | None, SteerRuntime] = {}


def steer_stats(worker: Any = None) -> dict[str, int]:
    """The steer-op counters of this process, summed over its runtimes.

    Takes (and ignores) a worker as first argument, so that it can be run on every worker with
    ``LLM.collective_rpc(steer_stats)``.
    """
    total = SteerStats()
    for key, rt in _RUNTIMES.items():
        if key is None:
            continue
        total.calls += rt.planner.op_calls
        total.rows += rt.planner.op_rows
    return total.as_dict()


def get_runtime(additional_config: dict | None) -> SteerRuntime | None:
    """The process's runtime for this engine's configuration (None: no steers configured).

    Validates and serialises the configuration: called once per runner, head and per-request
    state (at load), never per step (:func:`runtime_of`)."""
    cfg = SteerServerConfig.from_additional_config(additional_config)
    if cfg is None or not cfg.enabled:
        return None
    import json

    key = json.dumps(cfg.to_additional_config(), sort_keys=True)
    rt = _RUNTIMES.get(key)
    if rt is None:
        rt = _RUNTIMES[key] = SteerRuntime(cfg)
    _RUNTIMES[None] = rt
    return rt


def current_runtime() -> SteerRuntime | None:
    """The runtime this worker process used last (a worker serves one engine): for vLLM
    objects that carry no config (V2's prompt-logprob worker)."""
    return _RUNTIMES.get(None)


#: Each vLLM runner's (or V2 speculator's, or worker's) :class:`RunnerBinding`, kept beside it
#: (nothing is set on vLLM's objects).
BINDINGS: SideTable[RunnerBinding] = SideTable()


class RunnerBinding:
    """The plugin's state for one vLLM runner (or V2 speculator, or worker), kept in
    :data:`BINDINGS`."""

    __slots__ = ("runtime", "resolved", "drafter_checked", "spec_step", "captured",
                 "steady_rows", "steady_ids", "steady_version", "steady_assigned",
                 "sample_batch_at")

    def __init__(self) -> None:
        self.runtime: SteerRuntime | None = None
        """The worker's runtime for this runner's engine (None: no steers configured)."""
        self.resolved = False
        """Whether :attr:`runtime` was looked up (at the runner's first hooked call)."""
        self.drafter_checked = False
        """The runner's drafter heads were checked (``spec_decode.prepare_drafter_once``)."""
        self.spec_step = False
        """V1: inside a speculative ``execute_model``: its verification rows are mapped."""
        self.captured = False
        """V2 speculator: its drafter heads were prepared for CUDA-graph-captured steps."""
        self.steady_rows = None
        """V2 runner: the row source (``MappedRows``) of its last steered step, kept while that
        batch had one row per request, no generation window and no drafter; a step with the
        same request ids (:attr:`steady_ids`), the request-slot table at :attr:`steady_version`
        and no request put into a slot since (:attr:`steady_assigned`) reuses it."""
        self.steady_ids = None
        """The request ids of that step's batch, in order (a copy of ``input_batch.req_ids``)."""
        self.steady_version = -1
        """The request-slot table's version when :attr:`steady_rows` was mapped."""
        self.steady_assigned = -1
        """The request-slot table's count of requests put into slots then
        (``RequestSlots.assigned``)."""
        self.sample_batch_at: int | None = None
        """V2 runner: where ``sample()``'s ``input_batch`` is among the positional arguments
        after ``self``, found by name from its signature at the first steered call (None: not
        yet; -1: keyword-only, read by name)."""


def binding(owner: Any) -> RunnerBinding:
    """The :class:`RunnerBinding` of a runner (made on first use)."""
    b = BINDINGS.get(owner)
    if b is None:
        b = BINDINGS.set(owner, RunnerBinding())
    return b


def bound(owner: Any) -> RunnerBinding:
    """The :class:`RunnerBinding` of a runner (or V2 speculator, or worker) with its runtime
    resolved: looked up from its ``vllm_config`` at its first call, then one dictionary read."""
    b = BINDINGS.get(owner)
    if b is not None and b.resolved:
        return b
    b = binding(owner)
    b.runtime = get_runtime(owner.vllm_config.additional_config)
    b.resolved = True
    return b


def runtime_of(owner: Any) -> SteerRuntime | None:
    """The runtime of a runner (or V2 speculator, or worker) (:func:`bound`)."""
    b = BINDINGS.get(owner)
    if b is not None and b.resolved:
        return b.runtime
    return bound(owner).runtime


__all__ = ["SteerRuntime", "SteerStats", "RunnerBinding", "get_runtime", "runtime_of",
           "binding", "bound", "current_runtime", "steer_stats"]
