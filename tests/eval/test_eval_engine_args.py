"""``vllm-steer tune`` and ``vllm-steer eval`` take vLLM's own engine flags (``EngineArgs``'s
parser), map them into the engine they start, and default per device: bf16 and CUDA graphs on
CUDA, float32, eager and a 512-token window on CPU. The engine is a stand-in that records
what ``vllm.LLM`` was given; tests/eval/test_eval_tune_tp.py runs the real one at TP=2."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys

import pytest

from helpers.steers import random_steer
from vllm_steer.cli import build_parser, main
from vllm_steer.eval.cli import config_from_args
from vllm_steer.eval.generation import EngineConfig, VLLMGenerator

VLLM_FLAGS = ["--tensor-parallel-size", "2", "--dtype", "float16", "--max-model-len", "2k",
              "--gpu-memory-utilization", "0.8", "--quantization", "fp8", "--enforce-eager",
              "--max-num-seqs", "64"]


@pytest.fixture
def steer_file(tmp_path):
    from vllm_steer.format import save_steer

    path = tmp_path / "detox.safetensors"
    save_steer(str(path), random_steer(64, 4, "detox"))
    return str(path)


@pytest.fixture
def llm_kwargs(monkeypatch):
    """vllm.LLM replaced by a recorder of its arguments."""
    import vllm

    seen: list[dict] = []

    class RecordingLLM:
        def __init__(self, model, **kw):
            seen.append(dict(kw, model=model))

    monkeypatch.setattr(vllm, "LLM", RecordingLLM)
    return seen


def test_eval_parses_vllms_engine_flags_into_its_engine(steer_file, llm_kwargs):
    args = build_parser().parse_args(["eval", "toxicity", "--steer", steer_file, "--seed", "7",
                                      "--model", "my-model", *VLLM_FLAGS])
    cfg = config_from_args(args)
    assert cfg.model == "my-model" and cfg.sampling.seed == 7
    assert cfg.engine == EngineConfig(
        dtype="float16", max_model_len=2000, max_num_seqs=64, enforce_eager=True,
        extra={"tensor_parallel_size": 2, "gpu_memory_utilization": 0.8,
               "quantization": "fp8"})
    # what the engine is given, on either device: the flags as typed, --seed and --model too
    for device in ("cpu", "cuda"):
        llm_kwargs.clear()
        VLLMGenerator("my-model", {"detox": steer_file}, engine=cfg.engine, seed=7,
                      device=device)
        kw = llm_kwargs[0]
        assert {k: kw[k] for k in ("model", "seed", "tensor_parallel_size", "dtype",
                                   "max_model_len", "gpu_memory_utilization", "quantization",
                                   "enforce_eager", "max_num_seqs")} == {
            "model": "my-model", "seed": 7, "tensor_parallel_size": 2, "dtype": "float16",
            "max_model_len": 2000, "gpu_memory_utilization": 0.8, "quantization": "fp8",
            "enforce_eager": True, "max_num_seqs": 64}
        assert kw["additional_config"] == {"vllm_steer": {"steers": {"detox": steer_file}}}
    # the recorded command gives the same configuration back
    again = config_from_args(build_parser().parse_args(shlex.split(cfg.command)[1:]))
    assert again == cfg and "--tensor-parallel-size 2" in cfg.command


def test_unset_engine_settings_take_the_devices_defaults(steer_file, llm_kwargs):
    cfg = config_from_args(build_parser().parse_args(["eval", "sentiment", "--steer",
                                                      steer_file]))
    assert cfg.engine == EngineConfig()
    VLLMGenerator("m", engine=cfg.engine, device="cuda")
    VLLMGenerator("m", engine=cfg.engine, device="cpu")
    VLLMGenerator("m", engine=cfg.engine)  # this machine: no GPU, so the CPU's
    cuda, cpu, here = llm_kwargs
    assert cuda == {"model": "m", "seed": 0, "additional_config": None, "dtype": "bfloat16",
                    "enforce_eager": False}  # vLLM's own window, batch and memory share
    assert cpu == {"model": "m", "seed": 0, "additional_config": None, "dtype": "float32",
                   "enforce_eager": True, "max_model_len": 512, "max_num_seqs": 128,
                   "kv_cache_memory_bytes": 1 << 30,
                   # every prompt prefilled whole: vLLM's CPU runner cannot rewind the
                   # generator of a seeded request whose prefill was split
                   "enable_chunked_prefill": False}
    assert here == cpu
    assert EngineConfig(extra={"enable_chunked_prefill": True}).resolved("cpu")[
        "enable_chunked_prefill"] is True  # what the user gives wins
    # a setting the user gives wins over the device's default
    given = EngineConfig(dtype="float32", enforce_eager=True, kv_cache_gib=2.0)
    assert given.resolved("cuda") == {"dtype": "float32", "enforce_eager": True,
                                      "kv_cache_memory_bytes": 2 << 30}


@pytest.fixture(params=["plain", "plugin loaded"])
def plugin_state(request, monkeypatch):
    """Each tool test twice: in a plain process, and in one where this package's vLLM plugin
    is registered (as after an engine started in the same process): its hooks wrap
    ``EngineArgs.add_cli_args`` / ``from_cli_args`` for ``vllm serve``'s ``--steer`` flags,
    which must not reach the tools' parsers (their ``steer`` is a file)."""
    import vllm_steer.eval.engine_args as engine_args

    monkeypatch.setattr(engine_args, "_TEMPLATE", [])
    if request.param == "plugin loaded":
        from vllm_steer.integrations.plugin import register

        register()
    return request.param


