"""The presets file (``vllm serve ... --steer-presets-file PATH``): presets served as model
names, kept in a file that every API server re-reads when it changes, so a fleet of servers
converges on the file's presets without an HTTP call to each.

The format, JSON (``.json``) or YAML (``.yaml`` / ``.yml``)::

    {"presets": {"polite": {"detox": 4, "sentiment": 2},
                 "detox-stable": "detox-v2:4"}}

``presets`` maps each preset (model) name to its steer mix: an object of steer -> strength, or
the ``--steer-preset`` string form ``"steer:strength,..."``. ``{"presets": {}}`` serves no
preset from the file. Each preset is checked like ``--steer-preset``: a valid model name that
is not the served model, a LoRA adapter or a ``--steer-preset`` preset; steers that are loaded
(or files of ``--steer-dir``); strengths within ``--steer-max-strength``.

This module reads and checks a file (pure, no torch); the API server's polling is
:func:`vllm_steer.server.presets_route.watch_presets_file`, the table it fills
:mod:`vllm_steer.integrations.engine.presets`.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from typing import Any, Iterable, Mapping

from vllm_steer.names import echo
from vllm_steer.policy import PolicyError, preset_from_body

#: File name endings read as JSON and as YAML; any other ending is refused.
JSON_SUFFIXES = (".json",)
YAML_SUFFIXES = (".yaml", ".yml")
#: The one top-level key of a presets file.
PRESETS_KEY = "presets"
#: Largest presets file read (bytes): a file of presets is a few kB.
MAX_FILE_BYTES = 1 << 20
FILE_EXAMPLE = '{"presets": {"polite": {"detox": 4, "sentiment": 2}}}'
#: Looks at a path that vanished while it was being resolved, before it counts as missing. A
#: Kubernetes ConfigMap volume links ``presets.yaml`` to ``..data/presets.yaml`` and updates
#: by renaming ``..data`` to a new folder, then removing the old folder at once: a look that
#: went through the old ``..data`` may find its file gone, and the next one finds the new file.
RESOLVE_TRIES = 5
#: The pause before each further look, times the looks made so far (seconds): a swap lasts
#: well under this, so a second look sees the new folder.
RESOLVE_PAUSE_S = 0.001


class PresetsFileError(ValueError):
    """A presets file that cannot be served; the message names the file, the problem and the
    fix. At start-up the server refuses to start; at run time the presets loaded before stay
    in force."""


def file_format(path: str) -> str:
    """``"json"`` or ``"yaml"`` from the file's name; :class:`PresetsFileError` otherwise."""
    low = str(path).lower()
    if low.endswith(JSON_SUFFIXES):
        return "json"
    if low.endswith(YAML_SUFFIXES):
        return "yaml"
    raise PresetsFileError(f"--steer-presets-file {echo(str(path), 200)}: unknown format; name "
                           "the file .json (JSON) or .yaml / .yml (YAML)")


def stat_key(path: str) -> tuple[int, int, int] | None:
    """What tells a changed file cheaply: ``(mtime_ns, size, inode)``; None if it is missing
    (an editor replacing the file, a Kubernetes ConfigMap swapping its link, change it)."""
    for k in range(RESOLVE_TRIES):
        try:
            st = os.stat(path)
        except FileNotFoundError:
            time.sleep(RESOLVE_PAUSE_S * (k + 1))
            continue
        except OSError:
            return None
        return (st.st_mtime_ns, st.st_size, st.st_ino)
    return None


def _open(path: str):
    """``open(path, "rb")``, looked up again if the path vanished while it was resolved
    (:data:`RESOLVE_TRIES`)."""
    for k in range(RESOLVE_TRIES):
        try:
            return open(path, "rb")
        except FileNotFoundError:
            if k == RESOLVE_TRIES - 1:
                raise
            time.sleep(RESOLVE_PAUSE_S * (k + 1))
    raise AssertionError("unreachable")


