"""The LM head's steer op replayed from CUDA graphs, one per row bucket. Semantics: see
:mod:`vllm_steer.reference`.

On a GPU the eager steer op is launch-bound: its kernels run for a few microseconds, the host
spends far longer launching them. :class:`SteerGraphs` records the capture-safe op
(:func:`vllm_steer.ops.steer_fixed`: on CUDA the grouped op,
:mod:`vllm_steer.kernels.triton.grouped`, which reads only the steers in use, over the bank in
place) once per *row bucket* (1, 2, 4, ..., up to
:data:`MAX_GRAPH_ROWS` rows, as vLLM captures its model per batch size) into a CUDA graph with
static buffers, and replays it each step: one copy of the step's rows into the bucket's static
input, one replay, the first rows of its static output returned.

- static input ``[bucket, hidden]`` (the rows past the step's are padding: whatever an earlier
  step left there; their outputs are never read);
- the coefficient table and the row index the caller keeps (their storage the graph keeps):
  row ``i`` takes row ``index[i]`` of the table, ``-1`` a padding row (no steer). The LM head
  passes the request-slot table's device rows with its per-step rows after them, and its
  persistent ``[rows]`` int64 index, rewritten only on a step whose rows changed. Without an
  index, row ``i`` takes row ``i`` of the table (``-1`` past the table's end);
- static output ``[bucket, hidden]``: what :meth:`SteerGraphs.run` returns a view of, valid
  until the next call (as the outputs of vLLM's captured model).

The worker captures every bucket up to its most rows per step when the model loads
(:meth:`SteerGraphs.capture`), and again after a load that dropped them; a bucket still
missing is captured on the first step that needs it, then replayed. The cache is dropped
(every bucket is captured again) when the caller passes another coefficient table or index
(its buffer was re-allocated), when the activations change dtype or width, and when the bank's
storage moves (:meth:`SteerGraphs.use_bank`: only a bank without a reservation grows; a load
into a reserved bank writes in place and keeps every graph). :meth:`SteerGraphs.run` returns
None, and the caller launches the op eagerly, for more rows than the largest bucket, and for
good once a capture failed (:attr:`SteerGraphs.failed`, logged).

The graph itself comes from a backend (:class:`CudaGraphBackend` on CUDA); tests pass a
stand-in that records captures and replays, so the bucket and re-capture rules are checked on
a CPU.
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable, Protocol

import torch

from vllm_steer import sizing
from vllm_steer.logs import get_logger

from . import ENV_BACKEND, capture_safe
from .layout import row_bucket

#: Set to 0 to launch the LM head's steer op eagerly on CUDA (no CUDA graphs of it).
ENV_GRAPHS = "VLLM_STEER_CUDA_GRAPHS"
#: The largest row bucket captured; a step with more rows launches the op eagerly.
MAX_GRAPH_ROWS = sizing.MAX_GRAPH_ROWS


def graphs_enabled(choice: str | None = "auto") -> bool:
    """Whether the head's op may be replayed from CUDA graphs: ``$VLLM_STEER_CUDA_GRAPHS``
    (default on), and the steer backend left to ``auto`` (``choice``, the configured backend,
    and ``$VLLM_STEER_BACKEND``): a backend named explicitly is launched as asked."""
    if (choice or "auto") != "auto" or os.environ.get(ENV_BACKEND, "auto") != "auto":
        return False
    value = os.environ.get(ENV_GRAPHS, "").strip()
    if not value:
        return True
    try:
        return int(value) != 0
    except ValueError:
        raise ValueError(f"${ENV_GRAPHS}={value!r} is not an integer: set it to 1 (CUDA "
                         f"graphs for the LM head's steer op, the default) or 0 (eager)") from None


class GraphBackend(Protocol):
    """Records a function into a replayable graph (CUDA graphs; a stand-in in tests)."""

    def capture(self, fn: Callable[[], None]) -> Any: ...

    def replay(self, graph: Any) -> None: ...

    def reset(self) -> None:
        """Every graph captured so far is being dropped: the next capture starts afresh."""


class CudaGraphBackend:
    """``torch.cuda.CUDAGraph``: the function is run once on a side stream (library handles
    and workspaces are created outside the capture), then captured there; the graphs of one
    :class:`SteerGraphs` share one memory pool (they replay one at a time, on one stream) until
    :meth:`reset`: once its last graph is gone, the caching allocator keeps a pool only to free
    it, and a capture into it fails an internal assertion of PyTorch's.
    The capture is thread-local: work other threads of the process put on the GPU meanwhile
    is neither captured nor refused."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.pool = None

    def capture(self, fn: Callable[[], None]) -> Any:
        # torch.cuda.graph's steps (a device sync, then capture_begin/end on a side stream)
        # without its gc.collect() and empty_cache(), which would cost a serving process far
        # more than the capture itself
        with torch.cuda.device(self.device):
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                fn()
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.stream(side):
                graph.capture_begin(pool=self.pool, capture_error_mode="thread_local")
                try:
                    fn()
                finally:
                    graph.capture_end()
            torch.cuda.current_stream().wait_stream(side)
            if self.pool is None:
                self.pool = graph.pool()
        return graph

    def replay(self, graph: Any) -> None:
        graph.replay()

    def reset(self) -> None:
        self.pool = None  # the next capture opens a new pool


