"""vLLM's Model Runner V2 (the GPU default): the hooks that map each step's rows to request
slots (the per-request state itself: :mod:`vllm_steer.integrations.request_state_v2`).

Semantics: see :mod:`vllm_steer.reference`. Thin by design: V2 keeps request state in slots
(``add_request(slot, params)``) and tells, per step, which slot each logits row belongs to
(``expanded_idx_mapping``). That mapping is needed *before* ``compute_logits``, so the runner's
``sample()`` is wrapped to write it as the step's sampled rows
(:class:`~vllm_steer.integrations.worker.step_mapping.StepMapping`) for the LM-head call.
V2 never says that a request finished, so the head works only in steps whose batch
(``idx_mapping``) holds a steered slot. Under batch-sharded sampling (TP > 1) rows come
owner-sorted; they are mapped through the sharder's own sort. Tested live in
tests/e2e/test_vllm_v2.py (through the test shim tests/v2shim) and piecewise in
tests/integrations/worker/test_v2.py.
Prompt logprobs are steered too: the prompt-logprob worker's ``compute_logits`` calls (chunks
that may hold rows of several requests) are slices of the step's hidden states, each row's
request slot that of its token, from host-side data (:func:`prompt_logprobs`).
Speculative decoding: the verification rows (``num_draft_tokens + 1`` per request) come
through the same ``expanded_idx_mapping``; drafters are steered too (a draft model on host
rows, EAGLE / EAGLE-3 / MTP inside CUDA graphs: :mod:`vllm_steer.integrations.worker.spec_v2`).
Each hook reads the runner's runtime from its binding (one dictionary read per step) and vLLM's
arguments by name (:class:`~vllm_steer.integrations.worker.arguments.Arg`).
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch

from vllm_steer.integrations.worker.arguments import Arg
from vllm_steer.integrations.worker.gates import GATES
from vllm_steer.integrations.worker.rows import NO_ROWS, MappedRows, PromptRows
from vllm_steer.integrations.worker.runtime import BINDINGS, V2RunnerBinding, current_runtime
from vllm_steer.integrations.worker.spec_decode import prepare_drafter_once
from vllm_steer.integrations.worker.step_faults import HEAD, REQUEST_STATE, ROWS, attach
from vllm_steer.integrations import vllm_access as va
from vllm_steer.integrations.vllm_access import v2_req_ids as _req_ids  # every steered step

_INPUT_BATCH = Arg("input_batch")
_SCHEDULER_OUTPUT = Arg("scheduler_output")
_BINDINGS_BY_ID = BINDINGS.by_id  # each runner's binding: read in sample() with no call
_HIDDEN_STATES = Arg("hidden_states")
_LOGITS_FN = Arg("logits_fn")


def sample(orig, self, *args, **kwargs):
    """``GPUModelRunner.sample`` (V2): the step's sampled rows (row -> slot) for V2's
    ``sample()``, which calls the head; outside it (warm-up, dummy runs) the step has none.

    The head works only when a slot of this step's batch (``idx_mapping``) is steered: V2 has
    no removal callback, and a finished request's slot must cost nothing.

    Rows are the sampled rows of the step in batch order (``expanded_idx_mapping``), except
    under batch-sharded sampling (``--enable-batch-sharded-sampling``, TP > 1), where
    ``sample()`` computes the logits of ``hidden_states[sorted_logits_indices]`` (rows sorted
    by owner rank): there each row's slot is that of the token it was gathered from, read
    through the very indices the runner's ``BatchSharder`` returns.

    A step with steered rows whose ``sample()`` never reached the head (a path that computes
    logits without the model's logits layer) records :class:`HeadBypassedError` as a fault of
    the head instead of serving those rows unsteered: the step's steered requests fail with
    its message, the others are served (one integer comparison per steered step). A fault in
    mapping the rows leaves them unsteered and fails the step's steered requests alike
    (:mod:`~vllm_steer.integrations.worker.step_faults`).

    Per step: nothing while no request in the process is steered (the hook is gated by the
    steered slots: vLLM's method runs without it, ``Hook.gates``). Otherwise the runner's
    binding is one dictionary read, and a step with the request ids of the runner's last
    steered step, in the same order, reuses its rows when no request was put into a slot
    since and the request-slot table is unchanged (a steady decode step: ``input_batch`` one
    index at the place found by name from ``orig``'s signature at the first steered call,
    three comparisons, no numpy; that table still holds a steered slot, so no gate is read).
    With the caches cold after vLLM's step, each call made here costs a few µs. V2 gives a
    request its slot when it adds the request (and
    then calls the per-request state's ``add_request``, counted in
    :attr:`~vllm_steer.integrations.worker.request_slots.RequestSlots.assigned`), so the same
    ids with none added are the same slots, even when a finished request's id comes back.
    Another batch is checked and mapped from host arrays (:func:`_batch_rows`), the bytes of
    its slots keying the check of the batch
    (:meth:`~vllm_steer.integrations.worker.request_slots.RequestSlots.any_steered`) and the
    head's step (:class:`MappedRows` ``key``).
    """
    b = _BINDINGS_BY_ID.get(id(self))  # V2RunnerBinding.of(self), inline: every steered step
    source = None
    if b is not None and b.steady_ids is not None:  # the runner's last steered batch
        try:
            ids = _req_ids(args[b.sample_batch_at])  # its place is known by then
        except Exception:  # noqa: BLE001 - passed by keyword (IndexError), or unreadable:
            ids = None  # the step is mapped again, under its fault guard (_step_rows)
        if ids == b.steady_ids:  # the same requests in the same order, none added since
            table = b.runtime.slots
            if b.steady_assigned == table.assigned and b.steady_version == table.version:
                source = b.steady_rows  # a steady decode step: the last steered step's rows
    if source is None:
        b, source = _step_rows(b, orig, self, args, kwargs)
        if source is None:  # no steered request in this step's batch (or a fault)
            return orig(self, *args, **kwargs)
    rt = b.runtime
    planner = rt.planner
    step = rt.step
    calls = planner.head_calls
    try:
        step.sampled = source
        if source.slots is not None:
            out = orig(self, *args, **kwargs)
        else:  # batch-sharded sampling: the rows' slots through the sharder's own sort
            with contextlib.ExitStack() as scope:
                with rt.faults.guard(ROWS):  # a fault: no row steered, steered requests fail
                    step.sampled = NO_ROWS
                    input_batch = _sample_input_batch(b, orig, self, args, kwargs)
                    scope.enter_context(_sorted_rows(va.v2_batch_sharder(self), input_batch,
                                                     rt, self))
                    step.sampled = source
                out = orig(self, *args, **kwargs)
    finally:
        step.sampled = NO_ROWS
    if planner.head_calls == calls:  # sampled unsteered: the step's steered requests fail
        rt.faults.record(HEAD, HeadBypassedError(HEAD_BYPASSED))
    return out


#: :attr:`V2RunnerBinding.sample_batch_at` of a ``sample()`` whose ``input_batch`` is
#: keyword-only: past any call's positional arguments, so it is always read by name
_BY_NAME = 1 << 30


def _sample_input_batch(b, orig, runner, args, kwargs):
    """``sample()``'s ``input_batch``: at the runner's first steered call its place among the
    positional arguments is found by name from ``orig``'s signature (and kept in the
    binding); passed by keyword (or keyword-only), it is read by name."""
    if b.sample_batch_at is None:
        pos = _INPUT_BATCH.position(orig)  # counts self
        b.sample_batch_at = _BY_NAME if pos is None else pos - 1
    if b.sample_batch_at < len(args):
        return args[b.sample_batch_at]
    return _INPUT_BATCH.get(orig, (runner, *args), kwargs)


def _step_rows(b, orig, runner, args, kwargs):
    """``(binding, sampled rows)`` of a ``sample()`` call that is not a steady step (or whose
    runner has no binding yet): the rows are None when nothing is steered in the process or
    in this step's batch, or when a fault of the mapping was recorded (the step's steered
    requests fail)."""
    if not GATES.steered_slots:  # no steered request in this process (a hook not gated)
        return b, None
    if b is None:
        b = V2RunnerBinding.of(runner)
    rt = b.runtime
    if rt is None:
        return b, None
    with rt.faults.guard(ROWS):  # a fault: the step's steered requests fail
        input_batch = _sample_input_batch(b, orig, runner, args, kwargs)
        return b, _batch_rows(runner, b, rt, input_batch)
    return b, None


def prepare_inputs(orig, self, *args, **kwargs):
    """``GPUModelRunner.prepare_inputs`` (V2): the tokens' part of the step mapping, for the
    decoder layers' steers (:class:`~vllm_steer.integrations.worker.step_mapping.TokenCoefs`),
    built from the input batch's host arrays before the model's forward. Gated
    (``Hook.gates``): in a process whose model has no such op, vLLM's method runs without
    it."""
    input_batch = orig(self, *args, **kwargs)
    if not GATES.layer_mappings:
        return input_batch
    rt = V2RunnerBinding.of(self).runtime
    if rt is not None and rt.step.tokens is not None and not rt.step.tokens.idle:
        with rt.faults.guard(ROWS):  # a fault: the step's steered requests fail
            rt.step.tokens.build_or_clear(*va.v2_step_tokens(
                self, input_batch, _true_computed(rt, self, input_batch, keep=True)))
    return input_batch


def add_requests(orig, self, *args, **kwargs):
    """``GPUModelRunner.add_requests`` (V2), then: on a pipeline
    stage without the LM head vLLM builds no sampler, so the per-request steer state (a
    logits processor of the sampler) never gets ``add_request``; the stage's decoder blocks
    still add each request's vectors, so its new requests are put into their request slots
    here. Gated by the decoder-layer mappings."""
    out = orig(self, *args, **kwargs)
    if not GATES.layer_mappings:
        return out
    rt = V2RunnerBinding.of(self).runtime
    if rt is None or rt.step.tokens is None or va.v2_has_sampler(self):
        return out
    scheduler_output = _SCHEDULER_OUTPUT.get(orig, (self, *args), kwargs)
    with rt.faults.guard(REQUEST_STATE):
        for slot, params in va.v2_new_request_slots(self, scheduler_output):
            rt.assign(slot, params)
        rt.slots.flush()
    return out


def sample_tokens(orig, self, out):
    """``GPUModelRunner.sample_tokens`` (V2), run after it (``Hook.after``): the step's output
    ``out`` names the requests a fault of the plugin's worker code failed in this step
    (:mod:`~vllm_steer.integrations.worker.step_faults`), for the engine core to finish with
    HTTP 500. Called only when a fault waits as vLLM's method returns (gated by the faults):
    nothing of the plugin's runs in any other step."""
    rt = V2RunnerBinding.of(self).runtime
    if rt is None or not rt.faults.pending:
        return out
    output, req_ids = va.v2_step_output(out)
    attach(output, rt.faults.take(req_ids, va.v2_request_slots(self, req_ids),
                                  rt.slots.steered))
    return out


