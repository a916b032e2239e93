"""Per-worker steer state shared by the LM-head hook and the runner's logits processor.

Semantics: see :mod:`vllm_steer.reference`.

One :class:`SteerRuntime` per worker process and steer configuration. It holds

- the :class:`~vllm_steer.bank.SteerBank` on the model's device and dtype (loaded once),
- ``slot_coefs`` ``[max_num_reqs, K]`` fp32 on the device: the coefficients of the request in
  each batch slot (V1: persistent-batch index; V2: request-state slot), written by the logits
  processor when requests enter, leave or move, fully reset when a slot is reused,
- the *row source* of the next ``compute_logits`` call: which slot each hidden-state row
  belongs to. V1 samples rows in batch order (row i = slot i); V2 gives
  ``expanded_idx_mapping`` (row -> slot) per step; prompt-logprob calls map a slice of the
  step's hidden states to one request.

The head does no work at all while no request *of the current step* is steered (host-side
flags, no device sync): V1 zeroes a finished request's slot (``BatchUpdate.removed``); V2 has
no removal callback, so its runner wrapper asks :meth:`SteerRuntime.any_steered` about the
slots of the step's batch (``idx_mapping``) and a finished request's stale slot costs nothing.
:attr:`SteerRuntime.stats` counts the steer-op calls (cheap host counters).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from vllm_steer import REQUEST_FIELD
from vllm_steer.bank import SlotBank
from vllm_steer.config import SteerRequestError, SteerServerConfig, parse_request_steer
from vllm_steer.format import SteerFileError, load_steer, read_metadata
from vllm_steer.logs import get_logger

logger = get_logger()


@dataclass
class SteerStats:
    """Counters of the worker's steer op (host-side integers, no device sync)."""

    calls: int = 0  # steer-op calls (one per ``compute_logits`` with steered rows)
    rows: int = 0  # hidden-state rows passed through the steer op
    seconds: float = 0.0  # host time spent in the steer op (the metrics' per-step time)

    def as_dict(self) -> dict[str, int]:
        return {"calls": self.calls, "rows": self.rows}


@dataclass
class RowSource:
    """Where the rows of the next ``compute_logits`` call come from."""

    kind: str  # "batch" (row i = slot i), "mapping" (row -> slot), "slots", "prompt", "none"
    mapping: torch.Tensor | None = None  # [num_rows] slots on the device ("mapping")
    # "slots": the slot of each row on the host ([num_rows] int, numpy), and optionally the
    # index of the generated token each row samples ([num_rows] int, numpy; -1: a prompt row).
    # The host copy is what plans are made from (no device read).
    slots: np.ndarray | None = None
    positions: np.ndarray | None = None
    base: torch.Tensor | None = None  # the step's full hidden states ("prompt")
    query_start_loc: np.ndarray | None = None  # [num_reqs + 1] token offsets ("prompt")


