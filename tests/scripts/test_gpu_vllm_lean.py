"""scripts/gpu_vllm_lean.py and ``gpu_vllm_carry.py download --lean``: the import trace refuses
to leave behind a package that a module on the engine's path imports unconditionally (naming the
package, the module, the line and the import chain), allows the guarded, conditional and lazy
ones; ``strip`` rewrites the vLLM wheel without the listed extensions, RECORD included, and
the result installs and imports. Built on small wheels made here (the real vLLM wheel is
hundreds of MiB and not in the repository)."""

from __future__ import annotations

import base64
import hashlib
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
import gpu_vllm_lean as lean  # noqa: E402

ENGINE = """\
import json
import needed_pkg.sub
from vllm import helper
try:
    import guarded_pkg
except ImportError:
    guarded_pkg = None
if json:
    import cond_pkg
    from vllm import cond_only
from typing import TYPE_CHECKING
if TYPE_CHECKING:
    import typing_pkg


def f():
    import lazy_pkg
    from . import _ext_C
"""

MODULES = {
    "vllm/__init__.py": "",
    "vllm/engine.py": ENGINE,
    "vllm/helper.py": "import contextlib\nwith contextlib.suppress(ImportError):\n"
                      "    import vllm._moe_C\n",
    "vllm/cond_only.py": "import cond_needed\n",  # reached only under an `if`
    "vllm/unused.py": "import not_on_path\n",  # never imported by the path
}


def record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def make_wheel(path: Path, files: dict[str, bytes | str], requires=()) -> Path:
    files = {k: v.encode() if isinstance(v, str) else v for k, v in files.items()}
    info = "vllm-9.9.dist-info"
    files[f"{info}/METADATA"] = ("Metadata-Version: 2.1\nName: vllm\nVersion: 9.9\n" + "".join(
        f"Requires-Dist: {r}\n" for r in requires)).encode()
    files[f"{info}/WHEEL"] = b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n" \
                             b"Tag: py3-none-any\n"
    rows = [record_line(k, v) for k, v in files.items()] + [f"{info}/RECORD,,"]
    files[f"{info}/RECORD"] = ("\n".join(rows) + "\n").encode()
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        for k, v in files.items():
            z.writestr(k, v)
    return path


DROP = {name: ((name,), "test") for name in (
    "needed_pkg", "guarded_pkg", "cond_pkg", "lazy_pkg", "typing_pkg", "cond_needed",
    "not_on_path")}
STRIP = {"vllm/_ext_C.abi3.so": ("vllm._ext_C", "test"),
         "vllm/_moe_C.abi3.so": ("vllm._moe_C", "t")}


@pytest.fixture()
def wheel(tmp_path):
    files = dict(MODULES)
    files["vllm/_ext_C.abi3.so"] = b"\x7fELF" + bytes(5000)
    files["vllm/_moe_C.abi3.so"] = b"\x7fELF" + bytes(3000)
    return make_wheel(tmp_path / "vllm-9.9-py3-none-any.whl", files)


def test_the_trace_refuses_only_what_the_path_imports_unconditionally(wheel):
    with pytest.raises(lean.LeanError) as e:
        lean.check(wheel, roots=("vllm.engine",), drop=DROP, strip=STRIP)
    msg = str(e.value)
    assert "needed_pkg: imported unconditionally by vllm.engine (line 2; vllm.engine)" in msg
    for allowed in ("guarded_pkg", "cond_pkg", "lazy_pkg", "typing_pkg", "cond_needed",
                    "not_on_path", "_ext_C", "_moe_C"):
        assert allowed not in msg, allowed
    assert "carry it (remove it from LEAN_DROP" in msg

    rest = {k: v for k, v in DROP.items() if k != "needed_pkg"}
    t = lean.check(wheel, roots=("vllm.engine",), drop=rest, strip=STRIP)
    kinds = {name: sorted({s.kind for s in sites if s.module in t.reachable})
             for name, sites in t.sites.items()}
    assert kinds == {"guarded_pkg": ["guarded"], "cond_pkg": ["conditional"],
                     "lazy_pkg": ["lazy"], "typing_pkg": [],
                     "cond_needed": ["unconditional"],  # in a module reached under an `if`
                     "not_on_path": [], "vllm/_ext_C.abi3.so": ["lazy"],
                     "vllm/_moe_C.abi3.so": ["guarded"]}
    assert "vllm.cond_only" in t.reachable and "vllm.cond_only" not in t.required
    assert "vllm.helper" in t.required and "vllm.unused" not in t.reachable
    table = lean.report(t)
    assert table.splitlines()[2].split() == ["guarded_pkg", "0", "0", "1", "0"]


def test_a_wheel_without_the_paths_modules_is_refused_naming_them(wheel):
    with pytest.raises(lean.LeanError, match=r"\['vllm.v1.engine.core'\] are not in this wheel"):
        lean.trace(wheel, roots=("vllm.engine", "vllm.v1.engine.core"))


