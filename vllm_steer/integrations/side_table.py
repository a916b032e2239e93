"""Our state for vLLM's objects, kept beside them, never set on them. Light: no torch.

vLLM's runners, speculators, workers and engine cores are vLLM's classes: an attribute the
plugin set on one could clash with a later vLLM's own, and would outlive nothing it should.
A :class:`SideTable` maps each such object to the plugin's state for it, by identity, and drops
the entry when the object is collected (:func:`weakref.finalize`), so an identity is never
seen again with a stale entry. A lookup is one dictionary read.
"""

from __future__ import annotations

import weakref
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class SideTable(Generic[T]):
    """State per vLLM object, keyed by identity while the object lives."""

    __slots__ = ("_items", "__weakref__")

    def __init__(self) -> None:
        self._items: dict[int, T] = {}

    def get(self, owner: Any) -> T | None:
        """The state of ``owner`` (None: none yet)."""
        return self._items.get(id(owner))

    @property
    def by_id(self) -> dict[int, T]:
        """The table itself, keyed by ``id(owner)``, for a per-step hook to read with no call of
        its own (``table.by_id.get(id(owner))``; bind it once at import). Read only: entries
        are made by :meth:`set`, and dropped when their owner is collected."""
        return self._items

    def set(self, owner: Any, value: T) -> T:
        """Give ``owner`` this state (kept until ``owner`` is collected); returns it."""
        key = id(owner)
        if key not in self._items:
            weakref.finalize(owner, self._items.pop, key, None)
        self._items[key] = value
        return value

    def __len__(self) -> int:
        return len(self._items)


__all__ = ["SideTable"]
