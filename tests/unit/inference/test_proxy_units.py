"""The recording proxy over HTTP with the official ``openai`` client and a scripted generator
(no vLLM): schema, token-exact recording, stickiness, refusals, budget, concurrency, shutdown."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import httpx
import openai
import pytest

from asyncrl.tasks.model.tokenizer import EOS_TOKEN, IM_END_TOKEN, build_tokenizer, special_token_ids
from asyncrl.tasks.inference.proxy import RecordingProxy
from asyncrl.tasks.inference.samples import SampleOutput

IM_END = special_token_ids()[IM_END_TOKEN]
EOS = special_token_ids()[EOS_TOKEN]
TOKENIZER = build_tokenizer(320, 2048)
TOOLS = [
    {
        "type": "function",
        "function": {"name": "calc", "description": "evaluate", "parameters": {"properties": {"expr": {}}}},
    }
]


def _enc(text: str) -> list[int]:
    return list(TOKENIZER.encode(text, add_special_tokens=False))


class ScriptedGenerator:
    """``generate_one`` answering scripted replies (cut at max_new_tokens), version 5, from
    server ``http://s{call}``; records each call's arguments. ``gate``: calls wait on it."""

    def __init__(self, replies: list[list[int]], helpers: Any) -> None:
        self.replies = list(replies)
        self.helpers = helpers
        self.calls: list[dict[str, Any]] = []
        self.outputs: list[SampleOutput] = []
        self.gate: asyncio.Event | None = None

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
        self.calls.append(
            dict(prompt=list(prompt_token_ids), max_new_tokens=max_new_tokens, temperature=temperature,
                 top_p=top_p, stop=tuple(stop_token_ids), prefer=prefer_server)
        )  # fmt: skip
        if self.gate is not None:
            await self.gate.wait()
        ids = self.replies.pop(0)[:max_new_tokens]
        finish = "stop" if ids[-1] in stop_token_ids else "length"
        sample = self.helpers.sample_output(ids, finish, [5] * len(ids))
        self.outputs.append(sample)
        return sample, f"http://s{len(self.calls)}"


def _run(
    replies: list[list[int]],
    helpers: Any,
    body: Callable[[RecordingProxy, ScriptedGenerator], Awaitable[Any]],
    **budget: int,
) -> Any:
    async def main() -> Any:
        generator = ScriptedGenerator(replies, helpers)
        limits = {"max_episode_tokens": 1000, "max_context_tokens": 2048, **budget}
        proxy = RecordingProxy(generator, TOKENIZER, default_temperature=0.7, default_top_p=0.9, **limits)
        await proxy.start()
        try:
            return await body(proxy, generator)
        finally:
            await proxy.stop()

    return asyncio.run(main())


def _client(base_url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=base_url, api_key="ignored", max_retries=0)


def test_chat_tool_round_trip_is_recorded_token_exactly(helpers: Any) -> None:
    call = '<tool_call>\n{"name": "calc", "arguments": {"expr": "6*7"}}\n</tool_call>'
    replies = [_enc("Let me see." + call) + [IM_END], _enc("42") + [IM_END]]

    async def body(proxy: RecordingProxy, generator: ScriptedGenerator) -> Any:
        client = _client(proxy.open_episode("ep-1"))
        messages: list[Any] = [{"role": "user", "content": "6*7?"}]
        first = await client.chat.completions.create(
            model="anything", messages=messages, tools=TOOLS  # type: ignore[arg-type]
        )
        choice = first.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me see."
        (tool_call,) = choice.message.tool_calls or []
        assert tool_call.function.name == "calc" and json.loads(tool_call.function.arguments) == {"expr": "6*7"}
        assert first.model == "anything" and first.usage is not None
        assert first.usage.prompt_tokens == len(generator.calls[0]["prompt"])
        assert first.usage.completion_tokens == len(replies[0])
        messages += [choice.message, {"role": "tool", "tool_call_id": tool_call.id, "content": "42"}]
        second = await client.chat.completions.create(
            model="m", messages=messages, tools=TOOLS, temperature=0.2, max_tokens=50  # type: ignore[arg-type]
        )
        assert second.choices[0].message.content == "42" and second.choices[0].finish_reason == "stop"
        models = await client.models.list()
        assert [m.id for m in models.data] == ["policy"]
        return proxy.close_episode("ep-1"), generator

    tokens, generator = _run(replies, helpers, body)
    assert [c["temperature"] for c in generator.calls] == [0.7, 0.2] and generator.calls[0]["top_p"] == 0.9
    assert generator.calls[1]["max_new_tokens"] == 50 and set(generator.calls[0]["stop"]) == {EOS, IM_END}
    # Sticky: the second turn prefers the server of the first.
    assert [c["prefer"] for c in generator.calls] == [None, "http://s1"]
    # Each call continued exactly the recorded tokens; the output = model turns + masked env deltas.
    recorded = tokens.prompt_token_ids + tokens.output_token_ids
    assert generator.calls[0]["prompt"] == tokens.prompt_token_ids
    second_start = len(tokens.prompt_token_ids) + tokens.turn_starts[1]
    assert generator.calls[1]["prompt"] == recorded[:second_start]
    env = _enc("\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n")
    assert tokens.output_token_ids == replies[0] + env + replies[1]
    assert tokens.output_mask == [True] * len(replies[0]) + [False] * len(env) + [True] * len(replies[1])
    assert tokens.token_versions == [5] * len(tokens.output_token_ids)
    expected = TOKENIZER.apply_chat_template(
        [{"role": "user", "content": "6*7?"}, {"role": "assistant", "content": "Let me see." + call},
         {"role": "tool", "content": "42"}, {"role": "assistant", "content": "42"}], tools=TOOLS, tokenize=False,
    )  # fmt: skip
    assert TOKENIZER.decode(recorded) + "\n" == expected
    assert tokens.final_text == "42" and tokens.finish_reason == "stop"


