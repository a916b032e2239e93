"""What the frontend (API server, ``LLM`` process) and the engine core say to each other: the
one module both sides import (as vLLM's ``vllm/v1/engine/__init__.py`` is for its own
frontend and engine core). Neither side imports the other (import-linter checks it).

- **Management** (load / unload / list / presets): a utility call, vLLM's ``collective_rpc``
  with the method name :data:`MANAGEMENT_METHOD` and ``args=(op, kwargs)``, one of the ops
  ``OP_*`` below; the engine core answers one dict (its answer names the engine core,
  ``"engine"``). With data parallelism every engine core answers for itself:
  :func:`merge_answers` makes one answer of theirs, :func:`rollback_kwargs` undoes a load that
  only some of them took.
- **Admission**: a request's steers travel in ``SamplingParams.extra_args["steer"]`` in their
  serialised form (:meth:`vllm_steer.request.SteerRequest.to_wire`, decoded by
  :meth:`~vllm_steer.request.SteerRequest.from_wire`); a request the engine core refuses is
  finished with an error output whose ``stop_reason`` starts with :data:`REFUSED_PREFIX`.
- **Names and files**: the steer-name rule for a file name (:func:`name_problem`), and the one
  ``--steer-dir`` lookup (:func:`steer_dir_file`) the frontend and the engine core both use,
  so a request is refused with the same message wherever it is.

Light: standard library only.
"""

from __future__ import annotations

import os
from typing import Any

from vllm_steer.names import steer_name_problem
from vllm_steer.request import SteerRequestError, unknown_steer

#: ``collective_rpc`` method name of the management channel; the plugin's hook on
#: ``EngineCore.collective_rpc`` answers it in the engine core.
MANAGEMENT_METHOD = "vllm_steer_manage"
#: ``stop_reason`` prefix of the error output the engine core sends for a request whose steer
#: it refuses at admission; the API server turns it back into HTTP 400 (``param: "steer"``).
REFUSED_PREFIX = "vllm-steer refused: "
#: ``stop_reason`` prefix of the error output the engine core sends for a request whose
#: admission failed in the plugin's own code (:mod:`vllm_steer.integrations.guard`): the API
#: server answers it with HTTP 500 and the message, and the engine goes on serving.
FAILED_PREFIX = "vllm-steer failed: "
#: ``stop_reason`` prefix of the error output the engine core sends for a request whose
#: first-use steers find no room in the bank now (every slot they could take held by steers
#: running requests use): the API server answers it with HTTP 429 and ``Retry-After``.
BUSY_PREFIX = "vllm-steer busy: "
#: Attribute of a step's ``ModelRunnerOutput`` (set by the worker, read by the engine core's
#: scheduler hook): ``{request id: message}`` of the requests that step failed in the plugin's
#: worker code (:mod:`vllm_steer.integrations.worker.step_faults`). The output crosses the
#: process boundary pickled (vLLM's message queue; Ray's serialiser), which keeps it.
STEP_FAILED_ATTR = "vllm_steer_failed"

