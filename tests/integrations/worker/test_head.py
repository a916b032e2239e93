"""The LM-head hook (vllm_steer/integrations/worker/head.py): base-class calls that work with vLLM's
LoRA wrapper as ``self``, and the start-up check that our head replaced the model's logits
layer (a model-specific subclass of vLLM's LogitsProcessor is not replaced)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch
from helpers.fakes import fake_lm_head


@pytest.fixture(scope="module")
def head_cls():
    from vllm.config import VllmConfig, set_current_vllm_config

    from vllm_steer.integrations import plugin

    plugin.register()
    from vllm_steer.integrations.worker.head import SteeredLogitsProcessor

    with set_current_vllm_config(VllmConfig()):  # what the layers read when built
        yield SteeredLogitsProcessor


class _Wrapper(torch.nn.Module):
    """Like vLLM's LogitsProcessorWithLoRA: forwards public attribute misses to base_layer and
    calls ``type(base_layer).forward(self, ...)``."""

    def __init__(self, base):
        super().__init__()
        self.base_layer = base

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.__dict__["_modules"]["base_layer"], name)

    def forward(self, *args, **kwargs):
        return type(self.base_layer).forward(self, *args, **kwargs)


def test_head_works_with_a_lora_style_wrapper_as_self(head_cls):
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(50, 16, generator=g)
    hidden = torch.randn(3, 16, generator=g)
    head = head_cls(50)
    assert type(head) is head_cls
    wrapped = _Wrapper(head)
    got = wrapped(fake_lm_head(weight), hidden)
    assert torch.allclose(got, hidden @ weight.T, atol=1e-5)
    top = head_cls.get_top_tokens(wrapped, fake_lm_head(weight), hidden)
    assert top.tolist() == (hidden @ weight.T).argmax(-1).tolist()


def test_the_head_steers_only_while_a_request_in_the_process_is_steered(head_cls, tmp_path):
    """The head's gate: with no steered request in the process it computes vLLM's plain
    logits without reaching the runtime; a flushed steered slot makes it steer that row (the
    formula in plain torch); cleared again, plain logits and the runtime untouched."""
    from vllm_steer.integrations.worker.gates import GATES

    others = GATES.steered_slots  # other tests' live slots, given back after
    GATES.steered_slots = 0
    try:
        _head_gate(head_cls, tmp_path)
    finally:
        GATES.steered_slots += others


def _head_gate(head_cls, tmp_path):
    import numpy as np
    from helpers.steers import random_steer

    from vllm_steer.config import SteerServerConfig
    from vllm_steer.format import load_steer, save_steer
    from vllm_steer.integrations.worker.rows import SlotRows
    from vllm_steer.integrations.worker.runtime import SteerRuntime

    path = str(tmp_path / "a.safetensors")
    save_steer(path, random_steer(16, 4, "a", seed=3, scale=3.0))
    rt = SteerRuntime(SteerServerConfig(steers={"a": path}))
    rt.bank_state.load(16, torch.device("cpu"), torch.float32)
    rt.ensure_slots(4, torch.device("cpu"))
    head = head_cls(50)
    head.steer_runtime = rt
    g = torch.Generator().manual_seed(1)
    weight, hidden = torch.randn(50, 16, generator=g), torch.randn(2, 16, generator=g)
    plain = hidden @ weight.T
    rt.step.sampled = SlotRows(slots=np.array([0, 1]), positions=None)
    calls = rt.planner.head_calls
    assert torch.allclose(head(fake_lm_head(weight), hidden), plain, atol=1e-5)
    assert rt.planner.head_calls == calls  # the gate: the runtime was not reached
    eps = 5e-3
    row = np.zeros(rt.slots.num_columns, np.float32)
    row[0] = eps  # the steer's own column, no domain part (random_steer has none)
    rt.set_slot(1, row)
    rt.slots.flush()
    steer = load_steer(path)
    w = steer.p1.float() @ steer.p2.float().T
    want = torch.stack([hidden[0], hidden[1] + eps * (hidden[1] @ w)]) @ weight.T
    assert torch.allclose(head(fake_lm_head(weight), hidden), want, atol=1e-4)
    assert not torch.allclose(want, plain, atol=1e-2)
    rt.set_slot(1, None)
    rt.slots.flush()
    calls = rt.planner.head_calls
    assert torch.allclose(head(fake_lm_head(weight), hidden), plain, atol=1e-5)
    assert rt.planner.head_calls == calls


def test_check_head_names_a_model_specific_logits_subclass(head_cls):
    from vllm.model_executor.layers.logits_processor import LogitsProcessor

    from vllm_steer.integrations.worker.head import HeadNotInstalledError, check_head_installed

    class SpecialLogitsProcessor(LogitsProcessor):
        pass

    class FancyForCausalLM(torch.nn.Module):
        def __init__(self, proc):
            super().__init__()
            self.logits_processor = proc

    check_head_installed(FancyForCausalLM(LogitsProcessor(50)))  # replaced by ours: fine
    with pytest.raises(HeadNotInstalledError) as e:
        check_head_installed(FancyForCausalLM(SpecialLogitsProcessor(50)))
    msg = str(e.value)
    assert "FancyForCausalLM" in msg and "SpecialLogitsProcessor" in msg
    assert "silently ignored" in msg
    with pytest.raises(HeadNotInstalledError, match="FancyForCausalLM has no vLLM "
                                                    "LogitsProcessor layer"):
        check_head_installed(FancyForCausalLM(torch.nn.Identity()))


SPECIAL_MODEL = r"""
import json, sys
from vllm import LLM, ModelRegistry
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.models.llama import LlamaForCausalLM


