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
from vllm_steer.integrations import vllm_access as va
from vllm_steer.integrations.engine.management import (in_use_by_requests, load_steer_file,
                                                     never_fits)
from vllm_steer.integrations.engine.state import engine_state
from vllm_steer.integrations.protocol import SOURCE_STEER_DIR, count_problem, steer_dir_file
from vllm_steer.request import (BOUND_KEY, BoundSteer, SteerRequest, SteerRequestError, Window,
                                 refusal_reason)


#: The refusal reason (``REFUSAL_REASONS``) of a streaming-input session's chunk refused.
STREAMING_INPUT = "streaming_input"


class SteerAdmissionError(SteerRequestError):
    """A request names a steer the engine cannot serve (unloaded, its file refused, more
    steers than the bank holds at once): the request's HTTP 400."""


class SteerBankFullError(SteerAdmissionError):
    """A request's first-use steers find no room in the bank now (every slot they could take
    holds a steer running requests use): the request's HTTP 429, to be retried."""


def bind_request(core, request) -> None:
    """Bind the steers of ``request`` (an engine-core ``Request``) in this engine core: each
    steer it is served with gets the ``(bank_slot, load_id)`` that holds it, loading it from
    ``--steer-dir`` on first use, written into its sampling params (:data:`BOUND_KEY`).

    Admission is planned before anything is loaded: the count is checked against
    ``--max-steers-per-request`` and ``--max-steers`` (:func:`~vllm_steer.integrations.
    protocol.count_problem`), every first-use file is found, and the bank must have room for
    all of them at once without evicting a steer a running request uses or one this request
    names. A first-use load therefore never evicts a steer bound earlier in the same request.

    A streaming-input session (vLLM's ``resumable`` requests) sends each later input chunk,
    and the end of its input, as a new request of its id. The end is not bound: vLLM reads
    only its id and finishes the session, which a refusal would keep waiting for ever. A
    later chunk is bound as any request, and must keep the session's vector steers
    (:func:`check_session_chunk`).

    Raises :class:`SteerAdmissionError` when a named steer is not loaded (and not in
    ``--steer-dir``), its file there is refused, the request names too many steers, or the
    serialised form cannot be read; :class:`SteerBankFullError` when the bank has no room
    for them now; the message is the one
    the API server's own check gives (:func:`vllm_steer.integrations.protocol.steer_dir_file`).
    """
    session = va.streaming_session(core, request)
    if session is not None and not va.is_resumable(request):
        return  # the end of a session's input: nothing of it is served
    _bind(core, request)
    if session is not None:
        check_session_chunk(core, session, request)


def _bind(core, request) -> None:
    """:func:`bind_request` of one request, a session's input chunk included."""
    sp = va.sampling_params(request)
    if sp is None:
        return
    extra = va.extra_args(sp)
    if BOUND_KEY in extra:  # only the engine core writes it
        extra = {k: v for k, v in extra.items() if k != BOUND_KEY}
        va.set_extra_args(sp, extra)
    value = extra.get(REQUEST_FIELD)
    if value is None:  # an unsteered request: nothing of the plugin's state is read for it
        return
    st = engine_state(core)
    reg = st.registry
    if reg is None:
        return
    try:  # request data never raises out of the engine core: refuse this request only
        steers = SteerRequest.from_wire(value)
    except SteerRequestError as e:
        raise SteerAdmissionError(str(e), refusal_reason(e)) from None
    names = list(steers.strengths)
    for name in steers.named:  # a name at strength 0 applies nothing, but must exist
        if name not in steers.strengths and reg.get(name) is None:
            _steer_dir_path(core, name)
    problem = count_problem(names, st.config.per_request, reg.capacity, REQUEST_FIELD)
    if problem:
        raise SteerAdmissionError(problem, "too_many_steers")
    missing = [n for n in names if n not in reg.bound]
    if missing:
        paths = {n: _steer_dir_path(core, n) for n in missing}  # every file found first
        in_use = in_use_by_requests(core)
        room = reg.room(in_use, protect=names)
        if len(missing) > room:
            if len(reg.never_evicted() | set(names)) > reg.capacity:  # never fits: a 400
                raise SteerAdmissionError(f"{REQUEST_FIELD}: "
                                          + never_fits(reg, missing[0], names),
                                          "too_many_steers")
            reg.counters["bank_full"] += 1  # contention, not a failure: retry later (429)
            raise SteerBankFullError(_no_room(reg, names, missing, room), "bank_full")
        for name in missing:
            res = load_steer_file(core, name, paths[name], SOURCE_STEER_DIR, protect=names)
            if not res["ok"]:
                if res.get("status") == 507:
                    raise SteerBankFullError(f"{REQUEST_FIELD}: {res['error']}", "bank_full")
                raise SteerAdmissionError(f"{REQUEST_FIELD}: {res['error']}",
                                          res.get("reason", "bad_file"))
    slots = reg.bind(names)
    values = steers.named
    bound = [BoundSteer(n, *slots[n], values[n]) for n in names]
    va.set_extra_args(sp, {**extra, BOUND_KEY: BoundSteer.to_wire(bound)})
    if st.layers_enabled:
        if va.is_resumable(request):
            check_session_windows(reg, bound)
        salt_prefix_cache(request, reg, bound)