# ---- the management ops (``args=(op, kwargs)``) ---------------------------------------------
#: ``{}`` -> ``{"enabled", "steers": [...], "stats": {...}, "workers": [...], "version",
#: "presets", ...}``.
OP_LIST = "list"
#: ``{"name", "path", "source"}`` -> ``{"ok": True, "steer": {...}, "evicted": name,
#: "load_ms"}`` or ``{"ok": False, "status": 400|404|409|507, "error": message}``.
OP_LOAD = "load"
#: ``{"name"}`` -> ``{"ok": True, "steer": {...}}`` or an error as above.
OP_UNLOAD = "unload"
#: ``{"name", "load_ids": {engine: load_id}}``: unload ``name`` from an engine core that
#: holds it under the load id given for it (a load that failed on another engine core).
OP_ROLLBACK = "rollback"
#: ``{}`` -> the run-time preset table ``{"ok", "version", "presets"}``.
OP_PRESETS = "presets"
#: ``{"name", "steer", "token", "replace"}``: add a run-time preset (``replace``: the ``PUT``,
#: which swaps a run-time preset's mix in one step; ``"replaced"``: the mix before).
OP_PRESET_ADD = "preset_add"
#: ``{"name"}``: delete a run-time preset.
OP_PRESET_DELETE = "preset_delete"
#: ``{"name", "token"}``: undo the add of ``token`` (it failed on another engine core).
OP_PRESET_ROLLBACK = "preset_rollback"
#: ``{"presets", "stamp", "path"}``: the presets file's presets, replacing its last version.
OP_PRESET_FILE = "preset_file"
#: ``{}`` -> ``{"ok": True, "ticket": n}``: a number for a change (data parallelism: engine
#: core 0's orders the changes of a name, see
#: :mod:`vllm_steer.integrations.engine.change_order`).
OP_TICKET = "ticket"
#: The argument of a load, unload, preset add or delete that carries its ticket.
TICKET_KEY = "ticket"
#: The ops that change a name and carry a ticket under data parallelism, and the kind of name
#: each changes (a steer's and a preset's names are ordered apart).
ORDERED_OPS = {OP_LOAD: "steer", OP_UNLOAD: "steer", OP_PRESET_ADD: "preset",
               OP_PRESET_DELETE: "preset"}
#: Every op the engine core answers.
OPS = (OP_LIST, OP_LOAD, OP_UNLOAD, OP_ROLLBACK, OP_PRESETS, OP_PRESET_ADD, OP_PRESET_DELETE,
       OP_PRESET_ROLLBACK, OP_PRESET_FILE, OP_TICKET)
#: Where a steer was loaded from (``"source"`` of a load; ``--steer`` ones at start-up).
SOURCE_STARTUP, SOURCE_STEER_DIR, SOURCE_API, SOURCE_OFFLINE = \
    "--steer", "steer-dir", "api", "offline"
SOURCES = (SOURCE_STARTUP, SOURCE_STEER_DIR, SOURCE_API, SOURCE_OFFLINE)


def is_preset_op(op: str) -> bool:
    """Whether ``op`` is one of the run-time preset table's ops (no worker involved)."""
    return op.startswith("preset")


# ---- how many steers one request may be served with ------------------------------------------
def count_problem(names, per_request: int, capacity: int, where: str) -> str | None:
    """Why a request served with the steers ``names`` (after presets, defaults and floors)
    cannot be admitted for their number, else None: over ``--max-steers-per-request``
    (``per_request``), or over what the bank holds at once (``--max-steers``, ``capacity``).
    The frontend and the engine core refuse with this one message."""
    n = len(names)
    shown = ", ".join(repr(x) for x in list(names)[:12]) + (", ..." if n > 12 else "")
    if n > per_request:
        return (f"{where}: the request is served with {n} steers ({shown}), over the "
                f"server's limit of {per_request} per request (--max-steers-per-request="
                f"{per_request}; presets, --steer-default and --steer-floor count too); send "
                "fewer steers, or restart the server with a larger --max-steers-per-request")
    if n > capacity:
        return (f"{where}: the request is served with {n} steers ({shown}), but the steer "
                f"bank holds at most {capacity} at once (--max-steers={capacity}); send at "
                f"most {capacity} steers in one request, or restart the server with a larger "
                "--max-steers")
    return None


# ---- names and --steer-dir files --------------------------------------------------------------
class SteerNameError(ValueError):
    """A steer name is not allowed (charset, length, path separators)."""


def name_problem(name: Any) -> str | None:
    """Why ``name`` cannot name a steer or a file in ``--steer-dir``, else None: the steer-name
    rule (:func:`vllm_steer.names.steer_name_problem`), and no leading ``.`` or ``..``."""
    problem = steer_name_problem(name)
    if problem is not None:
        return problem
    if name.startswith(".") or ".." in name:
        return f"steer name {name!r} may not start with '.' or contain '..'"
    return None


def check_name(name: Any) -> str:
    """``name`` if it may name a steer, else :class:`SteerNameError` saying why."""
    problem = name_problem(name)
    if problem:
        raise SteerNameError(problem)
    return name


#: The file suffixes a ``--steer-dir`` steer may have, looked up in this order: the project's
#: steer file (either kind), then llama.cpp's control-vector GGUF.
STEER_DIR_SUFFIXES = (".safetensors", ".gguf")


