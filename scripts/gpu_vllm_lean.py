#!/usr/bin/env python3
"""The lean vLLM carry: what a dense bf16 model on Model Runner V2 (FlashAttention 3, Hopper)
never imports, checked by an import trace of vLLM's own wheel before it is left behind.

vLLM's wheel requires every CUDA extra any model may need (FlashInfer, the CuTe DSL, TileLang,
video decoders, MLA and quantized-GEMM kernels, alternative weight loaders) and ships compiled
extensions for them (FlashAttention 2 next to 3, MoE, FlashMLA, DeepGEMM, a Rust frontend).
Carried to a GPU host without network access in 56 MiB calls, they cost more than half of the
carry. This module lists them (``LEAN_DROP``: requirements; ``LEAN_STRIP``: members of the vLLM
wheel), each with the reason a dense model does not need it, and proves the reason from the
wheel itself:

  trace   parse every module of the vLLM wheel (``ast``, nothing imported), follow the imports
          that run when a module is imported (module level, ``if`` blocks included, not
          ``TYPE_CHECKING``) from the modules a dense model's engine imports (``PATH_ROOTS``),
          and classify every import of a dropped package or extension: *unconditional* (on
          that path: the drop is refused), *conditional* (under a module-level ``if``),
          *guarded* (``try``/``except ImportError``, ``contextlib.suppress``) or *lazy*
          (inside a function: runs only when that feature is used)
  strip   rewrite the vLLM wheel without ``LEAN_STRIP`` (its RECORD too), after ``trace``

``gpu_vllm_carry.py download --lean`` runs both. The first engine call on the GPU host is the
run-time check: a lazy import of a dropped package fails there with ``ModuleNotFoundError``
naming it, and ``download`` without ``--lean`` carries everything. ``host`` (run on the GPU
host after the install) says which attention extensions load. Standard library only.
"""

from __future__ import annotations

import argparse
import ast
import io
import json
import sys
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

# Requirements of vLLM left behind: name -> (import names, why a dense bf16 model on V2 does
# not need it). Their own requirements are not followed either.
LEAN_DROP: dict[str, tuple[tuple[str, ...], str]] = {
    "flashinfer-python": (("flashinfer",), "FlashInfer attention, sampling and MoE kernels: "
                          "vLLM imports it inside functions only; Hopper attention is "
                          "FlashAttention 3, and V2's sampler asks for FlashInfer at start-up "
                          "unless VLLM_USE_FLASHINFER_SAMPLER=0 (the GPU scripts set it when "
                          "FlashInfer is absent) and then samples with its own kernels"),
    "nvidia-cutlass-dsl": (("cutlass",), "the CuTe DSL (FlashAttention 4 on Blackwell, FP4/FP8 "
                           "GEMMs): imported inside functions only"),
    "quack-kernels": (("quack",), "CuTe DSL kernels for Blackwell"),
    "tilelang": (("tilelang",), "TileLang kernels (sparse MLA)"),
    "tokenspeed-mla": (("tokenspeed_mla",), "MLA attention kernels (DeepSeek-style models)"),
    "humming-kernels": (("humming",), "quantized GEMM kernels"),
    "nvidia-cudnn-frontend": (("cudnn",), "cuDNN attention for MLA prefill"),
    "torchcodec": (("torchcodec",), "video decoding for multimodal inputs"),
    "pynvvideocodec": (("PyNvVideoCodec",), "GPU video decoding for multimodal inputs"),
    "fastsafetensors": (("fastsafetensors",), "the --load-format fastsafetensors loader"),
    "instanttensor": (("instanttensor",), "the --load-format instanttensor loader"),
    "nvtx": (("nvtx",), "profiler ranges (--enable-layerwise-nvtx-tracing)"),
}