#: What starts the part of a request's ``cache_salt`` that names its decoder-layer steers.
SALT_PREFIX = "vllm-steer-layers:"


def layer_mix(reg, bound, prompt_tokens: int) -> str:
    """The request's mix of decoder-layer steers (vector steers), as a stable string: what
    each steer adds (its vectors' digest, :func:`vllm_steer.kinds.content_digest`) and its
    value (a strength or a window), in order; empty when it has none. A steer is named by its
    vectors, not by its name or load: a KV store that outlives the process or is shared by
    replicas (a KV connector) never serves blocks computed with other vectors loaded under the
    same name, and two loads of the same file share their blocks. LM-Steer steers are left
    out: they change only the sampled rows, never the keys and values, so their requests keep
    sharing the prefix cache. With a generation window the prompt's length too: a token's
    strength is the window's at the generated token its row samples, so the same tokens under
    the same window are computed at other strengths after a prompt of another length (a later
    turn of a chat reads its earlier reply's tokens as prompt, at the base strength)."""
    parts = []
    windowed = False
    for b, entry in _layer_steers(reg, bound):
        what = entry.content or f"{b.name}#{b.load_id}"  # content: set by every load
        parts.append(f"{what}={b.value!r}")
        windowed = windowed or _windowed(b)
    parts.sort()
    if windowed:
        parts.append(f"@prompt={prompt_tokens}")
    return ";".join(parts)


def _layer_steers(reg, bound) -> list:
    """``(bound steer, registry entry)`` of each decoder-layer steer (vector steer) of
    ``bound`` that applies something (a strength or a window's base not 0)."""
    out = []
    for b in bound:
        entry = reg.slots[b.bank_slot] if 0 <= b.bank_slot < len(reg.slots) else None
        if entry is not None and entry.kind != "lm-steer" and b.strength:
            out.append((b, entry))
    return out


def _windowed(b) -> bool:
    """Whether a bound steer's strength changes over the generated tokens (a window)."""
    return isinstance(b.value, Window) and b.value.strength != b.value.base


def salt_prefix_cache(request, reg, bound) -> None:
    """A request served with decoder-layer steers changes the keys and values of every later
    block: its prefix-cache blocks are salted with its mix (vLLM's ``cache_salt``, which the
    block hashes include), so that a prefix cached under one mix is never reused by a request
    with another mix, nor by an unsteered one. The request's own salt is kept in front. The
    block hashes vLLM computed when it made the request are computed again."""
    mix = layer_mix(reg, bound, va.prompt_tokens(request))
    if not mix:
        return
    import hashlib

    digest = hashlib.sha256(mix.encode()).hexdigest()[:32]
    own = va.cache_salt(request)
    va.resalt_request(request, f"{own or ''}|{SALT_PREFIX}{digest}")


def _layer_salt(request) -> str:
    """The part of a request's ``cache_salt`` that names its vector steers (what
    :func:`salt_prefix_cache` added); empty when it has none."""
    salt = va.cache_salt(request) or ""
    at = salt.rfind("|" + SALT_PREFIX)
    return salt[at + 1:] if at >= 0 else ""


