"""What a CUDA graph capture would record of an op, on any device: a dispatch mode that lists
every op with its output shapes and refuses any op that hands a device value to the host."""

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
