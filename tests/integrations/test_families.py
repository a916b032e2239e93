"""vllm_steer.integrations.families: the head's input size per family (OPT's project_out),
the refusal of architectures we cannot steer, and its call at engine configuration.
The families served for real: tests/e2e/test_vllm_families.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from helpers.steers import random_steer
from vllm_steer.format import save_steer
from vllm_steer.integrations import families
from vllm_steer.integrations.frontend.startup_checks import configure_engine


def _model_config(arch: str, hidden: int = 128, **hf):
    hf_config = SimpleNamespace(architectures=[arch], hidden_size=hidden, **hf)
    return SimpleNamespace(architectures=[arch], hf_config=hf_config, hf_text_config=hf_config,
                           model=f"/models/{arch}", runner_type="generate",
                           logits_processors=None, get_hidden_size=lambda: hidden)


def _vllm_config(mc, steers):
    return SimpleNamespace(model_config=mc, speculative_config=None, use_v2_model_runner=False,
                           additional_config={"vllm_steer": {"steers": steers}})


def test_head_input_size_is_opts_word_embed_proj_dim_else_the_hidden_size():
    assert families.head_input_size(_model_config("OPTForCausalLM", 1024,
                                                  word_embed_proj_dim=512)) == 512
    assert families.head_input_size(_model_config("OPTForCausalLM", 768,
                                                  word_embed_proj_dim=768)) == 768
    assert families.head_input_size(_model_config("LlamaForCausalLM", 2048)) == 2048
    assert families.head_input_size(_model_config("SomeNewForCausalLM", 96)) == 96


def test_refused_architecture_names_itself_and_the_reason():
    with pytest.raises(families.UnsupportedModelError,
                       match=r"InklingForCausalLM .* cannot be steered: its logits layer is "
                             r"vLLM's InklingLogitsProcessor.*served unsteered"):
        families.check_model(_model_config("InklingForCausalLM"))
    assert families.check_model(_model_config("Gemma2ForCausalLM", 256)) == 256


def test_the_refusal_reason_holds_for_the_installed_vllm():
    """vLLM replaces a PluggableLayer by the class's own name: a subclass with another name is
    never swapped for ours."""
    import inspect

    from vllm.model_executor.custom_op import PluggableLayer
    from vllm.model_executor.layers.logits_processor import LogitsProcessor

    mod = pytest.importorskip("vllm.models.inkling.nvidia.logits_processor")
    cls = mod.InklingLogitsProcessor
    assert issubclass(cls, LogitsProcessor) and cls.__name__ != "LogitsProcessor"
    assert "layer_class_name = cls.__name__" in inspect.getsource(PluggableLayer.__new__)


def test_configure_engine_refuses_before_the_engine_starts(tmp_path):
    path = tmp_path / "s.safetensors"
    save_steer(path, random_steer(128, 2, "s"))
    with pytest.raises(families.UnsupportedModelError, match="InklingForCausalLM"):
        configure_engine(_vllm_config(_model_config("InklingForCausalLM"), {"s": str(path)}))


def test_configure_engine_checks_steers_against_the_head_input_of_opt(tmp_path):
    """opt-350m-like: hidden 1024, project_out to 512 before the head. A steer of the head's
    input size is accepted (it used to be refused against hidden_size), one of the hidden
    size is refused naming the head's size."""
    from vllm_steer.format import SteerFileError

    good, bad = tmp_path / "good.safetensors", tmp_path / "bad.safetensors"
    save_steer(good, random_steer(512, 2, "good"))
    save_steer(bad, random_steer(1024, 2, "bad"))
    mc = _model_config("OPTForCausalLM", 1024, word_embed_proj_dim=512)
    configure_engine(_vllm_config(mc, {"good": str(good)}))
    assert mc.logits_processors == [
        "vllm_steer.integrations.request_state_v1:SteerRequestStateV1"]
    with pytest.raises(SteerFileError, match="hidden size 1024 but the model .* has 512"):
        configure_engine(_vllm_config(_model_config("OPTForCausalLM", 1024,
                                                    word_embed_proj_dim=512),
                                      {"bad": str(bad)}))


def test_module_is_light():
    import subprocess
    import sys

    code = ("import sys, vllm_steer.integrations.families; "
            "assert 'torch' not in sys.modules and 'vllm' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)
