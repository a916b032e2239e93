"""docs/architecture.md's "Where to make a change" names real places: every file it names
exists, and every ``file.py:Name`` (or ``file.py:Class.attribute``) is defined there (read
with ``ast``: a function, a class, a method, a module or class constant)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "architecture.md"


def _section() -> str:
    text = DOC.read_text()
    return text.split("## Where to make a change", 1)[1].split("\n## ", 1)[0]


def _defines(tree: ast.Module, qual: str) -> bool:
    body = tree.body
    for part in qual.split("."):
        hit = None
        for node in body:
            names = [node.name] if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                     ast.ClassDef)) else \
                [t.id for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
                 if isinstance(t, ast.Name)] if isinstance(node, (ast.Assign, ast.AnnAssign)) \
                else []
            if part in names:
                hit = node
        if hit is None:
            return False
        body = getattr(hit, "body", [])
    return True


def test_the_change_map_names_four_changes():
    heads = re.findall(r"^- \*\*(.+?)\*\*", _section(), flags=re.M)
    assert heads == ["A new per-request field", "A vLLM release that renames a wrapped method",
                     "A new kind of steer", "A new steer file format version"]


def test_every_file_and_name_the_change_map_gives_exists():
    refs = re.findall(r"`([\w/.]+\.(?:py|json))(?::([\w.]+))?`", _section())
    assert len(refs) >= 15, refs
    for path, qual in refs:
        file = ROOT / path
        assert file.is_file(), f"docs/architecture.md names {path}, which does not exist"
        if qual:
            assert _defines(ast.parse(file.read_text()), qual), (
                f"docs/architecture.md names {path}:{qual}, which {path} does not define")


def test_the_check_can_fail():
    tree = ast.parse((ROOT / "vllm_steer/format.py").read_text())
    assert _defines(tree, "FORMAT_VERSION") and not _defines(tree, "NO_SUCH_NAME")
    assert _defines(ast.parse((ROOT / "vllm_steer/request.py").read_text()),
                    "SteerRequest.to_wire")
