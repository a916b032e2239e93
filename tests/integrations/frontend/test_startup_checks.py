"""Start-up checks (vllm_steer.integrations.frontend.startup_checks) without starting an engine: the
steer files, speculative decoding, pooling models and data-parallel modes are refused at
engine config creation, naming what and why; what is accepted gets our per-request steer state
(a vLLM logits processor)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from helpers.steers import random_steer
from vllm_steer.format import TENSOR_P1, TENSOR_P2, METADATA_KEY, save_steer


@pytest.fixture(scope="module")
def registered():
    """The plugin registered in this process (its hooks installed into vLLM)."""
    from vllm_steer.integrations import plugin

    plugin.register()


def _engine_config(model, steers, **kw):
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(model=str(model), max_model_len=256,
                      additional_config={"vllm_steer": {"steers": steers}},
                      **kw).create_engine_config()


def test_engine_config_installs_the_v1_request_state(registered, tiny_model_dir, tmp_path):
    p = tmp_path / "a.safetensors"
    save_steer(p, random_steer(64, 4, "a"))
    cfg = _engine_config(tiny_model_dir, {"a": str(p)})
    assert cfg.model_config.logits_processors == [
        "vllm_steer.integrations.request_state_v1:SteerRequestStateV1"]


def test_each_runners_request_state_is_named_by_its_module_and_class():
    """The names start-up writes (and the V1 speculative-decoding hook matches) are real
    classes, each in its runner's module, subclassing that runner's logits-processor base."""
    import importlib

    from vllm.v1.sample.logits_processor import LogitsProcessor as V1Base
    from vllm.v1.worker.gpu.sample.logits_processor import LogitsProcessor as V2Base

    from vllm_steer.integrations.frontend import startup_checks
    from vllm_steer.integrations.worker import spec_v1

    assert spec_v1.V1_REQUEST_STATE == startup_checks.REQUEST_STATE_V1
    for fqcn, base in ((startup_checks.REQUEST_STATE_V1, V1Base),
                       (startup_checks.REQUEST_STATE_V2, V2Base)):
        module, _, name = fqcn.partition(":")
        cls = getattr(importlib.import_module(module), name)
        assert issubclass(cls, base) and cls.__module__ == module, fqcn


def _bad_files(tmp_path):
    from safetensors.torch import save_file

    good = random_steer(64, 4, "g")
    files = {}
    files["missing"] = (str(tmp_path / "missing.safetensors"), "no such file")
    t = tmp_path / "truncated.safetensors"
    save_steer(t, good)
    t.write_bytes(t.read_bytes()[:-64])
    files["truncated"] = (str(t), "truncated")
    n = tmp_path / "nan.safetensors"
    p1 = good.p1.clone()
    p1[0, 0] = float("inf")
    save_file({TENSOR_P1: p1, TENSOR_P2: good.p2}, n,
              metadata={METADATA_KEY: good.metadata.to_json()})
    files["nan"] = (str(n), "NaN or inf")
    w = tmp_path / "wide.safetensors"
    save_steer(w, random_steer(32, 4, "w"))
    files["shape"] = (str(w), "hidden size 32 but the model")
    k = tmp_path / "ref.pt"
    torch.save([{}, {"projector1": torch.zeros(1, 64, 2)}, 0], k)
    files["pickle"] = (str(k), "pickle")
    return files


def test_each_bad_steer_file_is_refused_at_startup_naming_file_and_reason(
        registered, tiny_model_dir, tmp_path):
    from vllm_steer.format import SteerFileError

    for kind, (path, reason) in _bad_files(tmp_path).items():
        with pytest.raises(SteerFileError) as e:
            _engine_config(tiny_model_dir, {"s": path})
        assert path in str(e.value) and reason in str(e.value), kind


def test_all_refused_files_are_listed_in_one_error(registered, tiny_model_dir, tmp_path):
    from vllm_steer.format import SteerFileError

    bad = _bad_files(tmp_path)
    with pytest.raises(SteerFileError) as e:
        _engine_config(tiny_model_dir, {k: p for k, (p, _) in bad.items()})
    for path, reason in bad.values():
        assert path in str(e.value) and reason in str(e.value)


def test_speculative_decoding_methods_without_steered_rows_are_refused_naming_the_method(
        registered, tiny_model_dir, tmp_path):
    p = tmp_path / "a.safetensors"
    save_steer(p, random_steer(64, 4, "a"))
    from types import SimpleNamespace

    from vllm_steer.integrations.frontend.startup_checks import check_speculative_config

    for spec in ({"method": "ngram_gpu", "num_speculative_tokens": 2, "prompt_lookup_max": 3,
                  "prompt_lookup_min": 1}, {"method": "medusa"}, {"method": "dflash"}):
        with pytest.raises(ValueError) as e:
            if spec["method"] == "ngram_gpu":  # through vLLM's own engine config
                _engine_config(tiny_model_dir, {"a": str(p)}, speculative_config=spec)
            else:  # (needs a checkpoint of that kind to build vLLM's config)
                check_speculative_config(SimpleNamespace(
                    speculative_config=SimpleNamespace(**spec), use_v2_model_runner=False))
        msg = str(e.value)
        assert f"speculative decoding method {spec['method']!r} is not supported" in msg, msg
        assert "ngram, draft_model, eagle, eagle3, mtp" in msg, msg
        assert "--speculative-config" in msg, msg


@pytest.mark.parametrize("v2", [False, True])
def test_speculative_decoding_methods_with_mapped_rows_are_accepted_on_both_runners(v2):
    from types import SimpleNamespace

    from vllm_steer.integrations.frontend.startup_checks import (SUPPORTED_SPEC_METHODS,
                                                                 check_speculative_config)

    assert SUPPORTED_SPEC_METHODS == ("ngram", "draft_model", "eagle", "eagle3", "mtp")
    for method in SUPPORTED_SPEC_METHODS:
        check_speculative_config(SimpleNamespace(
            speculative_config=SimpleNamespace(method=method), use_v2_model_runner=v2))


@pytest.mark.parametrize("method", ["eagle", "eagle3", "mtp"])
def test_adaptive_draft_verification_is_refused_naming_the_option(method):
    """With ``enable_adaptive_verification`` V2 decides each request's draft count on the
    device: the host offsets the step's tokens and verification rows are mapped from are
    placeholders, so a request's rows would get another request's steer."""
    from types import SimpleNamespace

    from vllm_steer.integrations.frontend.startup_checks import check_speculative_config

    with pytest.raises(ValueError, match="enable_adaptive_verification"):
        check_speculative_config(SimpleNamespace(
            speculative_config=SimpleNamespace(method=method, enable_adaptive_verification=True),
            use_v2_model_runner=True))
    check_speculative_config(SimpleNamespace(  # off (vLLM's default): served
        speculative_config=SimpleNamespace(method=method, enable_adaptive_verification=False),
        use_v2_model_runner=True))


@pytest.mark.parametrize("verify", ["synthetic", "fly"])
@pytest.mark.parametrize("v2", [False, True])
def test_lossy_draft_verification_is_refused_naming_the_option(verify, v2):
    """``rejection_sample_method`` "synthetic" (fixed acceptance rates) and "fly" (vLLM 0.33:
    a rejected draft accepted when the target's entropy is high) accept drafts the steered
    target rejects: a steered request would get the drafter's tokens (an n-gram drafter's, or
    a drafter left unsteered). "standard" and "block" verify exactly: served."""
    from types import SimpleNamespace

    from vllm_steer.integrations.frontend.startup_checks import (LOSSY_VERIFICATION,
                                                                 check_speculative_config)

    assert verify in LOSSY_VERIFICATION
    with pytest.raises(ValueError, match=f"rejection_sample_method '{verify}'.*\"standard\""):
        check_speculative_config(SimpleNamespace(speculative_config=SimpleNamespace(
            method="ngram", rejection_sample_method=verify), use_v2_model_runner=v2))
    for exact in ("standard", "block", None):
        check_speculative_config(SimpleNamespace(speculative_config=SimpleNamespace(
            method="ngram", rejection_sample_method=exact), use_v2_model_runner=v2))


def test_lossy_draft_verification_is_refused_at_engine_config_creation(registered,
                                                                        tiny_model_dir,
                                                                        tmp_path):
    """The same refusal on vLLM's own SpeculativeConfig (``create_engine_config``)."""
    p = tmp_path / "a.safetensors"
    save_steer(p, random_steer(64, 4, "a"))
    spec = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3,
            "prompt_lookup_min": 1, "rejection_sample_method": "synthetic",
            "synthetic_acceptance_rates": [0.5, 0.25]}
    with pytest.raises(ValueError, match="rejection_sample_method 'synthetic'"):
        _engine_config(tiny_model_dir, {"a": str(p)}, speculative_config=spec)


