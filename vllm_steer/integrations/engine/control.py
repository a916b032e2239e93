"""Steers loaded and unloaded at run time: the engine-core side and the worker side.

The engine core holds the :class:`~vllm_steer.integrations.engine.registry.SteerRegistry` (it sees
every request, waiting or running). Management reaches it through vLLM's own
``collective_rpc`` on the engine client (``AsyncLLM`` in the API server, ``LLM`` offline),
with the method name :data:`~vllm_steer.integrations.engine.registry.CONTROL_METHOD`: the plugin's
hook on ``EngineCore.collective_rpc`` answers that name in the engine core (see
:func:`handle`), which updates the registry and forwards the factors to every worker (all TP
ranks) with the executor's own ``collective_rpc`` (:func:`worker_op`).

Admission: the plugin's hook on ``EngineCore.add_request`` calls :func:`bind_request`, which
resolves every steer a request names to ``(slot, generation)`` (loading it from
``--steer-dir`` on first use) and writes that into the request's sampling params; the
workers steer with exactly that slot and generation. Operations and admissions run on the
engine core's one thread, so they are ordered.

Ops (``collective_rpc(CONTROL_METHOD, args=(op, kwargs))``, one dict back):

- ``("list", {})``: ``{"steers": [...], "stats": {...}, "workers": [...], "version",
  "presets", "metrics"}`` (``metrics``: what moved since the previous ``list``,
  :func:`vllm_steer.metrics.take_new`);
- ``("load", {"name", "path", "source"})``: ``{"ok": True, "steer": {...}, "evicted": name}``
  or ``{"ok": False, "status": 400|404|409|507, "error": message}``;
- ``("unload", {"name"})``: ``{"ok": True, "steer": {...}}`` or an error as above;
- ``("rollback", {"name", "generations": {engine: generation}})``: unload ``name`` from this
  engine core if it is bound to the generation given for this engine (a load that failed on
  another engine core, see :func:`merge`);
- ``("presets", {})``, ``("preset_add", {"name", "steer", "token", "replace"})``,
  ``("preset_delete", {"name"})``, ``("preset_rollback", {"name", "token"})``,
  ``("preset_file", {"presets", "stamp", "path"})``: the run-time preset table
  (:mod:`vllm_steer.integrations.engine.presets`); every answer (and ``list``'s) carries the table
  as ``{"version", "presets"}``.

Every answer names its engine core (``"engine"``, the data-parallel rank). With data
parallelism each engine core holds its own registry and vLLM's load-balancing client sends a
utility call to every one of them: :func:`merge` makes one answer of theirs.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

from vllm_steer import REQUEST_FIELD
from vllm_steer.config import SteerServerConfig
from vllm_steer.integrations.engine.presets import PresetTable, file_op
from vllm_steer.integrations.engine.registry import (BOUND_KEY, SteerCapacityError, SteerEntry,
                                              SteerNameError, SteerRegistry, bound_in,
                                              check_name, dir_path)
from vllm_steer.integrations.engine.answers import op_totals
from vllm_steer.logs import get_logger
from vllm_steer.metrics import take_new

logger = get_logger()


class SteerAdmissionError(ValueError):
    """A request names a steer the engine cannot serve (unloaded, or its file was refused)."""


# ---- engine core -------------------------------------------------------------------------
@dataclass
class EngineSteerState:
    """The engine core's steer state, one per ``EngineCore`` (:func:`engine_state`)."""

    config: SteerServerConfig | None
    """This engine's steer configuration (None: it does not steer)."""
    registry: SteerRegistry | None
    """Which steers are loaded, in which slot and generation (None: steering is off)."""
    hidden_size: int
    """The LM head's input size: what a steer must fit."""
    presets: PresetTable = field(default_factory=PresetTable)
    """The run-time preset table (``POST /v1/steer-presets``)."""


def engine_state(core) -> EngineSteerState:
    """This engine core's :class:`EngineSteerState`, created on first use (the one accessor)."""
    st = getattr(core, "vllm_steer_state", None)
    if st is not None:
        return st
    from vllm_steer.format import read_metadata
    from vllm_steer.integrations.families import head_input_size

    cfg = SteerServerConfig.from_additional_config(core.vllm_config.additional_config)
    if cfg is None or not cfg.enabled:
        st = EngineSteerState(cfg, None, 0)
    else:
        reg = SteerRegistry(cfg.capacity)
        for slot, (name, path) in enumerate(cfg.steers.items()):  # as the workers number them
            reg.commit(SteerEntry.from_metadata(name, path, read_metadata(path),
                                                reg.new_generation(), slot, "--steer"))
        reg.counters["loads"] = 0  # start-up steers are not run-time loads
        st = EngineSteerState(cfg, reg, head_input_size(core.vllm_config.model_config))
    core.vllm_steer_state = st
    return st


def _in_use(core) -> set[tuple[int, int]]:
    return bound_in(core.scheduler.requests.values())


def _workers(core, *args) -> list:
    from vllm_steer.integrations.worker.management import worker_op

    return core.model_executor.collective_rpc(worker_op, args=args)


def _error(status: int, message: str) -> dict:
    return {"ok": False, "status": status, "error": message}


def handle(core, op: str, kwargs: dict | None = None) -> dict:
    """One management op in the engine core (see the module doc)."""
    return {**_handle(core, op, kwargs), "engine": int(getattr(core, "engine_index", 0) or 0)}


