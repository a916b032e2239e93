"""The Helm chart (deploy/helm/vllm-steer) rendered and linted by Helm's own Go library
(``helm-python-sdk``, in the test extra: Helm's SDK behind a C ABI, no helm binary).

With its default values and the release name ``vllm-steer`` the chart renders the very
objects of deploy/kubernetes/, the model-download Job and the steer writer pod of jobs/
included (compared as parsed YAML; the claims' ``helm.sh/resource-policy`` is the chart's
only addition), so that everything the plain manifests are tested for holds for the chart
too; the rendered objects pass the Kubernetes schema strictly, with the defaults and with
every scheduling, registry, environment and claim value set; the chart's values.schema.json
refuses a bad value at render time; changed values reach the fields Kubernetes reads; the
Jobs are named from the release and each can be left out.
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
#: The plain manifests the chart renders (the alert rules stay a plain file).
CHART_KINDS = {"Deployment", "Service", "PersistentVolumeClaim", "ConfigMap",
               "PodDisruptionBudget", "NetworkPolicy", "ServiceMonitor", "Job", "Pod"}
#: What the chart adds to the plain claims: Helm's own annotation, read by `helm uninstall`.
KEEP = {"helm.sh/resource-policy": "keep"}
#: Every value for a real cluster set at once (the Kubernetes objects' own shapes).
CLUSTER_VALUES = {
    "imagePullSecrets": [{"name": "regcred"}],
    "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"},
    "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
    "affinity": {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [{
        "weight": 100, "podAffinityTerm": {
            "topologyKey": "kubernetes.io/hostname",
            "labelSelector": {"matchLabels": {"app.kubernetes.io/name": RELEASE}}}}]}},
    "extraEnv": [{"name": "VLLM_LOGGING_LEVEL", "value": "DEBUG"},
                 {"name": "HTTPS_PROXY", "valueFrom": {"configMapKeyRef": {
                     "name": "proxy", "key": "https"}}}],
    "existingModelsClaim": "shared-models",
    "existingSteersClaim": "team-steers",
}


def render(values: dict | None = None, name: str = RELEASE) -> dict[tuple[str, str], dict]:
    with helm.Chart.load(str(CHART)) as chart:
        out = chart.render(values or {}, name=name, namespace="llm")
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
    assert {k for k, _ in want} == CHART_KINDS - {"PrometheusRule"}
    for key, obj in want.items():
        if key[0] == "ConfigMap":  # the file's text may differ in layout, not in content
            assert _presets_doc(got[key]) == _presets_doc(obj)
            got[key]["data"] = obj["data"]
        if key[0] == "PersistentVolumeClaim":  # `helm uninstall` keeps both claims
            assert got[key]["metadata"].pop("annotations") == KEEP, key
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


def _pod_spec(obj: dict) -> dict:
    return obj["spec"]["template"]["spec"] if "template" in obj["spec"] else obj["spec"]


def _claims(obj: dict) -> dict[str, str]:
    """{mount path: claim} of a pod's volumes, as its containers mount them."""
    spec = _pod_spec(obj)
    vols = {v["name"]: v for v in spec["volumes"]}
    return {m["mountPath"]: vols[m["name"]]["persistentVolumeClaim"]["claimName"]
            for c in spec["containers"] for m in c["volumeMounts"]
            if "persistentVolumeClaim" in vols[m["name"]]}


