"""What the kernels do on the host around CUDA: host-to-device copies with no device sync
(:func:`to_device`, :class:`StagedCopy`; :class:`StagedRows`, a persistent buffer written only
when what it should hold changed), and the guard that keeps the steer op out of CUDA
graph capture."""

from __future__ import annotations

import numpy as np
import torch

from vllm_steer.logs import warn_once


def to_device(array, device: torch.device) -> torch.Tensor:
    """A host (numpy) array as a tensor on ``device``, with no device sync.

    Any device but the CPU: staged in pinned memory and copied ``non_blocking`` (a copy from
    pageable memory synchronises the stream). PyTorch's caching host allocator keeps the
    pinned block until the copy has run, so the staging is never rewritten early. CPU: the
    array's own memory (the caller hands over a fresh array)."""
    import numpy as np

    t = torch.from_numpy(np.ascontiguousarray(array))
    device = torch.device(device)
    if device.type == "cpu":
        return t
    return t.pin_memory().to(device, non_blocking=True)


#: What a captured steer op would do wrong, and the vLLM options that keep it out of graphs.
CAPTURE_ERROR = (
    "the steer op was called while a CUDA graph is being captured on {device}; steering runs "
    "outside CUDA graphs (each batch's plan and coefficients change between steps, and a "
    "replayed graph would keep the ones of its capture). Run vLLM with piecewise CUDA graphs, "
    "--compilation-config '{{\"cudagraph_mode\": \"PIECEWISE\"}}', or without CUDA graphs, "
    "--enforce-eager")


def capturing(t: torch.Tensor) -> bool:
    """Whether a CUDA graph is being captured on the current stream (on ``t``'s device)."""
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


def check_not_capturing(device: torch.device) -> None:
    """Raise if a CUDA graph is being captured on the current stream (tensors on CUDA only:
    for any other device this is one comparison). Called by :func:`vllm_steer.ops.apply_steers`
    and by every public kernel wrapper (steer and prepare functions)."""
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(CAPTURE_ERROR.format(device=device))


class StagedCopy:
    """Host -> device copies from pinned staging that is never rewritten before its copy ran,
    and never waited for while the device still runs.

    A ring of pinned buffers, each with a CUDA event recorded after its copy. A copy takes a
    buffer whose event has completed (``Event.query()``: a flag read, no wait) and adds a
    buffer when every one is still in flight, so however many copies a step makes (a V2
    prompt-logprob step copies once per chunk while the forward may still be running) the host
    does not wait behind the device: the ring grows to the number of copies in flight at once
    (a handful; :attr:`grown` counts the buffers added). Past :data:`MAX_STAGING_BUFFERS` in
    flight the oldest copy is waited for (logged once): a device that far behind the host is
    not a state the runner reaches (it reads each step's sampled tokens). This is vLLM's
    ``CpuGpuBuffer`` pattern (the V1 runner's ``prepare_inputs_event``) without its wait. On
    CPU the copy is a plain one (no pinning)."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self._free: list = []  # pinned buffers whose copy has run
        self._flight: list = []  # (buffer, event) of copies not known to have run, oldest first
        self._events: list = []  # spare events
        self.grown = 0  # pinned buffers allocated
        self.waits = 0  # copies waited for (ring full)
        self.copies = 0  # copies made
        self.bytes = 0  # bytes copied

    def copy_(self, dst: torch.Tensor, src: np.ndarray) -> torch.Tensor:
        """``dst.copy_(src)`` (``dst`` a contiguous device tensor of ``src``'s shape)."""
        self.copies += 1
        self.bytes += src.nbytes
        if not self.cuda:
            return dst.copy_(torch.from_numpy(src))
        buf = self._take(src.nbytes)
        staged = buf[:src.nbytes].view(dst.dtype).view(dst.shape)
        staged.numpy()[...] = src
        dst.copy_(staged, non_blocking=True)
        event = self._events.pop() if self._events else torch.cuda.Event()
        event.record()
        self._flight.append((buf, event))
        return dst

    def _take(self, nbytes: int) -> torch.Tensor:
        """A pinned buffer of at least ``nbytes`` that no pending copy reads (no wait unless
        :data:`MAX_STAGING_BUFFERS` copies are in flight)."""
        while self._flight and self._flight[0][1].query():  # copies that ran, in order
            buf, event = self._flight.pop(0)
            self._free.append(buf)
            self._events.append(event)
        if not self._free and len(self._flight) >= MAX_STAGING_BUFFERS:
            warn_once(f"vllm-steer: {len(self._flight)} coefficient copies in flight (the "
                      f"staging limit, {MAX_STAGING_BUFFERS}); the host waits for the oldest")
            buf, event = self._flight.pop(0)
            event.synchronize()
            self.waits += 1
            self._free.append(buf)
            self._events.append(event)
        buf = self._free.pop() if self._free else None
        if buf is None or buf.numel() < nbytes:
            buf = torch.empty(max(nbytes, 1024), dtype=torch.uint8, pin_memory=True)
            self.grown += 1
        return buf


class StagedRows:
    """A persistent device buffer the host writes whole arrays into (through its own
    :class:`StagedCopy`), copied only when what it should hold changed.

    :meth:`write` returns the buffer's first rows holding the array. The buffer is made on
    the first write (at least ``min_rows`` rows: the most a step usually has), and made again
    only when a write has more rows (twice as many as before, so that a growing step allocates
    seldom), other columns, or another device; a new buffer is always written. What the
    buffer holds is the writer's own array (callers hand over one they do not change)."""

    def __init__(self, dtype: torch.dtype, min_rows: int = 64):
        self.dtype = dtype
        self.min_rows = min_rows
        self.buffer: torch.Tensor | None = None
        """The device buffer (None before the first write)."""
        self._holds: np.ndarray | None = None  # what the buffer's first rows hold (None: unknown)
        self._copy: StagedCopy | None = None

    def write(self, host: np.ndarray, device: torch.device, min_rows: int = 0) -> torch.Tensor:
        """The buffer's first ``len(host)`` rows on ``device``, holding ``host`` (``[rows]`` or
        ``[rows, columns]`` of :attr:`dtype`): copied unless they hold it already.
        ``min_rows``: rows to make room for when the buffer is made (beside ``min_rows`` of
        the constructor)."""
        n = len(host)
        buf = self.buffer
        if buf is None or buf.device != device or buf.shape[0] < n \
                or buf.shape[1:] != host.shape[1:]:
            same = buf is not None and buf.device == device and buf.shape[1:] == host.shape[1:]
            rows = max(n, self.min_rows, min_rows, 2 * buf.shape[0] if same else 0)
            self._holds = None
            self.buffer = buf = torch.zeros((rows, *host.shape[1:]), dtype=self.dtype,
                                            device=device)
        if self._copy is None or self._copy.device != buf.device:
            self._copy = StagedCopy(buf.device)
        last = self._holds
        if last is None or last.shape != host.shape or not np.array_equal(last, host):
            self._holds = None  # a copy that fails leaves the rows unknown: the next one writes
            self._copy.copy_(buf[:n], host)
            self._holds = host
        return buf[:n]


#: The most coefficient copies one :class:`StagedCopy` keeps in flight before it waits.
MAX_STAGING_BUFFERS = 64

