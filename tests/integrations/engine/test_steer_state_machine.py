"""The engine core's steer state as a state machine (Hypothesis ``RuleBasedStateMachine``).

The engine core's plugin code (admission: :func:`vllm_steer.integrations.engine.core.
add_request`; management: :func:`~vllm_steer.integrations.engine.core.collective_rpc`) is
driven through its two hooks, as vLLM calls them, on a hand-built engine core with a small
bank (3 slots, one pinned by ``--steer``), a ``--steer-dir`` larger than the bank, run-time
updates and presets. Every rule is something a user or an operator does: requests naming 0
to N steers (loaded, first-use, missing and repeated names, presets as model names),
requests finishing, loads, unloads and replacements, preset adds, PUTs and deletes,
presets-file versions (valid and refused), steer files replaced on disk.

The invariants are what a user relies on:

- only the documented refusals leave the engine core: ``add_request`` and the management
  call never raise, a refusal is always a client's 400 (never the plugin's 500), and a
  request the bank can hold (its steers exist and fit beside the pinned ones and those
  running requests use) is admitted;
- every admitted request keeps the exact file it was admitted with, in the same bank slot
  and load, until it finishes (the workers' bank is modelled from the ``put`` / ``drop``
  calls the engine core makes);
- no slot is reused while a request uses it; capacity is never exceeded;
- counters and listings agree.

``make test`` runs a bounded profile (``VLLM_STEER_STATE_EXAMPLES``, default 25 programs of
up to 40 steps); a longer one: ``VLLM_STEER_STATE_EXAMPLES=2000 .venv/bin/python -m pytest
tests/integrations/engine/test_steer_state_machine.py`` (docs/internals.md).
"""

from __future__ import annotations

import hashlib
import itertools
import os
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")
pytest.importorskip("hypothesis")

from hypothesis import HealthCheck, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant,  # noqa: E402
                                 precondition, rule)

from helpers.fakes import engine_core  # noqa: E402
from helpers.steers import random_steer  # noqa: E402
from vllm_steer.config import SteerServerConfig  # noqa: E402
from vllm_steer.format import read_metadata, save_steer  # noqa: E402
from vllm_steer.integrations.engine import core as engine_hooks  # noqa: E402
from vllm_steer.integrations.engine.registry import SteerEntry, SteerRegistry  # noqa: E402
from vllm_steer.integrations.engine.state import EngineSteerState  # noqa: E402
from vllm_steer.integrations.protocol import (BUSY_PREFIX, MANAGEMENT_METHOD,  # noqa: E402
                                              REFUSED_PREFIX)
from vllm_steer.request import BOUND_KEY, BoundSteer, SteerRequest  # noqa: E402

HIDDEN = 16
CAPACITY = 3
DIR_NAMES = [f"d{i}" for i in range(6)]  # the steer dir: twice the bank
PINNED = "pin"
EXAMPLES = int(os.environ.get("VLLM_STEER_STATE_EXAMPLES", "25"))


