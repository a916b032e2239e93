"""The engine core's hooks: run-time steer management and admission.

The engine core's start makes its steer state (:func:`start`),
``EngineCore.collective_rpc`` answers the management method
(:data:`~vllm_steer.integrations.protocol.MANAGEMENT_METHOD`: load / unload / list / presets,
:mod:`vllm_steer.integrations.engine.management`), and ``EngineCore.add_request`` binds each
request's steers to (bank slot, load) (:mod:`vllm_steer.integrations.engine.binding`); a
request refused there is finished at once with an error output (:func:`send_refusal`), which
the API server turns into HTTP 400 (:mod:`vllm_steer.integrations.frontend.async_llm`). An
engine core in the caller's process (offline ``LLM`` with ``VLLM_ENABLE_V1_MULTIPROCESSING=0``)
hands its refusals to its client's next step (:func:`inproc_get_output`), so they end as with
an engine core process.

This module imports no torch.
"""

from __future__ import annotations

from vllm_steer.integrations import vllm_access
from vllm_steer.integrations.engine.binding import SteerBankFullError, bind_request
from vllm_steer.integrations.engine.management import run_op
from vllm_steer.integrations.engine.state import STATES, engine_state
from vllm_steer.integrations.guard import (BUSY_STATUS, CLIENT_STATUS, classify,
                                           management_failure)
from vllm_steer.integrations.protocol import (BUSY_PREFIX, FAILED_PREFIX, MANAGEMENT_METHOD,
                                              REFUSED_PREFIX)
from vllm_steer.integrations.side_table import SideTable
from vllm_steer.logs import get_logger
from vllm_steer.metrics import refusal_key
from vllm_steer.request import refusal_reason

logger = get_logger()


def start(orig, self, vllm_config):
    """``EngineCore._initialize_kv_caches``, which ``EngineCore.__init__`` calls once its
    workers are up: the engine core's steer state made then (the ``--steer`` files' headers
    read now, as the workers read them to reserve the bank, not at the first request or
    listing; a file that cannot be read fails the start). Not ``__init__`` itself: it loads
    the plugins, so a spawned engine core's own call of it runs unpatched. vLLM refusing the
    KV cache for want of memory (its ``ValueError``, which names only vLLM's own flags) is
    raised again with what the plugin took of that memory and the flags that size it
    (:func:`kv_cache_note`)."""
    try:
        out = orig(self, vllm_config)
    except ValueError as e:
        note = kv_cache_note(vllm_config, e)
        if note is None:
            raise
        raise ValueError(f"{e}\n{note}") from e
    engine_state(self)
    return out


#: Words of vLLM's errors when the memory left for the KV cache is too small
#: (``vllm.v1.core.kv_cache_utils``: "No available memory for the cache blocks", "... KV cache
#: is needed, which is larger than the available KV cache memory ...").
_KV_CACHE_SHORT = ("memory for the cache blocks", "available KV cache memory")


def kv_cache_note(vllm_config, error: Exception) -> str | None:
    """For vLLM's error that too little memory is left for the KV cache: the steer bank's
    share of what vLLM measured before sizing it, and the flags that size it (None: another
    error, no steering, or the figure cannot be computed; the error is then raised as it is)."""
    if not any(w in str(error) for w in _KV_CACHE_SHORT):
        return None
    try:
        from vllm_steer import sizing
        from vllm_steer.config import SteerServerConfig
        from vllm_steer.format import factor_ranks
        from vllm_steer.integrations.families import head_input_size
        from vllm_steer.kinds import applied_in_layers, read_any_metadata

        cfg = SteerServerConfig.from_additional_config(vllm_access.additional_config(vllm_config))
        if cfg is None or not cfg.enabled:
            return None
        mc = vllm_access.model_config(vllm_config)
        ranks = [r for path in cfg.steers.values()
                 if not applied_in_layers(read_any_metadata(path)) for r in factor_ranks(path)]
        rank, hidden = cfg.reserved_rank(ranks), head_input_size(mc)
        dtype = str(vllm_access.model_head_dtype(mc))
        bank = sizing.bank_bytes(cfg.capacity, rank, hidden, dtype)
        graphs = sizing.head_graph_bytes(cfg.capacity, rank, hidden, dtype, cfg.per_request)
    except Exception:  # noqa: BLE001 - vLLM's own error is what matters; the note is extra
        return None
    return (f"vllm-steer: of that memory, each GPU with the LM head holds the steer bank, "
            f"{bank / 2**20:,.1f} MiB ({cfg.capacity} max steers x rank {rank} x hidden "
            f"{hidden} x {dtype.replace('torch.', '')}, x2 factors, x2 for domain components), "
            f"and the head's CUDA graphs, up to {graphs / 2**20:,.1f} MiB; lower --max-steers "
            f"(now {cfg.capacity}) or --max-steer-rank (now {rank}) to leave it to the KV "
            "cache (docs/deploy.md, Sizing)")


