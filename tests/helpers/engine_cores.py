"""Engine cores for the management tests: the real management hook, registry and preset
table over two fake workers (tensor parallelism) that keep their copies of the bank and fail
on command, and vLLM's data-parallel client as the API server uses it."""

from __future__ import annotations

from types import SimpleNamespace

from helpers.fakes import engine_core
from vllm_steer.config import SteerServerConfig
from vllm_steer.integrations.engine import core as hooks
from vllm_steer.integrations.engine.registry import SteerRegistry
from vllm_steer.integrations.engine.state import EngineSteerState
from vllm_steer.integrations.protocol import MANAGEMENT_METHOD

HIDDEN = 16


class Workers:
    """Two workers' banks (``slot -> (load_id, name)``); ``fail(op, worker)``: that worker
    raises on the next ``op``, after the workers before it applied it (called twice: the
    next two such ops fail, in turn)."""

    def __init__(self):
        self.banks = [{}, {}]
        self.armed = []

    def fail(self, op, worker):
        self.armed.append((op, worker))

    def collective_rpc(self, fn, args=()):
        op, out = args[0], []
        for i, bank in enumerate(self.banks):
            if self.armed and self.armed[0] == (op, i):
                self.armed.pop(0)
                raise RuntimeError(f"fault injected in worker {i} during {op}")
            if op == "put":
                bank[args[1]] = (args[2], args[3])
            elif op == "drop":
                for s in args[1]:
                    bank.pop(s, None)
            out.append({} if op == "stats" else True)
        return out


def management_core(index=0, capacity=2, steer_dir=None):
    cfg = SteerServerConfig(steers={}, max_steers=capacity, steer_dir=steer_dir,
                            enable_updates=True)
    return engine_core(
        engine_index=index, steer_state=EngineSteerState(cfg, SteerRegistry(capacity), HIDDEN),
        scheduler=SimpleNamespace(requests={}), model_executor=Workers(),
        output_queue=SimpleNamespace(put_nowait=lambda item: None),
        vllm_config=SimpleNamespace(model_config=SimpleNamespace(model="tiny",
                                                                 served_model_name="tiny")))


def op(core, op_name, /, **kw) -> dict:
    (answer,) = hooks.collective_rpc(None, core, MANAGEMENT_METHOD, args=(op_name, kw))
    return answer


class DPClient:
    """vLLM's data-parallel client as the API server's management client uses it: a utility
    call to every engine core, one answer each."""

    def __init__(self, cores):
        self.core_engines = cores

    async def call_utility_all_async(self, method, *args):
        assert method == "collective_rpc"
        return [hooks.collective_rpc(None, c, *args) for c in self.core_engines]


def start_vector_core(cfg: SteerServerConfig, hidden: int, **attrs):
    """An engine core started as vLLM starts it (the plugin's start hook makes its steer
    state) with ``cfg`` on a two-block Llama stand-in of ``hidden`` (vector steers fit it);
    ``attrs``: the core's scheduler, executor, output queue. The frontend of its process
    admits by ``cfg`` too (the caller puts the previous configuration back)."""
    from vllm_steer.integrations.frontend.state import frontend_state

    st = frontend_state()
    st.reset(cfg)
    st.hidden_size = hidden
    hf = SimpleNamespace(num_hidden_layers=2, hidden_size=hidden, model_type="llama")
    vllm_config = SimpleNamespace(additional_config=cfg.to_additional_config(),
                                  model_config=SimpleNamespace(
                                      model="tiny", architectures=["LlamaForCausalLM"],
                                      hf_config=hf, hf_text_config=hf,
                                      get_hidden_size=lambda: hidden))
    core = engine_core(engine_index=0, **attrs)
    hooks.start(lambda self, c: setattr(self, "vllm_config", c), core, vllm_config)
    return core
