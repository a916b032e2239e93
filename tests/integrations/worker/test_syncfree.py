"""The per-step path plans from host data only and applies generation windows per generated
token (the worker's side).

CPU: a ``TorchDispatchMode`` marks the runtime's device-side tensors (the slot table
``slot_coefs`` and the per-step coefficient buffer) and everything computed from them, and
records every read of a marked tensor into Python (``item``/``_local_scalar_dense``,
``nonzero``, ``is_nonzero``, ``equal``, ``tolist``, ``numpy``): on CUDA each is a device-to-host
sync. Steps of the batch, mapping and slots row sources, with steering changes between them,
must record none. CUDA (skipped without one): the same steps under
``torch.cuda.set_sync_debug_mode("error")``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from helpers.rows import sampled_rows
from helpers.steers import random_steer
from vllm_steer.config import SteerServerConfig
from vllm_steer.request import Window
from vllm_steer.format import make_steer, save_steer
from vllm_steer.integrations.worker.rows import BatchRows, MappedRows, SlotRows
from vllm_steer.integrations.worker.runtime import SteerRuntime
from vllm_steer.reference import steer_coefficients, steer_reference

HIDDEN = 64
READS = {"aten._local_scalar_dense", "aten.nonzero", "aten.is_nonzero", "aten.item",
         "aten.equal", "aten.masked_select", "aten.unique"}


def _ptr(t: torch.Tensor) -> int:
    try:
        return t.untyped_storage().data_ptr()
    except Exception:  # noqa: BLE001 - tensors without storage
        return 0


class DeviceReads(TorchDispatchMode):
    """Records reads into Python of the runtime's device-side tensors (and of tensors
    computed from them): what would be a device-to-host sync on CUDA."""

    def __init__(self, rt: SteerRuntime):
        super().__init__()
        self.rt = rt
        self.marked: set[int] = set()
        self.reads: list[str] = []
        self.paused = False

    def is_marked(self, t) -> bool:
        if not isinstance(t, torch.Tensor):
            return False
        p = _ptr(t)
        if not p:
            return False
        planner = self.rt.planner
        roots = [self.rt.slots.device_rows, planner.coef_buffer, planner.row_index,
                 planner._shard_index.buffer, planner._shard_coefs.buffer]  # noqa: SLF001
        return p in self.marked or any(r is not None and p == _ptr(r) for r in roots)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        hit = not self.paused and any(self.is_marked(a) for a in tree_leaves((args, kwargs)))
        name = str(func.overloadpacket)
        if hit and name in READS:
            self.reads.append(name)
        out = func(*args, **kwargs)
        if hit:
            for o in tree_leaves(out):
                if isinstance(o, torch.Tensor) and _ptr(o):
                    self.marked.add(_ptr(o))
            for i, arg in enumerate(func._schema.arguments):  # written in place / out=
                if arg.alias_info is not None and arg.alias_info.is_write:
                    a = args[i] if i < len(args) else kwargs.get(arg.name)
                    if isinstance(a, torch.Tensor) and _ptr(a):
                        self.marked.add(_ptr(a))
        return out

    def __enter__(self):
        orig = {"tolist": torch.Tensor.tolist, "numpy": torch.Tensor.numpy}
        mode = self

        def watch(name):
            def method(t, *a, **k):
                if not mode.paused and mode.is_marked(t):
                    mode.reads.append(f"Tensor.{name}")
                return orig[name](t, *a, **k)
            return method

        self._orig = orig
        for name in orig:
            setattr(torch.Tensor, name, watch(name))
        return super().__enter__()

    def __exit__(self, *exc):
        for name, fn in self._orig.items():
            setattr(torch.Tensor, name, fn)
        return super().__exit__(*exc)


def _runtime(tmp_path, backend: str = "torch", domain: bool = False) -> SteerRuntime:
    steers = {}
    for name, seed in (("a", 1), ("b", 2), ("c", 3)):
        steers[name] = str(tmp_path / f"{name}.safetensors")
        s = random_steer(HIDDEN, 4, name, seed=seed, scale=3.0)
        if domain and name == "a":
            g = torch.Generator().manual_seed(9)
            s = make_steer(s.p1, s.p2, name, labels={"positive": name}, domain="with_steer",
                           domain_p1=torch.randn(HIDDEN, 4, generator=g),
                           domain_p2=torch.randn(HIDDEN, 4, generator=g))
        save_steer(steers[name], s)
    rt = SteerRuntime(SteerServerConfig(steers=steers, backend=backend))
    rt.bank_state.load(HIDDEN, torch.device("cpu"), torch.float32)
    rt.ensure_slots(8, torch.device("cpu"))
    return rt


def _row(rt, **strengths) -> np.ndarray:
    """A request's coefficient row by the reference rule (``steer_coefficients``)."""
    row = np.zeros(rt.slots.num_columns, dtype=np.float32)
    for name, s in strengths.items():
        j = rt.bank_state.names.index(name)
        meta = rt.bank_state.bank.steers[j].metadata
        served = rt.bank_state.bank.steers[j].domain_p1 is not None and meta.domain == "with_steer"
        row[j], row[rt.bank_state.capacity + j] = steer_coefficients(
            s, meta.epsilon, meta.domain_strength if served else None)
    return row


