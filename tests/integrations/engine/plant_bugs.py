"""Plant one bug at a time in the engine core's steer code (monkeypatched in this process
only) and run the steer state machine on it: how many programs it takes to fail.

Run by hand, from the repository root (not collected by pytest)::

    PYTHONPATH=$PWD .venv/bin/python tests/integrations/engine/plant_bugs.py [--examples 200]
        [--seeds 3] [BUG ...]

For each bug it prints the number of programs (of up to 40 steps) Hypothesis generated up to
the first failing one, per seed (no shrinking), or "missed". The clean code is run too: it
must pass. docs/dev/testing.md lists the results.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(HERE, "..", "..")]

from vllm_steer.integrations.engine import management, presets, registry  # noqa: E402

Reg = registry.SteerRegistry


def _commit_wrong_load_id(orig):
    def commit(self, entry, evicted=None):
        entry.load_id -= 1  # records the load before's id (the workers got the right one)
        return orig(self, entry, evicted)
    return commit


def _replace_keeps_old(orig):
    def commit(self, entry, evicted=None):
        old = self.get(entry.name)
        out = orig(self, entry, evicted)
        if old is not None and old.bank_slot != entry.bank_slot:
            old.state = "loaded"  # the name stays on the old file
            self.bound[entry.name] = old.bank_slot
        return out
    return commit


def _slot_off_by_one(orig):
    def commit(self, entry, evicted=None):
        if entry.source == "api":  # the registry records the wrong slot for a POST load
            entry.bank_slot = (entry.bank_slot + 1) % self.capacity
        return orig(self, entry, evicted)
    return commit


def _evict_ignores_requests(orig):
    def free_slot(self, in_use, *a, **kw):
        return orig(self, set(), *a, **kw)
    return free_slot


def _never_reaped(orig):
    def reap(self, in_use):
        return []
    return reap


def _most_recently_used(orig):
    def free_slot(self, in_use, evictable=True, replacing=None, protect=()):
        for e in self.slots:
            if e is not None:
                e.last_used = -e.last_used
        try:
            return orig(self, in_use, evictable, replacing, protect)
        finally:
            for e in self.slots:
                if e is not None:
                    e.last_used = -e.last_used
    return free_slot


def _bind_not_recorded(orig):
    def bind(self, names):
        saved = {n: self.slots[self.bound[n]].last_used for n in names if n in self.bound}
        out = orig(self, names)
        for n, t in saved.items():
            self.slots[self.bound[n]].last_used = t  # a request does not count as a use
        return out
    return bind


def _unload_not_counted(orig):
    def unload(self, name, in_use):
        out = orig(self, name, in_use)
        self.counters["unloads"] -= 1
        return out
    return unload


def _served_per_entry_lost(orig):
    def bind(self, names):
        out = orig(self, names)
        for n in names:
            self.slots[self.bound[n]].requests_served -= 1 if len(names) > 1 else 0
        return out
    return bind


def _file_stamp_ignored(orig):
    def set_file(self, p, stamp, reserved=None):
        self.file_stamp = None  # an older version read late replaces the newer one
        return orig(self, p, stamp, reserved)
    return set_file


def _put_before_check_of_room(orig):
    def load_steer_file(core, name, path, source, protect=()):
        return orig(core, name, path, source, protect=())  # evicts the request's own steers
    return load_steer_file


BUGS = {
    "commit-wrong-load-id": (Reg, "commit", _commit_wrong_load_id),
    "replace-keeps-old-file": (Reg, "commit", _replace_keeps_old),
    "slot-recorded-off-by-one": (Reg, "commit", _slot_off_by_one),
    "eviction-ignores-running": (Reg, "free_slot", _evict_ignores_requests),
    "drained-slot-never-freed": (Reg, "reap", _never_reaped),
    "evicts-most-recently-used": (Reg, "free_slot", _most_recently_used),
    "request-not-a-use": (Reg, "bind", _bind_not_recorded),
    "unload-not-counted": (Reg, "unload", _unload_not_counted),
    "served-per-load-lost": (Reg, "bind", _served_per_entry_lost),
    "presets-file-stamp-ignored": (presets.PresetTable, "set_file", _file_stamp_ignored),
    "first-use-evicts-own-steers": (management, "load_steer_file", _put_before_check_of_room),
}


@contextlib.contextmanager
def planted(bug):
    if bug is None:
        yield
        return
    owner, attr, make = BUGS[bug]
    orig = getattr(owner, attr)
    setattr(owner, attr, make(orig))
    extra = []
    if owner is management:  # binding imported it by name
        from vllm_steer.integrations.engine import binding
        extra.append((binding, attr, getattr(binding, attr)))
        setattr(binding, attr, getattr(owner, attr))
    try:
        yield
    finally:
        setattr(owner, attr, orig)
        for mod, a, v in extra:
            setattr(mod, a, v)


def programs_to_fail(examples: int, seed: int) -> int | None:
    import random

    from hypothesis import HealthCheck, Phase, settings
    from hypothesis.stateful import run_state_machine_as_test

    import test_steer_state_machine as t

    count = [0]

    class Counted(t.SteerStateMachine):
        def __init__(self):
            super().__init__()
            count[0] += 1

    random.seed(seed)
    try:
        run_state_machine_as_test(Counted, settings=settings(
            max_examples=examples, stateful_step_count=40, deadline=None, database=None,
            phases=[Phase.generate], suppress_health_check=list(HealthCheck)))
    except Exception:
        return count[0]
    return None


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bugs", nargs="*", default=[None, *BUGS])
    ap.add_argument("--examples", type=int, default=200)
    ap.add_argument("--seeds", type=int, default=3)
    args = ap.parse_args()
    import logging

    logging.disable(logging.CRITICAL)
    for bug in args.bugs:
        t0 = time.time()
        with planted(bug):
            found = [programs_to_fail(args.examples, s) for s in range(args.seeds)]
        shown = ", ".join("missed" if n is None else str(n) for n in found)
        print(f"{bug or 'no bug (must pass)':30s} programs to the first failure: {shown} "
              f"({time.time() - t0:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
