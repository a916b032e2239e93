"""The plugin's hooks against every committed vLLM surface manifest
(vllm_steer/integrations/surfaces/, written by scripts/vllm_surface.py), with no download: each
supported vLLM has every hook target, every name a wrapper reads, every parameter it binds by
name, and still calls the names patched where they are imported. Plus the start-up check's
reading of the installed vLLM (LiveSurface) agrees with the manifest script's (source)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_steer.integrations.hooks import surface_problems
from vllm_steer.integrations.plugin import HOOKS
from vllm_steer.integrations.supported import SUPPORTED_VLLM
from vllm_steer.integrations.surface import ManifestSurface, load_manifests

ROOT = Path(__file__).resolve().parents[2]
MANIFESTS = load_manifests()
REFRESH = ("regenerate it: pip download vllm==VERSION --no-deps -d DIR; "
           "python scripts/vllm_surface.py --wheel DIR/vllm-VERSION-*.whl")


def _version(m) -> str:
    return m["vllm"]


def test_every_supported_minor_version_has_a_manifest_and_every_manifest_is_supported():
    from packaging.specifiers import SpecifierSet
    from packaging.version import Version

    spec = SpecifierSet(SUPPORTED_VLLM)
    have = {Version(m["vllm"]).release[:2] for m in MANIFESTS}
    assert all(Version(m["vllm"]) in spec for m in MANIFESTS), (
        [m["vllm"] for m in MANIFESTS], SUPPORTED_VLLM)
    low = min(have)
    wanted = {(low[0], minor) for minor in range(low[1], low[1] + 50)
              if Version(f"{low[0]}.{minor}.0") in spec}
    assert wanted <= have, f"no manifest for vLLM {sorted(wanted - have)}: {REFRESH}"
    assert {(0, 32), (0, 33)} <= have


@pytest.mark.parametrize("manifest", MANIFESTS, ids=_version)
def test_hooks_match_the_manifest(manifest):
    surface = ManifestSurface(manifest)
    problems = [p for h in HOOKS for p in surface_problems(h, surface)]
    assert problems == [], f"vLLM {manifest['vllm']}: " + "; ".join(problems)


@pytest.mark.parametrize("manifest", MANIFESTS, ids=_version)
def test_a_hook_whose_reads_vllm_lacks_is_reported_by_the_manifest_check(manifest):
    """The check can fail: a manifest without one read, one parameter and one call."""
    m = json.loads(json.dumps(manifest))
    hook = next(h for h in HOOKS if h.params and h.reads and h.called_by)
    m["names"][hook.reads[0]] = None
    entry = m["names"][hook.target]
    entry["params"] = ", ".join(p for p in entry["params"].split(", ") if p != hook.params[0])
    m["calls"][next(iter(k for k in m["calls"] if k.endswith(hook.target)))] = None
    got = surface_problems(hook, ManifestSurface(m))
    assert len(got) == 3, got
    assert f"reads {hook.reads[0]}, which this vLLM does not have" in got[1]
    assert f"no parameter {hook.params[0]}" in got[0]
    assert "no longer calls it through the name the plugin patches" in got[2]


def test_the_installed_vllm_has_a_manifest_equal_to_a_fresh_extraction(tmp_path):
    """The committed manifest of the installed vLLM is what the script extracts now."""
    from vllm import __version__

    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "vllm_surface.py"),
                          "--out", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    fresh = json.loads((tmp_path / f"vllm-{__version__}.json").read_text())
    committed = [m for m in MANIFESTS if m["vllm"] == __version__]
    assert committed, f"no committed manifest for the installed vLLM {__version__}: {REFRESH}"
    assert fresh["names"] == committed[0]["names"] and fresh["calls"] == committed[0]["calls"]


def test_the_start_up_check_reads_the_installed_vllm_as_the_manifest_script_does():
    """LiveSurface (start-up: the imported vLLM) and Surface (the script: vLLM's source)
    find the same names, with the same parameters, and miss the same invented ones."""
    from vllm_steer.integrations.plugin import register
    from vllm_steer.integrations.surface import LiveSurface, Sources, Surface

    register()
    live, source = LiveSurface(), Surface(Sources())
    names = sorted({n for h in HOOKS for n in (h.target, *h.reads)})
    names += ["vllm.v1.worker.gpu_model_runner:GPUModelRunner.no_such_attribute",
              "vllm.v1.worker.gpu.input_batch:InputBatch.no_such_field",
              "vllm.plugins:no_such_function"]
    for name in names:
        a, b = live.lookup(name), source.lookup(name)
        assert (a is None) == (b is None), (name, a, b)
        assert (a or {}).get("params") == (b or {}).get("params"), (name, a, b)
    assert live.lookup(names[-1]) is None and live.lookup(names[-2]) is None
    for h in HOOKS:
        for caller in h.called_by:
            assert live.calls_by_name(caller, h.target) == source.calls_by_name(
                caller, h.target) is not None
