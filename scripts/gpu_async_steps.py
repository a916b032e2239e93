#!/usr/bin/env python3
"""Steered steps run one step ahead, as vLLM's Model Runner V2 runs them on a GPU, against the
plain-torch formula; no vLLM needed (run by scripts/gpu_window.py, check ``async``).

What vLLM does, reproduced with the plugin's own worker code and a stand-in model:

- the forward of each step is a CUDA graph replay (a stand-in model captured once, as vLLM
  captures its decode graphs), and the LM head runs eagerly after it, where the steer op runs
  (:func:`vllm_steer.integrations.worker.v2.sample` scopes the step's rows, the runtime steers
  them);
- the host never waits for a step: it prepares the next one (requests join and leave, slots
  are reused by requests with other steers or none, so every step's coefficients differ and
  are copied again) while the device still runs the previous ones, as async scheduling does;
- each step also computes prompt logprobs of three requests in chunks of 4 rows (one
  coefficient copy per chunk: :func:`vllm_steer.integrations.worker.v2.prompt_logprobs`).

Each step keeps its hidden states and the LM head's steered input on the device; at the end
(one synchronize) every row is compared with ``steer_reference`` on the same hidden states
with the coefficients its request had at that step (plain rows: bit for bit). A staging buffer
overwritten before its copy ran, or a row given another step's or another request's
coefficients, shows as a mismatch. Host waits on unfinished CUDA events are counted (0
expected). On the CPU (``device="cpu"``) the same steps run without graphs or overlap: a
rehearsal of the check itself.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 6e-2, torch.float16: 1e-2}  # max |error|
#: Allowed on top of TOLERANCE, times |reference|: one rounding of the dtype (bf16 keeps 8
#: significant bits, so a steered value of 8-16 one rounding off is 0.0625 away)
RELATIVE = {torch.float32: 2.0 ** -23, torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}
PROMPT_LENS = (5, 3, 6)  # three prompt-logprob requests, in chunks of 4 rows
CHUNK = 4


def _runtime(device, dtype, hidden: int, num_steers: int, rank: int, slots: int, folder: Path):
    from vllm_steer.format import make_steer, save_steer
    from vllm_steer.integrations.worker.runtime import get_runtime

    g = torch.Generator().manual_seed(11)
    files = {}
    for k in range(num_steers):
        name = f"s{k}"
        p1 = torch.randn(hidden, rank, generator=g) * (6.0 / hidden ** 0.25)
        p2 = torch.randn(hidden, rank, generator=g) * (6.0 / hidden ** 0.25)
        files[name] = str(folder / f"{name}.safetensors")
        save_steer(files[name], make_steer(p1, p2, name))
    config = {"vllm_steer": {"steers": files, "max_strength": 10}}
    rt = get_runtime(config)
    rt.bank_state.load(hidden, device, dtype)
    rt.ensure_slots(slots, device)
    rt.bank_state.warm_up()  # as at start-up: no kernel compiles inside the timed steps
    return rt, config


def _coef_row(rt, rng) -> np.ndarray:
    """A request's coefficients: no steer (a third of them), or one or two steers."""
    from vllm_steer.reference import steer_coefficients

    row = np.zeros(rt.slots.num_columns, dtype=np.float32)
    if rng.random() < 1 / 3:
        return row
    for j in rng.choice(len(rt.bank_state.names), size=rng.integers(1, 3), replace=False):
        eps = rt.bank_state.bank.steers[j].metadata.epsilon
        row[j], row[rt.bank_state.capacity + j] = steer_coefficients(float(rng.uniform(-8, 8)),
                                                                     eps, None)
    return row


class EagerGraphs:
    """The head's graph backend on the CPU: a capture keeps the function, a replay calls it.
    The head's graphs write into static buffers all the same, so the rows the head returns
    last until its next call, as on a GPU."""

    def capture(self, fn):
        fn()
        return fn

    def replay(self, graph):
        graph()

    def reset(self):
        pass


def _replay(fn, graph: bool):
    """``fn`` as vLLM runs a captured step: warmed up on a side stream, captured once in a CUDA
    graph, then replayed (without ``graph``: ``fn`` itself, run eagerly each time)."""
    if not graph:
        return fn
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    cg = torch.cuda.CUDAGraph()
    with torch.cuda.graph(cg):
        fn()
    return cg.replay


