"""The worker's half of run-time steer management: the engine core sends each op to every
worker (all TP ranks) with the executor's ``collective_rpc`` (:func:`worker_op`)."""

from __future__ import annotations

from typing import Any

from vllm_steer.integrations.worker.runtime import Binding


def worker_op(worker, op: str, *args) -> Any:
    """Runs in every worker (``collective_rpc`` with a callable): change or report bank
    slots."""
    rt = Binding.of(worker).runtime
    if rt is None:
        return None
    if op == "put":
        bank_slot, load_id, name, steer = args
        if rt.bank_state.bank is None:  # no LM head here (an earlier pipeline stage): no steers
            return False
        rt.put_steer(bank_slot, load_id, name, steer)
        return True
    if op == "drop":
        rt.drop_slots(args[0])
        return True
    if op == "stats":
        bank = rt.bank_state.bank
        return {**rt.planner.op_timer.report(), "op_calls": rt.planner.op_calls,
                "head_eager": int(rt.bank_state.head_eager()),
                "slots": [] if bank is None else
                [[i, g, n] for i, (g, n) in enumerate(zip(bank.load_ids, bank.names, strict=True))
                 if n is not None]}
    raise ValueError(f"unknown steer worker op {op!r}")
