"""The engine core's steer state as a state machine (Hypothesis ``RuleBasedStateMachine``),
checked against an independent model of the documented rules
(:mod:`steer_model`, which imports nothing of the plugin).

The engine core's plugin code (admission: :func:`vllm_steer.integrations.engine.core.
add_request`; management: :func:`~vllm_steer.integrations.engine.core.collective_rpc`) is
driven through its two hooks, as vLLM calls them, on a hand-built engine core with a small
bank (3 slots, one pinned by ``--steer``), a ``--steer-dir`` twice as large as the bank,
``--max-steers-per-request 4``, run-time updates and presets, and two workers (tensor
parallelism: each holds its own copy of the bank, modelled from the ``put`` / ``drop`` calls
it gets). Every rule is something a user or an operator does, or a fault: requests naming 0
to 5 steers (loaded, first-use, missing and repeated names, presets as model names), requests
finishing, loads, unloads and replacements, preset adds, PUTs and deletes, presets-file
versions (new, re-sent, older, refused, and one that fails half-way), steer files replaced,
corrupted or removed on disk, and a worker that fails during a put or a drop (the first
worker has written, the second raises) or a load that fails between the workers' put and the
registry's commit.

At every step the plugin is compared with the model:

- each admission's answer: admitted, or refused with the status (400, or 500 for a fault)
  and the documented reason (per-request limit, bank size, unknown steer, no room now, a bad
  file); each management answer's status, and the steer a load evicted;
- which file each running request is served: the sha256 of the file's bytes, read from the
  disk by the test when the model loaded it, must be what every worker's bank holds in the
  bank slot and load the request is bound to, until the request finishes;
- the listing (``GET /v1/steers``): every steer's name, source, state (loaded / draining),
  file, bank slot, load id and requests served, one bank slot per load, and every worker's
  bank holding exactly those loads;
- the counters (loads, unloads, evictions, failures, refusals), requests served per name,
  the loaded and draining counts; the preset table and its version.

``make test`` runs a bounded profile (``VLLM_STEER_STATE_EXAMPLES``, default 25 programs of
up to 40 steps); a longer one: ``VLLM_STEER_STATE_EXAMPLES=2000 .venv/bin/python -m pytest
tests/integrations/engine/test_steer_state_machine.py`` (docs/dev/testing.md).
"""

from __future__ import annotations

import hashlib
import itertools
import os
import sys
import time
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")
pytest.importorskip("hypothesis")

from hypothesis import HealthCheck, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
import steer_model as M  # noqa: E402

from helpers.fakes import engine_core  # noqa: E402
from helpers.steers import random_steer  # noqa: E402
from vllm_steer.config import SteerServerConfig  # noqa: E402
from vllm_steer.format import read_metadata, save_steer  # noqa: E402
from vllm_steer.integrations.engine import core as engine_hooks  # noqa: E402
from vllm_steer.integrations.engine import registry as registry_module  # noqa: E402
from vllm_steer.integrations.engine.registry import (SteerEntry, SteerRegistry,  # noqa: E402
                                                     file_stamp)
from vllm_steer.integrations.engine.state import EngineSteerState  # noqa: E402
from vllm_steer.integrations.protocol import (BUSY_PREFIX, FAILED_PREFIX,  # noqa: E402
                                              MANAGEMENT_METHOD, REFUSED_PREFIX)
from vllm_steer.request import BOUND_KEY, BoundSteer, SteerRequest  # noqa: E402

HIDDEN = 16
CAPACITY = 3
PER_REQUEST = 4
DIR_NAMES = [f"d{i}" for i in range(6)]  # the steer dir: twice the bank
PINNED = "pin"
STATIC_PRESET = "fixed"  # a --steer-preset
EXAMPLES = int(os.environ.get("VLLM_STEER_STATE_EXAMPLES", "25"))
SOURCES = {M.STARTUP: "--steer", M.STEER_DIR: "steer-dir", M.API: "api"}


