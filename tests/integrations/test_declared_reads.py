"""One rule: the plugin touches no attribute of a vLLM object outside its accessor layer
(``vllm_steer/integrations/vllm_access.py``), and every name touched there is declared (its
:class:`~vllm_steer.integrations.vllm_access.Access`'s names), so the start-up check verifies
it on the installed vLLM's surface: a release that renamed it is refused at start-up, not at
the first request that reaches it. The hook wrappers (the engine core's, the API server's,
the model runners', the steered head and the per-request state) call the layer's named
functions like everything else (the start-up checks, the request field, admission and
binding, the families, the HTTP routes of ``vllm_steer/server/``, metrics).

Read from the source (``ast``) of the code that runs in vLLM's processes:
``vllm_steer/integrations``, ``vllm_steer/server`` and ``vllm_steer/metrics.py`` (the tools
that drive vLLM as a user does, ``vllm_steer/eval`` and ``vllm_steer/offline.py``, use its
public API and are not the plugin). A vLLM object, in each function, is: a name imported from
``vllm``; a parameter of a hook wrapper (``wrapper(orig, self, ...)``, ``orig`` too, and each
item of its ``*args`` and ``**kwargs``); a name in
:data:`VLLM_NAMES` (the plugin's names for the vLLM objects it is handed); a parameter
annotated with a vLLM class or the CLI namespace vLLM's parser builds (:data:`VLLM_TYPES`);
``app.state`` (vLLM's API server fills it); ``self`` in a class derived from a vLLM class (the
names the class defines itself are its own); in the layer, each parameter of an accessor; a
parameter of a function that a caller in the scanned files hands one (a module's function,
called by name or through its module; a method, through ``self``), by position or keyword,
under whatever name (followed to a fixed point across modules; a parameter
annotated with the standard library's type it is used as, :data:`STDLIB_TYPES`, excepted); and
whatever is derived from one: an alias (``x = runner``), an
attribute (``x.a``), ``getattr(x, "a")``, a call's result (``x.f()``, ``orig(...)``), an item
(``x[i]``) or a loop variable over one. A touch is ``x.a`` (read or set),
``getattr``/``hasattr``/``setattr``/``delattr`` on one (a computed name is refused outside the
layer: it cannot be checked), and each name an ``operator.attrgetter`` (``methodcaller``)
reads, on whatever it is given (outside the layer always a touch: the scan cannot follow what
it is applied to). Python's own names (``__init__``, ``__name__``: :data:`PYTHON`)
are not vLLM's, nor are the plugin's own names on vLLM's objects (its flags on the CLI
namespace, :data:`OUR_FLAGS`; ``vllm_steer_*`` on ``app.state``), and neither are the
attributes of the plain types found behind a vLLM attribute (dict, list, ndarray, Tensor:
:data:`PLAIN`), but on the vLLM object itself.
Each import from a private module of another package (``pydantic._internal``) must be
declared too."""

from __future__ import annotations

import ast
import functools
import queue
import types
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from vllm_steer.integrations import vllm_access
from vllm_steer.integrations.plugin import HOOKS

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "vllm_steer"
SOURCES = sorted((PACKAGE / "integrations").rglob("*.py")) + \
    sorted((PACKAGE / "server").rglob("*.py")) + [PACKAGE / "metrics.py"]
#: The accessor layer.
LAYER = "vllm_steer/integrations/vllm_access.py"
#: Parameter and variable names the plugin gives the vLLM objects it is handed, outside the
#: wrappers' own parameters.
VLLM_NAMES = {"core", "runner", "vllm_config", "model_config", "req_states", "input_batch",
              "sharder", "scheduler_output", "speculative_config", "engine", "llm", "scheduler",
              "worker", "output", "models", "params", "sampling_params", "block"}
#: Annotations of a parameter that vLLM built (the CLI namespace of vLLM's parser), besides
#: the classes imported from ``vllm``.
VLLM_TYPES = {"argparse.Namespace", "Namespace"}
#: Annotations of a parameter that takes a vLLM object through the standard library's API
#: only (vLLM's ``FlexibleArgumentParser``, through argparse's): not followed into it.
STDLIB_TYPES = {"argparse.ArgumentParser"}
#: The plugin's prefix for what it keeps on vLLM's objects (``app.state.vllm_steer_engine``).
OUR_PREFIX = "vllm_steer_"
#: Attributes of the plain types found behind a vLLM attribute (``x.a.values()``): not vLLM's.
PLAIN = {n for t in (dict, list, tuple, set, str, queue.Queue, np.ndarray, torch.Tensor,
                    torch.nn.Module, types.AsyncGeneratorType, types.CoroutineType)
         for n in dir(t)}
#: Python's names, on any object.
PYTHON = {n for n in (*dir(object), *dir(type), "__func__", "__wrapped__", "__dict__",
                      "__annotations__", "__globals__") if n.startswith("__")}
#: Names the plugin's own classes define, read on the objects vLLM holds in its lists (our
#: per-request state among its logits processors), with the class that defines each.
OURS = {"needs_output_token_ids": "vllm_steer.integrations.request_state_v1:SteerRequestStateV1"}


def _our_flags() -> set[str]:
    """The plugin's own fields of vLLM's CLI namespace: the ``dest`` of each flag it adds
    (:func:`~vllm_steer.integrations.frontend.cli_args.add_steer_args`)."""
    import argparse

    from vllm_steer.integrations.frontend.cli_args import add_steer_args

    parser = argparse.ArgumentParser(add_help=False)
    add_steer_args(parser)
    return {a.dest for a in parser._actions}


#: The plugin's flags on vLLM's CLI namespace (``args.steer_dir``): its names, not vLLM's.
OUR_FLAGS = _our_flags()
_ATTR_FUNCS = ("getattr", "hasattr", "setattr", "delattr")
#: ``operator``'s getters: ``attrgetter("a")(x)`` reads ``x.a``, on whatever it is given later
_GETTERS = ("attrgetter", "methodcaller")


