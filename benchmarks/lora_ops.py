"""vLLM's multi-LoRA kernels (``lora_shrink`` / ``lora_expand`` and ``LoRAKernelMeta``, from
``vllm/lora/ops/triton_ops/``), loaded from their source files without importing vLLM: the
reference kernels the grouped steer op is measured beside (``bench_grouped_vs_lora.py``).

The five files are pure Triton and torch but for a few imports from the rest of vLLM (its
environment switches, logger, platform, ``triton_utils`` and two small helpers); :func:`load`
rewrites those imports to :mod:`stand-ins <_Stubs>` and loads the files as a private package,
so they run on a GPU host with no vLLM, and in Triton's CPU interpreter. The stand-ins set
what a stock vLLM server sets by default: no batch-invariant mode, no dual-stream LoRA (so no
programmatic dependent launch), no tuned config folder (the default kernel configs).

    python benchmarks/lora_ops.py carry build/lora_ops   # copy the files from the installed vLLM

``carry`` copies them (and the vLLM version) from the installed vLLM package, found without
importing it (the CPU build's Python sources are the CUDA build's), into a folder the GPU
host's runner carries.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import logging
import re
import shutil
import sys
import types
from pathlib import Path

FILES = ("kernel_utils.py", "utils.py", "lora_kernel_metadata.py", "lora_shrink_op.py",
         "lora_expand_op.py")
PACKAGE = "_vllm_lora_carried"


def installed_dir() -> Path | None:
    """``vllm/lora/ops/triton_ops`` of the installed vLLM (None: no vLLM), not imported."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return None
    d = Path(list(spec.submodule_search_locations)[0]) / "lora" / "ops" / "triton_ops"
    return d if all((d / f).exists() for f in FILES) else None


def carry(dest: str | Path) -> Path:
    """Copy the files from the installed vLLM into ``dest`` (with ``VERSION``)."""
    src = installed_dir()
    if src is None:
        raise SystemExit("lora_ops: no installed vLLM with vllm/lora/ops/triton_ops here")
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    for f in FILES:
        shutil.copyfile(src / f, dest / f)
    (dest / "VERSION").write_text(importlib.metadata.version("vllm") + "\n")
    return dest


class _Envs:
    """vLLM's environment switches the files read, at their defaults."""

    VLLM_BATCH_INVARIANT = False
    VLLM_LORA_ENABLE_DUAL_STREAM = False
    VLLM_LORA_DISABLE_PDL = True
    VLLM_TUNED_CONFIG_FOLDER = None


class _Platform:
    @staticmethod
    def is_cuda() -> bool:
        import torch

        return torch.cuda.is_available()

    @staticmethod
    def has_device_capability(cap: int) -> bool:
        import torch

        if not torch.cuda.is_available():
            return False
        major, minor = torch.cuda.get_device_capability()
        return major * 10 + minor >= cap


class _Logger(logging.LoggerAdapter):
    def warning_once(self, msg, *a):
        self.warning(msg, *a)

    def info_once(self, msg, *a):
        self.info(msg, *a)


def _stubs() -> types.ModuleType:
    import torch
    import triton
    import triton.language as tl

    m = types.ModuleType(f"{PACKAGE}._stubs")
    m.envs = _Envs()
    m.triton, m.tl = triton, tl
    m.current_platform = _Platform()
    m.init_logger = lambda name: _Logger(logging.getLogger(name), {})
    m.next_power_of_2 = lambda n: 1 << max(int(n) - 1, 0).bit_length()
    m.async_tensor_h2d = lambda data, dtype, target_device, pin_memory=False: torch.tensor(
        data, dtype=dtype, device=target_device)

    def direct_register_custom_op(**kw):  # the files then use their Python functions
        raise AttributeError("not registered as a torch op here")

    m.direct_register_custom_op = direct_register_custom_op
    return m


def _rewrite(text: str) -> str:
    text = re.sub(r"from vllm\.lora\.ops\.triton_ops\.(\w+) import",
                  rf"from {PACKAGE}.\1 import", text)
    return re.sub(r"from vllm(\.[\w.]+)? import", f"from {PACKAGE}._stubs import", text)


def load(src: str | Path | None = None) -> types.SimpleNamespace:
    """``shrink`` (``_lora_shrink``), ``expand`` (``_lora_expand``), ``Meta``
    (``LoRAKernelMeta``) and ``version``, from ``src`` (a :func:`carry` folder) or the
    installed vLLM's files."""
    src = Path(src) if src else installed_dir()
    if src is None or not all((src / f).exists() for f in FILES):
        raise FileNotFoundError(f"vLLM's LoRA op files are not in {src} (run `python "
                                f"benchmarks/lora_ops.py carry build/lora_ops` where vLLM is "
                                f"installed, and carry that folder)")
    if PACKAGE not in sys.modules:
        pkg = types.ModuleType(PACKAGE)
        pkg.__path__ = []
        sys.modules[PACKAGE] = pkg
        sys.modules[f"{PACKAGE}._stubs"] = _stubs()
        for f in FILES:
            name = f"{PACKAGE}.{f[:-3]}"
            mod = types.ModuleType(name)
            mod.__file__ = str(src / f)
            sys.modules[name] = mod
            # Triton's jit reads each kernel's source with inspect: linecache serves the
            # rewritten text under the file's own name
            code = _rewrite((src / f).read_text())
            import linecache

            linecache.cache[str(src / f) + f":{PACKAGE}"] = (
                len(code), None, code.splitlines(True), str(src / f) + f":{PACKAGE}")
            mod.__file__ = str(src / f) + f":{PACKAGE}"
            exec(compile(code, mod.__file__, "exec"), mod.__dict__)
    m = sys.modules
    version = (src / "VERSION").read_text().strip() if (src / "VERSION").exists() else (
        importlib.metadata.version("vllm") if installed_dir() else "?")
    return types.SimpleNamespace(shrink=m[f"{PACKAGE}.lora_shrink_op"]._lora_shrink,
                                 expand=m[f"{PACKAGE}.lora_expand_op"]._lora_expand,
                                 Meta=m[f"{PACKAGE}.lora_kernel_metadata"].LoRAKernelMeta,
                                 version=version)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "carry":
        print(f"lora_ops: carried {', '.join(FILES)} to {carry(sys.argv[2])}")
    else:
        raise SystemExit(__doc__.split("\n\n")[-2])