def _handle(core, op: str, kwargs: dict | None = None) -> dict:
    st = engine_state(core)
    reg, cfg = st.registry, st.config
    kwargs = dict(kwargs or {})
    if reg is None:
        if op == "list":
            return {"enabled": False, "steers": [], "stats": {}, "workers": []}
        return _error(404, "steering is not enabled on this server (start it with --steer, "
                      "--steer-dir or --enable-steer-updates)")
    if op.startswith("preset"):  # run-time presets: no worker involved
        return _preset_op(core, cfg, op, kwargs)
    freed = reg.reap(_in_use(core))
    if freed:
        _workers(core, "drop", freed)
    if op == "list":
        workers = _workers(core, "stats")
        stats = {**reg.stats(), "op": op_totals(workers)}
        return {"enabled": True, "steers": reg.listing(),
                "stats": stats, "metrics": take_new(core, stats, workers),
                "workers": workers, "steer_dir": cfg.steer_dir,
                "enable_updates": cfg.enable_updates, "updates_any_path": cfg.updates_any_path,
                **st.presets.snapshot()}
    if op == "load":
        existing = reg.get(kwargs["name"])
        if kwargs.get("source") == "steer-dir" and existing is not None:  # first use raced
            return {"ok": True, "steer": existing.to_json(), "evicted": None, "load_ms": 0.0}
        return load(core, kwargs["name"], kwargs["path"], kwargs.get("source", "api"))
    if op == "unload":
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
    if op == "rollback":
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
    """``presets`` (read the table), ``preset_add`` ``{"name", "steer", "token"}`` (checked
    by the API server; here only the name, atomically), ``preset_delete`` ``{"name"}``,
    ``preset_rollback`` ``{"name", "token"}``."""
    table = engine_state(core).presets
    if op == "presets":
        return {"ok": True, **table.snapshot()}
    if op in ("preset_add", "preset_file"):
        served = getattr(core.vllm_config.model_config, "served_model_name", None)
        reserved = {str(n): "the served model name"
                    for n in ([served] if isinstance(served, str) else served or [])}
        reserved.update({n: "a preset set by --steer-preset" for n in cfg.presets})
        if op == "preset_file":  # logged by the presets module
            return file_op(table, kwargs, reserved)
        res = table.add(kwargs["name"], kwargs["steer"], kwargs.get("token", ""), reserved,
                        replace=bool(kwargs.get("replace")))
        if res["ok"]:
            logger.info("vllm-steer: %s preset %r = %s (run time)",
                        "replaced" if res.get("replaced") else "added", kwargs["name"],
                        res["preset"]["steer"])
        return res
    if op == "preset_delete":
        res = table.delete(kwargs["name"], cfg.presets)
        if res["ok"]:
            logger.info("vllm-steer: deleted preset %r (run time)", kwargs["name"])
        return res
    if op == "preset_rollback":
        return table.rollback(kwargs["name"], kwargs.get("token", ""))
    return _error(400, f"unknown steer control op {op!r}")


def load(core, name: str, path: str, source: str) -> dict:
    """Check ``path`` like at start-up, pick a slot, put the factors on every worker, bind."""
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


def admit(core, request) -> None:
    """Admission in the engine core (the one place every entry point passes: HTTP,
    ``--api-server-count``, data parallelism, offline ``LLM``): the request's steers, decoded
    once from their serialised form, get the operator's ``--steer-default`` and
    ``--steer-floor`` (:func:`vllm_steer.policy.resolve`), then each is bound to the
    ``(slot, generation)`` that holds it (:class:`~vllm_steer.request.BoundSteer`, the form the
    workers read), loading it from ``--steer-dir`` on first use.

    Raises :class:`SteerAdmissionError` when a named steer is not loaded (and not in
    ``--steer-dir``) or its file there is refused.
    """
    from vllm_steer.policy import resolve
    from vllm_steer.request import BoundSteer, SteerRequest, unknown_steer

    sp = getattr(request, "sampling_params", None)
    if sp is None:
        return
    extra = getattr(sp, "extra_args", None) or {}
    if BOUND_KEY in extra:  # only the engine core writes it
        extra = {k: v for k, v in extra.items() if k != BOUND_KEY}
        sp.extra_args = extra
    st = engine_state(core)
    reg, cfg = st.registry, st.config
    value = extra.get(REQUEST_FIELD)
    if reg is None or (value is None and not (cfg.defaults or cfg.floors)):
        return
    try:  # request data never raises out of the engine core: refuse this request only
        steers = SteerRequest.parse(value, None, cfg.max_strength)  # decoded; limits kept
    except ValueError as e:
        raise SteerAdmissionError(str(e)) from None
    if cfg.defaults or cfg.floors:
        steers, _ = resolve(steers, None, cfg.defaults, cfg.floors)
    names = list(steers.strengths)
    for n in names:
        if n in reg.bound:
            continue
        # the same messages as the API server's own check (frontend.admission)
        if not cfg.steer_dir:
            raise SteerAdmissionError(unknown_steer(REQUEST_FIELD, n, reg.names()))
        try:
            path = dir_path(cfg.steer_dir, n)
        except SteerNameError as e:
            raise SteerAdmissionError(f"{REQUEST_FIELD}: {e}") from None
        if not os.path.isfile(path):
            raise SteerAdmissionError(unknown_steer(REQUEST_FIELD, n, reg.names(),
                                                    cfg.steer_dir))
        res = load(core, n, path, "steer-dir")
        if not res["ok"]:
            raise SteerAdmissionError(f"{REQUEST_FIELD}: {res['error']}")
    slots = reg.bind(names)
    values = steers.named
    bound = [BoundSteer(n, *slots[n], values[n]) for n in names]
    sp.extra_args = {**extra, REQUEST_FIELD: steers.to_wire(), BOUND_KEY: BoundSteer.to_wire(bound)}
