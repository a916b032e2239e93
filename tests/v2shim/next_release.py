"""Test harness: a stand-in for a vLLM release after the supported ones ("0.34.0"), in which
Model Runner V2's ``GPUModelRunner.sample`` is renamed (:data:`RENAMED`) and the V1 runner is
gone.

- :func:`manifest`: its surface, a copy of vLLM 0.33's committed manifest with the method
  renamed and the V1 runner's modules removed;
- :func:`hooks`: the plugin's hooks with the rename declared (the old name for the supported
  releases, the new one as an :class:`~vllm_steer.integrations.hooks.Alternative` from 0.34):
  what a plugin serving both releases declares;
- :func:`install`: with ``STEER_TEST_NEXT_RELEASE=1`` (``sitecustomize``), every engine process
  plays that release on the installed vLLM: the method gets its new name (the old one stays
  as vLLM's own call site, which a real release would have renamed with it), the plugin sees
  version :data:`VERSION` with :func:`manifest` as its surface, and registers :func:`hooks`.
  The plugin's code is not changed: only what it is told the installed vLLM is.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

VERSION = "0.34.0"
_RUNNER = "vllm.v1.worker.gpu.model_runner:GPUModelRunner"
#: (old name, new name) of the renamed Model Runner V2 method.
RENAMED = (f"{_RUNNER}.sample", f"{_RUNNER}.sample_logits")
#: Modules of the V1 runner, absent from the stand-in.
V1_MODULES = ("vllm.v1.worker.gpu_model_runner:", "vllm.v1.worker.gpu_input_batch:")
_SURFACES = Path(__file__).resolve().parents[2] / "vllm_steer" / "integrations" / "surfaces"


def manifest() -> dict:
    """The stand-in's surface manifest, from vLLM 0.33's."""
    m = json.loads((_SURFACES / "vllm-0.33.0.json").read_text())
    m["vllm"], m["source"] = VERSION, "tests/v2shim/next_release.py (from vllm-0.33.0.json)"
    old, new = RENAMED
    m["names"][new], m["names"][old] = m["names"][old], None
    for name in m["names"]:
        if name.startswith(V1_MODULES):
            m["names"][name] = None
    for key in m["calls"]:
        if key.startswith(V1_MODULES):
            m["calls"][key] = None
    return m


def hooks(base=None, declare: bool = True) -> tuple:
    """The plugin's hooks (``base``, default its ``HOOKS``) with the rename declared
    (``declare=False``: as they are)."""
    from vllm_steer.integrations.hooks import Alternative

    if base is None:
        from vllm_steer.integrations.plugin import HOOKS as base
    if not declare:
        return tuple(base)
    old, new = RENAMED
    return tuple(dataclasses.replace(h, versions="<0.34",
                                     alternatives=(Alternative(new, ">=0.34"),))
                 if h.target == old else h for h in base)


def rename_in_vllm(module) -> None:
    """Give Model Runner V2's ``sample`` its new name in the imported ``module``."""
    cls = module.GPUModelRunner
    attr = RENAMED[1].rpartition(".")[2]
    if attr in vars(cls):
        return
    setattr(cls, attr, vars(cls)["sample"])

    def sample(self, *args, **kwargs):  # vLLM's call site, which calls the new name
        return getattr(self, attr)(*args, **kwargs)

    cls.sample = sample


def play(plugin) -> None:
    """The plugin, once imported, sees the stand-in release and declares the rename."""
    from vllm_steer.integrations import manifest as manifests

    surface = manifests.ManifestSurface(manifest())
    manifests.installed_version = lambda: VERSION
    manifests.installed_surface = lambda _hooks: surface
    plugin.HOOKS = hooks(plugin.HOOKS)


def install(on_import) -> None:
    """Play the stand-in in this process (``on_import(module_name, fn)`` from sitecustomize)."""
    on_import("vllm.v1.worker.gpu.model_runner", rename_in_vllm)
    on_import("vllm_steer.integrations.plugin", play)