def test_completions_chain_by_text(helpers: Any) -> None:
    async def body(proxy: RecordingProxy, generator: ScriptedGenerator) -> Any:
        client = _client(proxy.open_episode("c"))
        first = await client.completions.create(model="m", prompt="2+2=", max_tokens=3)
        assert first.choices[0].text == "4" and first.choices[0].finish_reason == "stop"
        second = await client.completions.create(model="m", prompt="2+2=" + first.choices[0].text + "\n3+3=")
        assert second.choices[0].text == "6" and second.choices[0].finish_reason == "length"
        with pytest.raises(openai.BadRequestError, match="must start with the previous prompt"):
            await client.completions.create(model="m", prompt="2+2=5")
        with pytest.raises(openai.BadRequestError, match="uses completions"):
            await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
        return proxy.close_episode("c")

    tokens = _run([_enc("4") + [EOS], _enc("6")], helpers, body)
    assert TOKENIZER.decode(tokens.prompt_token_ids + tokens.output_token_ids) == "2+2=4<|endoftext|>\n3+3=6"
    assert tokens.output_mask == [True, True] + [False] * 5 + [True] and tokens.finish_reason == "length"


def test_bad_requests_are_refused_with_a_reason_and_the_proxy_keeps_serving(helpers: Any) -> None:
    async def body(proxy: RecordingProxy, generator: ScriptedGenerator) -> Any:
        base = proxy.open_episode("ep")
        client = _client(base)
        user: list[Any] = [{"role": "user", "content": "hi"}]
        refusals: list[tuple[dict[str, Any], type[Exception], str]] = [
            ({"stream": True}, openai.BadRequestError, "stream: streaming is not supported"),
            ({"n": 2}, openai.BadRequestError, "n: only n=1"),
            ({"seed": 3}, openai.BadRequestError, "seed: 3 is not supported"),
            ({"stop": ["\n"]}, openai.BadRequestError, "stop"),
            ({"tool_choice": "required", "tools": TOOLS}, openai.BadRequestError, "tool_choice"),
            ({"temperature": -1}, openai.BadRequestError, "temperature: must be a number >= 0"),
            ({"max_tokens": 0}, openai.BadRequestError, "max_tokens: must be an int >= 1"),
            ({"messages": []}, openai.BadRequestError, "messages: must be a non-empty list"),
        ]
        for extra, error, message in refusals:
            with pytest.raises(error, match=message):
                await client.chat.completions.create(**{"model": "m", "messages": user, **extra})
        with pytest.raises(openai.BadRequestError, match="unknown or unsupported parameter"):
            await client.chat.completions.create(model="m", messages=user, extra_body={"guided_json": {}})
        first = await client.chat.completions.create(model="m", messages=user)
        edited = [{"role": "user", "content": "HI"}, first.choices[0].message, {"role": "user", "content": "x"}]
        with pytest.raises(openai.BadRequestError, match=r"messages\[0\] \(user\) differs"):
            await client.chat.completions.create(model="m", messages=edited)  # type: ignore[arg-type]
        with pytest.raises(openai.NotFoundError, match="'nope' is not open"):
            await _client(base.replace("/ep/", "/nope/")).chat.completions.create(model="m", messages=user)
        async with httpx.AsyncClient() as http:
            raw = await http.post(base + "/chat/completions", content=b"{not json")
            assert raw.status_code == 400 and "not JSON" in raw.json()["error"]["message"]
        again = [*user, first.choices[0].message, {"role": "user", "content": "x"}]
        second = await client.chat.completions.create(model="m", messages=again)  # type: ignore[arg-type]
        assert second.choices[0].message.content == "b"
        tokens = proxy.close_episode("ep")
        with pytest.raises(openai.NotFoundError, match="'ep' is not open"):
            await client.chat.completions.create(model="m", messages=user)
        return tokens, proxy.stats()

    tokens, stats = _run([_enc("a") + [IM_END], _enc("b") + [IM_END]], helpers, body)
    assert len(tokens.turn_starts) == 2 and stats["calls"] == 2
    assert stats["refusals"] == {"invalid_request": 7, "unsupported_parameter": 4, "episode_not_found": 2}


