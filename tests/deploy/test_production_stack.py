"""The values file for vLLM's production-stack chart (deploy/production-stack/values.yaml).

No copy of production-stack is in this repository, and its chart is not rendered here. What is
checked instead:

- the file uses only keys that production-stack's ``helm/values.schema.json`` defines, with
  the types it gives them (:data:`PRODUCTION_STACK_KEYS`, written from that schema at
  vllm-project/production-stack commit 01eaf92cb895ececa44ee86083f11522adafbbc9). Unlike that
  schema, which lets unknown keys of a model spec through, a key it does not define is
  refused here: the chart would ignore it silently;
- what production-stack's Deployment template (``helm/templates/deployment-vllm-multi.yaml``,
  commit f1f9822790e76c4d5ac03303c32ce2073e44c573) makes of the values gives the container
  the plain Deployment's `vllm serve` arguments (both parsed by vLLM's own serve parser), its
  environment, volumes, resources and image.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import yaml

from deploy_helpers import DEPLOY, ROOT, manifests

jsonschema = pytest.importorskip("jsonschema")

VALUES = DEPLOY / "production-stack" / "values.yaml"
DOC = ROOT / "docs" / "production-stack.md"


def _obj(properties: dict, **extra) -> dict:
    return {"type": "object", "additionalProperties": False, "properties": properties, **extra}


_PROBE = _obj({"failureThreshold": {"type": "integer"},
               "initialDelaySeconds": {"type": "integer"},
               "periodSeconds": {"type": "integer"},
               "httpGet": _obj({"path": {"type": "string"},
                                "port": {"type": ["integer", "string"]}})})
_PULL = {"type": "string", "enum": ["Always", "IfNotPresent", "Never"]}
#: The keys of production-stack's values schema this repository's values file may use, with
#: the types that schema gives them (see the module's docstring for the commit).
PRODUCTION_STACK_KEYS = _obj({"servingEngineSpec": _obj({
    "enableEngine": {"type": "boolean"},
    "vllmApiKey": {"type": ["string", "object"], "additionalProperties": False,
                   "properties": {"secretName": {"type": "string"},
                                  "secretKey": {"type": "string"}}},
    "imagePullPolicy": _PULL,
    "containerPort": {"type": "integer"},
    "startupProbe": _PROBE, "readinessProbe": _PROBE, "livenessProbe": _PROBE,
    # an object there; the chart's helper chart.engineStrategy writes it as the Deployment's
    # strategy (default: maxSurge 100%, maxUnavailable 0); its keys are Kubernetes'
    "strategy": _obj({"type": {"type": "string", "enum": ["RollingUpdate", "Recreate"]},
                      "rollingUpdate": _obj({"maxSurge": {"type": ["integer", "string"]},
                                             "maxUnavailable": {"type": ["integer",
                                                                         "string"]}})}),
    "tolerations": {"type": "array"},
    "runtimeClassName": {"type": "string"},
    "modelSpec": {"type": "array", "minItems": 1, "items": _obj({
        "name": {"type": "string"},
        "repository": {"type": "string"},
        "tag": {"type": "string"},
        "modelURL": {"type": "string"},
        "replicaCount": {"type": "integer"},
        "resources": {"type": "object"},
        "imagePullSecret": {"type": "string"},
        "nodeSelectorTerms": {"type": "array"},
        "affinity": {"type": "object"},
        "env": {"type": "array"},
        "extraVolumes": {"type": "array"},
        "extraVolumeMounts": {"type": "array"},
        "vllmConfig": _obj({
            "dtype": {"type": "string"},
            "maxModelLen": {"type": "integer"},
            "gpuMemoryUtilization": {"type": ["integer", "number", "string"]},
            "enablePrefixCaching": {"type": "boolean"},
            "tensorParallelSize": {"type": "integer"},
            "extraArgs": {"type": "array", "items": {"type": "string"}}}),
    }, required=["name", "repository", "tag", "modelURL"])}})}, required=["servingEngineSpec"])


def values() -> dict:
    return yaml.safe_load(VALUES.read_text())


def _spec() -> dict:
    (spec,) = values()["servingEngineSpec"]["modelSpec"]
    return spec


def _deployment_container() -> tuple[dict, dict]:
    (deploy,) = [o for (k, _), o in manifests().items() if k == "Deployment"]
    pod = deploy["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    return deploy, c


def serve_argv(top: dict, spec: dict) -> list[str]:
    """The `vllm serve` arguments production-stack's Deployment template builds from a model
    spec (for the keys this file uses): the model, host and port, then the vllmConfig flags
    in the template's order, then extraArgs."""
    cfg = spec.get("vllmConfig", {})
    argv = [spec["modelURL"], "--host", "0.0.0.0", "--port", str(top.get("containerPort", 8000))]
    argv.append("--enable-prefix-caching" if cfg.get("enablePrefixCaching")
                else "--no-enable-prefix-caching")
    for key, flag in (("maxModelLen", "--max-model-len"), ("dtype", "--dtype"),
                      ("tensorParallelSize", "--tensor-parallel-size"),
                      ("gpuMemoryUtilization", "--gpu_memory_utilization")):
        if key in cfg:
            argv += [flag, str(cfg[key])]
    return argv + list(cfg.get("extraArgs", []))