class SteerRuntime:
    """State of one worker. Created by whichever of head/logits processor comes first."""

    def __init__(self, config: SteerServerConfig):
        self.config = config
        self.names = list(config.steers)
        self.metadata = {}
        problems = []
        for name, path in config.steers.items():
            try:
                self.metadata[name] = read_metadata(path)
            except SteerFileError as e:
                problems.append(str(e))
        if problems:
            raise SteerFileError(", ".join(config.steers.values()),
                                 [p.replace("\n", " ") for p in problems])
        self.bank: SlotBank | None = None
        self.backend: str | None = None  # resolved at load
        self.slot_coefs: torch.Tensor | None = None  # [max_slots, K] on device
        self._host: np.ndarray | None = None  # [max_slots, K] host mirror
        self._steered: np.ndarray | None = None  # [max_slots] bool: slot has a non-zero row
        self.stats = SteerStats()
        self._dirty = False
        self.num_active_slots = 0
        self.version = 0  # bumped whenever slot_coefs may change (keys the bank's plan)
        self.batch_size = 0
        self.row_source = RowSource("batch")
        # steers come and go at run time (vllm_steer.integrations.control): a fixed number of
        # steer slots, two coefficient columns each (steer, domain; see SlotBank)
        self.capacity = config.capacity
        self.num_columns = 2 * self.capacity

    # ---- loading (head side) -------------------------------------------------------------
    def load(self, hidden_size: int, device: torch.device, dtype: torch.dtype,
             model_id: str | None = None) -> None:
        """Load every steer on the model's device/dtype; refuse a steer that does not fit."""
        if self.bank is not None:
            return
        reasons = []
        steers = {}
        for name, path in self.config.steers.items():
            meta = self.metadata[name]
            if meta.hidden_size != hidden_size:
                reasons.append(f"steer {name!r} ({path}): hidden size {meta.hidden_size} does not "
                               f"fit the model's hidden size {hidden_size}; train or transfer it "
                               "for this model (vllm-steer train / vllm-steer transfer)")
                continue
            if meta.base_model and model_id and not _same_model(meta.base_model, model_id):
                logger.warning("vllm-steer: steer %r (%s) was trained on %r but the server runs "
                               "%r; it fits (same hidden size) but may not steer as intended",
                               name, path, meta.base_model, model_id)
            try:
                steers[name] = load_steer(path)
            except SteerFileError as e:
                reasons.append(str(e).replace("\n", " "))
        if reasons:
            raise SteerFileError(", ".join(self.config.steers.values()), reasons)
        self.bank = SlotBank(self.capacity, hidden_size, device=device, dtype=dtype,
                             max_rank=self.config.max_steer_rank)
        for slot, name in enumerate(self.names):  # the registry numbers them the same way
            self.bank.put(slot, slot + 1, name, steers[name])
        # Resolve the backend now (it imports the kernels, and Triton where present: about
        # half a second), not in the first steered request's step.
        from vllm_steer.ops import resolve_backend

        self.backend = resolve_backend(self.config.backend, torch.device(device or "cpu"))
        logger.info("vllm-steer: loaded %d steer(s) %s on %s/%s", len(steers), self.names,
                    device, dtype)

    # ---- request state (logits-processor side) -------------------------------------------
    def ensure_slots(self, max_slots: int, device: torch.device) -> None:
        if self._host is None or self._host.shape[0] < max_slots:
            self._host = np.zeros((max_slots, self.num_columns), dtype=np.float32)
            self._steered = np.zeros(max_slots, dtype=bool)
            self.slot_coefs = torch.zeros((max_slots, self.num_columns), dtype=torch.float32,
                                          device=device)
            self._dirty = False
            self.num_active_slots = 0
            self.version += 1

    def coef_row(self, params: Any) -> np.ndarray:
        """Coefficients of a request (zeros when it asks for no steer).

        The engine core bound each named steer to ``(slot, generation)`` at admission
        (``registry.BOUND_KEY``); a slot that no longer holds that generation is never used
        (the engine core keeps a slot while a request bound to it runs, so this is a bug
        guard, logged). Never raises on request data: bad steers are refused at admission
        (HTTP 400); one that slips through is served unsteered, with a warning."""
        from vllm_steer.integrations.registry import BOUND_KEY

        extra = getattr(params, "extra_args", None) or {}
        value = extra.get(REQUEST_FIELD)
        if value is None or self.bank is None:
            return np.zeros(self.num_columns, dtype=np.float32)
        try:
            strengths = parse_request_steer(value, None, self.config.max_strength)
        except Exception as e:  # noqa: BLE001 - request data must not crash a worker
            logger.warning("vllm-steer: request steer %r refused in the worker (%s); the request "
                           "is served unsteered. Its frontend did not validate it: see "
                           "docs/serving.md", value, e)
            return np.zeros(self.num_columns, dtype=np.float32)
        bound = extra.get(BOUND_KEY)
        if bound is None:  # not bound by the engine core (no control hook): current slots
            bound = {n: (s, self.bank.generations[s])
                     for s, n in enumerate(self.bank.names) if n is not None}
        row, problems = self.bank.coef_row(bound, strengths)
        for p in problems:
            logger.error("vllm-steer: request steer left out: %s", p)
        return np.asarray(row, dtype=np.float32)

    # ---- run-time loading (vllm_steer.integrations.control) ------------------------------
    def put_steer(self, slot: int, generation: int, name: str, steer) -> None:
        """Load a steer into a slot no request uses (the engine core picked it)."""
        assert self.bank is not None, "steers are loaded with the model"
        self.bank.put(slot, generation, name, steer)
        self.version += 1

    def drop_slots(self, slots) -> None:
        if self.bank is None:
            return
        for slot in slots:
            self.bank.drop(slot)
        self.version += 1

    def set_slot(self, slot: int, row: np.ndarray | None) -> None:
        """(Re)initialise a slot fully: a reused slot keeps nothing of its previous request."""
        assert self._host is not None
        if row is None:
            row = 0.0
        self._host[slot] = row
        self._steered[slot] = bool(np.any(self._host[slot]))
        self._dirty = True

    def move_slot(self, src: int, dst: int, swap: bool) -> None:
        assert self._host is not None
        if swap:
            self._host[[src, dst]] = self._host[[dst, src]]
            self._steered[[src, dst]] = self._steered[[dst, src]]
        else:
            self._host[dst] = self._host[src]
            self._host[src] = 0.0
            self._steered[dst] = self._steered[src]
            self._steered[src] = False
        self._dirty = True

    def flush(self) -> None:
        """Copy changed slot coefficients to the device (once per step, only when changed)."""
        if not self._dirty or self._host is None:
            return
        n = self._host.shape[0]
        self.slot_coefs[:n].copy_(torch.from_numpy(self._host), non_blocking=True)
        self.num_active_slots = int(np.count_nonzero(self._steered))
        self._dirty = False
        self.version += 1

    @property
    def has_steered_slots(self) -> bool:
        """Some slot holds a steered request (V2: possibly one that has finished)."""
        return self.bank is not None and self.num_active_slots > 0

    def any_steered(self, slots: np.ndarray) -> bool:
        """Whether any of these slots (a step's ``idx_mapping``) holds a steered request."""
        return self.has_steered_slots and bool(self._steered[slots].any())

    @property
    def active(self) -> bool:
        """Whether the head has steer work for the rows of the next ``compute_logits``."""
        return self.has_steered_slots and self.row_source.kind != "none"

    @contextlib.contextmanager
    def rows(self, source: RowSource):
        """Scope a row source to the calls inside the block (V2 sampling, prompt logprobs)."""
        prev, self.row_source = self.row_source, source
        try:
            yield
        finally:
            self.row_source = prev

    # ---- the head ------------------------------------------------------------------------
    def steer_rows(self, hidden: torch.Tensor) -> torch.Tensor:
        """Steer the rows of one ``compute_logits`` call. Semantics: see reference."""
        if not self.active or hidden.shape[0] == 0:
            return hidden
        coefs = self._coefs_for(hidden)
        if coefs is None:
            return hidden
        # V1 decode steps of an unchanged batch see the same slot coefficients: plan once per
        # change (version), not per step. Other row sources gather coefficients per call.
        key = (self.version, hidden.shape[0]) if self.row_source.kind == "batch" else None
        self.stats.calls += 1
        self.stats.rows += hidden.shape[0]
        t0 = time.perf_counter()
        out = self.bank.apply(hidden, coefs, backend=self.backend, plan_key=key)
        self.stats.seconds += time.perf_counter() - t0
        return out

    def _coefs_for(self, hidden: torch.Tensor) -> torch.Tensor | None:
        src = self.row_source
        n = hidden.shape[0]
        if src.kind == "none":
            return None
        if src.kind == "mapping":
            if src.mapping is None:
                _warn_once("vllm-steer: logits rows came before their row mapping was known; "
                           "they are computed unsteered")
                return None
            return self.slot_coefs.index_select(0, src.mapping[:n].long())
        if src.kind == "slots":
            if src.slots is None or len(src.slots) < n:
                _warn_once("vllm-steer: logits rows outnumber their known slots; they are "
                           "computed unsteered")
                return None
            idx = torch.from_numpy(np.ascontiguousarray(src.slots[:n], dtype=np.int64))
            return self.slot_coefs.index_select(0, idx.to(self.slot_coefs.device))
        if src.kind == "prompt":
            base = src.base
            assert base is not None and src.query_start_loc is not None
            row_bytes = base.stride(0) * base.element_size()
            offset = (hidden.data_ptr() - base.data_ptr()) // row_bytes
            if hidden.untyped_storage().data_ptr() != base.untyped_storage().data_ptr() \
                    or not 0 <= offset < base.shape[0]:
                _warn_once("vllm-steer: prompt-logprob rows could not be matched to a request; "
                           "they are computed unsteered")
                return None
            slot = int(np.searchsorted(src.query_start_loc, offset, side="right") - 1)
            return self.slot_coefs[slot:slot + 1].expand(n, -1)
        # "batch": V1 samples one row per request, in persistent-batch order
        if n != self.batch_size:
            _warn_once(f"vllm-steer: compute_logits got {n} rows for a batch of "
                       f"{self.batch_size} requests; rows left unsteered")
            return None
        return self.slot_coefs[:n]


