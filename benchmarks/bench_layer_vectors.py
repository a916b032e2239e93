#!/usr/bin/env python
"""The decoder layers' vector-steer op alone on the device, per layer and for a model's
layers, against the roofline.

The op (:func:`vllm_steer.kernels.layer_vectors.add_vectors`, imported, not copied) adds
``token_coefs[:n] @ vectors`` to a block's output: ``token_coefs`` is the step mapping's
persistent ``[max tokens, bank slots]`` fp32 buffer, ``vectors`` one block's ``[bank slots,
hidden]`` fp32 rows. Shapes (the defaults): hidden 4096, bf16 hidden states, a bank of 256
slots (every slot holding a vector), 256 and 64 rows (decode) and 8192 tokens (a prefill
chunk); row r steered by vector r % K of K = 1, 8, 64, 256 distinct vectors (min(K, rows) in
use), at a strength of 0.5 or 2. Timed per call:

- **1 layer**: one block's op;
- **32 layers** (``--layers``): the op of every block in turn, each block with its own vectors,
  the hidden states passed on (as the model's forward calls it).

Each is recorded in a CUDA graph and replayed (one call per replay, L2 flushed before each by
a 256 MiB write), timed with CUDA events; the median is printed. Two forms: ``eager`` (the op's
torch calls as written) and ``compiled`` (``torch.compile``, dynamic in the tokens, as vLLM's
compiled forward traces it; ``--no-compile`` skips it).

**Roofline**: (bytes of the used vectors, fp32, + the activations read and written, bf16) /
the device-to-device copy bandwidth measured here (each byte read and written, so copy
bandwidth is the figure), plus 10 us, per call (the 32 layers' call: 32 layers' bytes, one
10 us). The column ``read MiB`` is what the op actually reads: its matmul is dense over the
bank, so every slot's vector is read whatever K is, and the coefficient rows too. And its
matmul is fp32, ``2 * tokens * slots * hidden`` flops a layer (``GFLOP``; ``TFLOP/s``: what
the op achieved): at 256 rows and 256 slots that is 0.5 GFLOP a layer, so the op may be
bound by the device's fp32 rate rather than by its bandwidth.

Each line also checks the op against a reference that gathers each row's vector (fp32 torch,
no matmul), so a fast wrong op fails.

    python benchmarks/bench_layer_vectors.py --device cuda
    .venv/bin/python benchmarks/bench_layer_vectors.py --device cpu     # tiny shapes, no timing

On the CPU: tiny shapes (hidden 64, 8 slots, 2 layers, 16 and 5 rows, K = 1 and 8), fp32 and
bf16, correctness only. Exits 1 if a result is wrong. With ``OUT`` set, the lines are written
to ``OUT/layer_vectors.txt``.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from cuda_timing import copy_bandwidth, time_graph  # noqa: E402
from vllm_steer.integrations.worker.step_mapping import op_dtype  # noqa: E402
from vllm_steer.kernels.layer_vectors import add_vectors  # noqa: E402

FLOOR_US = 10.0  # the roofline's fixed cost of one call (a launch, a graph node's start)


def make_bank(d: int, slots: int, layers: int, device, seed: int = 0) -> torch.Tensor:
    """``[layers, slots, d]`` fp32: every slot of every layer holds a random vector."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(layers, slots, d, generator=g) * 0.1).to(device)


