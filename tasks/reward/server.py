"""The reward service as an OS process of its own, so that it can be killed and restarted
apart from the scheduler: ``python -m asyncrl.tasks.reward.server --config PROCESS_CONFIG
[--host 127.0.0.1] [--port 0]`` (:class:`~asyncrl.configs.processes.RewardProcessConfig`).

It starts a :class:`RewardPool` from the config's ``reward`` section, an HTTP server
(``POST /score``, ``GET /health``, ``GET /stats``), and registers its URL in the run root
(:mod:`asyncrl.tasks.reward.service_registry`) for clients
(:class:`~asyncrl.tasks.reward.remote.RemoteRewardScorer`). With ``ASYNCRL_REWARD_TOKEN`` every
path needs the bearer token (required off loopback). It ends on SIGTERM/SIGINT or when the
pool breaks. Exit status: 0 stopped, 1 the pool failed or another error, 2 bad config or
arguments. HTTP API and stats logging: ``docs/internals/reward.md``.
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import json
import logging
import os
import signal
import socket
import socketserver
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import FrameType
from typing import Any
from urllib.parse import urlsplit

from asyncrl.configs.loading import ConfigError, frozen_yaml, load_process_config
from asyncrl.configs.processes import RewardProcessConfig
from asyncrl.storage.fs import RunRoot, open_root
from asyncrl.tasks.system.network import is_loopback
from asyncrl.tasks.reward.process import MODULE
from asyncrl.tasks.reward.pool import PoolStats, RewardPool, RewardPoolError
from asyncrl.tasks.reward.service_registry import (
    TOKEN_ENV,
    RewardServiceInfo,
    read_reward_service,
    register_reward_service,
    unregister_reward_service,
)
from asyncrl.tasks.reward.types import RewardRequest

__all__ = ["TOKEN_ENV", "RewardServiceInfo", "format_stats", "main", "parse_score_body", "read_reward_service", "serve"]

EXIT_OK, EXIT_ERROR, EXIT_CONFIG = 0, 1, 2
MAX_BODY_BYTES = 64 << 20
"""Largest /score body accepted (413 above): a bound on what one client can make the service buffer."""
WATCH_EVERY_S = 0.5
"""How often the main thread looks at the pool's health."""
REPORT_EVERY_S = 30.0
"""How often the service logs its pool's stats (one line, :func:`format_stats`)."""
IDLE_CONNECTION_S = 300.0
"""A kept-alive connection with no new request for this long is closed (frees its thread)."""
logger = logging.getLogger("asyncrl.reward.server")

Route = Callable[[], tuple[int, dict[str, Any]]]


class RequestRefused(Exception):
    """A request the service refuses: ``status`` and a message for the client."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def parse_score_body(body: Any) -> list[RewardRequest]:
    """The requests of a /score body; ``ValueError`` naming the first bad field (``requests[3].kind``)."""
    if not isinstance(body, dict) or set(body) != {"requests"}:
        shown = sorted(body) if isinstance(body, dict) else type(body).__name__
        raise ValueError(f"body: expected a JSON object with exactly the key 'requests', got {shown}")
    if not isinstance(body["requests"], list):
        raise ValueError(f"requests: expected a list, got {type(body['requests']).__name__}")
    return [RewardRequest.from_json(item, f"requests[{i}]") for i, item in enumerate(body["requests"])]


class RewardHTTPServer(ThreadingHTTPServer):
    """Serves one pool; one thread per connection (scoring blocks that thread, not others)."""

    daemon_threads = True  # a connection left open must not keep the process alive at exit

    def __init__(self, host: str, port: int, pool: RewardPool, token: str | None) -> None:
        self.address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.pool = pool
        self._token_digest = None if token is None else _digest(token)
        super().__init__((host, port), RewardRequestHandler)

    def server_bind(self) -> None:
        """Bind without HTTPServer's ``socket.getfqdn`` (a reverse DNS lookup that can stall
        for seconds on a machine without DNS)."""
        socketserver.TCPServer.server_bind(self)
        host, port = self.server_address[:2]
        self.server_name, self.server_port = str(host), int(port)

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        shown = f"[{host}]" if ":" in str(host) else str(host)
        return f"http://{shown}:{port}"

    def authorized(self, header: str | None) -> bool:
        """Whether ``header`` (the Authorization value) carries the token; always true without one.

        Both sides are hashed before ``hmac.compare_digest`` so neither the token's content
        nor its length shows in the comparison's timing."""
        if self._token_digest is None:
            return True
        scheme, _, token = (header or "").partition(" ")
        if scheme.lower() != "bearer":
            return False
        return hmac.compare_digest(_digest(token.strip()), self._token_digest)