@dataclass(frozen=True)
class Touch:
    """One touch of an attribute of a vLLM object."""

    where: str
    """``path:line (function)``."""
    function: str
    """The top-level function (or class) it is in."""
    name: str | None
    """The attribute (None: a name computed at run time)."""
    depth: int
    """1: on the vLLM object itself; more: on what one of its attributes holds; 0: on the
    tuple or dict of a hook wrapper's ``*args`` / ``**kwargs`` (vLLM's arguments)."""
    how: str
    """``read``, ``set``, or the built-in called (``getattr``, ``setattr``, ...)."""


def last(name: str) -> str:
    return name.rpartition(":")[2].rpartition(".")[2]


class _Taint:
    """The vLLM objects of one function: roots and what is derived from them, with depth."""

    def __init__(self, roots: set[str], ours: set[tuple[str, str]] = frozenset(),
                 handed: dict[str, int] | None = None, held: dict[str, int] | None = None
                 ) -> None:
        self.depth = {**(handed or {}), **{r: 0 for r in roots}}
        self.ours = ours
        """``(root, name)``: the plugin's own attribute of a root (a vLLM subclass's
        ``self.name``), not a vLLM object."""
        self.held = held or {}
        """``{name: level}``: the attributes by which some object of the plugin's holds a vLLM
        object (:data:`HELD`): ``x.name`` on any object that is not vLLM's is one."""

    def level(self, node) -> int | None:
        """0 for a vLLM object, k for what k attribute steps from one hold; None: not one."""
        if isinstance(node, ast.Name):
            return self.depth.get(node.id)
        if _app_state(node):
            return 0
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and \
                (node.value.id, node.attr) in self.ours:
            return None
        name = node.attr if isinstance(node, ast.Attribute) else \
            node.args[1].value if isinstance(node, ast.Call) and len(node.args) > 1 and \
            isinstance(node.args[1], ast.Constant) else None
        if isinstance(name, str) and name.startswith(OUR_PREFIX):
            return None  # what the plugin keeps on a vLLM object is its own
        if isinstance(node, (ast.Attribute, ast.Subscript)):
            inner = self.level(node.value)
            if inner is None and isinstance(node, ast.Attribute):
                return self.held.get(node.attr)
            return None if inner is None else inner + 1
        if isinstance(node, ast.Await):
            return self.level(node.value)
        if isinstance(node, ast.Call):
            if isinstance(node.func, ast.Name) and node.func.id == "getattr" and node.args:
                inner = self.level(node.args[0])
                return None if inner is None else inner + 1
            inner = self.level(node.func)
            return None if inner is None else inner + 1
        if isinstance(node, ast.BoolOp):
            levels = [lv for lv in map(self.level, node.values) if lv is not None]
            return min(levels) if levels else None
        return None

    def bind(self, target, level: int | None) -> None:
        if level is None:
            return
        if isinstance(target, ast.Name):
            self.depth[target.id] = min(level, self.depth.get(target.id, level))
        elif isinstance(target, (ast.Tuple, ast.List)):
            for el in target.elts:
                self.bind(el, level + 1)

    def learn(self, fn) -> None:
        """Follow the aliases of ``fn`` (twice: a use before its assignment in source order)."""
        for _ in range(2):
            for n in ast.walk(fn):
                if isinstance(n, ast.Assign):
                    if len(n.targets) == 1 and isinstance(n.targets[0], ast.Tuple) and \
                            isinstance(n.value, ast.Tuple) and \
                            len(n.value.elts) == len(n.targets[0].elts):
                        for t, v in zip(n.targets[0].elts, n.value.elts, strict=True):
                            self.bind(t, self.level(v))
                        continue
                    for t in n.targets:
                        self.bind(t, self.level(n.value))
                elif isinstance(n, (ast.AnnAssign, ast.NamedExpr)) and n.value is not None:
                    self.bind(n.target, self.level(n.value))
                elif isinstance(n, (ast.For, ast.AsyncFor, ast.comprehension)):
                    lv = self.level(n.iter)
                    self.bind(n.target, None if lv is None else lv + 1)


_FUNCTION = (ast.FunctionDef, ast.AsyncFunctionDef)


def _app_state(node) -> bool:
    """``app.state`` or ``<x>.app.state``: the state vLLM's API server fills
    (``init_app_state``: ``args``, ``openai_serving_models``, ...)."""
    return isinstance(node, ast.Attribute) and node.attr == "state" and (
        (isinstance(node.value, ast.Name) and node.value.id == "app")
        or (isinstance(node.value, ast.Attribute) and node.value.attr == "app"))


def _annotated_vllm(fn, imported: set[str]) -> set[str]:
    """The parameters of ``fn`` annotated with a vLLM class (or a CLI namespace)."""
    args = fn.args.posonlyargs + fn.args.args + fn.args.kwonlyargs
    return {a.arg for a in args if a.annotation is not None and
            ast.unparse(a.annotation).strip("'\"") in VLLM_TYPES | imported}


def _own_names(cls: ast.ClassDef) -> set[str]:
    """The names a class defines itself: its body's, and what its methods set on ``self``."""
    own = {t.id for n in cls.body if isinstance(n, (ast.Assign, ast.AnnAssign))
           for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
           if isinstance(t, ast.Name)}
    own |= {n.name for n in cls.body if isinstance(n, (*_FUNCTION, ast.ClassDef))}
    own |= {t.attr for n in ast.walk(cls) if isinstance(n, (ast.Assign, ast.AnnAssign))
            for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name)
            and t.value.id == "self"}
    return own


def _functions(tree):
    """``(top-level name, function)`` for every outermost function (a module's, a class's
    methods); a function nested in one is read with it (its closure's aliases hold)."""
    def outermost(node):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, _FUNCTION):
                yield child
            else:
                yield from outermost(child)

    for top in tree.body:
        for fn in ([top] if isinstance(top, _FUNCTION) else outermost(top)):
            yield getattr(top, "name", "<module>"), fn