def _digest(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


class FakeWorkers:
    """The workers' bank as the engine core's ``put`` / ``drop`` calls leave it:
    ``bank_slot -> (load_id, name, sha256 of the file the factors came from)``."""

    def __init__(self):
        self.bank: dict[int, tuple[int, str, str]] = {}

    def collective_rpc(self, fn, args=()):
        op = args[0]
        if op == "put":
            _, slot, load_id, name, steer = args
            self.bank[slot] = (load_id, name, steer.vllm_steer_digest)
        elif op == "drop":
            for slot in args[1]:
                self.bank.pop(slot, None)
        return [{} if op == "stats" else True]


class SteerStateMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.root = None

    @initialize(data=st.data())
    def start(self, data):
        import tempfile

        self.root = tempfile.mkdtemp(prefix="steer-state-")
        self.dir = os.path.join(self.root, "dir")
        os.mkdir(self.dir)
        self.seeds = itertools.count(100)
        for name in DIR_NAMES:
            self._write(name)
        pin = os.path.join(self.root, f"{PINNED}.safetensors")
        save_steer(pin, random_steer(HIDDEN, 2, PINNED, seed=1))
        self.cfg = SteerServerConfig(steers={PINNED: pin}, max_strength=10.0,
                                     steer_dir=self.dir, max_steers=CAPACITY,
                                     enable_updates=True)
        reg = SteerRegistry(self.cfg.capacity)
        reg.commit(SteerEntry.from_metadata(PINNED, pin, read_metadata(pin),
                                            reg.new_load_id(), 0, "--steer"))
        reg.counters["loads"] = 0
        self.workers = FakeWorkers()
        self.workers.bank[0] = (1, PINNED, _digest(pin))
        self.outputs: list = []
        self.core = engine_core(
            engine_index=0, steer_state=EngineSteerState(self.cfg, reg, HIDDEN),
            scheduler=SimpleNamespace(requests={}), model_executor=self.workers,
            output_queue=SimpleNamespace(put_nowait=self.outputs.append),
            vllm_config=SimpleNamespace(model_config=SimpleNamespace(
                model="tiny", served_model_name="tiny")))
        self.reg = reg
        self.running: dict[str, dict[str, tuple[int, int, str]]] = {}  # id -> name -> bound
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
            with open(path, "rb") as f:
                blob = f.read()
            steer.vllm_steer_digest = hashlib.sha256(blob).hexdigest()
            return steer

        self._restore = (fmt, real)
        fmt.load_steer = load

    def teardown(self):
        if self.root is not None:
            fmt, real = self._restore
            fmt.load_steer = real
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

    # ---- the two hooks, as vLLM calls them -------------------------------------------------
    def _manage(self, op, **kwargs) -> dict:
        (answer,) = engine_hooks.collective_rpc(None, self.core, MANAGEMENT_METHOD,
                                                args=(op, kwargs))
        assert "ok" in answer or op == "list", answer
        if answer.get("ok") is False:
            assert answer["status"] in (400, 404, 409, 507), answer  # never the plugin's 500
            assert "vllm-steer: internal error" not in answer["error"], answer
        return answer

    def _admit(self, value) -> tuple[bool, str]:
        """One request through ``EngineCore.add_request``: (admitted, refusal message)."""
        rid = f"r{next(self.ids)}"
        extra = {} if value is None else {"steer": value}
        request = SimpleNamespace(request_id=rid, client_index=0,
                                  sampling_params=SimpleNamespace(extra_args=extra))
        before = len(self.outputs)
        admitted = []
        engine_hooks.add_request(lambda core, req, wave: admitted.append(req), self.core,
                                 request)
        if not admitted:
            (client_index, out), = self.outputs[before:]
            reason = out.outputs[0].stop_reason
            # a documented refusal only: "busy" (HTTP 429, retry) only for a request that fits
            # once running requests finish, beside the steers never evicted
            assert reason.startswith((REFUSED_PREFIX, BUSY_PREFIX)), reason
            if reason.startswith(BUSY_PREFIX):
                names = set(SteerRequest.from_wire(value).strengths)
                assert len(self.reg.never_evicted() | names) <= self.reg.capacity, reason
            return False, reason
        self.core.scheduler.requests[rid] = request
        bound = BoundSteer.from_wire((request.sampling_params.extra_args or {}).get(BOUND_KEY))
        self.running[rid] = {b.name: (b.bank_slot, b.load_id, self.workers.bank[b.bank_slot][2])
                             for b in bound}
        for b in bound:  # bound to the slot and load that hold it now
            assert self.workers.bank[b.bank_slot][:2] == (b.load_id, b.name), (b, self.workers.bank)
        return True, ""

    # ---- rules -----------------------------------------------------------------------------
    @rule(names=st.lists(st.sampled_from([*DIR_NAMES, PINNED, "nope", "../x"]), max_size=5),
          strength=st.sampled_from([1, -2.5, 0]), as_text=st.booleans())
    def request(self, names, strength, as_text):
        """A request naming 0 to 5 steers: loaded, first-use, missing, bad and repeated."""
        if as_text:  # the vllm_xargs string form, repeats and all
            value = ",".join(f"{n}:{strength}" for n in names)
        else:
            value = {n: strength for n in names}
        try:
            parsed = SteerRequest.parse(value, None, self.cfg.max_strength)
        except ValueError:  # the frontend refuses it (tested with the frontend)
            return
        distinct = list(parsed.strengths)
        fits = self._fits(distinct)
        ok, why = self._admit(parsed.to_wire())
        assert ok == bool(fits), (distinct, fits, why, self._state())

    @rule(preset=st.sampled_from(["p1", "p2"]), extra=st.sampled_from([None, "d0", PINNED]))
    def request_with_preset(self, preset, extra):
        """A request whose model is a preset: the preset's mix under its own steers."""
        mix = self._manage("presets")["presets"].get(preset)
        if mix is None:
            return
        from vllm_steer import policy

        own = SteerRequest.parse({extra: 1} if extra else {}, None, self.cfg.max_strength)
        served = policy.with_preset(own, mix)
        self._admit(served.to_wire())

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def finish(self, data):
        rid = data.draw(st.sampled_from(sorted(self.running)))
        self.running.pop(rid)
        self.core.scheduler.requests.pop(rid)

    @rule(name=st.sampled_from([*DIR_NAMES, "api1"]), src=st.sampled_from(DIR_NAMES))
    def load(self, name, src):
        """POST /v1/steers: load (or replace) ``name`` from a file of the steer dir."""
        self._manage("load", name=name, path=os.path.join(self.dir, f"{src}.safetensors"),
                     source="api")

    @rule(name=st.sampled_from([*DIR_NAMES, "api1", PINNED, "never"]))
    def unload(self, name):
        self._manage("unload", name=name)

    @rule(name=st.sampled_from(DIR_NAMES), corrupt=st.booleans())
    def replace_file(self, name, corrupt):
        """A steer file replaced on disk (write-then-rename), sometimes by a bad one."""
        self._write(name, corrupt)

    @rule(name=st.sampled_from(DIR_NAMES))
    def remove_file(self, name):
        path = os.path.join(self.dir, f"{name}.safetensors")
        if os.path.exists(path):
            os.remove(path)

    @rule(name=st.sampled_from(DIR_NAMES))
    def restore_file(self, name):
        if not os.path.exists(os.path.join(self.dir, f"{name}.safetensors")):
            self._write(name)

    @rule(name=st.sampled_from(["p1", "p2", "tiny"]), mix=st.sampled_from(
        [{"d0": 2.0}, {"d1": 1.0, "d2": -1.0}, {PINNED: 3.0}, {"d0": 1, "d1": 1, "d2": 1,
                                                            "d3": 1}]),
        replace=st.booleans())
    def preset_add(self, name, mix, replace):
        """POST /v1/steer-presets, or PUT /v1/steer-presets/NAME (``replace``)."""
        self._manage("preset_add", name=name, steer=mix, token=f"t{next(self.ids)}",
                     replace=replace)

    @rule(name=st.sampled_from(["p1", "p2", "tiny"]))
    def preset_delete(self, name):
        self._manage("preset_delete", name=name)

    @rule(presets=st.sampled_from([{"p2": {"d4": 1.0}}, {"p1": {"d5": -2.0}}, {},
                                   {"tiny": {"d0": 1.0}}]))
    def presets_file(self, presets):
        """A new version of the presets file (one naming the served model is refused)."""
        self.file_version += 1
        self._manage("preset_file", presets=presets,
                     stamp=(self.file_version, f"v{self.file_version}"), path="presets.json")

    # ---- what must hold --------------------------------------------------------------------
    def _fits(self, names) -> bool | None:
        """Whether the bank can hold ``names`` now (None: a name has no good file)."""
        missing = [n for n in names if n not in self.reg.bound]
        for n in missing:
            path = os.path.join(self.dir, f"{n}.safetensors")
            if n in ("nope", "../x") or not os.path.exists(path):
                return None
            try:
                read_metadata(path)
            except Exception:
                return None
        if len(names) > CAPACITY:
            return False
        in_use = {(s, g) for b in self.running.values() for s, g, _ in b.values()}
        room = 0
        for e in self.reg.slots:
            if e is None or ((e.bank_slot, e.load_id) not in in_use and (
                    e.state == "draining"
                    or (e.source == "steer-dir" and e.name not in names))):
                room += 1
        return len(missing) <= room

    def _state(self):
        return {"slots": [(e.name, e.bank_slot, e.load_id, e.state, e.source) if e else None
                          for e in self.reg.slots], "running": self.running}

    @invariant()
    def admitted_requests_keep_their_file(self):
        if self.root is None:
            return
        for rid, bound in self.running.items():
            for name, (slot, load_id, digest) in bound.items():
                assert self.workers.bank.get(slot) == (load_id, name, digest), (
                    rid, name, self._state(), self.workers.bank)

    @invariant()
    def capacity_and_listings_agree(self):
        if self.root is None:
            return
        entries = [e for e in self.reg.slots if e is not None]
        assert len(entries) <= CAPACITY and len(self.reg.bound) <= CAPACITY
        assert all(self.reg.slots[slot].name == name and self.reg.slots[slot].state == "loaded"
                   for name, slot in self.reg.bound.items())
        listing = self._manage("list")
        assert sorted(s["name"] for s in listing["steers"] if s["state"] == "loaded") == \
            sorted(self.reg.bound)
        assert listing["stats"]["loaded"] == len(self.reg.bound)
        assert self.reg.get(PINNED) is not None or PINNED not in self.reg.bound


SteerStateMachine.TestCase.settings = settings(
    max_examples=EXAMPLES, stateful_step_count=40, deadline=None,
    suppress_health_check=list(HealthCheck))
TestSteerState = SteerStateMachine.TestCase
