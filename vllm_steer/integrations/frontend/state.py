"""The frontend process's state (API server, or the process of an offline ``LLM``): what it
knows of the steers, held in a :class:`FrontendState` per engine client and reached through
:func:`frontend_state` alone (an API server has one engine; an offline process may build
several ``LLM``s, each admitting its requests by its own configuration: :func:`engine_scope`).

- ``config``: this engine's :class:`~vllm_steer.config.SteerServerConfig` (set when vLLM
  creates the engine config, and again by each ``InputProcessor``);
- ``loaded``: the names the engine core serves, as this process last heard (the steers poll
  and every management call refresh it; None: the configured ``--steer`` names);
- ``hidden_size``: the served model's steer size (``--steer-dir`` files are checked against it);
- ``engine``: this API server's engine client (the management routes, presets);
- ``slot_waiters``: the requests waiting for a steer slot, woken when a steered request ends;
- the run-time preset table as this process last read it (:meth:`FrontendState.presets_view`,
  replaced only by a newer ``version``).

Light: no torch, no vLLM at import time.
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass, field
from typing import Any, Mapping

from vllm_steer.config import SteerServerConfig
from vllm_steer.integrations.side_table import SideTable


@dataclass
class FrontendState:
    """What this frontend process knows of the steers (see the module doc)."""

    config: SteerServerConfig | None = None
    """This engine's steer configuration (None: the engine does not steer)."""
    loaded: set[str] | None = None
    """Names the engine core serves, as last heard; None: the configured ``--steer`` names."""
    hidden_size: int = 0
    """The served model's steer size (0: unknown)."""
    engine: Any = None
    """This API server's engine client (set by the steer endpoints)."""
    presets_version: int = -1
    """Version of the run-time preset table last read (-1: none read)."""
    presets: dict[str, dict[str, float]] = field(default_factory=dict)
    """The run-time preset table last read."""
    slot_waiters: set = field(default_factory=set)
    """Futures of the requests waiting for a steer slot, set when a steered request of this
    process finishes (:mod:`vllm_steer.integrations.frontend.async_llm`)."""

    def slot_may_be_free(self) -> None:
        """A steered request of this process finished: wake every request waiting for a
        steer slot (each asks the engine core once whether there is room now)."""
        waiters, self.slot_waiters = self.slot_waiters, set()
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)

    def reset(self, config: SteerServerConfig | None) -> None:
        """A new engine configuration for this process: it starts from its own ``--steer``
        names (run-time loads and presets of an earlier engine in the same process are
        forgotten)."""
        self.config = config
        self.loaded = None
        self.forget_presets()

    @property
    def enabled(self) -> bool:
        return self.config is not None and self.config.enabled

    def loaded_names(self) -> set[str]:
        if self.loaded is not None:
            return set(self.loaded)
        return set(self.config.steers) if self.config is not None else set()

    def set_loaded(self, names) -> None:
        self.loaded = None if names is None else set(names)

    # ---- the run-time preset table (vllm_steer.integrations.engine.presets) -----------------
    def presets_view(self) -> dict[str, dict[str, float]]:
        """The run-time presets as this process last read them."""
        return dict(self.presets)

    def update_presets(self, answer: Mapping[str, Any] | None) -> None:
        """Take the table from an engine-core answer if it is newer than the view."""
        if not answer or "version" not in answer or not isinstance(answer.get("presets"),
                                                                   Mapping):
            return
        if answer["version"] >= self.presets_version:
            self.presets_version = answer["version"]
            self.presets = {n: dict(m) for n, m in answer["presets"].items()}
            self.presets_from_file = set(answer.get("from_file") or ())

    def forget_presets(self) -> None:
        self.presets_version, self.presets = -1, {}
        self.presets_from_file: set[str] = set()  # the names of the presets file's presets

    def set_engine(self, engine) -> None:
        """This API server's engine client (a new engine: a new preset table)."""
        self.engine = engine
        self.forget_presets()


_STATE = FrontendState()
#: Each engine client's state, by its ``InputProcessor`` (one per ``LLM`` or ``AsyncLLM``):
#: a process may hold several engines (an offline steered ``LLM`` beside a plain one).
_ENGINES: SideTable[FrontendState] = SideTable()
#: The state of the engine whose call is running (None: the process's latest engine's).
_CURRENT: contextvars.ContextVar[FrontendState | None] = contextvars.ContextVar(
    "vllm_steer_frontend_state", default=None)


def frontend_state() -> FrontendState:
    """The :class:`FrontendState` of the engine whose call is running (:func:`engine_scope`:
    its admission, its management calls), else of the process's latest engine (the one
    accessor). An API server has one engine: always the same state."""
    current = _CURRENT.get()
    return _STATE if current is None else current


def new_engine(config: SteerServerConfig | None) -> FrontendState:
    """A new engine's configuration in this process (its engine config created, or its
    ``InputProcessor`` built): the latest engine's state starts from it. Where an engine's
    ``InputProcessor`` already holds that state (an earlier engine of the process), that
    engine keeps it and the new engine gets a state of its own."""
    global _STATE
    if any(st is _STATE for st in _ENGINES.by_id.values()):  # an engine's own already
        _STATE = FrontendState()
    _STATE.reset(config)
    return _STATE


def bind_engine(processor) -> FrontendState:
    """The latest engine's state becomes ``processor``'s (its ``InputProcessor``: one per
    engine client), read whenever a call of that engine runs (:func:`engine_scope`)."""
    return _ENGINES.set(processor, _STATE)


def state_of(processor) -> FrontendState | None:
    """The state of the engine whose ``InputProcessor`` is ``processor`` (None: unknown)."""
    return _ENGINES.get(processor)


@contextlib.contextmanager
def engine_scope(processor):
    """Run a call of the engine whose ``InputProcessor`` is ``processor`` with its own state
    (an engine the plugin does not know: the process's latest engine's)."""
    token = _CURRENT.set(_ENGINES.get(processor))
    try:
        yield
    finally:
        _CURRENT.reset(token)
