"""Doorbells: wake a component the moment what it waits for is in the run root.

A doorbell carries no data: the run root stays the only truth and the only way components
find each other. A waiter (the trainer for shards, the scheduler for a new weight version)
opens a :class:`DoorbellListener` on a *topic*, a UDP socket whose address it writes to
``doorbells/{topic}/{listener}.json``; the writer rings the topic (:class:`Doorbell`) right
after its write is durable. Either way the waiter then looks at the run root, so a lost,
late, forged or repeated datagram costs at most one look or one poll interval, never
correctness: polling stays the fallback. Reach across machines (``ASYNCRL_DOORBELL_HOST``)
and the storage work per ring: ``docs/internals/storage.md``.
"""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import os
import secrets
import select
import socket
import time
from dataclasses import dataclass

from asyncrl.storage import fs, paths
from asyncrl.storage.fs import RunRoot

logger = logging.getLogger(__name__)

SHARDS_TOPIC = "shards"
"""Rung by the scheduler after each trajectory shard it publishes; the trainer listens."""
WEIGHTS_TOPIC = "weights"
"""Rung by the trainer after each weight version it publishes; the scheduler listens."""
HOST_ENV = "ASYNCRL_DOORBELL_HOST"
DEFAULT_HOST = "127.0.0.1"
_DATAGRAM = b"ring"
_MAX_DRAIN = 1024


@dataclass(frozen=True)
class DoorbellAddress:
    """Where one listener of a topic listens (the content of its file in the run root)."""

    host: str
    port: int
    hostname: str
    pid: int

    def to_json(self) -> bytes:
        return json.dumps({"host": self.host, "port": self.port, "hostname": self.hostname, "pid": self.pid}).encode()

    @staticmethod
    def from_json(raw: bytes) -> DoorbellAddress | None:
        """The address in ``raw``, or None if it is not one (a ringer skips it)."""
        try:
            content = json.loads(raw)
            address = DoorbellAddress(str(content["host"]), int(content["port"]), str(content["hostname"]), int(content["pid"]))
        except (ValueError, KeyError, TypeError):
            return None
        return address if 0 < address.port < 65536 else None

    def reachable_from(self, hostname: str) -> bool:
        """A loopback address is reachable only from its own host."""
        loopback = self.host.startswith("127.") or self.host == "localhost"
        return not loopback or self.hostname == hostname


class DoorbellListener:
    """A UDP socket on ``host`` (``ASYNCRL_DOORBELL_HOST`` or 127.0.0.1, any free port),
    advertised at ``doorbells/{topic}/{id}.json`` until :meth:`close`."""

    def __init__(self, root: RunRoot, topic: str, host: str | None = None) -> None:
        self._root = root
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self._sock.setblocking(False)
        bind_host = host or os.environ.get(HOST_ENV) or DEFAULT_HOST
        try:
            self._sock.bind((bind_host, 0))
        except OSError as exc:
            self._sock.close()
            raise OSError(exc.errno, f"doorbell {topic!r}: cannot listen on {bind_host!r} ({HOST_ENV}): {exc}") from None
        self.address = DoorbellAddress(bind_host, self._sock.getsockname()[1], socket.gethostname(), os.getpid())
        self._relpath = paths.doorbell(topic, f"{self.address.hostname}-{self.address.pid}-{secrets.token_hex(4)}")
        try:
            fs.put_atomic_replace(root, self._relpath, self.address.to_json())
        except BaseException:
            self._sock.close()
            raise

    def _drain(self) -> bool:
        """Read every waiting datagram; True if there was one."""
        rung = False
        for _ in range(_MAX_DRAIN):
            try:
                self._sock.recv(64)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:  # e.g. ECONNREFUSED reported on a UDP socket: not a ring
                continue
            rung = True
        return rung

    def wait(self, timeout: float) -> bool:
        """Block until rung (True) or ``timeout`` seconds pass (False); pending rings are
        consumed, so one wait answers every ring sent before it returns."""
        if self._drain():
            return True
        readable, _, _ = select.select([self._sock], [], [], max(timeout, 0.0))
        return bool(readable) and self._drain()

    async def wait_async(self, timeout: float) -> bool:
        """:meth:`wait` for an event loop: returns early when rung, never blocks the loop."""
        if self._drain():
            return True
        loop = asyncio.get_running_loop()
        rung = loop.create_future()

        def on_readable() -> None:
            if not rung.done():
                rung.set_result(True)

        loop.add_reader(self._sock.fileno(), on_readable)
        try:
            await asyncio.wait_for(rung, timeout=max(timeout, 0.0))
        except TimeoutError:
            pass
        finally:
            loop.remove_reader(self._sock.fileno())
        return self._drain()

    def close(self) -> None:
        """Stop listening and remove the advertisement (best effort: a ringer that still
        lists it sends to a closed port, which is harmless)."""
        self._sock.close()
        try:
            fs.delete(self._root, self._relpath, missing_ok=True)
        except OSError as exc:
            logger.debug("doorbell %s: could not remove its address: %r", self._relpath, exc)

    def __enter__(self) -> DoorbellListener:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class Doorbell:
    """Rings every listener of ``topic`` (see the module docstring)."""

    def __init__(self, root: RunRoot, topic: str, refresh_s: float = 10.0, empty_refresh_s: float = 1.0) -> None:
        self._root = root
        self._topic = topic
        self._refresh_s = refresh_s
        self._empty_refresh_s = empty_refresh_s
        self._addresses: dict[str, DoorbellAddress | None] = {}
        self._listed_at = -float("inf")
        self._hostname = socket.gethostname()

    def _refresh(self) -> None:
        age = time.monotonic() - self._listed_at
        if age < (self._refresh_s if any(self._addresses.values()) else self._empty_refresh_s):
            return
        self._listed_at = time.monotonic()
        names = [n for n in fs.list_dir(self._root, paths.doorbell_dir(self._topic)) if n.endswith(".json")]
        new = [n for n in names if n not in self._addresses]
        contents = fs.read_many(self._root, [paths.doorbell(self._topic, n[: -len(".json")]) for n in new])
        self._addresses = {n: self._addresses.get(n) for n in names if n not in new}
        for name in new:
            raw = contents.get(paths.doorbell(self._topic, name[: -len(".json")]))
            self._addresses[name] = None if raw is None else DoorbellAddress.from_json(raw)

    def ring(self) -> int:
        """Send one datagram to each reachable listener; return how many were sent. Never
        raises for a listener that is gone or a store that cannot be listed (logged):
        a missed ring only delays the waiter to its next poll."""
        try:
            self._refresh()
        except OSError as exc:
            logger.debug("doorbell %s: listing listeners failed: %r", self._topic, exc)
        targets = [a for a in self._addresses.values() if a is not None and a.reachable_from(self._hostname)]
        if not targets:
            return 0
        sent = 0
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            sock.setblocking(False)
            for address in targets:
                try:
                    sock.sendto(_DATAGRAM, (address.host, address.port))
                    sent += 1
                except OSError as exc:
                    if exc.errno not in (errno.ECONNREFUSED, errno.EAGAIN, errno.ENETUNREACH, errno.EHOSTUNREACH):
                        logger.debug("doorbell %s: ringing %s failed: %r", self._topic, address, exc)
        return sent