def _args(fn) -> list[ast.arg]:
    return fn.args.posonlyargs + fn.args.args + fn.args.kwonlyargs


def _params(fn) -> list[str]:
    return [a.arg for a in _args(fn)]


def _base_call(node: ast.Attribute, fn, bases) -> bool:
    """``Base.method`` inside ``method`` of a class derived from the vLLM class ``Base``: the
    subclass calling its base class's own implementation (``Base.forward(self, ...)``), which
    reads nothing of a vLLM object."""
    return isinstance(node.value, ast.Name) and node.value.id in bases \
        and node.attr == fn.name


#: ``{(file, function): {parameter: level}}``: the parameters of a function (``Class.name``:
#: a method) that some caller hands a vLLM object (level: as :meth:`_Taint.level`).
Handed = dict[tuple[str, str], dict[str, int]]
#: The key of :data:`Handed` under which it keeps the attributes by which the plugin's objects
#: hold a vLLM object (``self.engine = engine``), ``{name: level}``: a read of that name on
#: any object of the plugin's is a vLLM object (by name: the scan does not know the class)
HELD = ("<any object of the plugin's>", "<its attributes>")


def _callees(tree, rel: str, files: set[str]) -> tuple[dict[str, tuple[str, str]],
                                                        dict[str, str]]:
    """The names a module calls its functions (and classes) and those of the other scanned
    files by: ``({local name: (file, name)}, {module alias: file})`` (its own module-level
    functions and classes, each ``from vllm_steer... import f`` of a file in ``files``, and
    each module of them imported whole: ``from vllm_steer.x import y``,
    ``import vllm_steer.x.y as y``)."""
    out = {n.name: (rel, n.name) for n in tree.body
           if isinstance(n, (*_FUNCTION, ast.ClassDef))}
    modules = {}
    for n in ast.walk(tree):
        if isinstance(n, ast.ImportFrom) and n.module and n.module.startswith("vllm_steer"):
            for a in n.names:
                target = n.module.replace(".", "/") + ".py"
                whole = f"{n.module}.{a.name}".replace(".", "/") + ".py"
                if whole in files:
                    modules[a.asname or a.name] = whole
                elif target in files:
                    out[a.asname or a.name] = (target, a.name)
        elif isinstance(n, ast.Import):
            for a in n.names:
                if a.asname and a.name.replace(".", "/") + ".py" in files:
                    modules[a.asname] = a.name.replace(".", "/") + ".py"
    return out, modules


def _callee(func, callees, modules) -> tuple[str, str] | None:
    """``(file, function)`` a call's ``func`` names (``f`` or ``module.f``), if scanned."""
    if isinstance(func, ast.Name):
        return callees.get(func.id)
    if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) \
            and func.value.id in modules:
        return modules[func.value.id], func.attr
    return None


def handed(sources: dict[str, str]) -> Handed:
    """Which parameters of the functions and methods of ``sources`` (``{file: source}``)
    are handed a vLLM object by a caller in them, under whatever name: the callers' vLLM
    objects followed into the functions they call, to a fixed point."""
    trees = {rel: ast.parse(src) for rel, src in sources.items()}
    def params(fn, method: bool) -> list[str | None]:
        args = _args(fn)[1:] if method and not any(
            getattr(d, "id", None) == "staticmethod" for d in fn.decorator_list) else _args(fn)
        return [None if a.annotation is not None and ast.unparse(a.annotation) in STDLIB_TYPES
                else a.arg for a in args]

    defs = {_key(rel, top, fn): params(fn, top != fn.name)
            for rel, tree in trees.items() for top, fn in _functions(tree)}
    # ``obj.name(...)`` on an object of the plugin's (``self.runtime.bind(x)``): the scan does
    # not know the object's class, so every scanned method of that name is followed
    methods: dict[str, list[tuple[str, str]]] = {}
    for key in defs:
        if "." in key[1]:
            methods.setdefault(key[1].rpartition(".")[2], []).append(key)
    # ``super().name(...)``: the method of a scanned base class (a vLLM base's is vLLM's)
    bases = {n.name: [b.id for b in n.bases if isinstance(b, ast.Name)]
             for tree in trees.values() for n in tree.body if isinstance(n, ast.ClassDef)}
    scopes = {rel: _Scope(rel, defs, methods, bases, *_callees(tree, rel, set(sources)),
                          _foreign_imports(tree)) for rel, tree in trees.items()}
    found: Handed = {}
    for _ in range(len(defs) + 1):
        before = {k: dict(v) for k, v in found.items()}
        for rel, tree in trees.items():
            for top, fn, taint in _taints(tree, rel, found):
                _note_held(fn, taint, found)
                for call in ast.walk(fn):
                    if isinstance(call, ast.Call):
                        for target in scopes[rel].targets(call.func, top, fn, taint):
                            _hand(call, target, defs[target], taint, found)
        if found == before:
            return found
    raise AssertionError("the vLLM objects handed between functions did not settle")


