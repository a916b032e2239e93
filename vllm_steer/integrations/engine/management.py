"""Run-time steer management in the engine core: load, unload, list and the preset table.

The engine core holds the :class:`~vllm_steer.integrations.engine.registry.SteerRegistry` (it
sees every request, waiting or running). Management reaches it through vLLM's own
``collective_rpc`` on the engine client (``AsyncLLM`` in the API server, ``LLM`` offline), with
the method name :data:`~vllm_steer.integrations.protocol.MANAGEMENT_METHOD`: the plugin's hook
on ``EngineCore.collective_rpc`` answers that name in the engine core (see :func:`run_op`),
which updates the registry and forwards the factors to every worker (all TP ranks) with the
executor's own ``collective_rpc``
(:func:`vllm_steer.integrations.worker.management.worker_op`). Operations and admissions
(:mod:`vllm_steer.integrations.engine.binding`) run on the engine core's one thread, so they
are ordered.

The ops and their answers: :mod:`vllm_steer.integrations.protocol` (``OP_*``). Every answer
names its engine core (``"engine"``, the data-parallel rank). With data parallelism each
engine core holds its own registry and vLLM's load-balancing client sends a utility call to
every one of them: :func:`vllm_steer.integrations.protocol.merge_answers` makes one answer of
theirs.
"""

from __future__ import annotations

import math
import time
from typing import Collection, Mapping

from vllm_steer.integrations import vllm_access as va
from vllm_steer.integrations.engine.presets import file_op
from vllm_steer.kinds import applied_in_layers
from vllm_steer.integrations.engine.registry import (SteerCapacityError, SteerEntry,
                                                     SteerNameError, bound_in, check_name,
                                                     file_stamp)
from vllm_steer.integrations.engine.state import engine_state
from vllm_steer.integrations.guard import note_outcome
from vllm_steer.integrations.protocol import (OP_LIST, OP_LOAD, OP_PRESET_ADD, OP_PRESET_DELETE,
                                              OP_PRESET_FILE, OP_PRESET_ROLLBACK, OP_PRESETS,
                                              OP_ROLLBACK, OP_TICKET, OP_UNLOAD, SOURCE_API,
                                              SOURCE_STEER_DIR, dir_has_file, is_preset_op,
                                              op_totals)
from vllm_steer.logs import get_logger
from vllm_steer.metrics import take_new

logger = get_logger()


def in_use_by_requests(core) -> set[tuple[int, int]]:
    """``(bank_slot, load_id)`` of every steer a request in the engine core (waiting or
    running) is bound to."""
    return bound_in(va.core_requests(core))


def _workers(core, *args) -> list:
    from vllm_steer.integrations.worker.management import worker_op

    return va.core_run_in_workers(core, worker_op, args)


def _drop(core, slots) -> None:
    """Empty ``slots`` in every worker. The registry has freed them already: no name is bound
    to them and the next load into one overwrites it, so a worker that fails to drop leaves
    unbound factors behind, never a steer served from the wrong slot. Logged, not raised: the
    op that freed them (an unload, a reap) has happened and answers so."""
    if not slots:
        return
    try:
        _workers(core, "drop", list(slots))
    except Exception:
        logger.exception("vllm-steer: emptying bank slot(s) %s in the workers failed; the "
                         "slots are free and are overwritten by the next load", list(slots))


#: The string arguments each op needs (anything else is a 400, never a KeyError).
_REQUIRED = {OP_LOAD: ("name", "path"), OP_UNLOAD: ("name",), OP_ROLLBACK: ("name",),
             OP_PRESET_DELETE: ("name",), OP_PRESET_ADD: ("name",),
             OP_PRESET_ROLLBACK: ("name",)}


def _error(status: int, message: str, reason: str | None = None) -> dict:
    """A refused op's answer; ``reason`` (a key of :data:`vllm_steer.request.REFUSAL_REASONS`)
    where a request's admission refuses with this answer."""
    out = {"ok": False, "status": status, "error": message}
    if reason is not None:
        out["reason"] = reason
    return out


