"""The request-slot table: the coefficients and generation windows of the request in each
batch slot of the runner (V1: persistent-batch index; V2: request-state slot), on the host and
mirrored on the device. Semantics: see :mod:`vllm_steer.reference`.

A *request slot* is where the runner keeps one running request; a *bank slot* is where the
steer bank keeps one loaded steer (:class:`~vllm_steer.bank.SlotBank`). Each request is decoded
once, when it enters a request slot (:func:`decode_request`): its bound form
(:class:`~vllm_steer.request.BoundSteer`, as the engine core bound it) becomes its coefficient
row and its windows, per bank slot.

Generation windows (a request's strength as a schedule over its generated tokens,
:class:`vllm_steer.request.Window`): per-slot window arrays on the host, set with the slot; each
step computes the windowed rows' coefficients from the index of the token each row samples,
vectorised (:meth:`RequestSlots.window_coefs`); requests without windows pay nothing for them.

The device mirror (:attr:`RequestSlots.table`) is what the LM head's CUDA graphs and the
drafters' capture-safe op read in place: :meth:`RequestSlots.flush` copies only the slots that
changed since the last flush (the whole table when most did), with the columns of decoder-layer
(vector) steers left at zero (:attr:`RequestSlots.layers`: those steers are applied in the
decoder blocks, never by the head). It is the first rows of :attr:`RequestSlots.device_rows`,
whose last :attr:`RequestSlots.extra_rows` rows the step planner fills with the coefficients of
the step's windowed rows.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from vllm_steer.bank import SlotBank, coefficient_columns
from vllm_steer.integrations import vllm_access as va
from vllm_steer.integrations.worker.gates import GATES
from vllm_steer.kernels import staging
from vllm_steer.logs import get_logger, warn_once
from vllm_steer.request import BOUND_KEY, BoundSteer, Window

logger = get_logger()


@dataclass(frozen=True)
class RequestCoefs:
    """A request decoded once: what its request slot is set to."""

    row: np.ndarray
    """``[2 * capacity]`` fp32: the constant coefficients (steer, then domain columns)."""
    windows: dict[int, Window] | None
    """Per bank slot, the generation window of each steer it names (a steer given as a number:
    a constant ``Window(s, base=s)``); None when it has no window (the common case)."""


def decode_request(params: Any, bank: SlotBank | None, num_columns: int) -> RequestCoefs:
    """The coefficients of a request (zeros when it asks for no steer), decoded once from the
    bound form the engine core wrote (``extra_args[BOUND_KEY]``).

    A bank slot that no longer holds the request's load id is never used (the engine core
    keeps a slot while a request bound to it runs, so this is a bug guard, logged). Never
    raises on request data."""
    extra = va.extra_args(params)
    wire = extra.get(BOUND_KEY)
    if bank is None or not wire:
        return RequestCoefs(np.zeros(num_columns, dtype=np.float32), None)
    try:
        bound = BoundSteer.from_wire(wire)
    except Exception as e:  # noqa: BLE001 - request data must not crash a worker
        logger.warning("vllm-steer: a request's bound steers %r are malformed (%s); the "
                       "request is served unsteered", wire, e)
        return RequestCoefs(np.zeros(num_columns, dtype=np.float32), None)
    row, problems = bank.coef_row({b.name: (b.bank_slot, b.load_id) for b in bound},
                                  {b.name: b.strength for b in bound})
    for p in problems:
        logger.error("vllm-steer: request steer left out: %s", p)
    windows = None
    if any(isinstance(b.value, Window) for b in bound):
        windows = {}
        for b in bound:
            j = b.bank_slot
            if not 0 <= j < bank.capacity or bank.load_ids[j] != b.load_id \
                    or bank.steers[j] is None or not b.strength:
                continue  # left out of the row too (logged above)
            windows[j] = b.value if isinstance(b.value, Window) else Window(b.value, base=b.value)
        windows = windows or None
    return RequestCoefs(np.asarray(row, dtype=np.float32), windows)


def _runs(slots: list[int], most: int) -> list[tuple[int, int]] | None:
    """The runs of neighbouring slots in ``slots`` (ascending) as ``[start, end)``; None when
    there are more than ``most``."""
    runs = []
    start = prev = slots[0]
    for s in slots[1:]:
        if s != prev + 1:
            if len(runs) + 1 >= most:
                return None
            runs.append((start, prev + 1))
            start = s
        prev = s
    runs.append((start, prev + 1))
    return runs


def _uncount(counted: list[int]) -> None:
    """A table was collected: its slots leave the process's gates."""
    GATES.steered_slots -= counted[0]
    GATES.windowed_slots -= counted[1]
    GATES.prompt_logprob_slots -= counted[2]


