"""vLLM's surface as the plugin sees it: the names its hooks patch and read, found in vLLM's
source code (``ast``), never by importing vLLM.

One reader serves three callers: the start-up check of the hooks a configuration uses
(:func:`vllm_steer.integrations.hooks.check_hooks`, on the installed vLLM), the script that
writes a version's manifest (``scripts/vllm_surface.py``, from the installed vLLM or from a
wheel file, which need not import on this host), and the test that checks
:data:`vllm_steer.integrations.plugin.HOOKS` against every committed manifest.

A name is ``module:Qualified.name``. :meth:`Surface.lookup` says what it is:

- ``function`` / ``method`` (with its parameter names), ``class``, ``class attribute`` (an
  assignment or an annotated field in the class body: dataclass, msgspec and pydantic fields),
  ``module attribute``;
- ``instance attribute``: assigned to ``self.<name>`` in a method of the class or of one of
  its vLLM base classes (the method is named in ``where``);
- ``outside vLLM``: the class has a base class from another package (pydantic's
  ``BaseModel``, ...), which may define it: accepted, not verified.

Imports are followed (``from x import Name`` and re-exports), and base classes through the
imports of the module that defines the class. No torch, no vLLM import.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import zipfile
from typing import Any

#: Format of the manifests ``scripts/vllm_surface.py`` writes
#: (``vllm_steer/integrations/surfaces/vllm-<version>.json``).
SURFACE_FORMAT = 1
#: Where the committed manifests are.
SURFACES_DIR = os.path.join(os.path.dirname(__file__), "surfaces")


class Sources:
    """vLLM's Python sources by module name: from a directory (the installed package) or from
    a wheel file."""

    def __init__(self, root: str | None = None, wheel: str | None = None) -> None:
        if wheel is not None:
            self._zip = zipfile.ZipFile(wheel)
            self._names = set(self._zip.namelist())
            self.root = None
        else:
            if root is None:
                spec = importlib.util.find_spec("vllm")  # finds the package, imports nothing
                if spec is None or not spec.submodule_search_locations:
                    raise ImportError("vllm is not installed")
                root = os.path.dirname(list(spec.submodule_search_locations)[0])
            self.root, self._zip = root, None
        self._text: dict[str, str | None] = {}

    def text(self, module: str) -> str | None:
        """The source of ``module`` (a package's ``__init__.py``), or None."""
        if module not in self._text:
            base = module.replace(".", "/")
            found = None
            for rel in (base + ".py", base + "/__init__.py"):
                if self._zip is not None:
                    if rel in self._names:
                        found = self._zip.read(rel).decode("utf-8")
                        break
                else:
                    path = os.path.join(self.root, rel)
                    if os.path.isfile(path):
                        with open(path, encoding="utf-8") as f:
                            found = f.read()
                        break
            self._text[module] = found
        return self._text[module]

    def is_package(self, module: str) -> bool:
        rel = module.replace(".", "/") + "/__init__.py"
        if self._zip is not None:
            return rel in self._names
        return os.path.isfile(os.path.join(self.root, rel))

    def version(self) -> str | None:
        """The version this source tree says it is (``vllm/_version.py``)."""
        text = self.text("vllm._version")
        if text is None:
            return None
        for node in ast.parse(text).body:
            if isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                names = {t.id for t in targets if isinstance(t, ast.Name)}
                if names & {"__version__", "version"} and isinstance(node.value, ast.Constant):
                    return str(node.value.value)
        return None


def _params(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
    """Parameter names as they bind: ``/`` after positional-only ones, ``*name``, a bare
    ``*`` before keyword-only ones, ``**name``."""
    a = fn.args
    out = [p.arg for p in a.posonlyargs]
    if a.posonlyargs:
        out.append("/")
    out += [p.arg for p in a.args]
    if a.vararg is not None:
        out.append("*" + a.vararg.arg)
    elif a.kwonlyargs:
        out.append("*")
    out += [p.arg for p in a.kwonlyargs]
    if a.kwarg is not None:
        out.append("**" + a.kwarg.arg)
    return out


def bindable(params: list[str]) -> set[str]:
    """The parameter names a caller may pass by keyword (not positional-only, not ``*x``)."""
    names = [p for p in params if not p.startswith("*")]
    if "/" in names:
        names = names[names.index("/") + 1:]
    return set(names)


class Surface:
    """Look names up in vLLM's sources (parsed once each)."""

    def __init__(self, sources: Sources) -> None:
        self.sources = sources
        self._trees: dict[str, ast.Module | None] = {}

    def tree(self, module: str) -> ast.Module | None:
        if module not in self._trees:
            text = self.sources.text(module)
            self._trees[module] = None if text is None else ast.parse(text)
        return self._trees[module]

    # ---- module level --------------------------------------------------------------------
    def _absolute(self, module: str, node: ast.ImportFrom) -> str:
        if not node.level:
            return node.module or ""
        pkg = module if self.sources.is_package(module) else module.rpartition(".")[0]
        for _ in range(node.level - 1):
            pkg = pkg.rpartition(".")[0]
        return pkg + ("." + node.module if node.module else "")

    def _module_def(self, module: str, name: str, depth: int = 0):
        """``(module, node)`` defining ``name`` at module level (imports followed), the string
        ``"outside:<module>"`` for a name imported from another package, or None."""
        tree = self.tree(module)
        if tree is None or depth > 8:
            return None
        found = None
        for node in _toplevel(tree.body):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) \
                    and node.name == name:
                found = (module, node)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                    found = (module, node)
            elif isinstance(node, ast.ImportFrom):
                for alias in node.names:
                    if (alias.asname or alias.name) == name:
                        src = self._absolute(module, node)
                        if not src.startswith("vllm"):
                            found = "outside:" + src
                        else:
                            found = self._module_def(src, alias.name, depth + 1) or (
                                (src + "." + alias.name, None)
                                if self.tree(src + "." + alias.name) is not None else None)
        if found is None and self.tree(module + "." + name) is not None \
                and self.sources.is_package(module):
            found = (module + "." + name, None)  # a submodule
        return found

    # ---- classes -------------------------------------------------------------------------
    def _bases(self, module: str, cls: ast.ClassDef) -> list:
        """The class's bases: ``(module, ClassDef)`` for vLLM classes, ``"outside:<name>"``
        for others."""
        out = []
        for b in cls.bases:
            if isinstance(b, ast.Subscript):  # Generic[T], Base[T]
                b = b.value
            dotted = _dotted(b)
            if dotted is None or dotted in ("object", "Generic", "Protocol", "ABC"):
                continue
            head, _, rest = dotted.partition(".")
            found = self._module_def(module, head)
            for part in rest.split(".") if rest else ():
                if isinstance(found, tuple) and found[1] is None:  # a module: its attribute
                    found = self._module_def(found[0], part)
                else:
                    found = None
            if isinstance(found, tuple) and isinstance(found[1], ast.ClassDef):
                out.append(found)
            else:  # another package's class, a builtin, or one built at run time
                out.append("outside:" + (found[len("outside:"):] + "." + dotted
                                         if isinstance(found, str) else dotted))
        return out

    def _class_member(self, module: str, cls: ast.ClassDef, name: str, depth: int = 0):
        """The entry for ``name`` in the class body of ``cls`` or its bases (class level)."""
        if depth > 12:
            return None
        for node in _toplevel(cls.body):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
                decos = {_dotted(d.func if isinstance(d, ast.Call) else d) for d in
                         node.decorator_list}
                if decos & {"property", "functools.cached_property", "cached_property"}:
                    return {"kind": "property", "where": f"{module}:{cls.name}"}
                kind = "staticmethod" if "staticmethod" in decos else "method"
                entry = {"kind": kind, "where": f"{module}:{cls.name}",
                         "params": _params(node)}
                return entry
            if isinstance(node, ast.ClassDef) and node.name == name:
                return {"kind": "class", "where": f"{module}:{cls.name}"}
            if isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                    return {"kind": "class attribute", "where": f"{module}:{cls.name}"}
        for base in self._bases(module, cls):
            if isinstance(base, tuple):
                got = self._class_member(base[0], base[1], name, depth + 1)
                if got is not None:
                    return got
        return None

    def _instance_attr(self, module: str, cls: ast.ClassDef, name: str, depth: int = 0):
        """Where ``self.<name>`` is assigned in a method of ``cls`` or of its vLLM bases."""
        if depth > 12:
            return None
        for node in _toplevel(cls.body):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or not \
                    node.args.args:
                continue
            me = node.args.args[0].arg
            for sub in ast.walk(node):
                targets = []
                if isinstance(sub, ast.Assign):
                    targets = sub.targets
                elif isinstance(sub, (ast.AnnAssign, ast.AugAssign)):
                    targets = [sub.target]
                for t in targets:
                    for el in (t.elts if isinstance(t, ast.Tuple) else [t]):
                        if isinstance(el, ast.Attribute) and el.attr == name and \
                                isinstance(el.value, ast.Name) and el.value.id == me:
                            return {"kind": "instance attribute",
                                    "where": f"{module}:{cls.name}.{node.name}"}
        for base in self._bases(module, cls):
            if isinstance(base, tuple):
                got = self._instance_attr(base[0], base[1], name, depth + 1)
                if got is not None:
                    return got
        return None

    def _outside_bases(self, module: str, cls: ast.ClassDef, depth: int = 0) -> list[str]:
        out = []
        for base in self._bases(module, cls):
            if isinstance(base, str):
                out.append(base[len("outside:"):])
            elif depth < 12:
                out += self._outside_bases(base[0], base[1], depth + 1)
        return out

    # ---- the one entry point -------------------------------------------------------------
    def lookup(self, name: str) -> dict[str, Any] | None:
        """What ``module:Qualified.name`` is in these sources (see the module docstring), or
        None when it is not there."""
        module, _, qual = name.partition(":")
        parts = qual.split(".")
        found = self._module_def(module, parts[0])
        if found is None:
            return None
        if isinstance(found, str):
            return {"kind": "outside vLLM", "where": found[len("outside:"):]}
        mod, node = found
        if len(parts) == 1:
            return _entry(mod, node, parts[0])
        for i, part in enumerate(parts[1:], 1):
            last = i == len(parts) - 1
            if node is None:  # a module
                got = self._module_def(mod, part)
                if got is None or isinstance(got, str):
                    return None if got is None else {"kind": "outside vLLM",
                                                     "where": got[len("outside:"):]}
                mod, node = got
                if last:
                    return _entry(mod, node, part)
                continue
            if not isinstance(node, ast.ClassDef):
                return None
            entry = self._class_member(mod, node, part)
            if entry is None and last:
                entry = self._instance_attr(mod, node, part)
            if entry is None:
                outside = self._outside_bases(mod, node)
                if outside and last:
                    return {"kind": "outside vLLM", "where": ", ".join(outside)}
                return None
            if last:
                return entry
            if entry["kind"] != "class":
                return None
            inner = [n for n in node.body if isinstance(n, ast.ClassDef) and n.name == part]
            node = inner[0] if inner else None
            if node is None:
                return None
        return None

    def function_node(self, name: str):
        """``(module, FunctionDef)`` of a function or method ``module:Qualified.name``."""
        module, _, qual = name.partition(":")
        parts = qual.split(".")
        found = self._module_def(module, parts[0])
        if not isinstance(found, tuple):
            return None
        mod, node = found
        for part in parts[1:]:
            if not isinstance(node, ast.ClassDef):
                return None
            hit = [n for n in _toplevel(node.body) if getattr(n, "name", None) == part]
            if not hit:
                return None
            node = hit[0]
        return (mod, node) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) \
            else None

    def calls_by_name(self, caller: str, target: str) -> str | None:
        """Whether function ``caller`` reads the name ``target`` patches at call time:
        ``target`` is ``module:name``, and the caller either lives in that module and uses the
        global ``name``, or imports ``name`` from that module inside its body and uses it.
        Returns how (``"global"`` / ``"local import"``), or None."""
        tmod, _, tname = target.partition(":")
        got = self.function_node(caller)
        if got is None:
            return None
        cmod, fn = got
        used, local_from = False, None
        for sub in ast.walk(fn):
            if isinstance(sub, ast.Name) and sub.id == tname and isinstance(sub.ctx, ast.Load):
                used = True
            if isinstance(sub, ast.ImportFrom):
                for alias in sub.names:
                    if (alias.asname or alias.name) == tname:
                        local_from = (self._absolute(cmod, sub), alias.name)
        if not used:
            return None
        if local_from is not None:
            return "local import" if local_from == (tmod, tname) else None
        return "global" if cmod == tmod else None


