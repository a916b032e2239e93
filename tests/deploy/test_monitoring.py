"""The Grafana dashboard, the alert rules and the docs' PromQL against what is on /metrics.

What is emitted is read, not listed by hand: vLLM's own metrics from its Prometheus stat
logger (``PrometheusStatLogger``, built in a subprocess on a stand-in configuration: the
names and label names it registers), the plugin's from :class:`vllm_steer.metrics.
SteerMetrics` on a registry of its own after an update that touches every label. Metrics
whose names :mod:`vllm_steer.metrics` declares but :class:`SteerMetrics` does not register
yet take their label names from :data:`DECLARED_LABELS`.

Every expression (the rules, the dashboard's targets and variables, the PromQL blocks of the
docs) may name only emitted metrics, select only their labels (or the labels Prometheus gives
a scraped target) and group only by those. ``promtool check rules`` checks the rule file and
``promtool test rules`` fires each alert on made-up series (with the emitted label sets) and
keeps it quiet on healthy ones. Each check is shown to catch a planted error.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from deploy_helpers import KUBERNETES, ROOT, manifests
from vllm_steer import metrics as M

MONITORING = KUBERNETES / "monitoring"
RULES = MONITORING / "prometheusrule.yaml"
DASHBOARD = MONITORING / "grafana-dashboard.json"
PROMQL_DOCS = (ROOT / "docs" / "serving.md", ROOT / "docs" / "deploy.md")
#: Labels Prometheus adds to every sample of a scraped pod (the Prometheus Operator's
#: ServiceMonitor; annotation-based discovery configs relabel to the same names).
TARGET_LABELS = {"namespace", "pod", "instance", "job", "service", "container", "endpoint"}
#: Label names of the metrics :mod:`vllm_steer.metrics` names whose series
#: :class:`SteerMetrics` does not register yet.
DECLARED_LABELS = {M.REQUESTS_REFUSED: {"status"}, M.PRESETS_FILE_REFUSED: set(),
                   M.PRESETS_FILE_RELOADS: set(), M.PRESETS_FILE_REFUSALS: set()}

VLLM_PROBE = r"""
import json
from unittest import mock
from prometheus_client import REGISTRY
from vllm.v1.metrics.loggers import PrometheusStatLogger
cfg = mock.MagicMock()
cfg.observability_config.show_hidden_metrics = False
cfg.observability_config.kv_cache_metrics = False
cfg.observability_config.custom_histogram_buckets = None
cfg.model_config.served_model_name = "m"
cfg.model_config.max_model_len = 512
cfg.model_config.is_diffusion = False
cfg.speculative_config = cfg.kv_transfer_config = cfg.ec_transfer_config = None
cfg.lora_config = None
PrometheusStatLogger(cfg)
out, itl = {}, set()
for fam in REGISTRY.collect():
    for s in fam.samples:
        if s.name.startswith("vllm:"):
            out.setdefault(s.name, {}).update(s.labels)
        if s.name == "vllm:inter_token_latency_seconds_bucket":
            itl.add(s.labels["le"])
print(json.dumps({"samples": out, "itl_buckets": sorted(itl, key=float)}))
"""


def _samples(registry) -> dict[str, dict[str, str]]:
    """{sample name: {label: a value}} of a registry (``_total``, ``_bucket``... included)."""
    out: dict[str, dict[str, str]] = {}
    for fam in registry.collect():
        for s in fam.samples:
            out.setdefault(s.name, {}).update(s.labels)
    return out


@pytest.fixture(scope="module")
def vllm_probe() -> dict:
    """vLLM's own metrics: their samples' names and labels, the inter-token buckets' bounds."""
    r = subprocess.run([sys.executable, "-c", VLLM_PROBE], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().split("\n")[-1])


@pytest.fixture(scope="module")
def itl_buckets(vllm_probe) -> list[str]:
    """The ``le`` bounds of vLLM's inter-token latency histogram, as /metrics writes them."""
    return vllm_probe["itl_buckets"]


