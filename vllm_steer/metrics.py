"""Steer metrics on vLLM's ``/metrics`` (its Prometheus registry, ``prometheus_client``).

Three processes take part, each with its own part here:

- the workers time one steer op in 64 (:class:`OpTimer`), each timed op counting for the
  untimed ones before it: its host time; on CUDA its device time from CUDA events, read only
  once the device has passed them (``Event.query``), so timing never makes the host wait; on
  the CPU the op runs on the host, so its device time is its host time;
- the engine core counts loads, unloads, evictions, refused loads and requests steered per
  steer; each ``list`` management op hands what moved since the previous ``list`` to the API
  server that asked (:func:`take_new`): every increment goes to exactly one API server;
- every API server polls ``list`` (once a second, :mod:`vllm_steer.server.steers_route`) and
  adds what it was handed to its counters (:class:`SteerMetrics`). With
  ``--api-server-count N`` (Prometheus multiprocess mode) ``/metrics`` sums the counters of
  the N processes: each increment once, never N times. Levels (steers loaded, slots, the
  per-step mean) are gauges in ``mostrecent`` mode: the last value any process saw.

Every counter and the per-step gauge carry the label ``engine``: the engine core's
data-parallel rank, as in vLLM's own metrics (``0`` without data parallelism).

=========================================  ==================================================
``vllm_steer:loaded_steers``               gauge: steers loaded now (bound to a name)
``vllm_steer:max_steers``                  gauge: steer slots (``--max-steers``)
``vllm_steer:requests_steered_total``      counter: requests admitted with a steer, label
                                           ``steer``
``vllm_steer:steer_loads_total``           counter: run-time loads (HTTP, offline,
                                           ``--steer-dir``)
``vllm_steer:steer_unloads_total``         counter: unloads
``vllm_steer:steer_evictions_total``       counter: least-recently-used evictions at capacity
``vllm_steer:steer_load_failures_total``   counter: refused loads (bad file, bad name, a full
                                           bank for a load over HTTP or offline; not a
                                           first use that waits for a slot)
``vllm_steer:steer_file_reads_total``      counter: steer files read by run-time loads
``vllm_steer:bank_full_waits_total``       counter: requests that found every slot they
                                           could take held and waited, label ``outcome``
                                           (``loaded``; ``retry_after``: answered HTTP 429)
``vllm_steer:requests_refused_total``      counter: requests the plugin refused, labels
                                           ``status`` (``400``, ``404``: the request's
                                           error; ``429``: no room in the bank now, retry;
                                           ``500``: a fault of the plugin),
                                           ``reason`` (:data:`~vllm_steer.request.
                                           REFUSAL_REASONS`) and ``source`` (``api_server``
                                           or ``engine_core``: where it was refused; an API
                                           server's refusals carry no ``engine``)
``vllm_steer:head_eager``                  gauge: 1 while the LM head's steer op is launched
                                           eagerly where it should replay from CUDA graphs
                                           (no rank reserved: no ``--steer`` file and no
                                           ``--max-steer-rank``; or a failed capture),
                                           else 0 (also where no graphs are used by choice:
                                           CPU, ``--enforce-eager``, a named backend)
``vllm_steer:start_time_seconds``          gauge: when this server's API server started
                                           (Unix time); a change means a restart
``vllm_steer:steer_op_seconds_total``      counter: time the device spent in the steer op
                                           (CUDA events; on the CPU the host time), from one
                                           op in 64
``vllm_steer:steer_op_host_seconds_total``  counter: host time in the steer op (on CUDA the
                                           launch cost, not the op), from one op in 64
``vllm_steer:steer_op_calls_total``        counter: steered LM-head calls
``vllm_steer:steer_op_seconds_per_step``   gauge: mean device time per timed steered call
                                           since the previous poll, seconds
``vllm_steer:presets_file_refused``        gauge: 1 while the newest version of the presets
                                           file is refused (retried every poll) and an older
                                           one serves, else 0
``vllm_steer:presets_file_reloads_total``  counter: versions of the presets file loaded (the
                                           one read at start-up included)
``vllm_steer:presets_file_refusals_total``  counter: versions of the presets file refused
                                           (once per version, not per retry)
=========================================  ==================================================

Refusals are counted where they happen, once each: the API server counts what it refuses
itself (the body's check, the policy, a ``--steer-dir`` load it waits for, an unknown model
name) in its own process, so with ``--api-server-count N`` the multiprocess sum counts each
once (:func:`count_refusal`); the engine core counts what it refuses at admission and hands the
counts out with the other counters (:func:`take_new`), and the API server that turns such a
refusal into the client's HTTP 400 does not count it again.

The presets file's metrics come from the API servers that read the file
(:class:`vllm_steer.server.presets_route.PresetsFileWatcher`) and carry no ``engine`` label: a
version loads into every engine core at once. A reload counts once per server (only the API
server whose read changed the engine core's table counts it); with ``--api-server-count N``
every API server reads the file, so a refused version counts once in each of them.

The op values are per engine core those of one worker that holds the LM head (tensor
parallelism: every rank steers the same rows; pipeline parallelism: the last stage).

Light: ``prometheus_client`` only (vLLM's own dependency); torch only inside :class:`OpTimer`'s
CUDA path (the worker has it loaded).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any

LOADED = "vllm_steer:loaded_steers"
CAPACITY = "vllm_steer:max_steers"
REQUESTS_STEERED = "vllm_steer:requests_steered_total"
OP_SECONDS = "vllm_steer:steer_op_seconds_total"
OP_HOST_SECONDS = "vllm_steer:steer_op_host_seconds_total"
OP_CALLS = "vllm_steer:steer_op_calls_total"
OP_SECONDS_PER_STEP = "vllm_steer:steer_op_seconds_per_step"
#: 1 while the LM head's op runs eagerly where it should replay from CUDA graphs, else 0.
HEAD_EAGER = "vllm_steer:head_eager"
#: When the API server started (Unix time): a change is a restart.
START_TIME = "vllm_steer:start_time_seconds"
#: 1 while the newest version of ``--steer-presets-file`` on disk is refused and an older one
#: serves, else 0.
PRESETS_FILE_REFUSED = "vllm_steer:presets_file_refused"
#: Versions of the presets file taken (counter).
PRESETS_FILE_RELOADS = "vllm_steer:presets_file_reloads_total"
#: Versions of the presets file refused (counter).
PRESETS_FILE_REFUSALS = "vllm_steer:presets_file_refusals_total"
#: The engine core's registry counters (``SteerRegistry.counters`` keys) -> metric names.
COUNTERS = {"loads": "vllm_steer:steer_loads_total",
            "unloads": "vllm_steer:steer_unloads_total",
            "evictions": "vllm_steer:steer_evictions_total",
            "failures": "vllm_steer:steer_load_failures_total",
            "file_reads": "vllm_steer:steer_file_reads_total"}
#: Requests whose first-use steer found the bank full and waited for a slot (counted by the
#: API server that waited, once per request), label ``outcome``: ``loaded`` (a slot freed in
#: time) or ``retry_after`` (HTTP 429 with ``Retry-After``).
BANK_FULL_WAITS = "vllm_steer:bank_full_waits_total"
BANK_FULL_OUTCOMES = ("loaded", "retry_after")
#: Requests the plugin refused, labels ``status`` (HTTP), ``reason``
#: (:data:`~vllm_steer.request.REFUSAL_REASONS`) and ``source`` (:data:`SOURCES`).
REQUESTS_REFUSED = "vllm_steer:requests_refused_total"
#: Where a request was refused: the ``source`` label.
API_SERVER, ENGINE_CORE = "api_server", "engine_core"
SOURCES = (API_SERVER, ENGINE_CORE)
#: The HTTP status of each refusal reason that is not 400 (``vllm_steer.request.
#: REFUSAL_REASONS``).
REASON_STATUS = {"unknown_preset": 404, "bank_full": 429, "internal": 500}
#: The label naming the engine core (data-parallel rank), as vLLM's own metrics name it.
ENGINE_LABEL = "engine"
#: A worker's op values in its ``stats`` answer (cumulative since start).
OP_KEYS = ("op_seconds", "op_host_seconds", "op_calls", "op_timed_calls")

#: One steer op in this many is timed (host and device), and counts for the untimed ones
#: before it: timing every op would add two CUDA event records (on the CPU, two clock reads
#: and their sums) to every steered step's host work. In a GPU engine one timed op in 16
#: cost about 5 us per steered step on average (an H100 host); one in 64 should cost about
#: 1.4 us (estimated from that, not measured), and the counters trail the calls by at most 63
#: ops (a fraction of a second of decoding).
TIMER_SAMPLE_EVERY = 64
#: Event pairs a worker keeps recorded before it reads the finished ones by itself.
TIMER_POLL_EVERY = 64
#: Most event pairs in flight; past it an op goes untimed (its call still counts).
TIMER_MAX_PENDING = 4096

_METRICS = None


# ---- worker: timing the op -----------------------------------------------------------------
class OpTimer:
    """The steer op's time in one worker: host time, and device time that never syncs, from
    one op in :data:`TIMER_SAMPLE_EVERY`.

    The caller times one op in :data:`TIMER_SAMPLE_EVERY`: ``token = timer.start(hidden)``
    before it, ``untimed = timer.stop(token)`` after it, then the next ``untimed`` ops with no
    call into the timer (the caller counts them down on its own object: the head's step
    planner, whose steady step touches nothing more). A timed op stands for itself
    and the untimed ones before it (:attr:`weight` of them): its time counts that many times,
    so the seconds are an estimate that only grows, exact in the mean, and trail the calls by
    at most ``TIMER_SAMPLE_EVERY - 1`` ops. The first op is timed alone.

    Thread-safe where it must be: a worker's ``stats`` op (:meth:`report`) may run beside a
    step (Ray's compiled graphs run the step on a thread of their own while the actor's other
    calls run on its main thread), so the pairs are read under a lock.

    On CUDA a pair of timing events (reused) is recorded around a timed op on the current
    stream; the device time of a pair is read (``elapsed_time``) only after ``query()`` says
    the device has passed its end event; pairs not finished yet stay for the next read
    (:meth:`poll`, run by :meth:`report` and every :data:`TIMER_POLL_EVERY` pairs). While a
    CUDA graph is captured nothing is recorded (a captured op has no time of its own). On the
    CPU the op runs synchronously on the host: its device time is its host time.
    """

    def __init__(self):
        self.host_seconds = 0.0
        self.device_seconds = 0.0
        self.timed_calls = 0  # ops whose device time is in device_seconds (weights summed)
        self.weight = 1  # the ops the next timed one stands for
        self._pending: deque = deque()  # (start, end, weight) of pairs not read yet
        self._free: list = []  # pairs read, for reuse
        self._lock = threading.Lock()  # the pairs: a step's stop() and a stats op's report()

    def start(self, t: Any) -> tuple:
        """Before a timed op on tensor ``t``: the token :meth:`stop` takes."""
        cuda = t.is_cuda
        return time.perf_counter(), self._record_start() if cuda else None, cuda

    def stop(self, token: tuple) -> int:
        """After the timed op (its kernels launched): how many ops the caller leaves untimed
        before it times the next one (which stands for them)."""
        t0, pair, cuda = token
        dt = time.perf_counter() - t0
        w = self.weight
        self.weight = TIMER_SAMPLE_EVERY
        self.host_seconds += dt * w
        if not cuda:
            self.device_seconds += dt * w
            self.timed_calls += w
        elif pair is not None:
            pair[1].record()
            with self._lock:
                self._pending.append((*pair, w))
                many = len(self._pending) >= TIMER_POLL_EVERY
            if many:
                self.poll()
        return TIMER_SAMPLE_EVERY - 1

    def _record_start(self):
        import torch

        if torch.cuda.is_current_stream_capturing() or len(self._pending) >= TIMER_MAX_PENDING:
            return None
        with self._lock:
            pair = self._free.pop() if self._free else None
        if pair is None:
            pair = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        pair[0].record()
        return pair

    def poll(self) -> None:
        """Add the device time of every op the device has finished, oldest first; stop at
        the first one it has not (``query()``: never a wait)."""
        with self._lock:
            while self._pending and self._pending[0][1].query():
                start, end, w = self._pending.popleft()
                self.device_seconds += start.elapsed_time(end) / 1000.0 * w
                self.timed_calls += w
                self._free.append((start, end))

    def report(self) -> dict:
        """The cumulative values a worker's ``stats`` answer carries (after a :meth:`poll`)."""
        self.poll()
        return {"op_seconds": self.device_seconds, "op_host_seconds": self.host_seconds,
                "op_timed_calls": self.timed_calls}


