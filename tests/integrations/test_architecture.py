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


def test_every_function_the_hooks_table_names_exists():
    """Each "our function" of the table is a real ``module.function`` of the package (a lazily
    imported worker wrapper is named by the function it calls)."""
    import importlib

    text = DOC.read_text()
    table = text.split("<!-- HOOKS:begin -->\n", 1)[1].split("\n<!-- HOOKS:end -->", 1)[0]
    named = []
    for row in table.splitlines()[2:]:
        fn = row.split("|")[3].split("<br>")[0].strip().strip("`")
        if fn == "(checked only)":
            continue
        named.append(fn)
        dotted = "vllm_steer.integrations." + fn.removeprefix("install: ")
        module, _, attr = dotted.rpartition(".")
        try:
            obj = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as e:
            raise AssertionError(f"docs/architecture.md names {fn}, which does not exist: "
                                 f"{e}") from e
        assert callable(obj), fn
    assert any(n.startswith("worker.") for n in named) and \
        any(n.startswith("install: ") for n in named), named
    gates = re.findall(r"<br>(?:after, )?while (.*?) \|", table)
    from vllm_steer.integrations.worker.gates import ProcessGates
    assert gates and {g for line in gates for g in re.findall(r"`(\w+)`", line)} <= set(
        ProcessGates.__slots__), gates  # every gate it names is one of the process gates


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
