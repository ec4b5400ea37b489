"""Hermes tool-call parsing: well-formed calls become OpenAI entries, the model's mistakes stay text."""

from __future__ import annotations

import json

import pytest

from asyncrl.tasks.inference.tool_calls import parse_tool_calls, tool_call_id


def test_one_call_with_content_before_it() -> None:
    text = 'Let me compute.\n<tool_call>\n{"name": "calc", "arguments": {"expr": "2+2"}}\n</tool_call>'
    parsed = parse_tool_calls(text, "ep-1", turn=0)
    assert parsed.content == "Let me compute."
    assert parsed.tool_calls == [
        {
            "id": tool_call_id("ep-1", 0, 0),
            "type": "function",
            "function": {"name": "calc", "arguments": '{"expr": "2+2"}'},
        }
    ]


def test_several_calls_and_serialised_arguments() -> None:
    text = (
        '<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n'
        '<tool_call>{"name": "b", "arguments": "{\\"y\\": [1, 2]}"}</tool_call>\n'
        '<tool_call>\n{"name": "c"}\n</tool_call>'
    )
    parsed = parse_tool_calls(text, "ep", turn=3)
    assert parsed.content == ""
    assert [c["function"]["name"] for c in parsed.tool_calls] == ["a", "b", "c"]
    assert [json.loads(c["function"]["arguments"]) for c in parsed.tool_calls] == [{"x": 1}, {"y": [1, 2]}, {}]
    assert [c["id"] for c in parsed.tool_calls] == [tool_call_id("ep", 3, i) for i in range(3)]


def test_ids_are_deterministic_and_distinct_per_episode_turn_and_index() -> None:
    ids = {tool_call_id(e, t, i) for e in ("a", "b") for t in range(3) for i in range(2)}
    assert len(ids) == 12 and tool_call_id("a", 1, 0) == tool_call_id("a", 1, 0)
    assert all(i.startswith("call_") for i in ids)


@pytest.mark.parametrize(
    "text",
    [
        "no tool call here",
        '<tool_call>\n{"name": "calc", "arguments": {"expr": "2+2"}\n</tool_call>',  # missing brace
        '<tool_call>\n{"name": "calc", "arguments": {"expr": "2+2"}}\n',  # unclosed
        '<tool_call>\n{"arguments": {}}\n</tool_call>',  # no name
        '<tool_call>\n{"name": "calc", "arguments": [1]}\n</tool_call>',  # arguments not an object
        '<tool_call>\n{"name": "calc", "arguments": "not json"}\n</tool_call>',
        '<tool_call>\n["calc"]\n</tool_call>',
        '<tool_call>\n{"name": "a"}\n</tool_call> and then text',  # text after the last block
        '<tool_call>\n{"name": "a"}\n</tool_call> x <tool_call>\n{"name": "b"}\n</tool_call>',
        '<tool_call>\n{"name": "a"}\n</tool_call>\n<tool_call>\n{"name": }\n</tool_call>',  # one bad of two
    ],
)
def test_malformed_calls_leave_the_whole_text_as_content(text: str) -> None:
    parsed = parse_tool_calls(text, "ep", turn=0)
    assert parsed.content == text and parsed.tool_calls == []