# ---- engine core: what moved since the previous list ---------------------------------------
def engine_totals(stats: dict, workers: list | None) -> dict:
    """One engine core's cumulative values: its registry's counters and requests steered per
    name (``stats``), and the op values of its worker with the most steered calls (every
    worker holding the LM head steers the same rows; one without the head counts nothing)."""
    found = [w for w in workers or [] if isinstance(w, dict)]
    head = max(found, key=lambda w: int(w.get("op_calls", 0)), default={})
    return {"counters": {k: stats.get("counters", {}).get(k, 0) for k in COUNTERS},
            "served": dict(stats.get("served") or {}),
            "refused": dict(stats.get("refused") or {}),
            "op": {k: head.get(k, 0) for k in OP_KEYS}}


def engine_levels(workers: list | None) -> dict:
    """One engine core's levels (not counts): ``head_eager``, 1 if a worker's LM head runs
    its op eagerly where it should replay from CUDA graphs."""
    found = [w for w in workers or [] if isinstance(w, dict)]
    return {"head_eager": max((int(bool(w.get("head_eager"))) for w in found), default=0)}


def take_new(state: Any, stats: dict, workers: list | None) -> dict:
    """What moved in this engine core since the previous call (the previous ``list`` from any
    API server), and remember the values handed out in ``state`` (the engine core's
    :class:`~vllm_steer.integrations.engine.state.EngineSteerState`: its ``engine`` and
    ``metrics_sent``). Each increment is handed out once, so
    the API servers' counters sum to the engine core's values. A value never goes back: a
    lower reading (another worker picked) hands out nothing until it passes the last one.

    ``{"engine": "0", "counters": {k: delta}, "served": {name: delta}, "refused":
    {"STATUS:REASON": delta}, "op": {k: delta}, "levels": {k: value}}``; ``counters`` and
    ``op`` always have every key (so the series exist from the first poll), ``served`` and
    ``refused`` only the keys that moved; ``levels`` (:func:`engine_levels`) are values as
    they are now, not increments."""
    now = engine_totals(stats, workers)
    last = state.metrics_sent or {}
    out: dict[str, Any] = {"engine": str(state.engine)}
    sent: dict[str, dict] = {}
    for part, values in now.items():
        prev = last.get(part, {})
        sent[part] = {**prev, **{k: max(v, prev.get(k, 0)) for k, v in values.items()}}
        out[part] = {k: max(0, v - prev.get(k, 0)) for k, v in values.items()}
    out["served"] = {k: d for k, d in out["served"].items() if d}
    out["refused"] = {k: d for k, d in out["refused"].items() if d}
    out["levels"] = engine_levels(workers)
    state.metrics_sent = sent
    return out