@dataclass(frozen=True)
class _Scope:
    """What :func:`handed` knows of the functions a call in the module ``rel`` may run."""

    rel: str
    defs: dict[tuple[str, str], list[str | None]]
    """Every scanned function and method, with its parameters (after ``self``)."""
    methods: dict[str, list[tuple[str, str]]]
    """Every scanned method, by its name."""
    bases: dict[str, list[str]]
    """Every scanned class's base classes, by name."""
    callees: dict[str, tuple[str, str]]
    """The module's names of scanned functions and classes (:func:`_callees`)."""
    modules: dict[str, str]
    """The module's names of scanned modules."""
    foreign: set[str]
    """The names it imports from other packages (:func:`_foreign_imports`)."""

    def targets(self, f, top: str, fn, taint: _Taint) -> list[tuple[str, str]]:
        """The scanned functions (keys of ``defs``) a call's ``f`` in ``fn`` (of the top-level
        ``top``) may run: a function by name or through its module, a class's ``__init__`` by
        the class's name, the class's own method through ``self``, a scanned base class's
        through ``super()``; none on a class or module of another package; else every scanned
        method of that name on an object that is not vLLM's (``obj.name``,
        ``self.attr.name``)."""
        value = f.value if isinstance(f, ast.Attribute) else None
        if _is_super(value):
            return [k for k in self.methods.get(f.attr, [])
                    if k[1].rpartition(".")[0] in self.bases.get(top, [])]
        if isinstance(value, ast.Name) and value.id in self.foreign:
            return []
        target = _callee(f, self.callees, self.modules)
        if target is not None and target not in self.defs:
            target = (target[0], f"{target[1]}.__init__")
        if top != fn.name and isinstance(value, ast.Name) and value.id == "self" and \
                _params(fn)[:1] == ["self"] and (self.rel, f"{top}.{f.attr}") in self.defs:
            target = (self.rel, f"{top}.{f.attr}")
        if target in self.defs:
            return [target]
        if value is not None and taint.level(value) is None and not (
                isinstance(value, ast.Name) and value.id in self.modules):
            return self.methods.get(f.attr, [])
        return []


def _note_held(fn, taint, found: Handed) -> None:
    """Note in ``found`` (under :data:`HELD`) each attribute of an object of the plugin's
    that ``fn`` sets to a vLLM object (``self.engine = engine``)."""
    for n in ast.walk(fn):
        if isinstance(n, ast.Assign):
            targets = n.targets
        elif isinstance(n, ast.AnnAssign) and n.value is not None:
            targets = [n.target]
        else:
            continue
        level = taint.level(n.value)
        for t in targets:
            if level is not None and isinstance(t, ast.Attribute) and \
                    taint.level(t.value) is None:
                have = found.setdefault(HELD, {})
                have[t.attr] = min(level, have.get(t.attr, level))


def _is_super(node) -> bool:
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and \
        node.func.id == "super"


def _foreign_imports(tree) -> set[str]:
    """The names a module imports from packages other than the plugin's (vLLM's included)."""
    out = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.ImportFrom) and not (n.module or "").startswith("vllm_steer") \
                and n.level == 0:
            out |= {a.asname or a.name for a in n.names}
        elif isinstance(n, ast.Import):
            out |= {(a.asname or a.name).split(".")[0] for a in n.names
                    if not a.name.startswith("vllm_steer")}
    return out


def _hand(call, target, params, taint, found: Handed) -> None:
    """Note in ``found`` the parameters of ``target`` (named ``params``) that ``call`` hands
    a vLLM object (by position, before any ``*args``, or by keyword)."""
    given = [(params[i], a) for i, a in enumerate(call.args)
             if i < len(params) and not any(
                 isinstance(b, ast.Starred) for b in call.args[:i + 1])]
    given += [(k.arg, k.value) for k in call.keywords if k.arg in params]
    for param, arg in given:
        level = taint.level(arg)
        if level is not None and param is not None:
            have = found.setdefault(target, {})
            have[param] = min(level, have.get(param, level))


def _key(rel: str, top: str, fn) -> tuple[str, str]:
    """A function's key in :data:`Handed`: ``(file, name)``, ``(file, "Class.name")`` for a
    method."""
    return rel, fn.name if top == fn.name else f"{top}.{fn.name}"


def _taints(tree, rel: str, given: Handed | None = None):
    """``(top-level name, function, its vLLM objects)`` for every outermost function of
    ``tree`` (the file ``rel``); ``given``: the parameters callers hand vLLM objects."""
    imported = _vllm_imports(tree)
    accessors = {a.function.__name__ for a in vllm_access.ACCESSES} if rel == LAYER else set()
    bases = _vllm_bases(tree, imported)
    # ``self`` in a class derived from a vLLM class is a vLLM object; the names the class
    # defines itself are ours
    own = {n.name: _own_names(n) for n in tree.body if isinstance(n, ast.ClassDef)
           and bases[n.name]}
    for top, fn in _functions(tree):
        args = _params(fn)
        wrapper = bool(args) and args[0] == "orig"
        roots = imported | VLLM_NAMES | (set(args) if wrapper or fn.name in accessors else set())
        roots |= {a for sub in ast.walk(fn) if isinstance(sub, _FUNCTION) and sub is not fn
                  and _params(sub)[:1] == ["orig"] for a in _params(sub)}
        roots |= _annotated_vllm(fn, imported)
        # a wrapper's ``*args`` / ``**kwargs``: vLLM's arguments, each item a vLLM object
        rest = {a.arg: -1 for sub in ast.walk(fn) if isinstance(sub, _FUNCTION)
                and _params(sub)[:1] == ["orig"] for a in (sub.args.vararg, sub.args.kwarg)
                if a is not None}
        mine = set()
        if top in own and args:  # ``self`` of a vLLM subclass; its own names are ours
            roots.add(args[0])
            mine = {(args[0], name) for name in own[top]}
        from_callers = (given or {}).get(_key(rel, top, fn), {})
        taint = _Taint(roots, mine, {**rest, **from_callers}, (given or {}).get(HELD))
        taint.learn(fn)
        yield top, fn, taint


def _vllm_bases(tree, imported: set[str]) -> dict[str, set[str]]:
    """Each module-level class's base classes imported from ``vllm`` (``imported``)."""
    return {n.name: {b.id for b in n.bases if isinstance(b, ast.Name)} & imported
            for n in tree.body if isinstance(n, ast.ClassDef)}


def _vllm_imports(tree) -> set[str]:
    """The names a module imports from ``vllm``."""
    imported = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.ImportFrom) and n.module and n.module.split(".")[0] == "vllm":
            imported |= {a.asname or a.name for a in n.names}
        elif isinstance(n, ast.Import):
            imported |= {(a.asname or a.name).split(".")[0] for a in n.names
                         if a.name.split(".")[0] == "vllm"}
    return imported


