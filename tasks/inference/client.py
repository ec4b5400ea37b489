"""Async generation client over one or more vLLM rollout servers, with interruptible weight updates.

Requests go to vLLM's streamed ``POST /inference/v1/generate``, whose final chunk carries the
engine's ``weight_versions`` spans, so every kept token's weight version is known exactly,
never guessed from timing. Each sample of a group is its own request, resubmitted alone
(after an abort, or elsewhere after a server failure) as prompt + tokens so far.
:meth:`RolloutClient.update_weights` pauses every server, loads, sets the version and
resumes, in ``interrupt_mode`` ``recompute`` (abort and resubmit; the paper's) or ``keep``
(freeze with the KV cache and continue). Rejoin: a server out of rotation is looked at again
with a doubling wait up to :data:`MAX_REJOIN_WAIT_S` and put back at the next weight update
once it answers. Modes, failures and rejoin in detail: ``docs/internals/inference.md``.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import httpx

from asyncrl.tasks.system.http_errors import error_text as _error_text
from asyncrl.tasks.inference.routing import ServerAddress, ServerPool, ServerState
from asyncrl.tasks.inference.samples import (
    INTERRUPT_MODES,
    InterruptMode,
    PartialSample,
    SampleOutput,
    Segment,
    UpdateStats,
)

logger = logging.getLogger(__name__)

GENERATE_PATH = "/inference/v1/generate"
PAUSE_PARAMS: dict[InterruptMode, dict[str, str]] = {
    "recompute": {"mode": "abort", "clear_cache": "true"},
    # clear_cache=true would make vLLM preempt the frozen requests (reset_running_requests)
    # and so recompute their KV cache at resume: keep mode would silently become recompute.
    "keep": {"mode": "keep", "clear_cache": "false"},
}
WeightLoader = Callable[[Any], "Awaitable[object] | object"]
"""Called once per server with the address given to the client (e.g. a
``RolloutServerHandle``), while that server is paused; sync loaders run in a thread."""


class RolloutAuthError(PermissionError):
    """A server refused the client's API key (HTTP 401)."""


class RolloutSetupError(RuntimeError):
    """A server lacks an endpoint the client needs (a launch flag is missing)."""


class RolloutRequestError(ValueError):
    """A server rejected a generation request as invalid (HTTP 400/422)."""


class _ServerFailure(Exception):
    """The server failed mid-request; ``partial`` holds the tokens that can be kept."""

    def __init__(self, reason: str, partial: Segment | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.partial = partial


MAX_REJOIN_WAIT_S = 600.0
"""Longest wait between two looks at a server out of rotation (:func:`rejoin_wait_s`)."""
REJOIN_LOOK_TIMEOUT_S = 5.0
"""A look at a server out of rotation that gets no answer within this counts as failed."""
KEEPALIVE_S = 2.0
"""Idle time after which the client drops a pooled connection (uvicorn closes at 5 s)."""


@dataclass(frozen=True)
class SamplingOptions:
    temperature: float
    top_p: float
    ignore_eos: bool
    stop_token_ids: tuple[int, ...]
    stream_interval: int

    def params(self, max_tokens: int) -> dict[str, Any]:
        """vLLM ``SamplingParams`` of one segment; ``logprobs: 0`` = the sampled token's only."""
        return {
            "stream_interval": self.stream_interval,
            "max_tokens": max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "logprobs": 0,
            "ignore_eos": self.ignore_eos,
            "stop_token_ids": list(self.stop_token_ids),
            "detokenize": False,
        }


def _check_positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}: must be an int >= 1, got {value!r}")


