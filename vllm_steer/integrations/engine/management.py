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

import time

from vllm_steer.integrations.engine.presets import file_op
from vllm_steer.integrations.engine.registry import (SteerCapacityError, SteerEntry,
                                                     SteerNameError, bound_in, check_name)
from vllm_steer.integrations.engine.state import engine_state
from vllm_steer.integrations.protocol import (OP_LIST, OP_LOAD, OP_PRESET_ADD, OP_PRESET_DELETE,
                                              OP_PRESET_FILE, OP_PRESET_ROLLBACK, OP_PRESETS,
                                              OP_ROLLBACK, OP_UNLOAD, SOURCE_API,
                                              SOURCE_STEER_DIR, is_preset_op, op_totals)
from vllm_steer.logs import get_logger
from vllm_steer.metrics import take_new

logger = get_logger()


def _in_use(core) -> set[tuple[int, int]]:
    return bound_in(core.scheduler.requests.values())


def _workers(core, *args) -> list:
    from vllm_steer.integrations.worker.management import worker_op

    return core.model_executor.collective_rpc(worker_op, args=args)


def _error(status: int, message: str) -> dict:
    return {"ok": False, "status": status, "error": message}


def run_op(core, op: str, kwargs: dict | None = None) -> dict:
    """One management op in the engine core (see the module doc): its answer, naming this
    engine core."""
    return {**_run_op(core, op, kwargs), "engine": int(getattr(core, "engine_index", 0) or 0)}


def _run_op(core, op: str, kwargs: dict | None = None) -> dict:
    st = engine_state(core)
    reg, cfg = st.registry, st.config
    kwargs = dict(kwargs or {})
    if reg is None:
        if op == OP_LIST:
            return {"enabled": False, "steers": [], "stats": {}, "workers": []}
        return _error(404, "steering is not enabled on this server (start it with --steer, "
                      "--steer-dir or --enable-steer-updates)")
    if is_preset_op(op):  # run-time presets: no worker involved
        return _preset_op(core, cfg, op, kwargs)
    freed = reg.reap(_in_use(core))
    if freed:
        _workers(core, "drop", freed)
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
        return load_steer_file(core, kwargs["name"], kwargs["path"],
                               kwargs.get("source", SOURCE_API))
    if op == OP_UNLOAD:
        name = kwargs["name"]
        try:
            entry, freed = reg.unload(name, _in_use(core))
        except KeyError:
            return _error(404, f"steer {name!r} is not loaded; loaded steers: "
                          f"{', '.join(reg.names()) or 'none'}")
        if freed:
            _workers(core, "drop", freed)
        logger.info("vllm-steer: unloaded steer %r (generation %d)%s", name, entry.generation,
                    "" if freed else "; its slot is freed when the requests using it finish")
        return {"ok": True, "steer": entry.to_json()}
    if op == OP_ROLLBACK:
        entry = reg.get(kwargs["name"])
        gen = (kwargs.get("generations") or {}).get(str(getattr(core, "engine_index", 0) or 0))
        if entry is None or entry.generation != gen:
            return {"ok": True, "steer": None}
        _, freed = reg.unload(kwargs["name"], _in_use(core))
        reg.counters["unloads"] -= 1  # not an unload anyone asked for
        if freed:
            _workers(core, "drop", freed)
        logger.info("vllm-steer: load of steer %r (generation %d) rolled back: it failed on "
                    "another data-parallel engine", kwargs["name"], gen)
        return {"ok": True, "steer": entry.to_json()}
    return _error(400, f"unknown steer control op {op!r}")


def _preset_op(core, cfg, op: str, kwargs: dict) -> dict:
    """``presets`` (read the table), ``preset_add`` ``{"name", "steer", "token", "replace"}``
    (checked by the API server; here only the name, atomically), ``preset_delete``
    ``{"name"}``, ``preset_rollback`` ``{"name", "token"}``, ``preset_file`` ``{"presets",
    "stamp", "path"}``."""
    table = engine_state(core).presets
    if op == OP_PRESETS:
        return {"ok": True, **table.snapshot()}
    if op in (OP_PRESET_ADD, OP_PRESET_FILE):
        served = getattr(core.vllm_config.model_config, "served_model_name", None)
        reserved = {str(n): "the served model name"
                    for n in ([served] if isinstance(served, str) else served or [])}
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
    return _error(400, f"unknown steer control op {op!r}")


def load_steer_file(core, name: str, path: str, source: str) -> dict:
    """Load the steer file ``path`` as ``name``: check it like at start-up, pick a slot, put
    the factors on every worker, bind the name (the ``load`` op's answer)."""
    from vllm_steer.format import SteerFileError, load_steer

    st = engine_state(core)
    reg, cfg, hidden = st.registry, st.config, st.hidden_size
    t0 = time.perf_counter()
    try:
        check_name(name)
    except SteerNameError as e:
        reg.counters["failures"] += 1
        return _error(400, str(e))
    try:
        steer = load_steer(path)
        reasons = []
        if steer.hidden_size != hidden:
            reasons.append(f"steer {name!r} has hidden size {steer.hidden_size} but the model "
                           f"{core.vllm_config.model_config.model} has {hidden}; train or "
                           "transfer the steer for this model (vllm-steer train / transfer)")
        for what, p in (("rank", steer.p1), ("domain rank", steer.domain_p1)):
            if cfg.max_steer_rank is not None and p is not None \
                    and p.shape[1] > cfg.max_steer_rank:
                reasons.append(f"steer {name!r} has {what} {p.shape[1]}, over "
                               f"--max-steer-rank={cfg.max_steer_rank} (the steer bank is "
                               "reserved for it at start-up); restart the server with a larger "
                               "--max-steer-rank or load a steer of a lower rank")
        if reasons:
            raise SteerFileError(path, reasons)
    except SteerFileError as e:
        reg.counters["failures"] += 1
        return _error(400, str(e))
    try:
        slot, evicted = reg.free_slot(_in_use(core), evictable=True, replacing=name)
    except SteerCapacityError as e:
        reg.counters["failures"] += 1
        return _error(507, f"cannot load steer {name!r}: {e}")
    gen = reg.new_generation()
    _workers(core, "put", slot, gen, name, steer)
    entry = reg.commit(SteerEntry.from_metadata(name, path, steer.metadata, gen, slot, source),
                       evicted)
    ms = (time.perf_counter() - t0) * 1e3
    logger.info("vllm-steer: loaded steer %r from %s (rank %d, slot %d, generation %d) in "
                "%.1f ms%s", name, path, entry.rank, slot, gen, ms,
                f"; evicted {evicted.name!r} (least recently used)" if evicted else "")
    return {"ok": True, "steer": entry.to_json(), "evicted": evicted.name if evicted else None,
            "load_ms": ms}