def read_file(path: str) -> tuple[str, tuple[int, str, int]]:
    """The file's text and its stamp ``(mtime_ns, sha256 of the bytes, read_ns)``: when the
    read began (the wall clock, just before the file is opened) orders versions. A read that
    began later saw the file as it was later, whatever the file's own times say: a backup
    restored with its old modification time (``cp -p``, ``rsync -a``) is the newest version,
    and a read of the old version that began before a swap (a ConfigMap's ``..data``) is older
    than any read of the new one, however late it is sent."""
    began = time.time_ns()
    try:
        with _open(path) as f:
            mtime = os.fstat(f.fileno()).st_mtime_ns
            data = f.read(MAX_FILE_BYTES + 1)
    except OSError as e:
        raise PresetsFileError(f"presets file {path}: cannot be read ({e.strerror or e}); "
                               "check the path given to --steer-presets-file") from None
    if len(data) > MAX_FILE_BYTES:
        raise PresetsFileError(f"presets file {path}: larger than {MAX_FILE_BYTES} bytes; a "
                               "presets file holds names and strengths only")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise PresetsFileError(f"presets file {path}: not UTF-8 text ({e})") from None
    return text, (mtime, hashlib.sha256(data).hexdigest(), began)


class DuplicateKeyError(ValueError):
    """A key given twice in one object of the file (JSON and YAML would keep the last)."""


def _unique(pairs: list[tuple[Any, Any]]) -> dict[Any, Any]:
    """An object of the file from its pairs, refusing a key given twice."""
    out: dict[Any, Any] = {}
    for k, v in pairs:
        if k in out:
            raise DuplicateKeyError(f"{echo(k, 80)} is given twice")
        out[k] = v
    return out


def _yaml(text: str) -> Any:
    """``yaml.safe_load`` refusing a key given twice in one mapping."""
    import yaml

    class Loader(yaml.SafeLoader):
        def construct_mapping(self, node, deep=False):
            self.flatten_mapping(node)
            return _unique([(self.construct_object(k, deep=deep),
                             self.construct_object(v, deep=deep)) for k, v in node.value])

    return yaml.load(text, Loader=Loader)  # noqa: S506 - a SafeLoader


def parse(text: str, path: str) -> dict[str, Any]:
    """The file's ``presets`` mapping as written (name -> mix), its shape checked."""
    fmt = file_format(path)
    try:
        doc = json.loads(text, object_pairs_hook=_unique) if fmt == "json" else _yaml(text)
    except DuplicateKeyError as e:
        raise PresetsFileError(f"presets file {path}: {e}; each name may be given once") \
            from None
    except Exception as e:  # noqa: BLE001 - json and yaml raise their own errors
        raise PresetsFileError(f"presets file {path}: not valid {fmt.upper()} ({e}); e.g. "
                               f"{FILE_EXAMPLE}") from None
    if not isinstance(doc, Mapping):
        raise PresetsFileError(f"presets file {path}: expected an object with \"presets\", got "
                               f"{echo(doc, 80)}; e.g. {FILE_EXAMPLE}")
    unknown = sorted(str(k) for k in doc if k != PRESETS_KEY)
    if unknown:
        raise PresetsFileError(f"presets file {path}: unknown key(s) "
                               f"{', '.join(map(repr, unknown))}; the file has one key, "
                               f"\"presets\", e.g. {FILE_EXAMPLE}")
    presets = doc.get(PRESETS_KEY)
    if presets is None:
        raise PresetsFileError(f"presets file {path}: \"presets\" is missing; e.g. "
                               f"{FILE_EXAMPLE} (an empty object serves no preset)")
    if not isinstance(presets, Mapping):
        raise PresetsFileError(f"presets file {path}: \"presets\" must map preset names to "
                               f"steer mixes, got {echo(presets, 80)}; e.g. {FILE_EXAMPLE}")
    return dict(presets)


def check(presets: Mapping[str, Any], path: str, steers: Iterable[str], max_strength: float,
          reserved: Mapping[str, str] | None = None) -> dict[str, dict[str, float]]:
    """Each preset checked like ``--steer-preset`` (``steers``: the names a preset may use;
    ``reserved``: model names taken, name -> what takes it); the mixes as numbers."""
    steers = set(steers)
    out: dict[str, dict[str, float]] = {}
    for name, mix in presets.items():
        try:
            name, mix = preset_from_body({"name": name, "steer": mix}, steers, max_strength,
                                         reserved)
        except PolicyError as e:
            raise PresetsFileError(f"presets file {path}: {e}") from None
        out[name] = mix
    return out


def load(path: str, steers: Iterable[str], max_strength: float,
         reserved: Mapping[str, str] | None = None
         ) -> tuple[dict[str, dict[str, float]], tuple[int, str]]:
    """Read, parse and check the file: ``(presets, stamp)``."""
    text, stamp = read_file(path)
    return check(parse(text, path), path, steers, max_strength, reserved), stamp
