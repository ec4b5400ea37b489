"""The client's book of in-flight samples: what a snapshot holds (finished segments, and a
streaming segment's tokens up to the first update on its server), when a write is due, and
how a group resumes from a journal (only the same group, prompt, budget and size)."""

from __future__ import annotations

import asyncio

from asyncrl.storage.journal import JournaledSample
from asyncrl.tasks.inference.client import RolloutClient
from asyncrl.tasks.inference.routing import ServerEndpoint
from asyncrl.tasks.inference.sample_journal import SampleJournal
from asyncrl.tasks.inference.samples import LiveSegment, Segment

PROMPT = (1, 2, 3)


def test_a_snapshot_holds_finished_segments_and_the_live_tokens_received_before_an_update() -> None:
    book = SampleJournal()
    first, second = book.start_group("g00000001", PROMPT, 2, 10, submitted_at=1.0)
    first.extend(Segment([7, 8], [-0.5, -0.25], [0, 0], "abort"))
    live = LiveSegment([9, 10, 11], [-1.0, -2.0, -3.0], version=1)
    first.live = live
    assert book.unjournaled_tokens() == 5
    snap = {s.index: s for s in book.snapshot()}
    assert snap[0].token_ids == (7, 8, 9, 10, 11) and snap[0].versions == (0, 0, 1, 1, 1)
    assert snap[0].logprobs == (-0.5, -0.25, -1.0, -2.0, -3.0) and snap[0].finish_reason is None
    assert snap[1].token_ids == () and snap[1].prompt_token_ids == PROMPT and snap[1].max_new_tokens == 10
    assert book.unjournaled_tokens() == 0
    live.freeze()  # an update begins on the server: later tokens may be of either version
    live.token_ids.extend([12, 13])
    live.logprobs.extend([-4.0, -5.0])
    assert book.unjournaled_tokens() == 0
    assert {s.index: s for s in book.snapshot()}[0].token_ids == (7, 8, 9, 10, 11)
    first.live = None
    first.extend(Segment([9, 10, 11, 12, 13], [-1.0, -2.0, -3.0, -4.0, -5.0], [1, 1, 1, 2, 2], "stop"))
    first.finish("stop", 2.0)
    snap = {s.index: s for s in book.snapshot()}
    assert snap[0].versions == (0, 0, 1, 1, 1, 2, 2) and snap[0].finish_reason == "stop"
    book.forget(["g00000001"])
    assert book.snapshot() == [] and book.tracked() == 0


def test_a_group_resumes_only_from_its_own_matching_entries() -> None:
    saved = [
        JournaledSample("g00000004", 0, PROMPT, 10, (7, 8), (-0.5, -0.5), (2, 2)),
        JournaledSample("g00000004", 1, PROMPT, 10, (9,), (-0.1,), (3,), finish_reason="stop"),
    ]
    book = SampleJournal()
    book.load({"g00000004": saved, "g00000005": saved})
    fresh = book.start_group("g00000003", PROMPT, 2, 10, submitted_at=1.0)
    assert [p.token_ids for p in fresh] == [[], []]
    resumed = book.start_group("g00000004", PROMPT, 2, 10, submitted_at=1.0)
    assert [p.token_ids for p in resumed] == [[7, 8], [9]] and resumed[0].versions == [2, 2]
    assert resumed[0].finish_reason is None and resumed[1].finish_reason == "stop"
    assert (book.counts.resumed_samples, book.counts.resumed_tokens, book.counts.finished_resumed) == (2, 3, 1)
    other_prompt = book.start_group("g00000005", (1, 2, 4), 2, 10, submitted_at=1.0)  # not this group's prompt
    assert [p.token_ids for p in other_prompt] == [[], []] and book.counts.mismatched == 1


def test_an_ended_journaled_sample_is_returned_without_a_request() -> None:
    """Every sample of the group had ended before the kill: no server is asked for anything
    (the client is not even started, and its one server does not exist)."""
    saved = [JournaledSample("g00000009", i, PROMPT, 4, (7, 8), (-0.5, -0.5), (1, 1), finish_reason="stop")
             for i in range(2)]  # fmt: skip
    book = SampleJournal()
    book.load({"g00000009": saved})
    client = RolloutClient([ServerEndpoint("http://127.0.0.1:9", None)], journal=book)
    outputs = asyncio.run(client.generate_group(list(PROMPT), 2, 4, journal_key="g00000009"))
    assert [(o.output_token_ids, o.token_versions, o.finish_reason) for o in outputs] == [([7, 8], [1, 1], "stop")] * 2
