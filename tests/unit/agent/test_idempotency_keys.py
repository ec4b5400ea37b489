"""Tool calls' idempotency keys: a function of (run, group, sample, turn, call) only, so a
replay of an episode's turn repeats them and nothing else does; the calculator example answers
a repeated key from its memo without running the tool again (docs/agents.md)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from asyncrl.configs.episode import EpisodeConfig
from asyncrl.examples import calculator
from asyncrl.examples.calculator import ToolMemo, run_tool
from asyncrl.tasks.agent.episode import EPISODE_API_KEY, EpisodeContext, run_episode, stable_episode_id
from asyncrl.tasks.agent.runner import EpisodeRunner
from asyncrl.tasks.data.records import PromptRecord
from asyncrl.tasks.inference.conversation import EpisodeTokens
from asyncrl.tasks.inference.proxy import EPISODE_ID, RecordingProxy
from asyncrl.tasks.inference.samples import SampleOutput
from asyncrl.tasks.model.tokenizer import IM_END_TOKEN, build_tokenizer, special_token_ids

RECORD = PromptRecord(prompt_id="000001-abc", prompt="What is 482*37+5?", answer="17839")
TOKENIZER = build_tokenizer(320, 2048)
IM_END = special_token_ids()[IM_END_TOKEN]
TOOLS = [{"type": "function", "function": {"name": "calc", "parameters": {"properties": {"expr": {}}}}}]


class Recorder:
    """Hands out base URLs and records which episode ids were opened."""

    def __init__(self) -> None:
        self.opened: list[str] = []

    def open_episode(self, episode_id: str) -> str:
        self.opened.append(episode_id)
        return f"http://127.0.0.1:1/episodes/{episode_id}/v1"

    def close_episode(self, episode_id: str) -> EpisodeTokens | None:
        return None


def group_keys(scope: str, group: str, n: int = 2, turns: int = 2, calls: int = 2) -> tuple[list[str], list[list[str]]]:
    """(episode ids opened, each episode's keys for its turns x calls) of one run of a group."""
    keys: dict[int, list[str]] = {}

    async def episode(context: EpisodeContext) -> float:
        keys[context.sample_index] = [context.tool_call_key(t, i) for t in range(turns) for i in range(calls)]
        return 1.0

    recorder = Recorder()
    runner = EpisodeRunner(episode, recorder, EpisodeConfig(function="m:f"), model="m", scope=scope)
    asyncio.run(runner.run_group(group, RECORD, n))
    return recorder.opened, [keys[i] for i in range(n)]


def test_a_replay_of_an_episode_repeats_its_keys_and_nothing_else_shares_one() -> None:
    opened, keys = group_keys("run-a", "g00000007")
    assert opened == ["run-a.g00000007.0", "run-a.g00000007.1"]  # the recorder's id is the context's
    assert keys[0][:3] == ["call_run-a.g00000007.0_0_0", "call_run-a.g00000007.0_0_1", "call_run-a.g00000007.0_1_0"]
    again_opened, again = group_keys("run-a", "g00000007")  # the same group run again (a retry)
    assert (again_opened, again) == (opened, keys)
    every = [k for _, ks in (group_keys("run-a", "g00000007"), group_keys("run-a", "g00000008"),
                             group_keys("run-b", "g00000007")) for sample in ks for k in sample]  # fmt: skip
    distinct = {k for k in every}
    # the replay repeats 8 keys; otherwise turns, calls, samples, groups and runs all differ
    assert len(every) == 3 * 2 * 4 and len(distinct) == len(every)


def test_a_hand_built_context_gets_a_random_id_and_keys_count_from_zero() -> None:
    first = EpisodeContext(RECORD, "http://x/v1", EPISODE_API_KEY, "m", 0)
    second = EpisodeContext(RECORD, "http://x/v1", EPISODE_API_KEY, "m", 0)
    assert first.episode_id != second.episode_id
    assert first.tool_call_key(0) == f"call_{first.episode_id}_0_0"
    with pytest.raises(ValueError, match="turn and index count from 0"):
        first.tool_call_key(-1)


def test_a_long_scope_still_makes_an_id_the_endpoint_accepts() -> None:
    long_a, long_b = "r" * 200, "r" * 199 + "s"
    ids = [stable_episode_id(scope, "g00000001", 15) for scope in (long_a, long_b)]
    assert all(EPISODE_ID.fullmatch(i) for i in ids) and ids[0] != ids[1]
    assert stable_episode_id("demo-tool", "g00000001", 15) == "demo-tool.g00000001.15"


def test_the_memo_answers_a_repeated_call_and_runs_a_changed_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ran: list[str] = []
    real_calc = calculator.calc
    monkeypatch.setattr(calculator, "calc", lambda expr: ran.append(expr) or real_calc(expr))
    memo = ToolMemo(tmp_path / "memo")
    assert run_tool("calc", '{"expr": "2*3"}', key="call_r.g1.0_0_0", memo=memo) == "6"
    assert run_tool("calc", '{"expr": "2*3"}', key="call_r.g1.0_0_0", memo=ToolMemo(tmp_path / "memo")) == "6"
    assert ran == ["2*3"]  # the repeat (even through another memo object: a restarted process) ran nothing
    # the same key with other arguments: that turn was sampled anew, so the call runs and replaces the record
    assert run_tool("calc", '{"expr": "2*4"}', key="call_r.g1.0_0_0", memo=memo) == "8"
    assert memo.recall("call_r.g1.0_0_0", "calc", '{"expr": "2*4"}') == "8"
    assert run_tool("calc", '{"expr": "2*3"}', key="call_r.g1.1_0_0", memo=memo) == "6"  # another sample's call
    assert run_tool("calc", '{"expr": "2*3"}') == "6"  # no key: no memo, as before
    assert ran == ["2*3", "2*4", "2*3", "2*3"]
    assert not list((tmp_path / "memo").glob("*.tmp"))


class OneToolCallGenerator:
    """The model of every episode: first turn calls ``calc`` on 482*37+5, second answers."""

    def __init__(self, helpers: Any) -> None:  # noqa: ANN401 - the session's plain helpers
        self.helpers = helpers
        self.turn = 0

    async def generate_one(
        self, prompt_token_ids: Sequence[int], max_new_tokens: int, temperature: float = 1.0, top_p: float = 1.0,
        *, stop_token_ids: Sequence[int] = (), prefer_server: str | None = None,
    ) -> tuple[SampleOutput, str]:  # fmt: skip
        call = '<tool_call>\n{"name": "calc", "arguments": {"expr": "482*37+5"}}\n</tool_call>'
        text = call if self.turn % 2 == 0 else "#### 17839"
        self.turn += 1
        ids = list(TOKENIZER.encode(text, add_special_tokens=False)) + [IM_END]
        return self.helpers.sample_output(ids, "stop", [1] * len(ids)), "http://s1"


def test_the_calculator_episode_hands_its_tool_the_key_and_a_retry_runs_no_call_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, helpers: Any
) -> None:
    """The real endpoint and the example's ``solve``: the call's id is the context's key, and
    running the same episode again (a retry after a crash) answers the call from the memo."""
    ran: list[str] = []
    real_calc = calculator.calc
    monkeypatch.setattr(calculator, "calc", lambda expr: ran.append(expr) or real_calc(expr))
    config = EpisodeConfig(function="m:f", options={"tools": TOOLS, "max_turns": 3, "memo_dir": str(tmp_path / "memo")})
    seen: list[tuple[str, str]] = []

    async def solve(context: EpisodeContext) -> float | None:
        seen.append((context.episode_id, context.tool_call_key(0, 0)))
        return await calculator.solve(context)

    async def main() -> list[list[EpisodeTokens | None]]:
        proxy = RecordingProxy(OneToolCallGenerator(helpers), TOKENIZER, default_temperature=1.0, default_top_p=1.0,
                               max_episode_tokens=1000, max_context_tokens=2048)  # fmt: skip
        await proxy.start(host="127.0.0.1", port=0)
        try:
            runner = EpisodeRunner(solve, proxy, config, model="m", scope="demo-tool")
            runs = [await runner.run_group("g00000003", RECORD, 1) for _ in range(2)]
            runs.append(await runner.run_group("g00000004", RECORD, 1))
        finally:
            await proxy.stop()
        return [[o.tokens for o in outcomes] for outcomes in runs]

    tokens = asyncio.run(main())
    assert all(t is not None and t.finish_reason == "stop" for run in tokens for t in run)
    assert seen[0] == seen[1] == ("demo-tool.g00000003.0", "call_demo-tool.g00000003.0_0_0")
    assert seen[2][1] == "call_demo-tool.g00000004.0_0_0"
    assert ran == ["482*37+5", "482*37+5"]  # group 3's retry was answered from the memo; group 4 ran
    records = [json.loads(p.read_text()) for p in sorted((tmp_path / "memo").glob("*.json"))]
    assert sorted(r["key"] for r in records) == ["call_demo-tool.g00000003.0_0_0", "call_demo-tool.g00000004.0_0_0"]
    assert {r["result"] for r in records} == {"17839"}
