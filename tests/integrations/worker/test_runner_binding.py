"""The per-step path: each runner finds its runtime once (no configuration rebuilt, validated or
serialised per step), and the hooks read vLLM's arguments by name, so that a vLLM that adds a
parameter still works and one that renames it fails loudly."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from vllm_steer.config import SteerServerConfig
from vllm_steer.integrations.worker import runtime as runtime_mod
from vllm_steer.integrations.worker.arguments import Arg
from vllm_steer.integrations.worker.gates import GATES
from vllm_steer.integrations.worker.runtime import BINDINGS, V1RunnerBinding
from vllm_steer.integrations.worker.v1 import prepare_inputs


class _Runner:
    speculative_config = None  # V1's runner without speculative decoding

    def __init__(self, config):
        self.vllm_config = SimpleNamespace(additional_config=config)
        self.input_batch = SimpleNamespace(num_reqs=2, num_computed_tokens_cpu=np.array([5, 7]),
                                           num_prompt_tokens=np.array([3, 3]))


def test_a_runner_looks_its_runtime_up_once_then_reads_it(monkeypatch):
    """Steps of a runner validate the steer configuration once, at its first hooked call; a
    runner of an engine without steers is bound to no runtime, also once."""
    built = []
    real = SteerServerConfig.from_additional_config

    def counted(cfg):
        built.append(1)
        return real(cfg)

    monkeypatch.setattr(SteerServerConfig, "from_additional_config", staticmethod(counted))
    sentinel = object()
    monkeypatch.setattr(runtime_mod, "get_runtime", lambda cfg: counted(cfg) and sentinel)
    runner = _Runner({"vllm_steer": {"steers": {"a": "a.safetensors"}}})
    assert [V1RunnerBinding.of(runner).runtime for _ in range(5)] == [sentinel] * 5
    assert len(built) == 1
    plain = _Runner(None)
    assert [V1RunnerBinding.of(plain).runtime for _ in range(5)] == [None] * 5
    assert len(built) == 2
    assert type(BINDINGS.get(plain)) is V1RunnerBinding
    assert sorted(vars(plain)) == ["input_batch", "vllm_config"]  # nothing set on the runner
    n = len(BINDINGS)
    del runner, plain  # a collected runner's binding goes with it
    assert len(BINDINGS) == n - 2


def test_v1_prepare_inputs_reads_its_arguments_by_name(monkeypatch):
    """A windowed slot's generated-token positions come from ``num_scheduled_tokens``, given
    by position or by keyword, wherever it stands in the signature."""

    monkeypatch.setattr(GATES, "windowed_slots", 1)  # a windowed request in this process
    from vllm_steer.integrations.worker.step_faults import StepFaults

    rt = SimpleNamespace(slots=SimpleNamespace(num_window_slots=1),
                         step=SimpleNamespace(batch_positions=None, tokens=None),
                         faults=StepFaults())
    runner = _Runner(None)
    BINDINGS.set(runner, V1RunnerBinding(rt))

    def old(self, scheduler_output, num_scheduled_tokens):
        return "out"

    def newer(self, scheduler_output, extra, num_scheduled_tokens, more=None):
        return "out"

    scheduled = np.array([1, 1])
    for orig, args, kwargs in ((old, (None, scheduled), {}),
                               (old, (None,), {"num_scheduled_tokens": scheduled}),
                               (newer, (None, "x", scheduled), {}),
                               (newer, (None, "x"), {"num_scheduled_tokens": scheduled})):
        rt.step.batch_positions = None
        assert prepare_inputs(orig, runner, *args, **kwargs) == "out"
        assert rt.step.batch_positions.tolist() == [3, 5]


def test_an_argument_a_vllm_renamed_fails_loudly_naming_it():
    def sample_draft(self, hidden, positions, idx_mapping):
        pass

    def renamed(self, hidden, positions, slot_mapping):
        pass

    arg = Arg("idx_mapping")
    assert arg.get(sample_draft, ("self", 1, 2, "m"), {}) == "m"
    assert arg.get(sample_draft, ("self", 1, 2), {"idx_mapping": "k"}) == "k"
    with pytest.raises(RuntimeError, match="has no parameter 'idx_mapping'.*slot_mapping"):
        arg.get(renamed, ("self", 1, 2, "m"), {})
    args, kwargs = arg.replace(sample_draft, ("self", 1, 2, "m"), {}, "new")
    assert args == ("self", 1, 2, "new") and kwargs == {}


def test_the_process_count_of_windowed_slots_follows_every_slot_change(tmp_path):
    """V1's per-step hook reads one process-wide count before anything else: it follows each
    request slot given, cleared, moved or reset, over two runtimes."""
    import torch

    from helpers.steers import random_steer
    from vllm_steer.format import save_steer
    from vllm_steer.integrations.worker.runtime import SteerRuntime
    from vllm_steer.request import Window

    path = str(tmp_path / "a.safetensors")
    save_steer(path, random_steer(16, 2, "a", seed=1))
    start = GATES.windowed_slots
    rts = [SteerRuntime(SteerServerConfig(steers={"a": path})) for _ in range(2)]
    row = np.zeros(rts[0].slots.num_columns, np.float32)
    row[0] = 1e-3
    for rt in rts:
        rt.bank_state.load(16, torch.device("cpu"), torch.float32)
        rt.ensure_slots(4, torch.device("cpu"))
        rt.set_slot(0, row, {0: Window(1.0, start=2)})
    assert GATES.windowed_slots == start + 2
    rts[0].set_slot(1, row, {0: Window(1.0, start=2)})
    rts[0].slots.move(0, 3, swap=False)  # moved: still two windowed slots there
    assert GATES.windowed_slots == start + 3
    rts[0].set_slot(3, row)  # the slot reused by a request with no window
    assert GATES.windowed_slots == start + 2
    rts[1].ensure_slots(8, torch.device("cpu"))  # a new, empty table
    assert GATES.windowed_slots == start + 1
    rts[0].set_slot(1, None)
    assert GATES.windowed_slots == start


def test_a_dropped_runtime_takes_its_slots_out_of_the_process_counts(tmp_path):
    """The process-wide counts gate the per-step hooks and the head: a runtime that goes
    away (an engine shut down in a process that starts another) leaves none of its steered or
    windowed slots in them."""
    import gc

    import torch

    from helpers.steers import random_steer
    from vllm_steer.format import save_steer
    from vllm_steer.integrations.worker.runtime import SteerRuntime
    from vllm_steer.request import Window

    path = str(tmp_path / "a.safetensors")
    save_steer(path, random_steer(16, 2, "a", seed=1))
    gc.collect()  # earlier tests' tables waiting for collection leave the counts first
    start = GATES.steered_slots, GATES.windowed_slots
    rt = SteerRuntime(SteerServerConfig(steers={"a": path}))
    rt.bank_state.load(16, torch.device("cpu"), torch.float32)
    rt.ensure_slots(4, torch.device("cpu"))
    row = np.zeros(rt.slots.num_columns, np.float32)
    row[0] = 1e-3
    rt.set_slot(0, row, {0: Window(1.0, start=2)})
    rt.set_slot(2, row)
    rt.slots.flush()
    assert (GATES.steered_slots, GATES.windowed_slots) == (start[0] + 2, start[1] + 1)
    del rt
    gc.collect()
    assert (GATES.steered_slots, GATES.windowed_slots) == start
