"""Gated hooks (``Hook.gates``, vllm_steer.integrations.hooks): while every gate of a hook is
closed (its count in the worker's process gates is zero) the patched vLLM method runs vLLM's
own code without calling the plugin's wrapper; a count leaving zero makes it call the wrapper
again, from the very next call."""

from __future__ import annotations

import pytest

from vllm_steer.integrations.hooks import RESOLVE_ATTR, wrap_method
from vllm_steer.integrations.worker.gates import GATES, ProcessGates


class _Recorder:
    """A plugin-like wrapper that records its calls and marks the result it returns."""

    def __init__(self):
        self.calls = []

    def __call__(self, orig, *args, **kwargs):
        self.calls.append(args[1:])
        return ("wrapped", orig(*args, **kwargs))


def _target():
    class Runner:  # vLLM's method: what a closed gate runs
        def step(self, x, *, y=0):
            return x + y

    return Runner


@pytest.fixture
def closed(monkeypatch):
    """Every gate closed (other tests of this process may have left a count open)."""
    for name in ProcessGates.__slots__:
        monkeypatch.setattr(GATES, name, 0)
    return GATES


def test_a_gated_hook_runs_vllms_method_while_its_gate_is_closed(closed, monkeypatch):
    cls, wrapper = _target(), _Recorder()
    wrap_method(cls, "step", wrapper, gates=("layer_mappings",))
    runner = cls()
    assert runner.step(2, y=3) == 5 and wrapper.calls == []  # vLLM's own result, no wrapper
    monkeypatch.setattr(GATES, "layer_mappings", GATES.layer_mappings + 1)
    assert runner.step(2, y=3) == ("wrapped", 5) and wrapper.calls == [(2,)]
    GATES.layer_mappings += 2  # still open
    assert runner.step(1) == ("wrapped", 1)
    GATES.layer_mappings -= 3  # zero again: closed
    assert runner.step(4) == 4 and len(wrapper.calls) == 2


def test_any_open_gate_of_several_opens_the_hook(closed, monkeypatch):
    cls, wrapper = _target(), _Recorder()
    wrap_method(cls, "step", wrapper, gates=("windowed_slots", "speculative_runtimes"))
    runner = cls()
    assert runner.step(1) == 1
    monkeypatch.setattr(GATES, "speculative_runtimes", 1)
    assert runner.step(1) == ("wrapped", 1)
    monkeypatch.setattr(GATES, "windowed_slots", 2)
    monkeypatch.setattr(GATES, "speculative_runtimes", 0)
    assert runner.step(1) == ("wrapped", 1)  # the other gate holds it open
    monkeypatch.setattr(GATES, "windowed_slots", 0)
    assert runner.step(1) == 1 and len(wrapper.calls) == 2


def test_ungated_hooks_and_other_gates_are_not_affected(closed, monkeypatch):
    cls, other = _target(), _target()
    always, gated = _Recorder(), _Recorder()
    wrap_method(cls, "step", always)
    wrap_method(other, "step", gated, gates=("worker_faults",))
    assert cls().step(1) == ("wrapped", 1)  # no gates: the wrapper at every call
    monkeypatch.setattr(GATES, "prompt_logprob_slots", 5)  # another gate opens
    assert other().step(1) == 1 and gated.calls == []


def test_a_lazily_imported_wrapper_is_imported_at_its_first_call_with_its_gate_open(
        closed, monkeypatch):
    cls, wrapper, imported = _target(), _Recorder(), []

    def lazy(orig, *args, **kwargs):  # plugin._worker's shape: the real one is imported later
        raise AssertionError("the lazy stand-in itself is never called once resolved")

    def resolve():
        imported.append(True)
        return wrapper

    setattr(lazy, RESOLVE_ATTR, resolve)
    wrap_method(cls, "step", lazy, gates=("steered_slots",))
    runner = cls()
    assert runner.step(3) == 3 and imported == []  # closed: nothing imported
    monkeypatch.setattr(GATES, "steered_slots", 1)
    assert runner.step(3) == ("wrapped", 3) and imported == [True]
    assert runner.step(4) == ("wrapped", 4) and imported == [True]  # once
    monkeypatch.setattr(GATES, "steered_slots", 0)
    assert runner.step(5) == 5
    monkeypatch.setattr(GATES, "steered_slots", 1)
    assert runner.step(6) == ("wrapped", 6) and imported == [True]