class SteerGraphs:
    """The capture-safe steer op over the bank in place, one graph per row bucket.

    ``p1``, ``p2``, ``rank``: the bank's factors in their fixed layout
    (:class:`vllm_steer.bank.SlotBank`), whose storage every graph reads at replay (so loads,
    which rewrite it in place, need no re-capture). ``backend``: :class:`CudaGraphBackend` on
    the bank's device unless given. ``max_per_row``: the most non-zero coefficients a row has
    (two per steer a request may use), what the grouped op's buffers are sized for.
    ``widths``: the bank's per-column steer ranks (:attr:`vllm_steer.bank.SlotBank.widths`,
    rewritten in place by loads), so the grouped op reads no zero padding."""

    def __init__(self, p1: torch.Tensor, p2: torch.Tensor, rank: int,
                 backend: GraphBackend | None = None, max_rows: int = MAX_GRAPH_ROWS,
                 max_per_row: int | None = None, widths: torch.Tensor | None = None):
        self.p1, self.p2, self.rank = p1, p2, int(rank)
        self.widths = widths  # [columns] int32 each column's steer rank, read at replay
        self.backend = backend if backend is not None else CudaGraphBackend(p1.device)
        self.max_rows = int(max_rows)
        self.max_per_row = max_per_row
        self.failed: str | None = None  # why it is launched eagerly for good: a failed capture
        self.captures = 0  # graphs captured (each bucket once per cache)
        self.replays = 0
        # the largest bucket capture() was asked for (0: none yet): a step of more rows runs
        # the op eagerly rather than capture while serving
        self.captured_top = 0
        # bucket -> (graph, static input, static output, and what else the graph reads: the
        # index and the table, referenced here so that their memory is never handed out again)
        self._graphs: dict[int, tuple] = {}
        self._steps: dict[int, tuple] = {}  # rows -> (graph, input view, output view)
        self._table: torch.Tensor | None = None  # what the graphs were captured with
        self._index: torch.Tensor | None = None  # the caller's row index (None: row i = i)
        self._dtype: torch.dtype | None = None
        self._width = 0

    @property
    def buckets(self) -> list[int]:
        """The buckets captured so far (ascending)."""
        return sorted(self._graphs)

    def use_bank(self, p1: torch.Tensor, p2: torch.Tensor, rank: int) -> None:
        """The bank's storage moved (it grew to a larger rank): the graphs read the new one
        from now on (captured again)."""
        self.p1, self.p2, self.rank = p1, p2, int(rank)
        self.invalidate()

    def invalidate(self) -> None:
        """Drop every graph: each bucket is captured again on its next use (into a new memory
        pool: the dropped graphs' pool is freed)."""
        if self._graphs:
            self._graphs.clear()
            self._steps.clear()
            self.backend.reset()

    def run(self, hidden: torch.Tensor, table: torch.Tensor,
            index: torch.Tensor | None = None) -> torch.Tensor | None:
        """The steered ``hidden`` (``[rows, hidden]``), row ``i`` with the coefficients of
        ``table[index[i]]`` (``table``: ``[T, columns]`` fp32; ``index``: ``[at least the
        largest bucket]`` int64, ``-1`` a padding row; both buffers that keep their storage from
        step to step, read in place at the replay). Without an index, row ``i`` takes
        ``table[i]`` (``table`` then has at least ``rows`` rows). Replayed from the bucket's
        graph (captured now if it is the bucket's first use since a :meth:`drop`); a view of
        the static output, valid until the next call. None when the caller must launch the op
        eagerly: too many rows, a bucket over the largest :meth:`capture` was asked for (a
        prompt-logprob chunk longer than any step's sampled rows: never captured while
        serving, which would stall the step and take memory after vLLM sized the KV cache),
        or :attr:`failed`."""
        n = hidden.shape[0]
        if n > self.max_rows or self.failed is not None:
            return None
        if table is not self._table or index is not self._index \
                or hidden.dtype != self._dtype or hidden.shape[1] != self._width:
            self._use(table, index, hidden.dtype, hidden.shape[1])
        step = self._steps.get(n)
        if step is None:  # the bucket's graph and the views of its buffers for n rows
            bucket = row_bucket(n)
            entry = self._graphs.get(bucket)
            if entry is None:
                if self.captured_top and bucket > self.captured_top:
                    return None  # past what start-up captured: no capture inside a step
                entry = self._try_capture(bucket)
                if entry is None:
                    return None
            step = self._steps[n] = (entry[0], entry[1][:n], entry[2][:n])
        graph, h_in, out = step
        h_in.copy_(hidden)
        self.backend.replay(graph)
        self.replays += 1
        return out

    def capture(self, rows: int, width: int, dtype: torch.dtype, table: torch.Tensor,
                index: torch.Tensor | None = None) -> int:
        """Capture now every bucket a step of 1..``rows`` rows replays (at most
        :attr:`max_rows`) that is not captured yet, for activations ``[rows, width]`` of
        ``dtype``, the coefficient table ``table`` and the row index ``index`` (as :meth:`run`
        takes them): at start-up
        and after a load that dropped the graphs, so that no serving step captures. Returns the
        number captured (0 once :attr:`failed`), logged with the time and device memory it
        took. A capture that fails leaves the caller on the eager op, logged
        (:attr:`failed`)."""
        if self.failed is not None or rows < 1:
            return 0
        if table is not self._table or index is not self._index or dtype != self._dtype \
                or width != self._width:
            self._use(table, index, dtype, width)
        dev = self.p1.device
        cuda = dev.type == "cuda"
        t0, held = time.perf_counter(), torch.cuda.memory_reserved(dev) if cuda else 0
        top = row_bucket(min(int(rows), self.max_rows))
        self.captured_top = max(self.captured_top, top)
        done = 0
        for bucket in (1 << i for i in range(top.bit_length())):
            if bucket not in self._graphs:
                if self._try_capture(bucket) is None:
                    break
                done += 1
        if done:
            mib = (torch.cuda.memory_reserved(dev) - held) / 2**20 if cuda else 0.0
            get_logger().info("vllm-steer: captured %d CUDA graph(s) of the LM head's steer op "
                              "(buckets %s rows) in %.2f s, %.1f MiB", done, self.buckets,
                              time.perf_counter() - t0, mib)
        return done

    def _use(self, table: torch.Tensor, index: torch.Tensor | None, dtype: torch.dtype,
             width: int) -> None:
        """Graphs for another coefficient table, row index or activations: drop the ones
        captured."""
        self.invalidate()  # a graph reads the table and the index it was captured with
        self._table, self._index = table, index
        self._dtype, self._width = dtype, int(width)

    def _try_capture(self, bucket: int):
        """:meth:`_capture`, or None when it fails: the graphs are dropped and :attr:`failed`
        says why, and from then on the caller launches the op eagerly (the graphs are an
        optimisation: a capture that fails must not stop serving)."""
        try:
            return self._capture(bucket)
        except Exception as e:  # noqa: BLE001 (whatever CUDA or the allocator raised)
            self.invalidate()
            first = (str(e).strip().splitlines() or [""])[0][:300]
            self.failed = f"capturing the {bucket}-row graph failed: {type(e).__name__}: {first}"
            get_logger().warning("vllm-steer: the LM head's steer op is launched eagerly from "
                                 "now on (not from CUDA graphs): %s", self.failed)
            return None

    def _capture(self, bucket: int):
        dev, table = self.p1.device, self._table
        h_in = torch.zeros((bucket, self._width), dtype=self._dtype, device=dev)
        out = torch.zeros_like(h_in)
        index = None  # row i takes the table's row i, read in place (no gather)
        if self._index is not None:  # the caller's row index, read in place
            assert self._index.shape[0] >= bucket, (tuple(self._index.shape), bucket)
            index = self._index[:bucket]
        elif table.shape[0] < bucket:  # the bucket's rows past the table's: padding rows
            index = torch.arange(bucket, dtype=torch.int64, device=dev)
            index = torch.where(index < table.shape[0], index, -1)
        p1, p2, rank, widths = self.p1, self.p2, self.rank, self.widths
        scratch = capture_safe.scratch(bucket, table.shape[1], rank, self._width, dev,
                                       self.max_per_row)

        def step() -> None:
            capture_safe.steer(h_in, p1, p2, rank, table, index, out, scratch, widths=widths)

        graph = self.backend.capture(step)
        self.captures += 1
        self._graphs[bucket] = (graph, h_in, out, index, table, scratch)
        return self._graphs[bucket]