def check_session_chunk(core, session, request) -> None:
    """Refuse a later input chunk of a streaming-input session (``request``, bound) whose
    vector steers are not the session's. vLLM keeps the session's ``cache_salt`` from its
    first chunk (a later chunk brings only its tokens and sampling params), and the salt enters
    only the first block's hash, the later blocks chaining from it: the blocks a chunk computes
    under another vector mix would be cached as the first mix's, and served, wrong, to the
    next request of that mix with the same tokens. LM-Steer steers change no key or value:
    they may change from chunk to chunk (the workers apply each chunk's own). The refusal
    reaches the client as the request's error, and its frontend aborts the session (the
    plugin's ``AsyncLLM.generate`` hook as it raises the refusal; vLLM 0.33 on any error)."""
    if _layer_salt(request) == _layer_salt(session):
        return
    reg = engine_state(core).registry  # a salt of the plugin's: steering is configured
    was, now = (_describe_layers(reg, va.sampling_params(r)) for r in (session, request))
    again = (" (the same names now hold other vectors: a steer was loaded again since the "
             "session began)") if was == now else ""
    raise SteerAdmissionError(
        f"{REQUEST_FIELD}: a streaming-input session keeps the vector steers it started with "
        f"({was}), but this input chunk asks for {now}{again}. Vector steers change the keys "
        "and values the session caches, and its prefix cache stays keyed by its first "
        "chunk's vector steers: send every chunk of the session with the same vector steers "
        "(LM-Steer steers may change from chunk to chunk), or start a new session for "
        "another mix of vector steers", STREAMING_INPUT)


def check_session_windows(reg, bound) -> None:
    """Refuse a generation window on a vector steer of a streaming-input session's input
    chunk. The window counts the tokens generated since the chunk's input, and a later chunk
    reads the session's earlier output as prompt, at the window's base strength, while the
    prefix cache, salted once for the session (:func:`check_session_chunk`), takes each
    token's strength to follow from the first chunk's prompt length (:func:`layer_mix`)."""
    names = [b.name for b, _ in _layer_steers(reg, bound) if _windowed(b)]
    if names:
        raise SteerAdmissionError(
            f"{REQUEST_FIELD}: a generation window on a vector steer "
            f"({', '.join(repr(n) for n in names)}) is not served to a streaming-input "
            "session: a later input chunk reads the session's output as prompt, at the "
            "window's base strength, and the prefix cache would hand its blocks to requests "
            "that computed the same tokens at other strengths. Give the vector steer a plain "
            "strength in a streaming-input session, or send the request without streaming "
            "input", STREAMING_INPUT)


def _describe_layers(reg, params) -> str:
    """The vector steers a request's bound steers apply, ``name=strength``, or "no vector
    steers"."""
    bound = BoundSteer.from_wire(va.extra_args(params).get(BOUND_KEY))
    steers = sorted(f"{b.name}={b.strength:g}" for b, _ in _layer_steers(reg, bound)) \
        if reg is not None else []
    return ", ".join(steers) or "no vector steers"


def _steer_dir_path(core, name: str) -> str:
    """The ``--steer-dir`` file of ``name`` (its first use), or refuse the request."""
    st = engine_state(core)
    try:
        return steer_dir_file(st.config.steer_dir, name, st.registry.names(), REQUEST_FIELD)
    except SteerRequestError as e:
        raise SteerAdmissionError(str(e), refusal_reason(e)) from None


def _no_room(reg, names, missing, room: int) -> str:
    """The refusal of a request whose first-use steers do not all fit in the bank now."""
    pinned = len(reg.never_evicted())
    used = reg.capacity - pinned - room
    return (f"{REQUEST_FIELD}: the request needs {len(missing)} steer(s) loaded from "
            f"--steer-dir ({', '.join(repr(n) for n in missing)}) but only {room} of the "
            f"{reg.capacity} steer slots can take one now (--max-steers={reg.capacity}: "
            f"{pinned} hold steers that are never evicted, {used} hold steers that running "
            "requests or this request use); retry when running requests finish, send fewer "
            f"steers at once (at most {reg.capacity - pinned} from --steer-dir), or restart "
            "with a larger --max-steers")