def _batch_rows(runner, b, rt, input_batch) -> MappedRows | None:
    """The sampled rows of a step whose batch differs from the last steered step's (or whose
    request-slot table changed): None when no slot of its batch is steered. Its drafter heads
    are checked at the runner's first steered step (:func:`prepare_drafter_once`), before its
    drafter proposes. A batch of one row per request with no generation window and no drafter
    is kept as the runner's steady rows (:attr:`V2RunnerBinding.steady_rows`, with its request
    ids): the next steps of that batch map nothing again."""
    if not b.drafter_checked:  # the first steered step: the drafter is loaded by then
        prepare_drafter_once(runner, b)  # which drafter heads stay steered (spec_decode.py)
    table = rt.slots
    b.steady_rows = b.steady_ids = None
    if not table.num_active_slots:  # none of this runner's requests is steered
        return None
    idx = va.v2_batch_slots(input_batch)
    key = idx.tobytes()  # the batch's slots: the check's and the head's key
    if not table.any_steered(idx, key):
        return None
    if va.v2_batch_sharder(runner) is not None:
        return MappedRows(mapping=None)
    slots, positions = _host_rows(rt, runner, input_batch)
    source = MappedRows(va.v2_row_mapping(input_batch), slots, positions,
                        key if slots is idx else None)
    if slots is idx and positions is None and va.v2_speculator(runner) is None:
        b.steady_rows = source
        b.steady_ids = list(va.v2_req_ids(input_batch))  # a copy: never vLLM's
        b.steady_version, b.steady_assigned = table.version, table.assigned
    return source


