"""A count that survives a SIGKILL of the process keeping it.

Each change rewrites the count in place: one ``pwrite`` of 8 bytes into the page cache, no
fsync. A killed process's writes stay in the page cache, so a reader after the kill sees
every increment up to the instant of the kill; only a crash of the machine itself may lose
the last ones. Each process keeps its own file (``<prefix>-<pid>-<start ns>.count``, one
little-endian unsigned 64-bit integer), so restarts never share one and a reader sums them.
"""

from __future__ import annotations

import os
import struct
import time
from pathlib import Path

SUFFIX = ".count"
_FORMAT = struct.Struct("<Q")


class DurableCount:
    """A running total in its own file (module docstring); :meth:`add` is one ``pwrite``."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.total = 0
        self._fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        os.pwrite(self._fd, _FORMAT.pack(0), 0)

    @classmethod
    def new(cls, directory: Path, prefix: str) -> DurableCount:
        """A count of this process in ``directory``, under a name no other process has."""
        return cls(directory / f"{prefix}-{os.getpid()}-{time.time_ns()}{SUFFIX}")

    def add(self, n: int) -> None:
        if n < 0:
            raise ValueError(f"{self.path}: a durable count only grows, got {n}")
        self.total += n
        os.pwrite(self._fd, _FORMAT.pack(self.total), 0)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def read_counts(directory: Path, prefix: str) -> dict[str, int]:
    """Every count of ``prefix`` in ``directory`` by file name ({} when there is none); a file
    that is not one count raises ``ValueError`` naming it."""
    counts: dict[str, int] = {}
    for path in sorted(directory.glob(f"{prefix}-*{SUFFIX}")) if directory.is_dir() else ():
        data = path.read_bytes()
        if len(data) != _FORMAT.size:
            raise ValueError(f"{path}: holds {len(data)} bytes, not one count of {_FORMAT.size}")
        counts[path.name] = _FORMAT.unpack(data)[0]
    return counts
