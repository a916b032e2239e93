"""The management client: one management op (list / load / unload / presets) sent to every
engine core, the answers merged, a partial change rolled back, and this process's views
refreshed. The HTTP routes (:mod:`vllm_steer.server`) use :func:`manage` on the API server's
``AsyncLLM``; offline, :mod:`vllm_steer.offline` uses :func:`manage_sync` on an ``LLM``.

The op itself runs in the engine core (:mod:`vllm_steer.integrations.engine.management`),
reached through vLLM's ``collective_rpc`` utility call with the method name
:data:`~vllm_steer.integrations.protocol.MANAGEMENT_METHOD`. With data parallelism each engine
core holds its own registry and vLLM's load-balancing client sends a utility call to every one
of them: their answers are merged (:func:`~vllm_steer.integrations.protocol.merge_answers`).
Light: no torch at import time.
"""

from __future__ import annotations

from typing import Any

from vllm_steer.integrations import vllm_access as va
from vllm_steer.integrations.frontend.state import engine_scope, frontend_state
from vllm_steer.integrations.protocol import (MANAGEMENT_METHOD, OP_LIST, OP_LOAD,
                                              OP_PRESET_ADD, OP_PRESET_ROLLBACK, OP_PRESETS,
                                              OP_ROLLBACK, OP_TICKET, OP_UNLOAD, ORDERED_OPS,
                                              SOURCE_STEER_DIR, TICKET_KEY, is_preset_op,
                                              merge_answers, rollback_kwargs)
from vllm_steer.logs import get_logger

logger = get_logger()


def _rolled_back(res: dict, undo: dict, answers: list[dict]) -> dict:
    """A load refused by an engine core and rolled back on those that had loaded it: the
    refusal, saying what the name serves on each of those, from its ``rollback`` answer
    (``answers``): its previous file again, nothing (unloaded: it had none, or it could not
    be loaded again), or, where the rollback failed, still the refused load
    (``rollback_failed``: those engine cores)."""
    name = undo["name"]
    by_engine = {str(a.get("engine")): a for a in answers}
    notes, failed = [], []
    for engine in sorted(undo["load_ids"]):
        a = by_engine.get(engine) or {"error": "no answer"}
        if not a.get("ok"):
            failed.append(engine)
            notes.append(f"engine core {engine} could not undo it ({a.get('error')}): there "
                         f"{name!r} serves the file of this load; send the load again, or "
                         f"DELETE /v1/steers/{name}")
        elif a.get("restored"):
            notes.append(f"undone on engine core {engine}: {name!r} serves its previous file "
                         "there again")
        elif a.get("previous_lost"):
            notes.append(f"undone on engine core {engine}, but {name!r} is unloaded there: "
                         f"its previous file could not be loaded again ({a['previous_lost']})")
        elif a.get("steer") is None:
            notes.append(f"nothing to undo on engine core {engine} ({name!r} was loaded "
                         "again since)")
        else:
            notes.append(f"undone on engine core {engine}")
    out = {**res, "error": f"{res['error']} (data parallelism: refused by engine core "
                           f"{res.get('engine')}; {'; '.join(notes)})"}
    if failed:
        out["rollback_failed"] = failed
    return out


def _unload_failed_somewhere(res: dict, answers: list[dict]) -> dict:
    """An unload that some engine cores did and another failed (not a 404: it had the name):
    that engine core still serves the name, so the call answers its error (sending it again
    unloads it there; the others answer 404, which the merged answer ignores)."""
    failed = [a for a in answers if not a.get("ok") and a.get("status") != 404]
    if not failed:
        return res
    done = sorted(str(a.get("engine")) for a in answers if a.get("ok"))
    return {**failed[0], "error": f"{failed[0]['error']} (data parallelism: unloaded by "
                                  f"engine core(s) {', '.join(done)} only; send the call again "
                                  "to unload it from the others)"}


def _take_views(op: str, res: dict, metrics: bool = True) -> None:
    """This process's views from an answer: the run-time presets (every answer has them), and
    from a ``list`` the names it admits and the metrics."""
    st = frontend_state()
    if is_preset_op(op) or op == OP_LIST:
        st.update_presets(res)
    if op == OP_LIST and res.get("enabled"):
        st.set_loaded(s["name"] for s in res["steers"] if s["state"] != "draining")
        if not metrics:
            return
        try:
            from vllm_steer.metrics import get_metrics

            get_metrics().update(res)
        except Exception:  # metrics never break serving
            logger.exception("vllm-steer: metrics update failed")


