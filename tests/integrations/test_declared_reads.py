"""Every name the plugin reads of a vLLM object is declared in HOOKS (``Hook.reads``, a target
or a parameter), so the start-up check verifies it: a vLLM release that renamed it is refused
at start-up, not at the first request that reaches it. And the plugin sets attributes on vLLM
objects only inside its hook wrappers (the one way it patches vLLM), never with ``setattr``.

Read from the plugin's source (``ast``): in each function of ``vllm_steer/integrations`` (and
``vllm_steer/metrics.py``), vLLM objects are the names imported from ``vllm``, the parameters
of a hook wrapper (``wrapper(orig, self, ...)``) and the names in :data:`VLLM_NAMES` (the
plugin's names for the vLLM objects it is handed: ``vllm_config``, ``runner``, ...). Each
attribute read on one (``x.a``, ``getattr(x, "a")``) must be declared; so must each attribute
read on what that returns (``x.a.b``), unless it is an attribute of the plain Python, numpy or
torch types vLLM hands over (dict, list, ndarray, Tensor: :data:`PLAIN`, computed). Dunder
names are Python's. Each import from a private module of another package
(``pydantic._internal``) must be declared as a read too."""

from __future__ import annotations

import ast
import queue
from pathlib import Path

import numpy as np
import torch

from vllm_steer.integrations.plugin import HOOKS

ROOT = Path(__file__).resolve().parents[2]
SOURCES = sorted((ROOT / "vllm_steer" / "integrations").rglob("*.py")) + \
    [ROOT / "vllm_steer" / "metrics.py"]
#: Parameter and variable names the plugin gives the vLLM objects it is handed, outside the
#: wrappers' own parameters.
VLLM_NAMES = {"core", "runner", "vllm_config", "model_config", "req_states", "input_batch",
              "sharder", "scheduler_output", "speculative_config"}
#: Attributes of the plain types found behind a vLLM attribute (``x.a.values()``): not vLLM's.
PLAIN = {n for t in (dict, list, tuple, set, str, queue.Queue, np.ndarray, torch.Tensor)
         for n in dir(t)}


def declared() -> set[str]:
    """The last component of every name HOOKS declare (targets, alternatives, reads)."""
    names = {t.target for h in HOOKS for t in h.targets} | {r for h in HOOKS for r in h.reads}
    return {n.rpartition(":")[2].rpartition(".")[2] for n in names}


def _chain(node) -> tuple[str | None, list[str]]:
    attrs = []
    while isinstance(node, ast.Attribute):
        attrs.append(node.attr)
        node = node.value
    return (node.id if isinstance(node, ast.Name) else None), attrs[::-1]


def scan(path: Path):
    """``(where, name, depth, how)`` for each attribute of a vLLM object read or set in
    ``path`` (depth 1: on the object itself), and ``(where, module:Name)`` of each private
    import of another package."""
    tree = ast.parse(path.read_text())
    rel = path.relative_to(ROOT)
    imported, private = set(), []
    constants = {t.id: n.value.value for n in tree.body if isinstance(n, ast.Assign)
                 and isinstance(n.value, ast.Constant) for t in n.targets
                 if isinstance(t, ast.Name)}
    for n in ast.walk(tree):
        if isinstance(n, ast.ImportFrom) and n.module:
            if n.module.split(".")[0] == "vllm":
                imported |= {a.asname or a.name for a in n.names}
            elif n.module != "__future__" and any(p.startswith("_") for p in n.module.split(".")):
                private += [(f"{rel}:{n.lineno}", f"{n.module}:{a.name}") for a in n.names]
    found = []
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        args = [a.arg for a in fn.args.posonlyargs + fn.args.args + fn.args.kwonlyargs]
        wrapper = bool(args) and args[0] == "orig"
        roots = imported | VLLM_NAMES | (set(args[1:]) if wrapper else set())
        inner = {id(n.value) for n in ast.walk(fn) if isinstance(n, ast.Attribute)}
        for n in ast.walk(fn):
            where = f"{rel}:{getattr(n, 'lineno', fn.lineno)} ({fn.name})"
            if isinstance(n, ast.Attribute) and id(n) not in inner:
                root, attrs = _chain(n)
                if root in roots:
                    store = not isinstance(n.ctx, ast.Load)
                    for depth, a in enumerate(attrs, 1):
                        last = depth == len(attrs)
                        found.append((where, a, depth, "set" if store and last else "read",
                                      wrapper))
            elif isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and \
                    n.func.id in ("getattr", "hasattr", "setattr", "delattr") and \
                    len(n.args) >= 2 and isinstance(n.args[0], ast.Name) and \
                    n.args[0].id in roots:
                name = n.args[1].value if isinstance(n.args[1], ast.Constant) else \
                    constants.get(getattr(n.args[1], "id", None))
                if name is None:  # a name computed at run time: not seen here
                    continue
                found.append((where, name, 1, "read" if n.func.id in ("getattr", "hasattr")
                              else n.func.id, wrapper))
    return found, private


def test_every_attribute_the_plugin_reads_of_a_vllm_object_is_declared():
    names = declared()
    undeclared = []
    for path in SOURCES:
        for where, a, depth, _how, _ in scan(path)[0]:
            if a.startswith("__") or a in names or (depth > 1 and a in PLAIN):
                continue
            undeclared.append(f"{where}: {a}")
    assert undeclared == [], ("attributes of vLLM objects read without a declaration in "
                              "HOOKS (add each to the reads of the hook whose code reads it): "
                              + "; ".join(undeclared))


def test_every_private_import_of_another_package_is_declared():
    reads = {r for h in HOOKS for r in h.reads}
    missing = [f"{where}: {name}" for path in SOURCES for where, name in scan(path)[1]
               if name not in reads]
    assert missing == [], "private imports without a declaration in HOOKS: " + "; ".join(missing)


def test_attributes_are_set_on_vllm_objects_only_inside_hook_wrappers():
    """Patching goes through ``wrap_method`` (or an install function) alone: outside a hook
    wrapper's own fields nothing sets an attribute on a vLLM object, and nothing uses
    ``setattr``/``delattr`` on one."""
    bad = [f"{where}: {how} {a}" for path in SOURCES for where, a, _, how, wrapper in scan(path)[0]
           if how in ("setattr", "delattr") or (how == "set" and not wrapper)]
    assert bad == [], "attributes set on vLLM objects outside the hooks: " + "; ".join(bad)


def test_the_scan_finds_the_reads_it_is_meant_to():
    """The scan is not vacuous: it sees reads of known vLLM objects in known places."""
    got = {(w.split(":")[0], a) for p in SOURCES for w, a, *_ in scan(p)[0]}
    assert ("vllm_steer/integrations/worker/v2.py", "idx_mapping_np") in got
    assert ("vllm_steer/integrations/request_state_v2.py", "max_num_reqs") in got
    assert ("vllm_steer/integrations/engine/management.py", "scheduler") in got
    private = {n for p in SOURCES for _, n in scan(p)[1]}
    assert "pydantic._internal._decorators:Decorator" in private
