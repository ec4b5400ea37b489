"""Async generation client over one or more vLLM rollout servers, with interruptible weight updates.

Requests go to vLLM's streamed ``POST /inference/v1/generate``, whose final chunk carries the
engine's ``weight_versions`` spans, so every kept token's weight version is known exactly,
never guessed from timing. Each sample of a group is its own request, resubmitted alone (after
an abort, or elsewhere after a server failure) as prompt + tokens so far.
:meth:`RolloutClient.update_weights` pauses every server, loads, sets the version and resumes,
in ``interrupt_mode`` ``recompute`` (abort and resubmit; the paper's) or ``keep`` (freeze with
the KV cache and continue). Rejoin: a server out of rotation is looked at again with a doubling
wait up to :data:`~asyncrl.tasks.inference.server_rotation.MAX_REJOIN_WAIT_S` and put back at
the next weight update once it answers (the client's
:class:`~asyncrl.tasks.inference.server_rotation.ServerRotation`). LoRA (``adapters``): each
version is an adapter on the servers' base model; a request names its server's current
adapter, and its tokens carry that adapter's version. Modes, failures, rejoin and LoRA in
detail: ``docs/internals/inference.md``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from types import TracebackType

import httpx

from asyncrl.tasks.inference.routing import ServerAddress, ServerPool, ServerState
from asyncrl.tasks.system.durable_count import DurableCount
from asyncrl.tasks.inference.sample_journal import SampleJournal
from asyncrl.tasks.inference.samples import (
    INTERRUPT_MODES,
    InterruptMode,
    LiveSegment,
    PartialSample,
    SampleOutput,
    Segment,
    UpdateStats,
)
from asyncrl.tasks.inference.client_errors import ServerFailure, misconfigured, raise_for_status, raise_stream_error
from asyncrl.tasks.inference.server_rotation import ServerRotation, WeightLoader, call_loader
from asyncrl.tasks.inference.vllm_api import (
    GENERATE_PATH,
    PAUSE_PARAMS,
    SamplingOptions,
    check_generate_args,
    check_positive_int,
    segment_versions,
)

logger = logging.getLogger(__name__)


KEEPALIVE_S = 2.0
"""Idle time after which the client drops a pooled connection (uvicorn closes at 5 s)."""


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
    (module docstring, "Rejoin"); the client's :class:`ServerRotation` does the looking.

    ``adapters``: the servers were started with LoRA (``RolloutServerConfig.max_lora_rank``)
    and each weight version is a LoRA adapter (loaded by ``ServerWeightLoader(adapters=True)``).
    Every segment's request then names, as ``model``, the adapter of its server's version at
    submission (:func:`~asyncrl.tasks.inference.vllm_api.adapter_name`; none, i.e. the base
    model, for a server still at version 0 without an adapter), and all its tokens carry that
    version (:func:`~asyncrl.tasks.inference.vllm_api.segment_versions`). vLLM cannot switch a
    running request's adapter: in ``recompute`` mode a cut segment is resubmitted under the new
    adapter, as without LoRA; in ``keep`` mode a frozen request finishes on the adapter it
    started with, and its tokens after the update keep the old version.

    ``journal``: groups asked for with a ``journal_key`` are tracked there while they
    generate, and start from its journaled state where a restarted scheduler loaded one
    (:mod:`~asyncrl.tasks.inference.sample_journal`).

    ``delivered``: every output token received, kept or not, is added to it as it arrives:
    a count that survives a kill of this process, so what killed schedulers received (and
    what was generated again after a kill) can be counted afterwards.
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
        adapters: bool = False,
        journal: SampleJournal | None = None,
        delivered: DurableCount | None = None,
    ) -> None:
        if interrupt_mode not in INTERRUPT_MODES:
            raise ValueError(f"interrupt_mode: must be one of {list(INTERRUPT_MODES)}, got {interrupt_mode!r}")
        if isinstance(initial_version, bool) or not isinstance(initial_version, int) or initial_version < 0:
            raise ValueError(f"initial_version: must be an int >= 0, got {initial_version!r}")
        check_positive_int("max_segments", max_segments)
        check_positive_int("stream_interval", stream_interval)
        if request_timeout_s <= 0 or control_timeout_s <= 0:
            raise ValueError(
                f"request_timeout_s and control_timeout_s must be > 0, got {request_timeout_s}, {control_timeout_s}"
            )
        if not rejoin_probe_s > 0:
            raise ValueError(f"rejoin_probe_s: must be > 0, got {rejoin_probe_s!r}")
        self._pool = ServerPool(list(servers))
        self._mode: InterruptMode = interrupt_mode
        self._initial_version = initial_version
        self._adapters = bool(adapters)
        self._journal = journal
        self._delivered = delivered
        self._max_segments = max_segments
        self._stream_interval = stream_interval
        # Read timeout = longest silence in one stream; a keep-mode pause is such a silence.
        self._request_timeout = httpx.Timeout(connect=30.0, read=request_timeout_s, write=60.0, pool=None)
        self._http: httpx.AsyncClient | None = None
        self._rotation = ServerRotation(
            self._pool,
            self._client,
            control_timeout=httpx.Timeout(control_timeout_s),
            request_timeout=self._request_timeout,
            rejoin_probe_s=float(rejoin_probe_s),
            adapters=self._adapters,
        )
        self._active: dict[int, set[PartialSample]] = {s.index: set() for s in self._pool.servers}
        self._resumed = asyncio.Event()
        self._resumed.set()
        self._update_lock = asyncio.Lock()
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
        await asyncio.gather(*(self._rotation.probe(server, self._initial_version) for server in self._pool.live()))
        if not self._pool.live():
            raise self._pool.no_live_error()
        if self._watcher is None:
            self._watcher = asyncio.create_task(self._rotation.watch_out_of_rotation(), name="rollout-rejoin-watch")

    async def close(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
            await asyncio.gather(self._watcher, return_exceptions=True)
            self._watcher = None
        if self._http is not None:
            await self._http.aclose()
            self._http = None

    def _client(self) -> httpx.AsyncClient:
        if self._http is None:
            raise RuntimeError("RolloutClient is not started: use `async with RolloutClient(...)` or `await start()`")
        return self._http

    @property
    def interrupt_mode(self) -> InterruptMode:
        return self._mode

    @property
    def adapters(self) -> bool:
        """Whether weight versions are LoRA adapters (class docstring)."""
        return self._adapters

    def server_adapters(self) -> dict[str, str | None]:
        """LoRA adapter each server in rotation is sampled with, by URL (None: the base model)."""
        return {s.url: s.adapter for s in self._pool.live()}

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
        journal_key: str | None = None,
    ) -> list[SampleOutput]:
        """Generate ``n`` samples of ``prompt_token_ids``, each at most ``max_new_tokens`` long.

        Every sample carries its behaviour log-probs and per-token versions; it is
        produced exactly once whatever updates or server failures happen meanwhile. With a
        ``journal_key`` and a journal, the group is tracked in it under that key, and its
        samples go on from their journaled tokens if it holds them (an ended one is not
        generated again).
        """
        check_generate_args(prompt_token_ids, n, max_new_tokens, temperature, top_p)
        options = SamplingOptions(
            float(temperature), float(top_p), bool(ignore_eos), tuple(stop_token_ids), self._stream_interval
        )
        submitted_at = time.time()
        if self._journal is not None and journal_key is not None:
            partials = self._journal.start_group(journal_key, prompt_token_ids, n, max_new_tokens, submitted_at)
        else:
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
        if partial.finish_reason is not None:  # ended before a restart, resumed from the journal
            return partial.finish(partial.finish_reason, time.time()), last_url
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
            except ServerFailure as failure:
                self._rotation.take_out(server, failure.reason)
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
        """Stream one request; ``ServerFailure`` (with the keepable tokens) if the server fails."""
        http = self._client()
        body: dict[str, object] = {
            "token_ids": partial.next_prompt(),
            "sampling_params": options.params(partial.remaining),
            "stream": True,
        }
        version = server.version
        if server.adapter is not None:
            body["model"] = server.adapter  # bound to the request for its whole life in vLLM
        token_ids: list[int] = []
        logprobs: list[float] = []
        finish_reason: str | None = None
        spans: object = None
        source = f"rollout server {server.url}{GENERATE_PATH}"
        partial.live = LiveSegment(token_ids, logprobs, version)
        try:
            async with http.stream(
                "POST", server.url + GENERATE_PATH, json=body, headers=server.headers, timeout=self._request_timeout
            ) as response:
                if response.status_code != 200:
                    await response.aread()
                    raise_for_status(server, GENERATE_PATH, response)
                async for line in response.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[len("data: ") :])
                    if "error" in chunk:
                        raise_stream_error(server, chunk["error"])
                    for choice in chunk.get("choices") or []:
                        ids = choice.get("token_ids") or []
                        content = (choice.get("logprobs") or {}).get("content") or []
                        if [c.get("token_id") for c in content] != ids:
                            raise RuntimeError(f"{source}: chunk log-probs do not match its token ids: {choice}")
                        token_ids.extend(ids)
                        logprobs.extend(float(c["logprob"]) for c in content)
                        server.streamed_tokens += len(ids)
                        if self._delivered is not None:
                            self._delivered.add(len(ids))
                        if choice.get("finish_reason") is not None:
                            finish_reason = choice["finish_reason"]
                            spans = choice.get("weight_versions")
        except httpx.TransportError as exc:
            raise ServerFailure(f"connection failed: {exc!r}", partial.cut_live()) from None
        except ServerFailure as failure:
            raise ServerFailure(failure.reason, partial.cut_live())
        except asyncio.CancelledError:
            # A stopping scheduler: the tokens certainly of `version` stay with the sample,
            # which its last journal write then holds (sample_journal).
            cut = partial.cut_live()
            if cut is not None:
                partial.extend(cut)
            raise
        finally:
            partial.live = None
        if finish_reason is None:
            raise ServerFailure("stream ended without a finish reason", partial.cut_live())
        if finish_reason not in ("stop", "length", "abort"):
            raise RuntimeError(f"{source}: unexpected finish reason {finish_reason!r}")
        logger.debug("%s: segment of %d tokens ended with %s, spans %s", source, len(token_ids), finish_reason, spans)
        versions = segment_versions(spans, len(token_ids), source, version if self._adapters else None)
        if self._adapters and isinstance(spans, list) and len(spans) > 1:
            logger.debug(
                "%s: segment ran across an update (spans %s) on the adapter of version %d; its tokens carry %d",
                source, spans, version, version,
            )  # fmt: skip
        return Segment(token_ids, logprobs, versions, finish_reason)

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
            await self._rotation.rejoin(version, load)
            return stats

    async def _update_all(self, servers: list[ServerState], version: int, load: WeightLoader) -> UpdateStats:
        failed: dict[str, str] = {}
        paused_at: dict[str, float] = {}
        interrupted = 0

        paused: set[str] = set()

        async def pause(server: ServerState) -> None:
            nonlocal interrupted
            for partial in self._active[server.index]:
                partial.interruptions += 1
                if partial.live is not None:
                    partial.live.freeze()  # its tokens from now on may be of either version
            interrupted += len(self._active[server.index])
            paused_at[server.url] = time.monotonic()
            if not self._active[server.index]:
                # Idle (e.g. every synchronous update): nothing to stop, and nothing can start
                # until the update ends (``_resumed`` is clear), so no pause round trip.
                return
            await self._rotation.control(server, "POST", "/pause", params=PAUSE_PARAMS[self._mode])
            paused.add(server.url)

        started = time.monotonic()
        phase_s: dict[str, float] = {}
        servers = await self._phase(servers, pause, "pausing", failed)
        phase_s["pause"] = time.monotonic() - started
        load_s: dict[str, float] = {}

        async def run_loader(server: ServerState) -> None:
            begun = time.monotonic()
            await call_loader(load, server.address)
            load_s[server.url] = time.monotonic() - begun

        mark = time.monotonic()
        servers = await self._phase(servers, run_loader, f"loading weight version {version}", failed)
        phase_s["load"] = time.monotonic() - mark

        async def set_version(server: ServerState) -> None:
            await self._rotation.control(server, "POST", "/update_weight_version", json={"new_version": str(version)})
            self._rotation.served_version(server, version)

        mark = time.monotonic()
        servers = await self._phase(servers, set_version, f"setting weight version {version}", failed)
        phase_s["set_version"] = time.monotonic() - mark
        resumed_at: dict[str, float] = {}

        async def resume(server: ServerState) -> None:
            if server.url in paused:
                await self._rotation.control(server, "POST", "/resume")
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
            is_misconfigured = misconfigured(result)
            if is_misconfigured or not isinstance(result, Exception):
                fatal = fatal or result
            reason = f"{what} failed: {result}" if isinstance(result, ServerFailure) else f"{what} failed: {result!r}"
            failed[server.url] = reason
            self._rotation.take_out(server, reason, rejoinable=not is_misconfigured)
            await self._rotation.release_failed(server)
        if fatal is not None:
            # A broken deployment: the others may hold new weights under the old version label.
            for server in kept:
                failed[server.url] = f"{what}: update abandoned after {fatal!r} on another server"
                self._rotation.take_out(server, failed[server.url])
            await asyncio.gather(*(self._rotation.release_failed(s) for s in kept))
            raise fatal
        return kept
