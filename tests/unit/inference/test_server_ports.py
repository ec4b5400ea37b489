"""The port checks before a rollout server starts: the kernel's outgoing range is read, and a
taken port inside it, or inside the range asyncrl draws its own ports from, is refused with the
hint to choose a base_port below both."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

from asyncrl.tasks.inference import server_ports
from asyncrl.tasks.inference.server_errors import PortInUseError
from asyncrl.tasks.system import network


def test_the_outgoing_range_is_read_and_an_unreadable_one_is_none(tmp_path: Path) -> None:
    path = tmp_path / "ip_local_port_range"
    path.write_text("32768\t60999\n")
    assert network.ephemeral_port_range(str(path)) == (32768, 60999)
    path.write_text("garbage\n")
    assert network.ephemeral_port_range(str(path)) is None
    assert network.ephemeral_port_range(str(tmp_path / "missing")) is None


@pytest.mark.parametrize("where", ["outgoing", "drawn", "neither"])
def test_a_taken_port_names_the_range_it_lies_in(monkeypatch: pytest.MonkeyPatch, where: str) -> None:
    """A taken port in the outgoing range, or in the range asyncrl draws its own listening ports
    from, gets the hint to choose a base_port below both; one below both gets no hint."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        span = (port - 5, port + 5) if where == "outgoing" else (port + 1, port + 5)
        monkeypatch.setattr(server_ports, "ephemeral_port_range", lambda: span)
        if where == "neither":
            monkeypatch.setattr(server_ports, "LOWEST_LISTEN_PORT", port + 1)
        with pytest.raises(PortInUseError, match=f"port {port} on 127.0.0.1 is already in use") as caught:
            server_ports.check_port_free("127.0.0.1", port)
    message = str(caught.value)
    assert f"in use by pid {os.getpid()} (" in message  # the holder is named
    assert ("this machine's range for outgoing connections" in message) is (where == "outgoing")
    assert ("asyncrl's own processes" in message) is (where == "drawn")
    lowest = min(span[0], network.LOWEST_LISTEN_PORT) if where == "outgoing" else network.LOWEST_LISTEN_PORT
    assert (f"choose a base_port below {lowest}" in message) is (where != "neither")


def test_a_listen_port_is_free_and_below_the_outgoing_range() -> None:
    low = (network.ephemeral_port_range() or (32_768, 60_999))[0]
    for _ in range(20):
        port = network.listen_port("127.0.0.1", count=2)
        assert network.LOWEST_LISTEN_PORT <= port and port + 1 < low
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", port + 1))  # every port of the span binds


def test_a_listen_port_keeps_to_the_range_asked() -> None:
    for _ in range(20):
        port = network.listen_port("127.0.0.1", count=2, lowest=10_000, below=network.LOWEST_LISTEN_PORT)
        assert 10_000 <= port and port + 1 < network.LOWEST_LISTEN_PORT
