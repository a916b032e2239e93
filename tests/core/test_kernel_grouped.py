"""The grouped capture-safe steer op (``vllm_steer/kernels/triton/grouped.py``), in Triton's
interpreter on the CPU (CUDA with ``VLLM_STEER_TEST_DEVICE=cuda``): the formula against the
reference in fp32, fp16 and bf16 in each regime (one steer over every row, many distinct steers
with one row each, several steers per row), unsteered and padding rows bit for bit, batch
invariance, and what a CUDA graph would record (the same launches and grids whatever the
values, nothing read back to the host)."""

from __future__ import annotations

import os

import pytest
import torch
from helpers.capture import Record

from vllm_steer.reference import steer_reference

triton = pytest.importorskip("triton")
DEVICE = torch.device(os.environ.get("VLLM_STEER_TEST_DEVICE", "cpu"))
if DEVICE.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("the Triton kernels run on the CPU only with TRITON_INTERPRET=1",
                allow_module_level=True)
if DEVICE.type == "cuda" and not torch.cuda.is_available():
    pytest.skip(f"VLLM_STEER_TEST_DEVICE={DEVICE} but CUDA is not available",
                allow_module_level=True)

from vllm_steer.kernels.triton import grouped  # noqa: E402
from vllm_steer.kernels.triton import grouped_jit  # noqa: E402

# dtype -> (rtol, atol as a fraction of the largest |delta|): fp32 summation order; 16-bit:
# the inputs are exact in both computations (fp32 sums), the output is rounded once (one ulp:
# 2^-11 fp16, 2^-8 bf16 relative, of values up to a few times the delta).
TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (2 ** -9, 2 ** -8),
       torch.bfloat16: (2 ** -6, 2 ** -5)}


def bank(d, ranks, rank, dtype, seed=0):
    """Random factors of ``ranks`` (0: an empty slot) in the fixed layout (slot c at columns
    ``[c * rank, c * rank + ranks[c])``, zeros after), built here by hand, and the same
    steers concatenated with their offsets: the reference's bank."""
    g = torch.Generator().manual_seed(seed)
    f1 = [torch.randn(d, r, generator=g) / d ** 0.5 for r in ranks]
    f2 = [torch.randn(d, r, generator=g) / max(r, 1) ** 0.5 for r in ranks]
    q1 = torch.zeros(d, len(ranks) * rank)
    q2 = torch.zeros_like(q1)
    offs = [0]
    for k, (a, b) in enumerate(zip(f1, f2, strict=True)):
        q1[:, k * rank:k * rank + a.shape[1]] = a
        q2[:, k * rank:k * rank + b.shape[1]] = b
        offs.append(offs[-1] + a.shape[1])
    p1, p2 = torch.cat(f1, 1).to(dtype), torch.cat(f2, 1).to(dtype)
    return q1.to(dtype), q2.to(dtype), p1, p2, offs


def expected(h, p1, p2, offs, table, index):
    rows = torch.stack([table[i] if i >= 0 else torch.zeros(table.shape[1])
                        for i in index.tolist()])
    return steer_reference(h, p1, p2, offs, rows)


def run(h, q1, q2, rank, table, index, **kw):
    dev = lambda t: None if t is None else t.to(DEVICE)  # noqa: E731
    return grouped.steer_grouped(dev(h), dev(q1), dev(q2), rank, dev(table), dev(index),
                                 **kw).cpu()


def check(out, ref, h, dtype):
    rtol, atol = TOL[dtype]
    scale = (ref.float() - h.float()).abs().max().item()
    torch.testing.assert_close(out.float(), ref.float(), rtol=rtol, atol=atol * scale + 1e-30)


def pattern(kind, rows, C, g):
    """A coefficient table ``[rows, C]`` in one regime, and its index (row i: table row i)."""
    table = torch.zeros(rows, C)
    if kind == "one":  # one steer over every row
        table[:, 1] = torch.randn(rows, generator=g)
    elif kind == "distinct":  # a steer per row, each row another one
        for r in range(rows):
            table[r, r % C] = 1.0 + torch.rand((), generator=g)
    else:  # several steers per row, some rows none
        mask = torch.rand(rows, C, generator=g) < 0.5
        table = torch.randn(rows, C, generator=g) * mask
        table[::4] = 0.0
    return table, torch.arange(rows)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("kind", ["one", "distinct", "mix"])
