"""The step mapping: which request slot, and which coefficients, each token of the step and
each row of its LM-head calls belong to, one object per worker, rewritten by the runner
adapters at every step. Semantics: see :mod:`vllm_steer.reference`.

vLLM's multi-LoRA keeps one ``LoRAMapping`` per step (each token's adapter, and each sampled
row's), built by the runner and copied into persistent device buffers that its kernels read
inside the CUDA graphs. The worker's :class:`StepMapping` is the same for steers, in two
parts, one per place a steer is applied:

- :attr:`StepMapping.tokens` (:class:`TokenCoefs`): each token of the model's input, its
  coefficients for the steers applied inside the decoder layers
  (:data:`vllm_steer.kinds.AT_DECODER_LAYERS`), in persistent device buffers that the
  model's compiled forward reads in place. The runner adapters give the step's tokens in the
  order of the model's input (:func:`~vllm_steer.integrations.vllm_access.v1_step_tokens`,
  :func:`~vllm_steer.integrations.vllm_access.v2_step_tokens`: each token's request slot and
  the index of the generated token its row samples) when the runner prepares its inputs, and
  :meth:`TokenCoefs.build` writes their coefficients into :attr:`LayerVectors.token_coefs`:
  pinned staging, then the device (:class:`~vllm_steer.kernels.staging.StagedCopy`: a ring of
  pinned buffers, so that an overlapping step under async scheduling never rewrites a copy in
  flight), only the rows that changed, and zeros past the step's tokens (padding tokens are
  never steered). A step with no vector-steered request costs one check once its rows are
  zero.
- the LM head's rows, one view per kind of ``compute_logits`` call
  (:mod:`~vllm_steer.integrations.worker.rows`): :attr:`StepMapping.sampled` (the rows the
  runner samples, verification rows included), :attr:`StepMapping.drafts` (a drafter's head)
  and :attr:`StepMapping.prompt` (the step's hidden states while its prompt logprobs are
  computed), with V1's persistent batch (:attr:`StepMapping.batch_size`,
  :attr:`StepMapping.batch_positions`). Each is written by the runner adapter that knows it
  (V1: the per-request state and the ``_prepare_inputs`` and ``_calc_spec_decode_metadata``
  hooks; V2: ``sample``; the drafters:
  :mod:`~vllm_steer.integrations.worker.spec_v2`; prompt logprobs: both runners'
  prompt-logprob hooks) and read by the head alone
  (:class:`~vllm_steer.integrations.worker.planner.StepPlanner`), which points the LM head's
  row index at the request slots' device rows (and writes the step's windowed rows'
  coefficients after them); the eager op alone gathers dense coefficients.
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch

from vllm_steer.integrations.worker.rows import (BATCH_ROWS, NO_ROWS, NoRows, PromptRows,
                                                 RowSource)
from vllm_steer.kernels import staging


class LayerVectors:
    """The vector bank and the per-token coefficients of one worker, read in place by its
    decoder blocks (:mod:`~vllm_steer.integrations.worker.decoder_layers`).

    ``vectors`` is ``[local blocks, bank slots, hidden]`` float32 (a pipeline stage holds only
    its own blocks' vectors); ``token_coefs`` ``[max tokens, bank slots]`` float32. Both are
    allocated once, when the model is loaded, and never move: a load or unload rewrites one
    slot's column in place."""

    def __init__(self, blocks: list[int], num_blocks: int, capacity: int, hidden_size: int,
                 max_tokens: int, device: torch.device, dtype: torch.dtype = torch.float32):
        self.blocks = list(blocks)
        """The model's decoder blocks (0-based, of ``num_blocks``) in this worker."""
        self.num_blocks = num_blocks
        self.capacity = capacity
        self.hidden_size = hidden_size
        self.max_tokens = max_tokens
        self.device = torch.device(device)
        self.dtype = dtype
        """The op's dtype (:func:`op_dtype`): float32, or the model's 16-bit dtype on CUDA."""
        self.vectors = torch.zeros(len(self.blocks), capacity, hidden_size, dtype=dtype,
                                   device=device)
        self.token_coefs = torch.zeros(max_tokens, capacity, dtype=dtype, device=device)
        self.stream_scales = [1.0] * len(self.blocks)
        """Per local block, the factor by which the served model's residual stream after it
        differs from the unscaled model's, set at install
        (:func:`~vllm_steer.integrations.families.stream_scale`): 1.0 but in an fp16
        DeepSeek-style model, whose stream vLLM divides by its routed_scaling_factor. The
        block's vectors are written multiplied by it, so that a vector acts as strongly as in
        the unscaled model."""
        self.slot_is_vector = np.zeros(capacity, dtype=np.float32)
        """1.0 for each bank slot that holds a decoder-layer steer (its coefficient column is
        read here, and not by the head)."""
        self.version = 0

    @property
    def reserved_bytes(self) -> int:
        return (self.vectors.numel() + self.token_coefs.numel()) * self.vectors.element_size()

    def set_stream_scales(self, scales: list[float]) -> None:
        """Each local block's :attr:`stream_scales` (before any steer is written)."""
        if len(scales) != len(self.blocks):
            raise ValueError(f"{len(scales)} stream scales for {len(self.blocks)} blocks")
        if self.slot_is_vector.any():
            raise RuntimeError("the stream scales must be set before any vector is written")
        self.stream_scales = [float(s) for s in scales]

    def put(self, bank_slot: int, steer) -> None:
        """Write a decoder-layer steer's vectors (its kind's ``[num_blocks, hidden]``,
        :attr:`vllm_steer.kinds.SteerKind.layer_vectors`) into ``bank_slot``: this worker's
        blocks' rows, in place, each multiplied in float32 by its block's stream scale
        (:attr:`stream_scales`; rows of scale 1.0 written as they are)."""
        from vllm_steer.kinds import kind_of

        if steer.hidden_size != self.hidden_size:
            raise ValueError(f"steer {steer.name!r} has hidden size {steer.hidden_size}; the "
                             f"model's decoder blocks have {self.hidden_size}")
        stacked = kind_of(steer).layer_vectors(steer, self.num_blocks)
        rows = stacked[self.blocks] if self.blocks else stacked[:0]
        if any(s != 1.0 for s in self.stream_scales):
            rows = rows.float() * torch.tensor(self.stream_scales, dtype=torch.float32,
                                               device=rows.device)[:, None]
        self.vectors[:, bank_slot, :].copy_(rows.to(self.vectors.device, self.dtype))
        self.slot_is_vector[bank_slot] = 1.0
        self.version += 1

    def drop(self, bank_slot: int) -> None:
        self.vectors[:, bank_slot, :].zero_()
        self.slot_is_vector[bank_slot] = 0.0
        self.version += 1

    def block_vectors(self, block: int) -> torch.Tensor:
        """Block ``block``'s ``[bank slots, hidden]`` view (what that block's op reads)."""
        return self.vectors[self.blocks.index(block)]


class TokenCoefs:
    """Each token's coefficients for the decoder-layer steers of the step, in
    :attr:`LayerVectors.token_coefs` (:attr:`StepMapping.tokens`, see the module doc).
    ``slots``: the worker's :class:`~vllm_steer.integrations.worker.request_slots.
    RequestSlots`."""

    def __init__(self, layers: LayerVectors, slots):
        self.layers = layers
        self.slots = slots
        self.filled = 0
        """Rows of the device buffer that may be non-zero (those of the last steered step)."""
        self.steps = 0  # steps mapped
        self.steered_steps = 0  # steps with a vector-steered token
        self.unchanged_steps = 0  # steps whose rows were those of the step before
        self._copy = staging.StagedCopy(layers.device)
        # what the device rows were last written for (no window among its requests): the
        # request-slot table's and the vector bank's versions, the requests' slots and token
        # counts; a step with the same key writes nothing
        self._key: tuple | None = None

    @property
    def idle(self) -> bool:
        """No steered request slot and no row left non-zero: a step maps nothing (:meth:`build`
        would write nothing), so the runner adapters need not read its tokens."""
        return not self.slots.num_active_slots and not self.filled

    def build(self, req_slots: np.ndarray, counts: np.ndarray,
              gen_first: np.ndarray | None) -> None:
        """Map one step: request ``i`` (request slot ``req_slots[i]``) has ``counts[i]``
        consecutive tokens in the model's input; the first samples generated token
        ``gen_first[i]`` (negative: a prompt token; None: unknown, only needed with generation
        windows), the next ones the following indices. Writes the step's rows and zeros the
        rows a longer previous step left."""
        self.steps += 1
        table = self.slots
        host = table.host
        n = int(counts.sum()) if len(counts) else 0
        per_req = None
        key = None
        if table.num_active_slots and host is not None and len(req_slots) and n:
            windowed = table.any_windowed(req_slots)
            if not windowed:  # the same requests, tokens and strengths: the rows are there
                key = (table.version, self.layers.version, req_slots.tobytes(),
                       counts.tobytes())
                if key == self._key:
                    self.unchanged_steps += 1
                    return
            per_req = self._vector_part(host[req_slots])
            if not per_req.any() and not (windowed and self._window_on_vectors(req_slots)):
                per_req = None  # no vector steer among the step's requests: nothing to map
            elif windowed:
                per_req = self._windowed_rows(req_slots, counts, gen_first, n)
            else:
                per_req = np.repeat(per_req, counts, axis=0)
        self._key = None  # never keep a stale key on error
        if per_req is None or not per_req.any():
            self._clear()
            self._key = key
            return
        if n > self.layers.max_tokens:
            raise RuntimeError(f"vllm-steer: the step has {n} tokens, over the "
                               f"{self.layers.max_tokens} the step mapping was sized for")
        buf = self.layers.token_coefs
        rows = np.ascontiguousarray(per_req, dtype=np.float32)
        if self.layers.dtype != torch.float32:  # the op's 16-bit dtype (CUDA)
            rows = _as_dtype(rows, self.layers.dtype)
        if self.filled > n:  # rows of a longer step: zeroed on the device
            buf[n:self.filled].zero_()
        dst = buf[:n]
        if rows.dtype == np.int16:  # 16-bit rows: copied as their bytes
            dst = dst.view(torch.int16)
        self._copy.copy_(dst, rows)
        self.filled = n
        self.steered_steps += 1
        self._key = key

    def build_or_clear(self, req_slots: np.ndarray, counts: np.ndarray,
                       gen_first: np.ndarray | None) -> None:
        """:meth:`build`; on a fault, the rows are zeroed (the step runs unsteered in the
        layers) and the fault raised for the step's steered requests to fail."""
        try:
            self.build(req_slots, counts, gen_first)
        except Exception:
            self.filled = max(self.filled, self.layers.max_tokens)
            self._clear()
            raise

    def _window_on_vectors(self, req_slots: np.ndarray) -> bool:
        """Whether a generation window of these slots' requests is on a vector steer (a
        strength or a base that is not 0): else a windowed step (an LM-Steer window) has no
        per-token row to compute here."""
        w = self.slots.windows
        if w is None:
            return False
        return bool(self._vector_part((w["strength"][req_slots] != 0)
                                      | (w["base"][req_slots] != 0)).any())

    def _windowed_rows(self, req_slots, counts, gen_first, n: int) -> np.ndarray:
        """Per-token rows when a request of the step has a generation window: each token's
        strength at the generated token its row samples (prompt tokens: the base strength)."""
        token_slots = np.repeat(req_slots, counts)
        if gen_first is None:
            positions = None
        else:
            starts = np.cumsum(counts) - counts
            positions = (np.repeat(gen_first, counts)
                         + (np.arange(n) - np.repeat(starts, counts))).astype(np.int64)
        return self._vector_part(self.slots.row_coefs(n, token_slots, positions))

    def _vector_part(self, rows: np.ndarray) -> np.ndarray:
        """``rows`` (request-slot table rows) with only the vector slots' columns (the
        decoder layers' bank; the LM-Steer slots' columns zero)."""
        return rows[:, :self.layers.capacity] * self.layers.slot_is_vector

    def _clear(self) -> None:
        """No vector-steered token in the step: zero the rows the last steered step left."""
        self._key = None
        if self.filled:
            self.layers.token_coefs[:self.filled].zero_()  # on the device: no copy
            self.filled = 0


class StepMapping:
    """The worker's step mapping (see the module doc): the tokens' coefficients for the
    decoder layers (:attr:`tokens`) and the LM head's views of the step's rows. A V1 runner's
    sampled rows are its persistent batch until a speculative step maps its verification rows;
    a V2 runner's are known only inside its ``sample()`` (``StepMapping(sampled=NO_ROWS)``)."""

    __slots__ = ("tokens", "sampled", "drafts", "prompt", "batch_size", "batch_positions",
                 "computed")

    def __init__(self, sampled: RowSource = BATCH_ROWS) -> None:
        self.tokens: TokenCoefs | None = None
        """Each token's coefficients for the decoder layers (None: no decoder-layer op in
        this worker's model)."""
        self.sampled: RowSource = sampled
        """The rows the runner samples (verification rows included)."""
        self.drafts: RowSource = NO_ROWS
        """The rows of a drafter's head."""
        self.prompt: PromptRows | NoRows | None = None
        """The step's hidden states while its prompt logprobs are computed (None otherwise)."""
        self.batch_size = 0
        """V1: the requests in the persistent batch (its rows, :data:`BATCH_ROWS`)."""
        self.batch_positions: np.ndarray | None = None
        """V1: the generated-token index each batch row samples (host; written at every step
        while some slot has a generation window, and read only then)."""
        self.computed: tuple[object, np.ndarray] | None = None
        """V2: ``(input batch, its requests' computed-token counts)`` read from the device
        before the step's forward, taken by its ``sample()`` (a generation window under
        speculative decoding: one read a step)."""

    def view(self) -> RowSource:
        """The target head's view: the prompt rows while the step's prompt logprobs are
        computed (each call a slice of the step's hidden states, found by its address; a
        call that is not is left unsteered), the sampled rows otherwise."""
        prompt = self.prompt
        return self.sampled if prompt is None else prompt

    @contextlib.contextmanager
    def prompts(self, prompt: PromptRows | NoRows):
        """``prompt`` as the step's prompt rows while the block computes its prompt logprobs
        (the prompt-logprob hooks of both runners; :class:`NoRows` after a fault: none
        steered); none after it, so that the step's hidden states are not kept."""
        self.prompt = prompt
        try:
            yield
        finally:
            self.prompt = None

    def __repr__(self) -> str:
        return f"StepMapping(sampled={self.sampled!r}, drafts={self.drafts!r}, prompt=" \
               f"{'None' if self.prompt is None else 'PromptRows(...)'}, tokens=" \
               f"{'None' if self.tokens is None else 'TokenCoefs(...)'})"


def op_dtype(device: torch.device, model_dtype: torch.dtype | None) -> torch.dtype:
    """The dtype of the layers' op: the model's 16-bit dtype on CUDA (its GEMM runs on the
    tensor cores; the strengths and vectors are rounded to it, well inside what a 16-bit
    residual stream resolves), float32 elsewhere (exact against a float32 reference)."""
    if torch.device(device).type == "cuda" and model_dtype in (torch.bfloat16, torch.float16):
        return model_dtype
    return torch.float32


def _as_dtype(rows: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    """``rows`` (float32) as the host bytes of ``dtype`` (a 16-bit dtype numpy may lack)."""
    return torch.from_numpy(rows).to(dtype).view(torch.int16).numpy()


__all__ = ["LayerVectors", "TokenCoefs", "StepMapping", "op_dtype"]