# Members of the vLLM wheel left behind: path (a file, or a folder ending in "/") -> (import
# name, why). FlashAttention 3 is kept: on Hopper vLLM prefers it (fa_utils.get_flash_attn_version).
LEAN_STRIP: dict[str, tuple[str, str]] = {
    "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so": (
        "vllm.vllm_flash_attn._vllm_fa2_C", "FlashAttention 2: Hopper uses FlashAttention 3 "
        "(ALiBi, which needs 2, is not a dense Llama's)"),
    "vllm/_moe_C_stable_libtorch.abi3.so": (
        "vllm._moe_C_stable_libtorch", "MoE kernels (imported under contextlib.suppress)"),
    "vllm/vllm-rs": ("vllm.vllm-rs", "the Rust frontend binary (VLLM_USE_RUST_FRONTEND)"),
    "vllm/third_party/deep_gemm/": ("vllm.third_party.deep_gemm", "DeepGEMM FP8 GEMMs"),
    "vllm/third_party/fmha_sm100/": ("vllm.third_party.fmha_sm100",
                                     "Blackwell attention headers"),
    "vllm/_flashmla_C.abi3.so": ("vllm._flashmla_C", "FlashMLA (DeepSeek-style attention)"),
    "vllm/_flashmla_extension_C.abi3.so": ("vllm._flashmla_extension_C", "FlashMLA"),
    "vllm/_deepselect_C.abi3.so": ("vllm._deepselect_C", "sparse-attention top-k (DeepSeek)"),
    "vllm/_flashkda_C.abi3.so": ("vllm._flashkda_C", "Kimi delta attention"),
    "vllm/_qutlass_C.abi3.so": ("vllm._qutlass_C", "FP4 kernels; cannot load on torch 2.11 "
                                "(three missing stable-ABI symbols: gpu_vllm_carry.py abi)"),
}

# The modules whose import a dense model's engine runs: the offline LLM and the OpenAI server,
# the engine core and executors, V2's runner and sampler, the V1 runner, the CUDA platform,
# the Llama model, FlashAttention's backend, the default loader.
PATH_ROOTS = (
    "vllm", "vllm.entrypoints.llm", "vllm.entrypoints.openai.api_server",
    "vllm.v1.engine.core", "vllm.v1.engine.async_llm", "vllm.v1.executor.uniproc_executor",
    "vllm.v1.executor.multiproc_executor", "vllm.v1.worker.gpu_worker",
    "vllm.v1.worker.gpu.model_runner", "vllm.v1.worker.gpu.sample.sampler",
    "vllm.v1.worker.gpu_model_runner", "vllm.platforms.cuda", "vllm.model_executor.models.llama",
    "vllm.v1.attention.backends.flash_attn", "vllm.vllm_flash_attn.flash_attn_interface",
    "vllm.model_executor.model_loader.default_loader",
)

KINDS = ("unconditional", "conditional", "guarded", "lazy")
_IMPORT_ERRORS = {"ImportError", "ModuleNotFoundError", "Exception", "BaseException", "OSError"}


class LeanError(Exception):
    """A drop the trace refuses, or a wheel that cannot be read; the message names each."""


@dataclass
class Site:
    module: str  # the importing module
    line: int
    target: str  # the imported module
    kind: str  # one of KINDS


@dataclass
class Trace:
    reachable: set[str]  # modules that importing the roots may import (``if`` blocks included)
    required: set[str]  # modules that importing the roots always imports
    sites: dict[str, list[Site]] = field(default_factory=dict)  # dropped name -> its sites
    via: dict[str, str] = field(default_factory=dict)  # module -> the module that imports it

    def chain(self, module: str) -> str:
        out = [module]
        while out[-1] in self.via and len(out) < 12:
            out.append(self.via[out[-1]])
        return " <- ".join(out)

    def refused(self) -> list[str]:
        """One line per unconditional import, on the path, of something dropped."""
        out = []
        for name, sites in self.sites.items():
            for s in {(s.module, s.line): s for s in sites}.values():
                if s.kind == "unconditional" and s.module in self.required:
                    out.append(f"{name}: imported unconditionally by {s.module} (line {s.line};"
                               f" {self.chain(s.module)})")
        return out


def _modules(z: zipfile.ZipFile) -> tuple[dict[str, tuple[str, bool]], set[str]]:
    """Python modules of the wheel: name -> (member, is_package); and every importable name
    (compiled extensions and folders included)."""
    mods, names = {}, set()
    for n in z.namelist():
        if not n.startswith("vllm/"):
            continue
        parts = n.split("/")
        names.update(".".join(parts[:i]) for i in range(1, len(parts)))
        stem = parts[-1].split(".")[0]
        if n.endswith(".so") or "." not in parts[-1]:
            names.add(".".join(parts[:-1] + [stem]))
        if n.endswith(".py"):
            pkg = parts[-1] == "__init__.py"
            name = ".".join(parts[:-1] if pkg else parts[:-1] + [stem])
            mods[name] = (n, pkg)
            names.add(name)
    return mods, names


