"""vLLM's surface as the plugin sees it: the names its hooks patch and read, found in a
package's source code (``ast``), never by importing it.

One reader serves three callers: the script that writes a version's manifest
(``scripts/vllm_surface.py``, from the installed vLLM or from a wheel file, which need not
import on this host), the start-up check of the hooks a configuration uses when no committed
manifest describes the installed vLLM (:func:`vllm_steer.integrations.manifest.installed_surface`),
and the tests that check :data:`vllm_steer.integrations.plugin.HOOKS` and the plugin's own
attribute reads.

A name is ``module:Qualified.name``. :meth:`Surface.lookup` says what it is:

- ``function`` / ``method`` / ``staticmethod`` (with its parameter names, :func:`params`),
  ``property``, ``class``, ``class attribute`` (an assignment or an annotated field in the
  class body: dataclass, msgspec and pydantic fields), ``module``, ``module attribute``;
- ``instance attribute``: assigned to ``self.<name>`` in a method of the class or of one of
  its base classes of the same package (the method is named in ``where``);
- ``parameter attribute``: ``module:function.name``, assigned to ``<parameter>.<name>`` in
  the function (vLLM's API server filling the ``app.state`` it is handed);
- ``outside vLLM`` (:data:`OUTSIDE`, whichever package is read): imported from another
  package, or the class has a base class from another package (pydantic's ``BaseModel``,
  ...), which may define it: accepted, not verified.

Imports are followed (``from x import Name`` and re-exports), and base classes through the
imports of the module that defines the class. No torch, no import of the package read.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import zipfile
from typing import Any

_DEPTH = 12  # imports, bases and nesting followed at most this deep
#: The kind of a name another package defines (accepted, not verified).
OUTSIDE = "outside vLLM"


class Sources:
    """A package's Python sources by module name: from a directory (the installed package) or
    from a wheel file."""

    def __init__(self, root: str | None = None, wheel: str | None = None,
                 package: str = "vllm") -> None:
        self.package = package
        self._zip = zipfile.ZipFile(wheel) if wheel is not None else None
        self._names = set(self._zip.namelist()) if self._zip is not None else set()
        if self._zip is None and root is None:
            spec = importlib.util.find_spec(package)  # finds the package, imports nothing
            if spec is None or not spec.submodule_search_locations:
                raise ImportError(f"{package} is not installed")
            root = os.path.dirname(list(spec.submodule_search_locations)[0])
        self.root = root
        self._text: dict[str, str | None] = {}

    def _read(self, rel: str) -> str | None:
        if self._zip is not None:
            return self._zip.read(rel).decode("utf-8") if rel in self._names else None
        path = os.path.join(self.root, rel)
        if not os.path.isfile(path):
            return None
        with open(path, encoding="utf-8") as f:
            return f.read()

    def text(self, module: str) -> str | None:
        """The source of ``module`` (a package's ``__init__.py``), or None."""
        if module not in self._text:
            base = module.replace(".", "/")
            found = self._read(base + ".py")
            self._text[module] = found if found is not None else self._read(base + "/__init__.py")
        return self._text[module]

    def is_package(self, module: str) -> bool:
        rel = module.replace(".", "/") + "/__init__.py"
        return rel in self._names if self._zip is not None else \
            os.path.isfile(os.path.join(self.root, rel))

    def version(self) -> str | None:
        """The version this source tree says it is (``<package>/_version.py``)."""
        text = self.text(self.package + "._version")
        for node in ast.parse(text).body if text is not None else ():
            if isinstance(node, (ast.Assign, ast.AnnAssign)):
                names = {t.id for t in _targets(node) if isinstance(t, ast.Name)}
                if names & {"__version__", "version"} and isinstance(node.value, ast.Constant):
                    return str(node.value.value)
        return None


def params(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
    """A function's parameter names as they bind (the one formatter): ``/`` after
    positional-only ones, ``*name``, a bare ``*`` before keyword-only ones, ``**name``."""
    a = fn.args
    out = [p.arg for p in a.posonlyargs] + (["/"] if a.posonlyargs else [])
    out += [p.arg for p in a.args]
    if a.vararg is not None:
        out.append("*" + a.vararg.arg)
    elif a.kwonlyargs:
        out.append("*")
    out += [p.arg for p in a.kwonlyargs]
    return out + (["**" + a.kwarg.arg] if a.kwarg is not None else [])


def bindable(names: list[str]) -> set[str]:
    """The parameter names a caller may pass by keyword (not positional-only, not ``*x``)."""
    names = [p for p in names if not p.startswith("*")]
    return set(names[names.index("/") + 1:] if "/" in names else names)


class Surface:
    """Look names up in a package's sources (each module parsed once)."""

    def __init__(self, sources: Sources) -> None:
        self.sources = sources
        self._trees: dict[str, ast.Module | None] = {}

    @property
    def version(self) -> str | None:
        return self.sources.version()

    def tree(self, module: str) -> ast.Module | None:
        if module not in self._trees:
            text = self.sources.text(module)
            self._trees[module] = None if text is None else ast.parse(text)
        return self._trees[module]

    # ---- the one lookup ------------------------------------------------------------------
    def find(self, name: str) -> tuple[dict[str, Any], Any] | None:
        """``(entry, node)`` of ``module:Qualified.name`` (the ``ast`` node defining it, or
        None for what has none: a module, an instance attribute, a name outside the
        package), or None when these sources lack it. Every lookup goes through here."""
        module, _, qual = name.partition(":")
        parts = qual.split(".")
        found = self._module_def(module, parts[0])
        if not isinstance(found, tuple):
            return None if found is None else (_outside(found), None)
        mod, node = found
        entry = _entry(mod, node)
        for part in parts[1:]:
            if node is None:  # a module: one of its module-level names
                found = self._module_def(mod, part)
                if not isinstance(found, tuple):
                    return None if found is None else (_outside(found), None)
                mod, node = found
                entry = _entry(mod, node)
            elif isinstance(node, ast.ClassDef):
                got = self._member(mod, node, part)
                if got is None:
                    outside = self._outside_bases(mod, node)
                    return (_outside(", ".join(outside)), None) \
                        if outside and part == parts[-1] else None
                entry, (mod, node) = got
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and \
                    part == parts[-1] and _sets_on_parameter(node, part):
                return {"kind": "parameter attribute", "where": f"{mod}:{node.name}"}, None
            else:
                return None
        return entry, node

    def lookup(self, name: str) -> dict[str, Any] | None:
        """What ``module:Qualified.name`` is in these sources (the module docstring), or None."""
        got = self.find(name)
        return None if got is None else got[0]

    def calls_by_name(self, caller: str, target: str) -> str | None:
        """Whether function ``caller`` reads the name ``target`` patches at call time:
        ``target`` is ``module:name``, and the caller either lives in that module and uses the
        global ``name``, or imports ``name`` from that module inside its body and uses it.
        Returns how (``"global"`` / ``"local import"``), or None."""
        tmod, _, tname = target.partition(":")
        got = self.find(caller)
        fn = None if got is None else got[1]
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            return None
        cmod = got[0]["where"].partition(":")[0]
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

    # ---- module level --------------------------------------------------------------------
    def _absolute(self, module: str, node: ast.ImportFrom) -> str:
        if not node.level:
            return node.module or ""
        pkg = module if self.sources.is_package(module) else module.rpartition(".")[0]
        for _ in range(node.level - 1):
            pkg = pkg.rpartition(".")[0]
        return pkg + ("." + node.module if node.module else "")

    def _module_def(self, module: str, name: str, depth: int = 0):
        """``(module, node)`` defining ``name`` at module level (imports followed; node None
        for a submodule), the string ``"<package>.<module>"`` for a name imported from another
        package, or None."""
        tree = self.tree(module)
        if tree is None or depth > _DEPTH:
            return None
        found = None
        for node in _toplevel(tree.body):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                if node.name == name:
                    found = (module, node)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                if any(isinstance(t, ast.Name) and t.id == name for t in _targets(node)):
                    found = (module, node)
            elif isinstance(node, ast.ImportFrom):
                for alias in node.names:
                    if (alias.asname or alias.name) == name:
                        found = self._imported(self._absolute(module, node), alias.name, depth)
        if found is None and self.sources.is_package(module) \
                and self.tree(module + "." + name) is not None:
            found = (module + "." + name, None)  # a submodule
        return found

    def _imported(self, src: str, name: str, depth: int):
        if src.partition(".")[0] != self.sources.package:
            return src
        got = self._module_def(src, name, depth + 1)
        if got is None and self.tree(src + "." + name) is not None:
            got = (src + "." + name, None)
        return got

    # ---- classes -------------------------------------------------------------------------
    def _bases(self, module: str, cls: ast.ClassDef) -> list:
        """The class's bases: ``(module, ClassDef)`` for this package's classes,
        ``"<dotted name>"`` for others (another package's, a builtin, one built at run time)."""
        out = []
        for b in cls.bases:
            dotted = _dotted(b.value if isinstance(b, ast.Subscript) else b)  # Base[T]
            if dotted is None or dotted in ("object", "Generic", "Protocol", "ABC"):
                continue
            head, _, rest = dotted.partition(".")
            found = self._module_def(module, head)
            for part in rest.split(".") if rest else ():
                found = self._module_def(found[0], part) \
                    if isinstance(found, tuple) and found[1] is None else None
            if isinstance(found, tuple) and isinstance(found[1], ast.ClassDef):
                out.append(found)
            else:
                out.append(found + "." + dotted if isinstance(found, str) else dotted)
        return out

    def _member(self, module: str, cls: ast.ClassDef, name: str):
        """``(entry, (module, node))`` of ``name`` on ``cls``: in its body or a base's, else
        assigned to ``self.<name>`` in a method of it or of a base."""
        return self._in_body(module, cls, name, 0) or self._assigned(module, cls, name, 0)

    def _in_body(self, module: str, cls: ast.ClassDef, name: str, depth: int):
        for node in _toplevel(cls.body):
            hit = isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) \
                and node.name == name or isinstance(node, (ast.Assign, ast.AnnAssign)) \
                and any(isinstance(t, ast.Name) and t.id == name for t in _targets(node))
            if hit:
                return _entry(module, node, cls.name), (module, node)
        return self._in_bases(module, cls, name, depth, self._in_body)

    def _assigned(self, module: str, cls: ast.ClassDef, name: str, depth: int):
        for fn in _toplevel(cls.body):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) or not fn.args.args:
                continue
            me = fn.args.args[0].arg
            for sub in ast.walk(fn):
                targets = _targets(sub) if isinstance(sub, (ast.Assign, ast.AnnAssign,
                                                            ast.AugAssign)) else ()
                for t in targets:
                    for el in t.elts if isinstance(t, ast.Tuple) else [t]:
                        if isinstance(el, ast.Attribute) and el.attr == name and \
                                isinstance(el.value, ast.Name) and el.value.id == me:
                            return {"kind": "instance attribute",
                                    "where": f"{module}:{cls.name}.{fn.name}"}, (module, el)
        return self._in_bases(module, cls, name, depth, self._assigned)

    def _in_bases(self, module, cls, name, depth, search):
        if depth >= _DEPTH:
            return None
        for base in self._bases(module, cls):
            got = search(base[0], base[1], name, depth + 1) if isinstance(base, tuple) else None
            if got is not None:
                return got
        return None

    def _outside_bases(self, module: str, cls: ast.ClassDef, depth: int = 0) -> list[str]:
        out = []
        for base in self._bases(module, cls):
            if isinstance(base, str):
                out.append(base)
            elif depth < _DEPTH:
                out += self._outside_bases(base[0], base[1], depth + 1)
        return out