def run_op(core, op: str, kwargs: dict | None = None) -> dict:
    """One management op in the engine core (see the module doc): its answer, naming this
    engine core. The engine-core hook runs it inside the plugin's guard
    (:func:`vllm_steer.integrations.engine.core.collective_rpc`): an op that fails in the
    plugin's code answers HTTP 500 and changes nothing."""
    answer = _run_op(core, op, kwargs)
    if isinstance(kwargs, dict) and not answer.get("superseded"):
        engine_state(core).order.take(op, kwargs, answer)  # data parallelism: its ticket
    return {**answer, "engine": va.engine_index(core)}


def _run_op(core, op: str, kwargs: dict | None = None) -> dict:
    st = engine_state(core)
    reg, cfg = st.registry, st.config
    if not isinstance(kwargs, dict) and kwargs is not None:
        return _error(400, f"steer management op {op!r}: its arguments must be a mapping, "
                      f"got {type(kwargs).__name__}")
    kwargs = dict(kwargs or {})
    missing = [k for k in _REQUIRED.get(op, ()) if not isinstance(kwargs.get(k), str)]
    if missing:
        return _error(400, f"steer management op {op!r}: {', '.join(missing)} must be given "
                      "as a string")
    if op == OP_TICKET:
        return {"ok": True, "ticket": st.order.ticket()}
    if reg is None:
        if op == OP_LIST:
            return {"enabled": False, "steers": [], "stats": {}, "workers": []}
        return _error(404, "steering is not enabled on this server (start it with --steer, "
                      "--steer-dir or --enable-steer-updates)")
    superseded = st.order.refusal(op, kwargs, st.engine)
    if superseded is not None:  # data parallelism: a newer change of the name came first
        return superseded
    if is_preset_op(op):  # run-time presets: no worker involved
        return _preset_op(core, cfg, op, kwargs)
    _drop(core, reg.reap(in_use_by_requests(core)))
    if op == OP_LIST:
        workers = _workers(core, "stats")
        stats = {**reg.stats(), "op": op_totals(workers)}
        return {"enabled": True, "steers": reg.listing(),
                "stats": stats, "metrics": take_new(st, stats, workers),
                "workers": workers, "steer_dir": cfg.steer_dir,
                "enable_updates": cfg.enable_updates, "updates_any_path": cfg.updates_any_path,
                **st.presets.snapshot()}
    if op == OP_LOAD:
        existing = reg.get(kwargs["name"])
        if kwargs.get("source") == SOURCE_STEER_DIR and existing is not None:  # first use raced
            return {"ok": True, "steer": existing.to_json(), "evicted": None, "load_ms": 0.0}
        protect = kwargs.get("protect") or ()
        return load_steer_file(core, kwargs["name"], kwargs["path"],
                               kwargs.get("source", SOURCE_API),
                               protect=[str(n) for n in protect] if isinstance(
                                   protect, (list, tuple)) else ())
    if op == OP_UNLOAD:
        name = kwargs["name"]
        named_by = policy_users(cfg, st.presets, name)
        if named_by and reg.get(name) is not None and not dir_has_file(cfg.steer_dir, name):
            return _error(409, f"steer {name!r} is named by {'; '.join(named_by)}: unloaded, "
                          "it could not be loaded again at a request's first use (it is no "
                          "file of --steer-dir), and every request that names it would be "
                          "refused. Change what names it first (each item says how), or "
                          "load a new version with POST /v1/steers (same name: it replaces "
                          "this one)")
        try:
            entry, freed = reg.unload(name, in_use_by_requests(core))
        except KeyError:
            return _error(404, f"steer {name!r} is not loaded; loaded steers: "
                          f"{', '.join(reg.names()) or 'none'}")
        _drop(core, freed)
        logger.info("vllm-steer: unloaded steer %r (load id %d)%s", name, entry.load_id,
                    "" if freed else "; its slot is freed when the requests using it finish")
        return {"ok": True, "steer": entry.to_json()}
    if op == OP_ROLLBACK:
        return _rollback(core, st, kwargs)
    return _error(400, f"unknown steer management op {op!r}")


