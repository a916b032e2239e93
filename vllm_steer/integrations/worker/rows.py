"""The rows of each ``compute_logits`` call: typed row sources. Semantics: see
:mod:`vllm_steer.reference`.

A *row source* says which request slot each hidden-state row of the next ``compute_logits``
call belongs to; the runner hooks set it for the calls they scope
(:meth:`~vllm_steer.integrations.worker.planner.StepPlanner.rows`), and the step planner
(:mod:`~vllm_steer.integrations.worker.planner`) steers the rows it names.
It is one of six small frozen types (a tagged union, :data:`RowSource`):

- :class:`BatchRows` (V1): row i is request slot i (persistent-batch order);
- :class:`MappedRows` (V2): the step's row -> slot on the device, with its host copy when
  known (a device mapping alone, under batch-sharded sampling, is gathered on the device);
- :class:`SlotRows`: the slot of each row on the host (speculative decoding, V2 prompt
  logprobs, drafters), optionally the generated-token index each row samples;
- :class:`PromptRows` (V1 prompt logprobs): a slice of the step's hidden states, one request;
- :class:`NoRows`: rows with no known slot, left unsteered;
- :class:`CapturedRows` (V2 drafters inside CUDA graphs): row -> slot on the device only,
  read by the capture-safe op (:meth:`~vllm_steer.integrations.worker.planner.StepPlanner.
  steer_fixed`).

Every row source but the last gives its row -> slot on the host, so that the planner reads no
device tensor into Python (sync-free); only batch-sharded sampling (V2, TP > 1), whose row
order exists on the device alone, is gathered on the device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

import numpy as np
import torch


@dataclass(frozen=True)
class BatchRows:
    """V1: row i is request slot i (persistent-batch order)."""


@dataclass(frozen=True)
class MappedRows:
    """V2: the step's row -> slot. ``mapping`` on the device; ``slots`` (and ``positions``,
    the generated-token index of each row) its host copy, which plans are made from when
    given; ``key`` the bytes of ``slots`` when the runner hook has them already. A device
    mapping alone (batch-sharded sampling) is gathered on the device."""

    mapping: torch.Tensor | None = None
    slots: np.ndarray | None = None
    positions: np.ndarray | None = None
    key: bytes | None = None


@dataclass(frozen=True)
class SlotRows:
    """The slot of each row on the host (``[num_rows]`` int) and optionally the index of the
    generated token each row samples (-1: a prompt row)."""

    slots: np.ndarray | None
    positions: np.ndarray | None = None


@dataclass(frozen=True)
class PromptRows:
    """V1 prompt logprobs: a slice of the step's hidden states ``base``, mapped to its request
    by its offset (``query_start_loc``: the requests' token offsets)."""

    base: torch.Tensor
    query_start_loc: np.ndarray


@dataclass(frozen=True)
class NoRows:
    """Rows with no known slot: left unsteered."""


@dataclass(frozen=True)
class CapturedRows:
    """Row -> slot on the device only (``mapping[i]``; -1: padding), for the capture-safe op."""

    mapping: torch.Tensor | None


#: Where the rows of the next ``compute_logits`` call come from.
RowSource = Union[BatchRows, MappedRows, SlotRows, PromptRows, NoRows, CapturedRows]

BATCH_ROWS = BatchRows()
NO_ROWS = NoRows()
#: The row sources of a whole batch step, which the next step may repeat (a steady step:
#: :meth:`~vllm_steer.integrations.worker.planner.StepPlanner.steer_rows`).
STEADY_KINDS = (BatchRows, MappedRows)


__all__ = ["RowSource", "BatchRows", "MappedRows", "SlotRows", "PromptRows", "NoRows",
           "CapturedRows", "BATCH_ROWS", "NO_ROWS", "STEADY_KINDS"]
