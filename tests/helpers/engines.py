"""Starting engines for tests: a steered offline ``LLM``, Model Runner V2 on this CPU (the
test shim), stock vLLM with no plugin, and a request's bound steers as the engine core
writes them."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@contextlib.contextmanager
def steered_llm(model_dir, steer_files: dict, **engine_kw):
    """An offline ``LLM`` serving ``steer_files`` (``--steer``), whose ``collective_rpc`` may
    carry the test's local functions (to read or set the worker's state)."""
    from vllm import LLM

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
        engine = LLM(str(model_dir), additional_config={"vllm_steer": {"steers": steer_files}},
                     **engine_kw)
        yield engine
        del engine


V2_SHIM_DIR = ROOT / "tests" / "v2shim"
UNIPROC_FLAG = "STEER_TEST_UNIPROC_SHIM"


def shim_module():
    """``tests/v2shim/sitecustomize.py`` loaded as a module, for its patch functions (loaded so,
    it installs nothing by itself)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("steer_test_v2shim",
                                                  V2_SHIM_DIR / "sitecustomize.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def hook_recorder():
    """``tests/v2shim/hook_recorder.py`` as the module ``hook_recorder`` (one instance in this
    process; the engine processes import it from the ``PYTHONPATH``)."""
    import importlib.util
    import sys

    if "hook_recorder" not in sys.modules:
        spec = importlib.util.spec_from_file_location("hook_recorder",
                                                      V2_SHIM_DIR / "hook_recorder.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules["hook_recorder"] = mod
        spec.loader.exec_module(mod)
    return sys.modules["hook_recorder"]


def _shim_on_path() -> None:
    """``tests/v2shim`` on the ``PYTHONPATH`` the processes started from here inherit: each of
    its shims is off unless its flag is set (the hook recorder's too)."""
    path = os.environ.get("PYTHONPATH", "")
    if str(V2_SHIM_DIR) not in path.split(os.pathsep):
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(V2_SHIM_DIR), path) if p)


def _platform_shim(flag: str, patch: str) -> bool:
    """The shim's CPU-platform patch ``patch`` in this process (which builds offline engines'
    configs) and, by ``flag`` (set to 1 unless the caller set it), in the processes it starts;
    ``flag=0``: neither. Whether it is on."""
    _shim_on_path()
    if os.environ.setdefault(flag, "1") != "1":
        return False
    shim = shim_module()
    shim.on_cpu_platform(getattr(shim, patch))
    return True


def use_uniproc_workers() -> None:
    """Engines of one worker, started by this process (offline ``LLM``) or by the processes it
    starts (``vllm serve``), run that worker in their engine-core process: vLLM's ``"uni"``
    executor, its default on a GPU. vLLM's CPU platform would spawn it (``"mp"``): one more
    process that imports vLLM, about 15 s per engine on this CPU. Engines that ask for
    ``distributed_executor_backend="mp"`` (``--distributed-executor-backend mp``) keep it, and
    engines of several workers are left alone. ``STEER_TEST_UNIPROC_SHIM=0`` turns this off."""
    _platform_shim(UNIPROC_FLAG, "keep_uniproc_executor")


FORK_FLAG = "STEER_TEST_FORK_SHIM"
START_METHOD_ENV = "VLLM_WORKER_MULTIPROC_METHOD"


def fork_engine_processes() -> None:
    """The engine-core and worker processes of the engines this process starts (offline
    ``LLM``), and of the ``vllm serve`` processes it starts, are forked: vLLM's CPU platform
    would spawn them, each starting Python and importing vLLM and the plugin again, about 10 s
    per engine on this CPU. An offline engine forks by vLLM's default once the shim keeps the
    platform from setting ``spawn``; ``vllm serve`` sets ``spawn`` itself unless
    ``VLLM_WORKER_MULTIPROC_METHOD`` is set (on every platform), so this process sets it to
    ``fork`` (unless the caller set it), a setting vLLM supports. Engines whose caller asks for
    ``spawn`` keep it (:func:`v2_runner_env`), and :func:`serve_spawns_engines` gives a test
    ``vllm serve``'s own default back. ``STEER_TEST_FORK_SHIM=0`` turns this off."""
    if _platform_shim(FORK_FLAG, "keep_start_method"):
        os.environ.setdefault(START_METHOD_ENV, "fork")


GC_FLAG = "STEER_TEST_GC_SHIM"


def freeze_imports_in_started_processes() -> None:
    """The processes started from here (``vllm serve``, its engine and API server processes,
    scripts) freeze for the collector what their imports made
    (``tests/v2shim/sitecustomize.py``, :func:`freeze_what_imports_made`): vLLM's start-up
    objects are not scanned again by every full collection. ``STEER_TEST_GC_SHIM=0`` turns this
    off."""
    _shim_on_path()
    os.environ.setdefault(GC_FLAG, "1")


