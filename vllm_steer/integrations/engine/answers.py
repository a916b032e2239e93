"""The engine cores' answers to a management op, made one (data parallelism: each engine core
holds its own registry and answers for itself). Pure functions on the answer dicts; the API
server's engine client (:mod:`vllm_steer.integrations.frontend.engine_client`) uses them.
Light: standard library only.
"""

from __future__ import annotations


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


def merge(op: str, answers: list[dict]) -> dict:
    """One answer from the answers of every engine core (data parallelism) to ``op``.

    - ``list``: a steer is ``loaded`` when every engine core has it bound, ``partial`` when
      some do (a ``--steer-dir`` steer loaded on first use, or evicted, in one engine core:
      the others load it again on their first use), else ``draining``; ``per_engine`` gives
      each engine core's slot, generation and state (they may differ: each binds its own
      requests); ``requests_served``, the counters and the steer-op time (``stats["op"]``)
      are summed over the engine cores.
    - ``load``: ok only if every engine core loaded it (the caller rolls back the others,
      see :func:`rollback_kwargs`); the first refusal is the answer.
    - ``unload``: ok if any engine core had it bound (it is bound in none afterwards).
    """
    if len(answers) == 1:
        return answers[0]
    if op.startswith("preset"):
        from vllm_steer.integrations.engine.presets import merge as merge_presets

        return merge_presets(op, answers)
    if op == "list":
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
                m["per_engine"].append({"engine": a.get("engine"), "slot": s["slot"],
                                        "generation": s["generation"], "state": s["state"],
                                        "requests_served": s.get("requests_served", 0)})
        steers = []
        for (name, loaded), m in merged.items():
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
    oks = [a for a in answers if a.get("ok")]
    if op == "load":
        if len(oks) < len(answers):
            return next(a for a in answers if not a.get("ok"))
        evicted = sorted({a["evicted"] for a in answers if a.get("evicted")})
        return {**answers[0], "evicted": ", ".join(evicted) or None,
                "steer": {**answers[0]["steer"], "per_engine": [
                    {"engine": a.get("engine"), "slot": a["steer"]["slot"],
                     "generation": a["steer"]["generation"]} for a in answers]}}
    if op == "unload":
        return oks[0] if oks else answers[0]
    return answers[0]


def rollback_kwargs(name: str, answers: list[dict]) -> dict | None:
    """``rollback`` arguments undoing a load that failed on some engine cores (None: it
    failed nowhere, or everywhere)."""
    done = {str(a.get("engine")): a["steer"]["generation"] for a in answers if a.get("ok")}
    if not done or len(done) == len(answers):
        return None
    return {"name": name, "generations": done}