async def manage(engine, op: str, **kwargs) -> dict:
    """One management op in every engine core: their answers merged, a load or preset add
    that only some of them took rolled back, this process's views (names, presets, metrics)
    refreshed. With data parallelism a change of a name first takes a ticket from engine core
    0, so that every engine core applies the changes of one name in one order (see
    :mod:`vllm_steer.integrations.engine.change_order`)."""
    if _ordered(engine, op, kwargs):
        tickets = await _every_engine(engine, OP_TICKET, {})
        first = min(tickets, key=lambda a: int(a.get("engine") or 0))
        if not first.get("ok"):
            return first
        kwargs = {**kwargs, TICKET_KEY: first["ticket"]}
    answers = await _every_engine(engine, op, kwargs)
    res = merge_answers(op, answers)
    first_use = op == OP_LOAD and kwargs.get("source") == SOURCE_STEER_DIR
    if first_use and not res.get("ok") and any(a.get("ok") for a in answers):
        # data parallelism: a first use loaded where there was room is kept (partial), not
        # undone; an engine core without room loads it at its own first use, or refuses there
        res = next(a for a in answers if a.get("ok"))
    elif op == OP_LOAD and not res.get("ok"):
        undo = rollback_kwargs(kwargs["name"], answers)
        if undo is not None:  # loaded by some engine cores only: undo it on those
            res = _rolled_back(res, undo, await _every_engine(engine, OP_ROLLBACK, undo))
    if op == OP_UNLOAD and res.get("ok"):
        res = _unload_failed_somewhere(res, answers)
    if op == OP_PRESET_ADD and not res.get("ok") and any(a.get("ok") for a in answers):
        # data parallelism: added by some engine cores only: take it out of those again
        await _every_engine(engine, OP_PRESET_ROLLBACK, {"name": kwargs["name"],
                                                         "token": kwargs.get("token", "")})
        res = await manage(engine, OP_PRESETS) | {k: res[k] for k in ("ok", "status", "error")}
    _take_views(op, res)
    if op in (OP_LOAD, OP_UNLOAD) and not _bank_full(op, kwargs, answers):
        await manage(engine, OP_LIST)  # refused ones too: the failure counters moved
    return res


def _ordered(engine, op: str, kwargs: dict) -> bool:
    """Whether ``op`` changes a name in several engine cores (data parallelism), so it takes a
    ticket first. A first use's load does not: it fills the name where it is missing, and each
    engine core evicts its first-use steers on its own anyway."""
    return (op in ORDERED_OPS and kwargs.get("source") != SOURCE_STEER_DIR
            and va.engine_core_count(engine) > 1)


def _bank_full(op: str, kwargs: dict, answers: list[dict]) -> bool:
    """Whether every engine core answered a first-use load with a full bank (507): nothing
    moved but a contention count, so no ``list`` follows (a request waiting for a slot asks
    again, and each ask stays one cheap call)."""
    return (op == OP_LOAD and kwargs.get("source") == SOURCE_STEER_DIR and bool(answers)
            and all(not a.get("ok") and a.get("status") == 507 for a in answers))


async def _every_engine(engine, op: str, kwargs: dict) -> list[dict]:
    """The op in every engine core this API server's client manages, one answer each.

    vLLM's load-balancing data-parallel client sends each utility call to every engine core
    but returns the first answer (``DPLBAsyncMPClient.call_utility_async``); its
    ``call_utility_all_async`` (one answer per engine core, what ``collective_rpc`` runs on
    each) gives them all. A single engine core: the same, one answer."""
    return await va.collective_rpc_every_core(engine, MANAGEMENT_METHOD, (op, kwargs))


async def refresh_presets(engine: Any = None) -> dict[str, dict[str, float]]:
    """Read the run-time preset table from the engine core (one utility call) into this
    process's view; returns the view. Without an engine client (offline), or if the call
    fails, the view as it is."""
    st = frontend_state()
    engine = engine if engine is not None else st.engine
    if engine is not None:
        try:
            await manage(engine, OP_PRESETS)
        except Exception as e:  # the engine is shutting down: the request fails anyway
            logger.debug("vllm-steer: reading the run-time presets failed: %s", e)
    return st.presets_view()


def manage_sync(llm: Any, op: str, **kwargs) -> dict:
    """:func:`manage` for an offline ``vllm.LLM`` (one engine core, in order with its
    ``generate`` calls): the op, then the list that refreshes this process's views."""
    res = va.llm_collective_rpc(llm, MANAGEMENT_METHOD, (op, kwargs))[0]
    listed = res if op == OP_LIST else va.llm_collective_rpc(llm, MANAGEMENT_METHOD,
                                                             (OP_LIST, {}))[0]
    with engine_scope(va.llm_input_processor(llm)):  # this LLM's view, not another engine's
        _take_views(op, res, metrics=False)
        if op != OP_LIST:
            _take_views(OP_LIST, listed, metrics=False)
    return res