def _want(rt, h, rows):
    coefs = torch.tensor(np.stack(rows), dtype=torch.float32)
    return steer_reference(h, *rt.bank_state.bank.factors, coefs)


def _steps(rt, source: str, mode: DeviceReads, gen, device=None, dtype=torch.float32):
    """Decode steps with steering changes between them; yields (out, hidden, rows wanted)."""
    a, b, c = _row(rt, a=4), _row(rt, b=-3, c=2), _row(rt, c=5)
    none = np.zeros(rt.slots.num_columns, dtype=np.float32)
    state = {0: a, 1: none, 2: b, 3: none}
    for slot, row in state.items():
        rt.set_slot(slot, row)
    rt.slots.flush()
    order = np.array([2, 0, 3, 1])  # the step's row -> slot (mapping and slots sources)
    for step in range(6):
        if step == 2:  # a request leaves and another takes its slot
            state[0] = c
            rt.set_slot(0, c)
            rt.slots.flush()
        if step == 4:  # slots move (V1 condense) / the batch order changes (V2)
            state[1], state[2] = state[2], state[1]
            rt.slots.move(1, 2, swap=True)
            rt.slots.flush()
            order = np.array([1, 3, 0, 2])
        h = torch.randn(4, HIDDEN, generator=gen).to(dtype)
        if device is not None:  # on the GPU, from pinned memory (a pageable copy syncs)
            h = h.pin_memory().to(device, non_blocking=True)
        if source == "batch":
            rt.step.batch_size = 4
            slots = np.arange(4)
            src = BatchRows()
        elif source == "mapping":
            slots = order
            src = MappedRows(mapping=torch.from_numpy(order.astype(np.int32)),
                            slots=order.copy())
        elif source == "sharded":  # batch-sharded sampling: the order is the sharder's
            slots = order[SHARDER_ORDER]
            src = _sharded_rows(rt, order, None, SHARDER_ORDER, mode, device)
        else:
            slots = order
            src = SlotRows(slots=order.copy())
        with sampled_rows(rt.planner, src), mode:
            out = rt.planner.steer_rows(h)
        yield out, h, [state[int(s)] for s in slots]


#: The row order of a batch-sharded step (the sharder's, on the device): rows of these tokens
SHARDER_ORDER = np.array([1, 3, 0, 2])


def _sharded_rows(rt, slots, positions, order, mode, device=None) -> MappedRows:
    """A batch-sharded step's sampled rows as V2's adapter makes them: requests of one token
    each (``slots``, ``positions``: batch order), each token's table row written from the host
    (:meth:`StepPlanner.sharded_index`), then picked on the device by the sharder's token
    indices ``order`` (the logits rows are those tokens' hidden states)."""
    tokens = np.arange(len(slots))
    with mode:
        index, table = rt.planner.sharded_index(slots.copy(), tokens, slots.copy(), positions)
        sorted_idx = torch.from_numpy(order.astype(np.int64))
        if device is not None:
            sorted_idx = sorted_idx.pin_memory().to(device, non_blocking=True)
        return MappedRows(mapping=index.index_select(0, sorted_idx), table=table)


