"""The worker-side runtime: slot coefficients, the per-batch plan, the head's rows (V1 flow)."""

from __future__ import annotations

import numpy as np
import torch

from helpers.rows import sampled_rows
from helpers.steers import random_steer
from vllm_steer.config import SteerServerConfig
from vllm_steer.format import save_steer
from vllm_steer.integrations.worker.runtime import SteerRuntime
from vllm_steer.reference import steer_reference


def _runtime(tmp_path):
    steers = {}
    for name, seed in (("a", 1), ("b", 2)):
        steers[name] = str(tmp_path / f"{name}.safetensors")
        save_steer(steers[name], random_steer(64, 4, name, seed=seed, scale=3.0))
    rt = SteerRuntime(SteerServerConfig(steers=steers))
    rt.bank_state.load(64, torch.device("cpu"), torch.float32)
    rt.ensure_slots(8, torch.device("cpu"))
    return rt


def _want(rt, h, rows):
    coefs = torch.tensor(np.stack(rows), dtype=torch.float32)
    return steer_reference(h, *rt.bank_state.bank.factors, coefs)


def test_decode_steps_reuse_the_plan_and_a_changed_slot_replans(tmp_path):
    rt = _runtime(tmp_path)
    assert rt.bank_state.backend == "torch"
    pad = [0.0] * (rt.slots.num_columns - 2)  # columns: one per steer slot (and domain) of the bank
    a, b, none = (np.array(r + pad, dtype=np.float32) for r in ([5e-3, 0], [0, -3e-3], [0, 0]))
    for slot, row in enumerate((a, b, none)):
        rt.set_slot(slot, row)
    rt.step.batch_size = 3
    rt.slots.flush()
    gen = torch.Generator().manual_seed(0)
    for _step in range(3):  # decode steps of an unchanged batch: one plan
        h = torch.randn(3, 64, generator=gen)
        torch.testing.assert_close(rt.planner.steer_rows(h), _want(rt, h, [a, b, none]))
    assert rt.planner.plans_made == 1
    # a request finishes and another takes its slot (update_state): the next step re-plans
    rt.set_slot(1, a)
    rt.slots.flush()
    h = torch.randn(3, 64, generator=gen)
    out = rt.planner.steer_rows(h)
    assert rt.planner.plans_made == 2
    torch.testing.assert_close(out, _want(rt, h, [a, a, none]))
    # a slot moved without a coefficient change still counts as a change
    rt.slots.move(0, 2, swap=True)
    rt.slots.flush()
    h = torch.randn(3, 64, generator=gen)
    torch.testing.assert_close(rt.planner.steer_rows(h), _want(rt, h, [none, a, a]))
    assert torch.equal(rt.planner.steer_rows(h)[0], h[0])  # unsteered row untouched


def test_no_steer_work_once_the_last_steered_request_left(tmp_path):
    rt = _runtime(tmp_path)
    a, none = (np.zeros(rt.slots.num_columns, dtype=np.float32) for _ in range(2))
    a[0] = 5e-3  # the first loaded steer's column
    rt.set_slot(0, none)
    rt.set_slot(1, a)
    rt.step.batch_size = 2
    rt.slots.flush()
    h = torch.randn(2, 64)
    assert rt.planner.active and not torch.equal(rt.planner.steer_rows(h)[1], h[1])
    assert rt.planner.stats.as_dict() == {"calls": 1, "rows": 2}
    # V1: the steered request finishes (BatchUpdate.removed), the other one goes on
    rt.set_slot(1, None)
    rt.step.batch_size = 1
    rt.slots.flush()
    assert not rt.planner.active and rt.slots.num_active_slots == 0
    assert torch.equal(rt.planner.steer_rows(h[:1]), h[:1])
    assert rt.planner.stats.calls == 1
    # a moved steered slot stays steered; the slot it left does not
    rt.set_slot(3, a)
    rt.slots.move(3, 0, swap=False)
    rt.slots.flush()
    assert rt.slots.num_active_slots == 1 and rt.any_steered(np.array([0]))
    assert not rt.any_steered(np.array([1, 2, 3]))


