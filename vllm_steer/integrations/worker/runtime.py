"""Per-worker steer state shared by the LM-head hook, the per-request steer state and the
runner hooks, and how each runner finds it. Semantics: see :mod:`vllm_steer.reference`.

One :class:`SteerRuntime` per worker process and steer configuration, made of four parts,
one concept each:

- the bank (:class:`~vllm_steer.integrations.worker.bank_state.BankState`): the
  :class:`~vllm_steer.bank.SlotBank` on the model's device and dtype, loaded once, with its
  bank slots filled and emptied at run time, and the backend resolved once;
- the request slots (:class:`~vllm_steer.integrations.worker.request_slots.RequestSlots`):
  the coefficients (and generation windows) of the request in each batch slot (V1:
  persistent-batch index; V2: request-state slot), written by the per-request steer state
  when requests enter, leave or move, fully reset when a slot is reused;
- the step mapping (:class:`~vllm_steer.integrations.worker.step_mapping.StepMapping`):
  which request slot, and which coefficients, each token of the step and each row of its
  LM-head calls belong to (the sampled, drafter and prompt-logprob rows), written by the
  runner adapters at every step;
- the step planner (:class:`~vllm_steer.integrations.worker.planner.StepPlanner`): the steer
  op on each LM-head call's rows, read from the step mapping and planned from host data only
  (sync-free).

Hooks and tests use each part through its own methods (``rt.slots.flush()``,
``rt.step.sampled``, ``rt.bank_state.bank``); the runtime's own methods are the few that
change more than one part together (a load, a drop, sizing the request slots).

The head does no work at all while no request *of the current step* is steered (host-side
flags, no device sync): V1 zeroes a finished request's slot (``BatchUpdate.removed``); V2 has
no removal callback, so its runner hook asks :meth:`SteerRuntime.any_steered` about the slots
of the step's batch (``idx_mapping``) and a finished request's stale slot costs nothing.
:attr:`StepPlanner.stats` reads the planner's counts of steer-op calls and rows (cheap host
counters).

Each vLLM object that runs hooks finds its runtime once: ``XBinding.of(owner)`` looks it up
from the engine's configuration at the object's first hooked call and keeps it, with what
that object's hooks read, in one binding per kind of owner (:class:`V1RunnerBinding`,
:class:`V2RunnerBinding`, :class:`SpeculatorBinding`; a worker's :class:`Binding` holds the
runtime alone), kept beside it in :data:`BINDINGS`, as vLLM's runner keeps
``self.lora_manager``; every later step reads it from there (no configuration rebuilt,
nothing serialised, nothing imported).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from vllm_steer.config import SteerServerConfig
from vllm_steer.integrations import vllm_access
from vllm_steer.integrations.side_table import SideTable
from vllm_steer.integrations.worker.bank_state import BankState
from vllm_steer.integrations.worker.request_slots import (RequestCoefs, RequestSlots,
                                                          decode_request)
from vllm_steer.integrations.worker.gates import GATES
from vllm_steer.logs import get_logger
from vllm_steer.integrations.worker.planner import SteerStats, StepPlanner
from vllm_steer.integrations.worker.step_mapping import (LayerVectors, StepMapping,
                                                         TokenCoefs, op_dtype)
from vllm_steer.integrations.worker.step_faults import REQUEST_STATE, StepFaults
from vllm_steer.request import BOUND_KEY
from vllm_steer.sizing import MAX_GRAPH_ROWS

logger = get_logger()


class SteerRuntime:
    """State of one worker: its bank (:attr:`bank_state`), its request slots (:attr:`slots`)
    and its step planner (:attr:`planner`), each used through its own methods. Created by
    whichever of head / per-request steer state comes first. Its own methods are the few
    that change more than one part together."""

    def __init__(self, config: SteerServerConfig):
        self.config = config
        self.bank_state = BankState(config)
        self.slots = RequestSlots(config.capacity)
        #: the step mapping: each token's and each LM-head row's slot, per step
        self.step = StepMapping()
        self.planner = StepPlanner(self.bank_state, self.slots, self.step)
        #: faults of the plugin's worker code waiting for the step's output (step_faults.py)
        self.faults = StepFaults()
        self.speculates = False  # its engine speculates (counted in GATES.speculative_runtimes)
        #: the vector bank read by the decoder layers (None: no decoder-layer op in this
        #: model: no vector steer configured); its tokens' coefficients: ``step.tokens``
        self.layers: LayerVectors | None = None

    # ---- steers inside the decoder layers -------------------------------------------------
    def install_layers(self, model: torch.nn.Module, num_blocks: int, hidden_size: int,
                       max_tokens: int, device: torch.device,
                       model_dtype: torch.dtype | None = None) -> int:
        """Give the model's decoder blocks the op of decoder-layer steers, reading a vector
        bank and a step mapping made now (once per worker, before vLLM compiles the model);
        the ``--steer`` steers of that kind are put in. Returns the blocks steered."""
        from vllm_steer.integrations.worker import decoder_layers

        if self.layers is not None:
            return 0
        blocks = decoder_layers.local_blocks(model, num_blocks)
        dtype = op_dtype(device, model_dtype)
        try:
            layers = LayerVectors(blocks, num_blocks, self.config.capacity, hidden_size,
                                  max_tokens, device, dtype)
        except torch.OutOfMemoryError as e:
            from vllm_steer.sizing import vector_bank_bytes

            cap, name = self.config.capacity, str(dtype).replace("torch.", "")
            mib = vector_bank_bytes(cap, len(blocks), hidden_size, max_tokens, name) / 2**20
            raise RuntimeError(
                f"vllm-steer: the vector bank needs {mib:.1f} MiB on {device} ({cap} max "
                f"steers x ({len(blocks)} blocks x hidden {hidden_size} + {max_tokens} step "
                f"tokens) x {name}) and the device cannot hold it "
                f"({str(e).splitlines()[0]}); lower --max-steers (now {cap}) or "
                f"--max-num-batched-tokens (now {max_tokens}), or serve without vector "
                "steers (no --steer-vectors and no vector --steer file)") from None
        n = decoder_layers.install(model, layers, num_blocks, model_dtype)
        logger.info("vllm-steer: vector bank reserves %.1f MiB (%d max steers x (%d blocks x "
                    "hidden %d + %d step tokens) x %s)", layers.reserved_bytes / 2**20,
                    self.config.capacity, len(blocks), hidden_size, max_tokens,
                    str(layers.dtype).replace("torch.", ""))
        self.layers, self.step.tokens = layers, TokenCoefs(layers, self.slots)
        GATES.layer_mappings += 1
        bank = self.bank_state.bank
        placement = self.config.startup_placement()
        if bank is None:  # a pipeline stage without the LM head: a bank of steers, no factors
            bank = self.bank_state.layers_only_bank(hidden_size, device)
            bank.layers = layers
            for name, steer in self.bank_state.load_startup_steers().items():
                bank.put(*placement[name], name, steer)
        else:
            bank.layers = layers
            for name, steer in self.bank_state.startup_layer_steers.items():
                bank.put(*placement[name], name, steer)
        self.slots.use_layers(layers)  # the head's table leaves the vector slots' columns out
        self.slots.version += 1
        return n

    # ---- the bank ------------------------------------------------------------------------
    def model_loaded(self, activation_dtype: torch.dtype | None = None) -> None:
        """The worker's model is built and its weights loaded (vLLM's loader, before it sizes
        the KV cache): capture the head's CUDA graphs now (:meth:`StepPlanner.capture_graphs`)
        for hidden states of ``activation_dtype`` (the model's dtype; the bank's when None)."""
        self.bank_state.model_loaded = True
        self.bank_state.activation_dtype = activation_dtype
        self.planner.capture_graphs()

    def put_steer(self, bank_slot: int, load_id: int, name: str, steer) -> None:
        """Load a steer into a bank slot no request uses (the engine core picked it, and
        issued its load id)."""
        self.bank_state.put(bank_slot, load_id, name, steer)
        self.slots.use_layers(self.layers)  # a vector steer's columns: out of the head's table
        self.slots.version += 1
        self.planner.capture_graphs()  # again, if the load changed the bank's layout

    def drop_slots(self, bank_slots) -> None:
        """Empty these bank slots."""
        self.bank_state.drop(bank_slots)
        self.slots.use_layers(self.layers)
        self.slots.version += 1
        self.planner.capture_graphs()

    def enable_fixed_drafter(self) -> float:
        """Drafters in CUDA graphs read the bank in place (MiB allocated: 0); the head's
        graphs are captured now if they are not yet."""
        mib = self.bank_state.enable_fixed_drafter()
        self.planner.capture_graphs()
        return mib

    # ---- the request slots ---------------------------------------------------------------
    def mark_speculative(self) -> None:
        """Its engine speculates (a ``speculative_config``; the V1 per-request state tells it when
        made): counted once in the process gates, which the V1 runner's ``_prepare_inputs`` hook
        reads before it asks its runner."""
        if not self.speculates:
            self.speculates = True
            GATES.speculative_runtimes += 1

    def ensure_slots(self, max_slots: int, device: torch.device,
                     max_rows: int | None = None) -> None:
        """Size the request-slot table for ``max_slots`` (vLLM's ``max_num_seqs``); a step
        steers at most ``max_rows`` rows (:func:`max_step_rows`; ``max_slots`` when None): the
        kernels are compiled and the head's graphs captured for that many, and the head's
        table has rows for that many windowed rows (at most the largest graph's)."""
        extra = min(max(max_rows or 0, max_slots), MAX_GRAPH_ROWS)
        if self.slots.ensure(max_slots, device, extra):
            self.bank_state.max_rows = max(max_rows or 0, max_slots)
            self.bank_state.warm_up()
            self.planner.capture_graphs()

    def decode(self, params: Any) -> RequestCoefs:
        """A request's row and windows, decoded once from its bound form."""
        return decode_request(params, self.bank_state.bank, self.slots.num_columns)

    def assign(self, slot: int, params: Any) -> RequestCoefs | None:
        """Put a request (its ``SamplingParams``) into request slot ``slot``: decoded once
        (:meth:`decode`), the slot fully reset (:meth:`set_slot`). A fault of the plugin's
        code here leaves the slot unsteered and fails that request alone (HTTP 500,
        :mod:`~vllm_steer.integrations.worker.step_faults`), unless it asked for no steer: it
        is then served as asked. Returns the request's coefficients (None after a fault)."""
        prompt = vllm_access.asks_prompt_logprobs(params)  # kept even when the rest fails
        try:
            coefs = self.decode(params)
            self.set_slot(slot, coefs.row, coefs.windows, prompt)
        except Exception as e:
            self.set_slot(slot, None, prompt_logprobs=prompt)
            if vllm_access.extra_args(params).get(BOUND_KEY):
                self.faults.record_slot(slot, REQUEST_STATE, e)
            else:  # it asked for no steer: served as asked
                self.faults.log(REQUEST_STATE, e, "no request fails (it asked for no steer)")
            return None
        if self.faults.slots:
            self.faults.clear_slot(slot)
        return coefs

    def set_slot(self, slot: int, row: np.ndarray | None, windows: dict | None = None,
                 prompt_logprobs: bool = False) -> None:
        """(Re)initialise request slot ``slot`` fully (:meth:`RequestSlots.set`)."""
        self.slots.set(slot, row, windows, self.bank_state.bank, prompt_logprobs)

    def any_steered(self, slots: np.ndarray) -> bool:
        """Whether any of these request slots (a step's ``idx_mapping``) is steered."""
        return self.bank_state.bank is not None and self.slots.any_steered(slots)


def max_step_rows(vllm_config: Any, max_slots: int) -> int:
    """The most rows one ``compute_logits`` call of a runner with ``max_slots`` request slots
    steers: a row per request, and with speculative decoding the draft tokens each request
    verifies too (``max_num_seqs x (1 + num_speculative_tokens)``, as Model Runner V2 sizes its
    logits)."""
    return max_slots * (1 + vllm_access.speculative_tokens(vllm_config))


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
        if key is not None:
            total.calls += rt.planner.op_calls
            total.rows += rt.planner.op_rows
    return total.as_dict()


def get_runtime(additional_config: dict | None) -> SteerRuntime | None:
    """The process's runtime for this engine's configuration (None: no steers configured).

    Validates and serialises the configuration: called once per runner, head and per-request
    state (at load), never per step (:meth:`Binding.of`)."""
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


#: Each vLLM owner's binding (:class:`Binding`: a runner's, a V2 speculator's or a worker's),
#: kept beside it (nothing is set on vLLM's objects).
BINDINGS: SideTable[Binding] = SideTable()


class Binding:
    """The plugin's state for one vLLM object that runs hooks (kept in :data:`BINDINGS`): the
    worker's runtime for that object's engine, looked up once, at its first hooked call
    (:meth:`of`). A worker's (run-time steer management) holds nothing else; each kind of
    runner and the V2 speculator add what their own hooks read."""

    __slots__ = ("runtime",)
    #: the ``VllmConfig`` of the owner, read through the accessor layer (one per owner kind:
    #: each is checked at start-up with the hook group of that kind)
    config_of = staticmethod(vllm_access.worker_vllm_config)

    def __init__(self, runtime: SteerRuntime | None) -> None:
        self.runtime = runtime
        """The worker's runtime for this object's engine (None: no steers configured)."""

    @classmethod
    def of(cls, owner: Any):
        """The binding of ``owner`` (a vLLM runner, speculator or worker): made at its first
        call, with the runtime looked up from its ``vllm_config``; then one dictionary read."""
        b = BINDINGS.get(owner)
        if b is None:
            config = cls.config_of(owner)
            b = BINDINGS.set(owner, cls(get_runtime(vllm_access.additional_config(config))))
        return b


class V1RunnerBinding(Binding):
    """The V1 runner's binding (:mod:`~vllm_steer.integrations.worker.v1`,
    :mod:`~vllm_steer.integrations.worker.spec_v1`)."""

    __slots__ = ("drafter_checked", "spec_step")
    config_of = staticmethod(vllm_access.v1_runner_vllm_config)

    def __init__(self, runtime: SteerRuntime | None) -> None:
        super().__init__(runtime)
        self.drafter_checked = False
        """The runner's drafter heads were checked (``spec_decode.prepare_drafter_once``)."""
        self.spec_step = False
        """Inside a steered speculative step's ``_prepare_inputs``: its verification rows are
        mapped (``spec_v1.start_step``)."""


class V2RunnerBinding(Binding):
    """Model Runner V2's binding (:mod:`~vllm_steer.integrations.worker.v2`): what its
    per-step ``sample`` hook reads, the last steady batch included."""

    __slots__ = ("drafter_checked", "steady_rows", "steady_ids", "steady_version",
                 "steady_assigned", "sample_batch_at")
    config_of = staticmethod(vllm_access.v2_runner_vllm_config)

    def __init__(self, runtime: SteerRuntime | None) -> None:
        super().__init__(runtime)
        self.drafter_checked = False
        """The runner's drafter heads were checked (``spec_decode.prepare_drafter_once``)."""
        self.steady_rows = None
        """The sampled rows (``MappedRows``) of its last steered step, kept while that batch
        had one row per request, no generation window and no drafter; a step with the same
        request ids (:attr:`steady_ids`), the request-slot table at :attr:`steady_version`
        and no request put into a slot since (:attr:`steady_assigned`) reuses it."""
        self.steady_ids = None
        """The request ids of that step's batch, in order (a copy of ``input_batch.req_ids``)."""
        self.steady_version = -1
        """The request-slot table's version when :attr:`steady_rows` was mapped."""
        self.steady_assigned = -1
        """The request-slot table's count of requests put into slots then
        (``RequestSlots.assigned``)."""
        self.sample_batch_at: int | None = None
        """Where ``sample()``'s ``input_batch`` is among the positional arguments after
        ``self``, found by name from its signature at the first steered call (None: not yet;
        keyword-only: a place past any call's, so it is read by name)."""


class SpeculatorBinding(Binding):
    """A V2 speculator's binding (:mod:`~vllm_steer.integrations.worker.spec_v2`)."""

    __slots__ = ("captured",)
    config_of = staticmethod(vllm_access.speculator_vllm_config)

    def __init__(self, runtime: SteerRuntime | None) -> None:
        super().__init__(runtime)
        self.captured = False
        """Its drafter heads were prepared for CUDA-graph-captured draft steps."""


__all__ = ["SteerRuntime", "SteerStats", "Binding", "V1RunnerBinding", "V2RunnerBinding",
           "SpeculatorBinding", "BINDINGS", "get_runtime", "current_runtime", "steer_stats",
           "max_step_rows"]