def test_strip_leaves_the_extensions_and_their_record_lines_and_the_wheel_installs(wheel,
                                                                                   tmp_path):
    out = tmp_path / "lean" / wheel.name
    out.parent.mkdir()
    left = lean.strip_wheel(wheel, out, STRIP)
    assert left == 5004 + 3004
    with zipfile.ZipFile(out) as z:
        names = set(z.namelist())
        record = z.read("vllm-9.9.dist-info/RECORD").decode()
    assert "vllm/_ext_C.abi3.so" not in names and "vllm/_moe_C.abi3.so" not in names
    assert "_ext_C" not in record and "_moe_C" not in record
    assert "vllm/engine.py,sha256=" in record
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                    "--target", str(target), str(out)], check=True, timeout=120)
    r = subprocess.run([sys.executable, "-c", "import vllm.helper, os; print(sorted(os.listdir("
                        "os.path.dirname(vllm.helper.__file__))))"], capture_output=True,
                       text=True, cwd=target, env={"PYTHONPATH": str(target)}, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "_ext_C.abi3.so" not in r.stdout and "'helper.py'" in r.stdout


def test_download_lean_skips_the_extras_strips_the_wheel_and_sets_stale_wheels_aside(tmp_path):
    """No network: every requirement is either left behind (LEAN_DROP) or on the machine."""
    dest = tmp_path / "whl"
    dest.mkdir()
    files = {m.replace(".", "/") + ".py": "" for m in lean.PATH_ROOTS if m != "vllm"}
    files["vllm/__init__.py"] = ""
    files["vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so"] = bytes(20000)
    files["vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so"] = bytes(10000)
    make_wheel(dest / "vllm-9.9-py3-none-any.whl", files,
               requires=["flashinfer-python==1.0", "six>=1.16"])
    (dest / "flashinfer_python-1.0-py3-none-any.whl").write_bytes(b"stale")
    pk = tmp_path / "packages.txt"
    pk.write_text("Packages: six, numpy.\n")
    cmd = [sys.executable, str(ROOT / "scripts" / "gpu_vllm_carry.py"), "download", "--vllm",
           "9.9", "--dest", str(dest), "--packages-file", str(pk), "--extra"]
    r = subprocess.run(cmd + ["--lean"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "skip flashinfer-python==1.0 (--skip)" in r.stdout
    assert "not needed: flashinfer_python-1.0-py3-none-any.whl" in r.stdout
    assert [p.name for p in dest.glob("*.whl")] == ["vllm-9.9-py3-none-any.whl"]
    with zipfile.ZipFile(dest / "vllm-9.9-py3-none-any.whl") as z:
        names = z.namelist()
    assert "vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so" in names
    assert "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so" not in names
    # the stripped wheel is not carried as a whole one
    r = subprocess.run(cmd + ["--skip", "flashinfer-python"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2
    assert "was stripped by `download --lean`; delete it" in r.stderr


def test_download_lean_refuses_to_leave_behind_what_a_carried_package_requires(tmp_path):
    """The import trace reads vLLM's modules only: a dropped package that another carried
    package requires (as XGrammar requires TVM FFI) is refused, naming both."""
    dest = tmp_path / "whl"
    dest.mkdir()
    files = {m.replace(".", "/") + ".py": "" for m in lean.PATH_ROOTS if m != "vllm"}
    files["vllm/__init__.py"] = ""
    make_wheel(dest / "vllm-9.9-py3-none-any.whl", files, requires=["grammar==1.0"])
    with zipfile.ZipFile(dest / "grammar-1.0-py3-none-any.whl", "w") as z:
        z.writestr("grammar-1.0.dist-info/METADATA", "Metadata-Version: 2.1\nName: grammar\n"
                   "Version: 1.0\nRequires-Dist: flashinfer-python>=0.1\n")
    pk = tmp_path / "packages.txt"
    pk.write_text("Packages: six.\n")
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_vllm_carry.py"), "download",
                        "--vllm", "9.9", "--dest", str(dest), "--packages-file", str(pk),
                        "--lean"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "--lean leaves behind what a carried package requires" in r.stderr
    assert "flashinfer-python (required by grammar)" in r.stderr


def test_host_report_names_each_extension_and_why_it_does_not_load():
    """``host`` runs after the install on the GPU host; here (vLLM's CPU build, no CUDA
    extensions) every extension is reported with its reason, and nothing raises."""
    pytest.importorskip("vllm")
    out = lean.host_report()
    assert set(out) == {"vllm._C_stable_libtorch", "vllm.vllm_flash_attn._vllm_fa3_C",
                        "vllm.vllm_flash_attn._vllm_fa2_C", "vllm._moe_C_stable_libtorch",
                        "flash_attn_version"}
    assert out["vllm.vllm_flash_attn._vllm_fa3_C"].startswith(("ModuleNotFoundError",
                                                               "ImportError"))


def test_requirements_follow_the_extras_a_dependency_is_asked_with(tmp_path):
    """``nvidia-cutlass-dsl[cu13]``: its cu13 libraries are carried (marked ``extra == "cu13"``),
    not only its unconditional ones."""
    import gpu_vllm_carry as carry

    w = tmp_path / "dsl-1.0-py3-none-any.whl"
    with zipfile.ZipFile(w, "w") as z:
        z.writestr("dsl-1.0.dist-info/METADATA",
                   "Metadata-Version: 2.1\nName: dsl\nVersion: 1.0\n"
                   "Requires-Dist: dsl-libs-base==1.0\nProvides-Extra: cu13\n"
                   'Requires-Dist: dsl-libs-cu13==1.0; extra == "cu13"\n'
                   'Requires-Dist: winonly; sys_platform == "win32"\n')
    assert carry.wheel_requirements(w) == ["dsl-libs-base==1.0"]
    assert carry.wheel_requirements(w, {"cu13"}) == ["dsl-libs-base==1.0",
                                                      'dsl-libs-cu13==1.0; extra == "cu13"']
