"""Per-worker steer state shared by the LM-head hook and the runner's logits processor.

Semantics: see :mod:`vllm_steer.reference`.

One :class:`SteerRuntime` per worker process and steer configuration. It holds

- the :class:`~vllm_steer.bank.SteerBank` on the model's device and dtype (loaded once),
- ``slot_coefs`` ``[max_num_reqs, K]`` fp32 on the device: the coefficients of the request in
  each batch slot (V1: persistent-batch index; V2: request-state slot), written by the logits
  processor when requests enter, leave or move, fully reset when a slot is reused,
- the *row source* of the next ``compute_logits`` call: which slot each hidden-state row
  belongs to. V1 samples rows in batch order (row i = slot i); V2 gives
  ``expanded_idx_mapping`` (row -> slot) per step; prompt-logprob calls map a slice of the
  step's hidden states to one request.

The head does no work at all while no request *of the current step* is steered (host-side
flags, no device sync): V1 zeroes a finished request's slot (``BatchUpdate.removed``); V2 has
no removal callback, so its runner wrapper asks :meth:`SteerRuntime.any_steered` about the
slots of the step's batch (``idx_mapping``) and a finished request's stale slot costs nothing.
:attr:`SteerRuntime.stats` counts the steer-op calls (cheap host counters).

The per-step path is sync-free by construction (no device tensor is read into Python): every
row source gives its row -> slot on the host (V1 batch order, V2's ``idx_mapping_np`` /
``cu_num_logits_np``, the ``slots`` array, the prompt-logprob slice's slot); the rows'
coefficients are gathered from the host mirror ``_host``, copied from pinned staging
(:class:`StagedCopy`) into a persistent device buffer only when they changed, and the backend's
plan is made from the host copy and cached under a host key. Host-to-device copies of the slot
table (:meth:`SteerRuntime.flush`) use pinned staging too, and no copy waits for the device
(however many a step makes: V2 prompt logprobs copy per chunk). Only batch-sharded sampling
(V2, TP > 1), whose row order exists on the device alone, gathers and plans on the device.

Generation windows (a request's strength as a schedule over its generated tokens,
:class:`vllm_steer.request.Window`): per-slot window arrays on the host, set with the slot; each
step computes the windowed rows' coefficients from the index of the token each row samples
(V1: the runner's ``_prepare_inputs`` hook; V2: the input batch's host arrays; ``slots``: its
``positions``), vectorised; requests without windows pay nothing for them.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from vllm_steer.bank import SlotBank
from vllm_steer.config import SteerServerConfig
from vllm_steer.request import BOUND_KEY, BoundSteer, Window
from vllm_steer.format import SteerFileError, load_steer, read_metadata
from vllm_steer.logs import get_logger
from vllm_steer.metrics import OpTimer

logger = get_logger()


@dataclass
class SteerStats:
    """Counters of the worker's steer op (host-side integers, no device sync)."""

    calls: int = 0  # steer-op calls (one per ``compute_logits`` with steered rows)
    rows: int = 0  # hidden-state rows passed through the steer op
    op: OpTimer = field(default_factory=OpTimer)  # the steer op's host and device time

    def as_dict(self) -> dict[str, int]:
        return {"calls": self.calls, "rows": self.rows}


@dataclass
class RowSource:
    """Where the rows of the next ``compute_logits`` call come from."""

    kind: str  # "batch" (row i = slot i), "mapping" (row -> slot), "slots", "prompt", "none",
    #            "captured" (row -> slot on the device only, read by a capture-safe op: steer_fixed)
    # "mapping" (V2): the step's row -> slot on the device; plans come from ``slots`` (its host
    # copy) when given; a device mapping alone (batch-sharded sampling) is gathered on the device
    mapping: torch.Tensor | None = None
    # "slots": the slot of each row on the host ([num_rows] int, numpy), and optionally the
    # index of the generated token each row samples ([num_rows] int, numpy; -1: a prompt row).
    # The host copy is what plans are made from (no device read).
    slots: np.ndarray | None = None
    positions: np.ndarray | None = None
    base: torch.Tensor | None = None  # the step's full hidden states ("prompt")
    query_start_loc: np.ndarray | None = None  # [num_reqs + 1] token offsets ("prompt")