def _sha(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


class InjectedFault(RuntimeError):
    pass


class FakeWorkers:
    """Two workers (tensor parallelism), each with its copy of the bank as the engine core's
    ``put`` / ``drop`` calls leave it: ``bank_slot -> (load_id, name, sha256 of the file the
    factors came from)``. ``arm(op, worker)``: that worker raises on the next ``op``, after
    the workers before it applied it."""

    def __init__(self):
        self.banks: list[dict[int, tuple[int, str, str]]] = [{}, {}]
        self.armed: tuple[str, int] | None = None
        self.undropped: set[int] = set()  # slots a failed drop left full in worker 1

    def arm(self, op: str, worker: int):
        self.armed = (op, worker)

    def disarm(self) -> bool:
        """Disarm; whether the armed fault had fired."""
        fired, self.armed = self.armed is None, None
        return fired

    def collective_rpc(self, fn, args=()):
        op = args[0]
        answers = []
        for i, bank in enumerate(self.banks):
            if self.armed == (op, i):
                self.armed = None
                if op == "drop":
                    self.undropped.update(args[1])
                raise InjectedFault(f"fault injected in worker {i} during {op!r}")
            if op == "put":
                _, slot, load_id, name, steer = args
                bank[slot] = (load_id, name, steer.vllm_steer_digest)
            elif op == "drop":
                for slot in args[1]:
                    bank.pop(slot, None)
            answers.append({} if op == "stats" else True)
        return answers


class Clock:
    """The registry's clock: every reading later than the last (least recently used is then
    an order, as the documentation states it), and the time formatting it uses."""

    def __init__(self):
        self.now = 1_000_000.0
        self.strftime, self.gmtime = time.strftime, time.gmtime

    def time(self):
        self.now += 1.0
        return self.now


def refusal_kind(message: str) -> str:
    """The documented reason a refusal message gives (docs/serving.md's table)."""
    if message.startswith(FAILED_PREFIX):
        return M.FAULT
    message = message.removeprefix(BUSY_PREFIX)
    for kind, marks in ((M.PER_REQUEST, ("--max-steers-per-request=",)),
                        (M.OVER_BANK, ("bank holds at most",)),
                        (M.NO_ROOM, ("can take one now",)),
                        (M.NEVER_FITS, ("never evicted", "more than")),
                        (M.NO_SLOT, ("steer slots are in use",)),
                        (M.BAD_FILE, ("' refused:",)),
                        (M.UNKNOWN, ("unknown steer",)),
                        (M.NAMED, ("is named by", "no file of --steer-dir"))):
        if all(m in message for m in marks):
            return kind
    raise AssertionError(f"an undocumented refusal: {message}")


class SteerStateMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.root = None

    @initialize()
    def start(self):
        import tempfile

        self.root = os.path.realpath(tempfile.mkdtemp(prefix="steer-state-"))
        self.dir = os.path.join(self.root, "dir")
        os.mkdir(self.dir)
        self.seeds = itertools.count(100)
        self.disk: dict[str, bool] = {}  # name -> a good steer file (False: corrupt)
        for name in DIR_NAMES:
            self._write(name)
        pin = os.path.join(self.root, f"{PINNED}.safetensors")
        save_steer(pin, random_steer(HIDDEN, 2, PINNED, seed=1))
        self.cfg = SteerServerConfig(steers={PINNED: pin}, max_strength=10.0,
                                     steer_dir=self.dir, max_steers=CAPACITY,
                                     max_steers_per_request=PER_REQUEST, enable_updates=True,
                                     presets={STATIC_PRESET: {PINNED: 1.0}})
        self.clock = Clock()
        self._restore = [(registry_module, "time", registry_module.time)]
        registry_module.time = self.clock
        reg = SteerRegistry(self.cfg.capacity)
        reg.commit(SteerEntry.from_metadata(PINNED, pin, read_metadata(pin),  # as at start
                                            reg.new_load_id(), 0, "--steer", file_stamp(pin)))
        reg.counters["loads"] = 0
        self.workers = FakeWorkers()
        for bank in self.workers.banks:
            bank[0] = (1, PINNED, _sha(pin))
        self.outputs: list = []
        self.core = engine_core(
            engine_index=0, steer_state=EngineSteerState(self.cfg, reg, HIDDEN),
            scheduler=SimpleNamespace(requests={}), model_executor=self.workers,
            output_queue=SimpleNamespace(put_nowait=self.outputs.append),
            vllm_config=SimpleNamespace(model_config=SimpleNamespace(
                model="tiny", served_model_name="tiny")))
        self.reg = reg
        self.model = M.SteerModel(CAPACITY, PER_REQUEST, reserved_presets={"tiny"},
                                  static_presets={STATIC_PRESET: {PINNED: 1.0}})
        first = M.Instance(PINNED, M.STARTUP, pin, _sha(pin), self.model.tick())
        self.model.instances.append(first)
        self.model.learn(first, 1, 0)
        # request id -> {name: (load id, bank slot, sha256 of the file, strength)}
        self.running: dict[str, dict[str, tuple]] = {}
        self.ids_admitted: list[str] = []
        self.ids = itertools.count()
        self.file_version = 0
        self._patch_load()

    def _patch_load(self):
        """Each steer read from a file carries the sha256 of the bytes read (the fake
        workers keep it: which file a slot's factors came from)."""
        from vllm_steer import format as fmt

        real = fmt.load_steer

        def load(path, *a, **kw):
            steer = real(path, *a, **kw)
            steer.vllm_steer_digest = _sha(path)
            return steer

        self._restore.append((fmt, "load_steer", real))
        fmt.load_steer = load

    def teardown(self):
        if self.root is not None:
            for mod, attr, value in self._restore:
                setattr(mod, attr, value)
            import shutil

            shutil.rmtree(self.root, ignore_errors=True)

    def _write(self, name: str, corrupt: bool = False):
        """Write ``DIR/NAME.safetensors`` as an operator would: write, then rename."""
        path = os.path.join(self.dir, f"{name}.safetensors")
        tmp = path + ".tmp"
        if corrupt:
            with open(tmp, "wb") as f:
                f.write(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
        else:
            save_steer(tmp, random_steer(HIDDEN, 2, name, seed=next(self.seeds)))
        os.replace(tmp, path)
        self.disk[name] = not corrupt

    def _digest(self, path: str) -> str | None:
        """The sha256 of the steer file at ``path`` now (None: none there, or no steer file)."""
        if not path.startswith(self.dir + os.sep):
            return _sha(path)  # the --steer file: never changed
        found = self._file(os.path.basename(path).removesuffix(".safetensors"))
        return found and found[1]

    def _file(self, name: str) -> tuple[str, str | None] | None:
        """``(path, sha256)`` of the steer-dir file of ``name`` as the disk has it now (sha256
        None: not a steer file), or None when there is none."""
        if name not in self.disk:
            return None
        path = os.path.join(self.dir, f"{name}.safetensors")
        return path, (_sha(path) if self.disk[name] else None)

    # ---- the two hooks, as vLLM calls them -------------------------------------------------
    def _manage(self, op, **kwargs) -> dict:
        (answer,) = engine_hooks.collective_rpc(None, self.core, MANAGEMENT_METHOD,
                                                args=(op, kwargs))
        assert "ok" in answer or op == "list", answer
        return answer

    def _check_answer(self, answer: dict, want: M.Outcome):
        assert answer["ok"] == want.ok, (answer, want)
        if not want.ok:
            assert answer["status"] == want.status, (answer, want)
            if want.status == 500:
                assert answer["error"].startswith("vllm-steer"), answer
            elif want.kind in (M.BAD_FILE, M.NO_SLOT):
                assert refusal_kind(answer["error"]) == want.kind, (answer, want)

    def _admit(self, wire, fault: str | None = None) -> tuple[M.Outcome, list]:
        """One request through ``EngineCore.add_request``, and the model's admission of the
        same steers: they must agree. Returns the model's outcome and the bound steers."""
        rid = f"r{next(self.ids)}"
        req = SteerRequest.from_wire(wire) if wire is not None else SteerRequest()
        names = list(req.strengths)
        zeros = [n for n in req.named if n not in req.strengths]
        files = {n: self._file(n) for n in names + zeros if n not in self.model.names()}
        if fault:
            self.workers.arm("put", int(fault[-1]))
        want = self.model.admit(rid, names, files, fault=bool(fault), zeros=zeros)
        extra = {} if wire is None else {"steer": wire}
        request = SimpleNamespace(request_id=rid, client_index=0,
                                  sampling_params=SimpleNamespace(extra_args=extra))
        before = len(self.outputs)
        admitted = []
        engine_hooks.add_request(lambda core, req, wave: admitted.append(req), self.core,
                                 request)
        if fault:
            assert self.workers.disarm() == (want.kind == M.FAULT), (want, names)
        self._learn(want.loads)
        if not admitted:
            (client_index, out), = self.outputs[before:]
            reason = out.outputs[0].stop_reason
            assert not want.ok, (names, reason, self._state())
            prefix = {500: FAILED_PREFIX, 429: BUSY_PREFIX}.get(want.status, REFUSED_PREFIX)
            assert reason.startswith(prefix), (want, reason)
            assert refusal_kind(reason) == want.kind, (want, reason)
            return want, []
        assert want.ok, (names, want, self._state())
        self.core.scheduler.requests[rid] = request
        bound = BoundSteer.from_wire((request.sampling_params.extra_args or {}).get(BOUND_KEY))
        assert [b.name for b in bound] == names, (bound, names)
        record = {}
        for b in bound:  # bound to the load the model serves it with
            inst = self.model.loaded(b.name)
            assert (b.load_id, b.bank_slot) == (inst.load_id, inst.bank_slot), (b, inst)
            record[b.name] = (b.load_id, b.bank_slot, inst.digest, b.value)
        self.running[rid] = record
        self.ids_admitted.append(rid)
        return want, bound

    def _learn(self, loads):
        """The load id and bank slot of the model's new loads, from the listing."""
        if not loads:
            return
        known = {i.load_id for i in self.model.instances if i.load_id is not None}
        rows = [s for s in self._manage("list")["steers"] if s["load_id"] not in known]
        for inst in loads:
            if not any(i is inst for i in self.model.instances):
                continue  # evicted again by a later load of the same request
            row = [s for s in rows if s["name"] == inst.name and s["state"] == "loaded"]
            assert len(row) == 1, (inst, rows)
            self.model.learn(inst, row[0]["load_id"], row[0]["bank_slot"])

    # ---- rules: requests -------------------------------------------------------------------
    @rule(names=st.lists(st.sampled_from([*DIR_NAMES, PINNED, "nope", "../x"]), max_size=5),
          strength=st.sampled_from([1, -2.5, 0]), as_text=st.booleans(),
          fault=st.sampled_from([None, None, None, "put0", "put1"]), short=st.booleans())
    def request(self, names, strength, as_text, fault, short):
        """A request naming 0 to 5 steers: loaded, first-use, missing, bad and repeated;
        sometimes a worker fails during its first first-use load. A ``short`` one finishes
        before the next step (its steers are idle again: what eviction may take)."""
        if as_text:  # the vllm_xargs string form, repeats and all
            value = ",".join(f"{n}:{strength}" for n in names)
        else:
            value = {n: strength for n in names}
        try:
            parsed = SteerRequest.parse(value, None, self.cfg.max_strength)
        except ValueError:  # the frontend refuses it (tested with the frontend)
            assert any(not M.valid_name(n) for n in names) or (
                as_text and len(set(names)) < len(names)), names  # a bad name, or given twice
            return
        outcome, bound = self._admit(parsed.to_wire(), fault)
        assert all(b.value == strength for b in bound), bound
        if short and outcome.ok:
            self._finish(self.ids_admitted[-1])

    @rule(names=st.lists(st.sampled_from(DIR_NAMES), min_size=1, max_size=4))
    def use(self, names):
        """Short requests one after the other, each naming one steer-dir steer (a first use
        loads it, at capacity evicting the least recently used idle one), each finished
        before the next."""
        for name in names:
            outcome, _ = self._admit(SteerRequest.parse({name: 1}, None, 10.0).to_wire())
            if outcome.ok:
                self._finish(self.ids_admitted[-1])

    @rule(preset=st.sampled_from(["p1", "p2", STATIC_PRESET]),
          extra=st.sampled_from([None, "d0", PINNED]), strength=st.sampled_from([1.0, -3.0]))
    def request_with_preset(self, preset, extra, strength):
        """A request whose model is a preset: the preset's mix under its own steers (a
        steer it names keeps its value, the preset's others are added)."""
        from vllm_steer import policy

        table = self._manage("presets")["presets"]
        mix = {STATIC_PRESET: {PINNED: 1.0}, **self.model.preset_table()}.get(preset)
        assert {STATIC_PRESET: self.cfg.presets[STATIC_PRESET], **table}.get(preset) == mix, (
            preset, table, mix)
        if mix is None:  # vLLM's 404 for an unknown model, before any steer is bound
            return
        own = {extra: strength} if extra else {}
        want = {**mix, **own}
        served = policy.with_preset(
            SteerRequest.parse(own, None, self.cfg.max_strength), mix)
        outcome, bound = self._admit(served.to_wire())
        if outcome.ok:
            assert {b.name: b.value for b in bound} == want, (bound, want)

    @rule(data=st.data())
    def finish(self, data):
        if self.running:
            self._finish(data.draw(st.sampled_from(sorted(self.running))))

    def _finish(self, rid):
        """A request finishes: up to its end every worker held the file it was admitted
        with, in its slot and load (afterwards a draining load of it is freed)."""
        for name, (load_id, slot, digest, _) in self.running[rid].items():
            for bank in self.workers.banks:
                assert bank.get(slot) == (load_id, name, digest), (rid, name, bank)
        self.running.pop(rid)
        self.core.scheduler.requests.pop(rid)
        self.model.finish(rid)

    # ---- rules: steers ---------------------------------------------------------------------
    @rule(name=st.sampled_from([*DIR_NAMES, "api1"]), src=st.sampled_from(DIR_NAMES),
          fault=st.sampled_from([None, None, "put0", "put1", "commit"]))
    def load(self, name, src, fault):
        """POST /v1/steers: load (or replace) ``name`` from a file of the steer dir;
        sometimes a worker fails during the put (the first one, or the second after the
        first wrote), or the load fails between the put and the registry's commit."""
        path = os.path.join(self.dir, f"{src}.safetensors")
        found = self._file(src)
        want = self.model.load(name, path, M.API, found and found[1], fault=bool(fault),
                               digest_of=self._digest)
        restore = None
        if fault == "commit":
            real = self.reg.commit

            def commit(*a, **kw):  # once: a put back into the slot commits
                self.reg.commit = real
                raise InjectedFault("fault injected between the put and the commit")
            self.reg.commit, restore = commit, real
        elif fault:
            self.workers.arm("put", int(fault[-1]))
        try:
            answer = self._manage("load", name=name, path=path, source="api")
        finally:
            if restore is not None:
                self.reg.commit = restore
            fired = self.workers.disarm()
        if fault and fault != "commit":
            assert fired == (want.kind == M.FAULT), (want, answer)
        self._check_answer(answer, want)
        if want.kind == M.FAULT:  # the error says what became of the steer it overwrote
            said = {"restored": f"steer {name!r} serves its previous file",
                    "unloaded": "is unloaded", "evicted": "is unloaded",
                    None: "nothing was changed"}[want.taken]
            assert said in answer["error"], (want, answer)
            self._learn(want.loads)
        if want.ok:
            assert answer["evicted"] == (want.evicted[0] if want.evicted else None), answer
            inst, = want.loads
            self.model.learn(inst, answer["steer"]["load_id"], answer["steer"]["bank_slot"])
            assert answer["steer"]["file"] == path, answer

    @rule(data=st.data(), src=st.sampled_from(DIR_NAMES),
          fault=st.sampled_from([None, None, "put1"]))
    def replace(self, data, src, fault):
        """POST /v1/steers for a name loaded now: a new load of another file (requests
        admitted before keep the old one)."""
        names = sorted(self.model.names())
        if names:
            self.load(data.draw(st.sampled_from(names)), src, fault)

    @rule(data=st.data(), fault=st.sampled_from([None, None, "drop1"]))
    def unload(self, data, fault):
        """DELETE /v1/steers/NAME; sometimes the second worker fails to empty the slot (the
        unload has happened: it answers so, and the slot is free). With a fault the name is
        one whose slot the unload empties at once (a loaded steer no request uses), so the
        fault fires; that it fired is checked."""
        idle = sorted(i.name for i in self.model.instances
                      if i.state == "loaded" and not i.users and i.source != M.STARTUP)
        names = idle if fault and idle else [*DIR_NAMES, "api1", PINNED, "never"]
        name = data.draw(st.sampled_from(names))
        inst = self.model.loaded(name)
        emptied = inst is not None and not inst.users
        want = self.model.unload(name, dir_file=name in self.disk)
        if fault:
            self.workers.arm("drop", 1)
        answer = self._manage("unload", name=name)
        fired = self.workers.disarm()
        if fault and want.ok and emptied:
            assert fired, (name, want, answer)  # the fault this rule is about happened
        self._check_answer(answer, want)

    @rule(name=st.sampled_from(DIR_NAMES), corrupt=st.booleans())
    def replace_file(self, name, corrupt):
        """A steer file replaced on disk (write-then-rename), sometimes by a bad one."""
        self._write(name, corrupt)

    @rule(name=st.sampled_from(DIR_NAMES))
    def remove_file(self, name):
        path = os.path.join(self.dir, f"{name}.safetensors")
        if os.path.exists(path):
            os.remove(path)
        self.disk.pop(name, None)

    @rule(name=st.sampled_from(DIR_NAMES))
    def restore_file(self, name):
        if name not in self.disk:
            self._write(name)

    # ---- rules: presets --------------------------------------------------------------------
    @rule(name=st.sampled_from(["p1", "p2", "tiny", STATIC_PRESET]), mix=st.sampled_from(
        [{"d0": 2.0}, {"d1": 1.0, "d2": -1.0}, {PINNED: 3.0}, {"d0": 1, "d1": 1, "d2": 1,
                                                            "d3": 1}]),
        replace=st.booleans())
    def preset_add(self, name, mix, replace):
        """POST /v1/steer-presets, or PUT /v1/steer-presets/NAME (``replace``)."""
        want = self.model.preset_add(name, mix, replace, dir_files=self.disk)
        self._check_answer(self._manage("preset_add", name=name, steer=mix,
                                        token=f"t{next(self.ids)}", replace=replace), want)

    @rule(name=st.sampled_from(["p1", "p2", "tiny", STATIC_PRESET]))
    def preset_delete(self, name):
        want = self.model.preset_delete(name)
        self._check_answer(self._manage("preset_delete", name=name), want)

    @rule(presets=st.sampled_from([{"p2": {"d4": 1.0}}, {"p1": {"d5": -2.0}}, {},
                                   {"tiny": {"d0": 1.0}}, {"p1": {"d0": 1.0}, "p3": {}}]),
          again=st.sampled_from([None, None, "same", "older"]))
    def presets_file(self, presets, again):
        """A new version of the presets file (one naming the served model is refused), or
        a version already read sent again by a slower API server (``same``, ``older``):
        nothing changes."""
        if again is None or self.model.file_stamp is None:
            self.file_version += 1
            stamp = (self.file_version, f"v{self.file_version}")
        elif again == "same":
            stamp = self.model.file_stamp
        else:
            stamp = (self.model.file_stamp[0] - 1, "older")
        want = self.model.presets_file(presets, stamp)
        self._check_answer(self._manage("preset_file", presets=presets, stamp=stamp,
                                        path="presets.json"), want)

    @rule(name=st.sampled_from(["p1", "p2"]))
    def presets_file_fails_half_way(self, name):
        """A presets file version whose second preset cannot be read (a fault in the swap,
        after the first preset, which takes a run-time name over): nothing changes."""
        self.file_version += 1
        answer = self._manage("preset_file", presets={name: {"d0": 1.0},
                                                      "p9": {"d1": "not a number"}},
                              stamp=(self.file_version, f"v{self.file_version}"),
                              path="presets.json")
        assert answer["ok"] is False, answer  # the model: unchanged (checked every step)

    # ---- what must hold --------------------------------------------------------------------
    def _state(self):
        return {"model": [(i.name, i.source, i.state, i.load_id, i.bank_slot, sorted(i.users))
                          for i in self.model.instances],
                "banks": self.workers.banks, "running": self.running}

    @invariant()
    def the_plugin_agrees_with_the_model(self):
        if self.root is None:
            return
        listing = self._manage("list")
        model = self.model
        self._learn([i for i in model.instances if i.load_id is None])
        # the listing: one row per load the model has, as the model has it
        rows = sorted((s["name"], s["source"], s["state"], s["load_id"], s["bank_slot"],
                       s["file"], s["requests_served"]) for s in listing["steers"])
        want = sorted((i.name, SOURCES[i.source], i.state, i.load_id, i.bank_slot, i.file,
                       i.served) for i in model.instances)
        assert rows == want, (rows, want, self._state())
        # every worker's bank holds those loads, each from the file the model read, and
        # nothing else (but a slot worker 1 failed to empty, until a load takes it)
        held = {i.bank_slot for i in model.instances}
        self.workers.undropped -= held
        for w, bank in enumerate(self.workers.banks):
            for i in model.instances:
                assert bank.get(i.bank_slot) == (i.load_id, i.name, i.digest), (
                    i.name, i.bank_slot, bank, self._state())
            assert set(bank) - held <= (self.workers.undropped if w == 1 else set()), (
                w, bank, held, self.workers.undropped, self._state())
        # every running request is served the file it was admitted with
        for rid, record in self.running.items():
            for name, (load_id, slot, digest, _) in record.items():
                for bank in self.workers.banks:
                    assert bank.get(slot) == (load_id, name, digest), (rid, name, bank)
        stats = listing["stats"]
        assert stats["counters"] == model.counters, (stats["counters"], model.counters)
        by_status: dict[int, int] = {}
        for key, n in stats["refused"].items():  # "STATUS:REASON"
            by_status[int(key.split(":")[0])] = by_status.get(int(key.split(":")[0]), 0) + n
        assert by_status == model.refused, (stats["refused"], model.refused)
        assert stats["served"] == model.served, (stats["served"], model.served)
        assert stats["loaded"] == len(model.names())
        assert stats["draining"] == sum(i.state == "draining" for i in model.instances)
        assert stats["capacity"] == CAPACITY
        assert listing["presets"] == model.preset_table(), (listing["presets"], model.__dict__)
        assert listing["version"] == model.preset_version
        assert sorted(listing.get("from_file", [])) == sorted(model.file_presets)


SteerStateMachine.TestCase.settings = settings(
    max_examples=EXAMPLES, stateful_step_count=40, deadline=None,
    suppress_health_check=list(HealthCheck))
TestSteerState = SteerStateMachine.TestCase