def test_speculative_decoding_ngram_draft_model_and_eagle_are_accepted(registered,
                                                                      tiny_model_dir,
                                                                      tmp_path):
    from helpers.models import make_tiny_eagle

    p = tmp_path / "a.safetensors"
    save_steer(p, random_steer(64, 4, "a"))
    for spec in ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3,
                  "prompt_lookup_min": 1},
                 {"method": "draft_model", "model": str(tiny_model_dir),
                  "num_speculative_tokens": 2},
                 {"method": "eagle", "model": str(make_tiny_eagle(tmp_path / "eagle")),
                  "num_speculative_tokens": 2}):
        cfg = _engine_config(tiny_model_dir, {"a": str(p)}, speculative_config=spec)
        assert cfg.speculative_config.method == spec["method"]
        assert cfg.model_config.logits_processors == [
            "vllm_steer.integrations.request_state_v1:SteerRequestStateV1"]


def _vllm(*args, timeout=240):
    exe = os.path.join(os.path.dirname(sys.executable), "vllm")
    return subprocess.run([exe, *args], capture_output=True, text=True, timeout=timeout)


def test_vllm_serve_exits_naming_a_bad_steer_file(tiny_model_dir, tmp_path):
    bad = tmp_path / "broken.safetensors"
    bad.write_bytes(b"not a steer")
    out = _vllm("serve", str(tiny_model_dir), "--steer", f"detox={bad}", "--port", "8099")
    assert out.returncode != 0
    assert str(bad) in out.stderr and "refused" in out.stderr