def make_case(bank: torch.Tensor, k: int, rows: int, dtype, seed: int = 0) -> dict:
    """Row r steered by vector ``which[r % used]`` (``used = min(k, rows)`` distinct slots of
    the bank) at 0.5 or 2 (powers of two: the reference's products are exact); the
    coefficient rows as the step mapping writes them (``[rows, slots]``, zero elsewhere) and
    random bf16 (or ``dtype``) hidden states."""
    g = torch.Generator().manual_seed(seed)
    _, slots, d = bank.shape
    used = min(k, rows)
    which = torch.randperm(slots, generator=g)[:used]
    slot_of_row = which[torch.arange(rows) % used]
    coef = 2.0 ** (2 * torch.randint(0, 2, (rows,), generator=g) - 1).float()
    coefs = torch.zeros(rows, slots)
    coefs[torch.arange(rows), slot_of_row] = coef
    h = torch.randn(rows, d, generator=g).to(dtype)
    dev = bank.device
    return dict(coefs=coefs.to(dev), h=h.to(dev), slot_of_row=slot_of_row.to(dev),
                coef=coef.to(dev), used=used)


def reference(h: torch.Tensor, bank: torch.Tensor, slot_of_row: torch.Tensor,
              coef: torch.Tensor) -> torch.Tensor:
    """The rows after every layer of ``bank`` (fp32 torch on ``h``'s device, no matmul): each
    layer adds the row's own vector, gathered by slot, times its strength; rounded to ``h``'s
    dtype after each layer, as the model's blocks hand it on."""
    out = h
    for layer in bank:
        out = (out.float() + coef[:, None] * layer[slot_of_row]).to(h.dtype)
    return out


def layers_op(x: torch.Tensor, coefs: torch.Tensor, bank: torch.Tensor) -> torch.Tensor:
    """The op of each of ``bank``'s layers in turn, the rows handed on (a model's forward)."""
    for k in range(bank.shape[0]):
        x = add_vectors(x, coefs, bank[k])
    return x


_COMPILED = []


def compiled_layers_op():
    """:func:`layers_op` under ``torch.compile``, dynamic in the tokens (made once)."""
    if not _COMPILED:
        _COMPILED.append(torch.compile(layers_op, dynamic=True))
    return _COMPILED[0]


def op_fn(h: torch.Tensor, coefs: torch.Tensor, bank: torch.Tensor, compiled: bool):
    """The op over ``bank``'s layers in turn; returns a call (graph-safe: in place into a
    persistent output) and that output."""
    out = torch.empty_like(h)
    fn = compiled_layers_op() if compiled else layers_op

    def call():
        out.copy_(fn(h, coefs, bank))
    return call, out


def roofline_bytes(used: int, rows: int, d: int, layers: int, itemsize: int) -> int:
    """The bytes the op cannot avoid: the used vectors (fp32) and the rows read and written,
    per layer."""
    return layers * (used * d * 4 + 2 * rows * d * itemsize)


def read_bytes(slots: int, rows: int, d: int, layers: int, itemsize: int,
               op_itemsize: int = 4) -> int:
    """The bytes the dense op reads and writes: every slot's vector and the coefficient rows
    (in the op's dtype), and the rows, per layer."""
    return layers * (slots * d * op_itemsize + rows * slots * op_itemsize
                     + 2 * rows * d * itemsize)


def dense_flops(rows: int, slots: int, d: int, layers: int) -> int:
    """The dense op's matmul: ``[rows, slots] @ [slots, d]`` per layer, 2 flops a product."""
    return layers * 2 * rows * slots * d