class LiveSurface:
    """The same answers as :class:`Surface`, from the imported vLLM (the start-up check: its
    modules are imported by then, and this costs no parsing): class-level names with
    ``inspect.getattr_static`` and the class annotations (dataclass, msgspec and pydantic
    fields), instance attributes from the methods' byte code (a ``STORE_ATTR`` of the name in
    a method of the class or a base), signatures with ``inspect.signature``, and the calls
    through a patched name from the caller's byte code."""

    def _resolve(self, name: str):
        import importlib

        module, _, qual = name.partition(":")
        obj = importlib.import_module(module)
        for part in qual.split(".") if qual else ():
            obj = getattr(obj, part)
        return obj

    def lookup(self, name: str) -> dict[str, Any] | None:
        import inspect

        owner_name, _, last = name.rpartition(".") if "." in name.partition(":")[2] \
            else (name.partition(":")[0] + ":", "", name.partition(":")[2])
        try:
            owner = self._resolve(owner_name.rstrip(":"))
        except (ImportError, AttributeError):
            return None
        if not inspect.isclass(owner):
            if not hasattr(owner, last):
                return None
            obj = getattr(owner, last)
            entry = {"kind": "class" if inspect.isclass(obj) else "function" if callable(obj)
                     else "module" if inspect.ismodule(obj) else "module attribute"}
            if entry["kind"] == "function":
                entry["params"] = _live_params(obj)
            return entry
        try:
            raw = inspect.getattr_static(owner, last)
        except AttributeError:
            raw = None
        else:
            if isinstance(raw, property):
                return {"kind": "property"}
            fn = raw.__func__ if isinstance(raw, (staticmethod, classmethod)) else raw
            if inspect.isfunction(fn):
                return {"kind": "staticmethod" if isinstance(raw, staticmethod) else "method",
                        "params": _live_params(fn)}
            return {"kind": "class" if inspect.isclass(raw) else "class attribute"}
        mro = [k for k in owner.__mro__ if k is not object]
        if any(last in vars(k).get("__annotations__", {}) for k in mro) or \
                last in (getattr(owner, "__struct_fields__", None) or ()):
            return {"kind": "class attribute"}
        for k in mro:
            if not k.__module__.startswith("vllm"):
                continue
            for attr, value in vars(k).items():
                if _stores(value, last):
                    return {"kind": "instance attribute", "where": f"{k.__module__}:"
                            f"{k.__qualname__}.{attr}"}
        outside = [k for k in mro if not k.__module__.startswith("vllm")]
        if outside:
            return {"kind": "outside vLLM", "where": ", ".join(
                f"{k.__module__}.{k.__qualname__}" for k in outside)}
        return None

    def calls_by_name(self, caller: str, target: str) -> str | None:
        import dis
        import inspect

        tmod, _, tname = target.partition(":")
        try:
            fn = inspect.unwrap(self._resolve(caller))
        except (ImportError, AttributeError):
            return None
        code = getattr(fn, "__code__", None)
        if code is None or tname not in code.co_names:
            return None
        ops = list(dis.get_instructions(code))
        for i, op in enumerate(ops):
            if op.opname == "IMPORT_FROM" and op.argval == tname:
                mods = [o.argval for o in ops[:i] if o.opname == "IMPORT_NAME"]
                return "local import" if mods and mods[-1] == tmod else None
        if fn.__module__ == tmod and any(o.opname == "LOAD_GLOBAL" and o.argval == tname
                                         for o in ops):
            return "global"
        return None


