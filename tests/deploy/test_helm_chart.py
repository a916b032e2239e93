"""The Helm chart (deploy/helm/vllm-steer) rendered and linted by Helm's own Go library
(``helm-python-sdk``, in the test extra: Helm's SDK behind a C ABI, no helm binary).

With its default values and the release name ``vllm-steer`` the chart renders the very
objects of deploy/kubernetes/ (compared as parsed YAML), so that everything the plain
manifests are tested for holds for the chart too; the rendered objects pass the Kubernetes
schema strictly; the chart's values.schema.json refuses a bad value at render time; changed
values reach the objects.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from deploy_helpers import DEPLOY, manifests

helm = pytest.importorskip("helm_python", reason="helm-python-sdk not installed (test extra)")

CHART = DEPLOY / "helm" / "vllm-steer"
RELEASE = "vllm-steer"
#: The plain manifests the chart renders (the jobs and the rule file stay plain files).
CHART_KINDS = {"Deployment", "Service", "PersistentVolumeClaim", "ConfigMap",
               "PodDisruptionBudget", "NetworkPolicy", "ServiceMonitor"}


def render(values: dict | None = None) -> dict[tuple[str, str], dict]:
    with helm.Chart.load(str(CHART)) as chart:
        out = chart.render(values or {}, name=RELEASE, namespace="llm")
    objects = {}
    for text in out.values():
        for doc in yaml.safe_load_all(text):
            if doc:
                objects[(doc["kind"], doc["metadata"]["name"])] = doc
    return objects


def _presets_doc(cm: dict) -> dict:
    return yaml.safe_load(cm["data"]["presets.yaml"])


def test_the_chart_with_its_defaults_renders_the_plain_manifests():
    got = render()
    want = {k: v for k, v in manifests().items() if k[0] in CHART_KINDS}
    assert set(got) == set(want)
    for key, obj in want.items():
        if key[0] == "ConfigMap":  # the file's text may differ in layout, not in content
            assert _presets_doc(got[key]) == _presets_doc(obj)
            got[key]["data"] = obj["data"]
        assert got[key] == obj, key


def test_helm_lint_passes_and_catches_a_planted_fault(tmp_path):
    res = helm.lint(str(CHART))
    assert res["errors"] == [] and res["messages"] == [], res
    bad = tmp_path / "vllm-steer"
    shutil.copytree(CHART, bad)
    (bad / "Chart.yaml").write_text((bad / "Chart.yaml").read_text().replace(
        "version: 0.1.0", "version: not-a-version"))
    res = helm.lint(str(bad))
    assert res["errors"] or any(m["severity"] >= 3 for m in res["messages"]), res


def test_the_values_schema_refuses_a_bad_value():
    with pytest.raises(helm.HelmError) as e:
        render({"replicas": "two"})
    assert "replicas" in str(e.value)
    with pytest.raises(helm.HelmError) as e:
        render({"storageClasName": "fast"})  # a misspelt key
    assert "storageClasName" in str(e.value)


def test_values_reach_the_objects():
    got = render({"replicas": 4, "storageClassName": "efs-sc",
                  "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
                  # Helm merges maps into the defaults: null drops a default preset
                  "presets": {"kind": {"detox": 2}, "detox-stable": None},
                  "serviceMonitor": {"enabled": False}, "networkPolicy": {"enabled": False}})
    deploy = got[("Deployment", RELEASE)]
    assert deploy["spec"]["replicas"] == 4
    assert deploy["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}
    assert {o["spec"]["storageClassName"] for (k, _), o in got.items()
            if k == "PersistentVolumeClaim"} == {"efs-sc"}
    assert _presets_doc(got[("ConfigMap", f"{RELEASE}-presets")]) == {
        "presets": {"kind": {"detox": 2}}}
    assert {k for k, _ in got} == CHART_KINDS - {"ServiceMonitor", "NetworkPolicy"}


def test_the_rendered_objects_pass_the_kubernetes_schema(tmp_path):
    exe = shutil.which("kubernetes-validate", path=str(Path(sys.executable).parent))
    if exe is None:
        pytest.skip("kubernetes-validate not installed (it is in the test extra)")
    path = tmp_path / "rendered.yaml"
    path.write_text("---\n".join(yaml.safe_dump(o) for o in render().values()))
    r = subprocess.run([exe, "--strict", str(path)], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("passed") + r.stderr.count("passed") == len(render()) - 1