def _compare(rt, inp: torch.Tensor, got: torch.Tensor, coefs: np.ndarray):
    """A step's steered rows against ``steer_reference`` on the same input with the rows'
    coefficients: (max |error| beyond RELATIVE x |reference|, plain rows not bit-identical,
    largest steer effect)."""
    from vllm_steer.reference import steer_reference

    bank = rt.bank_state.bank
    want = steer_reference(inp, bank.p1, bank.p2, bank.rank_offsets,
                           torch.as_tensor(coefs, dtype=torch.float32, device=inp.device))
    err = float(((got.float() - want.float()).abs()
                 - RELATIVE[inp.dtype] * want.float().abs()).amax().clamp_min(0))
    plain = ~torch.as_tensor(coefs.any(axis=1), device=inp.device)
    plain_diff = int((got[plain] != inp[plain]).any(dim=1).sum())
    effect = float((want[~plain].float() - inp[~plain].float()).abs().amax()) \
        if (~plain).any() else 0.0
    return err, plain_diff, effect


def run(device="cuda", dtype=torch.bfloat16, steps: int = 24, batch: int = 64,
        hidden: int = 1024, layers: int = 8, graph: bool | None = None,
        seed: int = 0, runtime_hook=None) -> dict:
    """The check; returns ``{"ok", "lines", ...}``. ``runtime_hook(rt)`` may alter the runtime
    (tests use it to show that a wrong row is caught)."""
    from vllm_steer.integrations.worker import v2
    from vllm_steer.integrations.worker.rows import NO_ROWS
    from vllm_steer.kernels.graphs import head_graphs

    device = torch.device(device)
    cuda = device.type == "cuda"
    graph = cuda if graph is None else graph
    rng = np.random.default_rng(seed)
    g = torch.Generator(device=device).manual_seed(seed)
    lines: list[str] = []
    tmp = tempfile.TemporaryDirectory()
    rt, config = _runtime(device, dtype, hidden, 4, 16, 2 * batch, Path(tmp.name))
    rt.step.sampled = NO_ROWS  # as the V2 processor sets it: rows outside sample()
    if not cuda and rt.bank_state.bank.graphs is None:  # the head's graphs as on a GPU, eagerly
        head_graphs(rt.bank_state.bank, graph_backend=EagerGraphs())
    if runtime_hook is not None:
        runtime_hook(rt)

    # the stand-in model: `layers` of tanh(x W), its forward captured in a CUDA graph
    w = (torch.randn(hidden, hidden, generator=g, device=device) / hidden ** 0.5).to(dtype)
    x = torch.zeros(batch, hidden, device=device, dtype=dtype)
    h = torch.zeros_like(x)

    def forward():
        y = x
        for _ in range(layers):
            y = torch.tanh(y @ w) * 2
        h.copy_(y)

    replay = _replay(forward, graph)

    class Runner:  # V2's GPUModelRunner.sample(): the LM head's input, steered
        vllm_config = SimpleNamespace(additional_config=config)

        def sample(self, hidden_states, input_batch, grammar_output):
            # the head's matmul reads the steered rows at once and writes new logits; the
            # steered rows (from a CUDA graph, its static output) last until the next call
            return rt.planner.steer_rows(hidden_states).clone()

    def sample(hs, batch_ns):
        return v2.sample(Runner.sample, Runner(), hs, batch_ns, None)

    # V2's PromptLogprobsWorker: its record of the running requests that asked for them
    prompt_worker = SimpleNamespace(in_progress_prompt_logprobs={
        f"r{i}": [] for i in range(len(PROMPT_LENS))})

    def prompt_fn(self, logits_fn, hidden_states, input_batch):  # vLLM's chunked prompt rows
        n = hidden_states.shape[0]  # each chunk's logits: new memory (the head's matmul)
        return torch.cat([logits_fn(hidden_states[a:a + CHUNK]).clone()
                          for a in range(0, n, CHUNK)])

    waits = _count_event_waits() if cuda else None
    slot_rows = np.zeros((2 * batch, rt.slots.num_columns), dtype=np.float32)
    req_ids = {}  # each slot's request id: a new request in a slot, a new id
    live = rng.choice(2 * batch, size=batch, replace=False)
    kept = []
    t0 = time.perf_counter()
    for step in range(steps):
        # requests leave and join: a quarter of the batch, each new one in a free slot
        leave = rng.choice(batch, size=batch // 4, replace=False)
        free = np.setdiff1d(np.arange(2 * batch), live)
        live[leave] = rng.choice(free, size=leave.size, replace=False)
        for slot in live[leave] if step else live:
            slot_rows[slot] = _coef_row(rt, rng)
            # each request asks for prompt logprobs (the record below): as our per-request
            # state puts it into its slot from its SamplingParams
            rt.set_slot(int(slot), slot_rows[slot], prompt_logprobs=True)
            req_ids[int(slot)] = f"r{step}-{slot}"
        rt.slots.flush()
        order = rng.permutation(live)  # this step's batch order (idx_mapping)
        x.copy_(torch.randn(batch, hidden, generator=g, device=device).to(dtype))
        replay()
        mapping = torch.as_tensor(order)  # V2 copies it from pinned host memory
        mapping = (mapping.pin_memory() if cuda else mapping).to(device, non_blocking=True)
        ib = SimpleNamespace(req_ids=[req_ids[int(s)] for s in order],
                             idx_mapping_np=order, cu_num_logits_np=np.arange(batch + 1),
                             expanded_idx_mapping=mapping, num_computed_tokens_np=None,
                             num_scheduled_tokens=None)
        logits = sample(h, ib)
        qsl = np.concatenate([[0], np.cumsum(PROMPT_LENS)])
        pb = SimpleNamespace(num_reqs=len(PROMPT_LENS), idx_mapping_np=order[:len(PROMPT_LENS)],
                             query_start_loc_np=qsl)
        ph = torch.randn(int(qsl[-1]), hidden, generator=g, device=device).to(dtype)
        plogits = v2.prompt_logprobs(prompt_fn, prompt_worker, rt.planner.steer_rows, ph, pb)
        kept.append((h.clone(), logits, ph, plogits, slot_rows[order].copy(),
                     np.repeat(slot_rows[order[:len(PROMPT_LENS)]], PROMPT_LENS, axis=0)))
    host_s = time.perf_counter() - t0
    if cuda:
        torch.cuda.synchronize()
    device_s = time.perf_counter() - t0

    tol = TOLERANCE[dtype]
    worst, plain_diff, effect, bad = 0.0, 0, 0.0, []
    for step, (hs, lg, ph, plg, coefs, pcoefs) in enumerate(kept):
        for what, inp, got, co in (("sampled", hs, lg, coefs), ("prompt", ph, plg, pcoefs)):
            err, diff, eff = _compare(rt, inp, got, co)
            worst, plain_diff, effect = max(worst, err), plain_diff + diff, max(effect, eff)
            if err > tol:
                bad.append(f"step {step} {what}: max |error| past one rounding {err:.3g} > {tol}")
    ok = not bad and plain_diff == 0 and effect > 5 * tol and (waits is None or waits[0] == 0)
    tag = str(dtype).replace("torch.", "")
    head = rt.bank_state.bank.graphs
    head_replays = 0 if head is None else head.replays
    lines.append(f"async {tag}: {steps} steps x {batch} rows + {sum(PROMPT_LENS)} prompt rows "
                 f"in chunks of {CHUNK}, forward {'in a CUDA graph' if graph else 'eager'}, "
                 f"head op replayed from its graphs {head_replays} times: "
                 f"max |steered - reference| past one rounding {worst:.3g} (tolerance {tol}), "
                 f"plain rows differing "
                 f"{plain_diff}, largest steer effect {effect:.3g}, host waits on unfinished "
                 f"events {'n/a' if waits is None else waits[0]}, host {host_s * 1e3:.0f} ms "
                 f"of {device_s * 1e3:.0f} ms: {'PASS' if ok else 'FAIL'}")
    lines += bad[:5]
    if waits is not None:
        waits[1]()
    tmp.cleanup()
    return {"ok": ok, "lines": lines, "worst": worst, "plain_diff": plain_diff,
            "effect": effect, "waits": None if waits is None else waits[0],
            "head_replays": head_replays}


def run_drafter(device="cuda", dtype=torch.bfloat16, steps: int = 16, batch: int = 64,
                hidden: int = 1024, graph: bool | None = None, seed: int = 1) -> dict:
    """The drafter's steer inside a CUDA graph (Model Runner V2's EAGLE / EAGLE-3 / MTP draft
    steps): a stand-in draft step (one layer, then ``StepPlanner.steer_fixed`` on its rows
    with the speculator-style ``idx_mapping`` buffer, -1 for padding) captured once; then
    replays with requests joining and leaving (the slot table rewritten in place), the mapping
    buffer rewritten, and a steer loaded into a free slot halfway: every replay's rows against
    the formula with that step's coefficients."""
    from vllm_steer.format import make_steer
    from vllm_steer.reference import steer_coefficients

    device = torch.device(device)
    cuda = device.type == "cuda"
    graph = cuda if graph is None else graph
    rng = np.random.default_rng(seed)
    g = torch.Generator(device=device).manual_seed(seed)
    tmp = tempfile.TemporaryDirectory()
    rt, _ = _runtime(device, dtype, hidden, 3, 16, 2 * batch, Path(tmp.name))
    rt.enable_fixed_drafter()
    w = (torch.randn(hidden, hidden, generator=g, device=device) / hidden ** 0.5).to(dtype)
    x = torch.zeros(batch, hidden, device=device, dtype=dtype)
    h = torch.zeros_like(x)
    out = torch.zeros_like(x)
    mapping = torch.full((batch,), -1, dtype=torch.int32, device=device)

    def draft_step():
        h.copy_(torch.tanh(x @ w) * 2)
        out.copy_(rt.planner.steer_fixed(h, mapping))

    replay = _replay(draft_step, graph)
    slot_rows = np.zeros((2 * batch, rt.slots.num_columns), dtype=np.float32)
    kept, loaded = [], False
    for step in range(steps):
        if step == steps // 2:  # a run-time load into the free fourth slot
            gg = torch.Generator().manual_seed(99)
            rt.put_steer(3, 7, "late", make_steer(torch.randn(hidden, 8, generator=gg) * 0.5,
                                                  torch.randn(hidden, 8, generator=gg) * 0.5,
                                                  "late"))
            loaded = True
        live = rng.choice(2 * batch, size=batch - 3, replace=False)
        for slot in live[: batch // 3]:
            row = _coef_row(rt, rng)
            if loaded and rng.random() < 0.5:
                row[3], row[rt.bank_state.capacity + 3] = steer_coefficients(
                    float(rng.uniform(-8, 8)), 1e-3, None)
            slot_rows[slot] = row
            rt.set_slot(int(slot), row)
        rt.slots.flush()
        m = np.concatenate([live, [-1, -1, -1]]).astype(np.int32)  # padded like V2's buffer
        mapping.copy_(torch.from_numpy(m))
        x.copy_(torch.randn(batch, hidden, generator=g, device=device).to(dtype))
        replay()
        kept.append((h.clone(), out.clone(), np.where((m >= 0)[:, None], slot_rows[m], 0.0)))
    if cuda:
        torch.cuda.synchronize()
    tol = TOLERANCE[dtype]
    worst, plain_diff, effect = 0.0, 0, 0.0
    for hs, got, co in kept:
        err, diff, eff = _compare(rt, hs, got, co)
        worst, plain_diff, effect = max(worst, err), plain_diff + diff, max(effect, eff)
    ok = worst <= 2 * tol and plain_diff == 0 and effect > 5 * tol
    tag = str(dtype).replace("torch.", "")
    line = (f"drafter {tag}: {steps} draft steps x {batch} rows (3 padding), "
            f"{'replayed from one CUDA graph' if graph else 'eager'}, a steer loaded halfway: "
            f"max |steered - reference| past one rounding {worst:.3g} (tolerance {2 * tol}), "
            f"plain rows differing "
            f"{plain_diff}, largest steer effect {effect:.3g}: {'PASS' if ok else 'FAIL'}")
    tmp.cleanup()
    return {"ok": ok, "lines": [line], "worst": worst, "plain_diff": plain_diff,
            "effect": effect}


def _count_event_waits():
    """Count ``torch.cuda.Event.synchronize`` calls on events the device has not reached."""
    counter = [0, None]
    real = torch.cuda.Event.synchronize

    def synchronize(self):
        if not self.query():
            counter[0] += 1
        return real(self)

    torch.cuda.Event.synchronize = synchronize

    def restore():
        torch.cuda.Event.synchronize = real

    counter[1] = restore
    return counter


if __name__ == "__main__":
    import sys

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    results = [f(dev, dt) for f in (run, run_drafter) for dt in (torch.float32, torch.bfloat16)]
    for r in results:
        print("\n".join(r["lines"]))
    sys.exit(0 if all(r["ok"] for r in results) else 1)
