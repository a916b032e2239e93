"""The steer op on the rows of each ``compute_logits`` call, planned once per step. Semantics:
see :mod:`vllm_steer.reference`.

The runner adapters write the step's views of its rows into the worker's step mapping
(:attr:`StepPlanner.step`, a :class:`~vllm_steer.integrations.worker.step_mapping.StepMapping`:
the sampled, drafter and prompt rows, and V1's persistent batch);
the target's head calls :meth:`StepPlanner.steer_rows`, a drafter's head
:meth:`StepPlanner.steer_draft_rows`.

The planner is sync-free by construction (no device tensor is read into Python): every view
gives its row -> slot on the host, and a step is planned again only when its host key
(:class:`StepKey`) changed. Like vLLM's ``LoRAMapping``, the per-step work is one mapping in
persistent device buffers, read by the LM head's CUDA graphs in place:

- the *table*: the request slots' device rows
  (:attr:`~vllm_steer.integrations.worker.request_slots.RequestSlots.device_rows`: each slot's
  coefficients, copied by the request state only for the slots that changed), then rows the
  planner fills per step with the coefficients of windowed rows (a generation window moves
  them with each row's generated token);
- the *row index* ``[rows]`` int64 (:attr:`StepPlanner.row_index`): each row's table row (its
  slot's, or its windowed row's), ``-1`` for the padding rows of a graph's bucket; written from
  pinned staging (:class:`~vllm_steer.kernels.staging.StagedCopy`) only when it changed.

A changed step thus costs the host O(rows) (the index) and the windowed rows' coefficients. The
eager op (no graphs: the CPU, ``VLLM_STEER_CUDA_GRAPHS=0``, a named backend, more rows than the
largest graph) takes dense ``[rows, columns]`` coefficients: they are gathered on the host and
copied to a device buffer of its own, and the backend's plan made from the host copy, only when
the eager op runs. Only batch-sharded sampling (V2, TP > 1), whose row order exists on the device
alone, maps tokens instead (:meth:`StepPlanner.sharded_index`: each token's table row, written
from the host, windowed rows' coefficients included) and runs the capture-safe op, which reads
the table in place through the rows' entries, picked on the device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from vllm_steer.integrations.worker.rows import (STEADY_KINDS, CapturedRows,
                                                 MappedRows, NoRows, PromptRows, RowSource,
                                                 SlotRows)
from vllm_steer.integrations.worker.step_mapping import StepMapping
from vllm_steer.kernels import batch_invariant, staging
from vllm_steer.kernels.layout import row_bucket
from vllm_steer.logs import warn_once
from vllm_steer.metrics import OpTimer
from vllm_steer.sizing import MAX_GRAPH_ROWS

#: The most device bytes the eager Triton op's plan may hold as scratch (its ``[rows, the
#: bank's columns]`` fp32 partial products); a larger step runs the grouped op
#: (:meth:`StepPlanner._eager_scratch_too_big`). 64 MiB: 512 rows at 256 steers of rank 64.
MAX_EAGER_SCRATCH_BYTES = 64 * 2**20


@dataclass
class SteerStats:
    """Counts of the worker's steer op (host-side integers, no device sync): a copy of
    the step planner's (:attr:`StepPlanner.op_calls`, :attr:`StepPlanner.op_rows`)."""

    calls: int = 0  # steer-op calls (one per ``compute_logits`` with steered rows)
    rows: int = 0  # hidden-state rows passed through the steer op

    def as_dict(self) -> dict[str, int]:
        return {"calls": self.calls, "rows": self.rows}


class StepKey(NamedTuple):
    """What a step's coefficients were gathered for: a step with an equal key has the same
    coefficients (and plan)."""

    slots_version: int
    """The request-slot table's version (:attr:`RequestSlots.version`)."""
    bank_version: int
    """The bank's version (:attr:`~vllm_steer.bank.SlotBank.version`)."""
    rows: int
    """The call's number of rows."""
    row_key: object
    """Which slot each row is: the bytes of the row -> slot array, ``"b"`` (V1's persistent
    batch: row i is slot i) or ``("p", slot)`` (one request's prompt rows)."""
    windowed: bool = False
    """Some row's slot has a generation window: its coefficients move with the rows'
    positions, and the step is never steady."""
    positions: bytes | None = None
    """With a window, the bytes of the rows' generated-token positions."""


_DEVICE_MAPPING = object()


