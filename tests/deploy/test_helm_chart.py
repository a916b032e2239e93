"""The Helm chart (deploy/helm/vllm-steer) rendered and linted by Helm's own Go library
(``helm-python-sdk``, in the test extra: Helm's SDK behind a C ABI, no helm binary).

With its default values and the release name ``vllm-steer`` the chart renders the very
objects of deploy/kubernetes/, the model-download Job and the steer writer pod of jobs/
included (compared as parsed YAML; the claims' ``helm.sh/resource-policy`` is the chart's
only addition), so that everything the plain manifests are tested for holds for the chart
too; the rendered objects pass the Kubernetes schema strictly, with the defaults and with
every scheduling, registry, environment and claim value set; the chart's values.schema.json
refuses a bad value at render time; changed values reach the fields Kubernetes reads; the
presets file is replaced as a whole and parses as the server parses it; string values stay
strings; a GPU request that differs from its limit fails the render; the Jobs are named from
the release and each can be left out.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from deploy_helpers import DEPLOY, manifests
from vllm_steer import presets_file

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
                  "presetsFile": "presets:\n  kind: {detox: 2}\n",
                  "serviceMonitor": {"enabled": False}, "networkPolicy": {"enabled": False}})
    deploy = got[("Deployment", RELEASE)]
    assert deploy["spec"]["replicas"] == 4
    assert deploy["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}
    assert {o["spec"]["storageClassName"] for (k, _), o in got.items()
            if k == "PersistentVolumeClaim"} == {"efs-sc"}
    assert _presets_doc(got[("ConfigMap", f"{RELEASE}-presets")]) == {
        "presets": {"kind": {"detox": 2}}}
    assert {k for k, _ in got} == CHART_KINDS - {"ServiceMonitor", "NetworkPolicy"}


def _served_presets(objects: dict) -> dict:
    """The presets of the file the replicas read, parsed and checked as the server does at
    start-up: the ConfigMap's key that the Deployment mounts where --steer-presets-file
    points (its steers: the --steer ones)."""
    (c,) = objects[("Deployment", RELEASE)]["spec"]["template"]["spec"]["containers"]
    (path,) = [a.split("=", 1)[1] for a in c["args"]
               if a.startswith("--steer-presets-file=")]
    (mount,) = [m for m in c["volumeMounts"] if m["name"] == "presets"]
    assert path.startswith(mount["mountPath"] + "/"), (path, mount)
    text = objects[("ConfigMap", f"{RELEASE}-presets")]["data"][path.rsplit("/", 1)[1]]
    steers = {"detox", "sentiment"}
    return presets_file.check(presets_file.parse(text, path), path, steers, 10.0)


MY_PRESETS = """\
# the fleet's aliases
presets:
  kind: {detox: 2}
  upbeat: "sentiment:3"
"""


def test_the_presets_file_is_replaced_as_a_whole():
    """`--set-file presetsFile=FILE` (a string value) gives the ConfigMap that very text: no
    preset of the chart's default file is merged in, and an empty one serves none."""
    got = render({"presetsFile": MY_PRESETS})
    assert got[("ConfigMap", f"{RELEASE}-presets")]["data"] == {"presets.yaml": MY_PRESETS}
    assert _served_presets(got) == {"kind": {"detox": 2.0}, "upbeat": {"sentiment": 3.0}}
    # the default file, served the same way, is the one replaced
    assert _served_presets(render()) == {"detox-stable": {"detox": 4.0}}
    assert _served_presets(render({"presetsFile": "presets: {}\n"})) == {}


@pytest.mark.parametrize("values, message", [
    ({"presetsFile": "presets: null\n"}, 'needs a "presets:" mapping'),
    ({"presetsFile": "kind: {detox: 2}\n"}, 'needs a "presets:" mapping'),
    ({"presetsFile": "presets: [kind\n"}, "presetsFile: not a YAML mapping"),
    ({"presetsFile": ""}, "at '/presetsFile': minLength"),
    # the map value of earlier versions of the chart, merged into the default presets
    ({"presets": {"kind": {"detox": 2}}}, "'presets' not allowed"),
], ids=["null", "no-presets-key", "not-yaml", "empty", "old-map-value"])
def test_a_presets_file_the_server_refuses_fails_the_install(values, message):
    with pytest.raises(helm.HelmError) as e:
        render(values)
    assert message in str(e.value), str(e.value)


def test_environment_values_render_as_strings():
    """A string value that YAML would read as a number or null stays a string: Kubernetes
    refuses an EnvVar value that is not one, and an empty VLLM_PLUGINS loads no plugin."""
    got = render({"modelDownload": {"modelId": "org/2024", "modelDir": "2024",
                                    "hfTokenSecret": {"name": "hf", "key": "1"}},
                  "plugins": "vllm_steer,vllm_steer_lens",
                  "apiKeySecret": {"name": "keys", "key": "0123"}})
    (job,) = _pod_spec(got[("Job", f"{RELEASE}-model-download")])["containers"]
    env = {e["name"]: e for e in job["env"]}
    assert env["MODEL_DIR"]["value"] == "2024" and env["MODEL_ID"]["value"] == "org/2024"
    assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "hf", "key": "1"}
    (c,) = _pod_spec(got[("Deployment", RELEASE)])["containers"]
    env = {e["name"]: e for e in c["env"]}
    assert env["VLLM_PLUGINS"]["value"] == "vllm_steer,vllm_steer_lens"
    assert env["VLLM_API_KEY"]["valueFrom"]["secretKeyRef"] == {"name": "keys", "key": "0123"}
    (c,) = _pod_spec(render({"plugins": "1"})[("Deployment", RELEASE)])["containers"]
    assert {"name": "VLLM_PLUGINS", "value": "1"} in c["env"]
    with pytest.raises(helm.HelmError) as e:
        render({"plugins": ""})
    assert "/plugins" in str(e.value) and "minLength" in str(e.value), str(e.value)


def test_a_gpu_request_that_differs_from_its_limit_fails_the_install():
    """Helm merges `resources` into the defaults: raising only the limit would keep the
    request of 1 GPU, which Kubernetes refuses (an extended resource's request equals its
    limit). The chart says so, with both values and the fix."""
    with pytest.raises(helm.HelmError) as e:
        render({"resources": {"limits": {"nvidia.com/gpu": "2"}}})
    msg = str(e.value)
    for part in ("requests.nvidia.com/gpu is 1", "limits.nvidia.com/gpu is 2",
                 "set both to the same value",
                 "--set resources.requests.nvidia\\.com/gpu=2"):
        assert part in msg, msg
    with pytest.raises(helm.HelmError) as e:
        render({"resources": {"requests": {"nvidia.com/gpu": 2}}})
    assert "requests.nvidia.com/gpu is 2 but limits.nvidia.com/gpu is 1" in str(e.value)
    got = render({"resources": {"requests": {"nvidia.com/gpu": 2},
                                "limits": {"nvidia.com/gpu": 2}}})
    (c,) = _pod_spec(got[("Deployment", RELEASE)])["containers"]
    assert c["resources"]["requests"]["nvidia.com/gpu"] == 2
    assert c["resources"]["limits"] == {"memory": "64Gi", "nvidia.com/gpu": 2}


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


