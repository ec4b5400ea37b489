"""The server pool side of the rollout client: control requests, taking a failing server out of
rotation, looking at it again with a doubling wait, bringing it back at the next weight
update, and the start-up check of each server. :class:`ServerRotation` is a component that
:class:`~asyncrl.tasks.inference.client.RolloutClient` holds; rejoin in detail:
``docs/internals/inference.md``.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections.abc import Callable
from typing import Any

import httpx

from asyncrl.tasks.inference.routing import ServerPool, ServerState
from asyncrl.tasks.inference.client_errors import RolloutSetupError, ServerFailure, misconfigured, raise_for_status
from asyncrl.tasks.inference.vllm_api import ADAPTER_PREFIX, GENERATE_PATH, PAUSE_PARAMS, adapter_name

logger = logging.getLogger(__name__)

WeightLoader = Callable[[Any], "Awaitable[object] | object"]
"""Called once per server with the address given to the client (e.g. a
``RolloutServerHandle``), while that server is paused; sync loaders run in a thread."""
MAX_REJOIN_WAIT_S = 600.0
"""Longest wait between two looks at a server out of rotation (:func:`rejoin_wait_s`)."""
REJOIN_LOOK_TIMEOUT_S = 5.0
"""A look at a server out of rotation that gets no answer within this counts as failed."""


async def call_loader(load: WeightLoader, address: Any) -> None:
    """Run a weight loader for one server: awaited if a coroutine function, else in a thread
    (and its result awaited if it is awaitable)."""
    if inspect.iscoroutinefunction(load):
        await load(address)
        return
    result = await asyncio.to_thread(load, address)
    if inspect.isawaitable(result):
        await result


def rejoin_wait_s(base_s: float, attempts: int) -> float:
    """Seconds before the next look at a server out of rotation after ``attempts`` failed looks
    or rejoins: min(base_s * 2 ** attempts, :data:`MAX_REJOIN_WAIT_S`)."""
    return min(base_s * 2.0 ** min(attempts, 32), MAX_REJOIN_WAIT_S)


class ServerRotation:
    """Control requests to the pool's servers and their rotation: out on failure, looked at
    again after :func:`rejoin_wait_s`, back in at the next weight update (module docstring).

    ``http`` returns the client's open connection pool (it raises if the client is not
    started); the pool's server states are shared with the client, which routes over them.
    ``adapters``: the servers' versions are LoRA adapters (:meth:`served_version`).
    """

    def __init__(
        self,
        pool: ServerPool,
        http: Callable[[], httpx.AsyncClient],
        *,
        control_timeout: httpx.Timeout,
        request_timeout: httpx.Timeout,
        rejoin_probe_s: float,
        adapters: bool = False,
    ) -> None:
        self._adapters = adapters
        self._pool = pool
        self._http = http
        self._control_timeout = control_timeout
        self._request_timeout = request_timeout
        self._rejoin_probe_s = rejoin_probe_s

    async def control(self, server: ServerState, method: str, path: str, **kwargs: Any) -> dict[str, Any]:
        """One control request (pause, resume, version...); ``ServerFailure`` if unreachable or 5xx.

        Control requests are idempotent: one that got no response because the server closed
        a pooled connection as it was sent (``RemoteProtocolError``) is sent once more on a
        new connection.
        """
        for attempt in (1, 2):
            try:
                response = await self._http().request(
                    method, server.url + path, headers=server.headers, timeout=self._control_timeout, **kwargs
                )
                break
            except httpx.RemoteProtocolError as exc:
                if attempt == 2:
                    raise ServerFailure(f"{path}: connection failed: {exc!r}") from None
                logger.debug("rollout server %s: %s %s got no response (%r); resending", server.url, method, path, exc)
            except httpx.TransportError as exc:
                raise ServerFailure(f"{path}: connection failed: {exc!r}") from None
        raise_for_status(server, path, response)
        body = response.json()
        return body if isinstance(body, dict) else {"result": body}

    def served_version(self, server: ServerState, version: int) -> None:
        """Record that ``server`` now serves weight ``version`` (loaded and labelled); with
        adapters, requests to it name that version's adapter from now on."""
        server.version = version
        server.adapter = adapter_name(version) if self._adapters else None

    async def release_failed(self, server: ServerState) -> None:
        """Best effort on a server leaving rotation mid-update: abort its requests (they move
        to other servers) and resume it; a dead server just fails both calls."""
        for method, path, params in (("POST", "/pause", {"mode": "abort"}), ("POST", "/resume", None)):
            try:
                await self.control(server, method, path, params=params)
            except Exception as exc:  # noqa: BLE001 - the server is already out; the reason is logged
                logger.warning("rollout server %s (out of rotation): %s %s failed: %r", server.url, method, path, exc)
                return

    def take_out(self, server: ServerState, reason: str, *, rejoinable: bool = True) -> None:
        """Take ``server`` out of rotation; unless it is misconfigured (not ``rejoinable``),
        look at it again after :func:`rejoin_wait_s` (module docstring)."""
        if server.live:
            logger.warning("rollout server %s taken out of rotation: %s", server.url, reason)
            server.rejoin_attempts = 0
        self._pool.take_out(server, reason)
        self._schedule_look(server, rejoinable=rejoinable)

    def _schedule_look(self, server: ServerState, *, rejoinable: bool = True) -> None:
        """A server out of rotation is not answering; look at it again :func:`rejoin_wait_s` of
        its ``rejoin_attempts`` from now, or never if it is not ``rejoinable``."""
        server.answering = False
        server.rejoin_at = (
            time.monotonic() + rejoin_wait_s(self._rejoin_probe_s, server.rejoin_attempts) if rejoinable else None
        )

    # ----- rejoin (module docstring) -----

    async def watch_out_of_rotation(self) -> None:
        """Look at every server out of rotation whose ``rejoin_at`` has come, until cancelled."""
        while True:
            await asyncio.sleep(min(1.0, self._rejoin_probe_s))
            now = time.monotonic()
            due = [
                s for s in self._pool.servers
                if not s.live and not s.answering and s.rejoin_at is not None and s.rejoin_at <= now
            ]  # fmt: skip
            await asyncio.gather(*(self.look(server) for server in due))

    async def look(self, server: ServerState) -> None:
        """One look at a server out of rotation: ``answering`` if ``GET /v1/models`` answers 200."""
        try:
            response = await self._http().get(
                server.url + "/v1/models", headers=server.headers, timeout=REJOIN_LOOK_TIMEOUT_S
            )
            answers = response.status_code == 200
        except httpx.HTTPError:
            answers = False
        if answers:
            server.answering = True
            logger.info("rollout server %s (out of rotation: %s) answers again; the next weight update rejoins it",
                        server.url, server.failure)  # fmt: skip
        else:
            server.rejoin_attempts += 1
            self._schedule_look(server)

    async def rejoin(self, version: int, load: WeightLoader) -> None:
        """Bring every answering server out of rotation to ``version`` and back into rotation
        (the caller holds the update lock; the servers in rotation already run ``version``)."""
        answering = [s for s in self._pool.servers if not s.live and s.answering]
        if not answering:
            return

        async def rejoin(server: ServerState) -> None:
            reason = server.failure
            try:
                # Whatever it still runs was moved to other servers when it went out.
                await self.control(server, "POST", "/pause", params=PAUSE_PARAMS["recompute"])
                await call_loader(load, server.address)
                await self.control(server, "POST", "/update_weight_version", json={"new_version": str(version)})
                await self.control(server, "POST", "/resume")
            except Exception as exc:  # noqa: BLE001 - it stays out; the reason is logged
                server.rejoin_attempts += 1
                self._schedule_look(server, rejoinable=not misconfigured(exc))
                logger.warning("rollout server %s did not rejoin at weight version %d: %r", server.url, version, exc)
                await self.release_failed(server)  # not left paused by the pause above
                return
            self.served_version(server, version)
            self._pool.readmit(server)
            logger.warning("rollout server %s back in rotation at weight version %d (it was out: %s)",
                           server.url, version, reason)  # fmt: skip

        await asyncio.gather(*(rejoin(server) for server in answering))

    # ----- start-up checks -----

    @staticmethod
    def _check_adapter(server: ServerState, listing: dict[str, Any]) -> None:
        """Adapters on: requests to ``server`` name its version's adapter if ``listing``
        (``GET /v1/models``) holds it, else the base model, which is right only at version 0 (a LoRA run's version 0
        is the base: B = 0). A later version without its adapter loaded (a server restarted
        outside the client) is a failure: its tokens would be the base model's under that label."""
        served = {str(item.get("id")) for item in listing.get("data") or [] if isinstance(item, dict)}
        name = adapter_name(server.version)
        if name in served:
            server.adapter = name
        elif server.version == 0:
            server.adapter = None
        else:
            loaded = sorted(s for s in served if s.startswith(ADAPTER_PREFIX))
            raise ServerFailure(
                f"serves weight version {server.version} but not its LoRA adapter {name} (adapters loaded: {loaded})"
            )

    async def probe(self, server: ServerState, initial_version: int) -> None:
        """Check the key (a guarded path), the dev endpoints (``/weight_info``) and the
        generate endpoint (one 1-token request); set the weight version to ``initial_version``
        if it was never set, else adopt it; with adapters, find its version's adapter
        (:meth:`_check_adapter`). A server that fails a check is taken out."""
        try:
            listing = await self.control(server, "GET", "/v1/models")
            info = await self.control(server, "GET", "/weight_info")
            raw = info.get("weight_version")
            if raw in (None, "default"):
                initial = {"new_version": str(initial_version)}
                await self.control(server, "POST", "/update_weight_version", json=initial)
                server.version = initial_version
            elif isinstance(raw, str) and raw.isdigit():
                server.version = int(raw)
            else:
                raise RolloutSetupError(f"rollout server {server.url} reports weight version {raw!r}, not an int")
            if self._adapters:
                self._check_adapter(server, listing)
            probe = {"token_ids": [0], "sampling_params": {"max_tokens": 1, "detokenize": False}, "stream": False}
            try:
                response = await self._http().post(
                    server.url + GENERATE_PATH, json=probe, headers=server.headers, timeout=self._request_timeout
                )
            except httpx.TransportError as exc:
                raise ServerFailure(f"{GENERATE_PATH}: connection failed: {exc!r}") from None
            raise_for_status(server, GENERATE_PATH, response)
        except ServerFailure as failure:
            self.take_out(server, f"start-up check failed: {failure.reason}")
