"""Arguments of hooked vLLM functions read by name, not by position.

A hook wrapper is called as ``wrapper(orig, *args, **kwargs)`` with whatever vLLM passed. An
:class:`Arg` finds its parameter's position once per wrapped function, from
``inspect.signature(orig)``, and then reads it from each call's positional or keyword
arguments; so a vLLM that adds a parameter before it still works, and one that removes or
renames it fails loudly, naming the function and the parameter.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable


class Arg:
    """One named parameter of hooked functions (``args`` include ``self`` for methods)."""

    __slots__ = ("name", "_positions")

    def __init__(self, name: str):
        self.name = name
        self._positions: dict[Callable, int | None] = {}

    def position(self, orig: Callable) -> int | None:
        """Its index among ``orig``'s positional parameters (None: keyword-only), found once."""
        try:
            return self._positions[orig]
        except KeyError:
            pass
        signature = list(inspect.signature(orig).parameters.values())
        pos = [p.name for p in signature
               if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        if self.name in pos:
            index = pos.index(self.name)
        elif any(p.name == self.name for p in signature):
            index = None
        else:
            raise RuntimeError(
                f"vllm-steer: {getattr(orig, '__qualname__', orig)} has no parameter "
                f"{self.name!r} in this vLLM (its parameters: {[p.name for p in signature]}); "
                "the plugin cannot read it. Use a supported vLLM version")
        self._positions[orig] = index
        return index

    def get(self, orig: Callable, args: tuple, kwargs: dict, default: Any = None) -> Any:
        """The argument's value in a call ``orig(*args, **kwargs)``."""
        if self.name in kwargs:
            return kwargs[self.name]
        i = self.position(orig)
        return args[i] if i is not None and i < len(args) else default

    def replace(self, orig: Callable, args: tuple, kwargs: dict, value: Any
                ) -> tuple[tuple, dict]:
        """``(args, kwargs)`` of the same call with this argument set to ``value``."""
        i = None if self.name in kwargs else self.position(orig)
        if i is not None and i < len(args):
            return args[:i] + (value,) + args[i + 1:], kwargs
        return args, {**kwargs, self.name: value}


__all__ = ["Arg"]