def scan(source: str, rel: str, given: Handed | None = None
         ) -> tuple[list[Touch], list[tuple[str, str]]]:
    """Every touch of a vLLM object in ``source`` (the file ``rel``), and ``(where,
    module:Name)`` of each import from a private module of another package. ``given``: the
    vLLM objects callers hand its functions (:func:`handed`; by default those of its own
    functions' calls in it)."""
    tree = ast.parse(source)
    if given is None:
        given = handed({rel: source})
    private = []
    constants = {t.id: n.value.value for n in tree.body if isinstance(n, ast.Assign)
                 and isinstance(n.value, ast.Constant) for t in n.targets
                 if isinstance(t, ast.Name)}
    for n in ast.walk(tree):
        if isinstance(n, ast.ImportFrom) and n.module and n.module.split(".")[0] != "vllm" \
                and n.module != "__future__" and any(p.startswith("_")
                                                     for p in n.module.split(".")):
            private += [(f"{rel}:{n.lineno}", f"{n.module}:{a.name}") for a in n.names]
    bases = _vllm_bases(tree, _vllm_imports(tree))
    found = []
    for node in tree.body:  # a getter made at module level (``get = attrgetter("a")``)
        getter = node.value if isinstance(node, ast.Assign) else None
        if isinstance(getter, ast.Call) and _getter(getter):
            found += _getter_touches(getter, f"{rel}:{node.lineno}", "<module>")
    for top, fn, taint in _taints(tree, rel, given):
        for n in ast.walk(fn):
            where = f"{rel}:{getattr(n, 'lineno', fn.lineno)} ({fn.name})"
            if isinstance(n, ast.Attribute):
                if _base_call(n, fn, bases.get(top, ())) or taint.level(n) is None and \
                        isinstance(n.value, ast.Name) and (n.value.id, n.attr) in taint.ours:
                    continue
                lv = taint.level(n.value)
                if lv is not None:
                    how = "read" if isinstance(n.ctx, ast.Load) else "set"
                    found.append(Touch(where, top, n.attr, lv + 1, how))
            elif isinstance(n, ast.Call) and _getter(n):  # reads whatever it is given
                found += _getter_touches(n, where, top)
            elif isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and \
                    n.func.id in _ATTR_FUNCS and len(n.args) >= 2:
                lv = taint.level(n.args[0])
                if lv is None:
                    continue
                name = n.args[1].value if isinstance(n.args[1], ast.Constant) else \
                    constants.get(getattr(n.args[1], "id", None))
                found.append(Touch(where, top, name, lv + 1, n.func.id))
    return found, private


def _getter(call: ast.Call) -> bool:
    """``attrgetter(...)`` or ``operator.attrgetter(...)`` (or ``methodcaller``)."""
    f = call.func
    return (f.id if isinstance(f, ast.Name) else getattr(f, "attr", None)) in _GETTERS


def _getter_touches(call: ast.Call, where: str, top: str) -> list[Touch]:
    """The touches of a getter: each name it reads (``"a.b"``: ``a``, then ``b`` on what it
    holds), taken as read on a vLLM object (the scan cannot follow what it is given)."""
    how = getattr(call.func, "id", None) or call.func.attr
    out = []
    for a in call.args[:1] if how == "methodcaller" else call.args:
        if not (isinstance(a, ast.Constant) and isinstance(a.value, str)):
            out.append(Touch(where, top, None, 1, how))
            continue
        out += [Touch(where, top, part, depth, how)
                for depth, part in enumerate(a.value.split("."), start=1)]
    return out


def violations(source: str, rel: str, given: Handed | None = None) -> list[str]:
    """What breaks the rule in ``source`` (the file ``rel``, relative to the repository);
    ``given``: as :func:`scan`'s."""
    touches, _ = scan(source, rel, given)
    per_access = {a.function.__name__: {last(n) for n in a.all_names}
                  for a in vllm_access.ACCESSES}
    out = []
    for t in touches:
        if t.name in PYTHON or ((t.depth > 1 or t.depth == 0) and (t.name in PLAIN
                                                               or t.name in OURS)):
            continue
        if t.name is not None and (t.name.startswith(OUR_PREFIX) or t.name in OUR_FLAGS):
            continue  # the plugin's own names on vLLM's objects (app.state, the CLI namespace)
        what = f"{t.where}: {t.how} {t.name or '(a computed name)'}"
        if rel == LAYER:
            if t.function not in per_access:
                out.append(f"{what}: in no accessor declared in ACCESSES")
            elif t.name is not None and t.name not in per_access[t.function]:
                out.append(f"{what}: not declared in the Access of {t.function}")
        else:
            out.append(f"{what}: a vLLM object touched outside {LAYER} (call an accessor)")
    return out


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


@functools.cache
def _sources() -> dict[str, str]:
    return {_rel(p): p.read_text() for p in SOURCES}


@functools.cache
def _given() -> Handed:
    """The vLLM objects the scanned files hand their functions (computed once)."""
    return handed(_sources())


def test_no_vllm_object_is_touched_outside_the_layer_and_every_name_is_declared():
    bad = [v for rel, src in _sources().items() for v in violations(src, rel, _given())]
    assert bad == [], "; ".join(bad)


def test_every_private_import_of_another_package_is_declared():
    reads = {r for h in HOOKS for r in h.reads} | \
        {n for a in vllm_access.ACCESSES for n in a.all_names}
    missing = [f"{where}: {name}" for rel, src in _sources().items() for where, name in
               scan(src, rel, _given())[1] if name not in reads]
    assert missing == [], "private imports without a declaration: " + "; ".join(missing)