def _outside(where: str) -> dict[str, Any]:
    return {"kind": OUTSIDE, "where": where}


def _targets(node) -> list:
    return node.targets if isinstance(node, ast.Assign) else [node.target]


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


def _sets_on_parameter(fn, name: str) -> bool:
    """Whether function ``fn`` assigns ``<one of its parameters>.<name>``."""
    names = set(params(fn))
    for n in ast.walk(fn):
        targets = n.targets if isinstance(n, ast.Assign) else \
            [n.target] if isinstance(n, ast.AnnAssign) else []
        if any(isinstance(t, ast.Attribute) and t.attr == name and
               isinstance(t.value, ast.Name) and t.value.id in names for t in targets):
            return True
    return False


def _entry(module: str, node, cls: str | None = None) -> dict[str, Any]:
    """What ``node`` (defined in ``module``, in the body of class ``cls`` if given) is."""
    where = f"{module}:{cls}" if cls else module
    if node is None:
        return {"kind": "module", "where": module}
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        decos = {_dotted(d.func if isinstance(d, ast.Call) else d) for d in node.decorator_list}
        if cls and decos & {"property", "functools.cached_property", "cached_property"}:
            return {"kind": "property", "where": where}
        kind = "function" if not cls else "staticmethod" if "staticmethod" in decos \
            else "method"
        return {"kind": kind, "where": where, "params": params(node)}
    if isinstance(node, ast.ClassDef):
        return {"kind": "class", "where": where}
    return {"kind": "class attribute" if cls else "module attribute", "where": where}
