"""The supported vLLM range: a vLLM outside it is refused at start-up (faked versions), the
override serves with a loud warning, and the range the docs and the image state is the one
in the code."""

from __future__ import annotations

import logging
import re
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_steer.integrations import hook_check, manifest
from vllm_steer.integrations.hook_check import UnsupportedVllmError
from vllm_steer.integrations.supported import ALLOW_UNTESTED_ENV, SUPPORTED_VLLM

ROOT = Path(__file__).resolve().parents[2]
LOW, HIGH = re.fullmatch(r">=([\d.]+),<([\d.]+)", SUPPORTED_VLLM).groups()


def _fake(monkeypatch, version: str) -> None:
    monkeypatch.setattr(manifest, "installed_version", lambda: version)
    monkeypatch.setattr(hook_check, "_WARNED", [])


@pytest.mark.parametrize("version", [f"{HIGH}.0", f"{HIGH}.1", f"{HIGH}.0rc1", "0.31.2",
                                     "1.0.0", "(unknown version)"])
def test_a_vllm_outside_the_range_is_refused_naming_range_version_and_override(
        monkeypatch, version):
    _fake(monkeypatch, version)
    monkeypatch.delenv(ALLOW_UNTESTED_ENV, raising=False)
    with pytest.raises(UnsupportedVllmError) as e:
        hook_check.check_hooks()  # the start-up check, as when steers are configured
    msg = str(e.value)
    assert f"vllm{SUPPORTED_VLLM}" in msg and version in msg, msg
    assert f"{ALLOW_UNTESTED_ENV}=1" in msg, msg
    # any value but 1 is not the override
    monkeypatch.setenv(ALLOW_UNTESTED_ENV, "yes")
    with pytest.raises(UnsupportedVllmError):
        hook_check.check_version()


@pytest.mark.parametrize("version", [f"{LOW}.0", f"{LOW}.0+cpu", f"{LOW}.5",
                                     f"0.{int(HIGH.split('.')[1]) - 1}.1.dev5+g0abc"])
def test_a_vllm_inside_the_range_passes_without_a_warning(monkeypatch, caplog, version):
    _fake(monkeypatch, version)
    monkeypatch.delenv(ALLOW_UNTESTED_ENV, raising=False)
    with caplog.at_level(logging.WARNING):
        hook_check.check_version()
    assert "UNTESTED" not in caplog.text


def test_the_override_serves_an_untested_vllm_with_one_loud_warning(monkeypatch, caplog):
    _fake(monkeypatch, f"{HIGH}.0")
    monkeypatch.setenv(ALLOW_UNTESTED_ENV, "1")
    logger = logging.getLogger("vllm.vllm_steer")
    monkeypatch.setattr(logger, "propagate", True)
    with caplog.at_level(logging.WARNING):
        hook_check.check_version()
        hook_check.check_version()  # every check of the process: warned once
    warnings = [r for r in caplog.records if "UNTESTED" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].levelno == logging.WARNING, caplog.text
    text = warnings[0].getMessage()
    assert f"{HIGH}.0" in text and f"vllm{SUPPORTED_VLLM}" in text and ALLOW_UNTESTED_ENV in text


def test_the_installed_vllm_is_in_the_range():
    """This checkout's own vLLM passes (else every engine test would be refused)."""
    hook_check.check_version()


def test_readme_deploy_and_dockerfile_state_the_range_of_the_code():
    spec = f"vllm{SUPPORTED_VLLM}"
    readme = (ROOT / "README.md").read_text()
    deploy = (ROOT / "docs" / "deploy.md").read_text()
    docker = (ROOT / "deploy" / "Dockerfile").read_text()
    assert f"`{spec}`" in readme and f"`{spec}`" in deploy
    # every vllm range either states is the code's
    for text in (readme, deploy, docker):
        assert set(re.findall(r"vllm>=[\d.]+,<[\d.]+", text)) == {spec}
    # the image's default base is a supported release, and its build checks the installed one
    base = re.search(r"ARG VLLM_IMAGE=vllm/vllm-openai:v([\d.]+)", docker).group(1)
    from vllm_steer.integrations.supported import version_problem

    assert version_problem(base) is None
    assert "python3 -m vllm_steer.integrations.supported" in docker
    assert spec in docker


def test_the_image_build_check_exits_1_outside_the_range_and_0_inside(tmp_path):
    """``python -m vllm_steer.integrations.supported`` as the image build runs it, on this
    checkout's vLLM (0) and on a fake distribution outside the range (1, naming both)."""
    ok = subprocess.run([sys.executable, "-m", "vllm_steer.integrations.supported"],
                        capture_output=True, text=True, cwd=ROOT)
    assert ok.returncode == 0 and SUPPORTED_VLLM in ok.stdout, ok
    fake = tmp_path / "site"
    dist = fake / f"vllm-{HIGH}.0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {HIGH}.0\n")
    code = (f"import sys; sys.path.insert(0, {str(fake)!r}); sys.path.insert(1, {str(ROOT)!r}); "
            "from vllm_steer.integrations.supported import main; raise SystemExit(main())")
    bad = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert bad.returncode == 1, bad
    assert f"vllm{SUPPORTED_VLLM}" in bad.stderr and f"{HIGH}.0" in bad.stderr, bad.stderr
