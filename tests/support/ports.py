"""Ports for servers a test run restarts: below the range asyncrl's own processes draw from
(:data:`~asyncrl.tasks.system.network.LOWEST_LISTEN_PORT`, itself below the kernel's range for
outgoing connections), so that nothing started while a server is down takes its port. Seen in CI
both ways: a connection's local end took a fixed port in the outgoing range, and a port drawn from
asyncrl's own range came back in use between the two runs of one test (a trainer's rendezvous on
another worker may draw it). The rule users get is the same (``inference.base_port`` help)."""

from __future__ import annotations

from asyncrl.tasks.system.network import LOWEST_LISTEN_PORT, listen_port

LOWEST_TEST_PORT = 10_000
"""The bottom of the range test runs draw their fixed ports from (up to LOWEST_LISTEN_PORT)."""


def restartable_base_port(count: int = 2) -> int:
    """A port p with p .. p + count - 1 free on 127.0.0.1, below the ports asyncrl draws itself."""
    return listen_port("127.0.0.1", count, lowest=LOWEST_TEST_PORT, below=LOWEST_LISTEN_PORT)