def test_a_failed_generation_records_nothing_and_the_call_can_be_retried(helpers: Any) -> None:
    class FailingOnce(ScriptedGenerator):
        async def generate_one(self, prompt_token_ids: Sequence[int], *args: Any, **kwargs: Any) -> Any:
            if not self.calls:
                self.calls.append({"prompt": list(prompt_token_ids)})
                raise RuntimeError("sample gave up after 1000 requests (max_segments)")
            return await super().generate_one(prompt_token_ids, *args, **kwargs)

    async def main() -> Any:
        generator = FailingOnce([_enc("ok") + [IM_END]], helpers)
        proxy = RecordingProxy(generator, TOKENIZER, max_episode_tokens=100, max_context_tokens=2048)
        await proxy.start()
        try:
            client = _client(proxy.open_episode("retry"))
            messages: list[Any] = [{"role": "user", "content": "hi"}]
            request: dict[str, Any] = {"model": "m", "messages": messages, "tools": TOOLS}
            with pytest.raises(openai.InternalServerError, match="RuntimeError: sample gave up"):
                await client.chat.completions.create(**request)
            reply = await client.chat.completions.create(**request)
            assert reply.choices[0].message.content == "ok"
            return proxy.close_episode("retry"), generator, proxy.stats()
        finally:
            await proxy.stop()

    tokens, generator, stats = asyncio.run(main())
    assert generator.calls[0]["prompt"] == generator.calls[1]["prompt"] == tokens.prompt_token_ids
    assert TOKENIZER.decode(tokens.prompt_token_ids).startswith("<|im_start|>system\nTools: calc(expr)<|im_end|>")
    assert tokens.output_token_ids == _enc("ok") + [IM_END] and stats["refusals"] == {"internal_error": 1}


def test_budget_clips_max_tokens_then_refuses(helpers: Any) -> None:
    async def body(proxy: RecordingProxy, generator: ScriptedGenerator) -> Any:
        client = _client(proxy.open_episode("b"))
        messages: list[Any] = [{"role": "user", "content": "hi"}]
        first = await client.chat.completions.create(model="m", messages=messages, max_completion_tokens=100)
        assert first.choices[0].finish_reason == "length" and first.choices[0].message.content == "abcd"
        messages += [first.choices[0].message, {"role": "user", "content": "more"}]
        with pytest.raises(openai.BadRequestError, match="episode budget exhausted: 4/4 model tokens"):
            await client.chat.completions.create(model="m", messages=messages)
        return proxy.close_episode("b"), generator

    tokens, generator = _run([_enc("abcdefgh")], helpers, body, max_episode_tokens=4)
    assert generator.calls[0]["max_new_tokens"] == 4
    assert tokens.finish_reason == "length" and tokens.output_token_ids == _enc("abcd")


def test_concurrent_calls_of_one_episode_and_closing_while_generating(helpers: Any) -> None:
    async def body(proxy: RecordingProxy, generator: ScriptedGenerator) -> Any:
        client = _client(proxy.open_episode("busy"))
        user: list[Any] = [{"role": "user", "content": "hi"}]
        generator.gate = asyncio.Event()
        first = asyncio.create_task(client.chat.completions.create(model="m", messages=user))
        while not generator.calls:
            await asyncio.sleep(0.01)
        with pytest.raises(openai.ConflictError, match="has a call in flight"):
            await client.chat.completions.create(model="m", messages=user)
        assert proxy.close_episode("busy") is None  # nothing recorded: the call in flight is cancelled
        with pytest.raises(openai.NotFoundError, match="closed while generating"):
            await first
        # Shutdown cancels what is still generating: the call gets 503 (not retried here).
        other = _client(proxy.open_episode("late"))
        pending = asyncio.create_task(other.chat.completions.create(model="m", messages=user))
        while len(generator.calls) < 2:
            await asyncio.sleep(0.01)
        await proxy.stop()
        with pytest.raises(openai.InternalServerError, match="stopped while generating"):
            await pending
        return proxy.stats()

    stats = _run([_enc("a") + [IM_END], _enc("b") + [IM_END]], helpers, body)
    assert stats["refusals"] == {"episode_busy": 1, "episode_not_found": 1, "proxy_stopping": 1}


def test_episode_ids_and_hosts_are_checked(helpers: Any) -> None:
    async def body(proxy: RecordingProxy, generator: ScriptedGenerator) -> None:
        assert proxy.url.startswith("http://127.0.0.1:")
        assert proxy.open_episode("a.b-C_1") == f"{proxy.url}/episodes/a.b-C_1/v1"
        with pytest.raises(ValueError, match="already open"):
            proxy.open_episode("a.b-C_1")
        with pytest.raises(ValueError, match="episode_id"):
            proxy.open_episode("a/b")
        with pytest.raises(KeyError, match="not open"):
            proxy.close_episode("zzz")
        other = RecordingProxy(generator, TOKENIZER, max_episode_tokens=1, max_context_tokens=1)
        with pytest.raises(ValueError, match="loopback only"):
            await other.start(host="0.0.0.0")

    _run([], helpers, body)
    with pytest.raises(ValueError, match="top_p"):
        RecordingProxy(
            ScriptedGenerator([], helpers), TOKENIZER, default_top_p=0, max_episode_tokens=1, max_context_tokens=1
        )
