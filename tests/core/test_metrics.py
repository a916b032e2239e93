"""vllm_steer.metrics: the values /metrics shows, from a ``list`` answer (one engine core or
several merged)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from vllm_steer.metrics import SteerMetrics


def _value(reg, name, **labels):
    return reg.get_sample_value(name, labels or None)


def _listing(op_seconds, op_calls, served=None):
    return {"enabled": True, "steers": [],
            "stats": {"loaded": 2, "capacity": 4, "served": served or {"detox": 3},
                      "counters": {"loads": 5, "unloads": 1, "evictions": 0, "failures": 2},
                      "op": {"seconds": op_seconds, "calls": op_calls}},
            "workers": [{"op_seconds": 99.0, "op_calls": 99}]}  # "op" is what counts


def test_update_mirrors_the_engine_values_and_the_per_step_mean():
    reg = CollectorRegistry()
    m = SteerMetrics(registry=reg)
    m.update(_listing(0.5, 10))
    assert _value(reg, "vllm_steer:loaded_steers") == 2
    assert _value(reg, "vllm_steer:max_steers") == 4
    assert _value(reg, "vllm_steer:requests_steered_total", steer="detox") == 3
    assert _value(reg, "vllm_steer:steer_loads_total") == 5
    assert _value(reg, "vllm_steer:steer_load_failures_total") == 2
    assert _value(reg, "vllm_steer:steer_op_seconds_total") == 0.5
    assert _value(reg, "vllm_steer:steer_op_calls_total") == 10
    assert _value(reg, "vllm_steer:steer_op_seconds_per_step") == 0.05
    m.update(_listing(0.9, 14))  # 4 more calls took 0.4 s
    assert abs(_value(reg, "vllm_steer:steer_op_seconds_per_step") - 0.1) < 1e-12
    m.update({"enabled": False, "steers": [], "stats": {}, "workers": []})  # nothing to read
    assert _value(reg, "vllm_steer:steer_op_calls_total") == 14
