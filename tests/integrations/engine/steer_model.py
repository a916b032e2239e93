"""What docs/serving.md says the engine's steers and presets do, as plain data: the oracle of
the steer state machine (``test_steer_state_machine.py``).

It imports nothing of the plugin: every rule below is written from the documentation
(docs/serving.md: capacity, ``--steer`` steers never evicted, least-recently-used eviction of
idle ``--steer-dir`` steers, ``--max-steers-per-request``, replace, unload and draining,
presets at run time and the presets file), so a bug in what the plugin decides or records
disagrees with it. The model never reads the plugin's state; it learns two identifiers from
the plugin's answers (the load id of each load and the bank slot that holds it) only to name
the loads it compares, and checks them (a new load id is larger than every earlier one; a
bank slot is below the capacity and held by one load at a time).

A steer "instance" is one load of a file: loaded (bound to its name) or draining (unloaded or
replaced, still used by a running request; freed when none uses it).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field

STARTUP, STEER_DIR, API = "--steer", "steer-dir", "api"

# Refusal kinds (what the plugin's message must say, see ``refusal_kind`` in the test).
PER_REQUEST, OVER_BANK, UNKNOWN, NO_ROOM, BAD_FILE, NEVER_FITS, NO_SLOT, FAULT, NAMED = (
    "per-request", "over-bank", "unknown", "no-room", "bad-file", "never-fits", "no-slot",
    "fault", "named")


@dataclass(eq=False)
class Instance:
    """One load of a steer file."""

    name: str
    source: str
    file: str
    digest: str  # sha256 of the file's bytes when it was loaded
    used_at: int  # the model's clock at its load or its last request (least recently used)
    load_id: int | None = None
    bank_slot: int | None = None
    state: str = "loaded"
    served: int = 0
    users: set = field(default_factory=set)  # ids of the running requests bound to it


@dataclass
class Outcome:
    """What an operation answers: ok, or a refusal (``status``, ``kind``). ``loads``: the
    instances it loaded (their load id and bank slot are learned from the answer). ``taken``:
    for a load that failed after a worker wrote over another load's slot, what became of
    that steer, as its error says: ``"evicted"``, ``"restored"`` (the name's previous file
    read again into its own slot) or ``"unloaded"`` (that failed too)."""

    ok: bool
    status: int = 200
    kind: str | None = None
    loads: list = field(default_factory=list)
    evicted: list = field(default_factory=list)
    taken: str | None = None


def valid_name(name: str) -> bool:
    """The documented name rule, for the names the state machine uses."""
    return bool(name) and not name.startswith(".") and "/" not in name and ".." not in name


class SteerModel:
    """The documented steer state of one engine core."""

    def __init__(self, capacity: int, per_request: int, reserved_presets=(),
                 static_presets=()):
        self.capacity = capacity
        self.per_request = per_request
        self.instances: list[Instance] = []
        self.clock = 0
        self.max_load_id = 0
        # bank_full: first uses that found every slot held (contention, not a failure);
        # file_reads: steer files read by loads (capacity is checked before the read)
        self.counters = {"loads": 0, "unloads": 0, "evictions": 0, "failures": 0,
                         "bank_full": 0, "file_reads": 0}
        self.refused: dict[int, int] = {}  # requests refused, per HTTP status
        self.served: dict[str, int] = {}
        self.reserved_presets = set(reserved_presets) | set(static_presets)
        self.static_presets = set(static_presets)
        # the --steer-preset mixes (static_presets: a mapping of name -> mix, or names only)
        self.static_mixes = {n: dict(m) for n, m in static_presets.items()} \
            if isinstance(static_presets, dict) else {}
        self.presets: dict[str, dict[str, float]] = {}  # added over HTTP
        self.file_presets: dict[str, dict[str, float]] = {}
        self.file_stamp: tuple[int, str] | None = None
        self.preset_version = 0

    # ---- queries ---------------------------------------------------------------------------
    def tick(self) -> int:
        self.clock += 1
        return self.clock

    def loaded(self, name: str) -> Instance | None:
        return next((i for i in self.instances if i.state == "loaded" and i.name == name), None)

    def names(self) -> set[str]:
        return {i.name for i in self.instances if i.state == "loaded"}

    def never_evicted(self) -> set[str]:
        """``--steer`` steers and those loaded over HTTP are never evicted."""
        return {i.name for i in self.instances if i.state == "loaded" and i.source != STEER_DIR}

    def _evictable(self, i: Instance, protect) -> bool:
        """An idle steer-dir steer that the request being admitted does not name."""
        return (i.state == "loaded" and i.source == STEER_DIR and not i.users
                and i.name not in protect)

    def room(self, protect=()) -> int:
        """Slots a first-use load could take now: free ones and idle steer-dir steers."""
        return (self.capacity - len(self.instances)
                + sum(self._evictable(i, protect) for i in self.instances))

    def reap(self) -> None:
        """A draining load no request uses is freed."""
        self.instances = [i for i in self.instances if i.state == "loaded" or i.users]

    def preset_table(self) -> dict[str, dict[str, float]]:
        return {**self.presets, **self.file_presets}

    # ---- loads -----------------------------------------------------------------------------
    def _take_slot(self, name: str, protect) -> tuple[str, Instance | None]:
        """Where a load goes: a free slot; else the slot of the name's own idle load (a
        replacement); else the least recently used idle steer-dir steer's (evicted); else
        none (``--max-steers`` is full)."""
        self.reap()
        if len(self.instances) < self.capacity:
            return "free", None
        old = self.loaded(name)
        if old is not None and not old.users:
            return "own", old
        cands = [i for i in self.instances if self._evictable(i, protect)]
        if cands:
            return "evict", min(cands, key=lambda i: (i.used_at, i.bank_slot))
        return "full", None

    def load(self, name: str, path: str, source: str, digest: str | None, protect=(),
             fault: bool = False, digest_of=None) -> Outcome:
        """Load ``path`` (its bytes' sha256 ``digest``; None: missing or not a steer file) as
        ``name``. ``fault``: a worker fails half-way through the put (or the load fails
        before the name is bound): nothing changes but the steer whose slot it was taking,
        which is unloaded (an evicted one counts as evicted); when that is the name's own
        earlier load (a replacement in its slot), its file is read again into the slot
        (``digest_of(path)``: that file's digest now, None if it is no steer file any more):
        the name serves it again, as a new load, or, if it changed on disk since that load
        (another digest, or none), is unloaded, the file not read."""
        if not valid_name(name):
            self.counters["failures"] += 1
            return Outcome(False, 400, BAD_FILE)
        if protect and len(self.never_evicted() | set(protect) | {name}) > self.capacity:
            self.counters["failures"] += 1
            return Outcome(False, 400, NEVER_FITS)
        where, taken = self._take_slot(name, protect)  # capacity before the file is read
        if where == "full":
            self.counters["bank_full" if source == STEER_DIR else "failures"] += 1
            return Outcome(False, 507, NO_SLOT)
        self.counters["file_reads"] += 1
        if digest is None:
            self.counters["failures"] += 1
            return Outcome(False, 400, BAD_FILE)
        if fault:
            self.counters["failures"] += 1
            out = Outcome(False, 500, FAULT)
            if taken is not None:
                self.instances.remove(taken)
                out.taken = "unloaded"
                if where == "evict":
                    self.counters["evictions"] += 1
                    out.taken = "evicted"
                elif digest_of is not None:  # its own: its file read again if unchanged
                    again = digest_of(taken.file)
                    if again is not None and again == taken.digest:
                        self.counters["file_reads"] += 1
                        out.taken = "restored"
                        out.loads.append(Instance(name, taken.source, taken.file, again,
                                                  self.tick()))
                        self.instances.append(out.loads[0])
            return out
        out = Outcome(True)
        if where == "evict":
            self.counters["evictions"] += 1
            self.instances.remove(taken)
            out.evicted.append(taken.name)
        old = self.loaded(name)
        if old is not None:
            if where == "own":
                self.instances.remove(old)
            else:
                old.state = "draining"
        new = Instance(name, source, path, digest, self.tick())
        self.instances.append(new)
        self.counters["loads"] += 1
        self.reap()
        out.loads.append(new)
        return out

    def learn(self, inst: Instance, load_id: int, bank_slot: int) -> None:
        """The plugin's identifiers of a new load: a load id larger than every earlier one,
        a bank slot within the capacity that no other live load holds."""
        assert load_id > self.max_load_id, (inst.name, load_id, self.max_load_id)
        assert 0 <= bank_slot < self.capacity, (inst.name, bank_slot)
        assert all(i.bank_slot != bank_slot for i in self.instances if i is not inst), (
            inst.name, bank_slot, [(i.name, i.bank_slot) for i in self.instances])
        self.max_load_id = load_id
        inst.load_id, inst.bank_slot = load_id, bank_slot

    def unload(self, name: str, dir_file: bool = False) -> Outcome:
        """DELETE /v1/steers/NAME. ``dir_file``: ``--steer-dir`` holds a file of the name (a
        request's first use would load it again). A steer a preset names (``--steer-preset``,
        the presets file, run time) that no first use could load again is kept: 409."""
        inst = self.loaded(name)
        if inst is None:
            return Outcome(False, 404, UNKNOWN)
        mixes = [*self.static_mixes.values(), *self.presets.values(),
                 *self.file_presets.values()]
        if not dir_file and any(name in mix for mix in mixes):
            return Outcome(False, 409, NAMED)
        inst.state = "draining"
        self.counters["unloads"] += 1
        self.reap()
        return Outcome(True)

    # ---- requests --------------------------------------------------------------------------
    def admit(self, rid: str, names: list[str], files: dict[str, str | None],
              fault: bool = False, zeros: Collection[str] = ()) -> Outcome:
        """Admit a request served with the steers ``names`` (distinct, in order).
        ``files``: for each name not loaded, its ``--steer-dir`` file as ``(path, digest)``
        (digest None: not a steer file), or None when there is no such file. ``fault``: the
        first first-use load fails in a worker. ``zeros``: names the request gives at
        strength 0 (applied nowhere, but each must name a steer: loaded, or a file of
        ``--steer-dir``, which is not read)."""
        out = self._admit(rid, names, files, fault, zeros)
        if not out.ok:
            self.refused[out.status] = self.refused.get(out.status, 0) + 1
        return out

    def _admit(self, rid, names, files, fault, zeros=()) -> Outcome:
        for n in zeros:
            if self.loaded(n) is None and (not valid_name(n) or files.get(n) is None):
                return Outcome(False, 400, UNKNOWN)
        if len(names) > self.per_request:
            return Outcome(False, 400, PER_REQUEST)
        if len(names) > self.capacity:
            return Outcome(False, 400, OVER_BANK)
        missing = [n for n in names if self.loaded(n) is None]
        for n in missing:
            if not valid_name(n) or files.get(n) is None:
                return Outcome(False, 400, UNKNOWN)
        self.reap()
        if len(missing) > self.room(protect=names):
            if len(self.never_evicted() | set(names)) > self.capacity:
                return Outcome(False, 400, NEVER_FITS)  # never fits: no wait helps
            self.counters["bank_full"] += 1  # fits once running requests end: retry (429)
            return Outcome(False, 429, NO_ROOM)
        loads, evicted = [], []
        for n in missing:
            path, digest = files[n]
            res = self.load(n, path, STEER_DIR, digest, protect=names, fault=fault)
            loads += res.loads
            evicted += res.evicted
            if not res.ok:
                status = {500: 500, 507: 429}.get(res.status, 400)
                return Outcome(False, status, res.kind, loads, evicted)
        now = self.tick()
        for n in names:
            inst = self.loaded(n)
            inst.used_at = now
            inst.served += 1
            inst.users.add(rid)
            self.served[n] = self.served.get(n, 0) + 1
        return Outcome(True, loads=loads, evicted=evicted)

    def finish(self, rid: str) -> None:
        for i in self.instances:
            i.users.discard(rid)
        self.reap()

    # ---- presets ---------------------------------------------------------------------------
    def preset_add(self, name: str, mix: dict, replace: bool,
                   dir_files: Collection[str] = ()) -> Outcome:
        """POST (``replace`` False: a taken name is refused) or PUT (adds or replaces a
        run-time preset in one step). A mix naming a steer that is not loaded and that no
        first use could load (``dir_files``: the names ``--steer-dir`` holds a file of) is
        refused (409: it was unloaded after the API server checked the mix). Names of the
        model, ``--steer-preset`` presets and the presets file are refused."""
        if any(n not in self.names() and n not in dir_files for n in mix):
            return Outcome(False, 409)
        if name in self.reserved_presets or name in self.file_presets or (
                name in self.presets and not replace):
            return Outcome(False, 400)
        self.presets[name] = {k: float(v) for k, v in mix.items()}
        self.preset_version += 1
        return Outcome(True)

    def preset_delete(self, name: str) -> Outcome:
        if name not in self.presets:
            if name in self.static_presets or name in self.file_presets:
                return Outcome(False, 400)
            return Outcome(False, 404)
        del self.presets[name]
        self.preset_version += 1
        return Outcome(True)

    def presets_file(self, presets: dict, stamp: tuple[int, str]) -> Outcome:
        """A version of the presets file: served as a whole; a name of the model or a
        ``--steer-preset`` refuses it; an older or the same version changes nothing; the file
        takes a name over from the run-time presets."""
        if any(n in self.reserved_presets for n in presets):
            return Outcome(False, 400)
        if self.file_stamp is not None and (stamp[0] < self.file_stamp[0]
                                            or stamp[1] == self.file_stamp[1]):
            return Outcome(True)
        for n in presets:
            self.presets.pop(n, None)
        self.file_presets = {n: {k: float(v) for k, v in m.items()} for n, m in presets.items()}
        self.file_stamp = (int(stamp[0]), str(stamp[1]))
        self.preset_version += 1
        return Outcome(True)
