"""The shell blocks of docs/deploy.md's roll-out section, as a user copies them."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SECTION = "## Rolling out a new steer version across replicas"
#: The blocks in the order the section gives them.
NAMES = ("copy", "swap_configmap", "swap_host", "rollback_configmap", "rollback_host")


def rollout_blocks() -> dict[str, str]:
    """{name: block} of the ``sh`` blocks of the section: the steer file written then renamed;
    the presets file swapped, with the shipped Deployment (the ConfigMap edited and applied)
    and on a host (a sibling file renamed over it); the roll-back, both ways."""
    text = (ROOT / "docs" / "deploy.md").read_text()
    section = text.split(SECTION, 1)[1].split("\n## ", 1)[0]
    blocks = [textwrap.dedent(b) for b in re.findall(r"```sh\n(.*?)\n\s*```", section, re.S)]
    assert len(blocks) == len(NAMES), blocks
    out = dict(zip(NAMES, blocks, strict=False))
    assert "mv " in out["copy"] and "/steers/detox-v2.safetensors" in out["copy"]
    for name, old, new in (("swap", "v1", "v2"), ("rollback", "v2", "v1")):
        # the ConfigMap: the alias set whatever it holds (the shipped file's {detox: 4} too),
        # and checked before it is applied
        sed = f"""'s/^\\( *detox-stable:\\).*/\\1 "detox-{new}:4"/'"""
        check = f"""grep -q 'detox-stable: "detox-{new}:4"'"""
        assert sed in out[f"{name}_configmap"] and check in out[f"{name}_configmap"] \
            and "kubectl apply -f " in out[f"{name}_configmap"], out[f"{name}_configmap"]
        sed = f"'s/\"detox-{old}:4\"/\"detox-{new}:4\"/'"
        assert sed in out[f"{name}_host"] and "mv " in out[f"{name}_host"], out[f"{name}_host"]
    return out