@pytest.fixture(scope="module")
def emitted(vllm_probe) -> dict[str, dict[str, str]]:
    """{sample name: {label: an example value}} of everything on /metrics."""
    out = dict(vllm_probe["samples"])
    assert "vllm:request_success_total" in out and "vllm:num_requests_running" in out
    from prometheus_client import CollectorRegistry

    reg = CollectorRegistry()
    sm = M.SteerMetrics(registry=reg)
    sm.update({"stats": {"loaded": 1, "capacity": 8},
               "metrics": {"engine": "0", "counters": {k: 1 for k in M.COUNTERS},
                           "served": {"detox": 1}, "refused": {"400:bank_full": 1},
                           "levels": {"head_eager": 0},
                           "op": {"op_seconds": 1e-3, "op_host_seconds": 1e-3, "op_calls": 64,
                                  "op_timed_calls": 64}}})
    plugin = _samples(reg)
    for name, labels in DECLARED_LABELS.items():
        if name not in plugin:
            plugin[name] = {k: "400" for k in labels}
    return out | plugin


# --------------------------------------------------------------------------- expressions

def rule_expressions() -> list[tuple[str, str]]:
    doc = yaml.safe_load(RULES.read_text())
    return [(f"rule {r['alert']}", r["expr"]) for g in doc["spec"]["groups"]
            for r in g["rules"]]


def dashboard_expressions(dash: dict | None = None) -> list[tuple[str, str]]:
    dash = dash or json.loads(DASHBOARD.read_text())
    out = [(f"panel {p['title']!r}", t["expr"]) for p in dash["panels"]
           for t in p.get("targets", [])]
    for v in dash["templating"]["list"]:
        if v["type"] == "query":
            m = re.fullmatch(r"label_values\((.*),\s*(\w+)\)", v["definition"])
            assert m, v["definition"]
            out.append((f"variable {v['name']}", f"sum by ({m.group(2)}) ({m.group(1)})"))
    return out


def docs_expressions() -> list[tuple[str, str]]:
    out = []
    for doc in PROMQL_DOCS:
        for block in re.findall(r"```promql\n(.*?)```", doc.read_text(), re.S):
            for ln in block.split("\n"):
                if ln.strip() and not ln.lstrip().startswith("#"):
                    out.append((f"{doc.name}", ln))
    return out


METRIC = re.compile(r"\b(vllm(?:_steer)?:[A-Za-z0-9_:]+)(\{[^}]*\})?")
CLAUSE = re.compile(r"\b(by|without)\s*\(([^)]*)\)")


def _argument(expr: str, start: int) -> str:
    """The parenthesised argument that starts at or after ``start`` (``sum by (x) (ARG)``)."""
    i = expr.index("(", start)
    depth = 0
    for j in range(i, len(expr)):
        depth += {"(": 1, ")": -1}.get(expr[j], 0)
        if depth == 0:
            return expr[i:j + 1]
    raise AssertionError(f"unbalanced parentheses in {expr!r}")


def problems(where: str, expr: str, emitted: dict[str, dict]) -> list[str]:
    """What in one expression names a metric /metrics lacks or a label it does not carry."""
    out = []
    expr = expr.replace("$namespace", "x").replace("$pod", "x")
    found = METRIC.findall(expr)
    if not found:
        out.append(f"{where}: no metric in {expr!r}")
    for name, matchers in found:
        if name not in emitted:
            out.append(f"{where}: {name} is not on /metrics")
            continue
        for label in re.findall(r"(\w+)\s*(?:=~|!~|!=|=)", matchers or ""):
            if label not in set(emitted[name]) | TARGET_LABELS:
                out.append(f"{where}: {name} has no label {label!r} "
                           f"(it has {sorted(emitted[name])})")
    for m in CLAUSE.finditer(expr):
        labels = {x.strip() for x in m.group(2).split(",") if x.strip()}
        inner = [n for n, _ in METRIC.findall(_argument(expr, m.end()))]
        have = set(TARGET_LABELS)
        for n in inner:
            have |= set(emitted.get(n, {}))
        for label in sorted(labels - have):
            out.append(f"{where}: {m.group(1)} ({label}) but {inner} carry no {label!r}")
        if m.group(1) == "by" and "engine" in labels:
            out.append(f"{where}: by (engine) adds the replicas together (each reports "
                       "engine=\"0\"); group by pod")
    return out