def _rollback(core, st, kwargs: dict) -> dict:
    """``rollback`` ``{"name", "load_ids"}``: undo this engine core's load ``load_ids[engine]``
    of ``name``, which another engine core refused. The name's previous file is read again
    where the load replaced one (answer ``restored``: the entry that serves it); else, or when
    that fails (answer ``previous_lost``: why), the name is unloaded, never left serving the
    refused load. ``steer`` None: that load is not the name's any more (nothing undone)."""
    reg, name = st.registry, kwargs["name"]
    entry = reg.get(name)
    load_id = (kwargs.get("load_ids") or {}).get(str(va.engine_index(core)))
    if entry is None or entry.load_id != load_id:
        return {"ok": True, "steer": None}
    restored, lost = _restore_replaced(core, st, name, load_id)
    if restored is not None:
        return {"ok": True, "steer": entry.to_json(), "restored": restored}
    if reg.get(name) is entry:  # (a put back into its own slot that failed unbound it)
        _, freed = reg.unload(name, in_use_by_requests(core))
        reg.counters["unloads"] -= 1  # not an unload anyone asked for
        _drop(core, freed)
    logger.info("vllm-steer: load of steer %r (load id %d) rolled back: it failed on "
                "another data-parallel engine; the name is unloaded here%s", name, load_id,
                f" (its previous file could not be loaded again: {lost})" if lost else "")
    out = {"ok": True, "steer": entry.to_json()}
    if lost:
        out["previous_lost"] = lost
    return out


def policy_users(cfg, table, name: str) -> list[str]:
    """What of the operator's policy names the steer ``name``: a default or a positive floor
    (which every request gets), a ``--steer-preset`` preset, a preset of the presets file or one
    added at run time (``table``: the engine core's :class:`~vllm_steer.integrations.engine.
    presets.PresetTable`); each with how to change it."""
    out = []
    if name in cfg.defaults:
        out.append(f"--steer-default {name}={cfg.defaults[name]:g} (every request gets it; "
                   "restart without it)")
    if cfg.floors.get(name, 0) > 0:  # raises every request (a negative floor: only its own)
        out.append(f"--steer-floor {name}={cfg.floors[name]:g} (every request gets at least "
                   "it; restart without it)")
    out += [f"--steer-preset {p} (restart without it)" for p, mix in cfg.presets.items()
            if name in mix]
    out += [f"the presets file's preset {p!r} (edit --steer-presets-file)"
            for p, mix in table.file.items() if name in mix]
    out += [f"the preset {p!r} (DELETE /v1/steer-presets/{p}, or PUT it without {name!r})"
            for p, mix in table.presets.items() if name in mix]
    return out


def _is_mix(value) -> bool:
    """A preset's mix: a mapping of steer names to finite numbers."""
    return isinstance(value, Mapping) and all(
        isinstance(k, str) and isinstance(v, (int, float)) and not isinstance(v, bool)
        and math.isfinite(v) for k, v in value.items())


