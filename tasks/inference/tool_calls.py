"""Hermes/Qwen-style tool calls in model text, as OpenAI ``tool_calls`` entries.

A model turn that calls tools reads ``content<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``
(one block per call, blocks separated by whitespace). :func:`parse_tool_calls` returns the
content before the first block and one OpenAI entry per block. A block the model got
wrong (unclosed, not JSON, no string ``name``, ``arguments`` not an object) is the
model's mistake, not a server error: the whole text is then returned as content with no
tool call, and the trainer sees the tokens it sampled either way.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from asyncrl.tasks.model.tokenizer import TOOL_CALL_CLOSE, TOOL_CALL_OPEN

_BLOCK = re.compile(re.escape(TOOL_CALL_OPEN) + r"(.*?)" + re.escape(TOOL_CALL_CLOSE), re.DOTALL)


@dataclass(frozen=True)
class ParsedTurn:
    """A model turn's text split into its content and its tool calls (OpenAI schema)."""

    content: str
    tool_calls: list[dict[str, Any]]
    """``{"id", "type": "function", "function": {"name", "arguments": <JSON object text>}}``."""


def tool_call_id(episode_id: str, turn: int, index: int) -> str:
    """Id of the ``index``-th call of model turn ``turn`` (both from 0) of an episode:
    ``call_<episode_id>_<turn>_<index>``. It is the call's idempotency key (``docs/agents.md``):
    the same whenever the same episode's turn is run again, since every part is, and distinct
    for any other call, since the last two ``_`` fields are the numbers and the rest is the
    episode id."""
    return f"call_{episode_id}_{turn}_{index}"


def _call(body: str) -> tuple[str, str] | None:
    """(name, arguments as JSON text) of one block's body, or None if it is malformed."""
    try:
        parsed = json.loads(body)
    except ValueError:
        return None
    if not isinstance(parsed, dict) or not isinstance(parsed.get("name"), str) or not parsed["name"]:
        return None
    arguments = parsed.get("arguments", {})
    if isinstance(arguments, str):  # some models emit the arguments already serialised
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return parsed["name"], json.dumps(arguments, ensure_ascii=False)


def parse_tool_calls(text: str, episode_id: str, turn: int) -> ParsedTurn:
    """Split ``text`` into content and tool calls; all blocks must parse, else no call at all.

    Content is the text before the first ``<tool_call>`` with trailing whitespace removed;
    text between or after blocks must be whitespace (otherwise the turn is malformed).
    """
    start = text.find(TOOL_CALL_OPEN)
    if start < 0:
        return ParsedTurn(text, [])
    calls: list[dict[str, Any]] = []
    position = start
    for match in _BLOCK.finditer(text, start):
        if text[position : match.start()].strip():
            return ParsedTurn(text, [])
        parsed = _call(match.group(1).strip())
        if parsed is None:
            return ParsedTurn(text, [])
        name, arguments = parsed
        call_id = tool_call_id(episode_id, turn, len(calls))
        calls.append({"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}})
        position = match.end()
    if not calls or text[position:].strip():  # an unclosed block, or text after the last one
        return ParsedTurn(text, [])
    return ParsedTurn(text[:start].rstrip(), calls)