def _pause_kernel_launches(monkeypatch, mode):
    """The Triton interpreter runs kernels on the host, reading their arguments: a launch is
    no read on CUDA, so launches of the two GEMM kernels are not watched (planning is). The
    interpreter of Triton 3.9 reads them outside torch's dispatch, so there the pause changes
    nothing; it keeps the check true for an interpreter that reads through torch."""
    from vllm_steer.kernels.triton import jit, launch

    # _interpreting looks at the kernels' type: fixed before they are wrapped
    interpreting = launch._interpreting()
    monkeypatch.setattr(launch, "_interpreting", lambda: interpreting)
    for name in ("_steer_shrink_kernel", "_steer_expand_kernel"):
        kernel = getattr(jit, name)

        class Paused:
            def __init__(self, k):
                self.k = k

            def __getitem__(self, grid):
                launch = self.k[grid]

                def run(*a, **kw):
                    mode.paused = True
                    try:
                        return launch(*a, **kw)
                    finally:
                        mode.paused = False
                return run

            def __getattr__(self, item):
                return getattr(self.k, item)

        monkeypatch.setattr(jit, name, Paused(kernel))  # launch looks them up in jit


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("source", ["batch", "mapping", "slots", "sharded"])
def test_steps_read_no_device_tensor(tmp_path, monkeypatch, backend, source):
    if backend == "triton":
        from vllm_steer.kernels import HAS_TRITON

        if not HAS_TRITON:
            pytest.skip("no triton")
    rt = _runtime(tmp_path, backend)
    assert rt.bank_state.backend == backend
    mode = DeviceReads(rt)
    if backend == "triton":
        _pause_kernel_launches(monkeypatch, mode)
    gen = torch.Generator().manual_seed(0)
    for out, h, rows in _steps(rt, source, mode, gen):
        torch.testing.assert_close(out, _want(rt, h, rows), atol=1e-4, rtol=1e-4)
        for i, r in enumerate(rows):
            if not r.any():
                assert torch.equal(out[i], h[i])  # unsteered rows: bit for bit
    assert rt.planner.stats.calls == 6
    assert mode.reads == [], f"device tensors read into Python: {sorted(set(mode.reads))}"


def test_the_guard_sees_a_device_read(tmp_path):
    """The check itself: planning from the device tensor (what the runtime used to do) is
    recorded."""
    from vllm_steer.kernels.torch_steer import prepare_torch

    rt = _runtime(tmp_path)
    rt.set_slot(0, _row(rt, a=4))
    rt.slots.flush()
    mode = DeviceReads(rt)
    with mode:
        coefs = rt.slots.table.index_select(0, torch.tensor([0, 1]))
        prepare_torch(*rt.bank_state.bank.factors, coefs)
    assert mode.reads


def test_an_unchanged_step_reuses_everything(tmp_path, monkeypatch):
    """Steps of an unchanged batch: no re-plan, no coefficient copy (mapping source, which
    used to re-plan at every step)."""
    rt = _runtime(tmp_path)
    rt.set_slot(3, _row(rt, a=4))
    rt.set_slot(5, _row(rt, b=2))
    rt.slots.flush()
    calls = {"plan": 0, "copy": 0}
    prepare = rt.bank_state.prepare

    def counted(*a, **k):
        calls["plan"] += 1
        return prepare(*a, **k)

    monkeypatch.setattr(rt.bank_state, "prepare", counted)
    h = torch.randn(3, HIDDEN)
    slots = np.array([5, 3, 0])
    for _ in range(4):
        src = MappedRows(mapping=torch.from_numpy(slots), slots=slots.copy())
        with sampled_rows(rt.planner, src):
            rt.planner.steer_rows(h)
        calls["copy"] = rt.planner.coef_buffer is not None
    assert calls["plan"] == 1
    # another row order is another step: re-planned
    with sampled_rows(rt.planner, SlotRows(slots=slots[::-1].copy())):
        out = rt.planner.steer_rows(h)
    assert calls["plan"] == 2
    torch.testing.assert_close(out, _want(rt, h, [_row(rt), _row(rt, a=4), _row(rt, b=2)]))


