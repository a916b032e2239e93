"""vllm_steer.metrics: what ``/metrics`` shows. The types and names Prometheus sees; the
counters fed by what each engine core hands out per ``list`` (each increment to one API
server, so several API servers and data-parallel engine cores count it once); the steer-op
timer, whose device time never makes the host wait."""

from __future__ import annotations

import contextlib
import glob
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from prometheus_client import CollectorRegistry, generate_latest, multiprocess, values
from prometheus_client.parser import text_string_to_metric_families

from helpers.steers import random_steer
from vllm_steer import metrics as metrics_mod
from vllm_steer.config import SteerServerConfig
from vllm_steer.format import save_steer
from vllm_steer.integrations.engine import management, state
from vllm_steer.integrations.protocol import merge_answers
from vllm_steer.integrations.engine.registry import SteerRegistry
from vllm_steer.metrics import SteerMetrics, take_new
from helpers.fakes import VllmObject, engine_core
from vllm_steer.integrations.engine.state import engine_state

COUNTER_NAMES = ["vllm_steer:requests_steered_total", "vllm_steer:steer_loads_total",
                 "vllm_steer:steer_unloads_total", "vllm_steer:steer_evictions_total",
                 "vllm_steer:steer_load_failures_total", "vllm_steer:steer_op_seconds_total",
                 "vllm_steer:steer_op_host_seconds_total", "vllm_steer:steer_op_calls_total",
                 "vllm_steer:requests_refused_total",
                 "vllm_steer:presets_file_reloads_total",
                 "vllm_steer:presets_file_refusals_total",
                 "vllm_steer:steer_file_reads_total", "vllm_steer:bank_full_waits_total"]
GAUGE_NAMES = ["vllm_steer:loaded_steers", "vllm_steer:max_steers",
               "vllm_steer:steer_op_seconds_per_step", "vllm_steer:presets_file_refused",
               "vllm_steer:head_eager", "vllm_steer:start_time_seconds"]


def families(text: str) -> dict:
    """Exposition text -> {name as exposed (a counter with its ``_total``): family}."""
    out = {}
    for f in text_string_to_metric_families(text):
        out[f.name + "_total" if f.type == "counter" else f.name] = f
    return out


def value(fams: dict, name: str, **labels) -> float:
    """The sum of the samples of ``name`` whose labels include ``labels`` (0 if none)."""
    return sum(s.value for s in fams[name].samples if s.name == name
               and all(s.labels.get(k) == v for k, v in labels.items())) if name in fams else 0.0


# ---- a fake engine core: the real registry and management op, workers we set ----------------
def _core(index: int, workers: list[dict]):
    cfg = SteerServerConfig(steers={}, max_steers=4, enable_updates=True)
    return engine_core(
        engine_index=index,
        steer_state=state.EngineSteerState(cfg, SteerRegistry(4), 64),
        scheduler=SimpleNamespace(requests={}),
        model_executor=SimpleNamespace(collective_rpc=lambda fn, args=(): (
            [dict(w) for w in workers] if args[0] == "stats" else [True] * len(workers))),
        vllm_config=SimpleNamespace(model_config=SimpleNamespace(model="tiny")))


def _steer(core, name: str, n: int) -> None:
    """``n`` requests admitted with steer ``name`` in this engine core."""
    for _ in range(n):
        engine_state(core).registry.bind([name])


def _list(cores) -> dict:
    """What an API server's engine client gets for ``list``: every engine core's answer,
    merged."""
    return merge_answers("list", [management.run_op(c, "list") for c in cores])


def _worker(seconds=0.0, host=0.0, calls=0, timed=0) -> dict:
    return {"op_seconds": seconds, "op_host_seconds": host, "op_calls": calls,
            "op_timed_calls": timed, "slots": []}


def _load(core, tmp_path, name: str, ok: bool = True) -> None:
    path = tmp_path / f"{name}.safetensors"
    if ok:
        save_steer(path, random_steer(64, 4, name))
    else:
        path.write_bytes(b"not a steer file")
    res = management.run_op(core, "load", {"name": name, "path": str(path), "source": "api"})
    assert res["ok"] is ok, res