def steer_dir_names(steer_dir: str | None) -> set[str]:
    """The steer names ``--steer-dir`` has files for (``NAME`` + one of
    :data:`STEER_DIR_SUFFIXES`); empty without a directory."""
    if not steer_dir or not os.path.isdir(steer_dir):
        return set()
    return {f[:-len(sfx)] for f in os.listdir(steer_dir) for sfx in STEER_DIR_SUFFIXES
            if f.endswith(sfx) and len(f) > len(sfx)}


def dir_has_file(steer_dir: str | None, name: str) -> bool:
    """Whether ``--steer-dir`` holds an entry for ``name`` under one of its suffixes."""
    return bool(steer_dir) and any(os.path.lexists(os.path.join(steer_dir, name + sfx))
                                   for sfx in STEER_DIR_SUFFIXES)


def dir_path(steer_dir: str, name: str) -> str:
    """``DIR/NAME.safetensors`` (or, when only that exists, ``DIR/NAME.gguf``: a control
    vector) for a valid ``name``; never a path outside ``steer_dir``."""
    check_name(name)
    root = os.path.realpath(steer_dir)
    paths = [os.path.realpath(os.path.join(root, name + sfx)) for sfx in STEER_DIR_SUFFIXES]
    path = next((p for p in paths if os.path.isfile(p)), paths[0])
    if os.path.dirname(path) != root:  # a symlink pointing out of the directory
        raise SteerNameError(f"steer {name!r}: {path} is outside --steer-dir {steer_dir}")
    return path


def steer_dir_file(steer_dir: str | None, name: str, loaded, where: str) -> str:
    """The file of a steer a request names that is not loaded: ``--steer-dir``'s
    ``NAME.safetensors`` or ``NAME.gguf`` (loaded on first use). Raises
    :class:`SteerRequestError` with the one message the frontend and the engine core both
    give: unknown steer (no ``--steer-dir``, or no such file there, listing ``loaded``), or a
    name that cannot be a file name."""
    if not steer_dir:
        raise SteerRequestError(unknown_steer(where, name, loaded), "unknown_steer")
    try:
        path = dir_path(steer_dir, name)
    except SteerNameError as e:
        raise SteerRequestError(f"{where}: {e}") from None
    if not os.path.isfile(path):
        raise SteerRequestError(unknown_steer(where, name, loaded, steer_dir), "unknown_steer")
    return path


# ---- the engine cores' answers made one (data parallelism) ----------------------------------
def op_totals(workers: list) -> dict:
    """The steer-op time of one engine core: that of its worker with the most steered calls.

    Every worker holding the LM head steers the same rows (tensor parallelism: each rank its
    copy of the hidden states), so one of them stands for the engine core; with pipeline
    parallelism only the last stage has the head (the others count nothing)."""
    found = [w for w in workers or [] if isinstance(w, dict)]
    if not found:
        return {"seconds": 0.0, "calls": 0}
    w = max(found, key=lambda w: int(w.get("op_calls", 0)))
    return {"seconds": float(w.get("op_seconds", 0.0)), "calls": int(w.get("op_calls", 0))}