def test_every_accessor_is_a_function_of_the_layer_and_declared_once():
    fns = [a.function for a in vllm_access.ACCESSES]
    assert len(set(fns)) == len(fns)
    assert all(f.__module__ == vllm_access.__name__ for f in fns)
    tree = ast.parse((ROOT / LAYER).read_text())
    touching = {t.function for t in scan(_sources()[LAYER], LAYER, _given())[0]}
    public = {n.name for n in tree.body if isinstance(n, _FUNCTION)}
    assert touching <= {f.__name__ for f in fns} | {"access_problems"}, touching
    assert {f.__name__ for f in fns} <= public


def test_the_allowed_files_exist_and_our_names_are_ours():
    from vllm_steer.integrations.hooks import resolve

    assert (ROOT / LAYER).is_file()
    for name, owner in OURS.items():
        assert name in vars(resolve(owner)), (name, owner)


# ---- the rule can fail: planted cases ----------------------------------------------------
FRONTEND_FILE = "vllm_steer/integrations/frontend/startup_checks.py"
RUNNER_FILE = "vllm_steer/integrations/worker/v2.py"
SERVER_FILE = "vllm_steer/server/lens_route.py"


def _one(source: str, rel: str, *words: str) -> None:
    """``source`` breaks the rule, and one of the violations says each of ``words``."""
    got = violations(source, rel)
    assert any(all(w in v for w in words) for v in got), (words, got)


def test_an_alias_of_a_vllm_object_is_followed():
    src = "def f(vllm_config):\n    mc = vllm_config\n    return bool(mc)\n"
    assert violations(src, FRONTEND_FILE) == []  # no attribute touched: nothing to find
    _one("def f(vllm_config):\n    x = vllm_config\n    y = x\n    return y.enforce_eager\n",
         FRONTEND_FILE, "read enforce_eager", "outside")
    # in a runner's hook wrapper too: an alias of what it is handed, read or set
    _one("def f(orig, self):\n    batch = self.input_batch\n    return batch.num_reqs\n",
         RUNNER_FILE, "read num_reqs", "outside")
    _one("def f(orig, self):\n    out = orig(self)\n    out.req_ids = []\n    return out\n",
         FRONTEND_FILE, "set req_ids", "outside")
    _one("def f(runner):\n    batch = runner.input_batch\n    batch.num_reqs = 0\n",
         RUNNER_FILE, "set num_reqs", "outside")
    # a wrapper's *args / **kwargs hold vLLM's arguments: each item is one, the tuple and
    # dict themselves are Python's; and so in a function they are handed to
    _one("def f(orig, self, *args, **kwargs):\n    return args[0].num_reqs\n", RUNNER_FILE,
         "read num_reqs", "outside")
    _one("def f(orig, self, *a, **kw):\n    return kw['input_batch'].req_ids\n", RUNNER_FILE,
         "read req_ids", "outside")
    _one("def f(orig, self, *args):\n    return g(args)\n\n\ndef g(xs):\n"
         "    return [x.req_ids for x in xs]\n", RUNNER_FILE, "read req_ids", "(g)")
    assert violations("def f(orig, self, *args, **kwargs):\n"
                      "    return args.index(self), kwargs.get('a'), len(args)\n",
                      RUNNER_FILE) == []


def test_a_vllm_object_handed_to_a_function_is_followed_into_it():
    """Under whatever name the function calls it: in the same module (by position or by
    keyword, one call deep or two), and in a function imported from another scanned module;
    what the function does with objects of its own is not a touch."""
    helper = "def _rows(thing, n=0):\n    return thing.idx_mapping_np[:n]\n"
    _one(f"def f(orig, self, *args):\n    return _rows(orig(self, *args))\n\n\n{helper}",
         RUNNER_FILE, "read idx_mapping_np", "(_rows)", "outside")
    _one(f"def f(runner):\n    return _rows(n=1, thing=runner.input_batch)\n\n\n{helper}",
         RUNNER_FILE, "read idx_mapping_np", "(_rows)")
    _one("def f(runner):\n    return _mid(3, runner)\n\n\ndef _mid(k, x):\n"
         f"    return _rows(x, k)\n\n\n{helper}", RUNNER_FILE, "read idx_mapping_np", "(_rows)")
    assert violations(f"def f(runner, table):\n    return _rows(table)\n\n\n{helper}",
                      RUNNER_FILE) == []
    # across modules: the caller's import names the callee's file
    other = "vllm_steer/integrations/worker/rows.py"
    sources = {RUNNER_FILE: "from vllm_steer.integrations.worker.rows import rows_of as r\n\n\n"
                            "def f(orig, self):\n    return r(0, self)\n",
               other: "def rows_of(k, source):\n    return source.expanded_idx_mapping[k]\n"}
    given = handed(sources)
    assert given == {(other, "rows_of"): {"source": 0}}
    got = violations(sources[other], other, given)
    assert any("read expanded_idx_mapping" in v and "(rows_of)" in v for v in got), got
    assert violations(sources[other], other) == []  # alone, nothing hands it one
    for imported in ("from vllm_steer.integrations.worker import rows as m\n",
                     "import vllm_steer.integrations.worker.rows as m\n"):
        whole = {**sources, RUNNER_FILE: f"{imported}\n\ndef f(orig, self):\n"
                                         "    return m.rows_of(0, source=self)\n"}
        assert handed(whole) == given, imported
    # a method handed one by another method of its class, through self
    method = ("class Rows:\n    def f(self, runner):\n        return self._of(1, runner)\n\n"
              "    def _of(self, k, source):\n        return source.input_batch\n")
    _one(method, RUNNER_FILE, "read input_batch", "(_of)")
    assert violations(method.replace("self._of(1, runner)", "self._of(1, k)"),
                      RUNNER_FILE) == []
    # a parameter that takes vLLM's parser as argparse's is not followed; another one is
    parser = ("import argparse\n\n\ndef hook(orig, parser):\n    add(orig(parser))\n\n\n"
              "def add(p: argparse.ArgumentParser):\n    p.add_argument('--x')\n")
    assert violations(parser, FRONTEND_FILE) == []
    _one(parser.replace("p: argparse.ArgumentParser", "p"), FRONTEND_FILE,
         "read add_argument", "(add)")


