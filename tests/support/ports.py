"""Ports for servers a test run restarts: below the kernel's range for outgoing connections, so
that no connection made while a server is down can take its port (as one did in CI: a killed
rollout server's fixed port in that range came back in use). The rule is the product's
(:func:`asyncrl.tasks.system.network.listen_port`)."""

from __future__ import annotations

from asyncrl.tasks.system.network import listen_port


def restartable_base_port(count: int = 2) -> int:
    """A port p with p .. p + count - 1 free on 127.0.0.1, all below the outgoing range."""
    return listen_port("127.0.0.1", count)