class HeadBypassedError(RuntimeError):
    """A step with steered requests was sampled without calling the model's logits layer."""


HEAD_BYPASSED = (
    "vllm-steer: this step's batch holds steered requests, but vLLM sampled it without calling "
    "the model's logits layer (compute_logits), where steers are applied: a sampling path that "
    "computes logits straight from lm_head.weight (such as a greedy fast path of a newer vLLM) "
    "would serve them unsteered. Turn that path off, or serve this vLLM without --steer")


def _host_rows(rt, runner, input_batch):
    """The step's row -> slot (``expanded_idx_mapping``) and, while some slot has generation
    windows, the generated-token index each row samples, from the input batch's host arrays
    (no device read): request i (slot ``idx[i]``) has ``cu_num_logits[i + 1] -
    cu_num_logits[i]`` rows, its last one sampling token ``num_computed + num_scheduled -
    prompt_len``."""
    idx = va.v2_batch_slots(input_batch)
    nr = len(idx)
    cu = va.v2_logits_offsets(input_batch)
    one_each = len(cu) <= nr or int(cu[nr]) - int(cu[0]) == nr  # no draft rows: the common case
    if one_each and not rt.slots.num_window_slots:
        return idx, None
    cu = cu[: nr + 1]
    counts = None if one_each else np.diff(cu)
    slots = idx if one_each else np.repeat(idx, counts)
    if not rt.slots.num_window_slots:
        return slots, None
    last = va.v2_last_positions(runner, input_batch, _true_computed(rt, runner, input_batch))
    if last is None or one_each:
        return slots, last
    local = np.arange(cu[nr] - cu[0]) - np.repeat(cu[:-1] - cu[0], counts)
    return slots, np.repeat(last - counts + 1, counts) + local


