"""Timing on a CUDA device for the op benchmarks (``bench_grouped_vs_lora.py``,
``bench_layer_vectors.py``): one call replayed from a CUDA graph with L2 flushed before each
replay, and the device's copy bandwidth (the rooflines' denominator)."""

from __future__ import annotations

import statistics

import torch


def time_graph(call, flush: torch.Tensor, reps: int) -> float:
    """Median microseconds of one replay of ``call`` recorded in a CUDA graph, L2 flushed
    (``flush``, a buffer larger than L2, zeroed) before each."""
    call()  # compile and warm, outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        call()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        flush.zero_()
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def copy_bandwidth(device) -> float:
    """Bytes per second of a device-to-device copy of 1 GiB (read + written)."""
    a = torch.empty(1 << 29, dtype=torch.float16, device=device)
    b = torch.empty_like(a)
    b.copy_(a)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        b.copy_(a)
    end.record()
    end.synchronize()
    return 10 * 2 * a.numel() * 2 / (start.elapsed_time(end) / 1e3)
