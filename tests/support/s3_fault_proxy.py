"""A fault-injecting reverse proxy for S3 endpoints: tests and chaos runs.

The proxy sits between an S3 client and a real S3 server (moto, SeaweedFS, ...). Each
request is read whole and then, by one draw of a seeded RNG, either forwarded untouched
or hit by one fault:

=================  ===========================================================================
``slowdown``       answer 503 ``SlowDown`` (S3 XML error body); not forwarded
``internal_error`` answer 500 ``InternalError`` (S3 XML error body); not forwarded
``delay``          wait ``delay_s``, then forward (not forwarded if the client hung up meanwhile)
``drop_before``    reset the connection (TCP RST); not forwarded: the server never sees it
``drop_after``     forward, let the server apply it, then reset instead of answering: the
                   client cannot know that its write happened (the case retries get wrong)
``truncate``       forward, send status, headers and half of the body, then close; a
                   response with fewer than 2 body bytes gets ``drop_after`` instead
=================  ===========================================================================

With rates r_k, a request draws u ~ U[0, 1) and gets the first kind k (in the order
above) with u < r_1 + ... + r_k, else none; so P(kind k) = r_k and P(no fault) =
1 - sum(r). Only requests whose ``"METHOD target"`` matches the plan's ``match``
regex draw, and none after ``max_faults`` faults. The draws follow the order in which
requests arrive, so one seed replays the same faults for a sequential client;
concurrent requests may swap places. Error answers to ``HEAD`` carry no body, as S3's.

Forwarding is verbatim: request line, headers (``Host`` and the SigV4 ``Authorization``
included) and body bytes go upstream unchanged, except the hop-by-hop headers the
proxy owns: ``Connection`` (upstream gets ``Connection: close``) and ``Expect`` (the
proxy answers ``100 Continue`` itself). botocore never signs either (``expect`` is on
its unsigned list; ``connection`` is added by the HTTP client after signing). ``Host``
must stay: the client signed the proxy's ``host:port``, and a server that checks
signatures (SeaweedFS) recomputes them from the ``Host`` it receives. Path-style
addressing (botocore's choice for an IP endpoint) keeps the bucket in the path, so the
upstream never needs the host name to find it.

Run it by hand in front of a store (then point ``storage.options.endpoint_url`` at it)::

    python tests/support/s3_fault_proxy.py --upstream http://127.0.0.1:8333 --port 9333 --rate 0.2
"""

from __future__ import annotations

import argparse
import asyncio
import random
import re
import signal
import socket
import struct
import threading
from collections import Counter, deque
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from types import MappingProxyType
from urllib.parse import urlsplit

FAULT_KINDS = ("slowdown", "internal_error", "delay", "drop_before", "drop_after", "truncate")
_ERROR_REPLIES = {
    "slowdown": (503, b"Slow Down", "SlowDown", "Please reduce your request rate."),
    "internal_error": (
        500, b"Internal Server Error", "InternalError", "We encountered an internal error. Please try again."
    ),
}
_HOP_BY_HOP = frozenset({b"connection", b"keep-alive", b"proxy-connection", b"expect"})
_HEAD_LIMIT = 1 << 20