# ---- types and names ------------------------------------------------------------------------
def test_every_total_is_a_counter_with_help_and_the_levels_are_gauges(tmp_path):
    workers = [_worker()]
    core = _core(0, workers)
    _load(core, tmp_path, "detox")
    _steer(core, "detox", 3)
    workers[0].update(_worker(0.5, 0.7, 10, 10))
    reg = CollectorRegistry()
    SteerMetrics(registry=reg).update(_list([core]))
    fams = families(generate_latest(reg).decode())
    steer_fams = {n: f for n, f in fams.items() if n.startswith("vllm_steer:")
                  and not n.endswith("_created")}  # prometheus_client's own counter stamps
    assert sorted(steer_fams) == sorted(COUNTER_NAMES + GAUGE_NAMES)
    for name, f in steer_fams.items():
        assert f.documentation, f"{name} has no HELP"
        assert f.type == ("counter" if name in COUNTER_NAMES else "gauge"), (name, f.type)
        if name.endswith("_total"):
            assert f.type == "counter", name
    assert value(fams, "vllm_steer:requests_steered_total", steer="detox", engine="0") == 3
    assert value(fams, "vllm_steer:steer_loads_total", engine="0") == 1
    assert value(fams, "vllm_steer:steer_file_reads_total", engine="0") == 1  # one load, one file
    assert value(fams, "vllm_steer:steer_op_seconds_total", engine="0") == 0.5
    assert value(fams, "vllm_steer:steer_op_host_seconds_total", engine="0") == 0.7
    assert value(fams, "vllm_steer:max_steers") == 4
    assert value(fams, "vllm_steer:loaded_steers") == 1


def test_bank_full_waits_are_counted_per_outcome_from_zero():
    """Both outcomes exist from the start (a rate over them is defined before the first wait),
    each wait counts once, in its outcome only."""
    reg = CollectorRegistry()
    m = SteerMetrics(registry=reg)
    read = lambda: {s.labels["outcome"]: s.value  # noqa: E731
                    for s in families(generate_latest(reg).decode())[
                        "vllm_steer:bank_full_waits_total"].samples if s.name.endswith("_total")}
    assert read() == {"loaded": 0.0, "retry_after": 0.0}
    m.bank_full_wait("retry_after")
    m.bank_full_wait("retry_after")
    m.bank_full_wait("loaded")
    assert read() == {"loaded": 1.0, "retry_after": 2.0}


def test_every_metric_is_documented_for_users():
    from pathlib import Path

    docs = "\n".join(p.read_text() for p in Path(__file__).parents[2].glob("docs/*.md"))
    for name in COUNTER_NAMES + GAUGE_NAMES:
        assert f"`{name}" in docs, f"{name} is not in docs/"


# ---- counters from deltas ---------------------------------------------------------------------
def test_take_new_hands_out_each_increment_once_and_never_a_decrease():
    from vllm_steer.integrations.engine.state import EngineSteerState

    state = EngineSteerState(None, None, 0, engine=1)  # where the engine core keeps them
    stats = {"counters": {"loads": 2, "unloads": 0, "evictions": 0, "failures": 1},
             "served": {"detox": 3}}
    tp = [_worker(0.5, 0.8, 10, 10), _worker(0.4, 0.9, 10, 10)]  # TP=2: the same 10 calls
    first = take_new(state, stats, tp)
    assert first["engine"] == "1"
    assert first["counters"] == {"loads": 2, "unloads": 0, "evictions": 0, "failures": 1,
                                 "file_reads": 0}
    assert first["served"] == {"detox": 3}
    assert first["op"] == {"op_seconds": 0.5, "op_host_seconds": 0.8, "op_calls": 10,
                           "op_timed_calls": 10}
    again = take_new(state, stats, tp)  # nothing moved: nothing handed out
    assert again["served"] == {} and set(again["counters"].values()) == {0}
    assert set(again["op"].values()) == {0}
    stats["counters"]["loads"] = 3
    stats["served"] = {"detox": 5, "formal": 1}
    # the other TP rank has the most calls now and a lower time: nothing goes back
    tp = [_worker(0.5, 0.8, 10, 10), _worker(0.45, 1.0, 12, 12)]
    third = take_new(state, stats, tp)
    assert third["counters"]["loads"] == 1 and third["served"] == {"detox": 2, "formal": 1}
    assert third["op"]["op_seconds"] == 0 and third["op"]["op_calls"] == 2
    assert third["op"]["op_host_seconds"] == pytest.approx(0.2)
    fourth = take_new(state, stats, [_worker(0.6, 1.0, 12, 12)])
    assert fourth["op"]["op_seconds"] == pytest.approx(0.1)  # only past the last one