def serve_spawns_engines(mp: pytest.MonkeyPatch) -> None:
    """``vllm serve`` started from here with its own start method, as on a host: it spawns its
    engine core (and that its workers), each importing vLLM and the plugin afresh. For the
    tests that run a server as deployed (the README's quick start, the chaos soak, the
    data-parallel server)."""
    mp.delenv(START_METHOD_ENV, raising=False)


def v2_runner_env() -> dict[str, str]:
    """Environment that puts the vLLM engine processes started from it on Model Runner V2 on
    this CPU, through the test shim tests/v2shim/sitecustomize.py (a stand-in Triton "cpu"
    backend, kernels in the Triton interpreter). Also for subprocesses (``vllm serve``)."""
    path = os.environ.get("PYTHONPATH", "")
    return {"PYTHONPATH": os.pathsep.join(p for p in (str(V2_SHIM_DIR), path) if p),
            "STEER_TEST_V2_SHIM": "1", "VLLM_USE_V2_MODEL_RUNNER": "1", "TRITON_INTERPRET": "1",
            START_METHOD_ENV: "spawn"}  # sitecustomize runs at process start


def bound_extra(names, steer) -> dict:
    """``extra_args`` of a request whose steers the engine core bound (as
    ``vllm_steer.integrations.engine.binding.bind_request`` does) to a runtime loaded from
    ``--steer`` files ``names`` (placed as the server's configuration places them); the raw
    value too."""
    from vllm_steer.config import SteerServerConfig
    from vllm_steer.request import BOUND_KEY, BoundSteer, SteerRequest

    if steer is None:
        return {}
    request = SteerRequest.parse(steer)
    placed = SteerServerConfig(steers={n: f"{n}.safetensors" for n in names}).startup_placement()
    bound = [BoundSteer(n, *placed[n], request.named[n])
             for n in request.strengths if n in placed]
    return {"steer": steer, BOUND_KEY: BoundSteer.to_wire(bound)}


_STOCK_VLLM = r"""
import gc, json, sys
from vllm import LLM, SamplingParams
if __name__ == "__main__":
    results = []
    for job in json.loads(sys.argv[1]):  # one engine after another, in this one process
        gc.freeze()  # vLLM's gc.collect() calls as an engine starts skip what exists now
        llm = LLM(job["model"], **job["engine_kw"])
        outs = llm.generate(job["prompts"], SamplingParams(max_tokens=job["max_tokens"],
                                                           temperature=0, logprobs=0))
        results.append([[list(o.outputs[0].token_ids),
                         [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs,
                                                         o.outputs[0].token_ids)]]
                        for o in outs])
        del llm, outs
        gc.collect()
    print("RESULT" + json.dumps(results))
"""


def stock_vllm(model_dir, prompts: list, max_tokens: int, engine_kw: dict, workdir: Path
               ) -> list:
    """Greedy ``[tokens, logprobs]`` per prompt from stock vLLM with no plugin loaded
    (``VLLM_PLUGINS=none``, a subprocess), the same engine settings: what unsteered requests
    must reproduce. See :func:`stock_vllm_many`."""
    return stock_vllm_many([(model_dir, prompts, max_tokens, engine_kw)], workdir)[0]


def stock_vllm_many(jobs: list, workdir: Path) -> list:
    """:func:`stock_vllm` of each ``(model_dir, prompts, max_tokens, engine_kw)`` in ``jobs``,
    their engines one after another in one subprocess (one Python start and one vLLM import
    for all). The engines run inside that subprocess (``VLLM_ENABLE_V1_MULTIPROCESSING=0``:
    no engine-core and worker processes to spawn, each importing vLLM again)."""
    import json
    import subprocess
    import sys

    script = Path(workdir) / "stock_vllm.py"
    script.write_text(_STOCK_VLLM)
    env = dict(os.environ, VLLM_PLUGINS="none", VLLM_ENABLE_V1_MULTIPROCESSING="0")
    spec = [{"model": str(m), "prompts": p, "max_tokens": n, "engine_kw": kw}
            for m, p, n, kw in jobs]
    out = subprocess.run([sys.executable, str(script), json.dumps(spec)], env=env,
                         capture_output=True, text=True, timeout=600 * len(jobs))
    line = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT")]
    assert line, out.stderr[-3000:]
    results = json.loads(line[0][len("RESULT"):])
    assert len(results) == len(jobs), out.stderr[-3000:]
    return results