def check_generate_args(
    prompt_token_ids: Sequence[int], n: int, max_new_tokens: int, temperature: float, top_p: float
) -> None:
    """``ValueError`` naming the first bad argument of :meth:`RolloutClient.generate_group`."""
    if len(prompt_token_ids) == 0:
        raise ValueError("prompt_token_ids: empty prompt; at least one token id is required")
    for i, token in enumerate(prompt_token_ids):
        if isinstance(token, bool) or not isinstance(token, int) or token < 0:
            raise ValueError(f"prompt_token_ids[{i}]: token ids are non-negative ints, got {token!r}")
    _check_positive_int("n", n)
    _check_positive_int("max_new_tokens", max_new_tokens)
    if not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature >= 0):
        raise ValueError(f"temperature: must be a finite number >= 0, got {temperature!r}")
    if not (isinstance(top_p, (int, float)) and 0 < top_p <= 1):
        raise ValueError(f"top_p: must be in (0, 1], got {top_p!r}")


def versions_from_spans(spans: object, num_tokens: int, source: str) -> list[int]:
    """One version per output token from vLLM's spans ``[{"version", "start", "end"}, ...]``.

    The spans must tile ``[0, num_tokens)`` in order; each version string must be an int.
    """
    if num_tokens == 0:
        return []
    if not isinstance(spans, list) or not spans:
        raise RuntimeError(f"{source}: {num_tokens} tokens came without weight_versions spans")
    versions: list[int] = []
    for span in spans:
        raw = span.get("version") if isinstance(span, dict) else None
        if not isinstance(raw, str) or not raw.isdigit():
            raise RuntimeError(
                f"{source}: weight version {raw!r} is not an int (was the server restarted outside the client?)"
            )
        if span.get("start") != len(versions) or not isinstance(span.get("end"), int) or span["end"] < span["start"]:
            raise RuntimeError(f"{source}: weight_versions spans {spans} do not tile [0, {num_tokens})")
        versions.extend([int(raw)] * (span["end"] - span["start"]))
    if len(versions) != num_tokens:
        raise RuntimeError(f"{source}: weight_versions spans {spans} do not tile [0, {num_tokens})")
    return versions


def _raise_for_status(server: ServerState, path: str, response: httpx.Response) -> None:
    """Map a non-200 answer to the error that says what to fix; 5xx means a failing server."""
    status = response.status_code
    if status == 200:
        return
    text = _error_text(response)
    where = f"rollout server {server.url}{path}"
    if status == 401:
        raise RolloutAuthError(
            f"{where} refused the API key (HTTP 401: {text}); check the api_key given for this server"
        )
    if status == 403 and "scale-out" in text.lower():
        raise RolloutSetupError(f"{where} is disabled: start vLLM with --enable-scale-out ({text})")
    if status == 404:
        raise RolloutSetupError(
            f"{where} not found (HTTP 404): the server needs VLLM_SERVER_DEV_MODE=1 and --enable-scale-out"
        )
    if status in (400, 413, 422):
        raise RolloutRequestError(f"{where} rejected the request (HTTP {status}): {text}")
    if status >= 500:
        raise _ServerFailure(f"{path} answered HTTP {status}: {text}")
    raise RolloutSetupError(f"{where}: unexpected HTTP {status}: {text}")


def _raise_stream_error(server: ServerState, error: object) -> None:
    """An error sent inside the stream: a 4xx code is a bad request, anything else a failing server."""
    code = error.get("code") if isinstance(error, dict) else None
    message = error.get("message", error) if isinstance(error, dict) else error
    if isinstance(code, int) and 400 <= code < 500:
        raise RolloutRequestError(
            f"rollout server {server.url}{GENERATE_PATH} rejected the request (HTTP {code}): {str(message)[:1000]}"
        )
    raise _ServerFailure(f"stream error: {str(error)[:500]}")


async def _call_loader(load: WeightLoader, address: Any) -> None:
    """Run a weight loader for one server: awaited if a coroutine function, else in a thread
    (and its result awaited if it is awaitable)."""
    if inspect.iscoroutinefunction(load):
        await load(address)
        return
    result = await asyncio.to_thread(load, address)
    if inspect.isawaitable(result):
        await result