def test_per_step_gauge_is_the_mean_device_time_of_the_calls_since_the_previous_poll():
    workers = [_worker(0.5, 0.6, 10, 10)]
    core = _core(0, workers)
    reg = CollectorRegistry()
    m = SteerMetrics(registry=reg)
    m.update(_list([core]))
    assert reg.get_sample_value("vllm_steer:steer_op_seconds_per_step", {"engine": "0"}) == 0.05
    workers[0].update(_worker(0.9, 1.0, 14, 14))  # 4 more calls took 0.4 s
    m.update(_list([core]))
    assert reg.get_sample_value("vllm_steer:steer_op_seconds_per_step",
                                {"engine": "0"}) == pytest.approx(0.1)
    m.update(_list([core]))  # no call since: the last mean stays
    assert reg.get_sample_value("vllm_steer:steer_op_seconds_per_step",
                                {"engine": "0"}) == pytest.approx(0.1)
    assert reg.get_sample_value("vllm_steer:steer_op_calls_total", {"engine": "0"}) == 14
    m.update({"enabled": False, "steers": [], "stats": {}, "workers": []})  # nothing to read
    assert reg.get_sample_value("vllm_steer:steer_op_calls_total", {"engine": "0"}) == 14


@contextlib.contextmanager
def _as_process(value_classes: dict, pid: int):
    """Run as API-server process ``pid`` in Prometheus multiprocess mode (what vLLM sets up
    for ``--api-server-count`` > 1): metric values go to that process's files."""
    old = values.ValueClass
    values.ValueClass = value_classes.setdefault(pid, values.MultiProcessValue(lambda: pid))
    try:
        yield
    finally:
        values.ValueClass = old


def test_two_api_servers_and_two_engine_cores_count_each_increment_once(tmp_path,
                                                                         monkeypatch):
    """vLLM's multiprocess ``/metrics`` sums a counter over the API-server processes: each
    engine core's values show once, under its own ``engine`` label, whichever API server
    polled when; the gauges show the last value."""
    prom = tmp_path / "prom"
    prom.mkdir()
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(prom))
    classes: dict = {}
    workers = [[_worker()], [_worker()]]
    cores = [_core(0, workers[0]), _core(1, workers[1])]
    servers = {}
    for pid in (101, 102):
        with _as_process(classes, pid):
            servers[pid] = SteerMetrics(registry=CollectorRegistry())

    def poll(pid):
        with _as_process(classes, pid):
            servers[pid].update(_list(cores))

    def scrape() -> dict:
        reg = CollectorRegistry()
        multiprocess.MultiProcessCollector(reg, path=str(prom))
        return families(generate_latest(reg).decode())

    for core in cores:
        _load(core, tmp_path, "detox")
    _load(cores[1], tmp_path, "bad", ok=False)
    poll(101)
    _steer(cores[0], "detox", 3)
    _steer(cores[1], "detox", 2)
    workers[0][0].update(_worker(0.25, 0.5, 5, 5))
    poll(102)
    poll(101)  # nothing moved since 102's poll: 101 adds nothing
    _steer(cores[1], "detox", 4)
    workers[1][0].update(_worker(0.5, 0.75, 6, 6))
    poll(101)
    poll(102)
    assert len(glob.glob(str(prom / "counter_*.db"))) == 2  # both processes hold counts
    fams = scrape()
    for e, core in enumerate(cores):  # what each engine core counted, once
        reg = engine_state(core).registry
        assert value(fams, "vllm_steer:requests_steered_total", engine=str(e),
                     steer="detox") == reg.served["detox"]
        assert value(fams, "vllm_steer:steer_loads_total", engine=str(e)) == \
            reg.counters["loads"] == 1
        assert value(fams, "vllm_steer:steer_load_failures_total", engine=str(e)) == \
            reg.counters["failures"] == e
    assert value(fams, "vllm_steer:requests_steered_total") == 3 + 2 + 4
    assert value(fams, "vllm_steer:steer_op_seconds_total", engine="0") == 0.25
    assert value(fams, "vllm_steer:steer_op_calls_total", engine="1") == 6
    assert value(fams, "vllm_steer:steer_op_host_seconds_total") == 0.5 + 0.75
    assert value(fams, "vllm_steer:loaded_steers") == 1  # a level: once, not per process
    assert value(fams, "vllm_steer:max_steers") == 4
    for name in COUNTER_NAMES:
        assert fams[name].type == "counter", name


