"""Committed surface manifests, and the surface the start-up check reads.

A manifest (``vllm_steer/integrations/surfaces/vllm-<version>.json``, written by
``scripts/vllm_surface.py``) records, for one vLLM release, what each name the hooks need is
(:meth:`vllm_steer.integrations.surface.Surface.lookup`): every target of every hook, each
alternative target included, every declared read (the hooks' and the accesses' of
:mod:`vllm_steer.integrations.vllm_access`), and every call through a patched imported
name. Names of other packages (pydantic) are not in it: they are read from the installed
package's source.

:func:`installed_surface` is what the start-up check
(:func:`vllm_steer.integrations.hook_check.check_hooks`) asks: the committed manifest of the
installed vLLM when there is one that covers every name, else the ``ast`` reader on the
installed vLLM's source (a release without a manifest yet). No import of vLLM here, no torch.
"""

from __future__ import annotations

import functools
import json
import os
from typing import Any

from vllm_steer.integrations.surface import Sources, Surface

#: Format of the manifests ``scripts/vllm_surface.py`` writes.
SURFACE_FORMAT = 1
#: Where the committed manifests are.
SURFACES_DIR = os.path.join(os.path.dirname(__file__), "surfaces")
#: The package the manifests describe; names of any other are read from its installed source.
PACKAGE = "vllm"


def params_text(names: list[str]) -> str:
    """Parameter names as a manifest stores them (one line: the file stays readable)."""
    return ", ".join(names)


def params_list(text: str) -> list[str]:
    """The inverse of :func:`params_text`."""
    return [p for p in text.split(", ") if p]


def call_key(caller: str, target: str) -> str:
    """A manifest's key of "does ``caller`` call ``target`` through its patched name"."""
    return f"{caller} -> {target}"


def _package(name: str) -> str:
    return name.partition(":")[0].partition(".")[0]


def in_package(name: str) -> bool:
    """Whether ``module:Qualified.name`` is vLLM's (a manifest's) rather than another
    package's."""
    return _package(name) == PACKAGE


def needed(hooks) -> tuple[list[str], list[tuple[str, str]]]:
    """The vLLM names and the (caller, target) pairs ``hooks`` depend on, in every release
    they name (each alternative target too); ``hooks`` may hold accesses too
    (:class:`~vllm_steer.integrations.vllm_access.Access`: the names they read and set, in
    every release)."""
    names = {n for h in hooks for n in (*(t.target for t in h.targets),
                                        *getattr(h, "all_names", h.reads))}
    calls = {(c, t.target) for h in hooks for t in h.targets for c in h.called_by}
    return sorted(n for n in names if in_package(n)), sorted(calls)


def write(surface: Surface, source: str, hooks) -> dict:
    """The manifest of ``surface`` (a vLLM's sources) for ``hooks``."""
    version = surface.version
    if version is None:
        raise ValueError(f"no vllm/_version.py in {source}")
    names, calls = needed(hooks)
    entries = {}
    for n in names:
        e = surface.lookup(n)
        entries[n] = e if e is None or "params" not in e else dict(
            e, params=params_text(e["params"]))
    return {"format": SURFACE_FORMAT, "vllm": version, "source": source, "names": entries,
            "calls": {call_key(c, t): surface.calls_by_name(c, t) for c, t in calls}}


class ManifestSurface:
    """A committed manifest answering as :class:`~vllm_steer.integrations.surface.Surface`;
    a name of another package is read from that package's installed source."""

    def __init__(self, manifest: dict) -> None:
        if manifest.get("format") != SURFACE_FORMAT:
            raise ValueError(f"surface manifest format {manifest.get('format')!r}, expected "
                             f"{SURFACE_FORMAT}: regenerate it with scripts/vllm_surface.py")
        self.version: str = manifest["vllm"]
        self.names: dict[str, Any] = manifest["names"]
        self.calls: dict[str, Any] = manifest["calls"]

    def covers(self, hooks) -> bool:
        """Whether every name and call ``hooks`` need is recorded here."""
        names, calls = needed(hooks)
        return set(names) <= set(self.names) and \
            {call_key(c, t) for c, t in calls} <= set(self.calls)

    def lookup(self, name: str):
        if not in_package(name):
            return outside_surface(_package(name)).lookup(name)
        if name not in self.names:
            raise KeyError(f"the manifest of vLLM {self.version} has no entry for {name}: "
                           "regenerate it with scripts/vllm_surface.py")
        entry = self.names[name]
        if entry is not None and isinstance(entry.get("params"), str):
            entry = dict(entry, params=params_list(entry["params"]))
        return entry

    def calls_by_name(self, caller: str, target: str):
        key = call_key(caller, target)
        if key not in self.calls:
            raise KeyError(f"the manifest of vLLM {self.version} has no entry for {key}: "
                           "regenerate it with scripts/vllm_surface.py")
        return self.calls[key]


class InstalledSurface(Surface):
    """The ``ast`` reader on the installed vLLM; names of other packages read from theirs."""

    def __init__(self) -> None:
        super().__init__(Sources(package=PACKAGE))

    def lookup(self, name: str):
        if not in_package(name):
            return outside_surface(_package(name)).lookup(name)
        return super().lookup(name)


@functools.cache
def outside_surface(package: str) -> Surface:
    """The ``ast`` reader on another installed package's source (pydantic)."""
    return Surface(Sources(package=package))


def load_manifests() -> list[dict]:
    """Every committed manifest, oldest vLLM first."""
    out = []
    for name in sorted(os.listdir(SURFACES_DIR)) if os.path.isdir(SURFACES_DIR) else ():
        if name.startswith("vllm-") and name.endswith(".json"):
            with open(os.path.join(SURFACES_DIR, name), encoding="utf-8") as f:
                out.append(json.load(f))
    return sorted(out, key=lambda m: release(m["vllm"]))


def release(version: str) -> tuple[int, ...]:
    """``"0.32.0+cpu"`` -> ``(0, 32, 0)``: what a manifest is matched on."""
    from packaging.version import Version

    return Version(version).release


def installed_version() -> str:
    """The installed vLLM's version (``vllm.__version__``; its source's ``_version.py``
    before vLLM is imported). The one place the plugin asks."""
    import sys

    mod = sys.modules.get("vllm")
    version = getattr(mod, "__version__", None) or Sources(package=PACKAGE).version()
    return str(version or "(unknown version)")


def installed_surface(hooks):
    """What the start-up check reads: the committed manifest of the installed vLLM release
    when one covers every name ``hooks`` need, else the ``ast`` reader on its source."""
    version = installed_version()
    try:
        mine = release(version)
    except Exception:  # an unparsable version: no manifest can match it
        mine = None
    for m in load_manifests():
        if mine is not None and release(m["vllm"]) == mine:
            surface = ManifestSurface(m)
            if surface.covers(hooks):
                return surface
    return InstalledSurface()