def test_a_vllm_object_handed_to_a_method_of_a_plugin_object_is_followed():
    """Into a method called on an object of the plugin's, whose class the scan does not know
    (``rows.of(x)``, ``self.rows.of(x)``: every scanned method of that name), into a class's
    ``__init__`` through the class's name, and into a scanned base class's method through
    ``super()``; not into a method of another package's class of the same name."""
    rows = ("class Rows:\n    def __init__(self, source=None):\n        self.n = 0\n\n"
            "    def of(self, k, source):\n        return source.input_batch\n\n\n")
    _one(rows + "def f(runner):\n    rows = Rows()\n    return rows.of(1, runner)\n",
         RUNNER_FILE, "read input_batch", "(of)", "outside")
    _one(rows + "class Head:\n    def __init__(self):\n        self.rows = Rows()\n\n"
                "    def step(self, runner):\n        return self.rows.of(1, source=runner)\n",
         RUNNER_FILE, "read input_batch", "(of)")
    assert violations(rows + "def f(runner, table):\n    return Rows().of(1, table)\n",
                      RUNNER_FILE) == []
    init = rows.replace("self.n = 0", "self.n = source.num_reqs")
    _one(init + "def f(runner):\n    return Rows(runner)\n", RUNNER_FILE,
         "read num_reqs", "(__init__)")
    sub = "class Mine(Rows):\n    def of(self, k, runner):\n        return super().of(k, runner)\n"
    _one(rows + sub.replace("def of(self, k, runner)", "def of(self, k, runner: SamplingParams)")
         .replace("class Mine", "from vllm import SamplingParams\n\n\nclass Mine"),
         RUNNER_FILE, "read input_batch", "(of)")
    # pydantic's ``Decorator.build``, not the plugin's ``build``
    other = ("from pydantic import Decorator\n\n\nclass Table:\n    def build(self, rows):\n"
             "        return rows.input_batch\n\n\ndef f(runner):\n"
             "    return Decorator.build(runner)\n")
    assert violations(other, RUNNER_FILE) == []
    _one(other.replace("Decorator.build(runner)", "Table().build(runner)"), RUNNER_FILE,
         "read input_batch", "(build)")


def test_a_vllm_object_kept_on_an_object_of_the_plugins_is_followed_where_it_is_read():
    """An attribute by which an object of the plugin's keeps a vLLM object (the API server's
    engine client on its state): reading it back, on any object of the plugin's and in any
    scanned module, is a vLLM object; an attribute of the same name that nothing sets to one
    is not."""
    state = ("from vllm.v1.engine.async_llm import AsyncLLM\n\n\nclass State:\n"
             "    def set_engine(self, engine: AsyncLLM):\n        self.engine = engine\n\n\n")
    _one(state + "def f(st):\n    return st.engine.errored\n", FRONTEND_FILE, "read errored",
         "(f)", "outside")
    _one(state + "def f(st):\n    e = st.engine\n    return getattr(e, 'errored')\n",
         FRONTEND_FILE, "getattr errored")
    plain = state.replace("self.engine = engine", "self.engine = 0")
    assert violations(plain + "def f(st):\n    return st.engine.errored\n",
                      FRONTEND_FILE) == []
    # set in one module, read in another (the HTTP server's routes)
    sources = {FRONTEND_FILE: state,
               SERVER_FILE: "def route(st):\n    return st.engine.errored\n"}
    given = handed(sources)
    assert given[HELD] == {"engine": 0}
    got = violations(sources[SERVER_FILE], SERVER_FILE, given)
    assert any("read errored" in v and "(route)" in v for v in got), got
    assert violations(sources[SERVER_FILE], SERVER_FILE) == []  # alone: nothing keeps one


def test_getattr_on_a_vllm_object_is_a_touch():
    _one("def f(vllm_config):\n    return getattr(vllm_config, 'enforce_eager', False)\n",
         FRONTEND_FILE, "getattr enforce_eager")
    _one("def f(vllm_config, name):\n    return getattr(vllm_config.model_config, name)\n",
         FRONTEND_FILE, "getattr (a computed name)")
    _one("def f(runner):\n    return getattr(runner, 'speculator', None)\n",
         RUNNER_FILE, "getattr speculator", "outside")
    _one("def f(orig, self, request):\n    sp = getattr(request, 'sampling_params')\n"
         "    setattr(sp, 'extra_args', {})\n", RUNNER_FILE, "setattr extra_args")


def test_a_subclass_calls_its_vllm_base_only_for_its_own_method():
    src = ("from vllm.layers import Base\n\n\nclass Ours(Base):\n"
           "    def forward(self, x):\n        return Base.forward(self, x)\n")
    assert violations(src, RUNNER_FILE) == []
    # another method of the base, or a class it does not derive from: touches
    _one(src.replace("return Base.forward", "return Base.other"), RUNNER_FILE,
         "read other", "outside")
    _one(src.replace("class Ours(Base)", "class Ours"), RUNNER_FILE, "read forward", "outside")


def test_a_read_in_the_http_server_is_refused():
    _one("async def f(engine):\n    return engine.model_config.max_model_len\n",
         SERVER_FILE, "read model_config", "outside")
    _one("from vllm.config import get_current_vllm_config\n\n\ndef f():\n"
         "    return get_current_vllm_config().model_config\n", SERVER_FILE, "read model_config")
    _one("from vllm import SamplingParams\n\n\ndef f():\n    p = SamplingParams()\n"
         "    return p.extra_args\n", SERVER_FILE, "read extra_args")


def test_the_layer_names_what_each_accessor_touches():
    assert violations("def enforce_eager(model_config):\n    return model_config.enforce_eager\n",
                      LAYER) == []
    _one("def enforce_eager(model_config):\n    return model_config.runner_type\n", LAYER,
         "not declared in the Access of enforce_eager")
    _one("def not_an_accessor(x, vllm_config):\n    return vllm_config.model_config\n", LAYER,
         "in no accessor")


