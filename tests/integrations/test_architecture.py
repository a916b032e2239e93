"""docs/architecture.md matches the tree: its patch-point table is HOOKS, and every module it
names exists."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "architecture.md"


def test_the_hooks_table_is_generated_from_hooks():
    from vllm_steer.integrations.plugin import HOOKS, hooks_table

    text = DOC.read_text()
    got = text.split("<!-- HOOKS:begin -->\n", 1)[1].split("\n<!-- HOOKS:end -->", 1)[0]
    assert got == hooks_table(), ("docs/architecture.md's table differs from HOOKS; "
                                  "regenerate it with hooks_table()")
    assert len(got.splitlines()) == len(HOOKS) + 2


def test_every_module_the_doc_names_exists():
    text = DOC.read_text()
    dirs = {"frontend": "vllm_steer/integrations/frontend",
            "engine core": "vllm_steer/integrations/engine",
            "worker": "vllm_steer/integrations/worker",
            "between them": "vllm_steer/integrations"}
    bullets = text.split("One line per process")[1].split("\n\n")[1]  # the list, to its end
    for line in bullets.split("\n- "):
        head = re.match(r"\*\*([a-z ]+)\*\*", line.strip())
        if not head:
            continue
        folder = ROOT / dirs[head.group(1)]
        names = re.findall(r"`([a-z_0-9]+\.py)`", line)
        assert names, line
        for name in names:
            assert (folder / name).is_file(), f"{folder / name} named in docs/architecture.md"
    on_disk = {p.name for d in ("frontend", "engine", "worker")
               for p in (ROOT / "vllm_steer/integrations" / d).glob("*.py")
               if p.name != "__init__.py"}
    assert on_disk <= set(re.findall(r"`([a-z_0-9]+\.py)`", text)), \
        "a module of a process package is missing from docs/architecture.md"