def _live_params(fn) -> list[str]:
    import inspect

    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return []
    out, kinds = [], inspect.Parameter
    saw_kwonly_marker = False
    params = list(sig.parameters.values())
    for i, p in enumerate(params):
        if p.kind is kinds.VAR_POSITIONAL:
            out.append("*" + p.name)
            saw_kwonly_marker = True
            continue
        if p.kind is kinds.VAR_KEYWORD:
            out.append("**" + p.name)
            continue
        if p.kind is kinds.KEYWORD_ONLY and not saw_kwonly_marker:
            out.append("*")
            saw_kwonly_marker = True
        out.append(p.name)
        if p.kind is kinds.POSITIONAL_ONLY and (i + 1 == len(params) or params[i + 1].kind
                                                 is not kinds.POSITIONAL_ONLY):
            out.append("/")
    return out


def _stores(value, name: str) -> bool:
    """Whether a class member (function, property, static/class method) assigns
    ``<first argument>.<name>``: a ``STORE_ATTR name`` in its byte code."""
    import dis
    import inspect

    fns = [value.fget, value.fset] if isinstance(value, property) else \
        [value.__func__] if isinstance(value, (staticmethod, classmethod)) else [value]
    for fn in fns:
        fn = inspect.unwrap(fn) if inspect.isfunction(fn) else fn
        code = getattr(fn, "__code__", None)
        if code is None or name not in code.co_names:
            continue
        if any(op.opname == "STORE_ATTR" and op.argval == name
               for op in dis.get_instructions(code)):
            return True
    return False


