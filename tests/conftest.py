"""Shared fixtures: tiny random-weight models made on the fly, the embedded model, the data,
the engine tests' pair of steers, Model Runner V2 for a module's engines. Plain helpers live
in :mod:`helpers` (``from helpers.models import make_tiny_llama``)."""

from __future__ import annotations

import os

# One OpenMP thread per process (this one, its engines and servers), set before torch is
# imported: the suite's models are tiny and two test workers with their engines already fill
# the machine's cores, where more threads per process only wait on each other (measured on 2
# cores: engine modules 7-14% faster). A value the caller set is kept.
os.environ.setdefault("OMP_NUM_THREADS", "1")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
from helpers.engines import (  # noqa: E402
    fork_engine_processes,
    freeze_imports_in_started_processes,
    hook_recorder,
    use_uniproc_workers,
    v2_runner_env,
)
from helpers.models import make_tiny_llama, tokenizer_src  # noqa: E402
from helpers.reference import HFReference  # noqa: E402
from helpers.steers import random_steer, save_steers  # noqa: E402
from vllm_steer.integrations import plugin  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DATA_DIR = Path(os.environ.get("VLLM_STEER_DATA", ROOT.parent / "shared" / "data"))

# An engine's processes get 1 s, not vLLM's 5, to exit before they are killed when a test's
# engine or server shuts down (inherited by the servers the tests start): every test that
# looks at an engine does so while it runs.
os.environ.setdefault("VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS", "1")
# An engine of one worker runs it in its engine-core process, as on a GPU, not in a process of
# its own as vLLM's CPU platform would: one process start less per engine (docs/internals.md).
use_uniproc_workers()
# Their engine-core and worker processes are forked, as on a GPU, not spawned as vLLM's CPU
# platform would: no Python start and vLLM import per process (docs/internals.md).
fork_engine_processes()
# The plugin's hooks note their first call (tests/v2shim/hook_recorder.py): installed before
# anything registers the plugin in this process (the engine processes: its sitecustomize).
hook_recorder().install(plugin)


@pytest.fixture(scope="session", autouse=True)
def started_processes_freeze_their_imports():
    """The processes started from here freeze for the collector what their imports made:
    vLLM's 800,000 start-up objects are not scanned again at every full collection
    (docs/internals.md). Set by a fixture, in each test process, not when this file is
    imported: pytest-xdist's controller imports it too, and its test workers would inherit the
    setting (their own heaps are left as they are)."""
    freeze_imports_in_started_processes()


def pytest_collection_modifyitems(config, items):
    """Modules that start vLLM engines (any test marked ``vllm``: most of the suite's time)
    run first, the others after them in their order: with two workers (``make test``,
    ``--dist loadfile --no-loadscope-reorder``) the run then ends on short modules rather
    than on one engine module while the other worker idles. (Starting the longest engine
    modules first was measured slower: they then run side by side, each starting servers and
    engines of several processes; benchmarks/RESULTS.md, "The test suite's time".)"""
    heavy = {item.path for item in items if item.get_closest_marker("vllm")}
    items.sort(key=lambda item: item.path not in heavy)  # stable: in-module order kept


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """Tiny random Llama (hidden 64, 2 layers, untied head), HF folder."""
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The embedded SmolLM2-135M-Instruct as an HF folder (prepared once, cached)."""
    return tokenizer_src()


@pytest.fixture(scope="session")
def data_dir() -> Path:
    if not DATA_DIR.is_dir():
        pytest.skip(f"data folder {DATA_DIR} not found (set VLLM_STEER_DATA)")
    return DATA_DIR


@pytest.fixture(scope="session")
def pair_steers(tmp_path_factory):
    """The engine tests' two random steers ``a`` and ``b`` (hidden 64, rank 8, seeds 1 and 2,
    scale 3: strengths of ~5 change the tiny models' greedy tokens): ``(objects, files)``."""
    objs = {"a": random_steer(64, 8, "a", seed=1, scale=3.0),
            "b": random_steer(64, 8, "b", seed=2, scale=3.0)}
    return objs, save_steers(tmp_path_factory.mktemp("pair-steers"), objs)


@pytest.fixture(scope="session")
def pair_ref(tiny_model_dir, pair_steers):
    """:class:`HFReference` of the tiny model with :func:`pair_steers`."""
    return HFReference(tiny_model_dir, pair_steers[0])


@pytest.fixture(scope="module")
def v2_runner():
    """Engines started in this module (offline ``LLM`` or servers that inherit os.environ) run
    Model Runner V2; see :func:`v2_runner_env`. Slow (Triton interpreter): tiny models."""
    with pytest.MonkeyPatch.context() as mp:
        for k, v in v2_runner_env().items():
            mp.setenv(k, v)
        # the test process imported vLLM without the shim; its config check wants Triton too
        mp.setattr("vllm.config.vllm.HAS_TRITON", True)
        yield