class RewardRequestHandler(BaseHTTPRequestHandler):
    """Routes /score, /health and /stats; every answer is JSON with a Content-Length."""

    server: RewardHTTPServer
    protocol_version = "HTTP/1.1"  # keep-alive: a scheduler sends batch after batch
    timeout = IDLE_CONNECTION_S

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        self._dispatch({"/health": self._health, "/stats": self._stats})

    def do_POST(self) -> None:  # noqa: N802 - http.server's naming
        self._dispatch({"/score": self._score})

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - overrides the base signature
        """Per-request lines go to the debug log, not to stderr, where errors must stand out."""
        logger.debug("%s %s", self.address_string(), format % args)

    def _dispatch(self, routes: dict[str, Route]) -> None:
        path = urlsplit(self.path).path
        try:
            if not self.server.authorized(self.headers.get("Authorization")):
                raise RequestRefused(401, "Unauthorized: missing or wrong 'Authorization: Bearer <token>'")
            route = routes.get(path)
            if route is None:
                endpoints = "POST /score, GET /health, GET /stats"
                raise RequestRefused(404, f"no such endpoint: {self.command} {path} ({endpoints})")
            status, body = route()
        except RequestRefused as exc:
            status, body = exc.status, {"error": str(exc)}
        except Exception as exc:  # noqa: BLE001 - the client gets the reason; the service keeps serving
            logger.exception("reward service: %s %s failed", self.command, path)
            status, body = 500, {"error": f"internal error: {type(exc).__name__}: {exc}"}
        self._send(status, body)

    def _score(self) -> tuple[int, dict[str, Any]]:
        try:
            requests = parse_score_body(self._read_json())
        except ValueError as exc:
            raise RequestRefused(400, str(exc)) from None
        try:
            results = self.server.pool.score_sync(requests)
        except RewardPoolError as exc:
            raise RequestRefused(503, str(exc)) from None
        return 200, {"results": [result.to_json() for result in results]}

    def _health(self) -> tuple[int, dict[str, Any]]:
        pool = self.server.pool
        if pool.healthy:
            return 200, {"status": "ok", "stats": asdict(pool.stats())}
        return 503, {"status": "broken", "error": pool.error or "the reward pool is not running"}

    def _stats(self) -> tuple[int, dict[str, Any]]:
        return 200, asdict(self.server.pool.stats())

    def _read_json(self) -> Any:
        length = self.headers.get("Content-Length")
        if length is None or not length.isdigit():
            raise RequestRefused(411, f"a Content-Length header is required, got {length!r}")
        if int(length) > MAX_BODY_BYTES:
            raise RequestRefused(413, f"body of {length} bytes is over the limit of {MAX_BODY_BYTES}")
        raw = self.rfile.read(int(length))
        try:
            return json.loads(raw)
        except ValueError as exc:
            raise RequestRefused(400, f"body is not valid JSON: {exc}") from None

    def _send(self, status: int, body: dict[str, Any]) -> None:
        """Send ``body``; close the connection after an error, whose request body may be unread."""
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        if status == 401:
            self.send_header("WWW-Authenticate", "Bearer")
        if status >= 400:
            self.send_header("Connection", "close")
            self.close_connection = True
        self.end_headers()
        self.wfile.write(data)


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


def install_stop_handlers(stop: threading.Event) -> None:
    """SIGTERM and SIGINT set ``stop`` (a supervisor stops the service with SIGTERM)."""

    def handler(signum: int, frame: FrameType | None) -> None:
        logger.info("received %s: stopping", signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)


def format_stats(stats: PoolStats) -> str:
    """One log line: completed items, reason counts, worker restarts, the sandboxes' caps."""
    reasons = ", ".join(f"{reason}={count}" for reason, count in sorted(stats.reasons.items())) or "none"
    caps = f"; {stats.caps}" if stats.caps else ""
    return (
        f"reward pool: {stats.completed} scored, {stats.pending} pending, {stats.busy}/{stats.workers} busy; "
        f"reasons: {reasons}; worker restarts {stats.worker_restarts} "
        f"({stats.workers_killed_for_timeout} killed for timeouts){caps}"
    )


