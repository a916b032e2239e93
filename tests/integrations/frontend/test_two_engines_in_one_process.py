"""Two engines (offline ``LLM`` / ``AsyncLLM``) in one process: each admits its requests by
its own steer configuration, whichever was built last."""

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from vllm import SamplingParams  # noqa: E402

from vllm_steer.config import SteerServerConfig  # noqa: E402
from vllm_steer.integrations.frontend import request_field  # noqa: E402
from vllm_steer.integrations.frontend.state import frontend_state, new_engine  # noqa: E402
from vllm_steer.request import SteerRequestError, admitted  # noqa: E402


class _Processor(SimpleNamespace):
    """What the hooks read of an ``InputProcessor`` (weak-referenceable, as it is)."""


def _input_processor(cfg):
    """An ``InputProcessor`` as vLLM builds it for an engine of ``cfg`` (its ``__init__``
    through the plugin's hook), and the params validator it uses for every request."""
    mc = SimpleNamespace(hf_config=SimpleNamespace(architectures=["LlamaForCausalLM"]),
                         hf_text_config=SimpleNamespace(hidden_size=64),
                         get_hidden_size=lambda: 64, architectures=["LlamaForCausalLM"],
                         logits_processors=[])
    vc = SimpleNamespace(additional_config=None if cfg is None else cfg.to_additional_config(),
                         model_config=mc)
    ip = _Processor(vllm_config=vc)
    request_field.input_processor_init(lambda self, vc, *a, **kw: None, ip, vc)
    validate = request_field.params_validator(lambda self: (lambda params: None), ip)
    validate.processor = ip  # the engine keeps its InputProcessor while it lives
    return validate


@pytest.fixture(autouse=True)
def _restore():
    old = frontend_state().config
    yield
    new_engine(old)


def test_a_second_engine_does_not_change_how_the_first_admits_its_requests():
    first = _input_processor(SteerServerConfig(steers={"detox": "detox.safetensors"}))
    _input_processor(None)  # a plain LLM built next, in the same process
    params = SamplingParams(extra_args={"steer": {"detox": 4}})
    first(params)  # refused today: "this server has no steers loaded"
    assert admitted(params.extra_args["steer"]).strengths == {"detox": 4.0}


def test_a_second_engine_s_policy_is_not_applied_to_the_first_engine_s_requests():
    first = _input_processor(SteerServerConfig(steers={"detox": "detox.safetensors"}))
    _input_processor(SteerServerConfig(steers={"detox": "d.safetensors", "calm": "c.gguf"},
                                       floors={"calm": 1.0}, max_strength=3.0))
    params = SamplingParams()
    first(params)  # today: served with the second engine's floor calm=1
    assert admitted((params.extra_args or {}).get("steer")) is None
    params = SamplingParams(extra_args={"steer": {"detox": 4}})
    first(params)  # today: refused by the second engine's --steer-max-strength 3
    assert admitted(params.extra_args["steer"]).strengths == {"detox": 4.0}


def test_an_offline_management_call_updates_its_own_engines_view():
    """``load_steer(llm, ...)`` refreshes the view of the names that LLM admits, not the
    view of the engine built last."""
    from vllm_steer.integrations.frontend.engine_client import manage_sync
    from vllm_steer.integrations.frontend.state import state_of
    from vllm_steer.integrations.protocol import OP_LIST, OP_LOAD

    first = _input_processor(SteerServerConfig(steers={"detox": "detox.safetensors"}))
    second = _input_processor(SteerServerConfig(steers={"calm": "calm.safetensors"}))
    listed = {"ok": True, "enabled": True, "steers": [
        {"name": n, "state": "loaded"} for n in ("detox", "extra")]}
    loaded = {"ok": True, "name": "extra"}
    llm = SimpleNamespace(  # a load, then the list that refreshes the view
        collective_rpc=lambda method, args: [listed if args[0] == OP_LIST else loaded],
        llm_engine=SimpleNamespace(input_processor=first.processor))
    assert manage_sync(llm, OP_LOAD, name="extra", path="extra.safetensors") == loaded
    assert state_of(first.processor).loaded_names() == {"detox", "extra"}
    assert state_of(second.processor).loaded_names() == {"calm"}
    params = SamplingParams(extra_args={"steer": {"extra": 2}})
    first(params)  # the first engine now admits its run-time steer
    assert admitted(params.extra_args["steer"]).strengths == {"extra": 2.0}
    with pytest.raises(SteerRequestError, match="unknown steer 'extra'; loaded steers: calm$"):
        second(SamplingParams(extra_args={"steer": {"extra": 2}}))