def _from_target(module: str, pkg: bool, node: ast.ImportFrom) -> str:
    """The module a ``from ... import`` of ``module`` names, relative levels resolved."""
    if not node.level:
        return node.module or ""
    base = module.split(".") if pkg else module.split(".")[:-1]
    base = base[:len(base) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def _handles_import_error(t: ast.Try) -> bool:
    """Whether a handler of ``t`` catches an import error (or everything)."""
    for h in t.handlers:
        types = [] if h.type is None else (
            h.type.elts if isinstance(h.type, ast.Tuple) else [h.type])
        if h.type is None or any(getattr(x, "id", getattr(x, "attr", None)) in _IMPORT_ERRORS
                                 for x in types):
            return True
    return False


def _imports(module: str, source: bytes, pkg: bool, names: set[str]) -> list[tuple[str, str, int]]:
    """(target, kind, line) of every import statement of one module."""
    out: list[tuple[str, str, int]] = []

    def emit(node, kind):
        if isinstance(node, ast.Import):
            out.extend((a.name, kind, node.lineno) for a in node.names)
            return
        target = _from_target(module, pkg, node)
        for a in node.names:
            sub = f"{target}.{a.name}"
            out.append((sub if sub in names else target, kind, node.lineno))

    def visit(body, kind):
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for sub in ast.walk(node):
                    if isinstance(sub, (ast.Import, ast.ImportFrom)):
                        emit(sub, "lazy")
            elif isinstance(node, ast.ClassDef):
                visit(node.body, kind)
            elif isinstance(node, ast.Try):
                visit(node.body, "guarded" if _handles_import_error(node) else kind)
                for h in node.handlers:
                    visit(h.body, kind)
                visit(node.orelse, kind)
                visit(node.finalbody, kind)
            elif isinstance(node, ast.With):
                suppressed = any("suppress" in ast.unparse(i.context_expr) for i in node.items)
                visit(node.body, "guarded" if suppressed else kind)
            elif isinstance(node, ast.If):
                if "TYPE_CHECKING" in ast.unparse(node.test):
                    continue
                weaker = "conditional" if kind == "unconditional" else kind
                visit(node.body, weaker)
                visit(node.orelse, weaker)
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                emit(node, kind)

    visit(ast.parse(source).body, "unconditional")
    return out


def trace(wheel: str | Path, roots=PATH_ROOTS, drop=None, strip=None) -> Trace:
    """The import trace of ``wheel`` (see the module docstring); ``drop`` / ``strip`` default to
    ``LEAN_DROP`` / ``LEAN_STRIP``."""
    drop = LEAN_DROP if drop is None else drop
    strip = LEAN_STRIP if strip is None else strip
    watched = {imp: name for name, (imps, _) in drop.items() for imp in imps}
    watched.update({imp: member for member, (imp, _) in strip.items()})
    try:
        z = zipfile.ZipFile(wheel)
    except (OSError, zipfile.BadZipFile) as e:
        raise LeanError(f"{wheel}: not a readable wheel ({e})") from None
    with z:
        mods, names = _modules(z)
        missing = [r for r in roots if r not in mods]
        if missing:
            raise LeanError(f"{wheel}: the path's modules {missing} are not in this wheel: the "
                            "trace's PATH_ROOTS are for vLLM 0.33; update them for this vLLM")
        t = Trace(reachable=set(), required=set())
        parsed: dict[str, list] = {}
        for edges, found in ((("unconditional",), t.required),
                             (("unconditional", "conditional"), t.reachable)):
            queue = list(roots)
            while queue:
                m = queue.pop()
                if m in found or m not in mods:
                    continue
                found.add(m)
                parts = m.split(".")
                for i in range(1, len(parts)):  # importing a.b.c imports a and a.b first
                    parent = ".".join(parts[:i])
                    if parent not in found:
                        t.via.setdefault(parent, m)
                        queue.append(parent)
                for target, kind, _ in _module_imports(z, mods, names, m, parsed):
                    if target.startswith("vllm") and kind in edges and target not in found:
                        t.via.setdefault(target, m)
                        queue.append(target)
        for m in mods:  # every import site of a watched name, reachable or not
            for target, kind, line in _module_imports(z, mods, names, m, parsed):
                for imp, name in watched.items():
                    if target == imp or target.startswith(imp + "."):
                        t.sites.setdefault(name, []).append(Site(m, line, target, kind))
    t.sites = {name: t.sites.get(name, []) for name in (*drop, *strip)}
    return t


def _module_imports(z, mods, names, m, cache):
    if m not in cache:
        member, pkg = mods[m]
        try:
            cache[m] = _imports(m, z.read(member), pkg, names)
        except SyntaxError:
            cache[m] = []
    return cache[m]


def check(wheel: str | Path, **kw) -> Trace:
    """:func:`trace`, raising :class:`LeanError` listing every refused drop at once."""
    t = trace(wheel, **kw)
    refused = t.refused()
    if refused:
        raise LeanError("the lean carry would drop what a dense model's engine imports:\n  "
                        + "\n  ".join(refused)
                        + "\ncarry it (remove it from LEAN_DROP / LEAN_STRIP in "
                          "scripts/gpu_vllm_lean.py), or carry everything: download without --lean")
    return t


def report(t: Trace, sizes: dict[str, int] | None = None) -> str:
    sizes = sizes or {}
    lines = [f"# import trace: a dense model's engine imports {len(t.required)} vLLM modules "
             f"always and {len(t.reachable) - len(t.required)} more under module-level `if`s;"
             " imports of each dropped name in them:",
             f"{'left behind':44s} {'MiB':>6s} " + " ".join(f"{k:>13s}" for k in KINDS)]
    for name, sites in t.sites.items():
        on_path = [s for s in sites if s.module in t.reachable]
        counts = [sum((s.kind if s.module in t.required or s.kind != "unconditional"
                       else "conditional") == k for s in on_path) for k in KINDS]
        mib = f"{sizes[name] / (1 << 20):6.1f}" if name in sizes else f"{'':6s}"
        lines.append(f"{name:44s} {mib} " + " ".join(f"{c:13d}" for c in counts))
    return "\n".join(lines)


def strip_wheel(src: str | Path, dst: str | Path, members=None) -> int:
    """Write ``src`` without ``members`` (default: ``LEAN_STRIP``; a name ending in "/" is a
    folder) and without their RECORD lines to ``dst``; returns the bytes left out (uncompressed)."""
    members = tuple(LEAN_STRIP if members is None else members)

    def dropped(n: str) -> bool:
        return any(n == m or (m.endswith("/") and n.startswith(m)) for m in members)

    left = 0
    buf = io.BytesIO()
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zout:
        for info in zin.infolist():
            if dropped(info.filename):
                left += info.file_size
                continue
            data = zin.read(info)
            if info.filename.endswith(".dist-info/RECORD"):
                rows = data.decode().splitlines()
                data = ("\n".join(r for r in rows if not dropped(r.split(",")[0])) + "\n").encode()
            zout.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED)
    Path(dst).write_bytes(buf.getvalue())
    return left