def test_each_regime_computes_the_reference_in_each_dtype(dtype, kind):
    d, rank, ranks, rows = 96, 16, [16, 5, 0, 16, 9, 16], 19
    q1, q2, p1, p2, offs = bank(d, ranks, rank, dtype, seed=3)
    g = torch.Generator().manual_seed(len(kind))
    table, index = pattern(kind, rows, len(ranks), g)
    h = (torch.randn(rows, d, generator=g) * 2).to(dtype)
    out = run(h, q1, q2, rank, table, index)
    ref = expected(h, p1, p2, offs, table, index)
    check(out, ref, h, dtype)
    untouched = (table[index] == 0).all(dim=1)
    assert torch.equal(out[untouched], h[untouched])  # bit for bit
    if kind != "mix":
        assert not untouched.all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_gathered_table_with_padding_rows_and_an_odd_width(dtype):
    d, rank, ranks, rows = 37, 8, [8, 3, 0, 5], 11  # hidden 37: every tile masked
    q1, q2, p1, p2, offs = bank(d, ranks, rank, dtype, seed=5)
    g = torch.Generator().manual_seed(1)
    table = torch.randn(rows + 3, len(ranks), generator=g) * 2
    table[1] = 0.0  # an unsteered request
    index = torch.randint(0, rows + 3, (rows,), generator=g, dtype=torch.int32)
    index[-1], index[1] = -1, 1  # a padding row, an unsteered row
    h = (torch.randn(rows, d, generator=g) * 3).to(dtype)
    out = run(h, q1, q2, rank, table, index)
    check(out, expected(h, p1, p2, offs, table, index), h, dtype)
    assert torch.equal(out[-1], h[-1]) and torch.equal(out[1], h[1])


def test_fp32_activations_on_bf16_factors():
    d, rank, ranks, rows = 64, 16, [16, 16, 7], 9
    q1, q2, p1, p2, offs = bank(d, ranks, rank, torch.bfloat16, seed=7)
    g = torch.Generator().manual_seed(2)
    table, index = pattern("mix", rows, len(ranks), g)
    h = torch.randn(rows, d, generator=g)
    out = run(h, q1, q2, rank, table, index)
    assert out.dtype == torch.float32
    ref = expected(h, p1.float(), p2.float(), offs, table, index)
    scale = (ref - h).abs().max().item()  # the activations split into two bf16 halves: ~2^-17
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4 * scale)


def test_every_steer_of_a_row_up_to_its_bound_is_applied():
    """``max_per_row`` = the most non-zero columns any row has: all of them count."""
    d, rank, ranks, rows = 48, 16, [16] * 8, 5
    q1, q2, p1, p2, offs = bank(d, ranks, rank, torch.float32, seed=9)
    g = torch.Generator().manual_seed(4)
    table = torch.randn(rows, len(ranks), generator=g)  # every column of every row
    h = torch.randn(rows, d, generator=g)
    out = run(h, q1, q2, rank, table, None, max_per_row=len(ranks))
    check(out, expected(h, p1, p2, offs, table, torch.arange(rows)), h, torch.float32)


def test_a_row_comes_out_the_same_whatever_its_batch():
    """Batch invariance by construction: the tiles never depend on the row count."""
    d, rank, ranks = 64, 16, [16, 16, 9, 0]
    q1, q2, *_ = bank(d, ranks, rank, torch.bfloat16, seed=11)
    g = torch.Generator().manual_seed(6)
    table, _ = pattern("mix", 40, len(ranks), g)
    table[0] = torch.tensor([1.5, -0.5, 2.0, 0.0])
    h = torch.randn(40, d, generator=g).to(torch.bfloat16)
    alone = run(h[:1], q1, q2, rank, table, torch.tensor([0]))
    for n in (2, 17, 40):
        idx = torch.arange(n)
        assert torch.equal(run(h[:n], q1, q2, rank, table, idx)[:1], alone)


class Launches:
    """Stand-ins for the four kernels that record each launch (grid, and every argument but
    the tensors) and then launch the real kernel."""

    def __init__(self, monkeypatch):
        self.log = []
        for name in ("_grouped_rows_kernel", "_grouped_segments_kernel",
                     "_grouped_shrink_kernel", "_grouped_expand_kernel"):
            monkeypatch.setattr(grouped_jit, name, self._wrap(name, getattr(grouped_jit, name)))

    def _wrap(self, name, kernel):
        log = self.log

        class Proxy:
            def __getitem__(self, grid):
                def launch(*args, **kw):
                    scalars = [a if not isinstance(a, torch.Tensor) else
                               ("tensor", a.data_ptr(), tuple(a.shape), a.dtype) for a in args]
                    log.append((name, tuple(grid), tuple(scalars), tuple(sorted(kw.items()))))
                    return kernel[grid](*args, **kw)
                return launch

        proxy = Proxy()
        proxy.fn = getattr(kernel, "fn", kernel)
        return proxy