@dataclass(frozen=True)
class FaultPlan:
    """Per-request fault probabilities (``rates``: kind -> probability) and the RNG seed."""

    rates: Mapping[str, float]
    seed: int = 0
    delay_s: float = 0.2
    """How long a ``delay`` fault holds the request (keep it under the client's read timeout)."""
    match: str | None = None
    """Only requests whose ``"METHOD target"`` this regex searches successfully may be hit."""
    max_faults: int | None = None
    """Inject at most this many faults under this plan (``None``: no limit)."""

    def __post_init__(self) -> None:
        unknown = sorted(set(self.rates) - set(FAULT_KINDS))
        if unknown:
            raise ValueError(f"unknown fault kinds {unknown}; known: {list(FAULT_KINDS)}")
        bad = {kind: rate for kind, rate in self.rates.items() if not 0.0 <= rate <= 1.0}
        if bad:
            raise ValueError(f"fault rates must lie in [0, 1], got {bad}")
        if sum(self.rates.values()) > 1.0 + 1e-9:
            raise ValueError(f"fault rates add up to {sum(self.rates.values())} > 1: {dict(self.rates)}")
        if self.delay_s < 0:
            raise ValueError(f"delay_s must be >= 0, got {self.delay_s}")
        if self.max_faults is not None and self.max_faults < 0:
            raise ValueError(f"max_faults must be >= 0 or None, got {self.max_faults}")
        if self.match is not None:
            re.compile(self.match)
        object.__setattr__(self, "rates", MappingProxyType(dict(self.rates)))

    @classmethod
    def uniform(
        cls, total: float, seed: int = 0, delay_s: float = 0.2, kinds: tuple[str, ...] = FAULT_KINDS
    ) -> FaultPlan:
        """``total`` split evenly over ``kinds``."""
        return cls({kind: total / len(kinds) for kind in kinds}, seed=seed, delay_s=delay_s)

    def draw(self, rng: random.Random, request_line: str, injected: int) -> str | None:
        """The fault for the next request, or ``None`` (see the module docstring);
        ``injected`` is how many faults this plan has injected so far."""
        if self.match is not None and not re.search(self.match, request_line):
            return None
        if self.max_faults is not None and injected >= self.max_faults:
            return None
        u = rng.random()
        bound = 0.0
        for kind in FAULT_KINDS:
            bound += self.rates.get(kind, 0.0)
            if u < bound:
                return kind
        return None


NO_FAULTS = FaultPlan({})


@dataclass(frozen=True)
class _Message:
    """One parsed HTTP/1.1 message head plus its raw body."""

    start_line: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes

    def header(self, name: bytes) -> bytes | None:
        for key, value in self.headers:
            if key.lower() == name:
                return value
        return None

    def serialize(self, extra_headers: list[tuple[bytes, bytes]] = (), body: bytes | None = None) -> bytes:
        """Start line and headers minus hop-by-hop ones, plus ``extra_headers``, then the body."""
        kept = [(k, v) for k, v in self.headers if k.lower() not in _HOP_BY_HOP] + list(extra_headers)
        lines = [self.start_line] + [k + b": " + v for k, v in kept]
        return b"\r\n".join(lines) + b"\r\n\r\n" + (self.body if body is None else body)


def _parse_head(head: bytes) -> tuple[bytes, list[tuple[bytes, bytes]]]:
    lines = head.rstrip(b"\r\n").split(b"\r\n")
    headers = []
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        headers.append((name.strip(), value.strip()))
    return lines[0], headers


async def _read_body(reader: asyncio.StreamReader, head: _Message) -> bytes:
    """The raw request body: chunked (kept chunked, trailers included) or Content-Length bytes."""
    if b"chunked" in (head.header(b"transfer-encoding") or b"").lower():
        raw = bytearray()
        while True:
            size_line = await reader.readuntil(b"\r\n")
            raw += size_line
            size = int(size_line.split(b";")[0].strip(), 16)
            if size == 0:
                while True:
                    trailer = await reader.readuntil(b"\r\n")
                    raw += trailer
                    if trailer == b"\r\n":
                        return bytes(raw)
            raw += await reader.readexactly(size + 2)
    length = int(head.header(b"content-length") or b"0")
    return await reader.readexactly(length) if length else b""


def _error_reply(kind: str, resource: str, with_body: bool) -> bytes:
    """An S3 error answer (XML body; a HEAD answer keeps the length header but no body)."""
    status, reason, code, message = _ERROR_REPLIES[kind]
    body = (
        '<?xml version="1.0" encoding="UTF-8"?>\n'
        f"<Error><Code>{code}</Code><Message>{message}</Message>"
        f"<Resource>{resource}</Resource><RequestId>fault-proxy</RequestId></Error>"
    ).encode()
    head = f"HTTP/1.1 {status} ".encode() + reason
    head += f"\r\nContent-Type: application/xml\r\nContent-Length: {len(body)}\r\n\r\n".encode()
    return head + body if with_body else head


