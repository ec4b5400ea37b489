"""Peak memory of a run's components, read from Linux's ``/proc`` while the run goes on.

A run records each live component's process group in ``process-groups.json``
(:class:`~asyncrl.tasks.launch.rl.ProcessGroupFile`); :class:`MemorySampler` reads that file
and every process of those groups (vLLM's engine core, the trainer's workers included) at a
fixed interval. A process's ``VmHWM`` is its own resident high-water mark, kept by the kernel,
so a component's largest process peak is exact up to the last interval of that process's
life; the sum of a group's ``VmRSS`` is only as good as the sampling, and counts pages that
forked processes share once per process.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Self

PROC = Path("/proc")
KIB = 1024
CLEAR_REFS_HWM = "5"
"""Written to ``/proc/<pid>/clear_refs``: reset the resident high-water mark to ``VmRSS`` (Linux 4.0+)."""


@dataclass(frozen=True)
class ProcessMemory:
    """One reading of one process (bytes)."""

    pid: int
    name: str
    """``/proc/<pid>/comm``: the executable's (or thread group's) short name."""
    rss_bytes: int
    """``VmRSS`` now."""
    hwm_bytes: int
    """``VmHWM``: the most it has been resident since it started."""


@dataclass
class ComponentPeak:
    """A component's peaks over a run (bytes)."""

    process_peak_bytes: int = 0
    """max over its processes of ``VmHWM`` (the largest process's own peak)."""
    process: str = ""
    """``name[pid]`` of that process."""
    group_peak_bytes: int = 0
    """max over samples of the sum of its processes' ``VmRSS`` (sampled; shared pages counted
    once per process)."""
    processes: int = 0
    """Distinct processes seen in its group."""


def read_process_memory(pid: int, proc: Path = PROC) -> ProcessMemory | None:
    """``VmRSS`` and ``VmHWM`` of ``pid`` from ``/proc/<pid>/status`` (kB there, bytes here);
    None once it is gone, or for a process without memory of its own (a zombie, a kernel thread)."""
    try:
        status = (proc / str(pid) / "status").read_text()
        name = (proc / str(pid) / "comm").read_text().strip()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    if "VmRSS" not in fields or "VmHWM" not in fields:
        return None
    kib = {key: int(fields[key].split()[0]) for key in ("VmRSS", "VmHWM")}
    return ProcessMemory(pid, name, kib["VmRSS"] * KIB, kib["VmHWM"] * KIB)


def own_memory(proc: Path = PROC) -> ProcessMemory:
    """:func:`read_process_memory` of this process; ``RuntimeError`` where ``/proc`` cannot say."""
    memory = read_process_memory(os.getpid(), proc)
    if memory is None:
        raise RuntimeError(f"{proc}/{os.getpid()}/status is not readable (Linux only)")
    return memory


def reset_own_peak(proc: Path = PROC) -> bool:
    """Reset this process's ``VmHWM`` to its ``VmRSS`` (so the next reading's peak is the
    peak since now); False where the kernel does not allow it."""
    try:
        (proc / str(os.getpid()) / "clear_refs").write_text(CLEAR_REFS_HWM)
    except OSError:
        return False
    return True


def process_group_of(pid: int, proc: Path = PROC) -> int | None:
    """The process group of ``pid``: field 5 of ``/proc/<pid>/stat`` (after the parenthesised
    command name, which may itself hold spaces or parentheses); None once it is gone."""
    try:
        stat = (proc / str(pid) / "stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    fields = stat.rsplit(")", 1)[-1].split()
    return int(fields[2]) if len(fields) > 2 else None


def group_members(pgids: set[int], proc: Path = PROC) -> Iterator[tuple[int, int]]:
    """(pgid, pid) of every live process in one of ``pgids`` (one pass over ``/proc``)."""
    for entry in proc.iterdir():
        if entry.name.isdigit():
            pgid = process_group_of(int(entry.name), proc)
            if pgid in pgids:
                yield pgid, int(entry.name)


def read_group_file(path: Path) -> dict[str, int]:
    """Component name -> process group id from a run's ``process-groups.json``; empty before
    the run wrote it (or while a write is being replaced)."""
    try:
        groups = json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}
    return {str(name): int(pgid) for name, pgid in groups.items() if isinstance(pgid, int) and pgid > 0}


class MemorySampler:
    """Samples the components named in ``groups_file`` every ``interval_s`` on a daemon
    thread while used as a context manager; :meth:`peaks` has the result. A component
    restarted under a new process group keeps one entry: the peaks of all its groups."""

    def __init__(self, groups_file: Path, interval_s: float = 0.5, proc: Path = PROC) -> None:
        if not interval_s > 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s!r}")
        self.groups_file = groups_file
        self.interval_s = interval_s
        self.proc = proc
        self.samples = 0
        self._peaks: dict[str, ComponentPeak] = {}
        self._seen: dict[str, set[int]] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def sample(self) -> None:
        """One reading of every process of every recorded component."""
        groups = read_group_file(self.groups_file)
        by_pgid: dict[int, list[ProcessMemory]] = {pgid: [] for pgid in groups.values()}
        for pgid, pid in group_members(set(by_pgid), self.proc):
            reading = read_process_memory(pid, self.proc)
            if reading is not None:
                by_pgid[pgid].append(reading)
        for name, pgid in groups.items():
            readings = by_pgid[pgid]
            if not readings:
                continue
            peak = self._peaks.setdefault(name, ComponentPeak())
            seen = self._seen.setdefault(name, set())
            seen.update(r.pid for r in readings)
            peak.processes = len(seen)
            peak.group_peak_bytes = max(peak.group_peak_bytes, sum(r.rss_bytes for r in readings))
            top = max(readings, key=lambda r: r.hwm_bytes)
            if top.hwm_bytes > peak.process_peak_bytes:
                peak.process_peak_bytes, peak.process = top.hwm_bytes, f"{top.name}[{top.pid}]"
        self.samples += 1

    def peaks(self) -> dict[str, dict[str, Any]]:
        """Component name -> :class:`ComponentPeak` as a dict, in name order."""
        return {name: asdict(peak) for name, peak in sorted(self._peaks.items())}

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def __enter__(self) -> Self:
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name="asyncrl-memory-sampler", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.sample()  # a last look: the components still alive


def component_peak(peaks: Mapping[str, Mapping[str, Any]], prefix: str) -> int | None:
    """The largest ``process_peak_bytes`` of the components whose name starts with ``prefix``
    (``rollout-server`` covers every server); None if none was sampled."""
    values = [int(p["process_peak_bytes"]) for name, p in peaks.items() if name.startswith(prefix)]
    return max(values) if values else None