def test_refusals_of_two_api_servers_and_an_engine_core_show_once_each(tmp_path, monkeypatch):
    """With ``--api-server-count 2`` each API server counts the requests it refused itself in
    its own process (:func:`count_refusal`; one exception counted once however many hooks it
    passes), the engine core's refusals reach whichever API server polls: the multiprocess
    ``/metrics`` shows each refusal once, by reason and where it happened."""
    from vllm_steer.integrations.engine.core import count_refusal as engine_refusal
    from vllm_steer.request import SteerRequestError

    prom = tmp_path / "prom"
    prom.mkdir()
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(prom))
    classes: dict = {}
    core = _core(0, [_worker()])
    servers = {}
    for pid in (101, 102):
        with _as_process(classes, pid):
            servers[pid] = SteerMetrics(registry=CollectorRegistry())

    def refuse(pid, exc, status=400, times=1):
        with _as_process(classes, pid):
            monkeypatch.setattr(metrics_mod, "_METRICS", servers[pid])
            for _ in range(times):  # the same refusal through several hooks: counted once
                metrics_mod.count_refusal(exc, status)

    refuse(101, SteerRequestError("steer: unknown steer 'x'", "unknown_steer"), times=3)
    refuse(102, SteerRequestError("steer: unknown steer 'y'", "unknown_steer"))
    refuse(102, SteerRequestError("steer: strength 99", "strength_limit"))
    refuse(101, RuntimeError("a fault"), status=500)
    engine_refusal(core, 400, "bank_full")
    engine_refusal(core, 400, "bank_full")
    with _as_process(classes, 102):
        servers[102].update(_list([core]))
    with _as_process(classes, 101):
        servers[101].update(_list([core]))  # nothing new: adds nothing
    reg = CollectorRegistry()
    multiprocess.MultiProcessCollector(reg, path=str(prom))
    fams = families(generate_latest(reg).decode())
    name = "vllm_steer:requests_refused_total"
    assert value(fams, name, source="api_server", reason="unknown_steer", status="400") == 2
    assert value(fams, name, source="api_server", reason="strength_limit") == 1
    assert value(fams, name, source="api_server", reason="internal", status="500") == 1
    assert value(fams, name, source="engine_core", reason="bank_full", engine="0") == 2
    assert value(fams, name) == 6


# ---- the op timer -----------------------------------------------------------------------------
class FakeDevice:
    """A device that runs what was recorded when told (``run``), 2 ms per event."""

    def __init__(self):
        self.queue: list = []
        self.clock = 0.0
        self.capturing = False
        self.events = 0  # events created
        self.waits = 0  # host waits on the device (synchronize)
        self.early_reads = 0  # elapsed_time on an event the device has not reached

    def run(self, n=None):
        for e in self.queue[:n]:
            e.t, e.done = self.clock, True
            self.clock += 2.0
        del self.queue[:n]


@pytest.fixture()
def fake_cuda(monkeypatch):
    dev = FakeDevice()

    class FakeEvent:
        def __init__(self, enable_timing=False, **k):
            assert enable_timing, "a timing event needs enable_timing=True"
            dev.events += 1
            self.done, self.t = True, None

        def record(self, stream=None):
            self.done = False
            dev.queue.append(self)

        def query(self):
            return self.done

        def synchronize(self):
            dev.waits += 1

        def elapsed_time(self, end):  # CUDA: cudaErrorNotReady unless both completed
            if not (self.done and end.done):
                dev.early_reads += 1
                raise RuntimeError("CUDA error: device not ready")
            return end.t - self.t

    def synchronize(*a, **k):
        dev.waits += 1

    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", synchronize)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: dev.capturing)
    return dev


ON_CUDA = SimpleNamespace(is_cuda=True, shape=(1, 8))
EVERY = metrics_mod.TIMER_SAMPLE_EVERY


def planner():
    """The head's step planner with no bank or slots: its timed op (``_timed``), the caller of
    the timer that counts the untimed ops down, is all these tests run."""
    from vllm_steer.integrations.worker.planner import StepPlanner

    return StepPlanner(None, None)


def op(planner, t):
    """One steer op through the planner's timer (timed when its turn comes); returns the op's
    result, which must come back."""
    out = planner._timed(lambda x, y: (x, y), t, "arg")
    assert out == (t, "arg")
    return out