def test_segments_from_host_equal_the_device_segments():
    from vllm_steer.kernels import HAS_TRITON

    if not HAS_TRITON:
        pytest.skip("no triton")
    from vllm_steer.kernels.triton.segments import segments, segments_host

    rng = np.random.default_rng(0)
    for n, K in ((1, 1), (7, 3), (40, 5), (3, 8), (5, 2)):
        c = torch.tensor((rng.random((n, K)) < 0.3) * rng.standard_normal((n, K)),
                         dtype=torch.float32)
        dev = segments(c)
        host = segments_host(c.numpy() != 0, torch.device("cpu"))
        assert torch.equal(dev[1], host[1]) and torch.equal(dev[2], host[2])
        for k in range(K):
            assert torch.equal(dev[0][k, :dev[1][k]], host[0][k, :host[1][k]])


# ---- generation windows (issue 24, runtime side) -------------------------------------------
def _window_row(rt, windows: dict, t: int) -> np.ndarray:
    """By hand: each steer's strength at generated token ``t`` (``Window.at``; prompt rows
    ``t = -1`` get the base), then ``steer_coefficients``."""
    row = np.zeros(rt.slots.num_columns, dtype=np.float32)
    for name, w in windows.items():
        s = w.base if t < 0 else w.at(t)
        if s:
            row += _row(rt, **{name: s})
    return row


class _Params:
    def __init__(self, steer):
        self.extra_args = {"steer": steer}


def test_windows_at_mixed_positions(tmp_path):
    """Requests at different generated-token positions in one batch, each with its own
    windows (ramp, end, a constant steer beside a window, a domain component): every row gets
    its own request's strengths at its own token, step after step, and slots keep their
    windows when moved and lose them when reused."""
    rt = _runtime(tmp_path, domain=True)
    w0 = {"a": Window(4.0, start=2, end=6, ramp=3)}  # a has a domain component
    w1 = {"b": Window(-3.0, start=0, end=3), "c": Window(2.0, base=2.0)}  # c: constant 2
    w2 = {"c": Window(5.0, start=1, ramp=4, base=1.0)}
    j = {n: rt.bank_state.names.index(n) for n in "abc"}
    for slot, w in ((0, w0), (1, w1), (3, w2)):
        rt.set_slot(slot, _row(rt, **{n: x.strength for n, x in w.items()}),
                    {j[n]: x for n, x in w.items()})
    rt.set_slot(2, _row(rt, b=1))  # constant, no window
    rt.slots.flush()
    assert rt.slots.num_window_slots == 3
    windows = {0: w0, 1: w1, 2: {"b": Window(1.0, base=1.0)}, 3: w2}
    gen = torch.Generator().manual_seed(0)
    start = np.array([0, 5, 1, 2])  # generated-token index of each slot at the first step
    for step in range(8):
        t = start + step
        h = torch.randn(4, HIDDEN, generator=gen)
        rt.step.batch_size, rt.step.batch_positions = 4, t
        out = rt.planner.steer_rows(h)
        want = [_window_row(rt, windows[s], int(t[s])) for s in range(4)]
        torch.testing.assert_close(out, _want(rt, h, want))
        # the same rows in another order, through host slots and positions (V2, spec decoding)
        order = np.array([3, 1, 0, 2, 3])
        pos = np.array([t[3], t[1], t[0], t[2], -1])  # the last row: a prompt row (base)
        h5 = torch.randn(5, HIDDEN, generator=gen)
        with sampled_rows(rt.planner, SlotRows(slots=order, positions=pos)):
            out = rt.planner.steer_rows(h5)
        want = [_window_row(rt, windows[int(s)], int(p)) for s, p in zip(order, pos, strict=True)]
        torch.testing.assert_close(out, _want(rt, h5, want))
        # and in the order of a batch-sharded step (the sharder's, known on the device only):
        # rows outside a window with base 0 come back bit for bit, and no device value is read
        mode, sharded = DeviceReads(rt), np.array([4, 1, 3, 0, 2])
        src = _sharded_rows(rt, order, pos, sharded, mode)
        with sampled_rows(rt.planner, src), mode:
            out = rt.planner.steer_rows(h5[sharded])
        want = [want[i] for i in sharded]
        torch.testing.assert_close(out, _want(rt, h5[sharded], want))
        for i, r in enumerate(want):
            if not r.any():
                assert torch.equal(out[i], h5[sharded][i])
        assert mode.reads == [], f"device tensors read into Python: {sorted(set(mode.reads))}"
    # a move carries the windows; a reused slot starts clean
    rt.slots.move(0, 2, swap=True)
    rt.set_slot(1, _row(rt, a=1))
    rt.slots.flush()
    windows = {0: {"b": Window(1.0, base=1.0)}, 1: {"a": Window(1.0, base=1.0)}, 2: w0, 3: w2}
    t = np.array([7, 0, 4, 3])
    h = torch.randn(4, HIDDEN, generator=gen)
    rt.step.batch_size, rt.step.batch_positions = 4, t
    out = rt.planner.steer_rows(h)
    want = [_window_row(rt, windows[s], int(t[s])) for s in range(4)]
    torch.testing.assert_close(out, _want(rt, h, want))
    assert rt.slots.num_window_slots == 2


