"""Network addresses and ports: the one loopback rule the components share (a server without a
token may listen only on loopback; a scheduler shares files only with servers on its own host),
and the one rule for a port a process picks to listen on."""

from __future__ import annotations

import ipaddress
import os
import random
import socket

LOWEST_LISTEN_PORT = 20_000
"""The bottom of the range :func:`listen_port` draws from (above the usual fixed service ports).
A fixed port of a run (``inference.base_port``) below it is never drawn by asyncrl's own
processes, so it stays free while its server is down (between two runs, during a restart)."""


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


def listen_port(
    host: str = "127.0.0.1", count: int = 1, lowest: int = LOWEST_LISTEN_PORT, below: int | None = None
) -> int:
    """A port p with p .. p + count - 1 free on ``host`` now, drawn at random from ``lowest`` up
    to ``below`` (default: the bottom of the kernel's range for outgoing connections,
    :func:`ephemeral_port_range`; 32768 where unreadable).

    Between this check and the listener's bind, a port the OS picked for port 0 can be taken by
    any outgoing connection on the machine (seen: a trainer's torch.distributed store failing
    with EADDRINUSE beside a busy test run); one below that range only by another listener
    that drew the same number."""
    if below is None:
        ephemeral = ephemeral_port_range()
        below = ephemeral[0] if ephemeral else 32_768
    highest = below - count
    rng = random.Random()
    for _ in range(1_000):
        port = rng.randrange(lowest, highest)
        if all(_bindable(host, port + offset) for offset in range(count)):
            return port
    raise RuntimeError(f"no {count} consecutive free ports on {host} between {lowest} and {highest}")


def listener_of(port: int, proc: str = "/proc") -> str | None:
    """Who listens on TCP ``port`` here, as ``pid N (command line)``, from ``/proc/net/tcp*``
    and the processes' open descriptors (Linux; only processes this user may inspect); None
    where no listener is found or /proc is unreadable. For error messages: a taken port names
    its holder."""
    inodes: set[str] = set()
    for table in ("tcp", "tcp6"):
        try:
            with open(f"{proc}/net/{table}") as file:
                rows = file.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if len(fields) > 9 and fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(f"socket:[{fields[9]}]")
    if not inodes:
        return None
    for pid in (name for name in os.listdir(proc) if name.isdigit()):
        try:
            descriptors = os.listdir(f"{proc}/{pid}/fd")
            if not any(os.readlink(f"{proc}/{pid}/fd/{fd}") in inodes for fd in descriptors):
                continue
            with open(f"{proc}/{pid}/cmdline", "rb") as file:
                command = file.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
        return f"pid {pid} ({command[:200]})"
    return None