def test_what_a_graph_records_is_the_same_for_any_values_and_reads_nothing_back(monkeypatch):
    """A CUDA graph replays the launches of its capture on the buffers of its capture: the op
    must launch the same kernels with the same grids and arguments whatever the coefficients
    and the index hold, read no device value on the host, and write its output in place."""
    monkeypatch.setattr(grouped, "_interpreting", lambda: DEVICE.type == "cpu")
    launches = Launches(monkeypatch)
    d, rank, ranks, rows = 64, 16, [16, 16, 9, 0, 4], 13
    q1, q2, p1, p2, offs = bank(d, ranks, rank, torch.float32, seed=13)
    q1, q2 = q1.to(DEVICE), q2.to(DEVICE)
    C = len(ranks)
    table = torch.zeros(rows + 2, C, device=DEVICE)
    index = torch.zeros(rows, dtype=torch.int64, device=DEVICE)
    h = torch.randn(rows, d, device=DEVICE)
    out = torch.empty_like(h)
    scratch = grouped.grouped_scratch(rows, C, 4, rank, d, DEVICE)
    g = torch.Generator().manual_seed(8)
    seen = []
    for case in range(4):  # nothing steered; one steer everywhere; distinct; a mix with padding
        if case == 1:
            table[:, 2] = 1.5
        elif case == 2:
            table.zero_()
            for r in range(rows + 2):
                table[r, r % C] = 0.5 + r / 10
        elif case == 3:
            table.copy_(torch.randn(rows + 2, C, generator=g)
                        * (torch.rand(rows + 2, C, generator=g) < 0.6))
            table[:, 0] = 0.0  # at most 4 steers a row: the scratch's bound
        index.copy_(torch.randint(-1, rows + 2, (rows,), generator=g))
        launches.log.clear()
        with Record():  # raises on any read of a device value by the host
            got = grouped.steer_grouped(h, q1, q2, rank, table, index, out=out,
                                        scratch=scratch)
        assert got is out
        seen.append(list(launches.log))
        ref = expected(h.cpu(), p1, p2, offs, table.cpu(), index.cpu())
        check(out.cpu(), ref, h.cpu(), torch.float32)
    assert len(seen[0]) == 4 and all(s == seen[0] for s in seen)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_with_widths_a_narrower_steers_padding_is_never_read(dtype):
    """``widths`` (the bank's per-column steer ranks): the columns past a steer's rank are
    never loaded. Here they hold NaN, which any read would spread into the rows."""
    d, rank, ranks, rows = 64, 16, [16, 5, 0, 9], 12
    q1, q2, p1, p2, offs = bank(d, ranks, rank, dtype, seed=17)
    for q in (q1, q2):
        for k, r in enumerate(ranks):
            q[:, k * rank + r:(k + 1) * rank] = float("nan")
    g = torch.Generator().manual_seed(9)
    table, index = pattern("mix", rows, len(ranks), g)
    table[:, 2] = 0.0  # the empty slot is used by no row
    h = (torch.randn(rows, d, generator=g) * 2).to(dtype)
    widths = torch.tensor(ranks, dtype=torch.int32).to(DEVICE)
    out = run(h, q1, q2, rank, table, index, widths=widths)
    assert not out.isnan().any()
    check(out, expected(h, p1, p2, offs, table, index), h, dtype)
    assert run(h, q1, q2, rank, table, index).isnan().any()  # without them, the padding is read


def test_a_scratch_made_for_a_lower_rank_or_another_hidden_size_is_refused():
    """The scratch's down-projection buffer is ``rank`` wide: one made for a lower rank (a
    bank that grew) would be written past its end; refused before any launch."""
    d, rank, rows, C = 64, 32, 5, 3
    p = torch.zeros(d, C * rank, device=DEVICE)
    table = torch.zeros(rows, C, device=DEVICE)
    h = torch.randn(rows, d, device=DEVICE)
    for bad in (grouped.grouped_scratch(rows, C, 2, 8, d, DEVICE),  # rank 8 (buffer 16 wide)
                grouped.grouped_scratch(rows, C, 2, rank, 4096, DEVICE)):  # split 4 ways
        with pytest.raises(AssertionError, match="another hidden size or a lower rank"):
            grouped.steer_grouped(h, p, p, rank, table, None, scratch=bad)
    good = grouped.grouped_scratch(rows, C, 2, rank, d, DEVICE)
    assert torch.equal(grouped.steer_grouped(h, p, p, rank, table, None, scratch=good), h)
