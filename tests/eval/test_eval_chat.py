"""Chat modes: prompts as user turns under the model's chat template, replies scored, their
perplexity given the templated prompt. The rendering is checked against the tokenizer's own
``apply_chat_template(tokenize=True)``, the perplexity against plain torch on the model's
weights, and (through vLLM) the replies against ``LLM.chat``."""

import json
import math

import pytest
import torch

from helpers.steers import random_steer
from vllm_steer.eval.chat import DEFAULT_INSTRUCTION, chat_prompts, check_mode, user_message
from vllm_steer.eval.generation import SamplingConfig
from vllm_steer.eval.harness import EvalConfig, evaluate
from vllm_steer.format import save_steer

PROMPTS = ["The weather today is", "My neighbour said that", "A long time ago"]


@pytest.fixture
def tok(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture
def prompts_file(tmp_path):
    p = tmp_path / "dev.jsonl"
    p.write_text("\n".join(json.dumps({"prompt": {"text": t}}) for t in PROMPTS))
    return str(p)


def test_user_turns_and_rendering_match_the_tokenizers_template(tok):
    assert user_message("Hi there", "chat") == "Hi there"
    assert user_message("Hi there", "chat-instruct") == "Continue this text: Hi there"
    assert user_message("x", "chat-instruct", "Review: {prompt}!") == "Review: x!"
    messages, texts, ids = chat_prompts(tok, PROMPTS, "chat-instruct")
    assert messages[0] == DEFAULT_INSTRUCTION.replace("{prompt}", PROMPTS[0])
    for m, t, x in zip(messages, texts, ids, strict=True):
        ref = tok.apply_chat_template([{"role": "user", "content": m}], tokenize=True,
                                      add_generation_prompt=True)
        ref = ref["input_ids"] if not isinstance(ref, list) else ref
        assert x == list(ref)
        assert t.endswith("<|im_start|>assistant\n") and f"<|im_start|>user\n{m}<|im_end|>" in t


def test_bad_modes_are_refused_with_every_reason(tok):
    with pytest.raises(ValueError, match=r"--mode 'poem'.*must contain \{prompt\}"):
        check_mode("poem", "no placeholder")
    with pytest.raises(ValueError, match="--instruction is used by --mode chat-instruct only"):
        check_mode("chat", "Say {prompt}")
    tok.chat_template = None
    with pytest.raises(ValueError, match="no chat template.*--mode plain"):
        chat_prompts(tok, ["x"], "chat")


class EchoGenerator:
    """Records what the model was given; replies with fixed text."""

    given = []

    def __init__(self, model, steers, blacklists, engine, seed):
        pass

    def generate(self, prompts, conditions, sampling, progress=True):
        EchoGenerator.given = list(prompts)
        return {c.label: [[f" I think it is nice {j}" for j in range(sampling.samples)]
                          for _ in prompts] for c in conditions}

    def close(self):
        pass


def test_chat_run_scores_replies_given_the_templated_prompt(tiny_model_dir, tok, prompts_file,
                                                            tmp_path):
    from transformers import AutoModelForCausalLM

    steer = str(tmp_path / "s.safetensors")
    save_steer(steer, random_steer(64, 4, "detox"))
    cfg = EvalConfig(task="toxicity", model=str(tiny_model_dir), steers=[steer],
                     strengths=[0, 3], baseline="none", prompt_file=prompts_file,
                     sampling=SamplingConfig(samples=2, max_tokens=8),
                     data_dir=str(tmp_path / "no-data"), out=str(tmp_path / "run"),
                     sentiment_scorers=["vader"], scorer_dtype="float32", mode="chat",
                     progress=False)
    res = evaluate(cfg, generator_factory=EchoGenerator, log=lambda m: None)
    _, texts, ids = chat_prompts(tok, PROMPTS, "chat")
    assert EchoGenerator.given == ids  # token ids of the templated prompts, as they are
    assert res["mode"] == "chat" and res["instruction"] is None
    assert "- mode: chat: the user turn is the prompt text as it is" in \
        (tmp_path / "run" / "results.md").read_text()
    recs = [json.loads(x) for x in (tmp_path / "run" / "generations.jsonl").read_text()
            .splitlines()]
    assert recs[0]["prompt"] == PROMPTS[0] and recs[0]["user"] == PROMPTS[0]
    # perplexity of a reply: its tokens given the templated prompt's, by plain torch
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    reply = recs[0]["samples"][1]
    r = tok(reply["text"], add_special_tokens=False)["input_ids"]
    x = torch.tensor([ids[0] + r])
    with torch.no_grad():
        lp = torch.log_softmax(model(input_ids=x).logits[0].float(), -1)
    nll = -sum(float(lp[len(ids[0]) + k - 1, t]) for k, t in enumerate(r))
    assert reply["tokens"] == len(r)
    assert reply["ppl"] == pytest.approx(math.exp(nll / len(r)), rel=1e-4)
    # per-prompt maxima recorded for the tune's significance check
    assert len(res["conditions"][0]["per_prompt"]["max_toxicity"]) == 3
    # the instruction mode and its recorded command
    from vllm_steer.cli import build_parser
    from vllm_steer.eval.cli import config_from_args

    argv = ["eval", "sentiment", "--steer", steer, "--prompts", prompts_file, "--mode",
            "chat-instruct", "--instruction", "Review this: {prompt}", "--baseline", "none"]
    c = config_from_args(build_parser().parse_args(argv))
    assert c.mode == "chat-instruct" and c.instruction == "Review this: {prompt}"
    assert "--mode chat-instruct --instruction 'Review this: {prompt}'" in c.command


@pytest.mark.vllm
def test_chat_mode_through_vllm_matches_llm_chat(tiny_model_dir, tok, tmp_path):
    """One engine: the harness's templated prompts give the replies ``LLM.chat`` gives, and
    the engine's perplexity of a reply equals plain torch's given the templated prompt."""
    from transformers import AutoModelForCausalLM
    from vllm import SamplingParams

    from vllm_steer.eval.generation import Condition, EngineConfig, VLLMGenerator

    steer = str(tmp_path / "s.safetensors")
    save_steer(steer, random_steer(64, 8, "s", seed=1, scale=3.0))
    gen = VLLMGenerator(str(tiny_model_dir), {"s": steer}, None,
                        EngineConfig(max_num_seqs=8, kv_cache_gib=0.25), seed=0)
    try:
        messages, _, ids = chat_prompts(tok, PROMPTS[:2], "chat-instruct")
        greedy = SamplingConfig(samples=1, max_tokens=6, top_p=1e-9)  # top-p ~0: argmax
        conds = [Condition("unsteered"), Condition("lm-steer", steer={"s": 5.0})]
        out = gen.generate(ids, conds, greedy, progress=False)
        for cond in conds:
            ref = gen.llm.chat([[{"role": "user", "content": m}] for m in messages],
                               SamplingParams(temperature=0, max_tokens=6,
                                              extra_args=cond.extra_args()), use_tqdm=False)
            assert [o.outputs[0].text for o in ref] == [x[0] for x in out[cond.label]]
        assert out["unsteered"] != out["lm-steer s=+5"]
        replies = [x[0] for x in out["lm-steer s=+5"]]
        nll = gen.nll(ids, replies, progress=False)
    finally:
        gen.close()
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    for p, reply, got in zip(ids, replies, nll, strict=False):
        r = tok(reply, add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            lp = torch.log_softmax(model(input_ids=torch.tensor([p + r])).logits[0], -1)
        want = -sum(float(lp[len(p) + k - 1, t]) for k, t in enumerate(r))
        assert got.tokens == len(r) and got.nll_sum == pytest.approx(want, rel=2e-3)