def test_rows_given_by_host_slots_get_their_slots_coefficients(tmp_path):
    """A ``slots`` row source (host-side row -> slot, as spec decoding and V2 prompt logprobs
    give it): each row is steered with its own slot's coefficients, in any order, repeated."""
    from vllm_steer.integrations.worker.rows import SlotRows

    rt = _runtime(tmp_path)
    pad = [0.0] * (rt.slots.num_columns - 2)
    a, b, none = (np.array(r + pad, dtype=np.float32) for r in ([5e-3, 0], [0, -3e-3], [0, 0]))
    for slot, row in ((3, a), (5, b), (0, none)):
        rt.set_slot(slot, row)
    rt.slots.flush()
    slots = np.array([5, 5, 3, 0, 3, 3])
    h = torch.randn(6, 64, generator=torch.Generator().manual_seed(1))
    with sampled_rows(rt.planner, SlotRows(slots=slots)):
        out = rt.planner.steer_rows(h)
    torch.testing.assert_close(out, _want(rt, h, [b, b, a, none, a, a]))
    assert torch.equal(out[3], h[3])


def test_a_steady_batchs_kept_answer_follows_every_change_of_the_slots():
    """V2 asks at every step whether the step's batch (``idx_mapping``) holds a steered slot,
    with the batch's bytes as a key: the answer kept for an unchanged batch must follow every
    slot that becomes steered, finishes or moves in between (checked against a plain set)."""
    from vllm_steer.integrations.worker.request_slots import RequestSlots

    table = RequestSlots(2)
    table.ensure(8, torch.device("cpu"))
    row = np.zeros(table.num_columns, dtype=np.float32)
    row[0] = 5e-3
    steered: set[int] = set()
    idx = np.array([0, 1, 2], dtype=np.intp)
    key = idx.tobytes()

    def check():
        want = bool(steered & {0, 1, 2})
        assert table.any_steered(idx, key) is want
        assert table.any_steered(idx, key) is want  # asked again: the kept answer
        assert table.any_steered(idx) is want

    check()
    for change in ("steer 5", "steer 1", "clear 1", "move 5 2", "clear 2"):
        op, *args = change.split()
        if op == "steer":
            table.set(int(args[0]), row, None, None)
            steered.add(int(args[0]))
        elif op == "clear":
            table.set(int(args[0]), None, None, None)
            steered.discard(int(args[0]))
        else:
            table.move(int(args[0]), int(args[1]), swap=False)
            steered.discard(int(args[0]))
            steered.add(int(args[1]))
        table.flush()
        check()


