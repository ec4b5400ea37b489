"""Ports for servers a test run restarts: below the kernel's range for outgoing connections, so
that no connection made while a server is down can take its port (as one did in CI: a killed
rollout server's fixed port in that range came back in use)."""

from __future__ import annotations

import random
import socket

from asyncrl.tasks.inference.server_ports import ephemeral_port_range

LOWEST = 20_000


def _free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def restartable_base_port(count: int = 2) -> int:
    """A port p with p .. p + count - 1 free on 127.0.0.1, all below the outgoing range."""
    ephemeral = ephemeral_port_range()
    highest = (ephemeral[0] if ephemeral else 32_768) - count
    rng = random.Random()
    for _ in range(1_000):
        port = rng.randrange(LOWEST, highest)
        if all(_free(port + offset) for offset in range(count)):
            return port
    raise RuntimeError(f"no {count} consecutive free ports between {LOWEST} and {highest}")