class SteerRuntime:
    """State of one worker. Created by whichever of head/logits processor comes first."""

    def __init__(self, config: SteerServerConfig):
        self.config = config
        self.names = list(config.steers)
        self.metadata = {}
        problems = []
        for name, path in config.steers.items():
            try:
                self.metadata[name] = read_metadata(path)
            except SteerFileError as e:
                problems.append(str(e))
        if problems:
            raise SteerFileError(", ".join(config.steers.values()),
                                 [p.replace("\n", " ") for p in problems])
        self.bank: SlotBank | None = None
        self.backend: str | None = None  # resolved at load
        self.slot_coefs: torch.Tensor | None = None  # [max_slots, K] on device
        self._host: np.ndarray | None = None  # [max_slots, K] host mirror
        self._steered: np.ndarray | None = None  # [max_slots] bool: slot has a non-zero row
        self.stats = SteerStats()
        self.head_calls = 0  # calls into the head (steer_rows), steered rows or not
        self._dirty = False
        self.num_active_slots = 0
        self.version = 0  # bumped whenever slot_coefs may change (keys the bank's plan)
        self.batch_size = 0
        # V1: the index of the generated token each row of the batch samples (host, set by the
        # runner hook only while some slot has a generation window; None otherwise)
        self.batch_positions: np.ndarray | None = None
        self.row_source = RowSource("batch")
        # per-slot generation windows (host; see set_slot): None until a request has one
        self._win: dict[str, np.ndarray] | None = None
        self._windowed: np.ndarray | None = None  # [max_slots] bool
        self.num_window_slots = 0
        # the per-step cache (see steer_rows): the step's key, its host coefficients, the
        # device buffer they were copied to, the plan and what it was made for
        self._step_key: object = None
        self._step_coefs: np.ndarray | None = None
        self._coefs_dev: torch.Tensor | None = None
        self._plan_key: object = None
        self._plan = None
        self._fn = None
        self._prepare = None
        self._coef_copy: StagedCopy | None = None
        self._slot_copy: StagedCopy | None = None
        # steers come and go at run time (integrations.engine.management): a fixed number of
        # steer slots, two coefficient columns each (steer, domain; see SlotBank)
        self.capacity = config.capacity
        self.num_columns = 2 * self.capacity
        self.max_rows = 0  # the most rows one step steers (vLLM's max_num_seqs), once known
        self.graphs = None  # CUDA: the head's op replayed from CUDA graphs (SlotBank.head_graphs)

    # ---- loading (head side) -------------------------------------------------------------
    def load(self, hidden_size: int, device: torch.device, dtype: torch.dtype,
             model_id: str | None = None) -> None:
        """Load every steer on the model's device/dtype; refuse a steer that does not fit."""
        if self.bank is not None:
            return
        reasons = []
        steers = {}
        for name, path in self.config.steers.items():
            meta = self.metadata[name]
            if meta.hidden_size != hidden_size:
                reasons.append(f"steer {name!r} ({path}): hidden size {meta.hidden_size} does not "
                               f"fit the model's hidden size {hidden_size}; train or transfer it "
                               "for this model (vllm-steer train / vllm-steer transfer)")
                continue
            if meta.base_model and model_id and not _same_model(meta.base_model, model_id):
                logger.warning("vllm-steer: steer %r (%s) was trained on %r but the server runs "
                               "%r; it fits (same hidden size) but may not steer as intended",
                               name, path, meta.base_model, model_id)
            try:
                steers[name] = load_steer(path)
            except SteerFileError as e:
                reasons.append(str(e).replace("\n", " "))
        if reasons:
            raise SteerFileError(", ".join(self.config.steers.values()), reasons)
        self.bank = self._reserve_bank(hidden_size, device, dtype, steers)
        for slot, name in enumerate(self.names):  # the registry numbers them the same way
            self.bank.put(slot, slot + 1, name, steers[name])
        # Resolve the backend now (it imports the kernels, and Triton where present: about
        # half a second), not in the first steered request's step.
        from vllm_steer import ops

        max_rank = self.config.max_steer_rank or max(
            (steers[n].p1.shape[1] for n in steers), default=None)
        self.backend = ops.resolve_backend(self.config.backend, torch.device(device or "cpu"),
                                           hidden_size, max_rank)
        self._fn = ops.backend_fn(self.backend)  # resolved once, not per step
        self._prepare = ops._PREPARE.get(self.backend)
        self.warm_up()
        self.graphs = self.bank.head_graphs(self.config.backend)
        logger.info("vllm-steer: loaded %d steer(s) %s on %s/%s", len(steers), self.names,
                    device, dtype)

    def _reserve_bank(self, hidden_size: int, device, dtype, steers: dict) -> SlotBank:
        """The bank, its device storage allocated now for its worst case: ``capacity`` steers
        of rank ``--max-steer-rank`` (or, without it, the largest start-up steer's), each with
        a domain component (:func:`~vllm_steer.bank.slot_bank_bytes`). Called while vLLM loads
        the model, so vLLM counts it with the weights before it sizes the KV cache, and a
        run-time load then allocates nothing. Refused with the figure when it does not fit."""
        from vllm_steer.bank import slot_bank_bytes

        cap, max_rank = self.capacity, self.config.max_steer_rank
        rank = max_rank or max((p.shape[1] for s in steers.values()
                                for p in (s.p1, s.domain_p1) if p is not None), default=0)
        dtype_name = str(dtype).replace("torch.", "")
        mib = slot_bank_bytes(cap, rank, hidden_size, dtype) / 2**20
        figure = (f"{cap} max steers x rank {rank} x hidden {hidden_size} x {dtype_name}, "
                  "x2 factors, x2 for domain components")
        try:
            bank = SlotBank(cap, hidden_size, device=device, dtype=dtype, max_rank=max_rank,
                            reserve_rank=rank)
        except torch.OutOfMemoryError as e:
            raise RuntimeError(
                f"vllm-steer: the steer bank needs {mib:.1f} MiB on {device} ({figure}) and the "
                f"device cannot hold it ({str(e).splitlines()[0]}); lower --max-steers "
                f"(now {cap}) or --max-steer-rank (now {rank}), or "
                "--gpu-memory-utilization") from None
        logger.info("vllm-steer: steer bank reserves %.1f MiB (%s)%s", mib, figure,
                    "" if max_rank else "; without --max-steer-rank a run-time load of a larger "
                    "rank allocates device memory outside vLLM's budget")
        return bank

    # ---- request state (logits-processor side) -------------------------------------------
    def ensure_slots(self, max_slots: int, device: torch.device) -> None:
        if self._host is None or self._host.shape[0] < max_slots:
            self._host = np.zeros((max_slots, self.num_columns), dtype=np.float32)
            self._steered = np.zeros(max_slots, dtype=bool)
            self.slot_coefs = torch.zeros((max_slots, self.num_columns), dtype=torch.float32,
                                          device=device)
            self._slot_copy = StagedCopy(torch.device(device))
            self._windowed = np.zeros(max_slots, dtype=bool)
            self._win = None
            self.num_window_slots = 0
            self._dirty = False
            self.num_active_slots = 0
            self.version += 1
            self.max_rows = max_slots
            self.warm_up()

    def warm_up(self) -> None:
        """Compile, now, every kernel specialisation the backend can launch for this bank's
        layout and up to ``max_rows`` rows (at start-up and after a load that changes the
        layout), so that no serving step stalls on a JIT compile. CUDA only (the CPU paths
        compile nothing)."""
        if self.bank is None or not self.max_rows or self.bank.p1.device.type != "cuda":
            return
        from vllm_steer import ops

        t0 = time.perf_counter()
        n = ops.warm_up(self.backend, self.bank.p1, self.bank.p2, self.bank.rank_offsets,
                        self.max_rows, self.bank.p1.dtype)
        if n:
            logger.info("vllm-steer: compiled %d steer-kernel specialisation(s) for up to %d "
                        "rows in %.1f s", n, self.max_rows, time.perf_counter() - t0)

    def _bound(self, params: Any) -> list[BoundSteer]:
        """The request's steers as the engine core bound them (the only form read here)."""
        extra = getattr(params, "extra_args", None) or {}
        try:
            return BoundSteer.from_wire(extra.get(BOUND_KEY))
        except Exception as e:  # noqa: BLE001 - request data must not crash a worker
            logger.warning("vllm-steer: a request's bound steers %r are malformed (%s); the "
                           "request is served unsteered", extra.get(BOUND_KEY), e)
            return []

    def coef_row(self, params: Any) -> np.ndarray:
        """Coefficients of a request (zeros when it asks for no steer).

        The engine core bound each steer to ``(slot, generation)`` at admission
        (:class:`~vllm_steer.request.BoundSteer`); a slot that no longer holds that generation
        is never used (the engine core keeps a slot while a request bound to it runs, so this
        is a bug guard, logged). Never raises on request data."""
        bound = self._bound(params) if self.bank is not None else []
        if not bound:
            return np.zeros(self.num_columns, dtype=np.float32)
        row, problems = self.bank.coef_row({b.name: (b.bank_slot, b.load_id) for b in bound},
                                           {b.name: b.strength for b in bound})
        for p in problems:
            logger.error("vllm-steer: request steer left out: %s", p)
        return np.asarray(row, dtype=np.float32)

    # ---- run-time loading (vllm_steer.integrations.engine.management) -----------------------
    def put_steer(self, slot: int, generation: int, name: str, steer) -> None:
        """Load a steer into a slot no request uses (the engine core picked it)."""
        assert self.bank is not None, "steers are loaded with the model"
        layout = list(self.bank.rank_offsets)
        self.bank.put(slot, generation, name, steer)
        self.version += 1
        if list(self.bank.rank_offsets) != layout:
            self.warm_up()
        if name in self.bank.fixed_left_out:
            logger.warning("vllm-steer: steer %r (rank %d) is wider than the drafter's copy of "
                           "the bank (rank %d): drafters inside CUDA graphs propose without it; "
                           "the target applies it", name, steer.p1.shape[1],
                           self.bank.fixed_rank)

    def drop_slots(self, slots) -> None:
        if self.bank is None:
            return
        for slot in slots:
            self.bank.drop(slot)
        self.version += 1

    def coef_windows(self, params: Any) -> dict | None:
        """The generation windows of a request, per bank slot: ``{slot: Window}`` covering every
        steer it names (a steer given as a number: a constant ``Window(s, base=s)``), or None
        when it has no window (the common case: constant coefficients, no per-step work).
        Never raises on request data (as :meth:`coef_row`)."""
        bound = self._bound(params) if self.bank is not None else []
        if not any(isinstance(b.value, Window) for b in bound):
            return None
        out = {}
        for b in bound:
            slot = b.bank_slot
            if not 0 <= slot < self.capacity or self.bank.generations[slot] != b.load_id \
                    or self.bank.steers[slot] is None or not b.strength:
                continue  # left out by coef_row too (logged there)
            out[slot] = b.value if isinstance(b.value, Window) else Window(b.value, base=b.value)
        return out or None

    def set_slot(self, slot: int, row: np.ndarray | None, windows: dict | None = None) -> None:
        """(Re)initialise a slot fully: a reused slot keeps nothing of its previous request.

        ``windows`` (from :meth:`coef_windows`): the request's strength is a schedule over its
        generated tokens; each step then computes the slot's coefficients from the index of the
        token each row samples (see :meth:`_row_coefs`). ``row`` stays the constant row (what
        the request asks for inside its windows), which says whether the slot is steered."""
        assert self._host is not None
        if row is None:
            row = 0.0
        self._host[slot] = row
        steered = bool(np.any(self._host[slot]))
        if windows:
            self._set_windows(slot, windows)
            steered = steered or any(w.strength or w.base for w in windows.values())
        elif self._windowed[slot]:
            self._windowed[slot] = False
            self.num_window_slots -= 1
        self._steered[slot] = steered
        self._dirty = True
        self.version += 1

    def _set_windows(self, slot: int, windows: dict) -> None:
        cap = self.capacity
        if self._win is None:
            n = self._host.shape[0]
            self._win = {k: np.zeros((n, cap), dtype=np.float64)
                         for k in ("strength", "base", "start", "end", "ramp", "eps", "dom")}
        w = self._win
        for arr in w.values():
            arr[slot] = 0.0
        w["end"][slot] = -1.0
        for j, win in windows.items():
            meta = self.bank.steers[j].metadata
            served = meta.domain == "with_steer" and self.bank.steers[j].domain_p1 is not None
            w["strength"][slot, j], w["base"][slot, j] = win.strength, win.base
            w["start"][slot, j], w["ramp"][slot, j] = win.start, win.ramp
            w["end"][slot, j] = -1 if win.end is None else win.end
            w["eps"][slot, j] = meta.epsilon
            w["dom"][slot, j] = meta.domain_strength * meta.epsilon if served else 0.0
        if not self._windowed[slot]:
            self._windowed[slot] = True
            self.num_window_slots += 1

    def move_slot(self, src: int, dst: int, swap: bool) -> None:
        assert self._host is not None
        arrays = [self._host, self._steered, self._windowed]
        if self._win is not None:
            arrays += list(self._win.values())
        for arr in arrays:
            if swap:
                arr[[src, dst]] = arr[[dst, src]]
            else:
                arr[dst] = arr[src]
                arr[src] = 0
        self.num_window_slots = int(np.count_nonzero(self._windowed))
        self._dirty = True
        self.version += 1

    def flush(self) -> None:
        """Copy changed slot coefficients to the device (once per step, only when changed),
        from pinned staging on CUDA (no sync; see :class:`StagedCopy`)."""
        if not self._dirty or self._host is None:
            return
        n = self._host.shape[0]
        self._slot_copy.copy_(self.slot_coefs[:n], self._host)
        self.num_active_slots = int(np.count_nonzero(self._steered))
        self._dirty = False
        self.version += 1

    @property
    def has_steered_slots(self) -> bool:
        """Some slot holds a steered request (V2: possibly one that has finished)."""
        return self.bank is not None and self.num_active_slots > 0

    def any_steered(self, slots: np.ndarray) -> bool:
        """Whether any of these slots (a step's ``idx_mapping``) holds a steered request."""
        return self.has_steered_slots and bool(self._steered[slots].any())

    def any_windowed(self, slots: np.ndarray) -> bool:
        """Whether any of these slots holds a request with a generation window."""
        return bool(self.num_window_slots) and bool(self._windowed[slots].any())

    @property
    def active(self) -> bool:
        """Whether the head has steer work for the rows of the next ``compute_logits``."""
        if self.row_source.kind == "captured":  # recorded whether or not a slot is steered
            return self.bank is not None and self.bank.fixed_p1 is not None
        return self.has_steered_slots and self.row_source.kind != "none"

    @contextlib.contextmanager
    def rows(self, source: RowSource):
        """Scope a row source to the calls inside the block (V2 sampling, prompt logprobs)."""
        prev, self.row_source = self.row_source, source
        try:
            yield
        finally:
            self.row_source = prev

    # ---- the head ------------------------------------------------------------------------
    def steer_rows(self, hidden: torch.Tensor) -> torch.Tensor:
        """Steer the rows of one ``compute_logits`` call. Semantics: see reference.

        Sync-free by construction: the rows' slots (and generated-token positions) are host
        data, their coefficients are gathered from the host mirror, copied to a persistent
        device buffer from pinned staging only when they changed, and the plan is made from
        the host copy and cached under a host key (coefficient version, the step's row -> slot
        array, window positions). An unchanged step costs a key comparison and the kernels.
        """
        self.head_calls += 1
        if self.row_source.kind == "captured":
            return self.steer_fixed(hidden, self.row_source.mapping)
        if not self.active or hidden.shape[0] == 0:
            return hidden
        n = hidden.shape[0]
        step = self._step_rows(hidden)
        if step is None:
            return hidden
        if step is _DEVICE_MAPPING:  # no host row -> slot (batch-sharded sampling)
            return self._steer_device_mapping(hidden)
        slots, positions, rows_key = step
        key = (self.version, self.bank.version, n, rows_key)
        if self.num_window_slots:
            windowed = self._windowed[:n] if slots is None else self._windowed[slots]
            if windowed.any():  # the coefficients move with the rows' positions
                key += (None if positions is None else positions.tobytes(),)
        self.stats.calls += 1
        self.stats.rows += n
        t0 = self.stats.op.start(hidden)
        if key != self._step_key:
            self._step_key = None  # never keep a stale key on error
            self._prepare_step(n, slots, positions)
            self._step_key = key
        coefs = self._coefs_dev[:n]
        out = None if self.graphs is None else self.graphs.run(hidden, self._coefs_dev)
        if out is not None:  # replayed from the row bucket's CUDA graph
            pass
        elif self._plan is None:
            out = self._fn(hidden, self.bank.p1, self.bank.p2, self.bank.rank_offsets, coefs)
        else:
            out = self._fn(hidden, self.bank.p1, self.bank.p2, self.bank.rank_offsets, coefs,
                           prepared=self._plan)
        self.stats.op.stop(t0)
        return out

    def _step_rows(self, hidden: torch.Tensor):
        """``(slots, positions, key)`` of the rows of this call, all host-side: ``slots`` None
        means row i = slot i; ``positions`` the generated-token index of each row (-1: not a
        generated token) or None. None: the rows are left unsteered."""
        src = self.row_source
        n = hidden.shape[0]
        if src.kind == "none":
            return None
        if src.kind in ("mapping", "slots"):
            if src.slots is None:
                if src.kind == "mapping" and src.mapping is not None:
                    return _DEVICE_MAPPING
                _warn_once("vllm-steer: logits rows came before their row mapping was known; "
                           "they are computed unsteered")
                return None
            if len(src.slots) < n:
                _warn_once("vllm-steer: logits rows outnumber their known slots; they are "
                           "computed unsteered")
                return None
            slots = np.asarray(src.slots[:n], dtype=np.int64)
            pos = None if src.positions is None else np.asarray(src.positions[:n], np.int64)
            return slots, pos, slots.tobytes()
        if src.kind == "prompt":
            base = src.base
            assert base is not None and src.query_start_loc is not None
            row_bytes = base.stride(0) * base.element_size()
            offset = (hidden.data_ptr() - base.data_ptr()) // row_bytes
            if hidden.untyped_storage().data_ptr() != base.untyped_storage().data_ptr() \
                    or not 0 <= offset < base.shape[0]:
                _warn_once("vllm-steer: prompt-logprob rows could not be matched to a request; "
                           "they are computed unsteered")
                return None
            slot = int(np.searchsorted(src.query_start_loc, offset, side="right") - 1)
            # prompt rows are no generated tokens: a window gives them its base strength
            return np.full(n, slot, dtype=np.int64), np.full(n, -1, dtype=np.int64), ("p", slot)
        # "batch": V1 samples one row per request, in persistent-batch order
        if n != self.batch_size:
            _warn_once(f"vllm-steer: compute_logits got {n} rows for a batch of "
                       f"{self.batch_size} requests; rows left unsteered")
            return None
        pos = self.batch_positions
        return None, (None if pos is None or len(pos) < n else pos[:n]), "b"

    def _row_coefs(self, n: int, slots: np.ndarray | None,
                   positions: np.ndarray | None) -> np.ndarray:
        """The rows' coefficients ``[n, columns]`` on the host: the slots' rows of the host
        mirror; a slot with generation windows gets each steer's strength at the row's
        generated token (``window_strengths``, vectorised over the windowed rows only), then
        ``steer_coefficients``' rule: the domain component applies wherever the steer's
        strength is non-zero. Semantics: see reference."""
        coefs = self._host[:n].copy() if slots is None else self._host[slots]
        if not self.num_window_slots:
            return coefs
        windowed = self._windowed[:n] if slots is None else self._windowed[slots]
        rows = np.flatnonzero(windowed)
        if rows.size == 0:
            return coefs
        from vllm_steer.reference import window_strengths

        ws = rows if slots is None else slots[rows]
        if positions is None:
            _warn_once("vllm-steer: a windowed request's generated-token positions are unknown "
                       "in this step; its rows get the windows' base strength")
            t = np.full(rows.size, -1, dtype=np.int64)
        else:
            t = positions[rows]
        w = self._win
        s = window_strengths(w["strength"][ws], w["base"][ws], w["start"][ws], w["end"][ws],
                             w["ramp"][ws], t[:, None])  # [rows, capacity]
        cap = self.capacity
        coefs[rows, :cap] = s * w["eps"][ws]
        coefs[rows, cap:] = np.where(s != 0, w["dom"][ws], 0.0)
        return coefs

    def _prepare_step(self, n: int, slots, positions) -> None:
        """A step whose key changed: gather its coefficients on the host; when they differ from
        the device buffer's, copy them (pinned, non-blocking) and re-plan what depends on them
        (the torch plan holds the values; the Triton plan only the non-zero pattern)."""
        coefs = self._row_coefs(n, slots, positions)
        last = self._step_coefs
        same = last is not None and last.shape == coefs.shape and np.array_equal(last, coefs)
        if not same:
            self._step_coefs = None
            dev = self.bank.p1.device
            if self._coefs_dev is None or self._coefs_dev.shape[0] < n \
                    or self._coefs_dev.device != dev:
                rows = max(n, 2 * (0 if self._coefs_dev is None else self._coefs_dev.shape[0]))
                self._coefs_dev = torch.zeros((rows, self.num_columns), dtype=torch.float32,
                                              device=dev)
                self._coef_copy = StagedCopy(dev)
            self._coef_copy.copy_(self._coefs_dev[:n], coefs)
            self._step_coefs = coefs
        if self._prepare is None:
            self._plan = None
            return
        sig = (coefs != 0).tobytes() if self.backend == "triton" else coefs.tobytes()
        plan_key = (self.bank.version, self.backend, n, sig)
        if plan_key != self._plan_key:
            self._plan_key, self._plan = None, None  # never keep a stale plan on error
            self._plan = self._prepare(self.bank.p1, self.bank.p2, self.bank.rank_offsets,
                                       self._coefs_dev[:n], host=coefs)
            self._plan_key = plan_key

    # ---- drafter heads inside CUDA graphs (Model Runner V2's EAGLE / EAGLE-3 / MTP) -----------
    def enable_fixed_drafter(self) -> float:
        """Keep the bank's fixed-layout copy (:meth:`SlotBank.enable_fixed`) for drafter heads
        that run inside captured CUDA graphs, at the bank's reserved rank; called while vLLM
        loads the drafter (before it sizes the KV cache). Returns the MiB allocated (0: no bank
        or already kept)."""
        bank = self.bank
        if bank is None:
            return 0.0
        shared = bank.graphs is not None  # the LM head's CUDA graphs hold the copy already
        if bank.fixed_p1 is not None and not shared:
            return 0.0
        rank = bank.reserved_rank  # the rank per steer the bank reserved at start-up
        mib = 0.0 if shared else bank.enable_fixed(rank) / 2**20
        logger.info("vllm-steer: the drafter's steers, inside CUDA graphs, use a fixed-layout "
                    "copy of the bank: %.1f MiB (rank %d per steer)%s%s",
                    bank.fixed_p1.numel() * bank.fixed_p1.element_size() / 2**19,
                    bank.fixed_rank, "; the LM head's copy, no more memory" if shared else "",
                    f"; left out (wider): {bank.fixed_left_out}" if bank.fixed_left_out else "")
        return mib

    def steer_fixed(self, hidden: torch.Tensor, mapping: torch.Tensor | None) -> torch.Tensor:
        """Steer rows whose slots are known only on the device (``mapping[i]``: row i's slot;
        -1: a padding row, left as it is) from the fixed-layout copy of the bank. Semantics:
        see reference.

        Capture-safe by construction: every tensor it reads keeps its storage and shape
        between steps (the slot table, the fixed copy, the caller's mapping buffer), its shapes
        depend only on the number of rows, and no value goes back to the host; so a CUDA
        graph that captured it computes each replay's rows with that replay's coefficients.
        Outside a capture, a worker with no steered slot skips it."""
        bank = self.bank
        n = hidden.shape[0]
        if bank is None or bank.fixed_p1 is None or mapping is None or n == 0:
            return hidden
        if mapping.shape[0] < n or self.slot_coefs is None:
            _warn_once("vllm-steer: drafter rows outnumber their known slots; they are "
                       "computed unsteered")
            return hidden
        if not self.has_steered_slots and not _capturing(hidden):
            return hidden
        self.stats.calls += 1
        self.stats.rows += n
        from vllm_steer import ops

        return ops.steer_fixed(hidden, bank.fixed_p1, bank.fixed_p2, bank.fixed_rank,
                               self.slot_coefs, mapping[:n])

    def _steer_device_mapping(self, hidden: torch.Tensor) -> torch.Tensor:
        """Rows known only through a device mapping (batch-sharded sampling): the slot table
        is gathered on the device and planned per call (the backend's own planning; the
        Triton backend's is a device launch, the torch backend's reads the device)."""
        n = hidden.shape[0]
        coefs = self.slot_coefs.index_select(0, self.row_source.mapping[:n].long())
        self.stats.calls += 1
        self.stats.rows += n
        t0 = self.stats.op.start(hidden)
        out = self._fn(hidden, self.bank.p1, self.bank.p2, self.bank.rank_offsets, coefs)
        self.stats.op.stop(t0)
        return out


