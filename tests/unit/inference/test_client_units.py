"""Rollout client pieces that need no vLLM server: routing, sample assembly, spans, argument checks."""

from __future__ import annotations

import asyncio
import socket

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncrl.tasks.inference.client import RolloutClient
from asyncrl.tasks.inference.server_rotation import MAX_REJOIN_WAIT_S, rejoin_wait_s
from asyncrl.tasks.inference.vllm_api import check_generate_args, versions_from_spans
from asyncrl.tasks.inference.routing import NoLiveServerError, ServerEndpoint, ServerPool
from asyncrl.tasks.inference.samples import LiveSegment, PartialSample, SampleOutput, SampleTimings, Segment


def _pool(k: int) -> ServerPool:
    return ServerPool([ServerEndpoint(f"http://127.0.0.1:{9000 + i}") for i in range(k)])


def test_pool_sends_each_request_to_the_least_loaded_server() -> None:
    pool = _pool(3)
    first = [pool.acquire() for _ in range(3)]
    assert [s.index for s in first] == [0, 1, 2]
    pool.release(first[1])
    assert pool.acquire().index == 1  # the only one with 0 outstanding
    pool.release(first[0])
    pool.release(first[2])
    # 0 and 2 both have 0 outstanding; 0 was given 1 request, 2 was given 1: list order decides
    assert pool.acquire().index == 0
    assert pool.acquire().index == 2


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 3)), max_size=60))
def test_pool_choice_is_always_a_live_minimum(ops: list[tuple[bool, int]]) -> None:
    pool = _pool(4)
    held = []
    for acquire, index in ops:
        if acquire or not held:
            counts = {s.index: s.outstanding for s in pool.live()}
            chosen = pool.acquire()
            assert counts[chosen.index] == min(counts.values())
            held.append(chosen)
        else:
            pool.release(held.pop(index % len(held)))
        if index == 3 and len(pool.live()) > 1:
            pool.take_out(pool.live()[0], "test")
    assert all(s.outstanding >= 0 for s in pool.servers)


def test_pool_skips_servers_out_of_rotation_and_names_every_reason() -> None:
    pool = _pool(2)
    pool.take_out(pool.servers[0], "connection refused")
    assert {pool.acquire().index for _ in range(4)} == {1}
    pool.take_out(pool.servers[1], "HTTP 500")
    pool.take_out(pool.servers[1], "later reason")  # the first reason is kept
    with pytest.raises(NoLiveServerError, match=r"all 2 rollout servers.*9000: connection refused.*9001: HTTP 500"):
        pool.acquire()


def test_a_readmitted_server_is_chosen_again_with_nothing_pending() -> None:
    pool = _pool(2)
    out = pool.servers[0]
    pool.take_out(out, "connection failed")
    out.rejoin_at, out.rejoin_attempts, out.answering = 5.0, 3, True
    pool.readmit(out)
    assert (out.live, out.failure, out.rejoin_at, out.rejoin_attempts, out.answering) == (True, None, None, 0, False)
    assert {pool.acquire().index for _ in range(2)} == {0, 1}


def test_the_wait_before_a_look_at_a_server_out_of_rotation_doubles_up_to_a_cap() -> None:
    assert [rejoin_wait_s(10.0, k) for k in range(4)] == [10.0, 20.0, 40.0, 80.0]
    assert rejoin_wait_s(10.0, 6) == MAX_REJOIN_WAIT_S == rejoin_wait_s(10.0, 10_000)


def test_pool_refuses_no_servers_and_duplicates() -> None:
    with pytest.raises(ValueError, match="at least one"):
        ServerPool([])
    with pytest.raises(ValueError, match="duplicate"):
        ServerPool([ServerEndpoint("http://h:1"), ServerEndpoint("http://h:1/")])


def test_endpoint_repr_hides_the_key() -> None:
    assert "secret" not in repr(ServerEndpoint("http://h:1", api_key="secret"))


def test_partial_sample_joins_segments_and_keeps_the_budget() -> None:
    partial = PartialSample([7, 8], max_new_tokens=5, submitted_at=1.0)
    partial.extend(Segment([1, 2], [-0.5, -0.25], [0, 0], "abort"))
    assert partial.next_prompt() == [7, 8, 1, 2] and partial.remaining == 3
    partial.extend(Segment([3], [-1.0], [1], "abort"))
    with pytest.raises(ValueError, match="overruns the remaining budget of 2"):
        partial.extend(Segment([4, 5, 6], [-1.0] * 3, [1] * 3, "length"))
    out = partial.finish("length", finished_at=2.0)
    assert out.output_token_ids == [1, 2, 3] and out.token_versions == [0, 0, 1]
    assert out.behaviour_logprobs == [-0.5, -0.25, -1.0]