def test_a_plain_request_in_a_clear_slot_changes_nothing_and_clears_a_used_one(tmp_path):
    """A request that asks for no steer, in a slot holding none, leaves the table as it is (no
    new version: nothing to plan again, nothing to copy to the device), and so does moving it
    between such slots; in a slot a steered or windowed request left, it clears the slot
    fully, and a steered or windowed request still moves."""
    from vllm_steer.integrations.worker.rows import SlotRows
    from vllm_steer.request import Window

    rt = _runtime(tmp_path)
    table = rt.slots
    zero = np.zeros(rt.slots.num_columns, dtype=np.float32)
    a = zero.copy()
    a[0] = 5e-3
    rt.set_slot(1, a)
    rt.set_slot(2, zero.copy(), {0: Window(3.0, start=2, base=0.0)})  # windowed, off at first
    rt.set_slot(5, zero.copy(), {0: Window(0.0, start=2, base=0.0)})  # windowed, never steered
    rt.slots.flush()
    version = table.version
    for slot, row in ((0, None), (3, zero), (4, zero.copy())):  # plain requests, clear slots
        rt.set_slot(slot, row)
    rt.slots.move(3, 0, swap=False)  # a plain request moves to a clear slot, or swaps with one
    rt.slots.move(4, 6, swap=True)
    assert table.version == version and not table.dirty
    rt.slots.move(1, 7, swap=True)  # the steered request moves: the table changes
    assert table.steered[7] and not table.steered[1] and table.version > version
    rt.slots.move(7, 1, swap=True)
    rt.slots.move(5, 6, swap=False)  # so does a windowed one, even with no strength yet
    assert table.windowed[6] and not table.windowed[5]
    rt.slots.move(6, 5, swap=False)
    rt.slots.flush()
    version = table.version
    # plain requests take the slots the steered and the windowed request left: cleared
    rt.set_slot(1, None)
    rt.set_slot(2, zero)
    rt.set_slot(5, None)
    assert table.version > version and table.dirty
    rt.slots.flush()
    assert rt.slots.num_active_slots == 0 and table.num_window_slots == 0
    assert not table.windowed[[2, 5]].any() and not table.host[:6].any()
    assert not torch.count_nonzero(table.table[:5])  # the device copy too
    h = torch.randn(5, 64, generator=torch.Generator().manual_seed(2))
    with sampled_rows(rt.planner, SlotRows(slots=np.arange(5), positions=np.full(5, 4))):
        assert torch.equal(rt.planner.steer_rows(h), h)  # every row as the plain model's


def test_a_steady_step_skips_the_row_lookup_and_every_change_ends_it(tmp_path, monkeypatch):
    """Decode steps of an unchanged batch reuse the last step's plan without looking its rows
    up again (V1's persistent batch; V2's batch with the same slots, as new row-source objects
    with the same bytes). Every change in between is served with its own coefficients, checked
    against the reference: a changed slot, a batch of another size, other rows planned in
    between (prompt logprobs, a drafter), a generation window, and V2 slots in another order."""
    from vllm_steer.integrations.worker.rows import MappedRows, SlotRows
    from vllm_steer.request import Window

    rt = _runtime(tmp_path)
    pad = [0.0] * (rt.slots.num_columns - 2)
    a, b, none = (np.array(r + pad, dtype=np.float32) for r in ([5e-3, 0], [0, -3e-3], [0, 0]))
    gen = torch.Generator().manual_seed(3)

    def step(rows, source=None):
        """The step's rows steered as the reference says; how many row lookups it made."""
        h = torch.randn(len(rows), 64, generator=gen)
        before = rt.planner.steps_planned
        if source is None:
            out = rt.planner.steer_rows(h)
        else:
            with sampled_rows(rt.planner, source):
                out = rt.planner.steer_rows(h)
        torch.testing.assert_close(out, _want(rt, h, rows))
        return rt.planner.steps_planned - before

    for slot, row in enumerate((a, b, none)):
        rt.set_slot(slot, row)
    rt.step.batch_size = 3
    rt.slots.flush()
    assert [step([a, b, none]) for _ in range(4)] == [1, 0, 0, 0]  # V1 decode steps
    rt.set_slot(1, a)  # a request finishes and another takes its slot
    rt.slots.flush()
    assert [step([a, a, none]) for _ in range(2)] == [1, 0]
    rt.set_slot(3, b)  # one more request joins the batch
    rt.step.batch_size = 4
    rt.slots.flush()
    assert [step([a, a, none, b]) for _ in range(2)] == [1, 0]
    rt.set_slot(4, None)  # a plain request joins: the table keeps its version
    rt.step.batch_size = 5
    rt.slots.flush()
    assert [step([a, a, none, b, none]) for _ in range(2)] == [1, 0]
    rt.step.batch_size = 4  # and finishes
    assert [step([a, a, none, b]) for _ in range(2)] == [1, 0]
    # other rows planned in between (a prompt-logprob chunk, a drafter's rows)
    assert step([b, a], SlotRows(slots=np.array([3, 0]))) == 1
    assert [step([a, a, none, b]) for _ in range(2)] == [1, 0]
    # a generation window: its rows move with their positions, never steady
    rt.set_slot(2, none, {0: Window(5.0, start=0, ramp=3)})
    rt.slots.flush()
    for t in range(3):
        rt.step.batch_positions = np.array([7, 7, t, 7])
        ramped = none.copy()
        ramped[0] = rt.slots.row_coefs(1, np.array([2]), np.array([t]))[0, 0]
        assert ramped[0] != 0
        assert step([a, a, ramped, b]) == 1
    rt.set_slot(2, none)  # the windowed request finishes
    rt.slots.flush()
    assert [step([a, a, none, b]) for _ in range(2)] == [1, 0]
    # V2: a new row source each step, the batch's slots as its bytes
    slots = np.array([3, 0, 2], dtype=np.int32)

    def mapped(s):
        return MappedRows(mapping=torch.from_numpy(s), slots=s, key=s.tobytes())

    assert [step([b, a, none], mapped(slots.copy())) for _ in range(3)] == [1, 0, 0]
    assert step([a, b, none], mapped(slots[[1, 0, 2]].copy())) == 1  # another order
    assert step([b, a, none], mapped(slots.copy())) == 1
    assert step([b, a, none], MappedRows(mapping=None, slots=slots.copy())) == 1  # no key


