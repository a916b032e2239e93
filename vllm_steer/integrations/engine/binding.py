"""Admission in the engine core: each steer a request is served with bound to the bank slot
and the load that hold it.

The plugin's hook on ``EngineCore.add_request`` (:func:`vllm_steer.integrations.engine.core.
add_request`) calls :func:`bind_request` for every request, whatever its entry point (HTTP,
``--api-server-count``, data parallelism, offline ``LLM``). The frontend has parsed the
request's steers and applied the operator's policy (presets, ``--steer-default``,
``--steer-floor``) once; the engine core decodes their serialised form once
(:meth:`~vllm_steer.request.SteerRequest.from_wire`), loads a steer from ``--steer-dir`` on its
first use, and writes the bound form the workers read
(:class:`~vllm_steer.request.BoundSteer`, under :data:`~vllm_steer.request.BOUND_KEY`).
Light: no torch at import time.
"""

from __future__ import annotations

from vllm_steer import REQUEST_FIELD
from vllm_steer.integrations.engine.management import load_steer_file
from vllm_steer.integrations.engine.state import engine_state
from vllm_steer.integrations.protocol import SOURCE_STEER_DIR, steer_dir_file
from vllm_steer.request import BOUND_KEY, BoundSteer, SteerRequest, SteerRequestError


class SteerAdmissionError(ValueError):
    """A request names a steer the engine cannot serve (unloaded, or its file was refused)."""


def bind_request(core, request) -> None:
    """Bind the steers of ``request`` (an engine-core ``Request``) in this engine core: each
    steer it is served with gets the ``(bank_slot, load_id)`` that holds it, loading it from
    ``--steer-dir`` on first use, written into its sampling params (:data:`BOUND_KEY`).

    Raises :class:`SteerAdmissionError` when a named steer is not loaded (and not in
    ``--steer-dir``), its file there is refused, or the serialised form cannot be read; the
    message is the one the API server's own check gives
    (:func:`vllm_steer.integrations.protocol.steer_dir_file`).
    """
    sp = getattr(request, "sampling_params", None)
    if sp is None:
        return
    extra = getattr(sp, "extra_args", None) or {}
    if BOUND_KEY in extra:  # only the engine core writes it
        extra = {k: v for k, v in extra.items() if k != BOUND_KEY}
        sp.extra_args = extra
    reg = engine_state(core).registry
    value = extra.get(REQUEST_FIELD)
    if reg is None or value is None:
        return
    try:  # request data never raises out of the engine core: refuse this request only
        steers = SteerRequest.from_wire(value)
    except SteerRequestError as e:
        raise SteerAdmissionError(str(e)) from None
    names = list(steers.strengths)
    for name in names:
        if name not in reg.bound:
            _load_from_steer_dir(core, name)
    slots = reg.bind(names)
    values = steers.named
    bound = [BoundSteer(n, *slots[n], values[n]) for n in names]
    sp.extra_args = {**extra, BOUND_KEY: BoundSteer.to_wire(bound)}


def _load_from_steer_dir(core, name: str) -> None:
    """Load ``name`` from ``--steer-dir`` (its first use), or refuse the request."""
    st = engine_state(core)
    try:
        path = steer_dir_file(st.config.steer_dir, name, st.registry.names(), REQUEST_FIELD)
    except SteerRequestError as e:
        raise SteerAdmissionError(str(e)) from None
    res = load_steer_file(core, name, path, SOURCE_STEER_DIR)
    if not res["ok"]:
        raise SteerAdmissionError(f"{REQUEST_FIELD}: {res['error']}")
