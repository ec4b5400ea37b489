"""Doorbells: a ring wakes a waiting listener at once; nothing about them can lose data."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import pytest

from asyncrl.storage import fs, paths
from asyncrl.storage.doorbell import Doorbell, DoorbellAddress, DoorbellListener
from asyncrl.storage.fs import RunRoot


def test_a_ring_wakes_a_waiting_listener_at_once(root: RunRoot) -> None:
    with DoorbellListener(root, "shards") as listener:
        bell = Doorbell(root, "shards")
        timer = threading.Timer(0.2, bell.ring)
        started = time.monotonic()
        timer.start()
        assert listener.wait(10.0) is True
        assert time.monotonic() - started < 5.0  # woken by the ring, not the 10 s timeout
        assert listener.wait(0.05) is False  # the ring was consumed


def test_rings_before_the_wait_are_not_lost_and_count_once(root: RunRoot) -> None:
    with DoorbellListener(root, "weights") as listener:
        bell = Doorbell(root, "weights")
        assert bell.ring() == 1
        assert bell.ring() == 1
        time.sleep(0.05)
        assert listener.wait(0.0) is True
        assert listener.wait(0.0) is False


def test_wait_times_out_without_a_ring(tmp_path) -> None:
    root = fs.open_root(f"file://{tmp_path}/run")
    with DoorbellListener(root, "shards") as listener:
        started = time.monotonic()
        assert listener.wait(0.2) is False
        assert time.monotonic() - started >= 0.19


def test_async_wait_returns_when_rung_and_leaves_the_loop_free(tmp_path) -> None:
    root = fs.open_root(f"file://{tmp_path}/run")

    async def scenario() -> tuple[bool, float, int]:
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        with DoorbellListener(root, "weights") as listener:
            tick_task = asyncio.create_task(ticker())
            asyncio.get_running_loop().call_later(0.3, Doorbell(root, "weights").ring)
            started = time.monotonic()
            rung = await listener.wait_async(10.0)
            elapsed = time.monotonic() - started
            tick_task.cancel()
            return rung, elapsed, ticks

    rung, elapsed, ticks = asyncio.run(scenario())
    assert rung is True
    assert 0.25 <= elapsed < 5.0
    assert ticks >= 5  # the loop kept running while waiting


def test_a_listener_advertises_its_address_and_removes_it_on_close(tmp_path) -> None:
    root = fs.open_root(f"file://{tmp_path}/run")
    listener = DoorbellListener(root, "shards")
    names = fs.list_dir(root, paths.doorbell_dir("shards"))
    assert len(names) == 1
    content = json.loads(fs.read_bytes(root, f"{paths.doorbell_dir('shards')}/{names[0]}"))
    assert content["port"] == listener.address.port and content["host"] == "127.0.0.1"
    listener.close()
    assert fs.list_dir(root, paths.doorbell_dir("shards")) == []


def test_ring_skips_gone_malformed_and_other_hosts_loopback_listeners(tmp_path) -> None:
    root = fs.open_root(f"file://{tmp_path}/run")
    with DoorbellListener(root, "shards") as listener:
        gone = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        gone.bind(("127.0.0.1", 0))
        gone_port = gone.getsockname()[1]
        gone.close()
        here = socket.gethostname()
        fs.put_atomic_replace(root, paths.doorbell("shards", "gone"), DoorbellAddress("127.0.0.1", gone_port, here, 1).to_json())
        fs.put_atomic_replace(root, paths.doorbell("shards", "bad"), b"{not json")
        fs.put_atomic_replace(
            root, paths.doorbell("shards", "elsewhere"), DoorbellAddress("127.0.0.1", listener.address.port, "other-host", 1).to_json()
        )
        bell = Doorbell(root, "shards")
        assert bell.ring() == 2  # ours and the gone one (a closed port is harmless); not bad, not elsewhere
        assert bell.ring() == 2  # an ICMP error from the gone port does not break the next ring
        assert listener.wait(1.0) is True


def test_ring_lists_listeners_at_most_once_per_refresh(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = fs.open_root(f"file://{tmp_path}/run")
    listings: list[str] = []
    real_list_dir = fs.list_dir
    monkeypatch.setattr(fs, "list_dir", lambda r, d: listings.append(d) or real_list_dir(r, d))
    bell = Doorbell(root, "shards", refresh_s=60.0, empty_refresh_s=60.0)
    for _ in range(50):
        assert bell.ring() == 0
    assert len(listings) == 1
    with DoorbellListener(root, "shards") as listener:
        assert Doorbell(root, "shards", refresh_s=60.0).ring() == 1
        assert listener.wait(1.0)


def test_a_topic_name_is_checked() -> None:
    with pytest.raises(ValueError, match="doorbell topic 'Shards/x'"):
        paths.doorbell_dir("Shards/x")


def test_an_unusable_host_is_named(tmp_path) -> None:
    root = fs.open_root(f"file://{tmp_path}/run")
    with pytest.raises(OSError, match="ASYNCRL_DOORBELL_HOST"):
        DoorbellListener(root, "shards", host="203.0.113.7")  # TEST-NET address: not on this machine
    assert fs.list_dir(root, paths.doorbell_dir("shards")) == []
