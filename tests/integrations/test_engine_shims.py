"""The test harness's shims for vLLM's CPU platform (``tests/v2shim/sitecustomize.py``): what
``check_and_update_config`` keeps, on a stand-in platform that does what vLLM's CPU platform
does to the settings they keep."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

from helpers.engines import shim_module

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
