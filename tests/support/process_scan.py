"""Find the processes of a run by an environment variable they inherited, whatever
session or process group they started, and check that they are gone (Linux /proc).

Plain functions, no pytest. A process is identified by pid and start time, so a reused
pid is never mistaken for it.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ProcessRecord:
    """One process, identified by pid and start time (a reused pid is another process)."""

    pid: int
    start_ticks: int
    cmdline: str


def _read_stat(pid: int) -> tuple[str, int, int] | None:
    """(state, parent pid, start time in clock ticks) of ``pid``, None if it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return fields[0], int(fields[1]), int(fields[19])


def process_record(pid: int) -> ProcessRecord | None:
    """A record of live (not zombie) process ``pid``, None if it is gone."""
    stat = _read_stat(pid)
    if stat is None or stat[0] in ("Z", "X"):
        return None
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return ProcessRecord(pid=pid, start_ticks=stat[2], cmdline=cmdline)


def _pids() -> list[int]:
    return [int(entry.name) for entry in Path("/proc").iterdir() if entry.name.isdigit()]


def initial_environ(pid: int) -> list[bytes]:
    """The ``NAME=value`` entries process ``pid`` was started with (``/proc/<pid>/environ``)."""
    return [entry for entry in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0") if entry]


def processes_with_env(name: str, value: str) -> list[ProcessRecord]:
    """Live processes whose initial environment holds ``name=value``, and all their
    descendants (a process that rewrote its title may have overwritten its environment)."""
    needle = f"{name}={value}".encode()
    marked: set[int] = set()
    parents: dict[int, int] = {}
    for pid in _pids():
        stat = _read_stat(pid)
        if stat is None:
            continue
        parents[pid] = stat[1]
        try:
            if needle in initial_environ(pid):
                marked.add(pid)
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
    found = set(marked)
    while True:
        children = {pid for pid, parent in parents.items() if parent in found} - found
        if not children:
            break
        found |= children
    found.discard(os.getpid())
    return [record for pid in sorted(found) if (record := process_record(pid)) is not None]


def still_alive(records: list[ProcessRecord]) -> list[ProcessRecord]:
    """The processes of ``records`` that still run (same pid and start time, not a zombie)."""
    alive = []
    for record in records:
        now = process_record(record.pid)
        if now is not None and now.start_ticks == record.start_ticks:
            alive.append(record)
    return alive


def wait_gone(records: list[ProcessRecord], timeout_s: float) -> list[ProcessRecord]:
    """Wait up to ``timeout_s`` for every process of ``records`` to end; return those left."""
    deadline = time.monotonic() + timeout_s
    while (left := still_alive(records)) and time.monotonic() < deadline:
        time.sleep(0.5)
    return left


def kill_processes(records: list[ProcessRecord]) -> None:
    """SIGKILL every process of ``records`` that still runs (teardown of a failed test)."""
    for record in still_alive(records):
        try:
            os.kill(record.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    wait_gone(records, timeout_s=10.0)


def ancestors(pid: int) -> list[int]:
    """The parent, grandparent, ... of live process ``pid`` up to pid 1 (empty if it is gone)."""
    chain: list[int] = []
    stat = _read_stat(pid)
    while stat is not None and stat[1] > 1 and stat[1] not in chain:
        chain.append(stat[1])
        stat = _read_stat(stat[1])
    return chain