def test_every_expression_names_emitted_metrics_and_their_labels(emitted):
    exprs = rule_expressions() + dashboard_expressions() + docs_expressions()
    assert len(rule_expressions()) >= 4 and len(dashboard_expressions()) >= 15
    assert any(w == "serving.md" for w, _ in exprs)
    found = [p for w, e in exprs for p in problems(w, e, emitted)]
    assert found == [], "\n".join(found)
    # what the dashboard shows: the steered share, the op time per token, loads, evictions,
    # refusals, the presets file's state, beside vLLM's own
    names = {n for _, e in dashboard_expressions() for n, _ in METRIC.findall(e)}
    assert {M.REQUESTS_STEERED, M.OP_SECONDS, M.OP_CALLS, M.COUNTERS["loads"],
            M.COUNTERS["evictions"], M.COUNTERS["failures"], M.REQUESTS_REFUSED,
            M.PRESETS_FILE_REFUSED, M.HEAD_EAGER, M.START_TIME, "vllm:request_success_total",
            "vllm:generation_tokens_total", "vllm:inter_token_latency_seconds_bucket"} <= names
    # an inter-token p99 panel, per replica
    assert any("histogram_quantile(0.99, sum by (pod, le) (rate(vllm:inter_token_latency" in e
               for _, e in dashboard_expressions())
    # every panel per replica: no aggregation that adds the replicas together (but the
    # requests per steer, which are summed over replicas by design)
    for w, e in dashboard_expressions():
        assert not re.search(r"\b(sum|max|min|avg|count)\s*\(", e) or w.startswith(
            ("variable", "panel 'Steered requests per steer'")), (w, e)
    # grouped per replica: every aggregation of the rules and the dashboard keeps `pod` or
    # adds everything up
    for w, e in rule_expressions() + dashboard_expressions():
        for m in CLAUSE.finditer(e):
            assert m.group(1) == "by" and ("pod" in m.group(2) or w.startswith("variable")
                                           or "steer" in m.group(2)), (w, e)


@pytest.mark.parametrize("planted, fragment", [
    ("sum by (pod) (rate(vllm_steer:requests_steerd_total[5m]))", "is not on /metrics"),
    ('sum by (pod) (rate(vllm_steer:steer_loads_total{status="400"}[5m]))',
     "has no label 'status'"),
    ("sum by (steer) (rate(vllm_steer:steer_loads_total[5m]))", "carry no 'steer'"),
    ("sum by (engine) (rate(vllm_steer:steer_op_seconds_total[5m]))", "adds the replicas"),
    ("sum by (pod) (rate(vllm:request_sucess_total[5m]))", "is not on /metrics"),
])
def test_the_expression_check_catches_a_planted_error(emitted, planted, fragment):
    found = problems("planted", planted, emitted)
    assert any(fragment in p for p in found), found


