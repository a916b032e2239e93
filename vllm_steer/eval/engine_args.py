"""vLLM's own engine flags on ``vllm-steer tune`` and ``vllm-steer eval``, as ``vllm bench``
takes them: every flag of ``vllm.engine.arg_utils.EngineArgs.add_cli_args``
(``--tensor-parallel-size``, ``--dtype``, ``--max-model-len``, ``--gpu-memory-utilization``,
``--quantization``, ``--enforce-eager``, ...), read into an
:class:`~vllm_steer.eval.generation.EngineConfig`.

Where a tool defines a flag that vLLM's engine also has (``--model``, ``--seed``), there is
one flag, the tool's, and its value goes to the engine too, as in ``vllm bench``: ``--seed``
seeds both the samples and the engine. The settings that depend on the device
(``--dtype``, ``--enforce-eager``, ``--max-model-len``, ``--max-num-seqs``) default to the
device's choice when not given (:data:`~vllm_steer.eval.generation.DEVICE_DEFAULTS`).

vLLM is imported only when such a command's parser is used (to parse or to print its help),
so ``vllm-steer`` and its other commands stay fast; the command's own flags are checked
before that import, so a mistake in them is refused at once.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys

#: ``EngineConfig`` fields set from vLLM's flags of the same name (default: the device's).
DEVICE_FIELDS = ("dtype", "enforce_eager", "max_model_len", "max_num_seqs")
#: Namespace attribute holding each vLLM engine flag's default (dest -> default).
DEFAULTS_ATTR = "vllm_engine_defaults"
DEVICE_HELP = {
    "dtype": "bfloat16 on CUDA, float32 on CPU",
    "enforce_eager": "CUDA graphs on CUDA (--no-enforce-eager), eager on CPU",
    "max_model_len": "the model's own on CUDA, 512 on CPU",
    "max_num_seqs": "vLLM's own on CUDA, 128 on CPU",
}


class EngineFlagsParser(argparse.ArgumentParser):
    """A command's parser that gains vLLM's engine flags the first time it parses or prints
    its help (so building the whole ``vllm-steer`` parser does not import vLLM)."""

    _engine_flags_added = False

    def _add_engine_flags(self) -> None:
        if not self._engine_flags_added:
            self._engine_flags_added = True
            add_engine_flags(self)

    def parse_known_args(self, args=None, namespace=None):
        if not self._engine_flags_added:
            self._check_own_flags(args)
        self._add_engine_flags()
        return super().parse_known_args(args, namespace)

    def _check_own_flags(self, args) -> None:
        """Parse the command's own flags before vLLM is imported for its engine flags: a
        mistake in them (a count out of range, a missing or conflicting flag) is refused at
        once, as the full parse would refuse it, not after vLLM's import. The flags this
        parser does not know yet (vLLM's) are left, unabbreviated, to the full parse; so is
        ``--help``, which lists them."""
        args = list(sys.argv[1:] if args is None else args)
        if "-h" in args or "--help" in args:
            return
        abbrev, self.allow_abbrev = self.allow_abbrev, False  # a vLLM flag is no own flag's
        try:
            super().parse_known_args(args, None)
        finally:
            self.allow_abbrev = abbrev

    def format_help(self):
        self._add_engine_flags()
        return super().format_help()


def engine_parser(subparsers, name: str, **kw) -> argparse.ArgumentParser:
    """``subparsers.add_parser(name, **kw)``, as an :class:`EngineFlagsParser`."""
    cls = subparsers._parser_class
    subparsers._parser_class = EngineFlagsParser
    try:
        return subparsers.add_parser(name, **kw)
    finally:
        subparsers._parser_class = cls


_TEMPLATE: list[argparse.ArgumentParser] = []


def _unhooked(name: str):
    """``EngineArgs.<name>`` as vLLM defines it, callable as on the class. In a process that
    loaded this package's vLLM plugin, ``add_cli_args`` and ``from_cli_args`` are wrapped to add
    and read the serving flags (``--steer`` ...): the tools take vLLM's engine flags only (their
    own positional ``steer`` is a file, not ``--steer NAME=PATH``)."""
    import functools
    import inspect

    from vllm.engine.arg_utils import EngineArgs

    from vllm_steer.integrations.hooks import WRAPPER_ATTR

    raw = inspect.getattr_static(EngineArgs, name)
    fn = raw.__func__ if isinstance(raw, (staticmethod, classmethod)) else raw
    if getattr(fn, WRAPPER_ATTR, None) is not None:
        fn = fn.__wrapped__
    return functools.partial(fn, EngineArgs) if isinstance(raw, classmethod) else fn


def _vllm_parser() -> argparse.ArgumentParser:
    """A parser holding exactly ``EngineArgs.add_cli_args``'s flags (built once)."""
    if not _TEMPLATE:
        p = argparse.ArgumentParser(add_help=False)
        _unhooked("add_cli_args")(p)
        _TEMPLATE.append(p)
    return _TEMPLATE[0]


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    """Add vLLM's engine flags to ``parser``, in vLLM's groups, under a "vLLM engine" title.
    A flag the tool defines itself stays the tool's; vLLM's is left out."""
    taken = set(parser._option_string_actions)
    if parser.usage is None:  # the tool's own flags, then the engine's in one word
        own = parser.format_usage().removeprefix("usage: ").rstrip().replace("%", "%%")
        parser.usage = own.replace(parser.prog, "%(prog)s", 1) + " [vLLM engine flags]"
    defaults: dict = {}
    for group in _vllm_parser()._action_groups:
        actions = [a for a in group._group_actions
                   if a.option_strings and not taken.intersection(a.option_strings)]
        if not actions:
            continue
        g = parser.add_argument_group(f"vLLM engine: {group.title}")
        for a in actions:
            a = copy.copy(a)
            if a.dest in DEVICE_HELP:
                a.default = None
                a.help = (a.help or "").rstrip() + f" (default: {DEVICE_HELP[a.dest]})"
            g._add_action(a)
            defaults[a.dest] = a.default
    parser.set_defaults(**{DEFAULTS_ATTR: defaults})


