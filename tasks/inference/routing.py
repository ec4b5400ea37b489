"""Which rollout server gets the next request, and which servers are still in rotation.

Each request goes to the live server with the fewest outstanding requests (ties: the
one that was given the fewest requests so far, then list order). A request may name a
preferred server (an episode's next turn, whose prefix is in that server's cache): it
goes there if that server is live and its outstanding count is at most
min(outstanding over live servers) + :data:`STICKY_SLACK`, else by the rule above. A server that fails
(connection lost, 5xx, a weight load that did not take) is taken out of rotation with its
reason; when none is left, :class:`NoLiveServerError` lists every reason. It comes back
(:meth:`ServerPool.readmit`) only through the rollout client's rejoin: once it answers again,
the next weight update loads the new version into it first
(:meth:`~asyncrl.tasks.inference.client.RolloutClient.update_weights`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol


STICKY_SLACK = 2
"""Extra outstanding requests a preferred server may have over the least loaded one and still be chosen."""


class ServerAddress(Protocol):
    """Where a server is and how to authenticate; :class:`~asyncrl.tasks.inference.server.RolloutServerHandle`
    and :class:`ServerEndpoint` both fit."""

    @property
    def url(self) -> str: ...

    @property
    def api_key(self) -> str | None: ...


@dataclass(frozen=True)
class ServerEndpoint:
    """A server known only by its base URL (and key): e.g. one started elsewhere."""

    url: str
    api_key: str | None = field(default=None, repr=False)


class NoLiveServerError(RuntimeError):
    """Every rollout server is out of rotation; the message gives each one's reason."""


def bearer_headers(server: ServerAddress) -> dict[str, str]:
    """``Authorization: Bearer <key>`` when the server has a key, else nothing."""
    return {"Authorization": f"Bearer {server.api_key}"} if server.api_key else {}


class ServerState:
    """One server as the client sees it: load, version, updates seen, rotation status."""

    def __init__(self, address: ServerAddress, index: int) -> None:
        self.address = address
        self.index = index
        self.url = address.url.rstrip("/")
        self.headers = bearer_headers(address)
        self.outstanding = 0
        self.assigned = 0
        self.version = 0
        """Weight version the server's engine is set to (its tokens carry it)."""
        self.adapter: str | None = None
        """On a client with adapters on: the LoRA adapter requests to this server name as
        ``model`` (its version's, :func:`~asyncrl.tasks.inference.vllm_api.adapter_name`);
        None = the base model (version 0, no adapter loaded yet), and always without adapters."""
        self.streamed_tokens = 0
        """Output tokens received from this server so far (kept or not)."""
        self.failure: str | None = None
        """Why the server is out of rotation (None while it is in)."""
        self.rejoin_at: float | None = None
        """Out of rotation: ``time.monotonic()`` from which the client looks whether it answers
        again; None while in rotation, or when it cannot come back (a misconfigured server)."""
        self.rejoin_attempts = 0
        """Looks and rejoins that failed since the server went out (each doubles the wait)."""
        self.answering = False
        """Out of rotation, but answered the client's last look: the next weight update rejoins it."""

    @property
    def live(self) -> bool:
        return self.failure is None

    def __repr__(self) -> str:
        status = "live" if self.live else f"out: {self.failure}"
        return f"ServerState({self.url}, v{self.version}, outstanding={self.outstanding}, {status})"


class ServerPool:
    """Least-outstanding-requests routing over the servers still in rotation."""

    def __init__(self, addresses: list[ServerAddress]) -> None:
        if not addresses:
            raise ValueError("servers: at least one rollout server is required")
        self.servers = [ServerState(address, i) for i, address in enumerate(addresses)]
        urls = [s.url for s in self.servers]
        duplicates = sorted({u for u in urls if urls.count(u) > 1})
        if duplicates:
            raise ValueError(f"servers: duplicate server URLs {duplicates}")

    def live(self) -> list[ServerState]:
        """Servers in rotation, in list order."""
        return [s for s in self.servers if s.live]

    def acquire(self, prefer: str | None = None) -> ServerState:
        """The live server with the fewest outstanding requests, now counting one more; the
        server at URL ``prefer`` instead when it is live and within :data:`STICKY_SLACK` of it."""
        live = self.live()
        if not live:
            raise self.no_live_error()
        server = min(live, key=lambda s: (s.outstanding, s.assigned, s.index))
        if prefer is not None:
            preferred = next((s for s in live if s.url == prefer.rstrip("/")), None)
            if preferred is not None and preferred.outstanding <= server.outstanding + STICKY_SLACK:
                server = preferred
        server.outstanding += 1
        server.assigned += 1
        return server

    def release(self, server: ServerState) -> None:
        server.outstanding -= 1

    def take_out(self, server: ServerState, reason: str) -> None:
        """Take ``server`` out of rotation (the first reason is kept)."""
        if server.failure is None:
            server.failure = reason

    def readmit(self, server: ServerState) -> None:
        """Put ``server`` back in rotation: no failure, nothing pending for a rejoin."""
        server.failure, server.rejoin_at, server.rejoin_attempts, server.answering = None, None, 0, False

    def no_live_error(self) -> NoLiveServerError:
        reasons = "; ".join(f"{s.url}: {s.failure}" for s in self.servers)
        return NoLiveServerError(f"all {len(self.servers)} rollout servers are out of rotation ({reasons})")
