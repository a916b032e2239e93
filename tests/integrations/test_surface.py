"""The plugin's hooks against every committed vLLM surface manifest
(vllm_steer/integrations/surfaces/, written by scripts/vllm_surface.py), with no download: each
supported vLLM has every hook target, every name a wrapper reads, every parameter it binds by
name, and still calls the names patched where they are imported. The start-up check reads the
installed vLLM's manifest, or the same ``ast`` reader on its source; nothing reads byte code.
A release that renames a wrapped method (tests/v2shim/next_release.py) passes the check with
the new name declared as an alternative target, and is refused without it, in that group only."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from helpers.engines import V2_SHIM_DIR

from vllm_steer.integrations import hook_check, hooks, manifest
from vllm_steer.integrations.hook_check import MissingHookError, surface_problems
from vllm_steer.integrations.plugin import HOOKS
from vllm_steer.integrations.supported import SUPPORTED_VLLM
from vllm_steer.integrations.manifest import ManifestSurface, load_manifests

ROOT = Path(__file__).resolve().parents[2]
MANIFESTS = load_manifests()
REFRESH = ("regenerate it: pip download vllm==VERSION --no-deps -d DIR; "
           "python scripts/vllm_surface.py --wheel DIR/vllm-VERSION-*.whl")
V2_CONFIG = SimpleNamespace(use_v2_model_runner=True, speculative_config=None)
V1_CONFIG = SimpleNamespace(use_v2_model_runner=False, speculative_config=None)


def _version(m) -> str:
    return m["vllm"]


def _next_release():
    """tests/v2shim/next_release.py, loaded as a module (the engine processes import it)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("next_release", V2_SHIM_DIR / "next_release.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


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


@pytest.mark.parametrize("manifest_", MANIFESTS, ids=_version)
def test_hooks_match_the_manifest(manifest_):
    surface = ManifestSurface(manifest_)
    problems = [p for h in HOOKS for p in surface_problems(h, surface)]
    assert problems == [], f"vLLM {manifest_['vllm']}: " + "; ".join(problems)


@pytest.mark.parametrize("manifest_", MANIFESTS, ids=_version)
def test_a_hook_whose_reads_vllm_lacks_is_reported_by_the_manifest_check(manifest_):
    """The check can fail: a manifest without one read, one parameter and one call."""
    import dataclasses

    m = json.loads(json.dumps(manifest_))
    hook = next(h for h in HOOKS if h.params and h.called_by)
    if not hook.reads:  # a read of another hook's, declared on this one
        hook = dataclasses.replace(hook, reads=next(h.reads for h in HOOKS if h.reads))
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


def test_the_start_up_check_reads_the_installed_vllms_manifest_else_its_source(
        monkeypatch, tmp_path):
    """With a committed manifest of the installed vLLM, the start-up check reads it; without
    one (a release not described yet), the same ``ast`` reader on the installed source, which
    finds every hook's names and none of the invented ones."""
    from vllm import __version__

    got = manifest.installed_surface(HOOKS)
    assert isinstance(got, ManifestSurface) and got.version == __version__
    monkeypatch.setattr(manifest, "SURFACES_DIR", str(tmp_path))  # no manifest at all
    source = manifest.installed_surface(HOOKS)
    assert isinstance(source, manifest.InstalledSurface) and source.version == __version__
    assert [p for h in HOOKS for p in surface_problems(h, source)] == []
    for name in ("vllm.v1.worker.gpu_model_runner:GPUModelRunner.no_such_attribute",
                 "vllm.v1.worker.gpu.input_batch:InputBatch.no_such_field",
                 "vllm.plugins:no_such_function", "pydantic:no_such_name"):
        assert source.lookup(name) is None, name


def test_nothing_in_the_plugin_reads_byte_code():
    """The surface is read from source (``ast``) or a manifest: no module imports ``dis``
    (byte code changes with every Python release)."""
    for path in (ROOT / "vllm_steer").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            assert "dis" not in names, f"{path.relative_to(ROOT)} imports dis"


def _problem_groups(hooks_, surface, config) -> dict[str, list[str]]:
    out = {}
    for g in hook_check.groups_used(config):
        got = [p for h in hooks_ if h.group is g for p in surface_problems(h, surface)]
        if got:
            out[g.name] = got
    return out


def test_a_release_that_renamed_a_wrapped_method_passes_with_the_alternative_declared():
    """The stand-in next release (0.33's manifest, V2's ``GPUModelRunner.sample`` renamed, the
    V1 runner removed): with the new name declared as an alternative, a Model Runner V2
    configuration passes; one on the gone V1 runner is refused (its groups only)."""
    nr = _next_release()
    surface = ManifestSurface(nr.manifest())
    declared = nr.hooks(HOOKS)
    old, new = nr.RENAMED
    hook = next(h for h in declared if h.target == old)
    assert hook.target_for(nr.VERSION) == new
    assert all(hook.target_for(m["vllm"]) == old for m in MANIFESTS)
    assert _problem_groups(declared, surface, V2_CONFIG) == {}
    assert set(_problem_groups(declared, surface, V1_CONFIG)) == {"v1", "v1-lens"}
    for m in MANIFESTS:  # and the supported releases still pass, at the old name
        assert [p for h in declared for p in surface_problems(h, ManifestSurface(m))] == []


def test_without_the_alternative_the_check_refuses_exactly_that_group(monkeypatch):
    """The same release with the hooks as they are: the V2 configuration is refused by the
    start-up check, naming the group of the renamed method and that method, nothing else."""
    nr = _next_release()
    surface = ManifestSurface(nr.manifest())
    old = nr.RENAMED[0]
    groups = _problem_groups(nr.hooks(HOOKS, declare=False), surface, V2_CONFIG)
    assert list(groups) == ["v2"] and len(groups["v2"]) == 1
    assert groups["v2"][0].startswith(f"{old} (") and groups["v2"][0].endswith(": not found")
    for declare in (True, False):  # through check_hooks, as at start-up
        monkeypatch.setattr(hooks, "_INSTALLED", list(nr.hooks(HOOKS, declare)))
        monkeypatch.setattr(hook_check, "_INSTALLED", hooks._INSTALLED)
        monkeypatch.setattr(hook_check, "_MISSING_BY_GROUP", {})
        monkeypatch.setattr(hook_check, "_SURFACE", {})
        monkeypatch.setattr(manifest, "installed_version", lambda: nr.VERSION)
        monkeypatch.setattr(manifest, "installed_surface", lambda _h: surface)
        monkeypatch.setenv("VLLM_STEER_ALLOW_UNTESTED_VLLM", "1")  # past the range check
        if declare:
            hook_check.check_hooks(V2_CONFIG)
        else:
            with pytest.raises(MissingHookError) as e:
                hook_check.check_hooks(V2_CONFIG)
            assert f"cannot steer on vLLM {nr.VERSION}" in str(e.value)
            assert "(hook group 'v2'," in str(e.value) and old in str(e.value)


@pytest.mark.parametrize("manifest_", MANIFESTS, ids=_version)
def test_accesses_match_the_manifest(manifest_):
    """Every name an accessor of the layer touches is in each supported vLLM."""
    from vllm_steer.integrations.vllm_access import ACCESSES, access_problems

    surface = ManifestSurface(manifest_)
    assert set(manifest.needed(ACCESSES)[0]) <= set(manifest_["names"])
    problems = [p for a in ACCESSES for p in access_problems(a, surface)]
    assert problems == [], f"vLLM {manifest_['vllm']}: " + "; ".join(problems)


def test_a_release_without_an_accessed_name_is_refused_at_start_up(monkeypatch):
    """A release whose ``ModelConfig`` lost ``enforce_eager`` (read by the layer's
    ``enforce_eager``, in the worker group): the start-up check refuses the configuration,
    naming the accessor and the name; an access declared for other releases is refused too."""
    import dataclasses

    from vllm import __version__

    from vllm_steer.integrations import vllm_access

    m = json.loads(json.dumps(next(m for m in MANIFESTS if m["vllm"] == __version__)))
    name = "vllm.config.model:ModelConfig.enforce_eager"
    m["names"][name] = None
    surface = ManifestSurface(m)
    monkeypatch.setattr(hook_check, "_SURFACE", {})
    monkeypatch.setattr(hook_check, "_MISSING_BY_GROUP", {})
    monkeypatch.setattr(manifest, "installed_surface", lambda _h: surface)
    with pytest.raises(MissingHookError) as e:
        hook_check.check_hooks(V1_CONFIG)
    assert "(hook group 'worker'," in str(e.value)
    assert "vllm_access.enforce_eager (" in str(e.value) and \
        f"reads {name}, which this vLLM does not have" in str(e.value)
    monkeypatch.setattr(hook_check, "_SURFACE", {})
    m["names"][name] = {"kind": "class attribute", "where": "vllm.config.model:ModelConfig"}
    later = tuple(dataclasses.replace(a, versions=">=99") if a.function is
                  vllm_access.enforce_eager else a for a in vllm_access.ACCESSES)
    monkeypatch.setattr(vllm_access, "ACCESSES", later)
    with pytest.raises(MissingHookError, match=f"declared for vLLM >=99, not {__version__}"):
        hook_check.check_hooks(V1_CONFIG)


def test_an_access_names_what_each_release_calls_it():
    """vLLM 0.33 moved ``FrontendArgs`` (``--api-key``): the access declares both places, each
    for its releases, and each manifest is checked at its own (a manifest records both)."""
    from vllm_steer.integrations.vllm_access import ACCESSES, access_problems, api_keys

    access = next(a for a in ACCESSES if a.function is api_keys)
    old = "vllm.entrypoints.launchers.cli_args:FrontendArgs.api_key"
    new = "vllm.entrypoints.common.cli_args:FrontendArgs.api_key"
    assert access.names_for("0.32.0+cpu") == (old,) and access.names_for("0.33.0") == (new,)
    for m in MANIFESTS:
        assert access_problems(access, ManifestSurface(m)) == []
        swapped = json.loads(json.dumps(m))
        swapped["names"][old], swapped["names"][new] = m["names"][new], m["names"][old]
        assert access_problems(access, ManifestSurface(swapped)) != []