class ManifestSurface:
    """A committed manifest (``scripts/vllm_surface.py``) answering as :class:`Surface`."""

    def __init__(self, manifest: dict) -> None:
        if manifest.get("format") != SURFACE_FORMAT:
            raise ValueError(f"surface manifest format {manifest.get('format')!r}, expected "
                             f"{SURFACE_FORMAT}: regenerate it with scripts/vllm_surface.py")
        self.version = manifest["vllm"]
        self.names = manifest["names"]
        self.calls = manifest["calls"]

    def lookup(self, name: str):
        if name not in self.names:
            raise KeyError(f"the manifest of vLLM {self.version} has no entry for {name}: "
                           "regenerate it with scripts/vllm_surface.py")
        entry = self.names[name]
        if entry is not None and isinstance(entry.get("params"), str):
            entry = dict(entry, params=[p for p in entry["params"].split(", ") if p])
        return entry

    def calls_by_name(self, caller: str, target: str):
        key = call_key(caller, target)
        if key not in self.calls:
            raise KeyError(f"the manifest of vLLM {self.version} has no entry for {key}: "
                           "regenerate it with scripts/vllm_surface.py")
        return self.calls[key]


def call_key(caller: str, target: str) -> str:
    """A manifest's key of "does ``caller`` call ``target`` through its patched name"."""
    return f"{caller} -> {target}"


