"""Conversation state of one episode (no server): deltas, env-token conventions, history
checks, templates that rewrite history, budgets, completion chains. Tiny byte-level tokenizer."""

from __future__ import annotations

from typing import Any

import pytest

from asyncrl.tasks.model.tokenizer import CHAT_TEMPLATE, EOS_TOKEN, IM_END_TOKEN, build_tokenizer, special_token_ids
from asyncrl.tasks.inference.conversation import (
    BudgetExhausted,
    ChatConversation,
    CompletionChain,
    ConversationError,
    EpisodeBudget,
    EpisodeTokens,
    TemplateError,
)

IM_END = special_token_ids()[IM_END_TOKEN]
EOS = special_token_ids()[EOS_TOKEN]
TOOLS = [{"type": "function", "function": {"name": "calc", "parameters": {"properties": {"expr": {}}}}}]
THINK_DROPPING_TEMPLATE = CHAT_TEMPLATE.replace(
    "(message['content'] or '')",
    "((message['content'] or '').split('</think>')[-1] if message['role'] == 'assistant' and not loop.last"
    " else (message['content'] or ''))",
)
"""Earlier assistant turns lose their ``<think>...</think>`` part when re-rendered."""
LAST_TURN_DECORATING_TEMPLATE = CHAT_TEMPLATE.replace(
    "(message['content'] or '')",
    "(('<think>\\n\\n</think>\\n\\n' + (message['content'] or '')) if message['role'] == 'assistant' and loop.last"
    " else ((message['content'] or '').split('</think>')[-1] if message['role'] == 'assistant'"
    " else (message['content'] or '')))",
)
"""Like Qwen3's: the last assistant turn gets an (empty) think block, earlier ones lose theirs."""


@pytest.fixture
def tokenizer() -> Any:
    return build_tokenizer(320, 2048)


