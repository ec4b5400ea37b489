"""Network addresses and ports: the one loopback rule the components share (a server without a
token may listen only on loopback; a scheduler shares files only with servers on its own host),
and the one rule for a port a process picks to listen on."""

from __future__ import annotations

import ipaddress
import random
import socket

LOWEST_LISTEN_PORT = 20_000
"""The bottom of the range :func:`listen_port` draws from (above the usual fixed service ports)."""


def is_loopback(host: str) -> bool:
    """Whether ``host`` is ``localhost`` or a loopback IP literal (127.0.0.0/8, ::1). Any other
    host name is taken as reachable from outside: it cannot be told from here."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def ephemeral_port_range(path: str = "/proc/sys/net/ipv4/ip_local_port_range") -> tuple[int, int] | None:
    """The kernel's range of ports for outgoing connections (Linux), or None where unreadable.

    A listening port inside it can be taken, while its server is down, as the local end of
    any outgoing connection on the machine, so a restarted server may find it in use.
    """
    try:
        with open(path) as file:
            low, high = (int(value) for value in file.read().split())
    except (OSError, ValueError):
        return None
    return low, high


def _bindable(host: str, port: int) -> bool:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def listen_port(host: str = "127.0.0.1", count: int = 1) -> int:
    """A port p with p .. p + count - 1 free on ``host`` now, drawn at random below the kernel's
    range for outgoing connections (:func:`ephemeral_port_range`; 32768 where unreadable).

    Between this check and the listener's bind, a port the OS picked for port 0 can be taken by
    any outgoing connection on the machine (seen: a trainer's torch.distributed store failing
    with EADDRINUSE beside a busy test run); one below that range only by another listener
    that drew the same number."""
    ephemeral = ephemeral_port_range()
    highest = (ephemeral[0] if ephemeral else 32_768) - count
    rng = random.Random()
    for _ in range(1_000):
        port = rng.randrange(LOWEST_LISTEN_PORT, highest)
        if all(_bindable(host, port + offset) for offset in range(count)):
            return port
    raise RuntimeError(f"no {count} consecutive free ports on {host} between {LOWEST_LISTEN_PORT} and {highest}")
