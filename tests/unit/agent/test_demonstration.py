"""Warm-start demonstrations replayed into the tokens an episode records: the prompt, the
assistant turns as the model would write them (trained), the tool turn and template glue
between them (masked), as the tiny tokenizer's chat template renders the conversation."""

from __future__ import annotations

from pathlib import Path

import json
from typing import Any

import pytest

from asyncrl.tasks.agent.demonstration import demonstration_tokens
from asyncrl.tasks.data.synthetic_tool import demonstration, make_calc_dataset
from asyncrl.tasks.model.tokenizer import CHAT_TEMPLATE, build_tokenizer
from asyncrl.configs.loading import load_config

TOOLS = load_config(str(Path(__file__).resolve().parents[3] / "configs" / "demo-tool.yaml")).rollout.episode.options["tools"]  # type: ignore[union-attr]
"""The tools configs/demo-tool.yaml offers the calculator episode, and its demonstrations use."""


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    built = build_tokenizer(512, 2048)
    built.chat_template = CHAT_TEMPLATE
    return built


def test_a_tool_demonstration_trains_the_assistant_turns_and_masks_the_rest(tokenizer: Any) -> None:
    problem = make_calc_dataset(1, seed=0)[0]
    conversation = demonstration(problem, "tool", TOOLS)
    tokens = demonstration_tokens(tokenizer, conversation["messages"], conversation["tools"])
    whole = tokenizer.decode(tokens.prompt_token_ids + tokens.output_token_ids, skip_special_tokens=False)
    rendered = tokenizer.apply_chat_template(conversation["messages"], tools=TOOLS, tokenize=False)
    assert whole == rendered.removesuffix("\n")  # the stop token ends the last turn; nothing follows it
    call = f'<tool_call>\n{{"name": "calc", "arguments": {json.dumps({"expr": problem.expression})}}}\n</tool_call><|im_end|>'
    trained = tokenizer.decode(
        [t for t, m in zip(tokens.output_token_ids, tokens.output_mask) if m], skip_special_tokens=False
    )
    assert trained == f"{call}#### {problem.answer}<|im_end|>"
    masked = tokenizer.decode(
        [t for t, m in zip(tokens.output_token_ids, tokens.output_mask) if not m], skip_special_tokens=False
    )
    assert masked == f"\n<|im_start|>tool\n{problem.answer}<|im_end|>\n<|im_start|>assistant\n"
    assert len(tokens.turn_starts) == 2 and tokens.final_text == f"#### {problem.answer}"


def test_a_direct_demonstration_is_one_turn(tokenizer: Any) -> None:
    problem = make_calc_dataset(1, seed=1)[0]
    conversation = demonstration(problem, "direct", TOOLS)
    tokens = demonstration_tokens(tokenizer, conversation["messages"], conversation["tools"])
    assert tokens.turn_starts == [0] and all(tokens.output_mask)
    assert tokenizer.decode(tokens.output_token_ids, skip_special_tokens=False) == f"#### {problem.answer}<|im_end|>"


def test_a_demonstration_without_an_assistant_turn_is_refused(tokenizer: Any) -> None:
    with pytest.raises(ValueError, match="needs an assistant message"):
        demonstration_tokens(tokenizer, [{"role": "user", "content": "hi"}])


def test_the_warm_start_trains_a_conversation_row_on_its_assistant_turns(tokenizer: Any) -> None:
    from asyncrl.tasks.data.records import PromptRecord
    from asyncrl.tasks.trainer.sft import sft_sequences

    problem = make_calc_dataset(1, seed=2)[0]
    conversation = demonstration(problem, "tool", TOOLS)
    record = PromptRecord("000000-x", problem.prompt, problem.answer, conversation=conversation)
    (sequence,) = sft_sequences([record], tokenizer)
    expected = demonstration_tokens(tokenizer, conversation["messages"], TOOLS)
    assert list(sequence.prompt_ids) == expected.prompt_token_ids
    assert list(sequence.output_ids) == expected.output_token_ids
    assert sequence.trained is not None and list(sequence.trained) == expected.output_mask
    assert sequence.trained_count == sum(expected.output_mask) < len(sequence.output_ids)
    broken = PromptRecord("000001-y", "hi", "1", conversation={"messages": [{"role": "user", "content": "hi"}], "tools": []})
    with pytest.raises(ValueError, match="prompt 000001-y: its conversation cannot be trained on"):
        sft_sequences([broken], tokenizer)