def _enc(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def _chat(tokenizer: Any, budget: EpisodeBudget | None = None) -> ChatConversation:
    return ChatConversation(tokenizer, budget or EpisodeBudget(10_000, 2048), "ep-7")


def _turn(conversation: Any, plan: Any, ids: list[int], helpers: Any, finish: str = "stop", version: int = 0) -> Any:
    return conversation.record(plan, helpers.sample_output(ids, finish, [version] * len(ids)))


def test_first_call_prompt_is_the_rendered_template(tokenizer: Any, helpers: Any) -> None:
    conversation = _chat(tokenizer)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
    plan = conversation.plan(messages, None, 8, parse_tools=False)
    expected = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.decode(plan.turn.context_token_ids) == expected
    assert plan.turn.context_token_ids == _enc(tokenizer, expected) and plan.turn.max_new_tokens == 8
    assert conversation.tokens() is None  # nothing recorded before a model turn
    turn = _turn(conversation, plan, _enc(tokenizer, "4") + [IM_END], helpers)
    assert turn.message == {"role": "assistant", "content": "4"} and turn.finish_reason == "stop"
    tokens = conversation.tokens()
    assert tokens is not None and tokens.prompt_token_ids == _enc(tokenizer, expected)
    assert tokens.output_token_ids == [52, IM_END] and tokens.output_mask == [True, True]
    assert tokens.turn_starts == [0] and tokens.final_text == "4" and tokens.finish_reason == "stop"


def _three_turns(tokenizer: Any, helpers: Any, conversation: ChatConversation) -> tuple[list[Any], list[list[int]]]:
    """user -> model (tool call, v1) -> tool result -> model (v1, v2, ended by EOS) -> user -> model (cut)."""
    messages: list[Any] = [{"role": "user", "content": "What is 6*7?"}]
    replies = [
        _enc(tokenizer, '<think>hm</think><tool_call>\n{"name": "calc", "arguments": {"expr": "6*7"}}\n</tool_call>')
        + [IM_END],
        _enc(tokenizer, "It is 42.") + [EOS],
        _enc(tokenizer, "Sure, 7*6=4"),
    ]
    versions = [[1] * len(replies[0]), [1] * 3 + [2] * (len(replies[1]) - 3), [2] * len(replies[2])]
    finishes = ["stop", "stop", "length"]
    followups: list[list[Any]] = [
        [{"role": "tool", "tool_call_id": "x", "content": "42"}],
        [{"role": "user", "content": "And 7*6?"}],
    ]
    for i, reply in enumerate(replies):
        plan = conversation.plan(messages, TOOLS, len(reply), parse_tools=True)
        turn = conversation.record(plan, helpers.sample_output(reply, finishes[i], versions[i]))
        messages = [*messages, turn.message, *(followups[i] if i < 2 else [])]
    return messages, replies


def test_multi_turn_tokens_are_model_turns_and_masked_env_deltas(tokenizer: Any, helpers: Any) -> None:
    conversation = _chat(tokenizer)
    messages, replies = _three_turns(tokenizer, helpers, conversation)
    tokens = conversation.tokens()
    assert tokens is not None
    out = tokens.output_token_ids
    starts = tokens.turn_starts
    assert len(starts) == 3
    # Model turns are exactly the sampled tokens; everything between them is masked env tokens.
    for start, reply in zip(starts, replies):
        assert out[start : start + len(reply)] == reply
    env_1 = out[len(replies[0]) : starts[1]]
    env_2 = out[starts[1] + len(replies[1]) : starts[2]]
    # Turn 1 ended with its own <|im_end|>: only "\n" closes it. Turn 2 ended with EOS: the full end is added.
    assert env_1 == _enc(tokenizer, "\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n")
    assert env_2 == _enc(tokenizer, "<|im_end|>\n<|im_start|>user\nAnd 7*6?<|im_end|>\n<|im_start|>assistant\n")
    expected_mask = [True] * len(replies[0]) + [False] * len(env_1) + [True] * len(replies[1])
    expected_mask += [False] * len(env_2) + [True] * len(replies[2])
    assert tokens.output_mask == expected_mask
    env = [i for i, m in enumerate(tokens.output_mask) if not m]
    assert all(tokens.behaviour_logprobs[i] == 0.0 for i in env)
    # Env tokens repeat the version of the model token before them.
    assert all(tokens.token_versions[i] == tokens.token_versions[i - 1] for i in env)
    assert tokens.token_versions[starts[1] - 1] == 1 and tokens.token_versions[starts[2] - 1] == 2
    assert tokens.behaviour_logprobs[starts[2]] == -0.5 and tokens.finish_reason == "length"
    assert tokens.final_text == "Sure, 7*6=4"
    # With ChatML the recorded text is the conversation the agent sees, turn ends as sampled.
    text = tokenizer.decode(tokens.prompt_token_ids + out)
    assert text.startswith("<|im_start|>system\nTools: calc(expr)<|im_end|>\n<|im_start|>user\nWhat is 6*7?")
    assert "</tool_call><|im_end|>\n<|im_start|>tool\n42" in text and "It is 42.<|endoftext|><|im_end|>\n" in text


def test_tool_call_turns_return_openai_messages(tokenizer: Any, helpers: Any) -> None:
    conversation = _chat(tokenizer)
    plan = conversation.plan([{"role": "user", "content": "6*7?"}], TOOLS, None, parse_tools=True)
    reply = _enc(tokenizer, 'ok<tool_call>\n{"name": "calc", "arguments": {"expr": "6*7"}}\n</tool_call>') + [IM_END]
    turn = _turn(conversation, plan, reply, helpers)
    assert turn.finish_reason == "tool_calls" and turn.message["content"] == "ok"
    (call,) = turn.message["tool_calls"]
    assert call["function"] == {"name": "calc", "arguments": '{"expr": "6*7"}'} and call["id"].startswith("call_")
    # Without tools in the request the same text is plain content.
    plain = _chat(tokenizer)
    plan = plain.plan([{"role": "user", "content": "6*7?"}], None, None, parse_tools=False)
    assert _turn(plain, plan, reply, helpers).message == {"role": "assistant", "content": tokenizer.decode(reply[:-1])}


@pytest.mark.parametrize("template", [THINK_DROPPING_TEMPLATE, LAST_TURN_DECORATING_TEMPLATE])
def test_a_template_that_rewrites_history_does_not_change_recorded_tokens(helpers: Any, template: str) -> None:
    normal, rewriting = build_tokenizer(320, 2048), build_tokenizer(320, 2048)
    rewriting.chat_template = template
    recorded = []
    for tokenizer in (normal, rewriting):
        conversation = _chat(tokenizer)
        messages, _ = _three_turns(tokenizer, helpers, conversation)
        recorded.append((conversation.tokens(), messages))
    assert recorded[0][0] == recorded[1][0]
    # The check has power: re-rendering the history with the rewriting template loses the
    # <think> part the model sampled and saw.
    tokens, messages = recorded[1]
    assert tokens is not None and "<think>hm</think>" in rewriting.decode(tokens.output_token_ids)
    rerendered = rewriting.apply_chat_template(messages, tools=TOOLS, tokenize=False)
    assert "<think>hm</think>" not in rerendered


def test_history_must_be_resent_unchanged(tokenizer: Any, helpers: Any) -> None:
    conversation = _chat(tokenizer)
    first = [{"role": "user", "content": [{"type": "text", "text": "6*"}, {"type": "text", "text": "7?"}]}]
    plan = conversation.plan(first, TOOLS, None, parse_tools=True)
    reply = _enc(tokenizer, '<tool_call>\n{"name": "calc", "arguments": {"expr": "6*7"}}\n</tool_call>') + [IM_END]
    turn = _turn(conversation, plan, reply, helpers)
    assert turn.message["content"] is None
    call = turn.message["tool_calls"][0]
    tool = {"role": "tool", "tool_call_id": call["id"], "content": "42"}
    # Accepted: content "" for None, text parts for a string, arguments re-serialised, another id.
    echoed = {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"id": "other", "function": {"name": "calc", "arguments": '{ "expr" : "6*7" }'}}],
    }
    conversation.plan([{"role": "user", "content": "6*7?"}, echoed, tool], TOOLS, None, parse_tools=True)
    edits: list[tuple[list[Any], str]] = [
        ([{"role": "user", "content": "6*8?"}, turn.message, tool], r"messages\[0\] \(user\) differs"),
        ([first[0], {**turn.message, "content": "I will call"}, tool], r"messages\[1\] \(assistant\) differs"),
        ([first[0], {"role": "assistant", "content": None}, tool], r"messages\[1\] \(assistant\) differs"),
        ([first[0]], "1 messages but the episode's history has 2"),
        ([], "non-empty list"),
        ([first[0], {"content": "x"}], r"messages\[1\]: a message is an object with a string 'role'"),
        ([first[0], turn.message, {"role": "user", "content": [{"type": "image_url"}]}], "only text parts"),
    ]
    for messages, error in edits:
        with pytest.raises(ConversationError, match=error):
            conversation.plan(messages, TOOLS, None, parse_tools=True)
    with pytest.raises(ConversationError, match="tools: differ"):
        conversation.plan([*first, turn.message, tool], None, None, parse_tools=False)