class StepPlanner:
    """The steer op on each ``compute_logits`` call's rows, read from the worker's step
    mapping (:attr:`step`), with a plan cached per step (the graphs' row index; the eager op's
    coefficients and backend plan). Reads the worker's
    bank (``bank_state``: :class:`~vllm_steer.integrations.worker.bank_state.BankState`) and
    request slots (``slots``: :class:`~vllm_steer.integrations.worker.request_slots.
    RequestSlots`). Counts its op calls and rows, and times one op in
    :data:`~vllm_steer.metrics.TIMER_SAMPLE_EVERY` (:attr:`op_timer`): the counters and the
    countdown to the next timed op are its own plain integers, so that a steady step touches
    no other object for them (each cold object costs there)."""

    def __init__(self, bank_state, slots, step: StepMapping | None = None):
        self.bank_state = bank_state
        self.slots = slots
        self.op_calls = 0  # steer-op calls (one per compute_logits with steered rows)
        self.op_rows = 0  # hidden-state rows passed through the steer op
        self.op_timer = OpTimer()  # the op's host and device time, from the timed ops
        self.op_untimed = 0  # ops to leave untimed before the next timed one (OpTimer.stop)
        # the worker's step mapping: written by the runner adapters, read by the head
        self.step = StepMapping() if step is None else step
        self.head_calls = 0  # calls into the head (steer_rows), steered rows or not
        self.steps_planned = 0  # calls whose rows were looked up (not a steady step)
        self.plans_made = 0  # eager plans made (the backend's planning function called)
        # the per-step cache (see steer_rows): the step's key and rows; the graphs' row index;
        # the eager op's coefficients (gathered at its first launch of the step) and plan
        self._step_key: StepKey | None = None
        self._rows: tuple | None = None  # (n, slots, positions) of the planned step
        self._copy: staging.StagedCopy | None = None  # the row index and windowed rows
        self._index: torch.Tensor | None = None  # the graphs' row index (never replaced)
        self._index_host = np.empty(0, dtype=np.int64)  # what _index holds (past it: -1)
        self._index_stale = self._index_host  # _index_host while a copy may have failed
        self._table: torch.Tensor | None = None  # the graphs' table (the slots' device rows)
        self._replay = False  # the step's index is written: the head's graphs may replay it
        self._step_coefs: np.ndarray | None = None  # the eager op's host coefficients
        self._step_coefs_dev: torch.Tensor | None = None  # their n device rows (None: none)
        # the eager op's device buffer (fp32 [rows, columns]), on a staging ring of its own:
        # its rows' copies (KiB to MiB) never take the index's pinned buffers
        self._coefs = staging.StagedRows(torch.float32)
        self._plan_key: object = None
        self._plan = None
        self._plan_checked = False  # _plan checked against the step's coefficients
        # the last planned batch step, while its rows have no window (see steer_rows)
        self._steady_src: RowSource | None = None
        self._steady_key: StepKey | None = None
        # batch-sharded sampling (sharded_index): its device buffers (each token's table row;
        # the windowed steps' coefficients)
        self._shard_index = staging.StagedRows(torch.int64)
        self._shard_coefs = staging.StagedRows(torch.float32)

    @property
    def stats(self) -> SteerStats:
        """The steer op's counts so far (a copy)."""
        return SteerStats(self.op_calls, self.op_rows)

    @property
    def active(self) -> bool:
        """Whether the target's head has steer work for the step's rows."""
        bank = self.bank_state.bank
        return bank is not None and self.slots.num_active_slots > 0 \
            and type(self.step.view()) is not NoRows

    def eager_inputs(self) -> tuple[torch.Tensor, object] | None:
        """What the eager op takes for the last planned step, made now if it is not yet (a
        step replayed from the head's graphs reads the table and the row index instead): its
        rows' coefficients on the device (``[rows, columns]`` fp32) and the backend's plan of
        them (None: a backend that plans inside the call). None before the first step."""
        if self._step_key is None:
            return None
        plan = self._plan if self._plan_checked else self._eager_plan(self._rows[0])
        return self._step_coefs_dev, plan

    @property
    def coef_buffer(self) -> torch.Tensor | None:
        """The eager op's device buffer of a step's coefficients (None before the first eager
        launch)."""
        return self._coefs.buffer

    @property
    def row_index(self) -> torch.Tensor | None:
        """The head's graphs' row index (``[rows]`` int64 on the device: each row's row of
        :attr:`head_table`, -1 past the step's rows), None before the graphs are captured."""
        return self._index

    @property
    def head_table(self) -> torch.Tensor | None:
        """The table the head's graphs read (the request slots' device rows, then the rows of
        the step's windowed rows), None before the request slots are sized."""
        return self.slots.device_rows

    # ---- the head ------------------------------------------------------------------------
    def steer_draft_rows(self, hidden: torch.Tensor) -> torch.Tensor:
        """Steer the rows of one ``compute_logits`` call of a drafter's head, in the step's
        drafter view (:attr:`~vllm_steer.integrations.worker.step_mapping.StepMapping.
        drafts`)."""
        return self.steer_rows(hidden, self.step.drafts)

    def steer_rows(self, hidden: torch.Tensor, src: RowSource | None = None) -> torch.Tensor:
        """Steer the rows of one ``compute_logits`` call, whose view of the step is ``src``;
        by default the target head's (:meth:`~vllm_steer.integrations.worker.step_mapping.
        StepMapping.view`: the prompt rows while the step's prompt logprobs are computed, the
        sampled rows otherwise). Semantics: see reference.

        Sync-free by construction: the rows' slots (and generated-token positions) are host
        data; a step whose key (:class:`StepKey`) changed writes the graphs' row index (and its
        windowed rows' coefficients) from pinned staging, and the eager op's coefficients and
        plan are made from the host table at its first launch. An unchanged step costs a key
        comparison and the kernels; a *steady* step not even that: the rows of the last
        planned batch step again (V1's persistent batch; V2's batch with the same slots: the
        sampled rows its ``sample`` hook reused, or one with the same bytes of
        ``idx_mapping``), as many rows, the request-slot table and the bank at the versions its
        plan was made for. That step had no generation window among its rows (it is recorded
        only then), and the table's version says none came since. Any other step planned since
        (prompt logprobs, a drafter's rows) replaces the step's key, which ends it. The check
        is written inline (a call costs on every steered step).
        """
        self.head_calls += 1
        if src is None:  # the target's head (StepMapping.view, inlined: every steered step)
            step = self.step
            src = step.sampled if step.prompt is None else step.prompt
        n = hidden.shape[0]
        bank = self.bank_state.bank
        key = self._steady_key  # the steady step's key (None: the last step was not one)
        if key is None or key is not self._step_key or n != key.rows \
                or not (src is self._steady_src or _same_mapped_rows(src, key)) \
                or self.slots.version != key.slots_version \
                or bank is None or bank.version != key.bank_version:
            kind = type(src)
            if kind is CapturedRows:
                return self.steer_fixed(hidden, src.mapping)
            if self._nothing_to_steer(kind) or n == 0:
                return hidden
            step = self._step_rows(hidden, src)
            if step is None:
                return hidden
            if step is _DEVICE_MAPPING:  # no host row -> slot (batch-sharded sampling)
                return self._steer_device_mapping(hidden, src)
            slots, positions, row_key = step
            key = self._key(n, slots, positions, row_key)
            if key != self._step_key:
                self._step_key = None  # never keep a stale key on error
                self.plan_step(n, slots, positions)
                self._plan_checked = False
                self._step_key = key
            # a batch step with no window among its rows: the next may be steady
            steady = not key.windowed and kind in STEADY_KINDS
            self._steady_src = src if steady else None
            self._steady_key = self._step_key if steady else None
        self.op_calls += 1
        self.op_rows += n
        untimed = self.op_untimed  # one call in TIMER_SAMPLE_EVERY is timed (_timed, inlined)
        t0 = None if untimed else self.op_timer.start(hidden)
        out = bank.graphs.run(hidden, self._table, self._index) if self._replay else None
        if out is None and bank.graphs is not None and bank.graphs.failed is None \
                and batch_invariant():
            # a step the graphs do not take (more rows than their largest bucket) runs their
            # op, launched now: a row's result then does not depend on its step's row count
            # (graphs that failed: every step launches the backend's op, alike)
            if self._step_coefs_dev is None:
                self._gather(n)
            out = self._fixed_op(hidden, self._step_coefs_dev, None)
        elif out is None and self._eager_scratch_too_big(n):
            if self._step_coefs_dev is None:
                self._gather(n)
            out = self._fixed_op_chunked(hidden, self._step_coefs_dev)
        if out is None:  # launched eagerly (no graphs, or not for this step)
            plan = self._plan if self._plan_checked else self._eager_plan(n)
            if plan is None:  # a backend with no plan (it plans inside the call)
                out = self.bank_state.fn(hidden, bank.p1, bank.p2, bank.rank_offsets,
                                         self._step_coefs_dev)
            else:
                out = self.bank_state.fn(hidden, bank.p1, bank.p2, bank.rank_offsets,
                                         self._step_coefs_dev, prepared=plan)
        self.op_untimed = untimed - 1 if t0 is None else self.op_timer.stop(t0)
        return out

    def _eager_scratch_too_big(self, n: int) -> bool:
        """Whether the Triton backend's plan for ``n`` rows would hold a scratch of over
        :data:`MAX_EAGER_SCRATCH_BYTES` (``[rows, the bank's columns]`` fp32, whatever steers
        the step uses: :func:`vllm_steer.sizing.eager_scratch_bytes`), allocated after vLLM
        sized the KV cache: such a step (many rows, a prompt-logprob chunk, on a large bank)
        runs the grouped op instead (:meth:`_fixed_op_chunked`)."""
        bank_state = self.bank_state
        return bank_state.backend == "triton" \
            and 4 * n * bank_state.bank.p1.shape[1] > MAX_EAGER_SCRATCH_BYTES

    def _fixed_op_chunked(self, hidden: torch.Tensor, coefs: torch.Tensor) -> torch.Tensor:
        """Row ``i`` steered with ``coefs[i]`` by the grouped op, :data:`MAX_GRAPH_ROWS` rows
        at a time: its scratch grows with the steers a row may use, not with the bank, and is
        at most what the head's largest graph holds (counted before vLLM sized the KV
        cache). Semantics: see reference."""
        n = hidden.shape[0]
        out = torch.empty_like(hidden, memory_format=torch.contiguous_format)
        for i in range(0, n, MAX_GRAPH_ROWS):
            j = min(n, i + MAX_GRAPH_ROWS)
            self._fixed_op(hidden[i:j], coefs[i:j], None, out=out[i:j])
        return out

    def _nothing_to_steer(self, kind: type) -> bool:
        """No steered request slot, rows with no known slot, or no bank: the one check."""
        return not self.slots.num_active_slots or kind is NoRows or self.bank_state.bank is None

    def _key(self, n: int, slots, positions, row_key) -> StepKey:
        """The step's :class:`StepKey` (with its rows' positions when a row is windowed)."""
        table = self.slots
        if table.any_windowed(slice(n) if slots is None else slots):  # moved with positions
            return StepKey(table.version, self.bank_state.bank.version, n, row_key, True,
                           None if positions is None else positions.tobytes())
        return StepKey(table.version, self.bank_state.bank.version, n, row_key)

    def _timed(self, fn, hidden: torch.Tensor, *args) -> torch.Tensor:
        """``fn(hidden, *args)``, counted, and timed when its turn comes (:attr:`op_untimed`
        is 0; :meth:`~vllm_steer.metrics.OpTimer.stop` says how many ops to leave untimed
        next). The head's steer_rows inlines the same, as a call there costs."""
        self.op_calls += 1
        self.op_rows += hidden.shape[0]
        if self.op_untimed:
            self.op_untimed -= 1
            return fn(hidden, *args)
        token = self.op_timer.start(hidden)
        out = fn(hidden, *args)
        self.op_untimed = self.op_timer.stop(token)
        return out

    def _step_rows(self, hidden: torch.Tensor, src: RowSource):
        """``(slots, positions, row_key)`` of the rows of this call (in the view ``src``), all
        host-side: ``slots`` None means row i = slot i; ``positions`` the generated-token index
        of each row (-1: not a generated token) or None. None: the rows are left unsteered."""
        self.steps_planned += 1
        n = hidden.shape[0]
        kind = type(src)
        if kind is NoRows:
            return None
        if kind is MappedRows or kind is SlotRows:
            if src.slots is None:
                if kind is MappedRows and src.mapping is not None:
                    return _DEVICE_MAPPING
                warn_once("vllm-steer: logits rows came before their row mapping was known; "
                          "they are computed unsteered")
                return None
            if len(src.slots) < n:
                warn_once("vllm-steer: logits rows outnumber their known slots; they are "
                          "computed unsteered")
                return None
            pos = None if src.positions is None else src.positions[:n]
            # converted only when the step is planned (plan_step)
            slots = src.slots if len(src.slots) == n else src.slots[:n]
            key = src.key if kind is MappedRows and slots is src.slots else None
            return slots, pos, slots.tobytes() if key is None else key
        if kind is PromptRows:
            return _prompt_rows(src, hidden)
        batch_size = self.step.batch_size
        if not src.sampled:  # BatchRows: V1's drafter rows, one per request in batch order
            if n > batch_size:
                warn_once("vllm-steer: drafter rows outnumber their known slots; they are "
                          "computed unsteered")
                return None
            return None, None, "b"
        # BatchRows: V1 samples one row per request, in persistent-batch order
        if n != batch_size:
            warn_once(f"vllm-steer: compute_logits got {n} rows for a batch of "
                      f"{batch_size} requests; rows left unsteered")
            return None
        pos = self.step.batch_positions
        return None, (None if pos is None or len(pos) < n else pos[:n]), "b"

    def plan_step(self, n: int, slots, positions) -> None:
        """A step whose key changed. Replayed from the head's CUDA graphs (:meth:`_write_index`):
        its row index is written when it changed, and its windowed rows' coefficients; no
        dense coefficients are gathered. The eager op's coefficients and plan wait for its
        first launch of the step (:meth:`_eager_plan`)."""
        if slots is not None:  # copies: kept for the step, whatever the runner does to its own
            slots = np.array(slots, dtype=np.int64)
        if positions is not None:
            positions = np.array(positions, dtype=np.int64)
        table = self.slots
        self._rows = (n, slots, positions)
        self._step_coefs = self._step_coefs_dev = None
        self._replay = False
        graphs = self.bank_state.bank.graphs
        if graphs is not None and n <= graphs.max_rows and graphs.failed is None \
                and table.device_rows is not None:
            self._replay = self._write_index(n, slots, positions)

    def _write_index(self, n: int, slots: np.ndarray | None,
                     positions: np.ndarray | None) -> bool:
        """Point the graphs' row index at the step's rows: each row's slot in the table (row
        i = slot i without ``slots``), a windowed row at its coefficients, computed now and
        written after the slots' rows; ``-1`` for the rows a longer step wrote before (a graph's
        bucket reads its padding rows: no steer). Copied only when it changed: O(rows) host
        work, and the windowed rows' coefficients. False: the step is launched eagerly (more
        windowed rows than the table has rows for them)."""
        table = self.slots
        buf = self._index_buffer()
        self._table = table.device_rows
        idx = np.arange(n, dtype=np.int64) if slots is None else slots
        if table.num_window_slots:
            rows = np.flatnonzero(table.windowed[:n] if slots is None else table.windowed[slots])
            if rows.size:
                if rows.size > table.extra_rows:
                    return False
                coefs = table.head_rows(table.window_coefs(
                    idx[rows], None if positions is None else positions[rows]), in_place=True)
                first = table.max_slots
                self._copy.copy_(self._table[first:first + rows.size], coefs)
                idx = idx.copy()
                idx[rows] = first + np.arange(rows.size, dtype=np.int64)
        last = self._index_host
        if len(last) == n and np.array_equal(idx, last):
            return True  # the rows of the index as they are
        if len(last) > n:  # the longer step's rows: padding again, in the same copy
            idx = np.concatenate([idx, np.full(len(last) - n, -1, dtype=np.int64)])
        self._index_host = self._index_stale  # on error: the next step rewrites it all
        self._copy.copy_(buf[:len(idx)], idx)
        self._index_host = idx[:n]  # the planner's own array (plan_step copied the slots)
        return True

    def _index_buffer(self) -> torch.Tensor:
        """The graphs' row index (``[largest bucket]`` int64, all -1 at first), made once for
        the bank's device; the graphs read it in place, so it is never replaced."""
        bank = self.bank_state.bank
        dev = bank.p1.device
        if self._copy is None or self._copy.device != dev:
            self._copy = staging.StagedCopy(dev)
        buf = self._index
        if buf is None or buf.device != dev:
            rows = row_bucket(bank.graphs.max_rows if bank.graphs is not None else 1)
            self._index = buf = torch.full((rows,), -1, dtype=torch.int64, device=dev)
            self._index_host = np.empty(0, dtype=np.int64)
            self._index_stale = np.full(rows, -2, dtype=np.int64)  # matches no step's rows
        return buf

    def _gather(self, n: int) -> None:
        """The eager op's coefficients of the planned step: the rows' coefficients gathered
        from the host table (the vector slots' columns left out: :meth:`RequestSlots.
        head_mask`), copied to the eager buffer unless it holds them already."""
        _, slots, positions = self._rows
        table = self.slots
        coefs = table.head_rows(table.row_coefs(n, slots, positions), in_place=True)
        # made for the most rows a step samples (max_num_seqs), doubled when a step has more
        # (a prompt-logprob chunk); only the eager op reads it (the head's graphs read the
        # table and the row index)
        self._step_coefs = coefs
        self._step_coefs_dev = self._coefs.write(coefs, self.bank_state.bank.p1.device,
                                                 min_rows=self.bank_state.max_rows)

    def capture_graphs(self) -> int:
        """Capture the head's CUDA graphs now (:meth:`~vllm_steer.kernels.graphs.SteerGraphs.
        capture`) for the most rows a step samples (vLLM's max_num_seqs), the request slots'
        device rows and this planner's row index, once the model is loaded and the request
        slots are sized (whichever comes last), and after a load or unload that dropped them
        (a new layout of the bank), so that no serving step stalls on a capture. Returns the
        number captured."""
        bank_state = self.bank_state
        bank = bank_state.bank
        graphs = None if bank is None else bank.graphs
        table = self.slots.device_rows
        if graphs is None or not bank_state.max_rows or not bank_state.model_loaded \
                or table is None:
            return 0
        return graphs.capture(bank_state.max_rows, bank.hidden_size,
                              bank_state.activation_dtype or bank.dtype, table,
                              self._index_buffer())

    def _eager_plan(self, n: int):
        """The eager op's plan for this step's coefficients (None: the backend plans inside
        the call), made again only when what it depends on changed (the torch plan holds the
        values; the Triton plan only the non-zero pattern). The step's coefficients are
        gathered first when they are not yet (:meth:`_gather`)."""
        if self._step_coefs_dev is None:
            self._gather(n)
        bank_state = self.bank_state
        if bank_state.prepare is None:
            self._plan, self._plan_checked = None, True
            return None
        bank, coefs = bank_state.bank, self._step_coefs
        sig = (coefs != 0).tobytes() if bank_state.backend == "triton" else coefs.tobytes()
        plan_key = (bank.version, bank_state.backend, n, sig)
        if plan_key != self._plan_key:
            self._plan_key, self._plan = None, None  # never keep a stale plan on error
            self._plan = bank_state.prepare(bank.p1, bank.p2, bank.rank_offsets,
                                            self._step_coefs_dev, host=coefs)
            self._plan_key = plan_key
            self.plans_made += 1
        self._plan_checked = True
        return self._plan

    def _steer_device_mapping(self, hidden: torch.Tensor, src: MappedRows) -> torch.Tensor:
        """Rows known only through a device mapping (batch-sharded sampling): row ``i`` takes
        row ``src.mapping[i]`` of ``src.table`` (the request slots' device table when None,
        :meth:`sharded_index`), read in place by the capture-safe op: no plan, no value read
        back to the host, whatever the backend."""
        n = hidden.shape[0]
        bank = self.bank_state.bank
        mapping = src.mapping
        if not bank.rank:
            return hidden
        if mapping.shape[0] < n:
            warn_once("vllm-steer: logits rows outnumber their known slots; they are "
                      "computed unsteered")
            return hidden
        table = self.slots.table if src.table is None else src.table
        return self._timed(self._fixed_op, hidden, table, mapping[:n])

    def _fixed_op(self, hidden: torch.Tensor, table: torch.Tensor,
                  index: torch.Tensor | None, out: torch.Tensor | None = None) -> torch.Tensor:
        """The capture-safe op (:func:`vllm_steer.ops.steer_fixed`) on the bank in place."""
        from vllm_steer import ops

        bank = self.bank_state.bank
        return ops.steer_fixed(hidden, bank.p1, bank.p2, bank.rank, table, index, out=out,
                               max_per_row=self.bank_state.max_per_row, widths=bank.widths)

    # ---- batch-sharded sampling (V2, TP > 1): the row order exists on the device only ---------
    def sharded_index(self, token_slots: np.ndarray, tokens: np.ndarray, slots: np.ndarray,
                      positions: np.ndarray | None):
        """``(index, table)`` of a batch-sharded step, whose logits rows come in an order
        known only on the device (the sharder's token indices): ``index`` (``[tokens]`` int64
        on the device) gives each scheduled token the row of ``table`` its logits row takes,
        so that the sharder's indices pick each row's on the device, and the op reads the
        table in place (:meth:`_steer_device_mapping`).

        ``token_slots``: each token's request slot; ``tokens``: the token each sampled row (in
        batch order) is computed from; ``slots`` and ``positions``: each sampled row's slot
        and generated-token index (None: unknown), all host arrays. With no windowed slot
        among the rows, each token's entry is its slot and the table is the request slots'
        device table (None); otherwise the rows' coefficients are computed on the host as on
        the other paths (:meth:`RequestSlots.row_coefs`: a windowed row's at its generated
        token) and copied to a buffer of the planner's, which is the table, each sampled
        token's entry its row there (the other tokens': -1, never read). Both copies come from
        pinned staging into persistent buffers, and are skipped when they hold the same."""
        device = self.bank_state.bank.p1.device
        table = self.slots
        n = len(slots)
        coefs_dev = None
        if table.any_windowed(slots):
            coefs = table.head_rows(table.row_coefs(n, slots, positions), in_place=True)
            index = np.full(len(token_slots), -1, dtype=np.int64)
            index[tokens] = np.arange(n, dtype=np.int64)
            coefs_dev = self._shard_coefs.write(coefs, device)
        else:
            index = np.array(token_slots, dtype=np.int64)  # a copy: never the runner's
        return self._shard_index.write(index, device), coefs_dev

    # ---- drafter heads inside CUDA graphs (Model Runner V2's EAGLE / EAGLE-3 / MTP) -----------
    def steer_fixed(self, hidden: torch.Tensor, mapping: torch.Tensor | None) -> torch.Tensor:
        """Steer rows whose slots are known only on the device (``mapping[i]``: row i's slot;
        -1: a padding row, left as it is) from the bank, read in place. Semantics: see
        reference.

        Capture-safe by construction: every tensor it reads keeps its storage and shape
        between steps (the slot table, the bank, the caller's mapping buffer), its shapes
        depend only on the number of rows, and no value goes back to the host; so a CUDA
        graph that captured it computes each replay's rows with that replay's coefficients.
        Outside a capture, a worker with no steered slot skips it."""
        bank = self.bank_state.bank
        n = hidden.shape[0]
        if bank is None or not bank.rank or mapping is None or n == 0:
            return hidden
        table = self.slots.table
        if mapping.shape[0] < n or table is None:
            warn_once("vllm-steer: drafter rows outnumber their known slots; they are "
                      "computed unsteered")
            return hidden
        capturing = staging.capturing(hidden)
        if not self.slots.num_active_slots and not capturing:
            return hidden
        if not capturing:  # a capture is no call: its replays run without the host
            self.op_calls += 1
            self.op_rows += n
        return self._fixed_op(hidden, table, mapping[:n])