def _bad_preset_args(op: str, kwargs: dict) -> str | None:
    """What is wrong with a preset op's arguments beyond :data:`_REQUIRED`'s strings (None:
    nothing): a mix that is no mapping of names to numbers, a presets file's presets or stamp
    of another shape. The API server sends them right; this answers a direct caller with a
    400 rather than a 500."""
    if op == OP_PRESET_ADD and not _is_mix(kwargs.get("steer")):
        return '"steer" must be a mapping of steer names to finite numbers, e.g. {"detox": 4}'
    if op == OP_PRESET_FILE:
        presets, stamp = kwargs.get("presets"), kwargs.get("stamp")
        if not isinstance(presets, Mapping) or not all(
                isinstance(n, str) and _is_mix(m) for n, m in presets.items()):
            return '"presets" must map preset names to mixes of finite numbers, e.g. ' \
                '{"kind": {"detox": 4}}'
        if not isinstance(stamp, (list, tuple)) or len(stamp) not in (2, 3) or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in stamp[::2]):
            return '"stamp" must be the file\'s [mtime_ns, sha256, read_ns]'
    return None


def never_fits(reg, name: str, names) -> str:
    """Why loading ``name`` for a request served with the steers ``names`` can never succeed:
    they and the steers never evicted are more than the bank's slots (no wait helps). The one
    message, whichever process finds it (a first use's load, the engine core's admission)."""
    never = reg.never_evicted()
    return (f"cannot load steer {name!r}: the request's steers "
            f"({', '.join(repr(n) for n in names)}) and the {len(never)} steer(s) never evicted "
            f"({', '.join(sorted(never)) or 'none'}) are more than the {reg.capacity} steer "
            f"slots (--max-steers={reg.capacity}); send fewer steers at once, or restart with a "
            "larger --max-steers")


def _preset_op(core, cfg, op: str, kwargs: dict) -> dict:
    """``presets`` (read the table), ``preset_add`` ``{"name", "steer", "token", "replace"}``
    (checked by the API server; here only the name, atomically), ``preset_delete``
    ``{"name"}``, ``preset_rollback`` ``{"name", "token"}``, ``preset_file`` ``{"presets",
    "stamp", "path"}``."""
    st = engine_state(core)
    table = st.presets
    if op == OP_PRESETS:
        return {"ok": True, **table.snapshot()}
    bad = _bad_preset_args(op, kwargs)
    if bad is not None:
        return _error(400, f"steer management op {op!r}: {bad}")
    if op == OP_PRESET_ADD:
        gone = [n for n in kwargs["steer"]
                if st.registry.get(n) is None and not dir_has_file(cfg.steer_dir, n)]
        if gone:  # unloaded since the API server checked the mix (its check and this op race)
            return _error(409, f"preset {kwargs['name']!r} names {', '.join(map(repr, gone))}, "
                          "which is no longer loaded (it was unloaded after the mix was "
                          "checked) and is no file of --steer-dir: every request naming the "
                          "preset would be refused. Load it again (POST /v1/steers), or leave "
                          "it out of the preset")
    if op in (OP_PRESET_ADD, OP_PRESET_FILE):
        reserved = {str(n): "the served model name"
                    for n in va.served_model_names(va.core_model_config(core))}
        reserved.update({n: "a preset set by --steer-preset" for n in cfg.presets})
        if op == OP_PRESET_FILE:  # logged by the presets module
            return file_op(table, kwargs, reserved)
        res = table.add(kwargs["name"], kwargs["steer"], kwargs.get("token", ""), reserved,
                        replace=bool(kwargs.get("replace")))
        if res["ok"]:
            logger.info("vllm-steer: %s preset %r = %s (run time)",
                        "replaced" if res.get("replaced") else "added", kwargs["name"],
                        res["preset"]["steer"])
        return res
    if op == OP_PRESET_DELETE:
        res = table.delete(kwargs["name"], cfg.presets)
        if res["ok"]:
            logger.info("vllm-steer: deleted preset %r (run time)", kwargs["name"])
        return res
    if op == OP_PRESET_ROLLBACK:
        return table.rollback(kwargs["name"], kwargs.get("token", ""))
    return _error(400, f"unknown steer management op {op!r}")