def test_a_hook_after_vllms_method_sees_a_gate_opened_during_that_call(closed, monkeypatch):
    """``Hook.after``: vLLM's method runs first; the wrapper gets ``(orig, self, out)`` and its
    result is the call's, only when a gate is open as vLLM's method returns, even one that
    method opened (a fault recorded during vLLM's step is named in that step's output)."""
    seen = []

    def after(orig, self, out):
        seen.append(out)
        return ("named", out)

    class Runner:
        opens = False

        def sample_tokens(self, x):
            if self.opens:  # a fault recorded during vLLM's step
                GATES.worker_faults += 1
            return x * 2

    wrap_method(Runner, "sample_tokens", after, gates=("worker_faults",), after=True)
    runner = Runner()
    assert runner.sample_tokens(3) == 6 and seen == []  # no fault: vLLM's output, untouched
    runner.opens = True
    assert runner.sample_tokens(4) == ("named", 8) and seen == [8]
    runner.opens = False
    assert runner.sample_tokens(5) == ("named", 10)  # still open: the wrapper decides
    monkeypatch.setattr(GATES, "worker_faults", 0)
    assert runner.sample_tokens(6) == 12 and seen == [8, 10]
    with pytest.raises(ValueError, match="needs gates"):
        wrap_method(_target(), "step", after, after=True)


def _only_calls_orig(wrapper) -> bool:
    """Called with a stand-in runner and vLLM method, whether ``wrapper`` only called that
    method (once, with the call's arguments) and returned its result unchanged."""
    seen = []

    def orig(*args, **kwargs):
        seen.append((args, kwargs))
        return "vllm's result"

    runner = object()
    try:
        out = wrapper(orig, runner, "a", b="b")
    except Exception:
        return False
    return out == "vllm's result" and seen == [((runner, "a"), {"b": "b"})]


def test_every_gated_hook_of_the_plugin_only_calls_vllm_while_its_gates_are_closed(closed):
    """A hook may be declared gated only if its wrapper does nothing but call vLLM's method
    while every one of its gates is zero: then skipping it changes nothing. Checked on the
    plugin's own wrappers (imported as the patched methods import them), each with its gates
    closed; the process gates they name are counts of :class:`ProcessGates`."""
    from vllm_steer.integrations.plugin import HOOKS

    gated = [h for h in HOOKS if h.gates]
    assert {h.target.rpartition(".")[2] for h in gated} >= {
        "sample", "prepare_inputs", "_prepare_inputs", "compute_prompt_logprobs",
        "sample_tokens"}
    for h in gated:
        assert set(h.gates) <= set(ProcessGates.__slots__), h.target
        if h.after:  # never called with its gates closed (see the test of after-hooks)
            continue
        fn = getattr(h.wrapper, RESOLVE_ATTR)()
        assert _only_calls_orig(fn), f"{h.target}: its wrapper does more than call vLLM " \
                                     f"with {h.gates} closed"


def test_the_check_of_gated_wrappers_fails_for_a_wrapper_that_works_with_its_gates_closed(
        closed):
    """Planted: wrappers that do something with every gate closed are told apart."""
    def changes_the_result(orig, *args, **kwargs):
        return orig(*args, **kwargs) + "!"

    def calls_twice(orig, *args, **kwargs):
        orig(*args, **kwargs)
        return orig(*args, **kwargs)

    def reads_the_runner(orig, self, *args, **kwargs):
        return orig(self, *args, **kwargs) if self.ready else None

    def passes_through(orig, *args, **kwargs):
        return orig(*args, **kwargs)

    assert [_only_calls_orig(w) for w in (changes_the_result, calls_twice, reads_the_runner,
                                          passes_through)] == [False, False, False, True]