def test_pooling_model_is_refused_with_steers(registered, tiny_model_dir, tmp_path):
    p = tmp_path / "a.safetensors"
    save_steer(p, random_steer(64, 4, "a"))
    with pytest.raises(ValueError, match="--steer needs a generative model; .* runs as a "
                                         "pooling model"):
        _engine_config(tiny_model_dir, {"a": str(p)}, runner="pooling")


@pytest.mark.parametrize("extra, flag", [({"steer_dir": "/tmp"}, "--steer-dir"),
                                         ({"enable_updates": True}, "--enable-steer-updates")])
@pytest.mark.parametrize("mode, fragment", [
    ("data_parallel_external_lb", "external load balancing"),
    ("data_parallel_hybrid_lb", "hybrid load balancing"),
    ("enable_elastic_ep", "elastic expert parallelism"),
])
def test_run_time_steers_are_refused_only_in_dp_modes_where_a_call_reaches_one_engine(
        extra, flag, mode, fragment):
    from types import SimpleNamespace

    import dataclasses

    from vllm.config import ParallelConfig

    from vllm_steer.config import SteerServerConfig
    from vllm_steer.integrations.frontend.startup_checks import check_runtime_steers_fit_parallelism

    assert mode in {f.name for f in dataclasses.fields(ParallelConfig)}  # vLLM's own name

    def dp(size, **flags):
        return SimpleNamespace(parallel_config=SimpleNamespace(data_parallel_size=size,
                                                               **flags))

    cfg = SteerServerConfig(**extra)
    with pytest.raises(ValueError, match=f"{flag} cannot be used with --data-parallel-size 2 "
                                         f"in {fragment}") as e:
        check_runtime_steers_fit_parallelism(cfg, dp(2, **{mode: True}))
    assert "internal load balancing" in str(e.value)
    # internal load balancing (the default of DP): every engine core gets every call
    check_runtime_steers_fit_parallelism(cfg, dp(2))
    check_runtime_steers_fit_parallelism(cfg, dp(1, **{mode: True}))
    # start-up steers only: fine in every mode
    check_runtime_steers_fit_parallelism(SteerServerConfig(steers={"a": "a.safetensors"}),
                                         dp(2, **{mode: True}))