def engine_config_from_args(args: argparse.Namespace, kv_cache_gib: float | None):
    """The :class:`~vllm_steer.eval.generation.EngineConfig` of parsed arguments: the
    device-dependent settings as given (``None``: the device's default), and every other vLLM
    engine flag that differs from vLLM's default in ``extra``. The values are checked by
    ``EngineArgs.from_cli_args``."""
    from vllm.engine.arg_utils import EngineArgs

    from vllm_steer.eval.generation import EngineConfig

    defaults = {k: d for k, d in (getattr(args, DEFAULTS_ATTR, None) or {}).items()
                if hasattr(args, k)}  # a flag without a default is absent until given
    ns = argparse.Namespace(**{k: getattr(args, k) for k in defaults})
    for k in DEVICE_FIELDS:  # EngineArgs' own default stands in for "the device's"
        if getattr(ns, k, None) is None and hasattr(EngineArgs, k):
            setattr(ns, k, getattr(EngineArgs, k))
    # The model is the tool's own flag (given to the engine later). vLLM's default model id
    # would be looked up on the hub under HF_HUB_OFFLINE; a path that exists is taken as is.
    ns.model = os.curdir
    _unhooked("from_cli_args")(ns)  # vLLM's own checks of the values
    own = {k: getattr(args, k) for k in DEVICE_FIELDS if k in defaults}
    extra = {k: getattr(args, k) for k, d in defaults.items()
             if k not in own and getattr(args, k) != d}
    cfg = EngineConfig(**own, kv_cache_gib=kv_cache_gib, extra=extra)
    cfg.resolved("cpu")  # clashes between our flags and vLLM's are errors now, not later
    return cfg


def engine_flags(engine) -> list[str]:
    """The command-line flags that give ``engine`` (an ``EngineConfig``): the inverse of
    :func:`engine_config_from_args`, for the recorded command."""
    a: list[str] = []
    for k in ("dtype", "max_model_len", "max_num_seqs", "kv_cache_gib", "enforce_eager"):
        a += _flag(k, getattr(engine, k))
    for k, v in engine.extra.items():
        a += _flag(k, v)
    return a


def _flag(dest: str, v) -> list[str]:
    name = "--" + dest.replace("_", "-")
    if v is None:
        return []
    if isinstance(v, bool):
        return [name if v else "--no-" + dest.replace("_", "-")]
    if isinstance(v, (list, tuple)):
        return [name, *(str(x) for x in v)]
    if isinstance(v, dict):
        return [name, json.dumps(v)]
    if isinstance(v, float):
        return [name, f"{v:g}"]
    return [name, str(v)]
