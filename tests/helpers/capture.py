"""What a CUDA graph capture would record of an op, on any device: a dispatch mode that lists
every op with its output shapes and refuses any op that hands a device value to the host, and
a graph backend for the CPU built on it (:class:`StandIn`)."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class Record(TorchDispatchMode):
    """Every op with its output shapes; an op that hands a value to the host raises (what a
    CUDA graph capture refuses, and a replay would skip)."""

    HOST = {"_local_scalar_dense", "nonzero", "equal", "is_nonzero", "masked_select",
            "unique", "_unique2", "item"}

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in self.HOST:
            raise AssertionError(f"{name} reads a device value on the host")
        out = func(*args, **(kwargs or {}))
        shapes = tuple(tuple(o.shape) for o in (out if isinstance(out, (tuple, list)) else [out])
                       if isinstance(o, torch.Tensor))
        self.ops.append((name, shapes))
        return out


class StandIn:
    """A graph backend for the CPU: ``capture`` runs the function once under :class:`Record`
    and keeps it with its op sequence; ``replay`` runs it again and fails unless it launches
    the same ops with the same shapes (what a real graph would replay)."""

    def __init__(self):
        self.captured, self.replayed, self.resets = [], 0, 0

    def capture(self, fn):
        with Record() as rec:
            fn()
        self.captured.append((fn, rec.ops))
        return len(self.captured) - 1

    def replay(self, graph):
        fn, recorded = self.captured[graph]
        with Record() as rec:
            fn()
        assert rec.ops == recorded, "a replay launched other ops than its capture"
        self.replayed += 1

    def reset(self):
        self.resets += 1