def _true_computed(rt, runner, input_batch, keep: bool = False):
    """The computed-token counts of the step's requests read from the device, where a
    generation window under speculative decoding needs them (the host's take the previous
    step's drafts as accepted); None where the host's serve. A wait for the device, once a
    step: the read of ``prepare_inputs`` (``keep``: the decoder layers' tokens) is kept for the
    same input batch's ``sample()`` (the head's rows), which takes it."""
    kept, rt.step.computed = rt.step.computed, None
    if not rt.slots.num_window_slots or va.v2_speculator(runner) is None:
        return None
    if kept is not None and kept[0] is input_batch:
        return kept[1]
    idx = va.v2_batch_slots(input_batch)
    if not len(idx) or not rt.slots.any_windowed(idx):
        return None
    computed = va.v2_device_computed_tokens(runner, idx)
    if keep:
        rt.step.computed = (input_batch, computed)
    return computed


#: Each sharder's pending row index while its runner's ``sample()`` runs (by ``id``):
#: ``(index, table, step rows, faults)``, read by :func:`shard_sampler_inputs`.
_SHARDING: dict[int, tuple] = {}


@contextlib.contextmanager
def _sorted_rows(sharder, input_batch, rt, runner):
    """Make the owner-sorted logits rows the sharder returns the step's sampled rows, through
    the hook on ``BatchSharder.shard_sampler_inputs`` (:func:`shard_sampler_inputs`), which
    records a fault in the runtime's :class:`~vllm_steer.integrations.worker.step_faults.
    StepFaults`.

    The row order exists only on the device (``sorted_logits_indices``, token indices), so the
    host maps *tokens*: each scheduled token's row of the table the head reads, from host
    arrays (:meth:`~vllm_steer.integrations.worker.planner.StepPlanner.sharded_index`: its
    slot, or, when a row of the step is windowed, its sampled row's coefficients at its
    generated token, as the other paths compute them), copied to a persistent device buffer;
    the sharder's indices then pick each sorted row's entry on the device. No device value is
    read. A fault here is the caller's (``sample()``'s guard: no row steered)."""
    slots, positions = _host_rows(rt, runner, input_batch)
    index, table = rt.planner.sharded_index(
        va.v2_token_slots(input_batch), va.v2_logits_tokens(input_batch), slots, positions)
    _SHARDING[id(sharder)] = (index, table, rt.step, rt.faults)  # this step only
    try:
        yield
    finally:
        _SHARDING.pop(id(sharder), None)


