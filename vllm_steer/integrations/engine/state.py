"""The engine core's one state object: what it knows of the steers, held in
:class:`EngineSteerState` and reached through :func:`engine_state` alone (one per
``EngineCore``). Light: no torch at import time.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm_steer.config import SteerServerConfig
from vllm_steer.format import factor_ranks
from vllm_steer.kinds import applied_in_layers, content_digest, load_any, read_any_metadata
from vllm_steer.integrations.engine.change_order import ChangeOrder
from vllm_steer.integrations.engine.presets import PresetTable
from vllm_steer.integrations.engine.registry import SteerEntry, SteerRegistry, file_stamp
from vllm_steer.integrations import vllm_access as va
from vllm_steer.integrations.protocol import SOURCE_STARTUP
from vllm_steer.integrations.side_table import SideTable


@dataclass
class EngineSteerState:
    """The engine core's steer state, one per ``EngineCore`` (:func:`engine_state`)."""

    config: SteerServerConfig | None
    """This engine's steer configuration (None: it does not steer)."""
    registry: SteerRegistry | None
    """Which steers are loaded, in which bank slot under which load id (None: steering is off)."""
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

    order: ChangeOrder = field(default_factory=ChangeOrder)
    """The tickets of the changes to each name (data parallelism: the engine cores apply the
    changes of a name in one order)."""
    engine: int = 0
    """This engine core's data-parallel rank (vLLM's ``EngineCore.engine_index``; 0 without
    data parallelism), which names its answers and metrics."""
    metrics_sent: dict | None = None
    """The metric values already handed out to the API servers
    (:func:`vllm_steer.metrics.take_new`; None before the first ``list``)."""
    layers_enabled: bool = False
    """Whether the workers' decoder layers have the op of decoder-layer steers (vector
    steers): :meth:`~vllm_steer.config.SteerServerConfig.layers_enabled`, read once."""
    replaced: dict = field(default_factory=dict)
    """Name -> ``(load id, entry)``: the entry a name held before its last load (that load id)
    replaced it; a data-parallel rollback of that load (it failed on another engine core)
    reads its file again, if unchanged on disk, rather than leave the name unbound here."""


#: Each engine core's :class:`EngineSteerState`, kept beside it (nothing is set on vLLM's
#: objects).
STATES: SideTable[EngineSteerState] = SideTable()


def attach(core, st: EngineSteerState) -> EngineSteerState:
    """Give an engine core this state, numbered as the core is (tests build engine cores by
    hand)."""
    st.engine = _engine_index(core)
    return STATES.set(core, st)


def _engine_index(core) -> int:
    return va.engine_index(core)


def engine_state(core) -> EngineSteerState:
    """This engine core's :class:`EngineSteerState` (the one accessor): made as the engine
    core starts (:func:`vllm_steer.integrations.engine.core.start`), or on first use where
    an engine core is built by hand."""
    st = STATES.get(core)
    if st is not None:
        return st
    from vllm_steer.integrations.families import head_input_size

    vllm_config = va.engine_config(core)
    cfg = SteerServerConfig.from_additional_config(va.additional_config(vllm_config))
    engine = _engine_index(core)
    if cfg is None or not cfg.enabled:
        st = EngineSteerState(cfg, None, 0, engine=engine)
    else:
        reg = SteerRegistry(cfg.capacity)
        ranks = []
        for name, (bank_slot, load_id) in cfg.startup_placement().items():  # the workers' too
            stamp = file_stamp(cfg.steers[name])
            meta = read_any_metadata(cfg.steers[name])
            content = None
            if not applied_in_layers(meta):  # the factors' ranks, as the workers reserve them
                ranks += factor_ranks(cfg.steers[name])
            else:  # what its vectors add, which names them in the prefix cache's salt
                content = content_digest(load_any(cfg.steers[name]),
                                         va.num_hidden_layers(va.model_config(vllm_config)))
            reg.commit(SteerEntry.from_metadata(name, cfg.steers[name], meta, load_id, bank_slot,
                                                SOURCE_STARTUP, stamp, content))
            reg.next_load_id = max(reg.next_load_id, load_id + 1)
        reg.counters["loads"] = 0  # start-up steers are not run-time loads
        st = EngineSteerState(cfg, reg, head_input_size(va.model_config(vllm_config)),
                              startup_ranks=tuple(ranks), engine=engine,
                              layers_enabled=cfg.layers_enabled())
    return STATES.set(core, st)