def _misconfigured(error: BaseException) -> bool:
    """A server that refused the key or lacks the endpoints: no rejoin can mend it."""
    return isinstance(error, (RolloutAuthError, RolloutSetupError))


def rejoin_wait_s(base_s: float, attempts: int) -> float:
    """Seconds before the next look at a server out of rotation after ``attempts`` failed looks
    or rejoins: min(base_s * 2 ** attempts, :data:`MAX_REJOIN_WAIT_S`)."""
    return min(base_s * 2.0 ** min(attempts, 32), MAX_REJOIN_WAIT_S)


class RolloutClient:
    """Generates sample groups on a pool of vLLM servers and updates their weights in place.

    Use as ``async with RolloutClient(servers) as client:``. Each server's engine
    version starts at ``initial_version`` if it was never set (vLLM's ``"default"``),
    else the client adopts the version the server reports.

    ``stream_interval``: the server sends a request's tokens in chunks of this many (plus
    its first token and whatever remains at the end). Nothing here needs per-token
    chunks, and per-token streaming costs the API server CPU: on a few cores it can fall far
    behind the engine, and a ``/pause`` waited behind that backlog
    until the requests it meant to interrupt had ended.

    ``rejoin_probe_s``: the first wait before a server out of rotation is looked at again
    (module docstring, "Rejoin").
    """

    def __init__(
        self,
        servers: Sequence[ServerAddress],
        *,
        interrupt_mode: InterruptMode = "recompute",
        initial_version: int = 0,
        request_timeout_s: float = 600.0,
        control_timeout_s: float = 120.0,
        max_segments: int = 1000,
        stream_interval: int = 16,
        rejoin_probe_s: float = 10.0,
    ) -> None:
        if interrupt_mode not in INTERRUPT_MODES:
            raise ValueError(f"interrupt_mode: must be one of {list(INTERRUPT_MODES)}, got {interrupt_mode!r}")
        if isinstance(initial_version, bool) or not isinstance(initial_version, int) or initial_version < 0:
            raise ValueError(f"initial_version: must be an int >= 0, got {initial_version!r}")
        _check_positive_int("max_segments", max_segments)
        _check_positive_int("stream_interval", stream_interval)
        if request_timeout_s <= 0 or control_timeout_s <= 0:
            raise ValueError(
                f"request_timeout_s and control_timeout_s must be > 0, got {request_timeout_s}, {control_timeout_s}"
            )
        if not rejoin_probe_s > 0:
            raise ValueError(f"rejoin_probe_s: must be > 0, got {rejoin_probe_s!r}")
        self._pool = ServerPool(list(servers))
        self._mode: InterruptMode = interrupt_mode
        self._initial_version = initial_version
        self._max_segments = max_segments
        self._stream_interval = stream_interval
        self._control_timeout = httpx.Timeout(control_timeout_s)
        # Read timeout = longest silence in one stream; a keep-mode pause is such a silence.
        self._request_timeout = httpx.Timeout(connect=30.0, read=request_timeout_s, write=60.0, pool=None)
        self._http: httpx.AsyncClient | None = None
        self._active: dict[int, set[PartialSample]] = {s.index: set() for s in self._pool.servers}
        self._resumed = asyncio.Event()
        self._resumed.set()
        self._update_lock = asyncio.Lock()
        self._rejoin_probe_s = float(rejoin_probe_s)
        self._watcher: asyncio.Task[None] | None = None

    # ----- lifecycle -----

    async def __aenter__(self) -> RolloutClient:
        await self.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    async def start(self) -> None:
        """Open connections and check every server: key, endpoints, weight version.

        Raises :class:`RolloutAuthError` / :class:`RolloutSetupError` for a misconfigured
        server; unreachable servers are taken out of rotation (error if none is left).
        """
        if self._http is None:
            # Idle connections are dropped before uvicorn's 5 s keep-alive timeout closes them
            # under a request (a request sent as the server closes gets no response).
            limits = httpx.Limits(max_connections=None, max_keepalive_connections=64, keepalive_expiry=KEEPALIVE_S)
            self._http = httpx.AsyncClient(limits=limits)
        await asyncio.gather(*(self._probe(server) for server in self._pool.live()))
        if not self._pool.live():
            raise self._pool.no_live_error()
        if self._watcher is None:
            self._watcher = asyncio.create_task(self._watch_out_of_rotation(), name="rollout-rejoin-watch")

    async def close(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
            await asyncio.gather(self._watcher, return_exceptions=True)
            self._watcher = None
        if self._http is not None:
            await self._http.aclose()
            self._http = None

    @property
    def interrupt_mode(self) -> InterruptMode:
        return self._mode

    @property
    def current_version(self) -> int:
        """Newest weight version among the servers in rotation."""
        live = self._pool.live()
        if not live:
            raise self._pool.no_live_error()
        return max(s.version for s in live)

    def server_versions(self) -> dict[str, int]:
        """Weight version of each server in rotation, by URL."""
        return {s.url: s.version for s in self._pool.live()}

    def streamed_tokens(self) -> dict[str, int]:
        """Output tokens received so far from each server (in rotation or not), by URL: the
        client's own, exact view of generation progress (vLLM's Prometheus counters lag)."""
        return {s.url: s.streamed_tokens for s in self._pool.servers}

    def failed_servers(self) -> dict[str, str]:
        """Servers out of rotation, by URL, with the reason."""
        return {s.url: s.failure for s in self._pool.servers if s.failure is not None}

    def rejoining_servers(self) -> list[str]:
        """Servers out of rotation that answered a look: the next weight update rejoins them."""
        return [s.url for s in self._pool.servers if not s.live and s.answering]

    # ----- generation -----

    async def generate_group(
        self,
        prompt_token_ids: Sequence[int],
        n: int,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        *,
        ignore_eos: bool = False,
        stop_token_ids: Sequence[int] = (),
    ) -> list[SampleOutput]:
        """Generate ``n`` samples of ``prompt_token_ids``, each at most ``max_new_tokens`` long.

        Every sample carries its behaviour log-probs and per-token versions; it is
        produced exactly once whatever updates or server failures happen meanwhile.
        """
        check_generate_args(prompt_token_ids, n, max_new_tokens, temperature, top_p)
        options = SamplingOptions(
            float(temperature), float(top_p), bool(ignore_eos), tuple(stop_token_ids), self._stream_interval
        )
        submitted_at = time.time()
        partials = [PartialSample(list(prompt_token_ids), max_new_tokens, submitted_at) for _ in range(n)]
        try:
            async with asyncio.TaskGroup() as group:  # one failure cancels the group's other samples
                tasks = [group.create_task(self._generate_sample(partial, options)) for partial in partials]
        except BaseExceptionGroup as errors:
            raise errors.exceptions[0] from errors  # callers catch the error, not a group of copies
        return [task.result()[0] for task in tasks]

    async def generate_one(
        self,
        prompt_token_ids: Sequence[int],
        max_new_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        *,
        stop_token_ids: Sequence[int] = (),
        prefer_server: str | None = None,
    ) -> tuple[SampleOutput, str]:
        """One sample, sticky to a server: ``(sample, URL of the server of its last segment)``.

        For one turn of a multi-turn episode, whose prompt extends the previous turn's: its
        first segment goes to ``prefer_server`` (the previous turn's server, which holds the
        prefix in its cache) unless that server is out of rotation or more than
        :data:`~asyncrl.tasks.inference.routing.STICKY_SLACK` requests busier than the least
        loaded one; every later segment (after an interruption) prefers the server of the
        segment before. Interruptions, resumption and failover are those of
        :meth:`generate_group`, in both interrupt modes.
        """
        check_generate_args(prompt_token_ids, 1, max_new_tokens, temperature, top_p)
        options = SamplingOptions(float(temperature), float(top_p), False, tuple(stop_token_ids), self._stream_interval)
        partial = PartialSample(list(prompt_token_ids), max_new_tokens, time.time())
        return await self._generate_sample(partial, options, prefer_server, sticky=True)

    async def _generate_sample(
        self,
        partial: PartialSample,
        options: SamplingOptions,
        prefer_server: str | None = None,
        *,
        sticky: bool = False,
    ) -> tuple[SampleOutput, str]:
        """Request segments until one ends with ``stop``/``length`` or the budget is spent;
        returns the sample and the URL of the server that produced its last segment.

        The first segment prefers ``prefer_server``; with ``sticky`` each later one prefers
        the server of the segment before (else every segment goes to the least loaded server).
        """
        prefer = prefer_server
        last_url = ""
        while partial.remaining > 0:
            if partial.segments >= self._max_segments:
                raise RuntimeError(
                    f"sample gave up after {partial.segments} requests (max_segments) with "
                    f"{len(partial.token_ids)}/{partial.max_new_tokens} tokens"
                )
            await self._resumed.wait()  # never submit into a pause: resubmissions go to the new weights
            if not self._resumed.is_set():
                continue  # woken by a resume, but another update began before this task ran
            server = self._pool.acquire(prefer)
            last_url = server.url
            if sticky:
                prefer = server.url
            partial.segments += 1
            self._active[server.index].add(partial)
            try:
                segment = await self._stream_segment(server, partial, options)
            except _ServerFailure as failure:
                self._take_out(server, failure.reason)
                partial.retries += 1
                if failure.partial is not None:
                    partial.extend(failure.partial)
                continue
            finally:
                self._active[server.index].discard(partial)
                self._pool.release(server)
            partial.extend(segment)
            if segment.finish_reason in ("stop", "length"):
                return partial.finish(segment.finish_reason, time.time()), last_url
        return partial.finish("length", time.time()), last_url

    async def _stream_segment(self, server: ServerState, partial: PartialSample, options: SamplingOptions) -> Segment:
        """Stream one request; ``_ServerFailure`` (with the keepable tokens) if the server fails."""
        http = self._client()
        body = {
            "token_ids": partial.next_prompt(),
            "sampling_params": options.params(partial.remaining),
            "stream": True,
        }
        epoch, version = server.update_epoch, server.version
        token_ids: list[int] = []
        logprobs: list[float] = []
        finish_reason: str | None = None
        spans: object = None
        source = f"rollout server {server.url}{GENERATE_PATH}"
        try:
            async with http.stream(
                "POST", server.url + GENERATE_PATH, json=body, headers=server.headers, timeout=self._request_timeout
            ) as response:
                if response.status_code != 200:
                    await response.aread()
                    _raise_for_status(server, GENERATE_PATH, response)
                async for line in response.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[len("data: ") :])
                    if "error" in chunk:
                        _raise_stream_error(server, chunk["error"])
                    for choice in chunk.get("choices") or []:
                        ids = choice.get("token_ids") or []
                        content = (choice.get("logprobs") or {}).get("content") or []
                        if [c.get("token_id") for c in content] != ids:
                            raise RuntimeError(f"{source}: chunk log-probs do not match its token ids: {choice}")
                        token_ids.extend(ids)
                        logprobs.extend(float(c["logprob"]) for c in content)
                        server.streamed_tokens += len(ids)
                        if choice.get("finish_reason") is not None:
                            finish_reason = choice["finish_reason"]
                            spans = choice.get("weight_versions")
        except httpx.TransportError as exc:
            keep = self._keepable(server, epoch, version, token_ids, logprobs)
            raise _ServerFailure(f"connection failed: {exc!r}", keep) from None
        except _ServerFailure as failure:
            raise _ServerFailure(failure.reason, self._keepable(server, epoch, version, token_ids, logprobs))
        if finish_reason is None:
            raise _ServerFailure(
                "stream ended without a finish reason", self._keepable(server, epoch, version, token_ids, logprobs)
            )
        if finish_reason not in ("stop", "length", "abort"):
            raise RuntimeError(f"{source}: unexpected finish reason {finish_reason!r}")
        logger.debug("%s: segment of %d tokens ended with %s, spans %s", source, len(token_ids), finish_reason, spans)
        return Segment(token_ids, logprobs, versions_from_spans(spans, len(token_ids), source), finish_reason)

    @staticmethod
    def _keepable(
        server: ServerState, epoch: int, version: int, token_ids: list[int], logprobs: list[float]
    ) -> Segment | None:
        """Tokens of a cut segment that can be kept: all of them if no update touched the
        server since the segment started (they are all of ``version``), else none."""
        if server.update_epoch != epoch or not token_ids:
            return None
        return Segment(list(token_ids), list(logprobs), [version] * len(token_ids), "abort")

    # ----- weight updates -----

    async def update_weights(self, version: int, load: WeightLoader) -> UpdateStats:
        """Pause every server, ``load(address)`` each, set ``version``, resume; return the cost.

        Phases run on all servers together: pause (``abort`` or ``keep`` per
        ``interrupt_mode``; skipped, with its resume, on a server with no request in flight),
        load, ``/update_weight_version``, resume. New and
        interrupted requests wait until every server has resumed. A server that fails
        a phase is taken out of rotation (its requests move to the others); if none is
        left, :class:`~asyncrl.tasks.inference.routing.NoLiveServerError`.
        """
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise ValueError(f"version: must be an int >= 0, got {version!r}")
        async with self._update_lock:
            servers = self._pool.live()
            if not servers:
                raise self._pool.no_live_error()
            newest = max(s.version for s in servers)
            if version <= newest:
                raise ValueError(f"version: {version} is not newer than the servers' current version {newest}")
            self._resumed.clear()
            try:
                stats = await self._update_all(servers, version, load)
            finally:
                self._resumed.set()
            await self._rejoin(version, load)
            return stats

    async def _update_all(self, servers: list[ServerState], version: int, load: WeightLoader) -> UpdateStats:
        failed: dict[str, str] = {}
        paused_at: dict[str, float] = {}
        interrupted = 0

        paused: set[str] = set()

        async def pause(server: ServerState) -> None:
            nonlocal interrupted
            server.update_epoch += 1
            for partial in self._active[server.index]:
                partial.interruptions += 1
            interrupted += len(self._active[server.index])
            paused_at[server.url] = time.monotonic()
            if not self._active[server.index]:
                # Idle (e.g. every synchronous update): nothing to stop, and nothing can start
                # until the update ends (``_resumed`` is clear), so no pause round trip.
                return
            await self._control(server, "POST", "/pause", params=PAUSE_PARAMS[self._mode])
            paused.add(server.url)

        started = time.monotonic()
        phase_s: dict[str, float] = {}
        servers = await self._phase(servers, pause, "pausing", failed)
        phase_s["pause"] = time.monotonic() - started
        load_s: dict[str, float] = {}

        async def run_loader(server: ServerState) -> None:
            begun = time.monotonic()
            await _call_loader(load, server.address)
            load_s[server.url] = time.monotonic() - begun

        mark = time.monotonic()
        servers = await self._phase(servers, run_loader, f"loading weight version {version}", failed)
        phase_s["load"] = time.monotonic() - mark

        async def set_version(server: ServerState) -> None:
            await self._control(server, "POST", "/update_weight_version", json={"new_version": str(version)})
            server.version = version

        mark = time.monotonic()
        servers = await self._phase(servers, set_version, f"setting weight version {version}", failed)
        phase_s["set_version"] = time.monotonic() - mark
        resumed_at: dict[str, float] = {}

        async def resume(server: ServerState) -> None:
            if server.url in paused:
                await self._control(server, "POST", "/resume")
            resumed_at[server.url] = time.monotonic()

        mark = time.monotonic()
        await self._phase(servers, resume, "resuming", failed)
        ended = time.monotonic()
        phase_s["resume"] = ended - mark
        if not self._pool.live():
            raise self._pool.no_live_error()
        stats = UpdateStats(
            version=version,
            mode=self._mode,
            stall_s=ended - started,
            server_stall_s={url: resumed_at[url] - paused_at[url] for url in resumed_at},
            load_s=load_s,
            interrupted_segments=interrupted,
            failed_servers=failed,
            phase_s=phase_s,
            paused_servers=len(paused),
        )
        logger.info(
            "weight version %d on %d servers (%s): stall %.3f s, %d requests interrupted, %d servers failed",
            version, len(resumed_at), self._mode, stats.stall_s, interrupted, len(failed),
        )  # fmt: skip
        return stats

    async def _phase(
        self,
        servers: list[ServerState],
        step: Callable[[ServerState], Awaitable[None]],
        what: str,
        failed: dict[str, str],
    ) -> list[ServerState]:
        """Run ``step`` on every server at once; those that fail are taken out (and, if they
        still answer, have their requests aborted and are resumed). Returns the others.

        Errors that mean a misconfigured deployment (bad key, missing endpoint) take every
        server of the update out of rotation and propagate.
        """
        results = await asyncio.gather(*(step(s) for s in servers), return_exceptions=True)
        kept: list[ServerState] = []
        fatal: BaseException | None = None
        for server, result in zip(servers, results):
            if not isinstance(result, BaseException):
                kept.append(server)
                continue
            misconfigured = _misconfigured(result)
            if misconfigured or not isinstance(result, Exception):
                fatal = fatal or result
            reason = f"{what} failed: {result}" if isinstance(result, _ServerFailure) else f"{what} failed: {result!r}"
            failed[server.url] = reason
            self._take_out(server, reason, rejoinable=not misconfigured)
            await self._release_failed(server)
        if fatal is not None:
            # A broken deployment: the others may hold new weights under the old version label.
            for server in kept:
                failed[server.url] = f"{what}: update abandoned after {fatal!r} on another server"
                self._take_out(server, failed[server.url])
            await asyncio.gather(*(self._release_failed(s) for s in kept))
            raise fatal
        return kept

    async def _release_failed(self, server: ServerState) -> None:
        """Best effort on a server leaving rotation mid-update: abort its requests (they move
        to other servers) and resume it; a dead server just fails both calls."""
        for method, path, params in (("POST", "/pause", {"mode": "abort"}), ("POST", "/resume", None)):
            try:
                await self._control(server, method, path, params=params)
            except Exception as exc:  # noqa: BLE001 - the server is already out; the reason is logged
                logger.warning("rollout server %s (out of rotation): %s %s failed: %r", server.url, method, path, exc)
                return

    async def _control(self, server: ServerState, method: str, path: str, **kwargs: Any) -> dict[str, Any]:
        """One control request (pause, resume, version...); ``_ServerFailure`` if unreachable or 5xx.

        Control requests are idempotent: one that got no response because the server closed
        a pooled connection as it was sent (``RemoteProtocolError``) is sent once more on a
        new connection.
        """
        for attempt in (1, 2):
            try:
                response = await self._client().request(
                    method, server.url + path, headers=server.headers, timeout=self._control_timeout, **kwargs
                )
                break
            except httpx.RemoteProtocolError as exc:
                if attempt == 2:
                    raise _ServerFailure(f"{path}: connection failed: {exc!r}") from None
                logger.debug("rollout server %s: %s %s got no response (%r); resending", server.url, method, path, exc)
            except httpx.TransportError as exc:
                raise _ServerFailure(f"{path}: connection failed: {exc!r}") from None
        _raise_for_status(server, path, response)
        body = response.json()
        return body if isinstance(body, dict) else {"result": body}

    def _client(self) -> httpx.AsyncClient:
        if self._http is None:
            raise RuntimeError("RolloutClient is not started: use `async with RolloutClient(...)` or `await start()`")
        return self._http

    def _take_out(self, server: ServerState, reason: str, *, rejoinable: bool = True) -> None:
        """Take ``server`` out of rotation; unless it is misconfigured (not ``rejoinable``),
        look at it again after :func:`rejoin_wait_s` (module docstring, "Rejoin")."""
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

    async def _watch_out_of_rotation(self) -> None:
        """Look at every server out of rotation whose ``rejoin_at`` has come, for the client's life."""
        while True:
            await asyncio.sleep(min(1.0, self._rejoin_probe_s))
            now = time.monotonic()
            due = [
                s for s in self._pool.servers
                if not s.live and not s.answering and s.rejoin_at is not None and s.rejoin_at <= now
            ]  # fmt: skip
            await asyncio.gather(*(self._look(server) for server in due))

    async def _look(self, server: ServerState) -> None:
        """One look at a server out of rotation: ``answering`` if ``GET /v1/models`` answers 200."""
        try:
            response = await self._client().get(
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

    async def _rejoin(self, version: int, load: WeightLoader) -> None:
        """Bring every answering server out of rotation to ``version`` and back into rotation
        (the caller holds the update lock; the servers in rotation already run ``version``)."""
        answering = [s for s in self._pool.servers if not s.live and s.answering]
        if not answering:
            return

        async def rejoin(server: ServerState) -> None:
            reason = server.failure
            try:
                # Whatever it still runs was moved to other servers when it went out.
                await self._control(server, "POST", "/pause", params=PAUSE_PARAMS["recompute"])
                await _call_loader(load, server.address)
                await self._control(server, "POST", "/update_weight_version", json={"new_version": str(version)})
                await self._control(server, "POST", "/resume")
            except Exception as exc:  # noqa: BLE001 - it stays out; the reason is logged
                server.rejoin_attempts += 1
                self._schedule_look(server, rejoinable=not _misconfigured(exc))
                logger.warning("rollout server %s did not rejoin at weight version %d: %r", server.url, version, exc)
                await self._release_failed(server)  # not left paused by the pause above
                return
            server.version = version
            self._pool.readmit(server)
            logger.warning("rollout server %s back in rotation at weight version %d (it was out: %s)",
                           server.url, version, reason)  # fmt: skip

        await asyncio.gather(*(rejoin(server) for server in answering))

    # ----- start-up checks -----

    async def _probe(self, server: ServerState) -> None:
        """Check the key (a guarded path), the dev endpoints (``/weight_info``) and the
        generate endpoint (one 1-token request); set or adopt the weight version."""
        try:
            await self._control(server, "GET", "/v1/models")
            info = await self._control(server, "GET", "/weight_info")
            raw = info.get("weight_version")
            if raw in (None, "default"):
                initial = {"new_version": str(self._initial_version)}
                await self._control(server, "POST", "/update_weight_version", json=initial)
                server.version = self._initial_version
            elif isinstance(raw, str) and raw.isdigit():
                server.version = int(raw)
            else:
                raise RolloutSetupError(f"rollout server {server.url} reports weight version {raw!r}, not an int")
            probe = {"token_ids": [0], "sampling_params": {"max_tokens": 1, "detokenize": False}, "stream": False}
            try:
                response = await self._client().post(
                    server.url + GENERATE_PATH, json=probe, headers=server.headers, timeout=self._request_timeout
                )
            except httpx.TransportError as exc:
                raise _ServerFailure(f"{GENERATE_PATH}: connection failed: {exc!r}") from None
            _raise_for_status(server, GENERATE_PATH, response)
        except _ServerFailure as failure:
            self._take_out(server, f"start-up check failed: {failure.reason}")
