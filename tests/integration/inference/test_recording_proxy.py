"""The recording proxy on a real vLLM server, driven by the official ``openai`` client.

The tiny random model never emits tool calls, so the tool path is covered by parsing
(test_tool_calls_units, test_proxy_units); here every assistant turn is followed by a
tool result or user message. The strongest check is the log-prob one: the behaviour
log-prob of every model token equals a transformers float32 log-prob over exactly the
recorded prompt + output before it (environment tokens included), so a token the proxy
lost, added or re-tokenised differently from what the model saw would break the match.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import openai
import pytest

from asyncrl.tasks.model.tokenizer import CHAT_TEMPLATE, IM_END_TOKEN, special_token_ids
from asyncrl.tasks.inference.client import RolloutClient
from asyncrl.tasks.inference.conversation import EpisodeTokens
from asyncrl.tasks.inference.proxy import RecordingProxy
from asyncrl.tasks.inference.samples import SampleOutput
from asyncrl.tasks.inference.server import RolloutServerHandle

LOGPROB_TOLERANCE = 1e-4
IM_END = special_token_ids()[IM_END_TOKEN]
TURN_TOKENS = 24
TRUNCATING_TEMPLATE = CHAT_TEMPLATE.replace(
    "(message['content'] or '')",
    "((message['content'] or '')[:4] if message['role'] == 'assistant' and not loop.last"
    " else (message['content'] or ''))",
)
"""Keeps only the first 4 characters of every earlier assistant turn: a template that
rewrites history (as Qwen3's drops earlier reasoning)."""


class Spy:
    """Passes ``generate_one`` through to the real client and keeps what each call sent and got."""

    def __init__(self, client: RolloutClient) -> None:
        self.client = client
        self.calls: list[tuple[list[int], str | None, SampleOutput, str]] = []

    async def generate_one(
        self,
        prompt_token_ids: Sequence[int],
        max_new_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        *,
        stop_token_ids: Sequence[int] = (),
        prefer_server: str | None = None,
    ) -> tuple[SampleOutput, str]:
        sample, url = await self.client.generate_one(
            prompt_token_ids, max_new_tokens, temperature, top_p, stop_token_ids=stop_token_ids,
            prefer_server=prefer_server,
        )  # fmt: skip
        self.calls.append((list(prompt_token_ids), prefer_server, sample, url))
        return sample, url


def _tokenizer(model_dir: Path, template: str | None = None) -> Any:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if template is not None:
        tokenizer.chat_template = template
    return tokenizer


async def _episode(
    proxy: RecordingProxy, episode_id: str, followups: list[dict[str, Any]], between: Callable[[int], Any] | None = None
) -> tuple[EpisodeTokens, list[Any]]:
    """user "Hi" -> model turn -> followups[0] -> model turn -> ...; ``await between(i)`` after turn i."""
    messages: list[Any] = [{"role": "user", "content": "Hi"}]
    base_url = proxy.open_episode(episode_id)
    async with openai.AsyncOpenAI(base_url=base_url, api_key="ignored", max_retries=0) as client:
        for i in range(len(followups) + 1):
            reply = await client.chat.completions.create(model="tiny", messages=messages, max_tokens=TURN_TOKENS)
            messages = [*messages, reply.choices[0].message, *followups[i : i + 1]]
            if between is not None and i < len(followups):
                await between(i)
    tokens = proxy.close_episode(episode_id)
    assert tokens is not None
    return tokens, messages


def _check_recorded(tokens: EpisodeTokens, spy: Spy, tokenizer: Any) -> None:
    """Model turns are exactly what vLLM returned per call, each call continued exactly the
    recorded tokens, environment tokens are masked with log-prob 0 and the previous version."""
    recorded = tokens.prompt_token_ids + tokens.output_token_ids
    assert len(spy.calls) == len(tokens.turn_starts)
    ends = [*tokens.turn_starts[1:], len(tokens.output_token_ids)]
    for (prompt, _, sample, _), start, end in zip(spy.calls, tokens.turn_starts, ends):
        assert prompt == recorded[: len(tokens.prompt_token_ids) + start]
        model_end = start + len(sample.output_token_ids)
        assert tokens.output_token_ids[start:model_end] == sample.output_token_ids
        assert tokens.behaviour_logprobs[start:model_end] == sample.behaviour_logprobs
        assert tokens.token_versions[start:model_end] == sample.token_versions
        assert tokens.output_mask[start:model_end] == [True] * len(sample.output_token_ids)
        assert not any(tokens.output_mask[model_end:end])
    env = [i for i, m in enumerate(tokens.output_mask) if not m]
    assert env and all(tokens.behaviour_logprobs[i] == 0.0 for i in env)
    assert all(tokens.token_versions[i] == tokens.token_versions[i - 1] for i in env)


def _check_logprobs(tokens: EpisodeTokens, hf_models: Callable[[int], Any], helpers: Any) -> float:
    """Every model token's behaviour log-prob against a transformers forward of its version
    over the whole recorded sequence; returns the largest difference."""
    worst = 0.0
    for version in sorted(set(tokens.token_versions)):
        reference = helpers.reference_logprobs(
            hf_models(version), None, tokens.prompt_token_ids, tokens.output_token_ids, len(tokens.output_token_ids)
        )
        for i, (mask, v) in enumerate(zip(tokens.output_mask, tokens.token_versions)):
            if mask and v == version:
                worst = max(worst, abs(reference[i] - tokens.behaviour_logprobs[i]))
    assert worst < LOGPROB_TOLERANCE, worst
    return worst


def _intended_text(tokenizer: Any, tokens: EpisodeTokens, messages: list[Any]) -> str:
    """The conversation rendered by the template, each assistant turn as sampled (a final
    EOS kept, a final <|im_end|> being the turn end the template writes), cut after the
    last sampled token."""
    ends = [*tokens.turn_starts[1:], len(tokens.output_token_ids)]
    rendered: list[dict[str, Any]] = []
    turns = iter(zip(tokens.turn_starts, ends))
    for message in messages:
        if not isinstance(message, dict):  # an assistant message the proxy returned
            start, end = next(turns)
            turn = [t for t, m in zip(tokens.output_token_ids[start:end], tokens.output_mask[start:end]) if m]
            own_end = turn[-1] == IM_END
            message = {"role": "assistant", "content": tokenizer.decode(turn[:-1] if own_end else turn)}
        rendered.append(message)
    text = tokenizer.apply_chat_template(rendered, tokenize=False)
    last = tokens.output_token_ids[-1]
    return text[: -len("\n")] if last == IM_END else text[: -len("<|im_end|>\n")]


@pytest.mark.slow
def test_a_chat_episode_records_exactly_what_vllm_generated(
    server_a: RolloutServerHandle, model_dirs: dict[int, Path], hf_models: Callable[[int], Any], helpers: Any
) -> None:
    tokenizer = _tokenizer(model_dirs[0])
    followups = [
        {"role": "tool", "tool_call_id": "call_0", "content": "42"},
        {"role": "user", "content": "And then?"},
    ]

    async def run() -> tuple[EpisodeTokens, list[Any], Spy, dict[str, Any]]:
        async with RolloutClient([server_a]) as client:
            spy = Spy(client)
            proxy = RecordingProxy(spy, tokenizer, max_episode_tokens=200, max_context_tokens=1024)
            await proxy.start()
            try:
                async with openai.AsyncOpenAI(base_url=proxy.open_episode("bad"), api_key="x", max_retries=0) as bad:
                    with pytest.raises(openai.BadRequestError, match="stream"):
                        await bad.chat.completions.create(
                            model="m", messages=[{"role": "user", "content": "x"}], stream=True
                        )
                assert proxy.close_episode("bad") is None
                tokens, messages = await _episode(proxy, "chat-1", followups)
                return tokens, messages, spy, proxy.stats()
            finally:
                await proxy.stop()

    tokens, messages, spy, stats = asyncio.run(run())
    assert stats["calls"] == 3 and stats["refusals"] == {"invalid_request": 1}
    _check_recorded(tokens, spy, tokenizer)
    assert [prefer for _, prefer, _, _ in spy.calls] == [None, server_a.url, server_a.url]  # sticky
    assert tokenizer.decode(tokens.prompt_token_ids + tokens.output_token_ids) == _intended_text(
        tokenizer, tokens, messages
    )
    worst = _check_logprobs(tokens, hf_models, helpers)
    print(f"proxy episode: {len(tokens.output_token_ids)} tokens, max |behaviour - reference| = {worst:.3g}")


@pytest.mark.slow
def test_an_episode_spanning_a_weight_update_carries_both_versions(
    server_a: RolloutServerHandle,
    model_dirs: dict[int, Path],
    loader: Callable[[int], Any],
    hf_models: Callable[[int], Any],
    helpers: Any,
) -> None:
    tokenizer = _tokenizer(model_dirs[0])

    async def run() -> tuple[EpisodeTokens, Spy, int]:
        async with RolloutClient([server_a]) as client:
            spy = Spy(client)
            old = client.current_version

            async def update(_: int) -> None:
                await client.update_weights(old + 1, loader(old + 1))

            proxy = RecordingProxy(spy, tokenizer, max_episode_tokens=200, max_context_tokens=1024)
            await proxy.start()
            try:
                followups = [{"role": "user", "content": "Go on."}]
                tokens, _ = await _episode(proxy, "update-1", followups, between=update)
                return tokens, spy, old
            finally:
                await proxy.stop()

    tokens, spy, old = asyncio.run(run())
    _check_recorded(tokens, spy, tokenizer)
    second = tokens.turn_starts[1]
    assert set(tokens.token_versions[:second]) == {old}  # the first turn and the env tokens after it
    assert set(tokens.token_versions[second:]) == {old + 1}
    _check_logprobs(tokens, hf_models, helpers)


@pytest.mark.slow
def test_a_template_that_rewrites_history_changes_no_recorded_token(
    server_a: RolloutServerHandle, model_dirs: dict[int, Path], hf_models: Callable[[int], Any], helpers: Any
) -> None:
    """With a template that truncates earlier assistant turns, the second turn still continues
    the first turn's sampled tokens, and the environment tokens are the normal template's."""
    normal, truncating = _tokenizer(model_dirs[0]), _tokenizer(model_dirs[0], TRUNCATING_TEMPLATE)

    async def run() -> tuple[EpisodeTokens, list[Any], Spy]:
        async with RolloutClient([server_a]) as client:
            spy = Spy(client)
            proxy = RecordingProxy(spy, truncating, max_episode_tokens=200, max_context_tokens=1024)
            await proxy.start()
            try:
                tokens, messages = await _episode(proxy, "truncating-1", [{"role": "user", "content": "More."}])
                return tokens, messages, spy
            finally:
                await proxy.stop()

    tokens, messages, spy = asyncio.run(run())
    _check_recorded(tokens, spy, truncating)
    # Same text as the normal template gives for this conversation: nothing was re-rendered.
    recorded_text = normal.decode(tokens.prompt_token_ids + tokens.output_token_ids)
    assert recorded_text == _intended_text(normal, tokens, messages)
    first_turn = spy.calls[0][2].output_token_ids
    assert spy.calls[1][0][len(tokens.prompt_token_ids) :][: len(first_turn)] == first_turn
    if len(messages[1].content) > 4:  # the template would have rewritten it
        assert _intended_text(truncating, tokens, messages) != recorded_text
    _check_logprobs(tokens, hf_models, helpers)


MID_TURN_ATTEMPTS = 3
"""A turn ends at the tiny model's first stop token, often before the update's pause reaches
the engine: the update is retried with the next version until one interrupts the turn."""


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["recompute", "keep"])
def test_an_update_in_the_middle_of_a_turn_resumes_it_with_both_versions(
    mode: str,
    server_a: RolloutServerHandle,
    model_dirs: dict[int, Path],
    loader: Callable[[int], Any],
    hf_models: Callable[[int], Any],
    helpers: Any,
) -> None:
    """Recompute mode: the turn is aborted, resubmitted as prompt + tokens so far on the same
    server; keep mode: it is paused and goes on in the same request (the old tokens' KV
    cache as the old weights computed it). Either way its tokens carry the old then the new
    version, with the behaviour log-probs of the weights that sampled them."""
    tokenizer = _tokenizer(model_dirs[0])

    async def run() -> tuple[EpisodeTokens, Spy, int]:
        async with RolloutClient([server_a], interrupt_mode=mode) as client:
            spy = Spy(client)
            old = client.current_version
            proxy = RecordingProxy(spy, tokenizer, max_episode_tokens=1500, max_context_tokens=2048)
            await proxy.start()
            try:
                base_url = proxy.open_episode(f"mid-turn-{old}")
                async with openai.AsyncOpenAI(base_url=base_url, api_key="x", max_retries=0) as agent:
                    before = client.streamed_tokens()[server_a.url]
                    messages = [{"role": "user", "content": "Tell me a long story."}]
                    call = asyncio.create_task(agent.chat.completions.create(model="m", messages=messages))
                    await helpers.wait_streamed(client, server_a.url, at_least=before + 1)
                    await client.update_weights(old + 1, loader(old + 1))
                    await call
                tokens = proxy.close_episode(f"mid-turn-{old}")
                assert tokens is not None
                return tokens, spy, old
            finally:
                await proxy.stop()

    for attempt in range(MID_TURN_ATTEMPTS):
        tokens, spy, old = asyncio.run(run())
        if len(set(tokens.token_versions)) == 2:
            break
    versions = tokens.token_versions
    print(f"mid-turn update: attempt {attempt + 1}, {versions.count(old)}/{len(versions)} tokens of v{old}")
    assert versions == sorted(versions) and set(versions) == {old, old + 1}, versions
    ((prompt, _, sample, url),) = spy.calls
    segments = 2 if mode == "recompute" else 1  # keep: never resubmitted
    assert (sample.timings.interruptions, sample.timings.segments) == (1, segments) and url == server_a.url
    assert prompt == tokens.prompt_token_ids and tokens.output_token_ids == sample.output_token_ids
    assert tokens.output_mask == [True] * len(versions) and tokens.behaviour_logprobs == sample.behaviour_logprobs
    if mode == "recompute":
        _check_logprobs(tokens, hf_models, helpers)
    else:
        switch = versions.index(old + 1)
        reference = helpers.reference_logprobs(
            hf_models(old), hf_models(old + 1), tokens.prompt_token_ids, tokens.output_token_ids, switch
        )
        worst = max(abs(r - b) for r, b in zip(reference, tokens.behaviour_logprobs))
        assert worst < LOGPROB_TOLERANCE, worst