def test_the_values_file_uses_only_production_stacks_keys_and_types():
    jsonschema.validate(values(), PRODUCTION_STACK_KEYS)
    # the check refuses what production-stack's chart would silently ignore
    bad = values()
    bad["servingEngineSpec"]["modelSpec"][0]["extraVolumeMount"] = []
    with pytest.raises(jsonschema.ValidationError, match="extraVolumeMount"):
        jsonschema.validate(bad, PRODUCTION_STACK_KEYS)
    bad = values()
    bad["servingEngineSpec"]["modelSpec"][0]["vllmConfig"]["maxModelLen"] = "8192"
    with pytest.raises(jsonschema.ValidationError, match="8192"):
        jsonschema.validate(bad, PRODUCTION_STACK_KEYS)


PARSE = r"""
import json, os, sys
from vllm.entrypoints.cli.serve import ServeSubcommand
from vllm.utils.argparse_utils import FlexibleArgumentParser
parser = FlexibleArgumentParser(prog="vllm")
ServeSubcommand().subparser_init(parser.add_subparsers(dest="subparser"))
out = []
for argv in json.loads(os.environ["ARGVS"]):
    out.append({k: v for k, v in vars(parser.parse_args(["serve", *argv])).items()
                if not callable(v)})
print(json.dumps(out, default=str))
"""


def test_the_engine_gets_the_plain_deployments_arguments():
    """Both argument lists through vLLM's serve parser (the plugin's flags included): the
    same namespace but for the two the chart always sets (the host, all interfaces either way;
    prefix caching, on: vLLM's default)."""
    deploy, c = _deployment_container()
    top = values()["servingEngineSpec"]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_", "PYTHON"))}
    env.update(PYTHONPATH=str(ROOT), VLLM_PLUGINS="vllm_steer",
               ARGVS=json.dumps([c["args"], serve_argv(top, _spec())]))
    r = subprocess.run([sys.executable, "-c", PARSE], capture_output=True, text=True,
                       timeout=600, env=env, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    plain, stack = json.loads(r.stdout.strip().split("\n")[-1])
    assert plain["steer"] and plain["steer_presets_file"], plain  # the plugin's flags parsed
    assert (plain.pop("host"), stack.pop("host")) == (None, "0.0.0.0")
    assert (plain.pop("enable_prefix_caching"), stack.pop("enable_prefix_caching")) == (None,
                                                                                      True)
    assert stack == plain


def test_the_container_gets_the_plain_deployments_image_environment_volumes_and_resources():
    deploy, c = _deployment_container()
    top, spec = values()["servingEngineSpec"], _spec()
    assert f"{spec['repository']}:{spec['tag']}" == c["image"]
    assert top["imagePullPolicy"] == c["imagePullPolicy"]
    assert spec["replicaCount"] == deploy["spec"]["replicas"]
    # rolled out one replica at a time on the freed GPU, as the Deployment (the chart's own
    # default starts the new pods first)
    assert top["strategy"] == deploy["spec"]["strategy"] == {
        "type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}}
    assert spec["resources"] == c["resources"]
    # the template's VLLM_API_KEY (from vllmApiKey) and the spec's env: the Deployment's
    key = {"name": "VLLM_API_KEY", "valueFrom": {"secretKeyRef": {
        "name": top["vllmApiKey"]["secretName"], "key": top["vllmApiKey"]["secretKey"]}}}
    by_name = {e["name"]: e for e in [key, *spec["env"]]}
    assert len(by_name) == 1 + len(spec["env"])
    assert by_name == {e["name"]: e for e in c["env"]}
    assert by_name["VLLM_PLUGINS"]["value"] == "vllm_steer"  # production: no lens, no page
    # each mount path reads the same claim, ConfigMap or memory, read-only alike
    pod = deploy["spec"]["template"]["spec"]

    def mounts(volumes, volume_mounts):
        vols = {v["name"]: {k: x for k, x in v.items() if k != "name"} for v in volumes}
        return {m["mountPath"]: (vols[m["name"]], m.get("readOnly", False))
                for m in volume_mounts}

    assert mounts(spec["extraVolumes"], spec["extraVolumeMounts"]) == mounts(
        pod["volumes"], c["volumeMounts"])
    # the probes ask /health on the served port, with the Deployment's start-up allowance
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert top[probe]["httpGet"] == {"path": "/health", "port": top["containerPort"]}
        assert top[probe]["failureThreshold"] == c[probe]["failureThreshold"], probe
        assert top[probe]["periodSeconds"] == c[probe]["periodSeconds"], probe


def test_the_page_installs_this_file_and_says_how_it_was_checked():
    text = DOC.read_text()
    assert "-f deploy/production-stack/values.yaml" in text
    assert "01eaf92cb895ececa44ee86083f11522adafbbc9" in text
    assert "production-stack.md" in (ROOT / "docs" / "deploy.md").read_text()