def test_cuda_op_time_comes_from_events_read_only_once_the_device_passed_them(fake_cuda):
    dev = fake_cuda
    p = planner()
    timer = p.op_timer
    for _ in range(1 + 2 * EVERY):  # steered calls; the device runs none of them yet
        op(p, ON_CUDA)
    assert timer.report()["op_timed_calls"] == 0 and timer.device_seconds == 0
    assert dev.events == 6  # three timed: the first, then one in TIMER_SAMPLE_EVERY
    dev.run(3)  # the first timed call's start and end, and the second's start
    rep = timer.report()
    assert rep["op_timed_calls"] == 1 and rep["op_seconds"] == pytest.approx(0.002)
    dev.run()
    rep = timer.report()  # each later timed call counts for itself and the untimed before it
    assert rep["op_timed_calls"] == 1 + 2 * EVERY
    assert rep["op_seconds"] == pytest.approx(0.002 * (1 + 2 * EVERY))
    assert rep["op_host_seconds"] > 0 and rep["op_host_seconds"] == timer.host_seconds
    assert dev.waits == 0 and dev.early_reads == 0


def test_cuda_timing_never_waits_reuses_its_events_and_skips_a_graph_capture(fake_cuda):
    dev = fake_cuda
    p = planner()
    timer = p.op_timer
    calls = 1 + 3 * metrics_mod.TIMER_POLL_EVERY * EVERY  # a long run with no report
    for step in range(calls):
        op(p, ON_CUDA)
        if step % 2:
            dev.run()  # the device one call behind the host
    assert dev.waits == 0 and dev.early_reads == 0
    assert len(timer._pending) <= metrics_mod.TIMER_POLL_EVERY  # read by itself, bounded
    assert dev.events <= 2 * (metrics_mod.TIMER_POLL_EVERY + 2)  # pairs reused
    dev.run()
    assert timer.report()["op_timed_calls"] == calls
    dev.capturing = True  # a CUDA graph capture: nothing recorded, nothing counted
    queued = len(dev.queue)
    for _ in range(EVERY):  # up to and including the next timed call
        op(p, ON_CUDA)
    assert p.op_untimed == EVERY - 1  # the timed call came, inside the capture
    assert len(dev.queue) == queued
    assert timer.report()["op_timed_calls"] == calls


def test_cpu_op_device_time_is_its_host_time(fake_cuda):
    p = planner()
    timer = p.op_timer
    for _ in range(1 + EVERY):
        op(p, torch.zeros(2))
    rep = timer.report()
    assert rep["op_timed_calls"] == 1 + EVERY and rep["op_seconds"] == rep["op_host_seconds"] > 0
    assert fake_cuda.events == 0


def test_a_worker_reports_its_timed_steer_calls(tmp_path):
    """The worker's ``stats`` answer (``GET /v1/steers`` ``"workers"``, and the metrics'
    source) after steered LM-head calls on the CPU."""
    from vllm_steer.integrations.worker.management import worker_op
    from vllm_steer.integrations.worker.runtime import get_runtime
    from vllm_steer.reference import steer_coefficients, steer_reference

    path = tmp_path / "a.safetensors"
    save_steer(path, random_steer(32, 4, "a", seed=1, scale=3.0))
    extra = {"vllm_steer": {"steers": {"a": str(path)}, "backend": "torch"}}
    rt = get_runtime(extra)
    rt.bank_state.load(32, torch.device("cpu"), torch.float32)
    rt.ensure_slots(2, torch.device("cpu"))
    row = np.zeros(rt.slots.num_columns, dtype=np.float32)
    row[0], row[rt.bank_state.capacity] = steer_coefficients(
        4, rt.bank_state.bank.steers[0].metadata.epsilon, None)
    rt.set_slot(0, row)
    rt.slots.flush()
    rt.step.batch_size = 1  # the runner's step: one request, in slot 0
    h = torch.randn(1, 32, generator=torch.Generator().manual_seed(0))
    worker = VllmObject(vllm_config=SimpleNamespace(additional_config=extra))
    for _ in range(3):
        out = rt.planner.steer_rows(h)
    torch.testing.assert_close(out, steer_reference(h, *rt.bank_state.bank.factors,
                                                    torch.tensor(row)[None]))
    rep = worker_op(worker, "stats")  # the first call timed; the next two wait for theirs
    assert rep["op_calls"] == 3 and rep["op_timed_calls"] == 1
    assert rep["op_seconds"] == rep["op_host_seconds"] > 0
    for _ in range(2 * EVERY - 2):  # up to the next timed call and one in EVERY after it
        rt.planner.steer_rows(h)
    rep = worker_op(worker, "stats")
    assert rep["op_calls"] == rep["op_timed_calls"] == 1 + 2 * EVERY
    assert rep["op_seconds"] == rep["op_host_seconds"] > 0


