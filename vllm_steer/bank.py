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
    ``capacity + j`` its domain component, so the per-request coefficient table of the serving
    runtime (``[max_num_seqs, 2 * capacity]``) is allocated once and a request's row never moves
    when other steers are loaded or unloaded.

    The factors have a fixed layout too, and the bank is never moved or copied: ``p1`` and
    ``p2`` are ``[hidden, 2 * capacity * rank]``, coefficient column ``k`` multiplying columns
    ``[k * rank, (k + 1) * rank)`` (a narrower steer padded with zeros, an empty slot all zeros;
    ``rank_offsets`` is ``[0, rank, 2 * rank, ...]``). :meth:`put` / :meth:`drop` rewrite one
    slot's columns in place and bump :attr:`version` (which invalidates the cached plan); the
    tensors keep their storage, shape and every slot's columns, so a CUDA graph that recorded
    an op reading them (:func:`vllm_steer.ops.steer_fixed`: the LM head's graphs and the
    drafters' inside vLLM's) reads the current steers at every replay.

    Memory: with ``reserve_rank`` the storage is allocated once, at construction, for
    ``capacity`` steers (and domain components) of rank up to ``reserve_rank``
    (:func:`slot_bank_bytes`): a run-time load allocates no device memory, so what vLLM measured
    at start-up (before it sized the KV cache) stays true. A steer larger than the reservation
    is refused when ``max_rank`` is ``reserve_rank`` (``--max-steer-rank``; what serving does),
    otherwise the storage grows to its rank (a device allocation, logged; the graphs reading the
    bank are told and record again). The steers themselves are kept on the host.
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
        # the LM head's CUDA graphs over the bank (kernels.graphs.head_graphs), told when the
        # storage grows (the only time it moves)
        self.graphs = None
        # the worker's vector bank (integrations.worker.step_mapping.LayerVectors: put(slot,
        # steer), drop(slot)) where the decoder layers have the op; None: no such op
        self.layers = None
        # False: a pipeline stage without the LM head keeps its slots' steers (for the
        # requests' coefficients) but no factors (no head's op reads them)
        self.keeps_factors = True
        self.reserved_rank = reserve_rank or 0  # rank per steer reserved (2 * capacity of them)
        self.rank = 0  # columns per coefficient column (the layout's rank)
        # [columns] int32 on the device: each column's steer rank (0: empty), rewritten in
        # place: the grouped op reads only these columns of a narrower steer
        self.widths = torch.zeros(self.num_columns, dtype=torch.int32, device=device)
        self._allocate(int(reserve_rank or 0))

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
        return 2 * self.p1.numel() * self.p1.element_size()

    def _allocate(self, rank: int) -> None:
        """Storage for ``rank`` columns per coefficient column, the current steers copied."""
        d, cols = self.hidden_size, self.num_columns
        old = (self.p1, self.p2, self.rank) if self.rank else None
        self.p1 = torch.zeros(d, cols * rank, device=self.device, dtype=self.dtype)
        self.p2 = torch.zeros_like(self.p1)
        if old is not None:
            for new, prev in zip((self.p1, self.p2), old[:2], strict=True):
                new.view(d, cols, rank)[:, :, :old[2]].copy_(prev.view(d, cols, old[2]))
        self.rank = rank
        self.rank_offsets: list[int] = [k * rank for k in range(cols + 1)]
        if self.graphs is not None:
            self.graphs.use_bank(self.p1, self.p2, rank)  # recorded again at their next use

    def put(self, bank_slot: int, load_id: int, name: str, steer: Steer) -> None:
        """Load ``steer`` into ``bank_slot`` (which no running request may use) under
        ``load_id`` (the engine core's, unique per load). A steer of a kind applied inside the
        decoder layers (:mod:`vllm_steer.kinds`) takes no factor columns: its slot's columns
        are zeros (the head's op reads nothing there) and its vectors go to :attr:`layers`
        (the worker's vector bank), which must exist. Whatever the slot held before is
        replaced whole: a steer of another kind leaves nothing of its own behind (the slot is
        reused when a name is loaded again into its own slot, on an eviction, and once a
        draining steer's last request finishes)."""
        from vllm_steer.kinds import AT_DECODER_LAYERS, kind_of

        if kind_of(steer).applied_at == AT_DECODER_LAYERS:
            self._put_layer_steer(bank_slot, load_id, name, steer)
            return
        if not self.keeps_factors:  # no head here: the steer is known, its factors are not kept
            self._drop_layer_vectors(bank_slot)
            self.steers[bank_slot] = steer.to(device="cpu")
            self.load_ids[bank_slot] = load_id
            self.names[bank_slot] = name
            self._changed()
            return
        if steer.hidden_size != self.hidden_size:
            raise ValueError(f"steer {name!r} has hidden size {steer.hidden_size}; the model "
                             f"has {self.hidden_size}")
        for what, p in (("rank", steer.p1), ("domain rank", steer.domain_p1)):
            if p is not None and self.max_rank is not None and p.shape[1] > self.max_rank:
                raise ValueError(f"steer {name!r} has {what} {p.shape[1]} over "
                                 f"--max-steer-rank={self.max_rank}; raise --max-steer-rank "
                                 f"(the bank is reserved for it at start-up)")
        self._drop_layer_vectors(bank_slot)  # checked first: a refused steer changes nothing
        host = steer.to(device="cpu", dtype=self.dtype)
        served = host.metadata.domain == "with_steer" and host.domain_p1 is not None
        width = max(host.p1.shape[1], host.domain_p1.shape[1] if served else 0)
        if width > self.rank:
            if self.rank:
                logger.warning(
                    "vllm-steer: the steer bank grows from rank %d to %d per steer on %s: a "
                    "device allocation outside the memory vLLM measured at start-up; set "
                    "--max-steer-rank to reserve the worst case at start-up",
                    self.rank, width, self.device)
            self._allocate(width)
        self.steers[bank_slot] = host
        self.load_ids[bank_slot] = load_id
        self.names[bank_slot] = name
        self._write(bank_slot, host.p1, host.p2)
        self._write(self.capacity + bank_slot, *((host.domain_p1, host.domain_p2) if served
                                                 else (None, None)))
        self._changed()

    def _put_layer_steer(self, bank_slot: int, load_id: int, name: str, steer) -> None:
        if self.layers is None:
            raise ValueError(f"steer {name!r} is a {steer.metadata.kind} steer, applied in the "
                             "model's decoder layers, but this server has no op there: start "
                             "it with --steer-vectors (or a vector steer among its --steer "
                             "files)")
        self.layers.put(bank_slot, steer)
        self.steers[bank_slot] = steer
        self.load_ids[bank_slot] = load_id
        self.names[bank_slot] = name
        self._write(bank_slot, None, None)
        self._write(self.capacity + bank_slot, None, None)
        self._changed()

    def layer_slots(self) -> list[int]:
        """The bank slots holding a steer applied in the decoder layers."""
        from vllm_steer.kinds import applied_in_layers

        return [j for j, st in enumerate(self.steers) if st is not None and applied_in_layers(st)]

    def _drop_layer_vectors(self, bank_slot: int) -> None:
        """Zero ``bank_slot``'s vectors in the decoder layers' bank when it holds a steer
        applied there (the layers would otherwise go on adding them)."""
        if self.layers is not None and self.steers[bank_slot] is not None:
            from vllm_steer.kinds import applied_in_layers

            if applied_in_layers(self.steers[bank_slot]):
                self.layers.drop(bank_slot)

    def drop(self, bank_slot: int) -> None:
        """Empty ``bank_slot``."""
        self._drop_layer_vectors(bank_slot)
        self.steers[bank_slot] = None
        self.load_ids[bank_slot] = 0
        self.names[bank_slot] = None
        self._write(bank_slot, None, None)
        self._write(self.capacity + bank_slot, None, None)
        self._changed()

    def _write(self, column: int, a: torch.Tensor | None, b: torch.Tensor | None) -> None:
        """Coefficient column ``column``'s factors, in place (zeros past their rank, or for
        none): one host-to-device copy per factor."""
        r = self.rank
        self.widths[column] = 0 if a is None else a.shape[1]
        if not r:
            return
        for dst, src in ((self.p1, a), (self.p2, b)):
            block = torch.zeros(self.hidden_size, r, dtype=dst.dtype)
            if src is not None:
                block[:, :src.shape[1]] = src
            dst[:, column * r:(column + 1) * r].copy_(block)

    def _changed(self) -> None:
        self.version += 1
        self._plan_key, self._plan = None, None

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
            served = meta.domain == "with_steer" \
                and getattr(self.steers[slot], "domain_p1", None) is not None
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
