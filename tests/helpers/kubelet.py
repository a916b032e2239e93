"""A ConfigMap volume updated as the kubelet updates one, for tests without a cluster.

The kubelet writes a ConfigMap (or Secret, downward-API, projected) volume with its
``AtomicWriter`` (``pkg/volume/util/atomic_writer.go``). The mounted folder holds:

    <mount>/presets.yaml -> ..data/presets.yaml      one link per top-level name
    <mount>/..data       -> ..2026_11_29_07_40_00.123456789
    <mount>/..2026_11_29_07_40_00.123456789/presets.yaml   the files themselves

and an update, :func:`atomic_write`, does what ``AtomicWriter.Write`` does, in its order:

1. compare the new payload with the files ``..data`` points at; nothing to do if equal;
2. make a new timestamped folder ``..YYYY_MM_DD_HH_MM_SS.<random>`` and write the payload
   into it;
3. make the link ``..data_tmp`` -> that folder, and rename it over ``..data`` (one atomic
   ``rename``: a reader sees the old files or the new ones, never a mix);
4. make the link ``NAME -> ..data/NAME`` for each new top-level name; remove the links of
   names no longer in the payload;
5. remove the old timestamped folder.

``python -m helpers.kubelet apply -f FILE`` stands in for ``kubectl apply -f FILE`` followed
by the kubelet's sync: each ConfigMap of FILE is written into the folders that
``KUBELET_MOUNTS`` (JSON: ConfigMap name -> folder) maps it to. The real kubelet does the same
after its sync period and ConfigMap cache (about a minute with the defaults); this one does it
at once.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import sys
import time
from pathlib import Path
from typing import Mapping

import yaml

DATA_DIR = "..data"
DATA_TMP = "..data_tmp"
#: The file mode a ConfigMap volume gives its files (``defaultMode``).
DEFAULT_MODE = 0o644
MOUNTS_ENV = "KUBELET_MOUNTS"


def _timestamped_name(now: float | None = None) -> str:
    t = time.gmtime(time.time() if now is None else now)
    # Go's os.MkdirTemp(dir, "..2006_01_02_15_04_05.") appends a random number
    return time.strftime("..%Y_%m_%d_%H_%M_%S.", t) + str(secrets.randbelow(10 ** 9))


def _current(target: Path) -> Path | None:
    """The timestamped folder ``..data`` points at, or None before the first write."""
    link = target / DATA_DIR
    if not link.is_symlink():
        return None
    return target / os.readlink(link)


def _files(folder: Path | None) -> dict[str, bytes]:
    if folder is None or not folder.is_dir():
        return {}
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file()}


def atomic_write(target: Path | str, payload: Mapping[str, str | bytes],
                 now: float | None = None) -> bool:
    """Project ``payload`` (file name -> content) into the volume folder ``target`` as the
    kubelet's ``AtomicWriter.Write`` does; False if the files were already these."""
    target = Path(target)
    target.mkdir(parents=True, exist_ok=True)
    data = {name: (v.encode() if isinstance(v, str) else bytes(v))
            for name, v in payload.items()}
    for name in data:
        if name.startswith("..") or os.path.isabs(name) or ".." in Path(name).parts:
            raise ValueError(f"invalid ConfigMap key {name!r}")
    old = _current(target)
    if old is not None and _files(old) == data:
        return False
    # 2. the new timestamped folder, written in full before anything points at it
    new = target / _timestamped_name(now)
    new.mkdir(mode=0o755)
    for name, content in data.items():
        path = new / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content)
        path.chmod(DEFAULT_MODE)
    # 3. ..data_tmp -> the new folder, renamed over ..data
    tmp = target / DATA_TMP
    if tmp.is_symlink() or tmp.exists():
        tmp.unlink()
    os.symlink(new.name, tmp)
    os.rename(tmp, target / DATA_DIR)
    # 4. the user-visible links, one per top-level name; the links of names gone removed
    top = {Path(name).parts[0] for name in data}
    for name in sorted(top):
        link = target / name
        if not link.is_symlink():
            os.symlink(f"{DATA_DIR}/{name}", link)
    for entry in target.iterdir():
        if not entry.name.startswith("..") and entry.name not in top and entry.is_symlink():
            entry.unlink()
    # 5. the old timestamped folder
    if old is not None and old.is_dir():
        shutil.rmtree(old)
    return True


def configmaps(path: Path | str) -> dict[str, dict[str, str]]:
    """{ConfigMap name: its data} of a manifest file."""
    out = {}
    for doc in yaml.safe_load_all(Path(path).read_text()):
        if doc and doc.get("kind") == "ConfigMap":
            out[doc["metadata"]["name"]] = dict(doc.get("data") or {})
    return out


def apply(path: Path | str, mounts: Mapping[str, str]) -> list[str]:
    """Each ConfigMap of the manifest ``path`` written into its mounted folders (``mounts``:
    ConfigMap name -> folder); the names of those that changed."""
    changed = []
    for name, data in configmaps(path).items():
        if name in mounts and atomic_write(mounts[name], data):
            changed.append(name)
    return changed


def main(argv: list[str]) -> int:
    """``apply -f FILE``: what ``kubectl apply`` and then the kubelet's sync do to the
    mounted ConfigMap volumes named in ``KUBELET_MOUNTS``."""
    if len(argv) != 3 or argv[:2] != ["apply", "-f"]:
        print(f"usage: kubectl apply -f FILE (got {' '.join(argv)!r})", file=sys.stderr)
        return 2
    mounts = json.loads(os.environ.get(MOUNTS_ENV, "{}"))
    changed = apply(argv[2], mounts)
    for name in configmaps(argv[2]):
        print(f"configmap/{name} {'configured' if name in changed else 'unchanged'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