#: The most runs of neighbouring slots a flush copies one by one; more are scattered on the
#: device from one copy (:meth:`RequestSlots.flush`).
MAX_RUN_COPIES = 2

#: the per-slot window arrays (host, ``[max_slots, capacity]`` float64 each)
WINDOW_FIELDS = ("strength", "base", "start", "end", "ramp", "eps", "dom")


class RequestSlots:
    """Coefficients ``[max_slots, 2 * capacity]`` of the request in each request slot: the host
    table, its device mirror (:attr:`table`, the changed slots copied: :meth:`flush`), which
    slots are steered and which have generation windows."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.num_columns = coefficient_columns(capacity)
        self.device_rows: torch.Tensor | None = None
        """``[max_slots + extra_rows, K]`` fp32 on the device: :attr:`table`, then the rows the
        step planner writes per step (:attr:`extra_rows`). Allocated once (:meth:`ensure`):
        CUDA graphs read it in place."""
        self.table: torch.Tensor | None = None  # [max_slots, K]: device_rows' first rows
        self.extra_rows = 0
        """Rows of :attr:`device_rows` past the table's: the step's windowed rows'
        coefficients, written by the step planner (at most this many per step)."""
        self.host: np.ndarray | None = None  # [max_slots, K] host table
        self.steered: np.ndarray | None = None  # [max_slots] bool: slot has a non-zero row
        self.windowed: np.ndarray | None = None  # [max_slots] bool
        self.prompt_logprobs: np.ndarray | None = None
        """``[max_slots]`` bool: the slot's request asked for prompt logprobs (steered or not:
        while none did, the prompt-logprob hooks have nothing to map)."""
        self.num_prompt_slots = 0
        self.windows: dict[str, np.ndarray] | None = None  # WINDOW_FIELDS, None until used
        self.num_window_slots = 0
        self.num_active_slots = 0  # steered slots as of the last flush
        self.version = 0  # bumped whenever the coefficients may change (keys the step plan)
        self.assigned = 0
        """Requests put into slots so far (:meth:`set`), counting those that changed nothing:
        while it stays, every running request is in the slot it had (V2 gives a request its
        slot only when it adds it, and then calls the per-request state's ``add_request``)."""
        self.max_slots = 0
        self.dirty = False
        self.layers = None
        """The decoder layers' vector bank (:class:`~vllm_steer.integrations.worker.
        step_mapping.LayerVectors`; None: no decoder-layer op): the columns of its vector
        slots are zeros in the device table (:meth:`head_mask`)."""
        self._mask_version: int | None = None  # layers.version the device table was masked at
        self._head_mask: tuple = (None, None, None)  # head_mask's (layers, version, mask)
        self._changed: set[int] = set()  # slots changed since the last flush
        self._all_changed = False  # the whole table is to be copied at the next flush
        self._scratch: torch.Tensor | None = None  # device bytes of a partial flush
        self._copy: staging.StagedCopy | None = None
        # this table's share of the process's counts, given back when the table is collected
        self._counted = [0, 0, 0]  # [steered slots, windowed slots, prompt-logprob slots]
        self._last_batch: tuple = (None, -1, False)  # any_steered's (slots' bytes, version, answer)
        weakref.finalize(self, _uncount, self._counted)

    def ensure(self, max_slots: int, device: torch.device, extra_rows: int | None = None
               ) -> bool:
        """Size the table for ``max_slots`` request slots, with ``extra_rows`` rows after it
        for the step planner (default: ``max_slots``). True: it was (re)made, empty."""
        if self.host is not None and self.host.shape[0] >= max_slots:
            return False
        cols = self.num_columns
        extra = max_slots if extra_rows is None else max(0, int(extra_rows))
        self.host = np.zeros((max_slots, cols), dtype=np.float32)
        self.steered = np.zeros(max_slots, dtype=bool)
        self.device_rows = torch.zeros((max_slots + extra, cols), dtype=torch.float32,
                                       device=device)
        self.table = self.device_rows[:max_slots]
        self.extra_rows = extra
        # a partial flush copies at most half the slots: their rows, then their indices
        self._scratch = torch.empty((max_slots // 2 + 1) * (4 * cols + 8), dtype=torch.uint8,
                                    device=device)
        self._changed, self._all_changed = set(), False
        self._mask_version = None if self.layers is None else self.layers.version
        self._copy = staging.StagedCopy(torch.device(device))
        self.windowed = np.zeros(max_slots, dtype=bool)
        self.prompt_logprobs = np.zeros(max_slots, dtype=bool)
        self._count_prompts(0)
        self.windows = None
        self._count_windows(0)
        self.dirty = False
        self._count_active(0)
        self.version += 1
        self.max_slots = max_slots
        return True

    def set(self, slot: int, row: np.ndarray | None, windows: dict | None,
            bank: SlotBank | None, prompt_logprobs: bool = False) -> None:
        """(Re)initialise a slot fully: a reused slot keeps nothing of its previous request.

        ``windows`` (:attr:`RequestCoefs.windows`): the request's strength is a schedule over
        its generated tokens; each step then computes the slot's coefficients from the index of
        the token each row samples (:meth:`row_coefs`). ``row`` stays the constant row (what
        the request asks for inside its windows), which says whether the slot is steered.

        A request that asks for no steer, in a slot that holds none (not steered, no windows:
        its row is all zeros), changes nothing: the table keeps its version and needs no copy
        to the device. ``prompt_logprobs``: the request asked for prompt logprobs
        (:attr:`prompt_logprobs`)."""
        assert self.host is not None
        self.assigned += 1
        if self.prompt_logprobs[slot] != prompt_logprobs:
            self.prompt_logprobs[slot] = prompt_logprobs
            self._count_prompts(self.num_prompt_slots + (1 if prompt_logprobs else -1))
        if not windows and not self.steered[slot] and not self.windowed[slot] \
                and (row is None or not row.any()) and not self.host[slot].any():
            return  # (a host row left by a fault half-way through the last set is reset)
        self.host[slot] = 0.0 if row is None else row
        steered = bool(np.any(self.host[slot]))
        if windows:
            self._set_windows(slot, windows, bank)
            steered = steered or any(w.strength or w.base for w in windows.values())
        elif self.windowed[slot]:
            self.windowed[slot] = False
            self._count_windows(self.num_window_slots - 1)
        self.steered[slot] = steered
        self._changed.add(slot)
        self.dirty = True
        self.version += 1

    def _set_windows(self, slot: int, windows: dict, bank: SlotBank) -> None:
        if self.windows is None:
            n = self.host.shape[0]
            self.windows = {k: np.zeros((n, self.capacity), dtype=np.float64)
                            for k in WINDOW_FIELDS}
        w = self.windows
        for arr in w.values():
            arr[slot] = 0.0
        w["end"][slot] = -1.0
        for j, win in windows.items():
            meta = bank.steers[j].metadata
            served = meta.domain == "with_steer" \
                and getattr(bank.steers[j], "domain_p1", None) is not None
            w["strength"][slot, j], w["base"][slot, j] = win.strength, win.base
            w["start"][slot, j], w["ramp"][slot, j] = win.start, win.ramp
            w["end"][slot, j] = -1 if win.end is None else win.end
            w["eps"][slot, j] = meta.epsilon
            w["dom"][slot, j] = meta.domain_strength * meta.epsilon if served else 0.0
        if not self.windowed[slot]:
            self.windowed[slot] = True
            self._count_windows(self.num_window_slots + 1)

    def move(self, src: int, dst: int, swap: bool) -> None:
        """Move (or swap) a slot's request to another slot. Two slots that hold no steer (all
        zeros, no windows, no prompt logprobs) stay as they are: nothing changes."""
        assert self.host is not None
        if not (self.steered[src] or self.windowed[src] or self.steered[dst]
                or self.windowed[dst] or self.prompt_logprobs[src]
                or self.prompt_logprobs[dst]):
            return
        arrays = [self.host, self.steered, self.windowed, self.prompt_logprobs]
        if self.windows is not None:
            arrays += list(self.windows.values())
        for arr in arrays:
            if swap:
                arr[[src, dst]] = arr[[dst, src]]
            else:
                arr[dst] = arr[src]
                arr[src] = 0
        self._count_windows(int(np.count_nonzero(self.windowed)))
        self._count_prompts(int(np.count_nonzero(self.prompt_logprobs)))
        self._changed.update((src, dst))
        self.dirty = True
        self.version += 1

    def _count_active(self, n: int) -> None:
        """Set :attr:`num_active_slots`, keeping the process's count
        (:data:`~vllm_steer.integrations.worker.gates.GATES`)."""
        GATES.steered_slots += n - self.num_active_slots
        self.num_active_slots = self._counted[0] = n

    def _count_windows(self, n: int) -> None:
        """Set :attr:`num_window_slots`, keeping the process's count
        (:data:`~vllm_steer.integrations.worker.gates.GATES`)."""
        GATES.windowed_slots += n - self.num_window_slots
        self.num_window_slots = self._counted[1] = n

    def _count_prompts(self, n: int) -> None:
        """Set :attr:`num_prompt_slots`, keeping the process's count
        (:data:`~vllm_steer.integrations.worker.gates.GATES`)."""
        GATES.prompt_logprob_slots += n - self.num_prompt_slots
        self.num_prompt_slots = self._counted[2] = n

    def flush(self) -> None:
        """Copy the slots changed since the last flush to the device (once per step, only when
        changed), from pinned staging on CUDA (no sync; see :class:`StagedCopy`): a run of
        neighbouring slots in one copy (up to :data:`MAX_RUN_COPIES` runs: a request that
        leaves and one that joins are two); more scattered ones as their rows and indices in
        one copy and a device scatter (``index_copy_``); the whole table when more than half
        changed, or when the decoder layers' vector slots changed (:attr:`layers`: their
        columns are zeros on the device, :meth:`head_mask`)."""
        layers = self.layers
        stale = layers is not None and layers.version != self._mask_version
        if not (self.dirty or stale) or self.host is None:
            return
        # counted before the copies: a fault in them fails the step's steered requests, those
        # whose slots were just steered included (a fault fails none while none is counted)
        self._count_active(int(np.count_nonzero(self.steered)))
        n = self.host.shape[0]
        changed = self._changed
        if stale or self._all_changed or 2 * len(changed) > n:
            self._copy.copy_(self.table, self.head_rows(self.host))
        elif changed:
            slots = sorted(changed)
            runs = _runs(slots, MAX_RUN_COPIES)
            if runs is None:
                self._scatter(np.array(slots, dtype=np.int64))
            else:  # a copy per run of neighbouring slots
                for a, b in runs:
                    self._copy.copy_(self.table[a:b], self.head_rows(self.host[a:b]))
        self._changed.clear()
        self._all_changed = False
        self._mask_version = None if layers is None else layers.version
        self.dirty = False
        self.version += 1

    def _scatter(self, slots: np.ndarray) -> None:
        """Copy the host rows of ``slots`` (ascending, at most half the table) to the device
        table: their rows and their indices staged as one block of bytes, copied once, then
        scattered on the device."""
        k, cols = len(slots), self.num_columns
        row_bytes = 4 * cols * k  # a multiple of 8 (cols is even): the indices stay aligned
        packed = np.empty(row_bytes + 8 * k, dtype=np.uint8)
        rows = packed[:row_bytes].view(np.float32).reshape(k, cols)
        np.take(self.host, slots, axis=0, out=rows)
        self.head_rows(rows, in_place=True)
        packed[row_bytes:].view(np.int64)[:] = slots
        dev = self._copy.copy_(self._scratch[:len(packed)], packed)
        self.table.index_copy_(0, dev[row_bytes:].view(torch.int64),
                               dev[:row_bytes].view(torch.float32).view(k, cols))

    def use_layers(self, layers) -> None:
        """The decoder layers' vector bank whose slots' columns the device table leaves at
        zero (:attr:`layers`): when it is another one, or its slots changed since the last
        flush, the whole table is copied again now (a load or an unload: rare)."""
        if layers is self.layers and (layers is None or layers.version == self._mask_version):
            return
        self.layers = layers
        if self.host is not None:
            self._all_changed = True
            self.dirty = True
            self.flush()

    def head_mask(self) -> np.ndarray | None:
        """``[columns]`` fp32: 0 at the steer columns of the bank slots holding a decoder-layer
        (vector) steer, 1 elsewhere; None while no slot does. The LM head never applies those
        columns (the decoder blocks do, from the host table). Made again only when the
        layers' slots changed (their version)."""
        layers = self.layers
        if layers is None:
            return None
        cached = self._head_mask
        if cached[0] is layers and cached[1] == layers.version:
            return cached[2]
        mask = None
        if layers.slot_is_vector.any():
            mask = np.ones(self.num_columns, dtype=np.float32)
            mask[:layers.capacity] -= layers.slot_is_vector
        self._head_mask = (layers, layers.version, mask)
        return mask

    def head_rows(self, coefs: np.ndarray, in_place: bool = False) -> np.ndarray:
        """Rows of coefficients (``[rows, columns]``, host) as the LM head applies them: the
        vector slots' columns zeroed (:meth:`head_mask`): a copy, or ``coefs`` itself when
        nothing is masked or ``in_place``. The one place the head's rows are masked (the
        device table's copies, the head's windowed rows, the eager op's rows)."""
        mask = self.head_mask()
        if mask is None:
            return coefs
        if in_place:
            coefs *= mask
            return coefs
        return coefs * mask

    def any_steered(self, slots: np.ndarray, key: bytes | None = None) -> bool:
        """Whether any of these slots (a step's ``idx_mapping``) holds a steered request.
        ``key``: ``slots.tobytes()`` when the caller has it; the answer is then kept for the
        next call with the same slots and an unchanged table (a steady decode step)."""
        if not self.num_active_slots:
            return False
        if key is None:
            return bool(self.steered[slots].any())
        last = self._last_batch
        if last[0] == key and last[1] == self.version:
            return last[2]
        out = bool(self.steered[slots].any())
        self._last_batch = (key, self.version, out)
        return out

    def any_windowed(self, slots: np.ndarray | slice) -> bool:
        """Whether any of these slots (indices, or a slice of the table) holds a request with a
        generation window."""
        return bool(self.num_window_slots) and bool(self.windowed[slots].any())

    def row_coefs(self, n: int, slots: np.ndarray | None,
                  positions: np.ndarray | None) -> np.ndarray:
        """The rows' coefficients ``[n, columns]`` on the host: the slots' rows of the host
        table, a windowed slot's computed for the row's generated token
        (:meth:`window_coefs`). Semantics: see reference."""
        coefs = self.host[:n].copy() if slots is None else self.host[slots]
        if not self.num_window_slots:
            return coefs
        windowed = self.windowed[:n] if slots is None else self.windowed[slots]
        rows = np.flatnonzero(windowed)
        if rows.size == 0:
            return coefs
        coefs[rows] = self.window_coefs(rows if slots is None else slots[rows],
                                        None if positions is None else positions[rows])
        return coefs

    def window_coefs(self, slots: np.ndarray, positions: np.ndarray | None) -> np.ndarray:
        """The coefficients ``[len(slots), columns]`` of rows of windowed slots (``slots``, each
        with a generation window), each at its generated token (``positions``; None: unknown,
        the windows' base strength, warned once): each steer's strength at the row's token
        (``window_strengths``, vectorised), then ``steer_coefficients``' rule: the domain
        component applies wherever the steer's strength is non-zero. Semantics: see
        reference."""
        from vllm_steer.reference import steer_coefficient_arrays, window_strengths

        if positions is None:
            warn_once("vllm-steer: a windowed request's generated-token positions are unknown "
                      "in this step; its rows get the windows' base strength")
            t = np.full(len(slots), -1, dtype=np.int64)
        else:
            t = positions
        w = self.windows
        s = window_strengths(w["strength"][slots], w["base"][slots], w["start"][slots],
                             w["end"][slots], w["ramp"][slots], t[:, None])  # [rows, capacity]
        cap = self.capacity
        coefs = np.empty((len(slots), self.num_columns), dtype=np.float32)
        coefs[:, :cap], coefs[:, cap:] = steer_coefficient_arrays(s, w["eps"][slots],
                                                                  w["dom"][slots])
        return coefs


__all__ = ["RequestSlots", "RequestCoefs", "decode_request"]
