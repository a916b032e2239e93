"""Steer metrics on vLLM's ``/metrics`` (its Prometheus registry, ``prometheus_client``).

The engine core counts (loads, unloads, evictions, failures, requests steered per steer) and
the workers time the steer op; every API-server process mirrors those engine-wide values
from the ``list`` control op it polls (:mod:`vllm_steer.server.steers_route`). They are
exported as gauges in ``mostrecent`` multiprocess mode, so with ``--api-server-count N``
(Prometheus multiprocess mode) the N mirrors of one engine value show once, not summed.

======================================  =====================================================
``vllm_steer:loaded_steers``            steers loaded now (bound to a name)
``vllm_steer:max_steers``               steer slots (``--max-steers``)
``vllm_steer:requests_steered_total``   requests admitted with a steer, label ``steer``
``vllm_steer:steer_loads_total``        run-time loads (HTTP, offline, ``--steer-dir``)
``vllm_steer:steer_unloads_total``      unloads
``vllm_steer:steer_evictions_total``    least-recently-used evictions at capacity
``vllm_steer:steer_load_failures_total``  refused loads (bad file, full, bad name)
``vllm_steer:steer_op_seconds_total``   host time in the steer op, seconds, summed over the
                                        engine cores (data parallelism); per engine core,
                                        one worker holding the LM head
``vllm_steer:steer_op_calls_total``     steered LM-head calls (counted the same way)
``vllm_steer:steer_op_seconds_per_step``  mean steer-op time per steered call since the last
                                        poll (seconds)
======================================  =====================================================

Light: ``prometheus_client`` only (vLLM's own dependency).
"""

from __future__ import annotations

_METRICS = None

COUNTERS = {"loads": "vllm_steer:steer_loads_total",
            "unloads": "vllm_steer:steer_unloads_total",
            "evictions": "vllm_steer:steer_evictions_total",
            "failures": "vllm_steer:steer_load_failures_total"}


class SteerMetrics:
    def __init__(self, registry=None):
        from prometheus_client import REGISTRY, Gauge

        reg = registry or REGISTRY
        g = lambda name, doc, labels=(): Gauge(name, doc, labelnames=labels, registry=reg,  # noqa
                                               multiprocess_mode="mostrecent")
        self.loaded = g("vllm_steer:loaded_steers", "Steers loaded now.")
        self.capacity = g("vllm_steer:max_steers", "Steer slots (--max-steers).")
        self.served = g("vllm_steer:requests_steered_total",
                        "Requests admitted with a steer, per steer name.", ("steer",))
        self.counters = {k: g(name, f"Steer {k} since start.") for k, name in COUNTERS.items()}
        self.op_seconds = g("vllm_steer:steer_op_seconds_total",
                            "Host time in the steer op, seconds (summed over engine cores).")
        self.op_calls = g("vllm_steer:steer_op_calls_total", "Steered LM-head calls (summed over engine cores).")
        self.op_per_step = g("vllm_steer:steer_op_seconds_per_step",
                             "Mean steer-op time per steered call since the last poll, seconds.")
        self._last = (0.0, 0)

    def update(self, listing: dict) -> None:
        """Mirror the engine's values from a ``list`` control op's answer."""
        stats = listing.get("stats") or {}
        self.loaded.set(stats.get("loaded", 0))
        self.capacity.set(stats.get("capacity", 0))
        for name, n in (stats.get("served") or {}).items():
            self.served.labels(steer=name).set(n)
        for k, gauge in self.counters.items():
            gauge.set((stats.get("counters") or {}).get(k, 0))
        op = stats.get("op")  # control.op_totals, summed over the engine cores
        if op is not None:
            sec, calls = float(op["seconds"]), int(op["calls"])
            self.op_seconds.set(sec)
            self.op_calls.set(calls)
            ls, lc = self._last
            if calls > lc:
                self.op_per_step.set((sec - ls) / (calls - lc))
            self._last = (sec, calls)


def get_metrics() -> SteerMetrics:
    """The process's steer metrics (created on first use, on vLLM's default registry)."""
    global _METRICS
    if _METRICS is None:
        _METRICS = SteerMetrics()
    return _METRICS