def load_steer_file(core, name: str, path: str, source: str,
                    protect: Collection[str] = (), put_back: bool = True) -> dict:
    """Load the steer file ``path`` as ``name``: pick a slot (never evicting a steer that a
    request uses or that ``protect`` names: the steers of the request being admitted), then
    read and check the file like at start-up, put the factors on every worker, bind the name
    (the ``load`` op's answer). Capacity comes first: a full bank answers 507 without reading
    the file (a ``--steer-dir`` first use counts it as ``bank_full``, contention, not a
    failure); a request that can never fit is a 400. A file that cannot be read is a 400
    naming it. A put that fails in a worker (or anything else before the name is bound) is
    raised with the registry as it was, but for the steer whose bank slot the load was
    taking, whose factors some workers may have overwritten: the slot is emptied in every
    worker and that steer unbound (an evicted steer-dir steer is read again on its next
    use); a name replaced in its own slot gets its previous file read again into it
    (``put_back``; else, or if that fails too, the name stays unloaded). The error records
    which (:func:`vllm_steer.integrations.guard.note_outcome`): its message says it.

    Draining slots no request uses are freed first and emptied in every worker (an
    admission's first-use load runs no op that would)."""
    from vllm_steer.format import SteerFileError, served_range_problems
    from vllm_steer.kinds import content_digest, load_any

    st = engine_state(core)
    reg, hidden = st.registry, st.hidden_size
    t0 = time.perf_counter()
    try:
        check_name(name)
    except SteerNameError as e:
        reg.counters["failures"] += 1
        return _error(400, str(e))
    never = reg.never_evicted()
    if protect and len(never | set(protect) | {name}) > reg.capacity:
        reg.counters["failures"] += 1  # never fits, however long the request waits
        return _error(400, never_fits(reg, name, protect), "too_many_steers")
    in_use = in_use_by_requests(core)
    _drop(core, reg.reap(in_use))
    try:  # capacity before the file: a full bank costs no read (the slot stays ours: this
        # op runs on the engine core's one thread, nothing binds or loads in between)
        slot, evicted = reg.free_slot(in_use, evictable=True, replacing=name, protect=protect)
    except SteerCapacityError as e:
        if source == SOURCE_STEER_DIR:  # contention, not a failure: the API server waits
            reg.counters["bank_full"] += 1
        else:
            reg.counters["failures"] += 1
        return _error(507, f"cannot load steer {name!r}: {e}")
    try:
        try:
            reg.counters["file_reads"] += 1
            stamp = file_stamp(path)
            steer = load_any(path)
        except OSError as e:  # gone, unreadable, or a folder since it was named
            raise SteerFileError(path, [f"cannot be read: {type(e).__name__}: {e}"]) from None
        reasons = []
        if applied_in_layers(steer):
            reasons = layer_steer_problems(core, st, name, steer.metadata)
        elif steer.hidden_size != hidden:
            reasons.append(f"steer {name!r} has hidden size {steer.hidden_size} but the model "
                           f"{va.model_name(va.core_model_config(core))} has {hidden}; train or "
                           "transfer the steer for this model (vllm-steer train / transfer)")
        else:  # the bank holds the factors in the model's dtype
            reasons += served_range_problems(steer, va.model_dtype(va.core_model_config(core)))
        limit = st.reserved_rank
        for what, p in (("rank", getattr(steer, "p1", None)),
                        ("domain rank", getattr(steer, "domain_p1", None))):
            if p is not None and p.shape[1] > limit:
                reasons.append(f"steer {name!r} has {what} {p.shape[1]}, over "
                               f"--max-steer-rank={limit} (the rank per steer the steer bank "
                               "reserved at start-up; default: the largest --steer file's "
                               "rank, at least 64); restart the server with a larger "
                               "--max-steer-rank or load a steer of a lower rank")
        if reasons:
            raise SteerFileError(path, reasons)
    except SteerFileError as e:
        reg.counters["failures"] += 1
        return _error(400, str(e))
    content = (content_digest(steer, va.num_hidden_layers(va.model_config(va.engine_config(core))))
               if applied_in_layers(steer) else None)
    load_id = reg.new_load_id()
    taken = reg.slots[slot]  # the entry in that slot: the evicted one, or the name's own
    previous = reg.get(name)  # the file the name holds now, if this load replaces it
    saved = _snapshot(reg)
    try:
        _workers(core, "put", slot, load_id, name, steer)
        entry = reg.commit(SteerEntry.from_metadata(name, path, steer.metadata, load_id, slot,
                                                    source, stamp, content), evicted)
    except Exception as e:  # a worker's put, or anything before the name is bound: undo it all
        _restore(reg, saved)
        reg.counters["failures"] += 1
        if taken is not None:  # its slot may hold part of the new factors now
            reg.slots[slot] = None
            if reg.bound.get(taken.name) == slot:
                reg.bound.pop(taken.name)
            if evicted is not None:
                reg.counters["evictions"] += 1
            logger.warning("vllm-steer: loading steer %r into bank slot %d failed; steer %r "
                           "(load id %d), which held that slot, is unbound%s", name, slot,
                           taken.name, taken.load_id,
                           " (read again on its next use)" if evicted is not None else "")
        _drop(core, [slot])
        if taken is not None:
            note_outcome(e, _taken_back(core, st, taken, evicted is not None, put_back))
        raise e
    st.replaced.pop(name, None)
    if previous is not None:
        st.replaced[name] = (load_id, previous)
    ms = (time.perf_counter() - t0) * 1e3
    logger.info("vllm-steer: loaded steer %r from %s (rank %d, bank slot %d, load id %d) in "
                "%.1f ms%s", name, path, entry.rank, slot, load_id, ms,
                f"; evicted {evicted.name!r} (least recently used)" if evicted else "")
    return {"ok": True, "steer": entry.to_json(), "evicted": evicted.name if evicted else None,
            "load_ms": ms}


