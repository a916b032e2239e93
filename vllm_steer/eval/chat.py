"""Prompt modes: plain completions, or user turns under the model's own chat template.

Users of an instruct model reach a steer through ``/v1/chat/completions``: their text is a
user turn, the model's chat template renders the conversation, and the steer acts on the
assistant's reply. ``--mode`` measures a steer that way:

- ``plain``: the prompt text is the whole model input and the model continues it (the
  paper's protocol, ``/v1/completions``);
- ``chat``: the prompt text is the user message, as it is;
- ``chat-instruct``: the prompt text inside a fixed instruction, by default
  :data:`DEFAULT_INSTRUCTION` (``Continue this text: {prompt}``), so that the reply is a
  continuation of the prompt rather than an answer to it.

In both chat modes the conversation is ``[{"role": "user", "content": MESSAGE}]`` rendered
with the tokenizer's ``apply_chat_template(..., add_generation_prompt=True)`` (the model's
default system turn, if its template adds one, included), then tokenised without adding
special tokens, as vLLM's chat endpoint does for Hugging Face tokenizers. The reply is what
gets scored; its perplexity is that of the reply's tokens given the templated prompt's tokens
(:meth:`vllm_steer.eval.generation.VLLMGenerator.nll`).
"""

from __future__ import annotations

from typing import Sequence

MODES = ("plain", "chat", "chat-instruct")
#: The instruction of ``chat-instruct`` (``{prompt}`` is replaced by the prompt text).
DEFAULT_INSTRUCTION = "Continue this text: {prompt}"


def check_mode(mode: str, instruction: str | None) -> None:
    """Refuse an unknown mode, or an instruction without ``{prompt}``; every problem in one
    error."""
    problems = []
    if mode not in MODES:
        problems.append(f"--mode {mode!r}: choose {', '.join(MODES)}")
    if instruction is not None:
        if mode != "chat-instruct":
            problems.append(f"--instruction is used by --mode chat-instruct only (got --mode "
                            f"{mode})")
        if "{prompt}" not in instruction:
            problems.append(f"--instruction {instruction!r}: must contain {{prompt}}, where "
                            "the prompt text goes")
    if problems:
        raise ValueError("; ".join(problems))


def user_message(prompt: str, mode: str, instruction: str | None = None) -> str:
    """The user turn of ``prompt`` in ``mode`` (``chat`` or ``chat-instruct``)."""
    if mode == "chat":
        return prompt
    if mode == "chat-instruct":
        return (instruction or DEFAULT_INSTRUCTION).replace("{prompt}", prompt)
    raise ValueError(f"mode {mode!r} has no user turn (choose chat or chat-instruct)")


def render(tokenizer, message: str) -> str:
    """The templated text of a one-turn conversation with ``message`` as the user's turn,
    ending with the assistant's generation prompt."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"{getattr(tokenizer, 'name_or_path', 'the model')}: the tokenizer "
                         "has no chat template; chat modes need an instruct model's template "
                         "(use --mode plain for a base model)")
    return tokenizer.apply_chat_template([{"role": "user", "content": message}],
                                         tokenize=False, add_generation_prompt=True)


def chat_prompts(tokenizer, prompts: Sequence[str], mode: str,
                 instruction: str | None = None) -> tuple[list[str], list[str], list[list[int]]]:
    """For each prompt: the user message, the templated text and its token ids (the tokens
    the model is given; no special tokens added beyond the template's own)."""
    messages = [user_message(p, mode, instruction) for p in prompts]
    texts = [render(tokenizer, m) for m in messages]
    ids = [list(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts]
    return messages, texts, ids