def refusal_key(status: int, reason: str) -> str:
    """The engine core's key of a refusal count (``"400:unknown_steer"``)."""
    return f"{int(status)}:{reason}"


# ---- API server: a refusal of its own ------------------------------------------------------
#: Set on a refusal once it is counted (the plugin's own exception types only).
_COUNTED = "_vllm_steer_counted"


def count_refusal(exc: BaseException, status: int) -> None:
    """Count ``exc``, a request this API server refuses with HTTP ``status``, once: in this
    process's counter (with ``--api-server-count N``, vLLM's multiprocess ``/metrics`` sums
    the N processes, each refusal counted by the one that answered it). A refusal the plugin
    raises through several hooks is counted by the first (it is marked). Never raises."""
    try:
        from vllm_steer.request import refusal_reason

        if getattr(exc, _COUNTED, False):
            return
        with_reason = status < 500
        get_metrics().refused_here(status, refusal_reason(exc) if with_reason else "internal")
        try:
            setattr(exc, _COUNTED, True)
        except AttributeError:  # pragma: no cover - an exception type with __slots__
            pass
    except Exception:  # noqa: BLE001 - metrics never break serving
        pass


# ---- API server: the Prometheus metrics ------------------------------------------------------
class SteerMetrics:
    """This API server's steer metrics on a ``prometheus_client`` registry."""

    def __init__(self, registry=None):
        from prometheus_client import REGISTRY, Counter, Gauge

        reg = registry or REGISTRY

        def gauge(name, doc, labels=()):
            return Gauge(name, doc, labelnames=labels, registry=reg,
                         multiprocess_mode="mostrecent")

        def counter(name, doc, labels=()):
            # prometheus_client declares a counter without its "_total" and exposes it with
            return Counter(name.removesuffix("_total"), doc,
                           labelnames=(ENGINE_LABEL, *labels), registry=reg)

        self.loaded = gauge(LOADED, "Steers loaded now.")
        self.capacity = gauge(CAPACITY, "Steer slots (--max-steers).")
        self.served = counter(REQUESTS_STEERED, "Requests admitted with a steer, per steer name.",
                              ("steer",))
        self.counters = {k: counter(name, doc) for (k, name), doc in zip(COUNTERS.items(), (
            "Run-time steer loads (HTTP, offline, first use from --steer-dir).",
            "Steer unloads.",
            "Least-recently-used steer evictions at capacity.",
            "Refused steer loads (bad file, bad name, no free slot for a load over HTTP or "
            "offline).",
            "Steer files read by run-time loads."), strict=True)}
        self.bank_full_waits = Counter(BANK_FULL_WAITS.removesuffix("_total"),
                                       "Requests that waited for a steer slot because every "
                                       "slot was held (contention, not a failure), per outcome "
                                       "(loaded; retry_after: HTTP 429).", ("outcome",),
                                       registry=reg)
        for outcome in BANK_FULL_OUTCOMES:  # both series exist from the start
            self.bank_full_waits.labels(outcome)
        self.refused = counter(REQUESTS_REFUSED, "Requests the steer plugin refused, per HTTP "
                               "status (400, 404: the request's error; 429: no room in the "
                               "bank now; 500: a fault of the plugin), reason, and where "
                               "(api_server, engine_core).",
                               ("status", "reason", "source"))
        from vllm_steer.request import REFUSAL_REASONS

        for reason in REFUSAL_REASONS:  # every API server's series exist from the start at 0,
            # so that a ratio over them has a denominator before the first refusal
            self.refused.labels("", str(REASON_STATUS.get(reason, 400)), reason, API_SERVER)
        self._engines: set[str] = set()  # engine cores seen (their refusal series made)
        self.head_eager = gauge(HEAD_EAGER, "1 while the LM head's steer op is launched "
                                "eagerly where it should replay from CUDA graphs, else 0.",
                                (ENGINE_LABEL,))
        self.start_time = Gauge(START_TIME, "When this server's API server started (Unix "
                                "time).", registry=reg, multiprocess_mode="max")
        self.start_time.set(time.time())
        self.op_seconds = counter(OP_SECONDS, "Time the device spent in the steer op, seconds "
                                  "(CUDA events; on the CPU the host time).")
        self.op_host_seconds = counter(OP_HOST_SECONDS, "Host time in the steer op, seconds "
                                       "(on CUDA the launch cost).")
        self.op_calls = counter(OP_CALLS, "Steered LM-head calls.")
        self.op_per_step = gauge(OP_SECONDS_PER_STEP, "Mean device time per timed steered "
                                 "call since the previous poll, seconds.", (ENGINE_LABEL,))
        # the presets file: read by the API servers, loaded into every engine core at once
        self.file_refused = gauge(PRESETS_FILE_REFUSED, "1 while the newest version of the "
                                  "presets file is refused (retried every poll) and an older "
                                  "one serves, else 0.")
        self.file_reloads = Counter(PRESETS_FILE_RELOADS.removesuffix("_total"),
                                    "Versions of the presets file loaded.", registry=reg)
        self.file_refusals = Counter(PRESETS_FILE_REFUSALS.removesuffix("_total"),
                                     "Versions of the presets file refused (once per "
                                     "version, not per retry).", registry=reg)

    def update(self, listing: dict) -> None:
        """Take a ``list`` management op's answer: the levels, and the increments handed to this
        process (``listing["metrics"]``: one engine core's :func:`take_new`, or a list of
        them with data parallelism)."""
        stats = listing.get("stats") or {}
        self.loaded.set(stats.get("loaded", 0))
        self.capacity.set(stats.get("capacity", 0))
        new = listing.get("metrics")
        for part in new if isinstance(new, list) else [new]:
            if part:
                self._add(part)

    def _add(self, new: dict) -> None:
        e = str(new.get("engine", "0"))
        if e not in self._engines:  # its refusal series exist from its first poll, at 0: the
            # first refusal of a kind is an increase, which an alert's increase() sees
            self._engines.add(e)
            from vllm_steer.request import REFUSAL_REASONS

            for reason in REFUSAL_REASONS:
                self.refused.labels(e, str(REASON_STATUS.get(reason, 400)), reason, ENGINE_CORE)
        for k, d in (new.get("counters") or {}).items():
            if k in self.counters:
                self.counters[k].labels(e).inc(d)
        for k, d in (new.get("refused") or {}).items():
            status, _, reason = str(k).partition(":")
            self.refused.labels(e, status, reason or "bad_steer", ENGINE_CORE).inc(d)
        for k, v in (new.get("levels") or {}).items():
            if k == "head_eager":
                self.head_eager.labels(e).set(v)
        for name, d in (new.get("served") or {}).items():
            self.served.labels(e, name).inc(d)
        op = new.get("op") or {}
        self.op_seconds.labels(e).inc(op.get("op_seconds", 0))
        self.op_host_seconds.labels(e).inc(op.get("op_host_seconds", 0))
        self.op_calls.labels(e).inc(op.get("op_calls", 0))
        if op.get("op_timed_calls", 0) > 0:
            self.op_per_step.labels(e).set(op.get("op_seconds", 0) / op["op_timed_calls"])

    def bank_full_wait(self, outcome: str) -> None:
        """One request that waited for a steer slot, ended with ``outcome``
        (:data:`BANK_FULL_OUTCOMES`)."""
        self.bank_full_waits.labels(outcome).inc()

    def refused_here(self, status: int, reason: str) -> None:
        """One request refused by this API server (no engine core: ``engine`` is empty)."""
        self.refused.labels("", str(int(status)), reason, API_SERVER).inc()

    def presets_file(self, reloaded: bool = False, refused_new: bool = False,
                     refused: bool | None = None) -> None:
        """A read of the presets file: a version ``reloaded`` (it changed the table), a new
        version ``refused_new``; ``refused``: whether the newest version is refused now."""
        if reloaded:
            self.file_reloads.inc()
        if refused_new:
            self.file_refusals.inc()
        if refused is not None:
            self.file_refused.set(1 if refused else 0)


def get_metrics() -> SteerMetrics:
    """The process's steer metrics (created on first use, on vLLM's default registry)."""
    global _METRICS
    if _METRICS is None:
        _METRICS = SteerMetrics()
    return _METRICS
