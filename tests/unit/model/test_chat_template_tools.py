"""The tiny tokenizer's chat template: plain ChatML without tools, a short tool list, Hermes
tool calls and ``tool`` turns with them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from asyncrl.tasks.model.tokenizer import build_tokenizer

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calc",
            "description": "Evaluate an arithmetic expression.",
            "parameters": {"type": "object", "properties": {"expr": {"type": "string"}, "digits": {}}},
        },
    },
    {"type": "function", "function": {"name": "now"}},
]


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return build_tokenizer(320, 2048)


def _chatml(messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
    text = "".join(f"<|im_start|>{m['role']}\n{m['content'] or ''}<|im_end|>\n" for m in messages)
    return text + ("<|im_start|>assistant\n" if add_generation_prompt else "")


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_without_tools_the_text_is_plain_chatml(tokenizer: Any, add_generation_prompt: bool) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2+2?\n"},
        {"role": "assistant", "content": "4"},
        {"role": "assistant", "content": None},
        {"role": "user", "content": ""},
    ]
    for tools in (None, []):
        text = tokenizer.apply_chat_template(
            messages, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=False
        )
        assert text == _chatml(messages, add_generation_prompt)


def test_tools_tool_calls_and_tool_results(tokenizer: Any) -> None:
    calls = [
        {"id": "c0", "type": "function", "function": {"name": "calc", "arguments": '{"expr": "6*7"}'}},
        {"id": "c1", "type": "function", "function": {"name": "now", "arguments": {}}},
    ]
    messages = [
        {"role": "user", "content": "6*7?"},
        {"role": "assistant", "content": "Let me see.", "tool_calls": calls},
        {"role": "tool", "tool_call_id": "c0", "content": "42"},
        {"role": "assistant", "content": None, "tool_calls": calls[:1]},
    ]
    text = tokenizer.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    assert text == (
        "<|im_start|>system\nTools: calc(expr, digits), now()<|im_end|>\n"
        "<|im_start|>user\n6*7?<|im_end|>\n"
        "<|im_start|>assistant\nLet me see.\n"
        '<tool_call>\n{"name": "calc", "arguments": {"expr": "6*7"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call><|im_end|>\n'
        "<|im_start|>tool\n42<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "calc", "arguments": {"expr": "6*7"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>assistant\n"
    )


def test_the_saved_tokenizer_renders_tools_too(tiny_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    saved = AutoTokenizer.from_pretrained(tiny_model_dir)
    messages = [{"role": "user", "content": "hi"}]
    text = saved.apply_chat_template(messages, tools=TOOLS[1:], add_generation_prompt=True, tokenize=False)
    assert text == "<|im_start|>system\nTools: now()<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