def test_the_absent_alerts_job_is_the_shipped_services_and_each_set_up_is_documented():
    """``job`` is what Prometheus names the scrape target: the shipped ServiceMonitor (no
    ``jobLabel``) gives the Service's name, which the rule selects; the docs give the value of
    the other set-ups: annotation discovery's scrape job and production-stack's engine Service
    (``RELEASE-MODELSPEC-engine-service``, named from the docs' install and the values file)."""
    (expr,) = [e for w, e in rule_expressions() if w == "rule VllmSteerMetricsAbsent"]
    job = re.fullmatch(r'absent\(vllm_steer:max_steers\{job="([^"]+)"\}\)', expr.strip())
    assert job, expr
    (service,) = [o for (k, _), o in manifests().items() if k == "Service"]
    monitor = yaml.safe_load((MONITORING / "servicemonitor.yaml").read_text())
    assert "jobLabel" not in monitor["spec"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= \
        service["metadata"]["labels"].items()
    assert job.group(1) == service["metadata"]["name"]
    deploy = (ROOT / "docs" / "deploy.md").read_text()
    stack = (ROOT / "docs" / "production-stack.md").read_text()
    release = re.search(r"helm install (\S+) vllm/vllm-stack", stack).group(1)
    values = yaml.safe_load((ROOT / "deploy" / "production-stack" / "values.yaml").read_text())
    (spec,) = values["servingEngineSpec"]["modelSpec"]
    assert f"`{release}-{spec['name']}-engine-service`" in stack
    for text in (deploy, stack):
        assert "RELEASE-MODELSPEC-engine-service" in text
    assert "`kubernetes-pods`" in deploy and "the Service's name" in deploy
    assert "VllmSteerMetricsAbsent" in stack


# --------------------------------------------------------------------------- promtool

def _promtool() -> str:
    exe = shutil.which("promtool")
    if exe is None:
        pytest.skip("promtool not installed (scripts/install.sh installs Debian's prometheus)")
    return exe


def _rule_file(path: Path, strip_annotations: bool = False) -> Path:
    spec = yaml.safe_load(RULES.read_text())["spec"]
    if strip_annotations:
        for g in spec["groups"]:
            for r in g["rules"]:
                r.pop("annotations", None)
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def test_promtool_checks_the_rules_and_catches_a_planted_error(tmp_path):
    exe = _promtool()
    r = subprocess.run([exe, "check", "rules", str(_rule_file(tmp_path / "rules.yaml"))],
                       capture_output=True, text=True, timeout=60)
    found = f"SUCCESS: {len(rule_expressions())} rules found"
    assert r.returncode == 0 and found in r.stdout, r.stdout + r.stderr
    bad = tmp_path / "bad.yaml"
    bad.write_text((tmp_path / "rules.yaml").read_text().replace("> 0.05", "> > 0.05", 1))
    r = subprocess.run([exe, "check", "rules", str(bad)], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode != 0 and "parse error" in r.stdout + r.stderr, r.stdout + r.stderr


def _series(emitted, name: str, pod: str, values: str, **labels) -> dict:
    """One input series of ``promtool test rules``: the sample's emitted labels, the
    target's, ``labels`` on top."""
    have = {**emitted[name], "namespace": "llm", "pod": pod, **labels}
    sel = ",".join(f'{k}="{v}"' for k, v in sorted(have.items()))
    return {"series": f"{name}{{{sel}}}", "values": values}


#: The p99 of vLLM's inter-token histogram against its own baseline (the form of the rule
#: before it compared means): what the latency test's series show it to miss and to make up.
ITL_P99_RISING = (
    "histogram_quantile(0.99, sum by (namespace, pod, le) "
    "(rate(vllm:inter_token_latency_seconds_bucket[10m]))) > bool 1.5 * "
    "histogram_quantile(0.99, sum by (namespace, pod, le) "
    "(rate(vllm:inter_token_latency_seconds_bucket[6h] offset 1h)))")


def _latency_test(s, itl_buckets: list[str], fired) -> dict:
    """``VllmSteerInterTokenLatencyRising`` on vLLM's own bucket bounds: 6000 tokens a minute
    per replica for 7 hours at an 11 ms step (the 8B shape's), then at minute 420:

    - ``sick`` (serving steered requests) and ``plain`` (serving none) slow to 22 ms: every
      token still in vLLM's 10-25 ms bucket, only the histogram's sum shows it; sick fires,
      plain does not;
    - ``tailnoise`` keeps its mean but 2% of its tokens land in the 25-50 ms bucket instead of
      0.5% (its interpolated p99 rises 1.5 times): no alert;
    - ``well`` stays as it was.
    """
    assert itl_buckets[:3] == ["0.01", "0.025", "0.05"] and itl_buckets[-1] == "+Inf", \
        itl_buckets
    lat = "vllm:inter_token_latency_seconds"
    n = 6000  # tokens a minute
    steady = f"0+{n}x500"
    # (cumulative count of le=0.025, sum in seconds) of each replica
    shapes = {"sick": (steady, "0+66x420 27720+132x80"),
              "plain": (steady, "0+66x420 27720+132x80"),
              "tailnoise": ("0+5970x420 2507400+5880x80", "0+66x500"),
              "well": (steady, "0+66x500")}
    series = []
    for pod, (le_25ms, total) in shapes.items():
        for le in itl_buckets:
            values = "0x500" if float(le) < 0.025 else le_25ms if le == "0.025" else steady
            series.append(s(f"{lat}_bucket", pod, values, le=le))
        series += [s(f"{lat}_sum", pod, total), s(f"{lat}_count", pod, steady),
                   s(M.REQUESTS_STEERED, pod, "0x500" if pod == "plain" else "0+60x500",
                     engine="0", steer="detox")]
    alert = "VllmSteerInterTokenLatencyRising"
    return {"interval": "1m", "input_series": series, "alert_rule_test": [
        {"eval_time": "450m", "alertname": alert, "exp_alerts": fired(alert)},
        {"eval_time": "432m", "alertname": alert, "exp_alerts": []},  # not yet 15 minutes
        {"eval_time": "400m", "alertname": alert, "exp_alerts": []}],
        # the buckets' p99 misses the doubled step and follows the tail: 1 where it would fire
        "promql_expr_test": [{"expr": ITL_P99_RISING, "eval_time": "450m", "exp_samples": [
            {"labels": f'{{namespace="llm", pod="{pod}"}}',
             "value": int(pod == "tailnoise")} for pod in shapes]}]}


def _alert_tests(emitted, itl_buckets: list[str]) -> dict:
    """Made-up series for replicas: ``sick`` should fire each alert, ``well`` never (and
    ``plain``, in the latency test, is slow but serves no steer)."""
    s = lambda *a, **k: _series(emitted, *a, job="vllm-steer", **k)  # noqa: E731
    api = {"engine": "", "source": M.API_SERVER}
    series = [
        # 10 requests/s finish on both; sick refuses 1/s (9%) for an unknown steer in the
        # API server, and one 500 in the engine core; well refuses 0.1/s (1%)
        s("vllm:request_success_total", "sick", "0+600x60", finished_reason="stop"),
        s("vllm:request_success_total", "well", "0+600x60", finished_reason="stop"),
        s(M.REQUESTS_REFUSED, "sick", "0+60x60", status="400", reason="unknown_steer", **api),
        s(M.REQUESTS_REFUSED, "sick", "0x20 1x40", status="500", reason="internal",
          engine="0", source=M.ENGINE_CORE),
        s(M.REQUESTS_REFUSED, "well", "0+6x60", status="400", reason="unknown_steer", **api),
        s(M.REQUESTS_REFUSED, "well", "0x60", status="500", reason="internal", **api),
        # ... and below 5% for any one reason: 0.4/s for each of two (4% each, 8% in all)
        s("vllm:request_success_total", "mixed", "0+600x60", finished_reason="stop"),
        s(M.REQUESTS_REFUSED, "mixed", "0+24x60", status="400", reason="unknown_steer", **api),
        s(M.REQUESTS_REFUSED, "mixed", "0+24x60", status="404", reason="unknown_preset",
          **api),
        # the presets file: refused on sick from minute 10, never on well
        s(M.PRESETS_FILE_REFUSED, "sick", "0x10 1x50"),
        s(M.PRESETS_FILE_REFUSED, "well", "0x60"),
        # 10 steered calls/s; sick 1 ms per call, well 0.1 ms; 10 ms between tokens on both
        s(M.OP_SECONDS, "sick", "0+0.6x60"),
        s(M.OP_SECONDS, "well", "0+0.06x60"),
        s(M.OP_CALLS, "sick", "0+600x60"),
        s(M.OP_CALLS, "well", "0+600x60"),
        s("vllm:inter_token_latency_seconds_sum", "sick", "0+6x60"),
        s("vllm:inter_token_latency_seconds_sum", "well", "0+6x60"),
        s("vllm:inter_token_latency_seconds_count", "sick", "0+600x60"),
        s("vllm:inter_token_latency_seconds_count", "well", "0+600x60"),
        # a refused load on sick at minute 30
        s(M.COUNTERS["failures"], "sick", "0x30 1x30"),
        s(M.COUNTERS["failures"], "well", "0x60"),
        # the head eager on sick from minute 10
        s(M.HEAD_EAGER, "sick", "0x10 1x50", engine="0"),
        s(M.HEAD_EAGER, "well", "0x60", engine="0"),
        # sick's server started again at minute 40
        s(M.START_TIME, "sick", "1000x40 3400x20"),
        s(M.START_TIME, "well", "1000x60"),
        # both replicas scraped
        s(M.CAPACITY, "sick", "8x60"),
        s(M.CAPACITY, "well", "8x60"),
    ]

    def fired(name, severity="warning", **labels):
        return [{"exp_labels": {"severity": severity, "namespace": "llm", "pod": "sick",
                                **labels}}]

    checks = [(45, "VllmSteerRefusalsRising",
               fired("VllmSteerRefusalsRising", reason="unknown_steer")),
              (5, "VllmSteerRefusalsRising", []),  # before its 10 minutes
              (25, "VllmSteerInternalErrors", fired("VllmSteerInternalErrors", "critical")),
              (15, "VllmSteerInternalErrors", []),
              (20, "VllmSteerPresetsFileRefused", fired("VllmSteerPresetsFileRefused")),
              (12, "VllmSteerPresetsFileRefused", []),  # refused, not yet for 5 minutes
              (40, "VllmSteerOpOverBudget", fired("VllmSteerOpOverBudget")),
              (10, "VllmSteerOpOverBudget", []),  # over budget, not yet for 15 minutes
              (35, "VllmSteerLoadFailures", fired("VllmSteerLoadFailures")),
              (55, "VllmSteerLoadFailures", []),  # 15 minutes later
              (30, "VllmSteerHeadEager", fired("VllmSteerHeadEager")),
              (20, "VllmSteerHeadEager", []),  # eager, not yet for 15 minutes
              (45, "VllmSteerRestarted", fired("VllmSteerRestarted")),
              (35, "VllmSteerRestarted", []),
              (30, "VllmSteerMetricsAbsent", [])]  # scraped
    groups = [{"interval": "1m", "input_series": series,
               "alert_rule_test": [{"eval_time": f"{t}m", "alertname": a, "exp_alerts": e}
                                   for t, a, e in checks]}]
    # nothing scraped: the absent alert fires after its 15 minutes (and not before)
    groups.append({"interval": "1m", "input_series": [
        s("vllm:request_success_total", "other", "0+600x30", finished_reason="stop")],
        "alert_rule_test": [
            {"eval_time": "20m", "alertname": "VllmSteerMetricsAbsent", "exp_alerts": [
                {"exp_labels": {"severity": "critical", "job": "vllm-steer"}}]},
            {"eval_time": "10m", "alertname": "VllmSteerMetricsAbsent", "exp_alerts": []}]})
    groups.append(_latency_test(s, itl_buckets, fired))
    return {"rule_files": ["rules.yaml"], "evaluation_interval": "1m", "tests": groups}


def test_each_alert_fires_on_the_sick_replica_only(emitted, itl_buckets, tmp_path):
    exe = _promtool()
    _rule_file(tmp_path / "rules.yaml", strip_annotations=True)
    tests = _alert_tests(emitted, itl_buckets)
    checks = [c for g in tests["tests"] for c in g["alert_rule_test"]]
    # every alert of the file is exercised, each both firing and silent
    alerts = {w.split(" ", 1)[1] for w, _ in rule_expressions()}
    assert {c["alertname"] for c in checks if c["exp_alerts"]} == alerts
    assert {c["alertname"] for c in checks if not c["exp_alerts"]} == alerts
    (tmp_path / "tests.yaml").write_text(yaml.safe_dump(tests, sort_keys=False))
    r = subprocess.run([exe, "test", "rules", "tests.yaml"], cwd=tmp_path, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    # the test is not vacuous: with a threshold of each kind raised the alert stays quiet and
    # promtool says so
    rules = tmp_path / "rules.yaml"
    spec = yaml.safe_load(rules.read_text())
    for alert, old, new in (("VllmSteerOpOverBudget", "> 0.05 *", "> 5 *"),
                            ("VllmSteerInterTokenLatencyRising", "> 1.5 *", "> 15 *"),
                            ("VllmSteerRefusalsRising", "> 0.05", "> 0.5"),
                            ("VllmSteerHeadEager", "== 1", "== 2")):
        changed = json.loads(json.dumps(spec))
        rule = next(r for g in changed["groups"] for r in g["rules"] if r["alert"] == alert)
        assert old in rule["expr"], (alert, old)
        rule["expr"] = rule["expr"].replace(old, new)
        rules.write_text(yaml.safe_dump(changed, sort_keys=False))
        r = subprocess.run([exe, "test", "rules", "tests.yaml"], cwd=tmp_path,
                           capture_output=True, text=True, timeout=120)
        assert r.returncode != 0 and alert in r.stdout + r.stderr, r.stdout
