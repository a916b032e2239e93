"""The deployment example as a user takes it: the wheel that ``python -m build`` makes, the
container recipe's install line run into a folder, an interpreter that sees only that folder
(and the vLLM of this environment), and the Kubernetes manifests read as YAML.

No network, no container runtime, no cluster: what these stand for is run here as far as a CPU
host can (docs/deploy.md says what is proven where).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
DOCKERFILE = DEPLOY / "Dockerfile"
KUBERNETES = DEPLOY / "kubernetes"
MANIFESTS = sorted(KUBERNETES.rglob("*.yaml"))
# Where the Deployment's claims are mounted (swapped for folders of a test).
MOUNTS = ("/models", "/steers")
# Where its ConfigMaps are mounted (swapped too; their files written there by a test).
CONFIG_MOUNTS = ("/etc/vllm-steer/presets",)
# What the build reads: the package and the files setup.py and pyproject.toml name.
BUILD_INPUTS = ("setup.py", "pyproject.toml", "README.md", "vllm_steer")
# Entries of this environment's site-packages that are this package's own installation
# (the editable one of a checkout): hidden from the isolated interpreter.
OWN_INSTALL = re.compile(r"^(vllm_steer|__editable__[._]+vllm_steer)", re.I)


def build(out: Path) -> tuple[Path, Path]:
    """``python -m build`` (sdist, then the wheel from the sdist) on a copy of the build
    inputs, so the checkout gets no build folders; returns (wheel, sdist)."""
    src = out / "src"
    src.mkdir(parents=True)
    for name in BUILD_INPUTS:
        p = ROOT / name
        if p.is_dir():
            shutil.copytree(p, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy(p, src / name)
    dist = out / "dist"
    # --no-isolation: the build backend (setuptools) of this environment, nothing downloaded
    r = subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(dist),
                        str(src)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"python -m build failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    wheels, sdists = list(dist.glob("*.whl")), list(dist.glob("*.tar.gz"))
    assert len(wheels) == 1 and len(sdists) == 1, sorted(p.name for p in dist.iterdir())
    return wheels[0], sdists[0]


def wheel_names(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as z:
        return z.namelist()


def wheel_text(wheel: Path, suffix: str) -> str:
    """The one file of the wheel whose name ends with ``suffix`` (e.g. ``entry_points.txt``)."""
    with zipfile.ZipFile(wheel) as z:
        names = [n for n in z.namelist() if n.endswith(suffix)]
        assert len(names) == 1, (suffix, names)
        return z.read(names[0]).decode()


# --------------------------------------------------------------------------- Dockerfile

def dockerfile_instructions(path: Path = DOCKERFILE) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of a Dockerfile, continuation lines joined, comments dropped."""
    out, cur = [], ""
    for ln in path.read_text().split("\n"):
        if not cur and (not ln.strip() or ln.lstrip().startswith("#")):
            continue
        if ln.rstrip().endswith("\\"):
            cur += ln.rstrip()[:-1]
            continue
        cur += ln
        word, _, rest = cur.strip().partition(" ")
        out.append((word.upper(), rest.strip()))
        cur = ""
    return out


def dockerfile_args(path: Path = DOCKERFILE) -> dict[str, str]:
    """Default values of the ``ARG``s."""
    return dict(a.split("=", 1) for k, a in dockerfile_instructions(path)
                if k == "ARG" and "=" in a)


def the(instructions, kind: str, pred=lambda a: True) -> str:
    hits = [a for k, a in instructions if k == kind and pred(a)]
    assert len(hits) == 1, f"expected one {kind} instruction, found {hits}"
    return hits[0]


# --------------------------------------------------------------------------- isolated Python

def isolated_site(out: Path) -> Path:
    """This environment's site-packages (vLLM, torch, ...) without this package's own
    installation: a folder of links to every other entry."""
    site = Path(sysconfig.get_paths()["purelib"])
    view = out / "site-without-vllm-steer"
    view.mkdir(parents=True)
    for entry in site.iterdir():
        if not OWN_INSTALL.match(entry.name) and not entry.name.endswith(".pth"):
            (view / entry.name).symlink_to(entry)
    return view


def isolated_env(target: Path, view: Path, **extra: str) -> dict[str, str]:
    """Environment of an interpreter run with ``-S`` (no site-packages, no .pth files): the
    install folder first, then the rest of this environment."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PYTHON", "VLLM_"))}
    env["PYTHONPATH"] = os.pathsep.join([str(target), str(view)])
    env.update(extra)
    return env


def run_isolated(code: str, target: Path, view: Path, cwd: Path, timeout: float = 300,
                 **extra_env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-S", "-c", code], cwd=cwd, capture_output=True,
                          text=True, timeout=timeout, env=isolated_env(target, view,
                                                                       **extra_env))


def last_json(stdout: str) -> dict:
    """The JSON object a probe script printed on its last line (vLLM logs may come first)."""
    return json.loads(stdout.strip().split("\n")[-1])


def shell_words(command: str) -> list[str]:
    return shlex.split(command)


# --------------------------------------------------------------------------- manifests

def manifests() -> dict[tuple[str, str], dict]:
    """{(kind, name): object} of every manifest under deploy/kubernetes."""
    out = {}
    for path in MANIFESTS:
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                out[(doc["kind"], doc["metadata"]["name"])] = doc
    return out


def swap_mounts(arg: str, tmp: Path) -> str:
    for m in MOUNTS + CONFIG_MOUNTS:
        arg = re.sub(rf"(^|=){re.escape(m)}(?=/|$)", rf"\g<1>{tmp}{m}", arg)
    return arg


def write_config_mounts(container: dict, volumes: list[dict], tmp: Path) -> None:
    """The files of each ConfigMap the container mounts, written where the kubelet puts them
    (the mount point swapped into ``tmp``)."""
    objects = manifests()
    by_name = {v["name"]: v for v in volumes}
    for mount in container["volumeMounts"]:
        cm = by_name[mount["name"]].get("configMap")
        if cm is None:
            continue
        folder = Path(swap_mounts(mount["mountPath"], tmp))
        folder.mkdir(parents=True, exist_ok=True)
        for name, text in objects[("ConfigMap", cm["name"])]["data"].items():
            (folder / name).write_text(text)


def secret_values(container: dict) -> dict[str, str]:
    """The container's environment, each Secret's value made up from the Secret's name (so
    that two Secrets never share a value)."""
    return {e["name"]: e.get("value") or f"made-up-{e['valueFrom']['secretKeyRef']['name']}"
            for e in container["env"]}
