"""The set of steers an engine serves, managed at run time: bank slots, load ids, capacity.

One :class:`SteerRegistry` lives in the engine-core process (the one place that sees every
request, waiting or running) and is the authority on which steers are loaded:

- **Slots.** ``--max-steers N`` fixes N steer slots up front. A steer occupies one slot; the
  per-request coefficient table of every worker has fixed columns per slot, so loading or
  unloading a steer never moves what a request in flight uses.
- **Load ids.** Every load gets a new load id (unique across names; the start-up steers'
  come with the server's configuration,
  :meth:`~vllm_steer.config.SteerServerConfig.startup_placement`). A request is *bound*
  when it reaches the engine core: each steer it names is resolved to
  ``(bank_slot, load_id)`` and written into its sampling params (:data:`BOUND_KEY`,
  :class:`~vllm_steer.request.BoundSteer`). Workers steer with exactly that bank slot and
  check that it still holds that load. Re-loading a name from another file makes a new load
  in another bank slot; requests bound before keep the old one.
- **Unloading.** The name is unbound at once (later requests are refused); the slot stays
  *draining* until no request bound to it remains, then is freed (:meth:`reap`). A request in
  flight when its steer is unloaded therefore finishes with it.
- **Eviction.** A steer loaded on first use from ``--steer-dir`` may be evicted, least
  recently used first, when a load needs a slot and it is used by no request. Steers given
  with ``--steer`` or loaded over HTTP / offline are never evicted.

Light: standard library only. The name rule and the ``--steer-dir`` path it uses are the
protocol's (:mod:`vllm_steer.integrations.protocol`), shared with the frontend.
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Collection, Iterable

from vllm_steer.integrations import vllm_access as va
from vllm_steer.integrations.protocol import (SOURCE_STARTUP, SOURCE_STEER_DIR, SOURCES,
                                              SteerNameError, check_name, dir_path, name_problem)
from vllm_steer.request import BOUND_KEY, BoundSteer

DEFAULT_MAX_STEERS = 8


class SteerCapacityError(RuntimeError):
    """No slot is free for a new steer."""


def path_inside(path: str, steer_dir: str | None) -> bool:
    if not steer_dir:
        return False
    root = os.path.realpath(steer_dir)
    return os.path.commonpath([root, os.path.realpath(path)]) == root


@dataclass
class SteerEntry:
    """One loaded steer (a row of ``GET /v1/steers``)."""

    name: str
    file: str
    load_id: int
    bank_slot: int
    hidden_size: int
    rank: int
    eps0: float
    labels: dict = field(default_factory=dict)
    recommended_strength: float | None = None
    base_model: str | None = None
    source: str = SOURCE_STARTUP
    loaded_at: float = 0.0
    requests_served: int = 0
    last_used: float = 0.0
    state: str = "loaded"  # "loaded" (bound to its name) or "draining" (unloaded, still used)
    kind: str = "lm-steer"  # the steer's kind (vllm_steer.kinds): lm-steer or vector
    layers: list | None = None  # a vector steer's decoder blocks (0-based)
    stamp: tuple | None = None  # the file as it was read (file_stamp), not listed
    # a decoder-layer steer's vectors as served (vllm_steer.kinds.content_digest), not listed
    content: str | None = None

    @classmethod
    def from_metadata(cls, name, path, meta, load_id, bank_slot, source,
                      stamp: tuple | None = None, content: str | None = None) -> "SteerEntry":
        now = time.time()
        return cls(name=name, file=os.path.abspath(path), load_id=load_id, bank_slot=bank_slot,
                   hidden_size=int(meta.hidden_size), rank=int(meta.rank),
                   eps0=float(meta.epsilon), labels=dict(meta.labels or {}),
                   recommended_strength=meta.recommended_strength, base_model=meta.base_model,
                   source=source, loaded_at=now, last_used=now,
                   kind=str(getattr(meta, "kind", "lm-steer")),
                   layers=list(meta.layers) if hasattr(meta, "layers") else None,
                   stamp=stamp, content=content)

    def to_json(self) -> dict:
        d = asdict(self)
        d.pop("last_used")
        d.pop("stamp")
        d.pop("content")
        d["loaded_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.loaded_at))
        return d


def file_stamp(path: str) -> tuple | None:
    """What tells a file apart from another one later at its path: ``(device, inode, size,
    mtime_ns)`` (a file replaced or rewritten has another), None when it cannot be read. Taken
    before the file is read, so that a change during the read counts as a change."""
    try:
        s = os.stat(path)
    except OSError:
        return None
    return (s.st_dev, s.st_ino, s.st_size, s.st_mtime_ns)


class SteerRegistry:
    """Bank slots, names and load ids of the steers one engine serves (see the module doc)."""

    def __init__(self, capacity: int = DEFAULT_MAX_STEERS):
        if capacity < 1:
            raise ValueError(f"--max-steers={capacity}: must be at least 1")
        self.capacity = capacity
        self.slots: list[SteerEntry | None] = [None] * capacity
        self.bound: dict[str, int] = {}  # name -> slot
        self.next_load_id = 1
        # bank_full: first-use loads that found every slot held (the request waits: not a
        # failure); file_reads: steer files read by run-time loads
        self.counters = {"loads": 0, "unloads": 0, "evictions": 0, "failures": 0,
                         "bank_full": 0, "file_reads": 0}
        self.served: dict[str, int] = {}  # requests steered per name (kept over unloads)
        # requests refused at admission, per "STATUS:REASON" (vllm_steer.metrics.refusal_key)
        self.refused: dict[str, int] = {}

    # ---- queries ---------------------------------------------------------------------------
    def get(self, name: str) -> SteerEntry | None:
        slot = self.bound.get(name)
        return None if slot is None else self.slots[slot]

    def names(self) -> list[str]:
        return sorted(self.bound)

    def listing(self) -> list[dict]:
        return [e.to_json() for e in sorted(filter(None, self.slots), key=lambda e: e.bank_slot)]

    # ---- planning a load -------------------------------------------------------------------
    def free_slot(self, in_use: set[tuple[int, int]], evictable: bool = True,
                  replacing: str | None = None,
                  protect: Collection[str] = ()) -> tuple[int, SteerEntry | None]:
        """A slot for a new steer: an empty one, else a draining one no request uses, else
        (``evictable``) the least recently used steer-dir steer no request uses and not named
        in ``protect`` (the steers of the request being admitted), whose entry is returned to
        be evicted. ``replacing``: the name being re-loaded (its old slot is free when no
        request uses it). Raises :class:`SteerCapacityError` naming the limit. Reaps first
        (:meth:`reap`); a caller that drives workers reaps itself before, to empty the freed
        slots in them."""
        self.reap(in_use)
        for i, e in enumerate(self.slots):
            if e is None:
                return i, None
        if replacing is not None:
            old = self.get(replacing)
            if old is not None and (old.bank_slot, old.load_id) not in in_use:
                return old.bank_slot, None
        if evictable:
            cands = [e for e in self.slots if self._evictable(e, in_use, protect)]
            if cands:
                victim = min(cands, key=lambda e: e.last_used)
                return victim.bank_slot, victim
        used = sum(1 for e in self.slots if e is not None)
        draining = sum(1 for e in self.slots if e is not None and e.state == "draining")
        raise SteerCapacityError(
            f"all {self.capacity} steer slots are in use ({used - draining} loaded"
            + (f", {draining} unloaded but still used by running requests" if draining else "")
            + f"; --max-steers={self.capacity}); unload a steer (DELETE /v1/steers/NAME) or "
            "restart with a larger --max-steers")

    def room(self, in_use: set[tuple[int, int]], protect: Collection[str] = ()) -> int:
        """How many steers could be loaded now without unloading one that a request uses or
        that ``protect`` names: empty slots, draining slots no request uses, and steer-dir
        steers no request uses (evictable). Changes nothing."""
        return sum(1 for e in self.slots if e is None
                   or (e.state == "draining" and (e.bank_slot, e.load_id) not in in_use)
                   or self._evictable(e, in_use, protect))

    @staticmethod
    def _evictable(e: SteerEntry | None, in_use: set[tuple[int, int]],
                   protect: Collection[str]) -> bool:
        """Whether a first-use load may evict ``e``: a loaded steer-dir steer no request uses
        and ``protect`` does not name (:meth:`free_slot`, :meth:`room`)."""
        return (e is not None and e.state == "loaded" and e.source == SOURCE_STEER_DIR
                and (e.bank_slot, e.load_id) not in in_use and e.name not in protect)

    def never_evicted(self) -> set[str]:
        """Names of the steers no first-use load can take the slot of: given with ``--steer``
        or loaded over HTTP or offline."""
        return {e.name for e in self.slots if e is not None and e.state == "loaded"
                and e.source != SOURCE_STEER_DIR}

    def commit(self, entry: SteerEntry, evicted: SteerEntry | None = None) -> SteerEntry:
        """Put ``entry`` (slot chosen by :meth:`free_slot`) in place and bind its name."""
        if evicted is not None:
            self.counters["evictions"] += 1
            self.bound.pop(evicted.name, None)
        old = self.get(entry.name)
        if old is not None and old.bank_slot != entry.bank_slot:
            old.state = "draining"
        self.slots[entry.bank_slot] = entry
        self.bound[entry.name] = entry.bank_slot
        self.counters["loads"] += 1
        return entry

    def new_load_id(self) -> int:
        g = self.next_load_id
        self.next_load_id += 1
        return g

    # ---- unloading -------------------------------------------------------------------------
    def unload(self, name: str, in_use: set[tuple[int, int]]) -> tuple[SteerEntry, list[int]]:
        """Unbind ``name``; its slot is freed now if no request uses it, else when none does.
        Returns the entry and the slots freed now."""
        slot = self.bound.pop(name, None)
        if slot is None:
            raise KeyError(name)
        entry = self.slots[slot]
        entry.state = "draining"
        self.counters["unloads"] += 1
        return entry, self.reap(in_use)

    def reap(self, in_use: set[tuple[int, int]]) -> list[int]:
        """Free draining slots no request uses; returns the freed slots."""
        freed = []
        for i, e in enumerate(self.slots):
            if e is not None and e.state == "draining" and (e.bank_slot, e.load_id) not in in_use:
                self.slots[i] = None
                freed.append(i)
        return freed

    # ---- admission -------------------------------------------------------------------------
    def bind(self, names: Iterable[str]) -> dict[str, list[int]]:
        """``{name: [bank_slot, load_id]}`` of the loaded steers ``names`` (KeyError if one is
        not)."""
        out = {}
        now = time.time()
        for n in names:
            e = self.slots[self.bound[n]]
            out[n] = [e.bank_slot, e.load_id]
        for n in names:
            e = self.slots[self.bound[n]]
            e.requests_served += 1
            e.last_used = now
            self.served[n] = self.served.get(n, 0) + 1
        return out

    def stats(self) -> dict:
        return {"counters": dict(self.counters), "served": dict(self.served),
                "refused": dict(self.refused),
                "loaded": len(self.bound), "capacity": self.capacity,
                "draining": sum(1 for e in self.slots if e is not None and e.state == "draining")}


def bound_in(requests: Iterable[Any]) -> set[tuple[int, int]]:
    """``(bank_slot, load_id)`` pairs bound by ``requests`` (objects with ``sampling_params``)."""
    used = set()
    for r in requests:
        extra = va.extra_args(va.sampling_params(r))
        used.update((b.bank_slot, b.load_id) for b in BoundSteer.from_wire(extra.get(BOUND_KEY)))
    return used


__all__ = ["SteerRegistry", "SteerEntry", "SteerCapacityError", "SteerNameError", "BOUND_KEY",
           "SOURCES", "name_problem", "check_name", "dir_path", "path_inside", "bound_in"]
