"""How a dataset question becomes the prompt text the policy sees.

One function serves rollout, SFT and evaluation, so the model is trained and scored
on exactly the prompt format it generates from.
"""

from __future__ import annotations

from typing import Any, Literal

PromptFormat = Literal["plain", "chat"]


def render_prompt(question: str, prompt_format: PromptFormat, tokenizer: Any | None = None) -> str:
    """`plain`: the question and a newline (the synthetic task and base models);
    `chat`: the tokenizer's chat template with one user turn and the generation prompt
    (instruction-tuned checkpoints such as Qwen2.5-Instruct)."""
    if prompt_format == "plain":
        return f"{question}\n"
    if prompt_format == "chat":
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise ValueError("data.prompt_format: 'chat' needs a tokenizer with a chat template")
        return str(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
            )
        )
    raise ValueError(f"data.prompt_format: must be 'plain' or 'chat', got {prompt_format!r}")