class SpecialLogitsProcessor(LogitsProcessor):
    pass


class TinySpecialHeadForCausalLM(LlamaForCausalLM):
    def __init__(self, *, vllm_config, prefix=""):
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        self.logits_processor = SpecialLogitsProcessor(self.config.vocab_size)


if __name__ == "__main__":
    ModelRegistry.register_model("TinySpecialHeadForCausalLM", TinySpecialHeadForCausalLM)
    kw = json.loads(sys.argv[2])
    try:
        LLM(sys.argv[1], distributed_executor_backend="uni", **kw)
    except Exception as e:
        print("STARTUP-FAILED " + " ".join(str(e).split()))
        sys.exit(3)
    print("STARTED")
"""


@pytest.mark.vllm
def test_engine_with_a_model_specific_logits_layer_fails_at_startup(tiny_model_dir, tmp_path):
    from helpers.steers import random_steer

    from vllm_steer.format import save_steer

    model = tmp_path / "special"
    shutil.copytree(tiny_model_dir, model)
    cfg = json.loads((model / "config.json").read_text())
    cfg["architectures"] = ["TinySpecialHeadForCausalLM"]
    (model / "config.json").write_text(json.dumps(cfg))
    save_steer(tmp_path / "a.safetensors", random_steer(64, 4, "a"))
    script = tmp_path / "special.py"
    script.write_text(textwrap.dedent(SPECIAL_MODEL))
    kw = dict(dtype="float32", kv_cache_memory_bytes=1 << 26, max_model_len=128,
              enforce_eager=True, additional_config={"vllm_steer": {"steers": {
                  "a": str(tmp_path / "a.safetensors")}}})
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0")
    out = subprocess.run([sys.executable, str(script), str(model), json.dumps(kw)], env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 3, (out.stdout[-2000:], out.stderr[-3000:])
    line = [ln for ln in out.stdout.splitlines() if ln.startswith("STARTUP-FAILED")][0]
    assert "TinySpecialHeadForCausalLM" in line and "SpecialLogitsProcessor" in line
    assert "not supported with --steer" in line


def test_the_loader_hook_captures_the_heads_graphs_once_the_model_is_loaded(head_cls, tmp_path):
    """vLLM's loader (``BaseModelLoader.load_model``, wrapped) returns the built model; its
    head's CUDA graphs (a stand-in here) are captured then, for every row bucket up to
    max_num_seqs, before any step: a configuration without steers captures nothing."""
    from helpers.capture import StandIn
    from helpers.steers import random_steer
    from vllm.config import VllmConfig

    from vllm_steer.format import save_steer
    from vllm_steer.integrations.worker import head as head_mod
    from vllm_steer.integrations.worker.runtime import get_runtime

    path = str(tmp_path / "a.safetensors")
    save_steer(path, random_steer(16, 4, "a", seed=1))
    config = {"vllm_steer": {"steers": {"a": path}, "max_steer_rank": 4}}
    rt = get_runtime(config)
    rt.bank_state.graph_backend = back = StandIn()
    rt.ensure_slots(6, torch.device("cpu"))  # the runner's request slots (V1: before the load)

    class TinyForCausalLM(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.logits_processor = head_cls(50)  # as vLLM builds it: the bank loads

    def orig(loader, vllm_config):
        rt.bank_state.load(16, torch.device("cpu"), torch.float32)  # what the head's __init__ does
        assert back.captured == []  # not while the model is built
        return TinyForCausalLM()

    model = head_mod.load_model(orig, object(), VllmConfig(additional_config=config))
    assert isinstance(model, TinyForCausalLM)
    assert rt.bank_state.bank.graphs.buckets == [1, 2, 4, 8] and len(back.captured) == 4
    plain = head_mod.load_model(lambda loader, vllm_config: TinyForCausalLM(), object(),
                                VllmConfig())
    assert isinstance(plain, TinyForCausalLM) and len(back.captured) == 4


def test_a_drafters_head_reads_the_steps_drafter_rows_and_records_its_op_in_graphs(
        head_cls, tmp_path, monkeypatch):
    """One step, two heads: the target's reads the step's sampled rows, a drafter's (marked
    once, as V2's EAGLE speculator is when it loads) the drafter rows, each against the
    reference with its own rows' slots. While a CUDA graph is recorded, with no request steered
    yet in the process, the drafter's head still records the op (a graph without it would
    serve every later replay unsteered); the target's head does nothing then."""
    import numpy as np

    from helpers.steers import random_steer
    from vllm_steer.format import save_steer
    from vllm_steer.kernels import staging
    from vllm_steer.integrations.worker.gates import GATES
    from vllm_steer.integrations.worker.rows import CapturedRows, SlotRows
    from vllm_steer.integrations.worker.runtime import get_runtime
    from vllm_steer.reference import steer_reference

    path = str(tmp_path / "a.safetensors")
    save_steer(path, random_steer(16, 4, "a", seed=4, scale=3.0))
    rt = get_runtime({"vllm_steer": {"steers": {"a": path}, "backend": "torch"}})
    rt.bank_state.load(16, torch.device("cpu"), torch.float32)
    rt.ensure_slots(4, torch.device("cpu"))
    rt.enable_fixed_drafter()
    target, drafter = head_cls(50), head_cls(50)
    target.steer_runtime = drafter.steer_runtime = rt
    drafter.steer_as_drafter(in_graphs=True)
    g = torch.Generator().manual_seed(2)
    weight, hidden = torch.randn(50, 16, generator=g), torch.randn(2, 16, generator=g)
    plain = hidden @ weight.T
    step = rt.step
    step.sampled = SlotRows(slots=np.array([0, 1]))
    step.drafts = CapturedRows(mapping=torch.tensor([1, 0], dtype=torch.int32))

    # a capture at start-up: nothing steered in the process yet
    monkeypatch.setattr(GATES, "steered_slots", 0)
    monkeypatch.setattr(staging, "capturing", lambda t: True)  # the planner reads it
    recorded = []
    real_op = rt.planner._fixed_op
    monkeypatch.setattr(rt.planner, "_fixed_op", lambda *a: recorded.append(1) or real_op(*a))
    calls = rt.planner.op_calls
    assert torch.allclose(drafter(fake_lm_head(weight), hidden), plain, atol=1e-5)
    assert recorded == [1]  # recorded: all-zero coefficients, plain logits
    assert torch.allclose(target(fake_lm_head(weight), hidden), plain, atol=1e-5)
    assert recorded == [1]  # the target's head: the gate, nothing else
    assert rt.planner.op_calls == calls  # a capture is not a steered call (the metric's)
    monkeypatch.undo()

    row = np.zeros(rt.slots.num_columns, np.float32)
    row[0] = 6e-3
    rt.set_slot(0, row)  # slot 0 steered, slot 1 not
    rt.slots.flush()
    factors = rt.bank_state.bank.factors

    def logits(rows_slots):
        coefs = torch.from_numpy(np.stack([row if s == 0 else np.zeros_like(row)
                                           for s in rows_slots]))
        return steer_reference(hidden, *factors, coefs) @ weight.T

    torch.testing.assert_close(target(fake_lm_head(weight), hidden), logits([0, 1]))
    torch.testing.assert_close(drafter(fake_lm_head(weight), hidden), logits([1, 0]))
