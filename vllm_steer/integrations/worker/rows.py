"""The LM head's view of each step: which request slot each hidden-state row of a
``compute_logits`` call belongs to. Semantics: see :mod:`vllm_steer.reference`.

The head's part of the worker's step mapping
(:class:`~vllm_steer.integrations.worker.step_mapping.StepMapping`) is one *view* per kind of
call:

- ``sampled``: the rows the runner samples (V1: the persistent batch, or the verification rows
  of a speculative step; V2: ``expanded_idx_mapping``);
- ``drafts``: the rows a drafter's head computes (one per request of the batch, in batch order;
  inside CUDA graphs: the speculator's own slot buffer on the device);
- ``prompt``: the prompt-logprob rows, which are views of the step's hidden states: a call's
  rows are found by their address in them.

Each view is written by one runner adapter, when the step's rows are known (V1:
:func:`~vllm_steer.integrations.worker.spec_v1.start_step` and
:func:`~vllm_steer.integrations.worker.spec_v1.calc_spec_decode_metadata`; V2:
:func:`~vllm_steer.integrations.worker.v2.sample`; the drafters:
:mod:`~vllm_steer.integrations.worker.spec_v2`; prompt logprobs: the prompt-logprob hooks
of both runners), and read by the head alone
(:meth:`~vllm_steer.integrations.worker.planner.StepPlanner.steer_rows` for the target's head,
:meth:`~vllm_steer.integrations.worker.planner.StepPlanner.steer_draft_rows` for a drafter's):
a call's view follows from what it is (a drafter's head; rows of the step's hidden states
while its prompt logprobs are computed; the sampled rows otherwise).

A view is one of six small frozen types (a tagged union, :data:`RowSource`):

- :class:`BatchRows` (V1): row i is request slot i (persistent-batch order);
- :class:`MappedRows` (V2): the step's row -> slot on the device, with its host copy when
  known (a device mapping alone, under batch-sharded sampling: each row's row of a table the
  host wrote, read on the device);
- :class:`SlotRows`: the slot of each row on the host (verification rows, drafters),
  optionally the generated-token index each row samples;
- :class:`PromptRows`: the step's hidden states and each token's slot (or each request's
  token offsets, V1: request i is slot i);
- :class:`NoRows`: rows with no known slot, left unsteered;
- :class:`CapturedRows` (V2 drafters inside CUDA graphs): row -> slot on the device only,
  read by the capture-safe op (:meth:`~vllm_steer.integrations.worker.planner.StepPlanner.
  steer_fixed`).

Every view but the last gives its row -> slot on the host, so that the planner reads no
device tensor into Python (sync-free); only batch-sharded sampling (V2, TP > 1), whose row
order exists on the device alone, gets its rows' table rows through the device (each token's
table row written from the host, picked by the sharder's own indices).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Union

import numpy as np
import torch


@dataclass(frozen=True)
class BatchRows:
    """V1: row i is request slot i (persistent-batch order). ``sampled``: the runner's
    sampled rows (one per request, each with its generated-token index when a window needs
    it); otherwise a drafter's rows (as many as the batch's requests or fewer, no index)."""

    sampled: bool = True


@dataclass(frozen=True)
class MappedRows:
    """V2: the step's row -> slot. ``mapping`` on the device; ``slots`` (and ``positions``,
    the generated-token index of each row) its host copy, which plans are made from when
    given; ``key`` the bytes of ``slots`` when the runner hook has them already. A device
    mapping alone (batch-sharded sampling) is each row's row of ``table`` (None: the request
    slots' device table), read in place by the capture-safe op."""

    mapping: torch.Tensor | None = None
    slots: np.ndarray | None = None
    positions: np.ndarray | None = None
    key: bytes | None = None
    table: torch.Tensor | None = None


@dataclass(frozen=True)
class SlotRows:
    """The slot of each row on the host (``[num_rows]`` int) and optionally the index of the
    generated token each row samples (-1: a prompt row)."""

    slots: np.ndarray | None
    positions: np.ndarray | None = None


@dataclass(frozen=True)
class PromptRows:
    """Prompt logprobs: the step's hidden states ``base`` (one row per scheduled token), of
    which each call's rows are a slice, found by its address. ``token_slots``: each token's
    request slot (V2); or ``query_start_loc``: each request's first token (V1, request i is
    slot i; a call holds one request's rows)."""

    base: torch.Tensor
    token_slots: np.ndarray | None = None
    query_start_loc: np.ndarray | None = None
    #: ``(offset, rows)`` of the logits call in progress, as the model's ``compute_logits``
    #: received them (:meth:`logits_fn`): the rows of a model that transforms its input
    #: before the LM head (MiMo applies its final norm there), which reaches the head as a
    #: new tensor, not a slice of :attr:`base`
    current: list = field(default_factory=list, compare=False)

    def offset_of(self, hidden: torch.Tensor) -> int | None:
        """The token index of ``hidden``'s first row in :attr:`base` (host addresses only);
        None when ``hidden`` is not a slice of it."""
        base = self.base
        if hidden.untyped_storage().data_ptr() != base.untyped_storage().data_ptr():
            return None
        offset = (hidden.data_ptr() - base.data_ptr()) // (base.stride(0) * base.element_size())
        return offset if 0 <= offset < base.shape[0] else None

    def row_offset(self, hidden: torch.Tensor) -> int | None:
        """The token index of the head's input ``hidden``'s first row in :attr:`base`: its
        address when it is a slice of it, else that of the rows the model's
        ``compute_logits`` received in this call (:attr:`current`, the same number of
        rows); None when neither."""
        offset = self.offset_of(hidden)
        if offset is None and self.current and self.current[0][1] == hidden.shape[0]:
            return self.current[0][0]
        return offset

    def logits_fn(self, fn: Callable) -> Callable:
        """``fn`` (the model's ``compute_logits``) recording the rows of each call in
        :attr:`current` while it runs. A fault finding them records none: the head's own
        search (:meth:`row_offset`, under its fault guard) fails the step's steered requests,
        and vLLM's call goes on."""
        def compute_logits(hidden, *args, **kwargs):
            try:
                offset = self.offset_of(hidden)
            except Exception:  # noqa: BLE001 - met again, and recorded, by the head
                offset = None
            self.current[:] = [] if offset is None else [(offset, hidden.shape[0])]
            try:
                return fn(hidden, *args, **kwargs)
            finally:
                self.current.clear()
        return compute_logits


@dataclass(frozen=True)
class NoRows:
    """Rows with no known slot: left unsteered."""


@dataclass(frozen=True)
class CapturedRows:
    """Row -> slot on the device only (``mapping[i]``; -1: padding), for the capture-safe op."""

    mapping: torch.Tensor | None


#: Where the rows of a ``compute_logits`` call come from.
RowSource = Union[BatchRows, MappedRows, SlotRows, PromptRows, NoRows, CapturedRows]

BATCH_ROWS = BatchRows()
#: V1's drafter rows: row i is the persistent batch's request i (no generated-token index)
DRAFT_BATCH_ROWS = BatchRows(sampled=False)
NO_ROWS = NoRows()
#: The views of a whole batch step, which the next step may repeat (a steady step:
#: :meth:`~vllm_steer.integrations.worker.planner.StepPlanner.steer_rows`).
STEADY_KINDS = (BatchRows, MappedRows)


__all__ = ["RowSource", "BatchRows", "MappedRows", "SlotRows", "PromptRows", "NoRows",
           "CapturedRows", "BATCH_ROWS", "DRAFT_BATCH_ROWS", "NO_ROWS", "STEADY_KINDS"]