def test_windows_cost_nothing_without_them_and_replan_only_on_change(tmp_path, monkeypatch):
    """A window that has reached its plateau changes no coefficient: the steps go on without
    copies or re-plans although the positions move; a ramp re-plans per changed step."""
    rt = _runtime(tmp_path)
    j = rt.bank_state.names.index("a")
    rt.set_slot(0, _row(rt, a=4), {j: Window(4.0, start=0, ramp=2)})
    rt.set_slot(1, _row(rt, b=2))
    rt.slots.flush()
    plans = []
    prepare = rt.bank_state.prepare
    monkeypatch.setattr(rt.bank_state, "prepare",
                        lambda *a, **k: plans.append(1) or prepare(*a, **k))
    h = torch.randn(2, HIDDEN)
    rt.step.batch_size = 2
    for t in range(6):
        rt.step.batch_positions = np.array([t, 10])
        rt.planner.steer_rows(h)
    assert len(plans) == 2  # t = 0 (half strength) and t = 1 (full); then unchanged


def test_request_windows_reach_the_slot(tmp_path):
    """``decode`` turns a request's bound windows into per-slot windows; steers given as
    numbers beside them stay constant."""
    from helpers.engines import bound_extra

    rt = _runtime(tmp_path)
    params = _Params(None)
    params.extra_args = bound_extra(rt.bank_state.names,
                                    {"a": {"strength": 4, "start": 1, "end": 3}, "b": 2})
    wins = rt.decode(params).windows
    ja, jb = rt.bank_state.names.index("a"), rt.bank_state.names.index("b")
    assert wins[ja].start == 1 and wins[ja].end == 3 and wins[ja].strength == 4
    assert wins[jb].at(0) == wins[jb].at(100) == wins[jb].base == 2
    params.extra_args = bound_extra(rt.bank_state.names, {"a": 3})
    assert rt.decode(params).windows is None