_DEVICE_MAPPING = object()


def _capturing(t: torch.Tensor) -> bool:
    """Whether a CUDA graph is being captured on the current stream (on ``t``'s device)."""
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


class StagedCopy:
    """Host -> device copies from pinned staging that is never rewritten before its copy ran,
    and never waited for while the device still runs.

    A ring of pinned buffers, each with a CUDA event recorded after its copy. A copy takes a
    buffer whose event has completed (``Event.query()``: a flag read, no wait) and adds a
    buffer when every one is still in flight, so however many copies a step makes (a V2
    prompt-logprob step copies once per chunk while the forward may still be running) the host
    does not wait behind the device: the ring grows to the number of copies in flight at once
    (a handful; :attr:`grown` counts the buffers added). Past :data:`MAX_STAGING_BUFFERS` in
    flight the oldest copy is waited for (logged once): a device that far behind the host is
    not a state the runner reaches (it reads each step's sampled tokens). This is vLLM's
    ``CpuGpuBuffer`` pattern (the V1 runner's ``prepare_inputs_event``) without its wait. On
    CPU the copy is a plain one (no pinning)."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self._free: list = []  # pinned buffers whose copy has run
        self._flight: list = []  # (buffer, event) of copies not known to have run, oldest first
        self._events: list = []  # spare events
        self.grown = 0  # pinned buffers allocated
        self.waits = 0  # copies waited for (ring full)

    def copy_(self, dst: torch.Tensor, src: np.ndarray) -> torch.Tensor:
        """``dst.copy_(src)`` (``dst`` a contiguous device tensor of ``src``'s shape)."""
        if not self.cuda:
            return dst.copy_(torch.from_numpy(src))
        buf = self._take(src.nbytes)
        staged = buf[:src.nbytes].view(dst.dtype).view(dst.shape)
        staged.numpy()[...] = src
        dst.copy_(staged, non_blocking=True)
        event = self._events.pop() if self._events else torch.cuda.Event()
        event.record()
        self._flight.append((buf, event))
        return dst

    def _take(self, nbytes: int) -> torch.Tensor:
        """A pinned buffer of at least ``nbytes`` that no pending copy reads (no wait unless
        :data:`MAX_STAGING_BUFFERS` copies are in flight)."""
        while self._flight and self._flight[0][1].query():  # copies that ran, in order
            buf, event = self._flight.pop(0)
            self._free.append(buf)
            self._events.append(event)
        if not self._free and len(self._flight) >= MAX_STAGING_BUFFERS:
            _warn_once(f"vllm-steer: {len(self._flight)} coefficient copies in flight (the "
                       f"staging limit, {MAX_STAGING_BUFFERS}); the host waits for the oldest")
            buf, event = self._flight.pop(0)
            event.synchronize()
            self.waits += 1
            self._free.append(buf)
            self._events.append(event)
        buf = self._free.pop() if self._free else None
        if buf is None or buf.numel() < nbytes:
            buf = torch.empty(max(nbytes, 1024), dtype=torch.uint8, pin_memory=True)
            self.grown += 1
        return buf


#: The most coefficient copies one :class:`StagedCopy` keeps in flight before it waits.
MAX_STAGING_BUFFERS = 64


_WARNED: set[str] = set()


def _warn_once(msg: str) -> None:
    if msg not in _WARNED:
        _WARNED.add(msg)
        logger.warning(msg)


def _same_model(a: str, b: str) -> bool:
    norm = lambda s: s.rstrip("/").split("/")[-1].lower().replace("_", "-")  # noqa: E731
    return norm(a) == norm(b) or a in b or b in a


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
        total.calls += rt.stats.calls
        total.rows += rt.stats.rows
    return total.as_dict()


def get_runtime(additional_config: dict | None) -> SteerRuntime | None:
    """The process's runtime for this engine's configuration (None: no steers configured)."""
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


__all__ = ["SteerRuntime", "RowSource", "SteerStats", "get_runtime", "steer_stats"]