def test_a_steer_of_the_served_model_is_not_warned_about_when_served_from_a_folder(
        tmp_path, caplog, monkeypatch):
    """``vllm serve /models/llama8b --served-model-name meta-llama/Llama-3.1-8B-Instruct``
    runs the model an LM-Steer file names: no "trained on another model" warning (a vector
    steer's fit check takes the served names alike); a model of another name is warned
    about."""
    import logging

    from vllm_steer.logs import LOGGER_NAME

    path = str(tmp_path / "a.safetensors")
    save_steer(path, random_steer(64, 4, "a", seed=1,
                                  base_model="meta-llama/Llama-3.1-8B-Instruct"))
    monkeypatch.setattr(logging.getLogger(LOGGER_NAME), "propagate", True)
    for ids, warned in ((("/models/llama8b", "meta-llama/Llama-3.1-8B-Instruct"), False),
                        (("/models/llama8b", "chat"), True)):
        caplog.clear()
        rt = SteerRuntime(SteerServerConfig(steers={"a": path}))
        with caplog.at_level(logging.WARNING):
            rt.bank_state.load(64, torch.device("cpu"), torch.float32, model_ids=ids)
        assert ("was trained on 'meta-llama/Llama-3.1-8B-Instruct' but the server runs "
                "'/models/llama8b'" in caplog.text) == warned, caplog.text


