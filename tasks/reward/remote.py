"""The scheduler's scorer when the reward service runs as its own process.

:class:`RemoteRewardScorer` has the interface of the in-process pool that the scheduler
uses (``RewardScorer``: ``await scorer.score(requests)``) and sends each batch to the
service registered in the run root (``rewards/service.json``). The service may be
killed and restarted by its supervisor at any time, on another port: a batch is sent
again until an answer comes (scoring has no side effect, so a batch scored twice is
harmless), and the registration is read again after every failure so that a restarted
service is found. Only an outage longer than ``unavailable_timeout_s`` fails the batch.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from collections.abc import Sequence
from types import TracebackType

import httpx

from asyncrl.storage import paths
from asyncrl.storage.fs import RunRoot
from asyncrl.tasks.reward.service_registry import TOKEN_ENV, read_reward_service
from asyncrl.tasks.reward.types import RewardRequest, RewardResult
from asyncrl.tasks.system.http_errors import error_text

logger = logging.getLogger("asyncrl.reward.remote")


class RewardServiceError(RuntimeError):
    """The reward service cannot score a batch: it refused it, or answered something else than its results."""


class RewardServiceRejected(RewardServiceError):
    """The service answered 4xx (a bad batch, a wrong or missing token): sending it again cannot help."""


class RewardServiceUnavailable(RewardServiceError):
    """No registered service answered (or it answered 5xx) for longer than ``unavailable_timeout_s``."""


class _Retry(Exception):
    """One failed attempt worth retrying; ``key`` tells outages' reasons apart (logged once each)."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(message)
        self.key = key


class RemoteRewardScorer:
    """Scores batches in the reward service registered under ``root``.

    ``token``: the bearer token (default: ``$ASYNCRL_REWARD_TOKEN``, none if unset).
    ``unavailable_timeout_s``: how long one batch waits through an outage (no service
    registered, connection refused or dropped, 5xx, a read over ``request_timeout_s``)
    before :class:`RewardServiceUnavailable`. Retries back off from ``backoff_s[0]`` to
    ``backoff_s[1]`` seconds. Use ``async with`` or call :meth:`close`.
    """

    def __init__(
        self,
        root: RunRoot,
        *,
        token: str | None = None,
        unavailable_timeout_s: float = 300.0,
        request_timeout_s: float = 600.0,
        connect_timeout_s: float = 5.0,
        backoff_s: tuple[float, float] = (0.1, 2.0),
    ) -> None:
        if unavailable_timeout_s < 0 or request_timeout_s <= 0 or connect_timeout_s <= 0:
            raise ValueError(
                "RemoteRewardScorer: unavailable_timeout_s must be >= 0 and request_timeout_s, connect_timeout_s > 0, "
                f"got {unavailable_timeout_s}, {request_timeout_s}, {connect_timeout_s}"
            )
        if not 0 < backoff_s[0] <= backoff_s[1]:
            raise ValueError(f"RemoteRewardScorer: backoff_s must be (first, most), 0 < first <= most; got {backoff_s}")
        self.root = root
        self.unavailable_timeout_s = unavailable_timeout_s
        self.backoff_s = backoff_s
        token = token if token is not None else os.environ.get(TOKEN_ENV) or None
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._client = httpx.AsyncClient(timeout=httpx.Timeout(request_timeout_s, connect=connect_timeout_s))
        self._url: str | None = None
        self._last_url: str | None = None
        self._outage_since: float | None = None
        self._outage_reasons: set[str] = set()

    async def score(self, requests: Sequence[RewardRequest]) -> list[RewardResult]:
        """One result per request, in order (the pool's reasons included)."""
        if not requests:
            return []
        body = encode_requests(requests)
        deadline: float | None = None
        delay = self.backoff_s[0]
        while True:
            try:
                return await self._attempt(body, len(requests))
            except _Retry as exc:
                self._url = None  # read the registration again: the service may have moved
                now = time.monotonic()
                deadline = deadline if deadline is not None else now + self.unavailable_timeout_s
                self._note_outage(exc)
                if now >= deadline:
                    raise RewardServiceUnavailable(
                        f"reward service {self._last_url or '(never registered)'} unavailable for "
                        f"{self.unavailable_timeout_s:g} s; last error: {exc}"
                    ) from None
                await asyncio.sleep(min(delay, deadline - now))
                delay = min(delay * 2, self.backoff_s[1])

    async def close(self) -> None:
        await self._client.aclose()

    async def __aenter__(self) -> RemoteRewardScorer:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    async def _attempt(self, body: bytes, expected: int) -> list[RewardResult]:
        """Send the batch once; ``_Retry`` for what a restarted service can fix."""
        url = await self._service_url()
        try:
            response = await self._client.post(
                f"{url}/score", content=body, headers={**self._headers, "Content-Type": "application/json"}
            )
        except httpx.TransportError as exc:
            raise _Retry(f"{url} {type(exc).__name__}", f"POST {url}/score: {type(exc).__name__}: {exc}") from None
        if response.status_code >= 500:
            raise _Retry(
                f"{url} HTTP {response.status_code}",
                f"POST {url}/score: HTTP {response.status_code}: {error_text(response)}",
            )
        self._note_answer(url)
        return decode_results(response, url, expected)

    async def _service_url(self) -> str:
        """The registered URL (cached until an attempt fails); ``_Retry`` while none is registered."""
        if self._url is not None:
            return self._url
        where = self.root.display(paths.reward_service_path())
        try:
            info = await asyncio.to_thread(read_reward_service, self.root)
        except OSError as exc:
            raise _Retry(f"registry {type(exc).__name__}", f"cannot read {where}: {exc}") from None
        except ValueError as exc:
            raise RewardServiceError(str(exc)) from None  # not an outage: a broken entry stays broken
        if info is None:
            raise _Retry("not registered", f"no reward service registered ({where} does not exist)")
        self._url = self._last_url = info.url
        return info.url

    def _note_outage(self, failure: _Retry) -> None:
        """Warn once per reason per outage: a restart takes many attempts, the log needs one line."""
        if self._outage_since is None:
            self._outage_since = time.monotonic()
        if failure.key not in self._outage_reasons:
            self._outage_reasons.add(failure.key)
            logger.warning(
                "reward service unavailable, retrying for up to %g s: %s", self.unavailable_timeout_s, failure
            )

    def _note_answer(self, url: str) -> None:
        """The service answered: an outage, if any, is over."""
        if self._outage_since is not None:
            logger.info("reward service at %s answers again after %.1f s", url, time.monotonic() - self._outage_since)
        self._outage_since = None
        self._outage_reasons.clear()