def merge_answers(op: str, answers: list[dict]) -> dict:
    """One answer from the answers of every engine core (data parallelism) to ``op``.

    - ``list``: a steer is ``loaded`` when every engine core has it bound, ``partial`` when
      some do (a ``--steer-dir`` steer loaded on first use, or evicted, in one engine core:
      the others load it again on their first use), else ``draining``; ``per_engine`` gives
      each engine core's bank slot, load id and state (they may differ: each binds its own
      requests); ``requests_served``, the counters and the steer-op time (``stats["op"]``)
      are summed over the engine cores.
    - ``load``: ok only if every engine core loaded it (the caller rolls back the others,
      see :func:`rollback_kwargs`); the first refusal is the answer.
    - ``unload``: ok if any engine core had it bound (it is bound in none afterwards).
    - the preset ops: see :func:`merge_preset_answers`.
    - a change an engine core refused because a newer change of the name reached it first
      (``superseded``, see :mod:`vllm_steer.integrations.engine.change_order`): that refusal,
      whatever the others answered (the newer change stands on every engine core).
    """
    if len(answers) == 1:
        return answers[0]
    superseded = next((a for a in answers if a.get("superseded")), None)
    if superseded is not None:
        return superseded
    if is_preset_op(op):
        return merge_preset_answers(op, answers)
    if op == OP_LIST:
        return _merge_lists(answers)
    oks = [a for a in answers if a.get("ok")]
    if op == OP_LOAD:
        if len(oks) < len(answers):
            return next(a for a in answers if not a.get("ok"))
        evicted = sorted({a["evicted"] for a in answers if a.get("evicted")})
        return {**answers[0], "evicted": ", ".join(evicted) or None,
                "steer": {**answers[0]["steer"], "per_engine": [
                    {"engine": a.get("engine"), "bank_slot": a["steer"]["bank_slot"],
                     "load_id": a["steer"]["load_id"]} for a in answers]}}
    if op == OP_UNLOAD:
        return oks[0] if oks else answers[0]
    return answers[0]


def _merge_lists(answers: list[dict]) -> dict:
    failed = [a for a in answers if a.get("ok") is False]
    if failed:  # an engine core's list failed: its answer (status, error) is the answer
        return failed[0]
    if not all(a.get("enabled") for a in answers):
        return answers[0]
    n = len(answers)
    merged: dict[tuple, dict] = {}
    for a in answers:
        for s in a["steers"]:
            key = (s["name"], s["state"] == "loaded")
            m = merged.get(key)
            if m is None:
                m = merged[key] = {**s, "requests_served": 0, "per_engine": []}
            m["requests_served"] += s.get("requests_served", 0)
            m["per_engine"].append({"engine": a.get("engine"), "bank_slot": s["bank_slot"],
                                    "load_id": s["load_id"], "state": s["state"],
                                    "requests_served": s.get("requests_served", 0)})
    steers = []
    for (_name, loaded), m in merged.items():
        if loaded:
            m["state"] = "loaded" if len(m["per_engine"]) == n else "partial"
        steers.append(m)
    stats = dict(answers[0]["stats"])
    stats["counters"] = {k: sum(a["stats"]["counters"].get(k, 0) for a in answers)
                         for k in answers[0]["stats"]["counters"]}
    served: dict[str, int] = {}
    for a in answers:
        for k, v in a["stats"].get("served", {}).items():
            served[k] = served.get(k, 0) + v
    stats["served"] = served
    ops = [a["stats"].get("op") or op_totals(a.get("workers")) for a in answers]
    stats["op"] = {"seconds": sum(o["seconds"] for o in ops),
                   "calls": sum(o["calls"] for o in ops)}
    stats["loaded"] = sum(1 for s in steers if s["state"] != "draining")
    stats["draining"] = sum(1 for s in steers if s["state"] == "draining")
    stats["engines"] = n
    return {**answers[0], "steers": steers, "stats": stats,
            "metrics": [a.get("metrics") for a in answers],  # vllm_steer.metrics.take_new
            "workers": [w for a in answers for w in (a.get("workers") or [])]}


def merge_preset_answers(op: str, answers: list[dict]) -> dict:
    """One answer of the engine cores' answers (data parallelism) to a preset op: an add (or
    replacement, or file) is ok if every engine core took it (else the first refusal: the
    caller rolls back the others), a delete if any had it; the table read is engine core 0's."""
    if len(answers) == 1:
        return answers[0]
    if op in (OP_PRESET_ADD, OP_PRESET_FILE):
        return next((a for a in answers if not a.get("ok")), answers[0])
    if op == OP_PRESET_DELETE:
        return next((a for a in answers if a.get("ok")), answers[0])
    return answers[0]


def rollback_kwargs(name: str, answers: list[dict]) -> dict | None:
    """``rollback`` arguments undoing a load that failed on some engine cores (None: it
    failed nowhere, or everywhere)."""
    done = {str(a.get("engine")): a["steer"]["load_id"] for a in answers if a.get("ok")}
    if not done or len(done) == len(answers):
        return None
    return {"name": name, "load_ids": done}

