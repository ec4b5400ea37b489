"""The network side of starting a rollout server: the URL it is advertised and probed at, a
free port picked by the OS, and the bind test that finds a fixed port taken before spawning.
"""

from __future__ import annotations

import errno
import socket

from asyncrl.tasks.inference.server_config import RolloutServerConfig
from asyncrl.tasks.inference.server_errors import PortInUseError, RolloutServerError
from asyncrl.tasks.system.network import LOWEST_LISTEN_PORT, ephemeral_port_range, listener_of


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def is_wildcard(host: str) -> bool:
    """Whether ``host`` means every interface (``0.0.0.0``, ``::``, or empty)."""
    return host in ("", "0.0.0.0", "::")


def server_urls(config: RolloutServerConfig, port: int) -> tuple[str, str]:
    """(advertised base URL, local probe URL) of a server bound to ``config.host:port``.

    Health probes stay on this machine: through loopback when bound to every interface.
    """
    wildcard = is_wildcard(config.host)
    advertised = config.advertise_host or (socket.gethostname() if wildcard else config.host)
    probe = ("::1" if ":" in config.host else "127.0.0.1") if wildcard else config.host
    return f"http://{_url_host(advertised)}:{port}", f"http://{_url_host(probe)}:{port}"


def free_port(host: str) -> int:
    """A TCP port that is free on ``host`` right now (the OS's pick for port 0)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def check_port_free(host: str, port: int) -> None:
    """Raise :class:`PortInUseError` naming ``host:port`` if a process listens there now.

    A bind test with ``SO_REUSEADDR`` (what the server itself binds with), so a port left in
    TIME_WAIT by our own stopped server is free, and one with a listener is not.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    bind_host = "" if is_wildcard(host) else host
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((bind_host, port))
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE:
                raise RolloutServerError(f"rollout server cannot bind {_url_host(host)}:{port}: {exc.strerror}") from None
            holder = listener_of(port) or "another process"
            raise PortInUseError(
                f"rollout server port {port} on {host} is already in use by {holder}; stop that "
                f"process (`ss -ltnp 'sport = :{port}'` shows it) or choose another port (inference.base_port)"
                + _taken_port_hint(port)
            ) from None


def _taken_port_hint(port: int) -> str:
    """Why a fixed port may be taken while its server is down, where its range says so: the
    machine's range for outgoing connections (any connection's local end), or the range asyncrl's
    own processes draw listening ports from (:func:`~asyncrl.tasks.system.network.listen_port`)."""
    ephemeral = ephemeral_port_range()
    if ephemeral is not None and ephemeral[0] <= port <= ephemeral[1]:
        return (
            f"; it lies in this machine's range for outgoing connections ({ephemeral[0]}-{ephemeral[1]}), "
            f"which any connection may take while the server is down: choose a base_port below "
            f"{min(ephemeral[0], LOWEST_LISTEN_PORT)}"
        )
    if port >= LOWEST_LISTEN_PORT and (ephemeral is None or port < ephemeral[0]):
        return (
            f"; asyncrl's own processes (a trainer's rendezvous) draw listening ports from {LOWEST_LISTEN_PORT} up, "
            f"and may take it while the server is down: choose a base_port below {LOWEST_LISTEN_PORT}"
        )
    return ""
