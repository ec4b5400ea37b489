"""A group cut mid-generation goes on from its journaled tokens, on a real vLLM server.

The first client generates a long group, its book is journaled to a run root part way, the
group runs on past the journal and is then cut (what a killed scheduler leaves: the journal,
nothing else). The server then moves to new weights, and a second client, its book loaded
from the journal, asks for the same group: each sample must start with exactly its
journaled tokens, log-probs and versions, continue on the new weights from there, and the
server must generate only the rest. The continuation's log-probs are checked against
transformers over prompt + journaled tokens + continuation (the new weights re-read the
journaled prefix, as after any recompute interruption). Each life counts the tokens it
received in a durable count, as a scheduler does: received - kept is exactly what the cut
lost, the waste the chaos audit counts.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from asyncrl.storage.fs import open_root
from asyncrl.storage.journal import read_journal, write_journal
from asyncrl.tasks.inference.client import RolloutClient
from asyncrl.tasks.inference.sample_journal import SampleJournal
from asyncrl.tasks.inference.samples import SampleOutput
from asyncrl.tasks.inference.server import RolloutServerHandle
from asyncrl.tasks.system.durable_count import DurableCount, read_counts

PROMPT = [84, 104, 101, 32, 97, 110, 115, 119, 101, 114, 32, 105, 115]
N, MAX_NEW_TOKENS = 2, 1200
GROUP = "g00000007"
LOGPROB_TOLERANCE = 1e-4


@pytest.mark.slow
def test_a_cut_group_goes_on_from_its_journaled_tokens_on_new_weights(
    tmp_path: Path, server_a: RolloutServerHandle, loader: Callable[[int], Any], hf_models: Callable[[int], Any],
    helpers: Any,
) -> None:
    root = open_root(str(tmp_path / "store"))

    async def first_life() -> tuple[int, int, int]:
        """Generate, journal part way, run on, cut: (version, tokens journaled, tokens streamed)."""
        book = SampleJournal()
        delivered = DurableCount.new(tmp_path / "counts", "delivered")
        async with RolloutClient([server_a], journal=book, delivered=delivered) as client:
            version = client.current_version
            group = asyncio.create_task(
                client.generate_group(PROMPT, N, MAX_NEW_TOKENS, ignore_eos=True, journal_key=GROUP)
            )
            await helpers.wait_streamed(client, server_a.url, at_least=64)
            snapshot = book.snapshot()
            await asyncio.to_thread(write_journal, root, snapshot)
            journaled = sum(len(s.token_ids) for s in snapshot)
            await helpers.wait_streamed(client, server_a.url, at_least=journaled + 64)
            group.cancel()
            await asyncio.gather(group, return_exceptions=True)
            return version, journaled, client.streamed_tokens()[server_a.url]

    old, journaled, first_streamed = asyncio.run(first_life())
    saved = read_journal(root)[GROUP]
    assert journaled > 0 and first_streamed > journaled  # tokens after the journal were lost with the cut
    assert [s.index for s in saved] == list(range(N)) and all(s.finish_reason is None for s in saved)
    assert all(set(s.versions) <= {old} for s in saved)

    async def second_life() -> tuple[int, list[SampleOutput], int, SampleJournal]:
        book = SampleJournal()
        book.load(read_journal(root))
        delivered = DurableCount.new(tmp_path / "counts", "delivered")
        async with RolloutClient([server_a], journal=book, delivered=delivered) as client:
            new = client.current_version + 1
            await client.update_weights(new, loader(new))
            outputs = await client.generate_group(PROMPT, N, MAX_NEW_TOKENS, ignore_eos=True, journal_key=GROUP)
            return new, outputs, client.streamed_tokens()[server_a.url], book

    new, outputs, streamed, book = asyncio.run(second_life())
    assert book.counts.resumed_samples == N and book.counts.resumed_tokens == journaled
    assert streamed == N * MAX_NEW_TOKENS - journaled  # the server generated only the rest
    received = read_counts(tmp_path / "counts", "delivered")
    assert sorted(received.values()) == sorted([first_streamed, streamed])
    assert sum(received.values()) - N * MAX_NEW_TOKENS == first_streamed - journaled  # received - kept: the cut's loss
    before, after = hf_models(old), hf_models(new)
    for sample, kept in zip(outputs, saved, strict=True):
        k = len(kept.token_ids)
        assert len(sample.output_token_ids) == MAX_NEW_TOKENS and sample.finish_reason == "length"
        assert tuple(sample.output_token_ids[:k]) == kept.token_ids
        assert tuple(sample.behaviour_logprobs[:k]) == kept.logprobs
        assert sample.token_versions == [old] * k + [new] * (MAX_NEW_TOKENS - k)
        tokens = sample.output_token_ids
        reference = helpers.reference_logprobs(after, None, PROMPT, tokens, len(tokens))[k:]
        worst = max(abs(x - y) for x, y in zip(reference, sample.behaviour_logprobs[k:], strict=True))
        assert worst < LOGPROB_TOLERANCE, f"continuation off the new weights by {worst:.3g} (resumed at {k})"
        # The check has power: the old weights' log-probs of the continuation are far off.
        stale = helpers.reference_logprobs(before, None, PROMPT, tokens, len(tokens))[k:]
        off = max(abs(x - y) for x, y in zip(stale, sample.behaviour_logprobs[k:], strict=True))
        assert off > 100 * LOGPROB_TOLERANCE
