"""Sticky routing (an episode's next turn prefers its previous server) without a vLLM server."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncrl.tasks.inference.client import RolloutClient
from asyncrl.tasks.inference.routing import STICKY_SLACK, ServerEndpoint, ServerPool


def _pool(k: int) -> ServerPool:
    return ServerPool([ServerEndpoint(f"http://127.0.0.1:{9000 + i}") for i in range(k)])


def test_the_preferred_server_is_chosen_within_the_slack_only() -> None:
    pool = _pool(2)
    preferred = pool.servers[1].url
    for expected_outstanding in range(1, STICKY_SLACK + 2):
        assert pool.acquire(prefer=preferred).index == 1  # 0 is idle; 1 has expected_outstanding - 1
        assert pool.servers[1].outstanding == expected_outstanding
    # Server 1 now has STICKY_SLACK + 1 outstanding, server 0 none: too busy to stick.
    assert pool.acquire(prefer=preferred).index == 0
    assert pool.acquire(prefer=preferred + "/").index == 1  # 1 is within the slack again (0 has 1)


def test_an_unknown_or_dead_preferred_server_falls_back_to_the_least_loaded() -> None:
    pool = _pool(3)
    assert pool.acquire(prefer="http://elsewhere:1").index == 0
    pool.take_out(pool.servers[2], "dead")
    assert pool.acquire(prefer=pool.servers[2].url).index == 1
    assert pool.servers[2].outstanding == 0


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 3), st.integers(-1, 3)), max_size=60))
def test_the_choice_is_the_preferred_server_iff_it_is_live_and_within_the_slack(
    ops: list[tuple[bool, int, int]],
) -> None:
    pool = _pool(4)
    held = []
    for acquire, index, prefer in ops:
        if acquire or not held:
            counts = {s.index: s.outstanding for s in pool.live()}
            url = pool.servers[prefer].url if prefer >= 0 else None
            chosen = pool.acquire(prefer=url)
            sticks = prefer in counts and counts[prefer] <= min(counts.values()) + STICKY_SLACK
            if sticks:
                assert chosen.index == prefer
            else:
                assert counts[chosen.index] == min(counts.values())
            held.append(chosen)
        else:
            pool.release(held.pop(index % len(held)))
        if index == 3 and len(pool.live()) > 1:
            pool.take_out(pool.live()[0], "test")
    assert all(s.outstanding >= 0 for s in pool.servers)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"prompt_token_ids": []}, "prompt_token_ids: empty prompt"),
        ({"max_new_tokens": 0}, "max_new_tokens: must be an int >= 1"),
        ({"top_p": 1.5}, "top_p"),
    ],
)
def test_generate_one_checks_its_arguments_first(kwargs: dict[str, object], message: str) -> None:
    args: dict[str, object] = {"prompt_token_ids": [1, 2], "max_new_tokens": 4}
    args.update(kwargs)
    client = RolloutClient([ServerEndpoint("http://127.0.0.1:9")])  # never contacted: the check comes first
    with pytest.raises(ValueError, match=message):
        asyncio.run(client.generate_one(**args))  # type: ignore[arg-type]