def wait_until_stopped(
    pool: RewardPool, stop: threading.Event, every_s: float = WATCH_EVERY_S, report_every_s: float = REPORT_EVERY_S
) -> str | None:
    """Block until ``stop`` is set (None) or the pool breaks (its error): a broken pool
    cannot heal, so the process must end and be restarted by its supervisor. Logs the
    pool's stats every ``report_every_s`` seconds meanwhile."""
    next_report = time.monotonic() + report_every_s
    while not stop.wait(every_s):
        if not pool.healthy:
            return pool.error or "the reward pool's dispatcher stopped"
        if time.monotonic() >= next_report:
            logger.info("%s", format_stats(pool.stats()))
            next_report = time.monotonic() + report_every_s
    return None


def serve(config: RewardProcessConfig, root: RunRoot, host: str, port: int, token: str | None) -> int:
    """Run the service until stopped or broken (see the module docstring); the exit status."""
    stop = threading.Event()
    install_stop_handlers(stop)
    try:
        pool = RewardPool(config.reward).start()
    except RewardPoolError as exc:
        print(f"reward service: {exc}", file=sys.stderr)
        return EXIT_ERROR
    try:
        error = _serve_pool(pool, root, host, port, token, stop)
    finally:
        pool.close()
    if error is not None:
        print(f"reward service: the reward pool broke: {error}", file=sys.stderr)
        return EXIT_ERROR
    logger.info("reward service stopped; %s", format_stats(pool.stats()))
    return EXIT_OK


def _serve_pool(
    pool: RewardPool, root: RunRoot, host: str, port: int, token: str | None, stop: threading.Event
) -> str | None:
    """Serve ``pool`` over HTTP, registered in ``root``, until stopped (None) or broken (the error)."""
    httpd = RewardHTTPServer(host, port, pool, token)
    threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.2}, name="reward-http", daemon=True).start()
    info: RewardServiceInfo | None = None
    try:
        info = register_reward_service(root, httpd.url, os.getpid())
        logger.info(
            "reward service listening on %s (pid %d, %d workers); %s", info.url, info.pid, pool.size, pool.caps_report
        )
        return wait_until_stopped(pool, stop)
    finally:
        if info is not None:
            _unregister(root, info)
        httpd.shutdown()
        httpd.server_close()


def _unregister(root: RunRoot, info: RewardServiceInfo) -> None:
    """Remove our entry so clients stop trying this URL; a storage fault is logged, not raised:
    the entry then names a dead URL, which clients survive (they read it again)."""
    try:
        unregister_reward_service(root, info)
    except OSError as exc:
        logger.warning("reward service: could not remove its registration: %s", exc)


def check_arguments(host: str, port: int, token: str | None) -> None:
    """``ConfigError`` for a port out of range, an empty token, or an open non-loopback host."""
    if not 0 <= port <= 65535:
        raise ConfigError(f"--port: {port} is not in 0-65535 (0 picks a free port)")
    if token is not None and not token.strip():
        raise ConfigError(f"{TOKEN_ENV} is set but empty: unset it (no authentication) or set a token")
    if token is None and not is_loopback(host):
        raise ConfigError(f"--host {host!r} is not loopback: set {TOKEN_ENV} so that only clients with the token score")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="the reward service's process config (RunPaths.process_config)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback)")
    parser.add_argument("--port", type=int, default=0, help="port to listen on; 0 (default) picks a free one")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s", stream=sys.stderr)
    token = os.environ.get(TOKEN_ENV)
    try:
        check_arguments(args.host, args.port, token)
        config = load_process_config(args.config, RewardProcessConfig)
        root = open_root(config.storage.root, config.storage.options)
    except (ConfigError, ValueError) as exc:
        print(f"reward service: config error: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    logger.info("config (secrets redacted):\n%s", frozen_yaml(config))
    try:
        return serve(config, root, args.host, args.port, token)
    except Exception as exc:  # noqa: BLE001 - one line for the supervisor's log; the traceback is logged
        logger.exception("reward service failed")
        print(f"reward service: {type(exc).__name__}: {exc}", file=sys.stderr)
        return EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main())