def test_an_attribute_getter_is_a_touch():
    """``attrgetter`` reads the attributes of whatever it is given later, which the scan cannot
    follow: outside the layer it is refused, in the layer its names are its function's."""
    _one("from operator import attrgetter\n\nget = attrgetter('req_ids')\n", RUNNER_FILE,
         "attrgetter req_ids", "outside")
    _one("import operator\n\n\ndef f(orig, self):\n"
         "    return operator.attrgetter('speculator')(self)\n", RUNNER_FILE,
         "attrgetter speculator", "outside")
    _one("def f(x, name):\n    return attrgetter(name)(x)\n", SERVER_FILE,
         "attrgetter (a computed name)")
    _one("def f(runner):\n    return methodcaller('get_model')(runner)\n", FRONTEND_FILE,
         "methodcaller get_model", "outside")
    _one("def v2_req_ids(input_batch):\n    return attrgetter('num_reqs')(input_batch)\n",
         LAYER, "not declared in the Access of v2_req_ids")
    assert violations("def v2_req_ids(input_batch):\n"
                      "    return attrgetter('req_ids')(input_batch)\n", LAYER) == []


def test_the_same_reads_through_the_layer_pass():
    src = ("from vllm_steer.integrations import vllm_access as va\n\n\n"
           "def f(vllm_config):\n    return va.enforce_eager(va.model_config(vllm_config))\n")
    assert violations(src, FRONTEND_FILE) == []
    assert violations(src, SERVER_FILE) == []


def test_the_scan_finds_the_reads_it_is_meant_to():
    """The scan is not vacuous on the plugin itself: it sees reads of known vLLM objects in
    known places."""
    got = {(t.where.split(":")[0], t.name) for rel, src in _sources().items()
           for t in scan(src, rel, _given())[0]}
    assert (LAYER, "idx_mapping_np") in got and (LAYER, "max_num_reqs") in got
    assert (LAYER, "scheduler") in got and (LAYER, "output_queue") in got
    assert (LAYER, "enforce_eager") in got and (LAYER, "is_last_rank") in got
    # the same reads where the hooks once made them, planted: found there too
    planted = [t.name for t in scan("def f(orig, self, input_batch):\n"
                                    "    return input_batch.idx_mapping_np\n", RUNNER_FILE)[0]]
    assert planted == ["idx_mapping_np"]
    private = {n for p in SOURCES for _, n in scan(p.read_text(), _rel(p))[1]}
    assert "pydantic._internal._decorators:Decorator" in private


def test_the_shapes_a_review_found_missed_are_flagged():
    """The reads once missed (the object reached the code under a name the scan did not
    know): each planted, each flagged; the same through the layer, or on the plugin's own
    names, passes."""
    worker = "vllm_steer/integrations/worker/request_slots.py"
    # a request's SamplingParams, in a worker module and in the engine core's registry
    _one("def decode(params, bank):\n    return getattr(params, 'extra_args', None) or {}\n",
         worker, "getattr extra_args", "outside")
    _one("def bound(sampling_params):\n    return sampling_params.extra_args\n",
         "vllm_steer/integrations/engine/registry.py", "read extra_args", "outside")
    _one("def serve(params, served):\n    params.extra_args = {}\n", FRONTEND_FILE,
         "set extra_args", "outside")
    assert violations("from vllm_steer.integrations import vllm_access as va\n\n\n"
                      "def decode(params):\n    return va.extra_args(params)\n", worker) == []
    # vLLM's decoder blocks
    _one("def install(block, t):\n    block.register_buffer('b', t, persistent=False)\n",
         "vllm_steer/integrations/worker/decoder_layers.py", "read register_buffer", "outside")
    # app.state, filled by vLLM's API server; the plugin's own names on it are its own
    _one("def f(raw):\n    return getattr(raw.app.state, 'args', None)\n", SERVER_FILE,
         "getattr args", "outside")
    _one("def f(app):\n    return app.state.openai_serving_models.models\n", SERVER_FILE,
         "read openai_serving_models", "outside")
    assert violations("def f(raw):\n    w = getattr(raw.app.state, 'vllm_steer_presets_watcher',"
                      " None)\n    return w.state(1)\n", SERVER_FILE) == []
    # ``self`` in a subclass of a vLLM class: vLLM's names flagged, the subclass's own not
    sub = ("from vllm.model_executor.layers.logits_processor import LogitsProcessor\n\n\n"
           "class Ours(LogitsProcessor):\n    def __init__(self, n):\n        self.mine = n\n\n"
           "    def forward(self, x):\n        return self.mine.step(x) + self.{}\n")
    _one(sub.format("logits_as_input"), RUNNER_FILE, "read logits_as_input", "outside")
    assert violations(sub.format("mine"), RUNNER_FILE) == []
    # the CLI namespace vLLM's parser built: vLLM's fields flagged, the plugin's flags not
    cli = "vllm_steer/integrations/frontend/cli_args.py"
    _one("import argparse\n\n\ndef f(args: argparse.Namespace):\n"
         "    return getattr(args, 'served_model_name', None)\n", cli,
         "getattr served_model_name", "outside")
    _one("import argparse\n\n\ndef f(args: argparse.Namespace):\n    args.api_key = []\n", cli,
         "set api_key", "outside")
    assert violations("import argparse\n\n\ndef f(args: argparse.Namespace):\n"
                      "    return getattr(args, 'steer_dir', None)\n", cli) == []
    # a RequestOutput's completions, in the API server's hook
    _one("async def generate(orig, self, *args):\n    async for out in orig(self, *args):\n"
         "        for o in out.outputs:\n            o.stop_reason\n",
         "vllm_steer/integrations/frontend/async_llm.py", "read stop_reason")
