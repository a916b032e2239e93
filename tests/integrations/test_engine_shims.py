"""The test harness's shims for vLLM's CPU platform (``tests/v2shim/sitecustomize.py``): what
``check_and_update_config`` keeps, on a stand-in platform that does what vLLM's CPU platform
does to the settings they keep."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from helpers.engines import GC_FLAG, shim_module

START = "VLLM_WORKER_MULTIPROC_METHOD"


@pytest.fixture(autouse=True)
def start_method_restored(monkeypatch):
    """The variable as this process had it, whatever a test or the stand-in writes."""
    monkeypatch.setenv(START, "")  # noted for restoring, then removed
    monkeypatch.delenv(START)


def cpu_like_platform():
    class Platform:
        @classmethod
        def check_and_update_config(cls, vllm_config):
            os.environ[START] = "spawn"  # as vLLM's CpuPlatform does
            vllm_config.parallel_config.distributed_executor_backend = "mp"
            vllm_config.scheduler_config.async_scheduling = False
    return Platform


def config(backend="uni", async_scheduling=True):
    return SimpleNamespace(parallel_config=SimpleNamespace(distributed_executor_backend=backend),
                           scheduler_config=SimpleNamespace(async_scheduling=async_scheduling))


def probe_result(argv, env, timeout):
    """Run a probe script in a fresh process and return what it printed after ``RESULT`` (JSON);
    without that line, fail with the end of its stderr."""
    import json
    import subprocess

    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout)
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT")]
    assert line, proc.stderr[-3000:]
    return json.loads(line[0][len("RESULT"):])


@pytest.mark.parametrize("given", [None, "fork", "spawn"])
def test_the_start_method_keeps_the_value_it_had(given):
    shim = shim_module()
    platform = cpu_like_platform()
    shim.keep_start_method(platform)
    shim.keep_start_method(platform)  # idempotent
    if given is not None:
        os.environ[START] = given
    cfg = config()
    platform.check_and_update_config(cfg)
    assert os.environ.get(START) == given
    # the platform's other changes are its own
    assert cfg.parallel_config.distributed_executor_backend == "mp"
    assert cfg.scheduler_config.async_scheduling is False


def test_the_shims_stack_each_keeping_its_own_setting():
    shim = shim_module()
    platform = cpu_like_platform()
    shim.keep_uniproc_executor(platform)
    shim.keep_start_method(platform)
    shim.keep_async_scheduling(platform)
    shim.keep_uniproc_executor(platform)  # idempotent under the others
    cfg = config()
    platform.check_and_update_config(cfg)
    assert START not in os.environ
    assert cfg.parallel_config.distributed_executor_backend == "uni"
    assert cfg.scheduler_config.async_scheduling is True
    # an engine of several workers keeps what the platform gives it
    cfg = config(backend=None)
    platform.check_and_update_config(cfg)
    assert cfg.parallel_config.distributed_executor_backend == "mp"


def test_vllms_cpu_platform_still_sets_spawn_as_the_stand_in_does():
    """The premise of the start-method shim, read in the installed vLLM: its CPU platform's
    config check sets the start method to ``spawn`` (if vLLM stops, the shim has nothing to
    keep and this says so)."""
    import inspect

    import vllm.platforms.cpu as cpu

    assert f'os.environ["{START}"] = "spawn"' in inspect.getsource(cpu)
    cpu_like_platform().check_and_update_config(config())
    assert os.environ[START] == "spawn"


def test_vllm_serve_sets_spawn_only_when_the_start_method_is_unset():
    """The premise of the suite's ``VLLM_WORKER_MULTIPROC_METHOD=fork``
    (``helpers.engines.fork_engine_processes``), read in the installed vLLM: ``vllm serve``
    sets ``spawn`` unless the variable is set."""
    import inspect

    from vllm.entrypoints.serve.utils.api_utils import cli_env_setup

    src = inspect.getsource(cli_env_setup)
    assert f'if "{START}" not in os.environ' in src and f'os.environ["{START}"] = "spawn"' in src


_WIDE_BLOCKS = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
import torch
from helpers.engines import shim_module

shim = shim_module()
shim._install()  # before vLLM is imported: its HAS_TRITON
shim._bool_masks()
from triton.runtime import interpreter
from vllm.v1.worker.gpu.sample.gumbel import gumbel_sample
from vllm.v1.worker.gpu.sample.logprob import compute_topk_scores

launches = []
own = interpreter.GridExecutor.__call__


def record(self, *args, **kwargs):  # what Triton's own launch gets
    launches.append([self.fn.__name__, list(self.grid), kwargs.get("BLOCK_SIZE")])
    return own(self, *args, **kwargs)


interpreter.GridExecutor.__call__ = record
out = {}
for vocab in (49152, 50257):  # a multiple of the blocks' 1,024 tokens, and not
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(6, vocab, generator=g) * 3
    logits[0, [100, 30000, vocab - 1]] = 50.0  # a tie across blocks: the first wins
    logits[1, [5, 6]] = 50.0  # a tie inside a block
    logits[2, vocab - 1] = 50.0  # the last token, in the last (partial) block
    temperature = torch.tensor([0.0, 0.0, 0.0, 1.0, 0.7, 1.5])
    seed = torch.tensor([0, 0, 0, 11, 12, 13])
    rows = torch.arange(6, dtype=torch.int32)
    pos = torch.tensor([3, 4, 5, 6, 7, 8])
    for name in ("own", "wide"):
        if name == "wide":
            shim._one_vocabulary_block_per_row()
        launches.clear()
        sampled = gumbel_sample(logits, rows, temperature, seed, pos, apply_temperature=True,
                                is_drafting=False)
        scores = compute_topk_scores(logits, 3, sampled)
        out[f"{vocab}-{name}"] = {"sampled": sampled.tolist(),
                                  "ids": scores.logprob_token_ids.tolist(),
                                  "logprobs": scores.logprobs.tolist(),
                                  "ranks": scores.selected_token_ranks.tolist(),
                                  "launches": list(launches)}
        interpreter.GridExecutor.__call__ = record  # the next vocabulary: Triton's own again
    ref = torch.log_softmax(logits, -1)
    out[f"{vocab}-reference"] = {"argmax": logits.argmax(-1).tolist(), "logprobs": ref.tolist()}
print("RESULT" + json.dumps(out))
"""