def _prompt_rows(src: PromptRows, hidden: torch.Tensor):
    """``(slots, positions, row_key)`` of prompt-logprob rows: each row's slot from its
    token's (V2) or its request's (V1), found by the call's offset in the step's hidden
    states; prompt rows are no generated tokens, so a window gives them its base strength."""
    n = hidden.shape[0]
    offset = src.row_offset(hidden)
    tokens = src.token_slots
    if offset is None or (tokens is not None and offset + n > len(tokens)):
        warn_once("vllm-steer: prompt-logprob rows could not be matched to a request; "
                  "they are computed unsteered")
        return None
    positions = np.full(n, -1, dtype=np.int64)
    if tokens is not None:  # V2: a chunk may hold rows of several requests
        slots = np.asarray(tokens[offset:offset + n], dtype=np.int64)
        return slots, positions, slots.tobytes()
    slot = int(np.searchsorted(src.query_start_loc, offset, side="right") - 1)
    return np.full(n, slot, dtype=np.int64), positions, ("p", slot)


def _same_mapped_rows(src: RowSource, key: StepKey) -> bool:
    """V2 rows with the same bytes of ``idx_mapping`` as the step of ``key``: the same rows."""
    return type(src) is MappedRows and src.key is not None and src.key == key.row_key


__all__ = ["StepPlanner", "StepKey", "SteerStats"]