def collective_rpc(orig, self, method, timeout=None, args=(), kwargs=None):
    """``EngineCore.collective_rpc`` answers :data:`~vllm_steer.integrations.protocol.
    MANAGEMENT_METHOD` in the engine core (load / unload / list / presets, forwarded to every
    worker by the executor's own collective_rpc). The op never raises (:func:`run_op`: a
    failure is its answer); a call whose arguments are not ``(op, kwargs)`` is answered
    with a 400."""
    if method == MANAGEMENT_METHOD:
        if not args or not isinstance(args[0], str) or len(args) > 2:
            return [{"ok": False, "status": 400, "engine": 0,
                     "error": f"steer management call: expected (op, kwargs), got {args!r:.200}"}]
        try:
            return [run_op(self, *args)]
        except Exception as e:  # the plugin's one guard: answered, never raised
            return [{**management_failure(str(args[0]), e),
                     "engine": vllm_access.engine_index(self)}]
    return orig(self, method, timeout, args, kwargs)


def add_request(orig, self, request, request_wave: int = 0):
    """``EngineCore.add_request``: each steer bound to (bank slot, load)
    (:func:`~vllm_steer.integrations.engine.binding.bind_request`), inside the plugin's one
    guard (:mod:`vllm_steer.integrations.guard`): a request refused there (HTTP 400) or whose
    admission failed in the plugin's code (HTTP 500, logged once with its traceback) is
    finished at once with an error output (:func:`send_refusal`), and the engine core goes on
    with every other request. Only vLLM's own ``add_request`` runs outside the guard.

    A request vLLM adds only to abort it at once (``abort_immediately``: the KV connector's
    clean-up of a request that never runs, which vLLM 0.33's paused engine sends with the
    client's own sampling params after it rejected the request) is handed to vLLM as it is:
    binding it could load a ``--steer-dir`` steer for nothing, or refuse it and so skip the
    clean-up (the remote KV blocks held for it would never be freed)."""
    if vllm_access.aborts_immediately(request):
        return orig(self, request, request_wave)
    try:
        bind_request(self, request)
    except Exception as e:
        request_id = vllm_access.request_id(request)
        status, message = classify(e, "EngineCore.add_request", request_id)
        if status == CLIENT_STATUS:
            logger.warning("vllm-steer: request %s refused: %s", request_id, message)
            reason = refusal_reason(e)
            if isinstance(e, SteerBankFullError):  # no room now: the client may retry
                status, reason = BUSY_STATUS, "bank_full"
        else:
            reason = "internal"
        count_refusal(self, status, reason)
        send_refusal(self, request, message, status)
        return
    return orig(self, request, request_wave)


def count_refusal(core, status: int, reason: str) -> None:
    """One more request refused by the plugin in this engine core, per status and reason in
    its registry's ``refused``: ``vllm_steer:requests_refused_total{source="engine_core"}``."""
    st = STATES.get(core)  # never created here: this runs when admission failed
    reg = st.registry if st is not None else None
    if reg is not None:
        key = refusal_key(status, reason)
        reg.refused[key] = reg.refused.get(key, 0) + 1


def send_refusal(core, request, message: str, status: int = CLIENT_STATUS) -> None:
    """Finish ``request`` at once with vLLM's error output (as
    ``EngineCore._send_error_outputs_to_client`` does), its ``stop_reason`` carrying
    :data:`~vllm_steer.integrations.protocol.REFUSED_PREFIX` (a refusal, HTTP 400),
    :data:`~vllm_steer.integrations.protocol.BUSY_PREFIX` (no room in the bank now, HTTP
    429) or
    :data:`~vllm_steer.integrations.protocol.FAILED_PREFIX` (a fault of the plugin, HTTP 500)
    and ``message``: the API server's ``AsyncLLM.generate`` hook turns it into the client's
    answer instead of vLLM's generic 500. An engine core in the caller's process has no output
    queue: the output goes out with its client's next step (:func:`inproc_get_output`)."""
    prefix = {CLIENT_STATUS: REFUSED_PREFIX, BUSY_STATUS: BUSY_PREFIX}.get(status,
                                                                          FAILED_PREFIX)
    if vllm_access.core_output_queue(core) is not None:
        vllm_access.send_error_output(core, request, prefix + message)
        return
    refused = REFUSED_IN_PROCESS.get(core)
    if refused is None:
        refused = REFUSED_IN_PROCESS.set(core, [])
    refused.append(vllm_access.error_output(vllm_access.request_id(request), prefix + message))


#: The error outputs of the requests an engine core in the caller's process refused, not yet
#: handed to its client (:func:`inproc_get_output`).
REFUSED_IN_PROCESS: SideTable[list] = SideTable()


def inproc_get_output(orig, self):
    """``InprocClient.get_output`` (the engine core stepped in the caller's process: offline
    ``LLM`` with ``VLLM_ENABLE_V1_MULTIPROCESSING=0``): the step's outputs, and the error
    outputs of the requests the engine core refused since the last step (:func:`send_refusal`),
    as an engine core process hands them to its client on its output queue. vLLM's output
    processor then finishes each refused request (``finish_reason`` ``"error"``, the refusal in
    ``stop_reason``): raised from the engine core instead, it would stay unfinished there,
    and the ``LLM``'s next ``generate`` would wait for it forever."""
    outputs = orig(self)
    refused = REFUSED_IN_PROCESS.get(vllm_access.inproc_engine_core(self))
    if refused:
        vllm_access.extend_outputs(outputs, refused)
        refused.clear()
    return outputs