def _taken_back(core, st, taken: SteerEntry, evicted: bool, put_back: bool) -> str:
    """What became of ``taken``, the steer whose bank slot a load that failed was taking (it
    is unbound and the slot emptied): the sentence the load's error says. The name's own
    earlier file (a replacement in its own slot) is read again into it (``put_back``)."""
    try:
        return _take_back(core, st, taken, evicted, put_back)
    except Exception:  # the load's own error is the answer; say what the registry holds
        logger.exception("vllm-steer: after a failed load, handling steer %r failed",
                         taken.name)
        now = st.registry.get(taken.name)
        return (f"steer {taken.name!r} is unloaded" if now is None else
                f"steer {taken.name!r} serves {now.file} (load id {now.load_id})")


def _take_back(core, st, taken: SteerEntry, evicted: bool, put_back: bool) -> str:
    name = taken.name
    if evicted:
        return (f"steer {name!r} (loaded from --steer-dir), whose bank slot the load was "
                "taking, is unloaded; it is read again on its next use")
    why = _load_again(core, st, taken) if put_back else None
    if put_back and why is None:
        now = st.registry.get(name)
        logger.info("vllm-steer: steer %r serves its previous file %s again (load id %d)",
                    name, taken.file, now.load_id)
        return (f"steer {name!r} serves its previous file {taken.file} again (read again "
                f"into its bank slot {now.bank_slot}: load id {now.load_id})")
    cfg = st.config
    out = f"steer {name!r} is unloaded"
    if put_back:
        out += (f": the load was replacing its previous file {taken.file} in its own bank "
                f"slot (no other was free), and that file could not be loaded again ({why})")
        logger.warning("vllm-steer: steer %r is unloaded: its previous file %s could not be "
                       "loaded again (%s)", name, taken.file, why)
    if dir_has_file(cfg.steer_dir, name):
        out += "; a request naming it loads it again from --steer-dir"
    else:
        out += "; requests naming it are refused until it is loaded again (POST /v1/steers)"
        named_by = policy_users(cfg, st.presets, name)
        if named_by:
            out += f"; it is named by {'; '.join(named_by)}"
    return out


