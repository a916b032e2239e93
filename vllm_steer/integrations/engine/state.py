"""The engine core's one state object: what it knows of the steers, held in
:class:`EngineSteerState` and reached through :func:`engine_state` alone (one per
``EngineCore``). Light: no torch at import time.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm_steer.config import SteerServerConfig
from vllm_steer.integrations.engine.presets import PresetTable
from vllm_steer.integrations.engine.registry import SteerEntry, SteerRegistry
from vllm_steer.integrations.protocol import SOURCE_STARTUP
from vllm_steer.integrations.side_table import SideTable


@dataclass
class EngineSteerState:
    """The engine core's steer state, one per ``EngineCore`` (:func:`engine_state`)."""

    config: SteerServerConfig | None
    """This engine's steer configuration (None: it does not steer)."""
    registry: SteerRegistry | None
    """Which steers are loaded, in which slot and generation (None: steering is off)."""
    hidden_size: int
    """The LM head's input size: what a steer must fit."""
    presets: PresetTable = field(default_factory=PresetTable)
    """The run-time preset table (``POST /v1/steer-presets``)."""
    startup_ranks: tuple[int, ...] = ()
    """The ranks of the ``--steer`` files (what the workers' bank reservation is sized for,
    with :meth:`~vllm_steer.config.SteerServerConfig.reserved_rank`)."""

    @property
    def reserved_rank(self) -> int:
        """The largest rank a steer loaded at run time may have: what the bank reserved."""
        return self.config.reserved_rank(self.startup_ranks) if self.config else 0


#: Each engine core's :class:`EngineSteerState`, kept beside it (nothing is set on vLLM's
#: objects).
STATES: SideTable[EngineSteerState] = SideTable()


def attach(core, st: EngineSteerState) -> EngineSteerState:
    """Give an engine core this state (tests build engine cores by hand)."""
    return STATES.set(core, st)


def engine_state(core) -> EngineSteerState:
    """This engine core's :class:`EngineSteerState`, created on first use (the one accessor)."""
    st = STATES.get(core)
    if st is not None:
        return st
    from vllm_steer.format import read_metadata
    from vllm_steer.integrations.families import head_input_size

    cfg = SteerServerConfig.from_additional_config(core.vllm_config.additional_config)
    if cfg is None or not cfg.enabled:
        st = EngineSteerState(cfg, None, 0)
    else:
        reg = SteerRegistry(cfg.capacity)
        ranks = []
        for slot, (name, path) in enumerate(cfg.steers.items()):  # as the workers number them
            meta = read_metadata(path)
            ranks.append(int(meta.rank))
            reg.commit(SteerEntry.from_metadata(name, path, meta, reg.new_generation(), slot,
                                                SOURCE_STARTUP))
        reg.counters["loads"] = 0  # start-up steers are not run-time loads
        st = EngineSteerState(cfg, reg, head_input_size(core.vllm_config.model_config),
                              startup_ranks=tuple(ranks))
    return STATES.set(core, st)