# ---- CUDA: the same steps under sync debug mode ---------------------------------------------
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("source", ["batch", "mapping", "sharded"])
def test_cuda_steps_do_not_sync(tmp_path, backend, source, dtype):
    """Steered decode steps on the GPU, in fp32 and bf16 (mixed steered/unsteered rows, a
    steering change and a move midway, flush included) raise on any device-to-host sync;
    results match the reference. The first step warms up (kernel compilation, allocator); every
    step after it is checked."""
    steers = {}
    for name, seed in (("a", 1), ("b", 2), ("c", 3)):
        steers[name] = str(tmp_path / f"{name}.safetensors")
        save_steer(steers[name], random_steer(HIDDEN, 16, name, seed=seed, scale=3.0))
    dev = torch.device("cuda")
    rt = SteerRuntime(SteerServerConfig(steers=steers, backend=backend))
    rt.bank_state.load(HIDDEN, dev, dtype)
    rt.ensure_slots(8, dev)
    gen = torch.Generator().manual_seed(0)

    class NoWatch:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    results = []
    steps = _steps(rt, source, NoWatch(), gen, dev, dtype)
    first = True
    while True:
        try:
            if first:
                out, h, rows = next(steps)
                first = False
            else:
                torch.cuda.set_sync_debug_mode("error")
                try:
                    out, h, rows = next(steps)
                finally:
                    torch.cuda.set_sync_debug_mode("default")
        except StopIteration:
            break
        results.append((out, h, rows))
    assert len(results) == 6
    for out, h, rows in results:
        want = steer_reference(h.cpu(), rt.bank_state.bank.p1.cpu(), rt.bank_state.bank.p2.cpu(),
                               rt.bank_state.bank.rank_offsets,
                               torch.tensor(np.stack(rows), dtype=torch.float32))
        tol = 2e-3 if dtype == torch.float32 else 3e-2  # bf16: an ulp at the rows' magnitude
        torch.testing.assert_close(out.cpu(), want, atol=tol, rtol=tol)


def test_v2_rows_and_positions_come_from_the_input_batchs_host_arrays(tmp_path):
    """V2: the step's row -> slot (``expanded_idx_mapping``) and each row's generated-token
    index, from the input batch's host arrays, one row per request and several (spec
    decoding's layout); the windowed rows are steered at their own tokens."""
    from types import SimpleNamespace

    from vllm_steer.integrations.worker.v2 import _host_rows

    rt = _runtime(tmp_path)
    j = rt.bank_state.names.index("a")
    win = Window(4.0, start=5, ramp=3)  # 0, 4/3, 8/3 at tokens 4, 5, 6
    rt.set_slot(5, _row(rt, a=4), {j: win})
    rt.set_slot(2, _row(rt, b=2))
    rt.slots.flush()
    prompt_len = np.zeros(8, dtype=np.int32)
    prompt_len[[5, 2, 0]] = [7, 3, 4]
    runner = SimpleNamespace(req_states=SimpleNamespace(prompt_len=SimpleNamespace(np=prompt_len)))
    batch = SimpleNamespace(idx_mapping_np=np.array([5, 2, 0]),
                            cu_num_logits_np=np.array([0, 1, 2, 3]),
                            num_computed_tokens_np=np.array([10, 3, 4]),
                            num_scheduled_tokens=np.array([1, 1, 1]))
    slots, pos = _host_rows(rt, runner, batch)
    assert slots.tolist() == [5, 2, 0] and pos.tolist() == [4, 1, 1]  # 10 + 1 - 7, ...
    # spec decoding's layout: request 0 verifies 2 drafts (3 rows), request 2 one (2 rows)
    batch.cu_num_logits_np = np.array([0, 3, 4, 6])
    batch.num_scheduled_tokens = np.array([3, 1, 2])
    slots, pos = _host_rows(rt, runner, batch)
    assert slots.tolist() == [5, 5, 5, 2, 0, 0]
    assert pos.tolist() == [4, 5, 6, 1, 1, 2]  # the last row of each samples 10 + 3 - 7 = 6
    h = torch.randn(6, HIDDEN)
    with sampled_rows(rt.planner, MappedRows(mapping=torch.from_numpy(slots), slots=slots,
                           positions=pos)):
        out = rt.planner.steer_rows(h)
    want = [_row(rt, a=win.at(4)), _row(rt, a=win.at(5)), _row(rt, a=win.at(6)),
            _row(rt, b=2), _row(rt), _row(rt)]
    torch.testing.assert_close(out, _want(rt, h, want))
    rt.set_slot(5, None)  # no window left: no positions asked for
    assert rt.slots.num_window_slots == 0 and _host_rows(rt, runner, batch)[1] is None
