"""Warm-start demonstrations in the tokens the recording endpoint would have recorded.

A demonstration is an OpenAI chat conversation (``{"messages": [...], "tools": [...]}``, a
data row's ``conversation``). It is replayed through the endpoint's own conversation code
(:class:`~asyncrl.tasks.inference.conversation.ChatConversation`) as if the model had written
each assistant message: the message as the chat template renders it, then the turn's stop
token. So the SFT example holds exactly the token sequence an episode produces at RL time
(prompt, model turns, and the tokens inserted between them), and the warm start trains on
the assistant turns only (``output_mask``).
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from typing import Any

from asyncrl.tasks.inference.conversation import (
    ANCHOR_USER,
    ChatConversation,
    ChatTokenizer,
    EpisodeBudget,
    EpisodeTokens,
    TurnRenderer,
    normalize_message,
)
from asyncrl.tasks.inference.samples import SampleOutput, SampleTimings

_UNBOUNDED = 1 << 30


def assistant_turn_ids(tokenizer: ChatTokenizer, renderer: TurnRenderer, message: Mapping[str, Any]) -> list[int]:
    """The tokens a model writes for ``message``: the template's rendering of it between the
    generation prompt and the turn's end, then the first end token (the stop token)."""
    gen = renderer.render([ANCHOR_USER], add_generation_prompt=True)
    closed = renderer.render([ANCHOR_USER, normalize_message(dict(message), "assistant")], add_generation_prompt=False)
    close_text = renderer.render([ANCHOR_USER, {"role": "assistant", "content": ""}], add_generation_prompt=False)[len(gen) :]
    if not closed.startswith(gen) or not closed.endswith(close_text):
        raise ValueError("chat template: an assistant message does not render between the generation prompt and its end")
    body = closed[len(gen) : len(closed) - len(close_text)]
    return list(tokenizer.encode(body, add_special_tokens=False)) + renderer.close_token_ids[:1]


def demonstration_tokens(
    tokenizer: ChatTokenizer, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None = None
) -> EpisodeTokens:
    """The episode tokens of a demonstration (module docstring); ``ValueError`` if it has no
    assistant message after its first message or does not replay token-exactly (e.g. an
    assistant message whose tool calls the endpoint would not parse back)."""
    tool_list = [dict(t) for t in tools] if tools else None
    renderer = TurnRenderer(tokenizer, tool_list)
    conversation = ChatConversation(tokenizer, EpisodeBudget(_UNBOUNDED, _UNBOUNDED), "demonstration")
    history: list[dict[str, Any]] = []
    for index, message in enumerate(messages):
        if message.get("role") != "assistant" or not history:
            history.append(dict(message))
            continue
        plan = conversation.plan(history, tool_list, None, parse_tools=bool(tool_list))
        ids = assistant_turn_ids(tokenizer, renderer, message)
        now = time.time()
        sample = SampleOutput(ids, [0.0] * len(ids), [0] * len(ids), "stop", SampleTimings(now, now, 0, 0, 1))
        turn = conversation.record(plan, sample)
        replayed, wanted = normalize_message(turn.message, "replayed"), normalize_message(dict(message), f"messages[{index}]")
        if (replayed["content"], _calls(replayed)) != (wanted["content"], _calls(wanted)):
            raise ValueError(
                f"messages[{index}]: replays as {replayed!r:.200} instead of {wanted!r:.200} "
                "(the endpoint would return another message for these tokens)"
            )
        history.append(turn.message)
    tokens = conversation.tokens()
    if tokens is None:
        raise ValueError("a demonstration needs an assistant message after its first message")
    return tokens


def _calls(message: Mapping[str, Any]) -> list[tuple[str, Any]]:
    """Tool calls compared by name and argument value (JSON text parsed)."""
    calls = []
    for call in message.get("tool_calls", []):
        arguments = call["function"]["arguments"]
        try:
            arguments = json.loads(arguments)
        except ValueError:
            pass
        calls.append((call["function"]["name"], arguments))
    return calls