def test_engine_core_refusals_reach_prometheus_by_status_and_reason():
    """The engine core's refusals (400: the request's error; 429: no room in the bank now;
    500: a fault of the plugin)
    become ``vllm_steer:requests_refused_total{engine, status, reason, source="engine_core"}``,
    each increment once; the API server's own series are there at 0 from the start, and an
    engine core's from its first poll (so that its first 500 is an increase from 0, which an
    alert's ``increase()`` sees)."""
    from vllm_steer.integrations.engine.state import EngineSteerState

    core = EngineSteerState(None, None, 0, engine=0)  # where the engine core keeps them
    stats = {"counters": {}, "served": {}, "refused": {}}
    reg = CollectorRegistry()
    m = SteerMetrics(registry=reg)

    def engine_series():
        return {tuple(sorted(s.labels.items())): s.value
                for s in families(generate_latest(reg).decode())[
                    "vllm_steer:requests_refused_total"].samples
                if s.name.endswith("_total") and s.labels.get("source") == "engine_core"}

    m.update({"stats": stats, "metrics": take_new(core, stats, [])})  # the first poll
    first = engine_series()
    assert first[(("engine", "0"), ("reason", "internal"), ("source", "engine_core"),
                  ("status", "500"))] == 0.0
    assert set(first.values()) == {0.0}
    stats["refused"].update({"429:bank_full": 3, "500:internal": 1})
    m.update({"stats": stats, "metrics": take_new(core, stats, [])})
    stats["refused"]["429:bank_full"] = 5
    stats["refused"]["400:unknown_steer"] = 2
    m.update({"stats": stats, "metrics": take_new(core, stats, [])})
    m.update({"stats": stats, "metrics": take_new(core, stats, [])})  # nothing moved
    samples = {tuple(sorted(s.labels.items())): s.value
               for s in families(generate_latest(reg).decode())[
                   "vllm_steer:requests_refused_total"].samples if s.name.endswith("_total")}
    engine = {k: v for k, v in samples.items() if ("source", "engine_core") in k and v}
    assert engine == {
        (("engine", "0"), ("reason", "bank_full"), ("source", "engine_core"),
         ("status", "429")): 5.0,
        (("engine", "0"), ("reason", "unknown_steer"), ("source", "engine_core"),
         ("status", "400")): 2.0,
        (("engine", "0"), ("reason", "internal"), ("source", "engine_core"),
         ("status", "500")): 1.0}
    api = {dict(k)["reason"]: (dict(k)["status"], v) for k, v in samples.items()
           if ("source", "api_server") in k}
    assert api["unknown_preset"] == ("404", 0) and api["internal"] == ("500", 0)
    assert api["strength_limit"] == ("400", 0) and api["bank_full"] == ("429", 0)
    # an API server's refusal names no engine core (an empty label: Prometheus drops it)
    assert {dict(k).get("engine", "") for k in samples if ("source", "api_server") in k} == {""}


def test_a_stats_op_beside_a_step_never_reads_an_unfinished_timing_pair():
    """Under Ray's compiled graphs a worker's ``stats`` op (``OpTimer.report``) runs on the
    actor's main thread while a step runs on another: two reads of the pending pairs at once
    must not take a pair the device has not finished (its ``elapsed_time`` raises: the step's
    head fault, HTTP 500 for its steered requests)."""
    import threading
    import time

    from vllm_steer.metrics import OpTimer

    class Event:
        def __init__(self, done, slow=False):
            self.done, self.slow = done, slow

        def query(self):
            if self.slow:
                time.sleep(0.05)  # the window between the check and the pop
            return self.done

        def elapsed_time(self, end):
            if not end.done:
                raise RuntimeError("the end event has not been recorded or completed")
            return 2.0

    errors = []
    for _ in range(3):
        timer = OpTimer()
        timer._pending.extend([(Event(True), Event(True, slow=True), 1),
                               (Event(True), Event(False), 1)])

        def read(timer=timer):
            try:
                timer.report()
            except RuntimeError as e:
                errors.append(e)

        threads = [threading.Thread(target=read) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert timer.timed_calls == 1 and len(timer._pending) == 1  # the unfinished one waits
    assert errors == []
