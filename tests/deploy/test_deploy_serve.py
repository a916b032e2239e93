"""The Kubernetes Deployment's `vllm serve` command, served on this CPU from the wheel.

The wheel that ``python -m build`` makes is installed into a folder; `vllm serve` runs in an
interpreter that sees only that folder and this environment's vLLM, with the Deployment's
arguments and environment (deploy/kubernetes/deployment.yaml). What a CPU cannot take is
swapped, and only that: the model (a tiny random Llama for Llama-3.1-8B-Instruct, the served
name kept), ``--dtype`` and ``--max-model-len`` for it, a KV-cache size and eager mode for
the CPU; the steers are random ones of the tiny model's hidden size under the file names the
Deployment gives. One engine for the module.
"""

from __future__ import annotations

import re
import subprocess
import sys
from unittest import mock

import pytest
import requests

from helpers.steers import random_steer
from deploy_helpers import (MOUNTS, build, isolated_env, isolated_site, manifests,
                            secret_values, swap_mounts, write_config_mounts)
from vllm_steer.format import save_steer
from vllm_steer.server import launch

pytestmark = pytest.mark.vllm
KEY = "test-key-from-the-secret"
MARK = "<!-- the installed copy -->\n"
SWAPPED = {"--dtype": "float32", "--max-model-len": "512"}
CPU_ONLY = ["--max-num-seqs", "16", "--kv-cache-memory-bytes", str(1 << 28), "--enforce-eager"]


def _deployment() -> dict:
    (deploy,) = [o for (k, _), o in manifests().items() if k == "Deployment"]
    return deploy


def _deployment_container() -> dict:
    (c,) = _deployment()["spec"]["template"]["spec"]["containers"]
    return c


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve")
    wheel, _ = build(tmp / "build")
    target, view = tmp / "site", isolated_site(tmp)
    r = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--target",
                        str(target), str(wheel)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    with open(target / "vllm_steer" / "server" / "static" / "index.html", "a") as f:
        f.write(MARK)
    c = _deployment_container()
    argv = [swap_mounts(a, tmp) for a in c["args"]]
    for m in MOUNTS:
        (tmp / m.strip("/")).mkdir(exist_ok=True)
    write_config_mounts(c, _deployment()["spec"]["template"]["spec"]["volumes"], tmp)
    for seed, a in enumerate(a for a in argv if a.endswith(".safetensors")):
        name, path = a.split("=", 1)
        save_steer(path, random_steer(64, 8, name, seed=seed + 1, scale=3.0))
    argv[0] = str(tiny_model_dir)
    argv = [f"{a.split('=')[0]}={SWAPPED[a.split('=')[0]]}" if a.split("=")[0] in SWAPPED
            else a for a in argv] + CPU_ONLY
    env = secret_values(c)
    env["VLLM_API_KEY"] = KEY
    # `vllm serve` of an interpreter without site-packages (the wheel's folder first), run
    # outside the checkout
    wrapper = tmp / "vllm"
    wrapper.write_text(f'#!/bin/sh\ncd "{tmp}" && exec "{sys.executable}" -S -m '
                       'vllm.entrypoints.cli.main "$@"\n')
    wrapper.chmod(0o755)
    full_env = isolated_env(target, view, **env)
    with mock.patch.object(launch, "vllm_executable", return_value=str(wrapper)), \
            mock.patch.dict("os.environ", full_env, clear=True):
        with launch.serve(argv, tmp / "server.log") as url:
            yield {"url": url, "target": target, "argv": argv, "log": tmp / "server.log"}


def _get(server, path, key=None):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return requests.get(server["url"] + path, headers=headers, timeout=30)


def _complete(server, model, steer=None, key=KEY):
    body = {"model": model, "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0}
    if steer is not None:
        body["steer"] = steer
    return requests.post(server["url"] + "/v1/completions", json=body, timeout=120,
                         headers={"Authorization": f"Bearer {key}"} if key else {})


def test_the_lens_route_and_the_playground_are_off_in_production(server):
    # the Deployment's VLLM_PLUGINS names the plugin only (its endpoint plugin serves both);
    # the installed copy has the page, so a 404 is the setting's, not a missing file's
    assert (server["target"] / "vllm_steer" / "server" / "static" / "index.html").read_text(
    ).endswith(MARK)
    assert _get(server, "/steer/").status_code == 404
    r = requests.post(server["url"] + "/v1/steer/highlight", timeout=30,
                      headers={"Authorization": f"Bearer {KEY}"},
                      json={"model": "meta-llama/Llama-3.1-8B-Instruct", "text": "Hello",
                            "steer": {"detox": 4}})
    assert r.status_code == 404, r.text


def test_health_and_metrics_answer_the_probes_without_the_key(server):
    assert _get(server, "/health").status_code == 200
    r = _get(server, "/metrics")
    assert r.status_code == 200
    loaded = re.search(r"^vllm_steer:loaded_steers(?:\{[^}]*\})? (\S+)$", r.text, re.M)
    assert loaded is not None, r.text[:2000]
    assert float(loaded.group(1)) == 2.0  # detox and sentiment, the Deployment's --steer


def test_every_v1_route_needs_the_key_from_the_secret(server):
    for path in ("/v1/models", "/v1/steers"):
        assert _get(server, path).status_code == 401, path
        assert _get(server, path, key="wrong").status_code == 401, path
        assert _get(server, path, key=KEY).status_code == 200, path
    assert _complete(server, "meta-llama/Llama-3.1-8B-Instruct", key=None).status_code == 401
    ids = {m["id"] for m in _get(server, "/v1/models", key=KEY).json()["data"]}
    # the served model, the --steer-preset and the presets file's preset (the ConfigMap)
    assert ids == {"meta-llama/Llama-3.1-8B-Instruct", "polite", "detox-stable"}
    steers = _get(server, "/v1/steers", key=KEY).json()
    names = {s["name"] for s in (steers["data"] if isinstance(steers, dict) else steers)}
    assert names == {"detox", "sentiment"}


def test_the_preset_serves_detox_at_4_and_the_steer_changes_the_text(server):
    model = "meta-llama/Llama-3.1-8B-Instruct"
    plain = _complete(server, model)
    steered = _complete(server, model, steer={"detox": 4})
    preset = _complete(server, "polite")
    for r in (plain, steered, preset):
        assert r.status_code == 200, r.text
    text = [r.json()["choices"][0]["text"] for r in (plain, steered, preset)]
    assert text[1] != text[0]
    assert text[2] == text[1]


def test_only_the_admin_key_from_its_secret_changes_presets(server):
    """The Deployment enables updates with the steer admin key: the API key serves requests
    but gets 403 on the management routes; the admin key (its own Secret) adds a preset,
    which then serves."""
    admin = secret_values(_deployment_container())["VLLM_STEER_ADMIN_KEY"]
    assert admin != KEY
    body = {"name": "kind", "steer": {"detox": 2}}
    url = server["url"] + "/v1/steer-presets"
    r = requests.post(url, json=body, timeout=30, headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 403 and "admin key" in r.json()["error"]["message"], r.text
    r = requests.post(url, json=body, timeout=30)
    assert r.status_code == 401
    r = requests.post(url, json=body, timeout=30, headers={"Authorization": f"Bearer {admin}"})
    assert r.status_code == 200, r.text
    ids = {m["id"] for m in _get(server, "/v1/models", key=KEY).json()["data"]}
    assert "kind" in ids
    assert _complete(server, "kind").status_code == 200  # the admin key also sends requests
    assert _complete(server, "kind", key=admin).status_code == 200