def _load_again(core, st, was: SteerEntry) -> str | None:
    """Load the file of ``was`` again under its name (its source kept): the file a failed op
    took from the name. Why it failed (None: it serves the name again). A file changed on disk
    since it was loaded is not read (the name would serve another steer than before the
    failed op). Not a load anyone asked for: the ``loads`` and ``failures`` counters do not
    count it."""
    name, path = was.name, was.file
    if was.stamp is None or file_stamp(path) != was.stamp:
        return (f"{path} is gone or was changed on disk since it was loaded; it is not read "
                "again as this steer")
    reg = st.registry
    counted = {k: reg.counters[k] for k in ("loads", "failures")}
    try:
        res = load_steer_file(core, name, path, was.source, put_back=False)
        why = None if res.get("ok") else str(res.get("error"))
    except Exception as e:  # a worker's put again: the slot is emptied, the name unbound
        logger.warning("vllm-steer: loading steer %r again from %s failed", name, path,
                       exc_info=True)
        why = f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"
    reg.counters.update(counted)
    return why


def _restore_replaced(core, st, name: str, load_id: int) -> tuple[dict | None, str | None]:
    """Undo load ``load_id`` of ``name`` that replaced another file of that name: that file
    is loaded again from its path (its factors were overwritten), unless it changed on disk
    since (:func:`_load_again`), so that the name serves what it served before the failed
    call. ``(the entry loaded, None)``; ``(None, why)``: the file is not loaded again;
    ``(None, None)``: the load replaced nothing (either way the caller unloads the name where
    it is still bound)."""
    prev = st.replaced.pop(name, None)
    if prev is None or prev[0] != load_id:
        return None, None
    was = prev[1]
    path = was.file
    why = _load_again(core, st, was)
    if why is not None:
        logger.warning("vllm-steer: rolling back the load of steer %r (load id %d): its "
                       "previous file %s could not be loaded again (%s); the name is "
                       "unloaded", name, load_id, path, why)
        return None, why
    st.replaced.pop(name, None)
    logger.info("vllm-steer: load of steer %r (load id %d) rolled back: it failed on another "
                "data-parallel engine; its previous file %s serves the name again", name,
                load_id, path)
    return st.registry.get(name).to_json(), None


def layer_steer_problems(core, st, name: str, meta) -> list[str]:
    """Why a steer applied in the decoder layers (a vector steer) cannot be served by this
    engine: no op in its layers (started without ``--steer-vectors`` or a vector ``--steer``
    file), or a steer made for another model (hidden size, decoder blocks, architecture,
    name: :func:`vllm_steer.vectors.model_fit_problems`, naming both sides). Empty: it fits."""
    from vllm_steer.integrations.families import model_identity
    from vllm_steer.vectors import model_fit_problems

    if not st.layers_enabled:
        return [f"steer {name!r} is a {meta.kind} steer (added in the model's decoder layers), "
                "but this server was started without the op there: restart it with "
                "--steer-vectors (or with a vector steer among its --steer files)"]
    mc = va.model_config(va.engine_config(core))
    return model_fit_problems(meta, **model_identity(mc))


def _snapshot(reg) -> tuple:
    """What :meth:`~vllm_steer.integrations.engine.registry.SteerRegistry.commit` changes,
    to put back when a load fails half-way (:func:`_restore`)."""
    return (list(reg.slots), dict(reg.bound), dict(reg.counters),
            [(e, e.state) for e in reg.slots if e is not None])


def _restore(reg, saved: tuple) -> None:
    slots, bound, counters, states = saved
    reg.slots[:] = slots
    reg.bound.clear()
    reg.bound.update(bound)
    reg.counters.clear()
    reg.counters.update(counters)
    for e, state in states:
        e.state = state