_WARNED: set[str] = set()


def _warn_once(msg: str) -> None:
    if msg not in _WARNED:
        _WARNED.add(msg)
        logger.warning(msg)


def _same_model(a: str, b: str) -> bool:
    norm = lambda s: s.rstrip("/").split("/")[-1].lower().replace("_", "-")  # noqa: E731
    return norm(a) == norm(b) or a in b or b in a


def request_strengths(params: Any, runtime: "SteerRuntime | None" = None,
                      config: SteerServerConfig | None = None) -> dict[str, float]:
    """The ``{name: strength}`` a request asks for (``SamplingParams.extra_args["steer"]``)."""
    extra = getattr(params, "extra_args", None) or {}
    value = extra.get(REQUEST_FIELD)
    if value is None:
        return {}
    cfg = config or (runtime.config if runtime else None)
    known = cfg.steers if cfg else None
    max_s = cfg.max_strength if cfg else float("inf")
    return parse_request_steer(value, known, max_s)


# One runtime per process and configuration (tests may run several engines in one process).
_RUNTIMES: dict[str, SteerRuntime] = {}


def steer_stats(worker: Any = None) -> dict[str, int]:
    """The steer-op counters of this process, summed over its runtimes.

    Takes (and ignores) a worker as first argument, so that it can be run on every worker with
    ``LLM.collective_rpc(steer_stats)``.
    """
    total = SteerStats()
    for rt in _RUNTIMES.values():
        total.calls += rt.stats.calls
        total.rows += rt.stats.rows
    return total.as_dict()


def get_runtime(additional_config: dict | None) -> SteerRuntime | None:
    """The process's runtime for this engine's configuration (None: no steers configured)."""
    cfg = SteerServerConfig.from_additional_config(additional_config)
    if cfg is None or not cfg.enabled:
        return None
    import json

    key = json.dumps(cfg.to_additional_config(), sort_keys=True)
    rt = _RUNTIMES.get(key)
    if rt is None:
        rt = _RUNTIMES[key] = SteerRuntime(cfg)
    return rt


__all__ = ["SteerRuntime", "RowSource", "SteerStats", "get_runtime", "request_strengths",
           "steer_stats", "SteerRequestError"]
