"""A bank of loaded steers on one device: the factors of all steers concatenated along the
rank axis, as :mod:`vllm_steer.reference` defines, plus the mapping from a request's
``{name: strength}`` to a row of coefficients.

Semantics: see :mod:`vllm_steer.reference`.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import torch

from vllm_steer.format import Steer
from vllm_steer.logs import get_logger
from vllm_steer.ops import apply_steers, prepare_steers
from vllm_steer.reference import steer_coefficients

logger = get_logger()


class SteerBank:
    """K loaded steers (a steer whose domain component is served counts as two columns)."""

    def __init__(self, steers: Mapping[str, Steer], device=None, dtype=None):
        self.names: list[str] = list(steers)
        self.steers = {n: s.to(device=device, dtype=dtype) for n, s in steers.items()}
        hidden = {s.hidden_size for s in self.steers.values()}
        if len(hidden) > 1:
            raise ValueError(f"steers have different hidden sizes: "
                             f"{ {n: s.hidden_size for n, s in self.steers.items()} }")
        self.hidden_size = hidden.pop() if hidden else 0
        p1s, p2s, offs = [], [], [0]
        # column k of the coefficient matrix -> (steer index, multiplier kind)
        self._columns: list[tuple[str, str]] = []
        for n in self.names:
            s = self.steers[n]
            p1s.append(s.p1), p2s.append(s.p2), offs.append(offs[-1] + s.p1.shape[1])
            self._columns.append((n, "steer"))
            if s.metadata.domain == "with_steer" and s.domain_p1 is not None:
                p1s.append(s.domain_p1), p2s.append(s.domain_p2)
                offs.append(offs[-1] + s.domain_p1.shape[1])
                self._columns.append((n, "domain"))
        if p1s:
            self.p1 = torch.cat(p1s, dim=1).contiguous()  # [hidden, total_rank]
            self.p2 = torch.cat(p2s, dim=1).contiguous()  # [hidden, total_rank]
        else:
            self.p1 = self.p2 = torch.zeros(0, 0, device=device, dtype=dtype)
        self.rank_offsets: list[int] = offs
        self.index = {n: i for i, n in enumerate(self.names)}
        self._plan_key: object = None
        self._plan = None

    @property
    def num_columns(self) -> int:
        return len(self._columns)

    def coef_row(self, strengths: Mapping[str, float]) -> list[float]:
        """Coefficients (strength * epsilon, domain included) for one request."""
        row = [0.0] * self.num_columns
        for k, (n, kind) in enumerate(self._columns):
            meta = self.steers[n].metadata
            steer, domain = steer_coefficients(float(strengths.get(n, 0.0)), meta.epsilon,
                                               meta.domain_strength)
            row[k] = steer if kind == "steer" else domain
        return row

    def coefs(self, strengths: Mapping[str, float], num_rows: int, device=None) -> torch.Tensor:
        row = torch.tensor(self.coef_row(strengths), dtype=torch.float32, device=device)
        return row.expand(num_rows, -1).contiguous()

    def apply(self, hidden: torch.Tensor, coefs: torch.Tensor, backend: str | None = None,
              plan_key: object = None) -> torch.Tensor:
        """Steer ``hidden`` ([rows, hidden]) with per-row ``coefs`` ([rows, K]).

        ``plan_key``: a value that changes whenever ``coefs`` may have changed (the serving
        runtime passes its coefficient version and the row count). Calls with the key of the
        previous call reuse its plan (no re-planning: see :func:`vllm_steer.ops.prepare_steers`).
        """
        if self.num_columns == 0:
            return hidden
        prepared = None
        if plan_key is not None:
            key = (plan_key, backend)
            if key != self._plan_key:
                self._plan_key, self._plan = None, None  # never keep a stale plan on error
                self._plan = prepare_steers(self.p1, self.p2, self.rank_offsets, coefs, backend)
                self._plan_key = key
            prepared = self._plan
        return apply_steers(hidden, self.p1, self.p2, self.rank_offsets, coefs, backend=backend,
                            prepared=prepared)


def coefficient_columns(capacity: int) -> int:
    """Coefficient columns of a bank of ``capacity`` bank slots: two per bank slot, its steer
    (column ``j``) and its domain component (column ``capacity + j``); see :class:`SlotBank`."""
    return 2 * capacity


def slot_bank_bytes(capacity: int, max_rank: int, hidden_size: int, dtype) -> int:
    """Device bytes of a :class:`SlotBank` reserved for ``capacity`` steers of rank up to
    ``max_rank``: two factors (``p1``, ``p2``), each ``[hidden, total rank]``, whose total
    rank is at most ``2 * capacity * max_rank`` (every slot's steer and its domain
    component)."""
    from vllm_steer.sizing import bank_bytes

    return bank_bytes(capacity, max_rank, hidden_size, dtype)


class SlotBank:
    """A bank of ``capacity`` steer *slots* whose steers come and go at run time.

    The coefficient layout is fixed up front: column ``j`` is slot ``j``'s steer and column
    ``capacity + j`` its domain component (zero width when absent), so the per-request
    coefficient table of the serving runtime (``[max_num_seqs, 2 * capacity]``) is allocated
    once and a request's row never moves when other steers are loaded or unloaded.
    :meth:`put` / :meth:`drop` change one slot; the concatenated factors are repacked and
    :attr:`version` bumps, which invalidates the cached plan.

    Memory: with ``reserve_rank`` the factors' device storage is allocated once, at
    construction, for ``capacity`` steers (and domain components) of rank up to
    ``reserve_rank`` (:func:`slot_bank_bytes`), and every later put or drop rewrites it in
    place: a run-time load allocates no device memory, so what vLLM measured at start-up
    (before it sized the KV cache) stays true. A steer larger than the reservation is refused
    when ``max_rank`` is ``reserve_rank`` (``--max-steer-rank``), otherwise the storage grows
    (a device allocation, logged). The steers themselves are kept on the host.
    """

    def __init__(self, capacity: int, hidden_size: int, device=None, dtype=None,
                 max_rank: int | None = None, reserve_rank: int | None = None):
        self.capacity = capacity
        self.hidden_size = hidden_size
        self.device, self.dtype = device, dtype
        self.max_rank = max_rank
        self.steers: list[Steer | None] = [None] * capacity
        # per bank slot, the load id the engine core issued for the steer it holds (0: empty);
        # a request bound to another load of that bank slot is never served this steer
        self.load_ids: list[int] = [0] * capacity
        self.names: list[str | None] = [None] * capacity
        self.version = 0
        self._plan_key: object = None
        self._plan = None
        self._store1 = self._store2 = None  # flat device storage of p1 and p2
        # the fixed-layout copy for CUDA-graph-captured drafter heads (enable_fixed): segment
        # k (column k's steer or domain component) at columns [k * fixed_rank, ...), zeros
        # elsewhere, rewritten in place at every put / drop
        self.fixed_rank = 0
        self.fixed_p1: torch.Tensor | None = None  # [hidden, 2 * capacity * fixed_rank]
        self.fixed_p2: torch.Tensor | None = None
        self.fixed_left_out: list[str] = []  # steers wider than fixed_rank (not in the copy)
        # the LM head's CUDA graphs over the fixed copy (kernels.graphs.head_graphs), told of
        # every change of the bank's layout and of the copy
        self.graphs = None
        self.reserved_rank = reserve_rank or 0  # rank per steer reserved (2 * capacity of them)
        if reserve_rank:
            self._allocate(coefficient_columns(capacity) * reserve_rank)
        self._rebuild()

    @property
    def num_columns(self) -> int:
        return coefficient_columns(self.capacity)

    @property
    def factors(self) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """``(p1, p2, rank_offsets)``: the bank as every steer op takes it."""
        return self.p1, self.p2, self.rank_offsets

    @property
    def reserved_bytes(self) -> int:
        """Device bytes of the factors' storage (both factors)."""
        return 0 if self._store1 is None else 2 * self._store1.numel() * self._store1.element_size()

    def _allocate(self, total_rank: int) -> None:
        n = self.hidden_size * total_rank
        self._store1 = torch.zeros(n, device=self.device, dtype=self.dtype)
        self._store2 = torch.zeros(n, device=self.device, dtype=self.dtype)

    def put(self, bank_slot: int, load_id: int, name: str, steer: Steer) -> None:
        """Load ``steer`` into ``bank_slot`` (which no running request may use) under
        ``load_id`` (the engine core's, unique per load)."""
        if steer.hidden_size != self.hidden_size:
            raise ValueError(f"steer {name!r} has hidden size {steer.hidden_size}; the model "
                             f"has {self.hidden_size}")
        for what, p in (("rank", steer.p1), ("domain rank", steer.domain_p1)):
            if p is not None and self.max_rank is not None and p.shape[1] > self.max_rank:
                raise ValueError(f"steer {name!r} has {what} {p.shape[1]} over "
                                 f"--max-steer-rank={self.max_rank}; raise --max-steer-rank "
                                 f"(the bank is reserved for it at start-up)")
        self.steers[bank_slot] = steer.to(device="cpu", dtype=self.dtype)  # packed in _rebuild
        self.load_ids[bank_slot] = load_id
        self.names[bank_slot] = name
        self._rebuild()

    def drop(self, bank_slot: int) -> None:
        """Empty ``bank_slot``."""
        self.steers[bank_slot] = None
        self.load_ids[bank_slot] = 0
        self.names[bank_slot] = None
        self._rebuild()

    def _rebuild(self) -> None:
        """Pack the slots' factors on the host, then one contiguous copy per factor into the
        device storage (grown only when no reservation holds them)."""
        d = self.hidden_size
        parts1, parts2, offs = [], [], [0]
        segs = [(s.p1, s.p2) if s is not None else (None, None) for s in self.steers]
        segs += [(s.domain_p1, s.domain_p2)
                 if s is not None and s.metadata.domain == "with_steer"
                 and s.domain_p1 is not None else (None, None) for s in self.steers]
        for a, b in segs:
            if a is not None:
                parts1.append(a), parts2.append(b)
            offs.append(offs[-1] + (0 if a is None else a.shape[1]))
        total = offs[-1]
        if self._store1 is None or self._store1.numel() < d * total:
            if self._store1 is not None:
                logger.warning(
                    "vllm-steer: the steer bank grows from total rank %d to %d on %s: a device "
                    "allocation outside the memory vLLM measured at start-up; set "
                    "--max-steer-rank to reserve the worst case at start-up",
                    self._store1.numel() // max(d, 1), total, self.device)
            self._allocate(total)
        self.p1 = self._store1[:d * total].view(d, total)
        self.p2 = self._store2[:d * total].view(d, total)
        if parts1:
            self.p1.copy_(torch.cat(parts1, dim=1))
            self.p2.copy_(torch.cat(parts2, dim=1))
        layout_changed = offs != getattr(self, "rank_offsets", None)
        self.rank_offsets = offs
        self.version += 1
        self._plan_key, self._plan = None, None
        if self.fixed_p1 is not None:
            self._fill_fixed(segs)
        if self.graphs is not None and layout_changed:
            self.graphs.invalidate()  # captured again at their next use

    def enable_fixed(self, rank: int) -> int:
        """Keep, from now on, a copy of the factors whose layout never changes: segment ``k``
        (the factors that coefficient column ``k`` multiplies) at columns ``[k * rank, k *
        rank + width)`` of ``fixed_p1`` / ``fixed_p2`` (``[hidden, 2 * capacity * rank]``),
        zeros elsewhere. Its storage, shape and the column of every segment stay the same
        across puts and drops (rewritten in place), so a CUDA graph that captured a steer op
        reading it reads the current steers at every replay
        (:func:`vllm_steer.ops.steer_fixed`: drafter heads inside vLLM's graphs, and the LM
        head's own graphs, :func:`vllm_steer.kernels.graphs.head_graphs`, which share this
        one copy). A steer wider than ``rank`` is left out of the copy (``fixed_left_out``).
        Returns the bytes allocated."""
        rank = max(int(rank), 1)
        cols = self.num_columns * rank
        self.fixed_rank = rank
        self.fixed_p1 = torch.zeros(self.hidden_size, cols, device=self.device, dtype=self.dtype)
        self.fixed_p2 = torch.zeros_like(self.fixed_p1)
        if self.graphs is not None:  # a new copy: the graphs read it from now on
            self.graphs.use_copy(self.fixed_p1, self.fixed_p2, rank)
        self._rebuild()
        return 2 * self.fixed_p1.numel() * self.fixed_p1.element_size()

    def _fill_fixed(self, segs) -> None:
        r, left = self.fixed_rank, []
        host1 = torch.zeros(self.fixed_p1.shape, dtype=self.dtype)
        host2 = torch.zeros(self.fixed_p2.shape, dtype=self.dtype)
        for k, (a, b) in enumerate(segs):
            if a is None:
                continue
            if a.shape[1] > r:
                left.append(self.names[k % self.capacity] or f"slot {k % self.capacity}")
                continue
            host1[:, k * r:k * r + a.shape[1]] = a
            host2[:, k * r:k * r + b.shape[1]] = b
        self.fixed_p1.copy_(host1)
        self.fixed_p2.copy_(host2)
        self.fixed_left_out = sorted(set(left))
        if self.graphs is not None:
            self.graphs.left_out(self.fixed_left_out, self.fixed_rank)

    def coef_row(self, bound: Mapping[str, Sequence[int]], strengths: Mapping[str, float]
                 ) -> tuple[list[float], list[str]]:
        """Coefficients for a request bound to ``{name: (bank_slot, load_id)}``.

        Returns the row and the problems (a bank slot that no longer holds that load: the
        steer is left out, never replaced by another file's).
        """
        row = [0.0] * self.num_columns
        problems = []
        for name, s in strengths.items():
            if not s:
                continue
            slot, load_id = bound.get(name, (None, None))
            known = slot is not None and 0 <= slot < self.capacity
            if not known or self.load_ids[slot] != load_id or self.steers[slot] is None:
                problems.append(f"steer {name!r} load {load_id} is not in bank slot {slot} "
                                f"(it holds load {self.load_ids[slot] if known else None})")
                continue
            meta = self.steers[slot].metadata
            served = meta.domain == "with_steer" and self.steers[slot].domain_p1 is not None
            row[slot], row[self.capacity + slot] = steer_coefficients(
                float(s), meta.epsilon, meta.domain_strength if served else None)
        return row, problems

    def apply(self, hidden: torch.Tensor, coefs: torch.Tensor, backend: str | None = None,
              plan_key: object = None) -> torch.Tensor:
        """Like :meth:`SteerBank.apply`; the plan is also keyed by the bank's version."""
        prepared = None
        if plan_key is not None:
            key = (plan_key, backend, self.version)
            if key != self._plan_key:
                self._plan_key, self._plan = None, None
                self._plan = prepare_steers(self.p1, self.p2, self.rank_offsets, coefs, backend)
                self._plan_key = key
            prepared = self._plan
        return apply_steers(hidden, self.p1, self.p2, self.rank_offsets, coefs, backend=backend,
                            prepared=prepared)