def check(name: str, got: torch.Tensor, ref: torch.Tensor, h: torch.Tensor) -> str | None:
    """None when ``got`` is the reference within a rounding per layer of the output's dtype."""
    err = (got.cpu().float() - ref.float()).abs().max().item()
    eps = torch.finfo(h.dtype).eps
    lim = 2 * eps * max(ref.float().abs().max().item(), 1.0)
    changed = (ref.float() - h.cpu().float()).abs().max().item()
    if err > lim:
        return f"{name}: max error {err:.3g} over {lim:.3g}"
    if changed <= lim:  # a case in which the op could do nothing and pass
        return f"{name}: the vectors change the rows by {changed:.3g}, under the tolerance"
    return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--d", type=int, default=4096)
    ap.add_argument("--slots", type=int, default=256, help="the bank's slots")
    ap.add_argument("--layers", type=int, default=32, help="the model's decoder blocks")
    ap.add_argument("--K", type=int, nargs="+", default=[1, 8, 64, 256])
    ap.add_argument("--rows", type=int, nargs="+", default=[256, 64, 8192],
                    help="tokens of the step (decode rows; 8192: a prefill chunk)")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--no-compile", action="store_true", help="time the eager form only")
    a = ap.parse_args(argv)
    device = torch.device(a.device)
    cuda = device.type == "cuda"
    if not cuda:
        a.d, a.slots, a.layers, a.K, a.rows = 64, 8, 2, [1, 8], [16, 5]
    dtypes = [torch.bfloat16] if cuda else [torch.float32, torch.bfloat16]
    forms = ["eager"] + ([] if a.no_compile or not cuda else ["compiled"])
    lines, failures = [], []
    say = lambda s: (print(s, flush=True), lines.append(s))  # noqa: E731
    bw = copy_bandwidth(device) if cuda else None
    say(f"# vector-steer op (vllm_steer.kernels.layer_vectors.add_vectors); d {a.d}, "
        f"{a.slots} bank slots, vectors in the op's dtype (the rows' on CUDA), "
        f"{', '.join(str(t)[6:] for t in dtypes)} rows, "
        f"{device}" + (f"; copy bandwidth {bw / 1e12:.2f} TB/s; roofline = used vectors + "
                       f"rows read and written, over it, + {FLOOR_US:g} us"
                       if bw else " (no timing)"))
    if cuda:
        flush = torch.empty(256 << 20, dtype=torch.uint8, device=device)
        say(f"{'rows':>5} {'K':>4} {'used':>4} {'layers':>6} {'form':>8} {'roof MiB':>8} "
            f"{'read MiB':>8} {'GFLOP':>7} {'roof us':>8} {'op us':>8} {'op/roof':>7} "
            f"{'TFLOP/s':>7}")
    bank = make_bank(a.d, a.slots, a.layers, device)
    for dtype in dtypes:
        for rows in a.rows:
            for k in a.K:
                c = make_case(bank, k, rows, dtype, seed=rows * 1000 + k)
                # the op's dtype as served (the step mapping's op_dtype): the rows' 16-bit
                # dtype on CUDA, float32 elsewhere
                odt = op_dtype(device, dtype)
                for layers in (1, a.layers):
                    sub = bank[:layers]
                    ref = reference(c["h"], sub.to(odt).float(), c["slot_of_row"], c["coef"])
                    for form in forms:
                        call, out = op_fn(c["h"], c["coefs"].to(odt), sub.to(odt),
                                          form == "compiled")
                        call()
                        name = f"rows {rows} K {k} {layers} layer(s) {form} {str(dtype)[6:]}"
                        problem = check(name, out, ref, c["h"])
                        if problem:
                            failures.append(problem)
                        if not cuda:
                            if not problem:
                                say(f"{name}: matches the reference")
                            continue
                        roof_b = roofline_bytes(c["used"], rows, a.d, layers, dtype.itemsize)
                        read_b = read_bytes(a.slots, rows, a.d, layers, dtype.itemsize,
                                            odt.itemsize)
                        flops = dense_flops(rows, a.slots, a.d, layers)
                        roof = roof_b / bw * 1e6 + FLOOR_US
                        t = time_graph(call, flush, a.reps)
                        say(f"{rows:5} {k:4} {c['used']:4} {layers:6} {form:>8} "
                            f"{roof_b / 2**20:8.2f} {read_b / 2**20:8.2f} {flops / 1e9:7.2f} "
                            f"{roof:8.1f} {t:8.1f} {t / roof:7.2f} {flops / t / 1e6:7.1f}")
    for f in failures:
        say(f"FAILED {f}")
    out = os.environ.get("OUT")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        Path(out, "layer_vectors.txt").write_text("\n".join(lines) + "\n")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