def test_cluster_values_reach_the_fields_kubernetes_reads():
    got = render(CLUSTER_VALUES)
    deploy = got[("Deployment", RELEASE)]
    spec = deploy["spec"]["template"]["spec"]
    for key in ("imagePullSecrets", "nodeSelector", "tolerations", "affinity"):
        assert spec[key] == CLUSTER_VALUES[key], key
    (c,) = spec["containers"]
    names = [e["name"] for e in c["env"]]
    # the chart's variables first, the extra ones after, each once
    assert names[-2:] == ["VLLM_LOGGING_LEVEL", "HTTPS_PROXY"] and len(set(names)) == len(names)
    assert c["env"][-2:] == CLUSTER_VALUES["extraEnv"]
    # the existing claims are mounted, and none is created
    assert not [k for k, _ in got if k == "PersistentVolumeClaim"]
    assert _claims(deploy) == {"/models": "shared-models", "/steers": "team-steers"}
    job = got[("Job", f"{RELEASE}-model-download")]
    writer = got[("Pod", f"{RELEASE}-steer-writer")]
    assert _claims(job) == {"/models": "shared-models"}
    assert _claims(writer) == {"/steers": "team-steers"}
    # the Jobs pull the same image from the same registry; they need no GPU node
    for obj in (job, writer):
        assert _pod_spec(obj)["imagePullSecrets"] == [{"name": "regcred"}]
        assert "tolerations" not in _pod_spec(obj) and "nodeSelector" not in _pod_spec(obj)
    # one existing claim: the chart creates the other, kept on uninstall
    got = render({"existingModelsClaim": "shared-models"})
    (claim,) = [o for (k, _), o in got.items() if k == "PersistentVolumeClaim"]
    assert claim["metadata"]["name"] == f"{RELEASE}-steers"
    assert claim["metadata"]["annotations"] == KEEP
    assert _claims(got[("Deployment", RELEASE)]) == {"/models": "shared-models",
                                                     "/steers": f"{RELEASE}-steers"}


def test_the_jobs_are_named_from_the_release_and_each_can_be_left_out():
    got = render({"modelDownload": {"modelId": "Qwen/Qwen2.5-7B-Instruct",
                                    "modelDir": "Qwen2.5-7B-Instruct",
                                    "hfTokenSecret": {"name": "hf", "key": "t"}}}, name="prod")
    job, writer = got[("Job", "prod-model-download")], got[("Pod", "prod-steer-writer")]
    assert _claims(job) == {"/models": "prod-models"}
    assert _claims(writer) == {"/steers": "prod-steers"}
    assert _claims(got[("Deployment", "prod")]) == {"/models": "prod-models",
                                                    "/steers": "prod-steers"}
    (c,) = _pod_spec(job)["containers"]
    env = {e["name"]: e for e in c["env"]}
    assert env["MODEL_ID"]["value"] == "Qwen/Qwen2.5-7B-Instruct"
    assert env["MODEL_DIR"]["value"] == "Qwen2.5-7B-Instruct"
    assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "hf", "key": "t"}
    # neither pod is a replica: the Service does not send them requests
    selector = got[("Service", "prod")]["spec"]["selector"]
    assert not selector.items() <= writer["metadata"]["labels"].items()
    assert not selector.items() <= job["spec"]["template"]["metadata"]["labels"].items()
    kinds = {k for k, _ in render({"modelDownload": {"enabled": False}})}
    assert "Job" not in kinds and "Pod" in kinds
    kinds = {k for k, _ in render({"steerWriter": {"enabled": False}})}
    assert "Pod" not in kinds and "Job" in kinds


def test_the_schema_refuses_a_misshapen_cluster_value():
    for values, key in (({"imagePullSecrets": ["regcred"]}, "imagePullSecrets"),
                        ({"extraEnv": [{"value": "1"}]}, "extraEnv"),
                        ({"nodeSelector": {"gpu": True}}, "nodeSelector"),
                        ({"modelDownload": {"enable": False}}, "enable"),
                        ({"existingModelsClaim": 3}, "existingModelsClaim")):
        with pytest.raises(helm.HelmError) as e:
            render(values)
        assert key in str(e.value), (values, str(e.value))


@pytest.mark.parametrize("values", [{}, CLUSTER_VALUES], ids=["defaults", "cluster-values"])
def test_the_rendered_objects_pass_the_kubernetes_schema(tmp_path, values):
    """Strictly: a value put where Kubernetes does not read it (a misspelt or misplaced
    field) fails; the ServiceMonitor, a custom resource, is not checked."""
    exe = shutil.which("kubernetes-validate", path=str(Path(sys.executable).parent))
    if exe is None:
        pytest.skip("kubernetes-validate not installed (it is in the test extra)")
    objects = render(values)
    path = tmp_path / "rendered.yaml"
    path.write_text("---\n".join(yaml.safe_dump(o) for o in objects.values()))
    r = subprocess.run([exe, "--strict", str(path)], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("passed") + r.stderr.count("passed") == len(objects) - 1