def test_v2s_vocabulary_kernels_read_a_row_as_one_block_with_the_same_tokens_and_logprobs(
        tmp_path):
    """The V2 shim's one block per vocabulary row (``_one_vocabulary_block_per_row``), on vLLM's
    own ``gumbel_sample`` and ``compute_topk_scores``: the same sampled tokens (greedy rows with
    ties across and inside blocks and at the last partial block, seeded random rows), the same
    ranks and top tokens, logprobs within 1e-5 of Triton's own blocked launches and of
    ``log_softmax``; and the wide launches did run (one program per row, one block)."""
    import sys

    script = tmp_path / "wide.py"
    script.write_text(_WIDE_BLOCKS)
    env = dict(os.environ, TRITON_INTERPRET="1", STEER_TEST_V2_SHIM="0")  # patched here only
    tests_dir = str(Path(__file__).resolve().parents[1])
    out = probe_result([sys.executable, str(script), tests_dir], env, timeout=600)
    for vocab in (49152, 50257):
        own, wide = out[f"{vocab}-own"], out[f"{vocab}-wide"]
        ref = out[f"{vocab}-reference"]
        assert wide["sampled"] == own["sampled"]
        assert wide["sampled"][:3] == ref["argmax"][:3] == [100, 5, vocab - 1]
        assert wide["ids"] == own["ids"] and wide["ranks"] == own["ranks"]
        rows = zip(wide["logprobs"], own["logprobs"], wide["ids"], ref["logprobs"], strict=True)
        for w, o, ids, r in rows:
            assert max(abs(a - b) for a, b in zip(w, o, strict=True)) < 1e-5
            assert max(abs(a - r[i]) for a, i in zip(w, ids, strict=True)) < 1e-5
        blocks = -(-vocab // 1024)
        wide_block = 1 << (vocab - 1).bit_length()
        assert ["_gumbel_sample_kernel", [6, blocks], 1024] in own["launches"]
        assert ["_gumbel_sample_kernel", [6, 1], wide_block] in wide["launches"]
        assert ["_topk_log_softmax_kernel", [6], wide_block] in wide["launches"]
        assert ["_ranks_kernel", [6], wide_block] in wide["launches"]


_GC_PROBE = r"""
import gc, json, os, weakref
import vllm.config  # about half a million objects: full collections run while it imports
import vllm.platforms.cpu  # the fork shim's heap freeze registers with the platform's patch
frozen = gc.get_freeze_count()


class Node:
    pass


def cycle_collected():  # a cycle made after the imports, unreachable: collected as always
    a, b = Node(), Node()
    a.b, b.a = b, a
    ref = weakref.ref(a)
    del a, b
    gc.collect()
    return ref() is None


out = {"frozen": frozen, "cycle_collected": cycle_collected()}
r, w = os.pipe()
pid = os.fork()
if pid == 0:  # a forked child: everything it inherited frozen, nothing scanned again
    os.write(w, json.dumps({"frozen": gc.get_freeze_count(),
                            "cycle_collected": cycle_collected()}).encode())
    os._exit(0)
os.waitpid(pid, 0)
out["child"] = json.loads(os.read(r, 65536))
out["after_fork"] = gc.get_freeze_count()  # the parent's as it was
print("RESULT" + json.dumps(out))
"""


@pytest.mark.parametrize("on", ["1", "0"])
def test_started_processes_freeze_what_importing_vllm_made_and_still_collect_cycles(on):
    """``STEER_TEST_GC_SHIM=1`` (``helpers.engines.freeze_imports_in_started_processes``):
    after importing vLLM, what the imports made is frozen for the collector (the next full
    collections do not scan it), a cycle made later is collected as always, and a forked child
    (the fork shim) starts with everything frozen while the parent's freezes stay. Off, a
    process freezes nothing but its forked children's heaps."""
    import sys

    shims = str(Path(__file__).resolve().parents[1] / "v2shim")
    env = {**os.environ, "PYTHONPATH": shims, GC_FLAG: on, "STEER_TEST_FORK_SHIM": "1"}
    r = probe_result([sys.executable, "-c", _GC_PROBE], env, timeout=300)
    assert r["cycle_collected"] and r["child"]["cycle_collected"], r
    if on == "1":
        assert r["frozen"] > 100_000, r
    else:
        assert r["frozen"] == 0, r
    assert r["after_fork"] == r["frozen"], r
    assert r["child"]["frozen"] > max(r["frozen"], 100_000), r