def head_graphs(bank, choice: str | None = "auto",
                graph_backend: GraphBackend | None = None,
                max_per_row: int | None = None) -> SteerGraphs | None:
    """On CUDA, the LM head's steer op replayed from CUDA graphs (:class:`SteerGraphs`) over
    ``bank`` (a :class:`~vllm_steer.bank.SlotBank`) read in place: no copy, no device memory
    but the graphs' own buffers; kept as ``bank.graphs`` (the bank tells them when its storage
    moves). ``max_per_row``: the most non-zero coefficients a row has (two per steer a request
    may use; default: every column).

    None, and the head launches the op eagerly: on any other device; with
    ``VLLM_STEER_CUDA_GRAPHS=0``; when the steer backend was named (``choice``, the
    configured backend, or ``$VLLM_STEER_BACKEND``: anything but ``auto`` runs as asked); when
    the bank has no rank yet (no start-up steer and no ``--max-steer-rank``: nothing to lay
    out). ``graph_backend``: what records and replays the graphs (tests pass a stand-in,
    which also lifts the CUDA-only rule)."""
    if bank.graphs is not None:
        return bank.graphs
    on_cuda = torch.device(bank.device or "cpu").type == "cuda"
    if (graph_backend is None and not on_cuda) or not graphs_enabled(choice):
        return None
    logger = get_logger()
    if not bank.rank:
        logger.info("vllm-steer: the LM head's steer op is launched eagerly: the bank reserved "
                    "no rank (set --max-steer-rank to replay it from CUDA graphs)")
        return None
    graphs = bank.graphs = SteerGraphs(bank.p1, bank.p2, bank.rank, graph_backend,
                                       max_per_row=max_per_row, widths=bank.widths)
    logger.info("vllm-steer: the LM head's steer op replays from CUDA graphs (one per row "
                "bucket up to %d rows) over the bank in place (%d columns x rank %d x hidden "
                "%d), reading only the steers in use; VLLM_STEER_CUDA_GRAPHS=0 launches it "
                "eagerly instead", MAX_GRAPH_ROWS, bank.num_columns, bank.rank,
                bank.hidden_size)
    return graphs