@pytest.mark.parametrize("flags, named", [
    ({"enable_dbo": True}, "micro-batching (--enable-dbo / ubatch_size)"),
    ({"ubatch_size": 2}, "micro-batching (--enable-dbo / ubatch_size)"),
    ({"prefill_context_parallel_size": 2},
     "prefill context parallelism (--prefill-context-parallel-size)"),
])
def test_vector_steers_are_refused_where_a_steps_tokens_are_split(flags, named):
    # the decoder blocks would run on a slice (micro-batches) or a reordered share (prefill
    # context parallelism) of the step's tokens, reading the whole step's per-token strengths
    # from row 0: the wrong tokens steered. vLLM's CPU platform turns DBO off, so the refusal
    # is read on stand-in configs carrying vLLM's own field names.
    from types import SimpleNamespace

    import dataclasses

    from vllm.config import ParallelConfig

    from vllm_steer.integrations.frontend.startup_checks import check_layer_steering

    assert set(flags) <= {f.name for f in dataclasses.fields(ParallelConfig)}

    def config(**kw):
        return SimpleNamespace(parallel_config=SimpleNamespace(
            **{"enable_dbo": False, "ubatch_size": 0, "prefill_context_parallel_size": 1, **kw}),
            compilation_config=SimpleNamespace(pass_config=SimpleNamespace(enable_sp=False)))

    import re

    with pytest.raises(ValueError, match=f"vector steers cannot be served with {re.escape(named)}"
                                         ": the decoder blocks then run on a slice"):
        check_layer_steering(config(**flags))
    check_layer_steering(config())  # none of them: served
    check_layer_steering(config(ubatch_size=1))  # one micro-batch is the whole step


def test_a_models_specialized_decode_executor_is_refused_naming_the_option():
    """vLLM 0.33's ``additional_config={"decode_backend": "latency_specialized"}`` (DeepSeek-V4.1,
    Kimi-K3) builds a decode executor after the model is loaded: its decode steps run through
    kernels prepared from the blocks' weights (a vector steer's op skipped), and DeepSeek-V4.1's
    swaps the model's logits layer for its own subclass after the plugin checked the head.
    Refused at start-up; vLLM's own decode ("auto", or no key) is served."""
    from types import SimpleNamespace

    from vllm_steer.integrations.frontend.startup_checks import check_decode_backend

    def config(extra):
        return SimpleNamespace(additional_config=extra)

    with pytest.raises(ValueError, match="decode_backend='latency_specialized' cannot be "
                                         "served with steers"):
        check_decode_backend(config({"vllm_steer": {}, "decode_backend": "latency_specialized"}))
    for served in ({"vllm_steer": {}}, {"decode_backend": "auto"}, None):
        check_decode_backend(config(served))


def test_vector_steers_are_refused_with_monokernel_and_lm_steer_is_not():
    """``--monokernel`` (vLLM 0.33) runs some models' decode steps through fused layers
    (MiniMax-M3 on ROCm: ``(kernel or layer)(...)`` for each block), never the steered block's
    forward: vector steers are refused; the LM head is untouched (LM-Steer steers served)."""
    from types import SimpleNamespace

    from vllm_steer.integrations.frontend.startup_checks import check_layer_steering

    def config(**kernel):
        return SimpleNamespace(
            parallel_config=SimpleNamespace(enable_dbo=False, ubatch_size=0,
                                            prefill_context_parallel_size=1),
            compilation_config=SimpleNamespace(pass_config=SimpleNamespace()),
            kernel_config=SimpleNamespace(**kernel))

    with pytest.raises(ValueError, match="vector steers cannot be served with --monokernel"):
        check_layer_steering(config(monokernel=True))
    check_layer_steering(config(monokernel=False))
    check_layer_steering(config())  # a vLLM without the flag (0.32)


def test_the_decode_backend_refusal_runs_at_engine_config_creation(registered, tiny_model_dir,
                                                                   tmp_path):
    from vllm.engine.arg_utils import EngineArgs

    p = tmp_path / "a.safetensors"
    save_steer(p, random_steer(64, 4, "a"))
    args = EngineArgs(model=str(tiny_model_dir), max_model_len=256, additional_config={
        "vllm_steer": {"steers": {"a": str(p)}}, "decode_backend": "latency_specialized"})
    with pytest.raises(ValueError, match="decode_backend='latency_specialized'"):
        args.create_engine_config()