def _reset(writer: asyncio.StreamWriter) -> None:
    """Abort the connection with a TCP RST (SO_LINGER 0), as a crashed server or middlebox would."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        except OSError:
            pass
    writer.transport.abort()


class FaultProxy:
    """The proxy: a server on 127.0.0.1 (own event loop thread) in front of ``upstream``."""

    def __init__(self, upstream: str, plan: FaultPlan = NO_FAULTS, host: str = "127.0.0.1", port: int = 0) -> None:
        parts = urlsplit(upstream)
        if parts.scheme != "http" or not parts.hostname or not parts.port:
            raise ValueError(f"upstream must be http://host:port, got {upstream!r}")
        self.upstream = (parts.hostname, parts.port)
        self._bind = (host, port)
        self._lock = threading.Lock()
        self._plan = plan
        self._rng = random.Random(plan.seed)
        self._injected = 0
        self._counts: Counter[str] = Counter()
        self.events: deque[tuple[str, str, str]] = deque(maxlen=10_000)
        """Recent faults as (kind, method, request target)."""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.base_events.Server | None = None
        self._thread: threading.Thread | None = None
        self.url = ""

    def set_plan(self, plan: FaultPlan) -> None:
        """Switch to ``plan`` (its RNG restarts from ``plan.seed``); counts are kept."""
        with self._lock:
            self._plan = plan
            self._rng = random.Random(plan.seed)
            self._injected = 0

    @contextmanager
    def faults_paused(self) -> Iterator[None]:
        """No faults inside the block (setup and checks); the previous plan resumes afterwards."""
        with self._lock:
            saved = self._plan, self._rng, self._injected
            self._plan = NO_FAULTS
        try:
            yield
        finally:
            with self._lock:
                self._plan, self._rng, self._injected = saved

    def counts(self) -> dict[str, int]:
        """Requests seen (``requests``), forwarded (``forwarded``) and faults injected, by kind."""
        with self._lock:
            return dict(self._counts)

    def start(self) -> FaultProxy:
        ready = threading.Event()
        failure: list[BaseException] = []

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            try:
                self._server = loop.run_until_complete(
                    asyncio.start_server(self._serve, *self._bind, limit=_HEAD_LIMIT)
                )
            except BaseException as exc:  # reported to the starting thread
                failure.append(exc)
                ready.set()
                loop.close()
                return
            ready.set()
            loop.run_forever()
            loop.close()

        self._thread = threading.Thread(target=run, name="s3-fault-proxy", daemon=True)
        self._thread.start()
        ready.wait()
        if failure:
            raise RuntimeError(f"fault proxy could not listen on {self._bind}") from failure[0]
        host, port = self._server.sockets[0].getsockname()[:2]
        self.url = f"http://{host}:{port}"
        return self

    def stop(self) -> None:
        if self._loop is None or self._thread is None:
            return

        async def shutdown() -> None:
            self._server.close()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop = None

    def _next_fault(self, request: _Message) -> tuple[str | None, float]:
        with self._lock:
            self._counts["requests"] += 1
            request_line = request.start_line.rpartition(b" ")[0].decode(errors="replace")
            fault = self._plan.draw(self._rng, request_line, self._injected)
            self._injected += fault is not None
            return fault, self._plan.delay_s

    def _count(self, kind: str, request: _Message | None = None) -> None:
        with self._lock:
            self._counts[kind] += 1
            if request is not None:
                method, _, rest = request.start_line.partition(b" ")
                self.events.append((kind, method.decode(), rest.rpartition(b" ")[0].decode(errors="replace")))

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One client connection: requests in turn until the client closes or a fault ends it."""
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except asyncio.IncompleteReadError:
                    return  # the client closed between requests
                request = _Message(*_parse_head(head), b"")
                if (request.header(b"expect") or b"").lower() == b"100-continue":
                    writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
                    await writer.drain()
                request = _Message(request.start_line, request.headers, await _read_body(reader, request))
                if not await self._answer(request, reader, writer):
                    return
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            writer.transport.abort()
        except asyncio.CancelledError:
            writer.transport.abort()  # the proxy is stopping; end quietly rather than as "cancelled"
        finally:
            if not writer.transport.is_closing():
                writer.close()

    async def _answer(self, request: _Message, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        """Answer one request (or fail it); return whether the connection stays open."""
        fault, delay_s = self._next_fault(request)
        if fault in _ERROR_REPLIES:
            self._count(fault, request)
            method, target = request.start_line.split(b" ")[:2]
            writer.write(_error_reply(fault, target.decode(errors="replace"), with_body=method != b"HEAD"))
            await writer.drain()
            return True
        if fault == "drop_before":
            self._count(fault, request)
            _reset(writer)
            return False
        if fault == "delay":
            self._count(fault, request)
            await asyncio.sleep(delay_s)
            if reader.at_eof():
                self._count("delay_abandoned")  # the client gave up: a late copy must not land
                return False
        try:
            response = await self._forward(request)
        except (OSError, asyncio.IncompleteReadError, ValueError):
            self._count("upstream_error", request)  # the real store failed: say so, as a gateway does
            writer.write(b"HTTP/1.1 502 Bad Gateway\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
            await writer.drain()
            return False
        self._count("forwarded")
        if fault == "truncate" and len(response.body) < 2:
            fault = "drop_after"
        if fault == "drop_after":
            self._count(fault, request)
            _reset(writer)
            return False
        keep_alive = self._client_keeps_alive(request) and self._framed(request, response)
        connection = [(b"Connection", b"keep-alive" if keep_alive else b"close")]
        if fault == "truncate":
            self._count(fault, request)
            writer.write(response.serialize(connection, body=response.body[: len(response.body) // 2]))
            await writer.drain()
            writer.close()
            return False
        writer.write(response.serialize(connection))
        await writer.drain()
        return keep_alive

    async def _forward(self, request: _Message) -> _Message:
        """Send ``request`` upstream on a fresh connection and read the whole response."""
        up_reader, up_writer = await asyncio.open_connection(*self.upstream, limit=_HEAD_LIMIT)
        try:
            up_writer.write(request.serialize([(b"Connection", b"close")]))
            await up_writer.drain()
            raw = await up_reader.read()
        finally:
            up_writer.close()
        while True:
            head, separator, body = raw.partition(b"\r\n\r\n")
            if not separator:
                raise ValueError(f"upstream answered no complete HTTP head: {raw[:200]!r}")
            response = _Message(*_parse_head(head + separator), body)
            if not response.start_line.split(b" ")[1].startswith(b"1"):
                return response
            raw = body  # skip an interim 1xx response

    @staticmethod
    def _client_keeps_alive(request: _Message) -> bool:
        connection = (request.header(b"connection") or b"").lower()
        if request.start_line.endswith(b"HTTP/1.0"):
            return connection == b"keep-alive"
        return connection != b"close"

    @staticmethod
    def _framed(request: _Message, response: _Message) -> bool:
        """Whether the client can tell where the response ends without the connection closing."""
        status = response.start_line.split(b" ")[1]
        if request.start_line.startswith(b"HEAD ") or status in (b"204", b"304"):
            return True
        encoding = (response.header(b"transfer-encoding") or b"").lower()
        return response.header(b"content-length") is not None or b"chunked" in encoding


@contextmanager
def s3_fault_proxy(
    upstream: str, plan: FaultPlan = NO_FAULTS, host: str = "127.0.0.1", port: int = 0
) -> Iterator[FaultProxy]:
    """A started :class:`FaultProxy` in front of ``upstream`` (port 0: a free one); stopped on exit."""
    proxy = FaultProxy(upstream, plan, host=host, port=port).start()
    try:
        yield proxy
    finally:
        proxy.stop()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Fault-injecting reverse proxy for an S3 endpoint.")
    parser.add_argument("--upstream", required=True, help="the real S3 endpoint, http://host:port")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=9333)
    parser.add_argument("--rate", type=float, default=0.2, help="total fault probability per request")
    parser.add_argument("--kinds", nargs="+", default=list(FAULT_KINDS), choices=FAULT_KINDS)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--delay", type=float, default=0.2, help="seconds a delay fault holds a request")
    args = parser.parse_args(argv)
    plan = FaultPlan.uniform(args.rate, seed=args.seed, delay_s=args.delay, kinds=tuple(args.kinds))
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    with s3_fault_proxy(args.upstream, plan, host=args.host, port=args.port) as proxy:
        rates = {kind: round(rate, 4) for kind, rate in plan.rates.items()}
        print(f"fault proxy {proxy.url} -> {args.upstream}: {rates}", flush=True)
        while not stop.wait(10.0):
            print(f"counts: {proxy.counts()}", flush=True)
    print(f"final counts: {proxy.counts()}", flush=True)


if __name__ == "__main__":
    main()