def load_manifests() -> list[dict]:
    """Every committed manifest, oldest vLLM first."""
    import json

    out = []
    for name in sorted(os.listdir(SURFACES_DIR)) if os.path.isdir(SURFACES_DIR) else ():
        if name.startswith("vllm-") and name.endswith(".json"):
            with open(os.path.join(SURFACES_DIR, name), encoding="utf-8") as f:
                out.append(json.load(f))
    return sorted(out, key=lambda m: tuple(int(x) for x in m["vllm"].split(".")[:3]
                                           if x.isdigit()))


def _toplevel(body):
    """Statements of a body, including those under ``if``/``try`` (TYPE_CHECKING, fallbacks)."""
    for node in body:
        if isinstance(node, ast.If):
            yield from _toplevel(node.body)
            yield from _toplevel(node.orelse)
        elif isinstance(node, ast.Try):
            yield from _toplevel(node.body)
            for h in node.handlers:
                yield from _toplevel(h.body)
        else:
            yield node


def _dotted(node) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        head = _dotted(node.value)
        return None if head is None else head + "." + node.attr
    return None


def _entry(module: str, node, name: str) -> dict[str, Any]:
    if node is None:
        return {"kind": "module", "where": module}
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return {"kind": "function", "where": module, "params": _params(node)}
    if isinstance(node, ast.ClassDef):
        return {"kind": "class", "where": module}
    return {"kind": "module attribute", "where": module}