def test_a_cut_stream_keeps_the_tokens_received_before_an_update_began_on_its_server() -> None:
    partial = PartialSample([7, 8], max_new_tokens=4, submitted_at=1.0)
    assert partial.cut_live() is None  # nothing streaming
    token_ids, logprobs = [1, 2], [-0.5, -0.25]
    partial.live = LiveSegment(token_ids, logprobs, version=3)
    assert partial.cut_live() == Segment([1, 2], [-0.5, -0.25], [3, 3], "abort")  # no update: all of them
    partial.live.freeze()  # an update pauses the server: later tokens may be of either version
    token_ids.append(9)
    logprobs.append(-1.0)
    assert partial.cut_live() == Segment([1, 2], [-0.5, -0.25], [3, 3], "abort")
    partial.extend(Segment([4, 5, 6], [-1.0] * 3, [2] * 3, "abort"))
    assert partial.cut_live() == Segment([1], [-0.5], [3], "abort")  # within the budget left
    partial.live = LiveSegment([], [], version=3)
    assert partial.cut_live() is None


def test_unequal_arrays_are_refused() -> None:
    with pytest.raises(ValueError, match="2 token ids but 1 log-probs"):
        Segment([1, 2], [-1.0], [0, 0], "stop")
    timings = SampleTimings(0.0, 1.0, 0, 0, 1)
    with pytest.raises(ValueError, match="2 output_token_ids but 2 behaviour_logprobs and 1 token_versions"):
        SampleOutput([1, 2], [-1.0, -1.0], [0], "stop", timings)


def test_versions_from_spans() -> None:
    spans = [{"version": "3", "start": 0, "end": 2}, {"version": "4", "start": 2, "end": 5}]
    assert versions_from_spans(spans, 5, "s") == [3, 3, 4, 4, 4]
    assert versions_from_spans(None, 0, "s") == []
    with pytest.raises(RuntimeError, match="without weight_versions"):
        versions_from_spans(None, 2, "s")
    with pytest.raises(RuntimeError, match="do not tile"):
        versions_from_spans(spans, 6, "s")
    with pytest.raises(RuntimeError, match="do not tile"):
        versions_from_spans([{"version": "1", "start": 1, "end": 2}], 2, "s")
    with pytest.raises(RuntimeError, match="'default' is not an int"):
        versions_from_spans([{"version": "default", "start": 0, "end": 2}], 2, "s")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"prompt_token_ids": []}, "prompt_token_ids: empty prompt"),
        ({"prompt_token_ids": [1, -2]}, r"prompt_token_ids\[1\]"),
        ({"n": 0}, "n: must be an int >= 1, got 0"),
        ({"max_new_tokens": 0}, "max_new_tokens: must be an int >= 1, got 0"),
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
    ],
)
def test_bad_generate_arguments_name_the_argument(kwargs: dict[str, object], message: str) -> None:
    args: dict[str, object] = {"prompt_token_ids": [1, 2], "n": 2, "max_new_tokens": 4, "temperature": 1.0}
    args["top_p"] = 1.0
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        check_generate_args(**args)  # type: ignore[arg-type]
    client = RolloutClient([ServerEndpoint("http://127.0.0.1:9")])  # never contacted: the check comes first
    with pytest.raises(ValueError, match=message):
        asyncio.run(client.generate_group(**args))  # type: ignore[arg-type]


def test_bad_client_options() -> None:
    with pytest.raises(ValueError, match="interrupt_mode: must be one of"):
        RolloutClient([ServerEndpoint("http://h:1")], interrupt_mode="drop")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="initial_version"):
        RolloutClient([ServerEndpoint("http://h:1")], initial_version=-1)
    with pytest.raises(ValueError, match="rejoin_probe_s: must be > 0"):
        RolloutClient([ServerEndpoint("http://h:1")], rejoin_probe_s=0)


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_start_with_only_unreachable_servers_raises_a_clear_error() -> None:
    urls = [f"http://127.0.0.1:{_closed_port()}" for _ in range(2)]

    async def run() -> None:
        async with RolloutClient([ServerEndpoint(u) for u in urls]):
            pass

    with pytest.raises(NoLiveServerError, match=r"all 2 rollout servers are out of rotation.*connection failed"):
        asyncio.run(run())