def shard_sampler_inputs(orig, self, *args, **kwargs):
    """``BatchSharder.shard_sampler_inputs`` (V2, batch-sharded sampling): inside a steered
    ``sample()`` (:func:`_sorted_rows`), map each owner-sorted logits row to its row of the
    head's table (one gather on the device, through the sharder's own indices); otherwise
    vLLM's own call, untouched (one dictionary read). A fault here (this vLLM returning
    another layout, named in the message) leaves every row unsteered and fails the step's
    steered requests with it."""
    out = orig(self, *args, **kwargs)
    pending = _SHARDING.get(id(self))
    if pending is None:
        return out
    index, table, step, faults = pending
    mapped = NO_ROWS  # a fault: no row steered
    with faults.guard(ROWS):  # a fault: the step's steered requests fail
        sorted_idx = out[1] if isinstance(out, tuple) and len(out) == 4 else None
        if not isinstance(sorted_idx, torch.Tensor) or sorted_idx.dtype.is_floating_point:
            raise RuntimeError(
                "vllm-steer: BatchSharder.shard_sampler_inputs no longer returns (batch, "
                "sorted_logits_indices, grammar_output, metadata) in this vLLM; steered rows "
                "cannot be matched to requests. Run without --enable-batch-sharded-sampling")
        mapped = MappedRows(mapping=index.index_select(0, sorted_idx), table=table)
    step.sampled = mapped
    return out


def prompt_logprobs(orig, self, *args, **kwargs):
    """``PromptLogprobsWorker.compute_prompt_logprobs`` (V2): steer prompt logprobs like the
    sampled tokens (:func:`_steered_prompt_call`).

    vLLM calls it at every step; it computes nothing unless a running request asked for
    prompt logprobs, which vLLM records in ``in_progress_prompt_logprobs`` (an entry per such
    request, from ``add_request`` to ``remove_request``). While no request slot of the process
    holds a request that asked for prompt logprobs, vLLM's method runs without it (gated,
    ``Hook.gates``); while none is steered, one integer read
    (:data:`~vllm_steer.integrations.worker.gates.GATES`); then that record."""
    if not (GATES.prompt_logprob_slots and GATES.steered_slots) \
            or not va.v2_prompt_logprobs_pending(self):
        return orig(self, *args, **kwargs)
    return _steered_prompt_call(orig, self, args, kwargs)


def prompt_token_id_logprobs(orig, self, *args, **kwargs):
    """``PromptLogprobsWorker.compute_prompt_token_id_logprobs`` (V2, ``prompt_logprob_token_ids``):
    as :func:`prompt_logprobs`; vLLM's own record of such requests is ``token_id_scores``."""
    if not (GATES.prompt_logprob_slots and GATES.steered_slots) \
            or not va.v2_prompt_token_ids_pending(self):
        return orig(self, *args, **kwargs)
    return _steered_prompt_call(orig, self, args, kwargs)


def _steered_prompt_call(orig, self, args, kwargs):
    """Steer prompt logprobs like the sampled tokens.

    ``PromptLogprobsWorker.compute_prompt_logprobs`` runs the step's token rows through
    ``compute_logits`` in fixed-size chunks that may hold rows of several requests;
    ``compute_prompt_token_id_logprobs`` slices one request at a time. Either way the calls are
    views of the step's hidden states (``hidden_states[a:b]``): the step's prompt view
    (:class:`PromptRows`: those hidden states and each token's slot, ``idx_mapping_np``
    repeated over ``query_start_loc_np``) is written for the call, and the head finds each
    call's rows by their address (host-side, no device read).
    """
    rt = current_runtime()  # the prompt-logprob worker has no config: the worker's runtime
    if rt is None or not rt.slots.num_active_slots:
        return orig(self, *args, **kwargs)
    call, prompt = (self, *args), NO_ROWS  # a fault: vLLM's call, no prompt row steered
    with rt.faults.guard(ROWS):  # a fault: the step's steered requests fail
        input_batch = _INPUT_BATCH.get(orig, call, kwargs)
        if rt.any_steered(va.v2_batch_slots(input_batch)):
            rows = PromptRows(base=_HIDDEN_STATES.get(orig, call, kwargs),
                              token_slots=va.v2_token_slots(input_batch))
            # each call's rows as the model's compute_logits gets them (a model may transform
            # them before the head: MiMo's final norm)
            fn = rows.logits_fn(_LOGITS_FN.get(orig, call, kwargs))
            call, kwargs = _LOGITS_FN.replace(orig, call, kwargs, fn)
            prompt = rows
        else:
            prompt = None  # no steered request in the batch: vLLM's call as it is
    if prompt is None:
        return orig(*call, **kwargs)
    with rt.step.prompts(prompt):
        return orig(*call, **kwargs)
