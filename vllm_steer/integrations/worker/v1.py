"""vLLM's V1 model runner (the CPU runner and the V1 GPU runner): the hooks that give the
worker's :class:`~vllm_steer.integrations.worker.runtime.SteerRuntime` what the per-request
state (:class:`~vllm_steer.integrations.request_state_v1.SteerRequestStateV1`) cannot
see: the generated-token index of each batch row, the rows of prompt logprobs. Semantics: see
:mod:`vllm_steer.reference`. Speculative decoding on this runner:
:mod:`vllm_steer.integrations.worker.spec_v1`.

Each hook reads the runner's runtime from its binding
(:class:`~vllm_steer.integrations.worker.runtime.V1RunnerBinding`, ``.of(runner)``: one
dictionary read per step) and reads vLLM's arguments by name
(:class:`~vllm_steer.integrations.worker.arguments.Arg`).
"""

from __future__ import annotations

import contextlib

from vllm_steer.integrations.worker.arguments import Arg
from vllm_steer.integrations.worker.gates import GATES
from vllm_steer.integrations.worker.rows import NO_ROWS, PromptRows
from vllm_steer.integrations.worker.runtime import V1RunnerBinding
from vllm_steer.integrations.worker.spec_v1 import start_step
from vllm_steer.integrations.worker.step_faults import ROWS, attach
from vllm_steer.integrations.vllm_access import (v1_batch_positions,
                                                  v1_corrected_computed_tokens,
                                                  v1_has_prompt_logprobs,
                                                  v1_input_batch, v1_model_compute_logits,
                                                  v1_num_reqs,
                                                  v1_query_start_loc,
                                                  v1_speculates, v1_step_output, v1_step_tokens,
                                                  v1_untrack_output_token_ids)

_NUM_SCHEDULED = Arg("num_scheduled_tokens")
_HIDDEN_STATES = Arg("hidden_states")


def prepare_inputs(orig, self, *args, **kwargs):
    """``GPUModelRunner._prepare_inputs``: a speculative step's views of its rows start here
    while a request is steered (:func:`~vllm_steer.integrations.worker.spec_v1.start_step`;
    vLLM maps the verification rows inside); then the runtime gets the index of the generated
    token each batch row samples, while some slot has a generation window (host arrays only,
    one vectorised expression per step), and the tokens' coefficients of the decoder layers'
    steers. Gated (``Hook.gates``): in a process with no engine that speculates, no slot with
    a generation window and no decoder-layer steer, vLLM's method runs without it; otherwise
    two integer reads (three when steered; the runner is asked whether it speculates only in
    a process with an engine that does).

    Row i (request i of the persistent batch) samples the token after its scheduled ones:
    generated index ``num_computed_tokens + num_scheduled_tokens - num_prompt_tokens`` (0: the
    first generated token; a preempted request resumes with its outputs counted as computed;
    the sample of a non-final prefill chunk is discarded by vLLM, whatever its index).
    """
    gates = GATES
    if gates.steered_slots and gates.speculative_runtimes and v1_speculates(self):
        out = start_step(orig, self, args, kwargs)
    else:
        out = orig(self, *args, **kwargs)
    if not (gates.windowed_slots or gates.layer_mappings):  # most steps
        return out
    rt = V1RunnerBinding.of(self).runtime
    if rt is None:
        return out
    tokens = rt.step.tokens  # the tokens' coefficients for the decoder layers' steers
    layers = tokens is not None and not tokens.idle
    if not (rt.slots.num_window_slots or layers):
        return out
    with rt.faults.guard(ROWS):  # a fault: the step's steered requests fail
        rt.step.batch_positions = None
        batch = v1_input_batch(self)
        scheduled = _NUM_SCHEDULED.get(orig, (self, *args), kwargs)
        n, computed = v1_num_reqs(batch), None
        if gates.speculative_runtimes and rt.slots.any_windowed(slice(n)):
            # the host counts take the previous step's drafts as accepted (async scheduling):
            # a window needs the true ones, for the head's rows and the layers' tokens alike,
            # as the verification rows do
            computed = v1_corrected_computed_tokens(self, n)
        if rt.slots.num_window_slots:  # read only for windowed slots' rows
            rt.step.batch_positions = v1_batch_positions(batch, scheduled, computed)
        if layers:
            tokens.build_or_clear(*v1_step_tokens(batch, scheduled, computed))
    return out


def sample_tokens(orig, self, out):
    """``GPUModelRunner.sample_tokens`` (V1), run after it (``Hook.after``): the step's output
    ``out`` names the requests a fault of the plugin's worker code failed in this step
    (:mod:`~vllm_steer.integrations.worker.step_faults`), for the engine core to finish with
    HTTP 500. Called only when a fault waits as vLLM's method returns (gated by the faults):
    nothing of the plugin's runs in any other step."""
    rt = V1RunnerBinding.of(self).runtime
    if rt is None or not rt.faults.pending:
        return out
    output, req_ids = v1_step_output(out)  # row i of the batch is slot i
    attach(output, rt.faults.take(req_ids, None, rt.slots.steered))
    return out


def input_batch_init(orig, self, *args, **kwargs):
    """``InputBatch.__init__``: do not make V1 track output token ids for this plugin's sake.

    V1 cannot know whether a custom logits processor reads the requests' output token ids, so
    it tracks them whenever one is loaded; under async scheduling (GPU) that is a wait for the
    previous step's sampled tokens and a Python loop over the batch at every step. When every
    custom processor of the batch declares ``needs_output_token_ids = False`` (this plugin's
    does), the tracking is left off; penalties, bad words and thinking budgets still turn it
    on per batch, as in vLLM.
    """
    orig(self, *args, **kwargs)
    v1_untrack_output_token_ids(self)


def get_prompt_logprobs_dict(orig, self, *args, **kwargs):
    """``GPUModelRunner._get_prompt_logprobs_dict``: steer prompt logprobs of a steered request
    like its sampled tokens.

    ``_get_prompt_logprobs_dict`` calls ``compute_logits`` once per request on a slice of the
    step's hidden states: the step's prompt view (:class:`PromptRows`: those hidden states and
    each request's first token) is written for the call, and the head maps each slice back to
    its request's batch slot by its address. A fault in preparing that view leaves every
    prompt row unsteered and fails the step's steered requests.
    """
    if not GATES.prompt_logprob_slots or not v1_has_prompt_logprobs(self):  # (gated by it)
        return orig(self, *args, **kwargs)
    rt = V1RunnerBinding.of(self).runtime
    if rt is None or not rt.planner.active:
        return orig(self, *args, **kwargs)
    with contextlib.ExitStack() as scope:
        prompt = NO_ROWS  # a fault: no prompt row steered (nor taken for the sampled rows)
        with rt.faults.guard(ROWS):  # a fault: the step's steered requests fail
            rows = PromptRows(base=_HIDDEN_STATES.get(orig, (self, *args), kwargs),
                              query_start_loc=v1_query_start_loc(self))
            # each call's rows as the model's compute_logits gets them (a model may transform
            # them before the head: MiMo's final norm)
            scope.enter_context(v1_model_compute_logits(self, rows.logits_fn))
            prompt = rows
        scope.enter_context(rt.step.prompts(prompt))
        return orig(self, *args, **kwargs)