def test_tune_takes_the_same_flags_and_records_them(steer_file, tmp_path, monkeypatch,
                                                    plugin_state):
    """``tune``'s engine flags reach the evaluation it runs and its recorded command, with or
    without the serving plugin's hooks in the process, on a host without network access
    (``HF_HUB_OFFLINE``: checking the flags must not look vLLM's default model up)."""
    import huggingface_hub.constants

    import vllm_steer.eval.tune as tune_mod

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)

    seen = {}

    def fake_tune(cfg):
        seen["cfg"] = cfg
        return {"recommended_strength": 3.0, "rule": "r"}

    monkeypatch.setattr(tune_mod, "tune", fake_tune)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": {"text": "Hi"}}\n')
    assert main(["tune", steer_file, "--task", "toxicity", "--prompts", str(prompts),
                 "--model", "m", "--seed", "5", *VLLM_FLAGS]) == 0
    cfg = seen["cfg"]
    assert cfg.sampling.seed == 5 and cfg.model == "m"
    assert cfg.engine.extra == {"tensor_parallel_size": 2, "gpu_memory_utilization": 0.8,
                                "quantization": "fp8"}
    assert (cfg.engine.dtype, cfg.engine.max_model_len, cfg.engine.max_num_seqs,
            cfg.engine.enforce_eager) == ("float16", 2000, 64, True)
    for flag in ("--tensor-parallel-size 2", "--dtype float16", "--max-model-len 2000",
                 "--enforce-eager", "--quantization fp8", "--gpu-memory-utilization 0.8"):
        assert flag in cfg.command, (flag, cfg.command)
    assert "--steer " not in cfg.command and "steer_preset" not in cfg.engine.extra


def test_engine_flag_errors_name_the_flags(steer_file, capsys):
    assert main(["eval", "toxicity", "--steer", steer_file, "--kv-cache-gib", "1",
                 "--kv-cache-memory-bytes", "1000"]) == 1
    err = capsys.readouterr().err
    assert ("--kv-cache-gib 1 and --kv-cache-memory-bytes 1000 both size the KV cache: give "
            "one of them") in err
    with pytest.raises(SystemExit):  # vLLM's own choices
        main(["eval", "toxicity", "--dtype", "float8"])
    assert "invalid choice: 'float8'" in capsys.readouterr().err


def test_tune_help_lists_vllms_flags_and_the_other_commands_do_not_import_vllm():
    out = build_parser()._subparsers._group_actions[0].choices["tune"].format_help()
    for flag in ("--tensor-parallel-size", "--gpu-memory-utilization", "--quantization",
                 "--max-model-len", "--kv-cache-gib"):
        assert flag in out, flag
    assert "bfloat16 on CUDA, float32 on CPU" in out
    assert len(re.findall(r"^\s+--seed SEED", out, re.M)) == 1  # the tool's, also vLLM's
    code = ("import sys; from vllm_steer.cli import build_parser, main; "
            "build_parser().parse_args(['info', 'x']); "
            "print(sorted(m for m in ('vllm', 'torch') if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stderr[-2000:]


def test_tune_refuses_a_negative_strength_instead_of_trying_its_magnitude_twice(
        steer_file, tmp_path, monkeypatch, capsys):
    """``--strengths=-4,4`` would run +4 twice (two identical conditions): refused naming the
    rule (magnitudes; the task and the labels give the direction), before any generation."""
    import vllm_steer.eval.tune as tune_mod

    monkeypatch.setattr(tune_mod, "tune", lambda cfg: pytest.fail("tune ran"))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": {"text": "Hi"}}\n')
    assert main(["tune", steer_file, "--task", "toxicity", "--prompts", str(prompts),
                 "--model", "m", "--strengths=-4,4"]) == 1
    assert "give positive magnitudes" in capsys.readouterr().err


@pytest.mark.parametrize("argv, said", [
    (["eval", "toxicity", "--max-model-len", "2k", "--num-prompts", "0"],
     "argument --num-prompts: '0' is not an integer >= 1: give e.g. 100"),
    (["tune", "s.safetensors", "-tp", "2", "--task", "toxicity", "--prompts", "p.jsonl",
      "--num-prompts", "-1"], "argument --num-prompts: '-1' is not an integer >= 1"),
    (["tune", "s.safetensors", "--dtype", "float16", "--prompts", "p.jsonl"],
     "the following arguments are required: --task"),
])
def test_a_mistake_in_the_commands_own_flags_is_refused_before_vllm_is_imported(argv, said):
    """The command's own flags are parsed before vLLM is imported for its engine flags: a
    usage error among them is answered at once (it waited for vLLM's import, half a minute
    on this CPU); vLLM's flags given beside them (``-tp 2``, ``--max-model-len 2k``) are
    left to the full parse."""
    code = ("import sys\nfrom vllm_steer.cli import main\ntry:\n"
            f"    main({argv!r})\nexcept SystemExit as e:\n"
            "    print('EXIT', e.code, sorted(m for m in ('vllm', 'torch') if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=300)
    assert "EXIT 2 []" in r.stdout, r.stdout + r.stderr[-2000:]
    assert said in r.stderr, r.stderr


def test_vllms_short_and_long_flags_and_the_tools_abbreviations_still_parse(steer_file):
    """vLLM's short alias (``-tp``) and the tool's own flags abbreviated (``--num-prom``)
    parse as before: the early check of the tool's flags takes no vLLM flag for one of them,
    and the full parse keeps argparse's abbreviations."""
    args = build_parser().parse_args(["tune", steer_file, "--task", "toxicity", "-tp", "2",
                                      "--prompts", "p.jsonl", "--num-prom", "5",
                                      "--max-model-len", "2k"])
    assert (args.tensor_parallel_size, args.num_prompts, args.max_model_len) == (2, 5, 2000)