def host_report() -> dict:
    """(On the GPU host, after the install.) Which of vLLM's attention and op extensions load."""
    import importlib

    out = {}
    for name in ("vllm._C_stable_libtorch", "vllm.vllm_flash_attn._vllm_fa3_C",
                 "vllm.vllm_flash_attn._vllm_fa2_C", "vllm._moe_C_stable_libtorch"):
        try:
            importlib.import_module(name)
            out[name] = "loads"
        except Exception as e:  # noqa: BLE001  (report every reason, never stop)
            out[name] = f"{type(e).__name__}: {e}"
    try:
        from vllm.v1.attention.backends.fa_utils import get_flash_attn_version

        out["flash_attn_version"] = get_flash_attn_version()
    except Exception as e:  # noqa: BLE001
        out["flash_attn_version"] = f"{type(e).__name__}: {e}"
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("trace", help="the import trace of a vLLM wheel against the lean drops")
    p.add_argument("wheel")
    p.add_argument("--sites", action="store_true", help="also list every import site")
    p = sub.add_parser("strip", help="rewrite a vLLM wheel without LEAN_STRIP (after trace)")
    p.add_argument("wheel")
    p.add_argument("--out", required=True)
    sub.add_parser("host", help="(GPU host) which attention extensions load")
    a = ap.parse_args(argv)
    try:
        if a.cmd == "trace":
            t = trace(a.wheel)
            print(report(t))
            if a.sites:
                for name, sites in t.sites.items():
                    for s in sites:
                        print(f"  {name}: {s.kind:13s} {s.module}:{s.line}")
            refused = t.refused()
            for r in refused:
                print(f"REFUSED {r}")
            print("# the lean carry:", "REFUSED" if refused else "every drop is off the path")
            return 1 if refused else 0
        if a.cmd == "strip":
            check(a.wheel)
            left = strip_wheel(a.wheel, a.out)
            print(f"{a.out}: {len(LEAN_STRIP)} members left behind, {left / (1 << 20):.1f} MiB "
                  f"uncompressed; {Path(a.out).stat().st_size / (1 << 20):.1f} MiB")
            return 0
        print(json.dumps(host_report(), indent=1))
        return 0
    except LeanError as e:
        print(f"gpu_vllm_lean {a.cmd}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