def test_budget_clips_then_refuses_and_the_episode_ends_with_length(tokenizer: Any, helpers: Any) -> None:
    conversation = _chat(tokenizer, EpisodeBudget(max_episode_tokens=10, max_context_tokens=2048))
    messages: list[Any] = [{"role": "user", "content": "hi"}]
    plan = conversation.plan(messages, None, 6, parse_tools=False)
    assert (plan.turn.max_new_tokens, plan.turn.clipped) == (6, False)
    turn = _turn(conversation, plan, _enc(tokenizer, "hello") + [IM_END], helpers)
    messages += [turn.message, {"role": "user", "content": "more"}]
    plan = conversation.plan(messages, None, 100, parse_tools=False)
    assert (plan.turn.max_new_tokens, plan.turn.clipped) == (4, True)  # 10 - 6 model tokens left
    turn = _turn(conversation, plan, _enc(tokenizer, "abcd"), helpers, finish="length")
    messages += [turn.message, {"role": "user", "content": "again"}]
    before = conversation.tokens()
    with pytest.raises(BudgetExhausted, match="10/10 model tokens"):
        conversation.plan(messages, None, None, parse_tools=False)
    tokens = conversation.tokens()
    assert tokens is not None and before is not None and tokens.finish_reason == "length"
    assert tokens.output_token_ids == before.output_token_ids and sum(tokens.output_mask) == 10
    assert tokens.budget_exhausted


def test_a_continuation_that_inserts_nothing_extends_the_turn(tokenizer: Any, helpers: Any) -> None:
    """A completion cut by its own max_tokens and continued from exactly the recorded tokens
    adds no environment token: the continuation is the same model turn (no turn start right
    after a model token, which the shard schema refuses)."""
    chain = CompletionChain(tokenizer, EpisodeBudget(1000, 2048))
    plan = chain.plan("2+2=", 1)
    chain.record(plan, helpers.sample_output(_enc(tokenizer, "4"), "length"))
    tokens = chain.tokens()
    assert tokens is not None
    plan = chain.plan(tokens.prompt_token_ids + tokens.output_token_ids, 2)
    assert plan.turn.new_token_ids == []
    chain.record(plan, helpers.sample_output(_enc(tokenizer, "!") + [EOS]))
    tokens = chain.tokens()
    assert tokens is not None and tokens.turn_starts == [0] and all(tokens.output_mask)
    assert not tokens.budget_exhausted and tokens.finish_reason == "stop"


def test_context_cap_counts_prompt_and_env_tokens(tokenizer: Any, helpers: Any) -> None:
    messages: list[Any] = [{"role": "user", "content": "hi"}]
    prompt_len = len(_enc(tokenizer, "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"))
    conversation = _chat(tokenizer, EpisodeBudget(max_episode_tokens=1000, max_context_tokens=prompt_len + 3))
    plan = conversation.plan(messages, None, None, parse_tools=False)
    assert plan.turn.max_new_tokens == 3 and not plan.turn.clipped  # no max_tokens asked: the allowance
    turn = _turn(conversation, plan, _enc(tokenizer, "ok") + [IM_END], helpers)
    with pytest.raises(BudgetExhausted, match=f"context would be {prompt_len + 3 + 1 + 20}/{prompt_len + 3}"):
        conversation.plan([*messages, turn.message, {"role": "user", "content": "x"}], None, None, parse_tools=False)
    tokens = conversation.tokens()
    assert tokens is not None and tokens.finish_reason == "length"
    too_long = _chat(tokenizer, EpisodeBudget(max_episode_tokens=1000, max_context_tokens=prompt_len))
    with pytest.raises(BudgetExhausted):
        too_long.plan(messages, None, None, parse_tools=False)
    assert too_long.tokens() is None