def test_a_step_whose_plan_would_hold_a_large_scratch_runs_the_grouped_op_in_chunks(
        tmp_path, monkeypatch):
    """The Triton backend's eager plan holds ``[rows, the bank's columns]`` fp32 whatever
    steers the step uses, allocated after vLLM sized the KV cache. A step over
    ``MAX_EAGER_SCRATCH_BYTES`` (many rows on a large bank: a prompt-logprob chunk) runs the
    grouped op instead, ``MAX_GRAPH_ROWS`` rows at a time: no such plan is made, and every
    row, across the chunks' edges, is steered as the reference says."""
    import os

    import pytest

    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the Triton backend on CPU needs TRITON_INTERPRET=1")
    from vllm_steer.integrations.worker import planner as planner_mod
    from vllm_steer.integrations.worker.rows import SlotRows

    steers = {}
    for name, seed in (("a", 1), ("b", 2)):
        steers[name] = str(tmp_path / f"{name}.safetensors")
        save_steer(steers[name], random_steer(32, 4, name, seed=seed, scale=3.0))
    rows = 40
    rt = SteerRuntime(SteerServerConfig(steers=steers, backend="triton", max_steers=6,
                                        max_steer_rank=8))
    rt.bank_state.load(32, torch.device("cpu"), torch.float32)
    rt.ensure_slots(rows, torch.device("cpu"), rows)
    pad = [0.0] * (rt.slots.num_columns - 2)
    a, b, none = (np.array(r + pad, dtype=np.float32) for r in ([5e-3, 0], [0, -3e-3], [0, 0]))
    for slot, row in ((0, a), (1, b), (2, none)):
        rt.set_slot(slot, row)
    rt.slots.flush()
    slots = np.arange(rows) % 3
    h = torch.randn(rows, 32, generator=torch.Generator().manual_seed(3))
    want = _want(rt, h, [(a, b, none)[s] for s in slots])
    with sampled_rows(rt.planner, SlotRows(slots=slots)):
        torch.testing.assert_close(rt.planner.steer_rows(h), want)  # under the limit: a plan
    assert rt.planner.plans_made == 1 and rt.planner._plan.buf.shape == (rows, 6 * 2 * 8)
    rt.planner._plan = rt.planner._plan_key = None
    monkeypatch.setattr(planner_mod, "MAX_EAGER_SCRATCH_BYTES", 4 * rows * 6 * 2 * 8 - 1,
                        raising=False)
    monkeypatch.setattr(planner_mod, "MAX_GRAPH_ROWS", 16, raising=False)  # chunks: 16, 16, 8
    h = torch.randn(rows, 32, generator=torch.Generator().manual_seed(4))
    rt.set_slot(1, a)  # a request changed: the step is planned again
    rt.slots.flush()
    with sampled_rows(rt.planner, SlotRows(slots=slots)):
        out = rt.planner.steer_rows(h)
    torch.testing.assert_close(out, _want(rt, h, [(a, a, none)[s] for s in slots]))
    assert rt.planner.plans_made == 1 and rt.planner._plan is None  # no plan, no scratch
    assert all(torch.equal(out[i], h[i]) for i in range(rows) if slots[i] == 2)


def test_a_prompt_logprob_chunk_longer_than_any_step_is_never_captured_while_serving(tmp_path):
    """The head's graphs are captured at start-up for the buckets of up to max_num_seqs rows.
    A prompt-logprob chunk of more rows (300 at max_num_seqs 8) runs the op eagerly: no
    capture inside a serving step (it would stall the step and take memory after vLLM sized
    the KV cache), and its rows are steered as the reference says; a step of sampled rows
    still replays."""
    from helpers.capture import StandIn
    from vllm_steer.integrations.worker.rows import PromptRows

    path = str(tmp_path / "a.safetensors")
    save_steer(path, random_steer(32, 4, "a", seed=1))
    rt = SteerRuntime(SteerServerConfig(steers={"a": path}, max_steers=4, max_steer_rank=8))
    rt.bank_state.graph_backend = back = StandIn()
    rt.ensure_slots(8, torch.device("cpu"))
    rt.bank_state.load(32, torch.device("cpu"), torch.float32)
    rt.model_loaded()
    graphs = rt.bank_state.bank.graphs
    assert graphs.buckets == [1, 2, 4, 8] and len(back.captured) == 4
    row = np.zeros(rt.slots.num_columns, np.float32)
    row[0] = 1e-3
    rt.set_slot(0, row)
    rt.slots.flush()
    base = torch.randn(300, 32, generator=torch.Generator().manual_seed(5))
    with rt.step.prompts(PromptRows(base=base, token_slots=np.zeros(300, dtype=np.int64))):
        out = rt.planner.steer_rows(base)
    torch.testing.assert_close(out, _want(rt, base, [row] * 300))
    assert graphs.buckets == [1, 2, 4, 8] and len(back.captured) == 4  # nothing captured
    replays = graphs.replays
    rt.step.batch_size = 1
    h = torch.randn(1, 32)
    torch.testing.assert_close(rt.planner.steer_rows(h), _want(rt, h, [row]))
    assert graphs.replays == replays + 1