def encode_requests(requests: Sequence[RewardRequest]) -> bytes:
    """The /score body; ``TypeError`` / ``ValueError`` name the request that cannot be sent."""
    items = []
    for i, request in enumerate(requests):
        if not isinstance(request, RewardRequest):
            raise TypeError(f"requests[{i}]: expected a RewardRequest, got {type(request).__name__}")
        item = request.to_json()
        try:
            json.dumps(item)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"requests[{i}]: a {request.kind} request that is not JSON-able: {exc}") from None
        items.append(item)
    return json.dumps({"requests": items}).encode()


def decode_results(response: httpx.Response, url: str, expected: int) -> list[RewardResult]:
    """The results of a 2xx-4xx answer: ``RewardServiceRejected`` for 4xx with the service's
    message, ``RewardServiceError`` for an answer that is not ``expected`` results."""
    if 400 <= response.status_code < 500:
        raise RewardServiceRejected(
            f"reward service {url} refused the batch (HTTP {response.status_code}): {error_text(response)}"
        )
    if response.status_code != 200:
        raise RewardServiceError(
            f"reward service {url}: unexpected HTTP {response.status_code}: {error_text(response)}"
        )
    try:
        body = response.json()
        if not isinstance(body, dict) or not isinstance(body.get("results"), list):
            raise ValueError(f"expected {{'results': [...]}}, got {response.text[:200]!r}")
        results = [RewardResult.from_json(item, f"results[{i}]") for i, item in enumerate(body["results"])]
    except ValueError as exc:
        raise RewardServiceError(f"reward service {url}: malformed answer: {exc}") from None
    if len(results) != expected:
        raise RewardServiceError(f"reward service {url}: {len(results)} results for {expected} requests")
    return results