@pytest.mark.parametrize(
    ("old", "new"),
    [
        # Every earlier assistant turn rendered empty: the anchor's "y" is gone too.
        (
            "(message['content'] or '')",
            "('' if message['role'] == 'assistant' and not loop.last else message['content'])",
        ),
        # A generation prompt unlike the assistant turns' header.
        ("'<|im_start|>assistant\\n' }}{% endif %}", "'<|im_start|>bot\\n' }}{% endif %}"),
    ],
)
def test_a_template_that_cannot_give_deltas_is_named_at_the_first_call(old: str, new: str) -> None:
    """The episode says so instead of recording wrong tokens (HTTP 500: a setup error)."""
    tokenizer = build_tokenizer(320, 2048)
    assert old in CHAT_TEMPLATE
    tokenizer.chat_template = CHAT_TEMPLATE.replace(old, new)
    with pytest.raises(TemplateError, match="does not render as the generation prompt \\+ its content"):
        _chat(tokenizer).plan([{"role": "user", "content": "x"}], None, None, parse_tools=False)


def test_completion_chain_by_text_and_by_ids(tokenizer: Any, helpers: Any) -> None:
    chain = CompletionChain(tokenizer, EpisodeBudget(1000, 2048))
    plan = chain.plan("2+2=", 4)
    assert plan.turn.context_token_ids == _enc(tokenizer, "2+2=")
    assert chain.record(plan, helpers.sample_output(_enc(tokenizer, "4") + [EOS])) == "4"
    plan = chain.plan("2+2=4\n3+3=", 4)  # the returned text leaves the stop token out; it stays recorded
    assert plan.turn.new_token_ids == _enc(tokenizer, "\n3+3=")
    assert chain.record(plan, helpers.sample_output(_enc(tokenizer, "6"), "length", [3])) == "6"
    tokens = chain.tokens()
    assert tokens is not None
    recorded = tokens.prompt_token_ids + tokens.output_token_ids
    assert tokenizer.decode(recorded) == "2+2=4<|endoftext|>\n3+3=6"
    assert tokens.output_mask == [True, True] + [False] * 5 + [True] and tokens.token_versions[2:] == [0] * 5 + [3]
    plan = chain.plan(recorded + [10], 2)  # as token ids: every recorded token, stop token included
    assert plan.turn.new_token_ids == [10]
    with pytest.raises(ConversationError, match="must start with the previous prompt"):
        chain.plan("2+2=5", 4)
    with pytest.raises(ConversationError, match="start with the episode's 12 recorded tokens"):
        chain.plan(recorded[:-1], 4)
    with pytest.raises(ConversationError, match="prompt is empty"):
        CompletionChain(tokenizer, EpisodeBudget(1000, 2048)).plan("", 4)


def test_a_plan_is_recorded_only_onto_the_state_it_was_made_on(tokenizer: Any, helpers: Any) -> None:
    conversation = _chat(tokenizer)
    messages: list[Any] = [{"role": "user", "content": "hi"}]
    plan = conversation.plan(messages, None, None, parse_tools=False)
    turn = _turn(conversation, plan, [65, IM_END], helpers)
    plan = conversation.plan([*messages, turn.message, {"role": "user", "content": "x"}], None, None, False)
    _turn(conversation, plan, [66, IM_END], helpers)
    with pytest.raises(ConversationError, match="changed while this call was generating"):
        _turn(conversation, plan, [67, IM_END], helpers)


def test_episode_tokens_check_their_invariants() -> None:
    good = dict(
        prompt_token_ids=[1], output_token_ids=[2, 3], output_mask=[True, False], behaviour_logprobs=[-1.0, 0.0],
        token_versions=[0, 0], turn_starts=[0], finish_reason="stop", final_text="",
    )  # fmt: skip
    EpisodeTokens(**good)  # type: ignore[arg-type]
    for change, error in (
        ({"output_mask": [True]}, "mask/logprobs/versions lengths"),
        ({"turn_starts": [1]}, "increasing from 0"),
        ({"turn_starts": [0, 1]}, "must point at model tokens"),
    ):
        with pytest.raises(ValueError, match=error):
            EpisodeTokens(**{**good, **change})  # type: ignore[arg-type]
