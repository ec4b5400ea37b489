"""Caps on a sandbox as a whole: one cgroup v2 per sandbox with memory.max, pids.max and cpu.max.

The rlimits (``sandbox_process.prlimit_argv``) cap each PROCESS of a sandbox: a program that
forks can hold ``nproc x memory_mb``. Where the machine allows it, every sandbox also gets a
cgroup of its own that caps all its processes together. Whether it does is decided once per
pool (``decide_caps``) and reported (``SandboxCaps.describe``):

- the cgroup v2 unified hierarchy is mounted at ``/sys/fs/cgroup`` (its ``cgroup.controllers``
  exists: not cgroup v1, not the hybrid layout);
- the cpu, memory and pids controllers are available in this process's cgroup (the ``0::``
  line of ``/proc/self/cgroup``): it runs as root, or its cgroup was delegated to it (systemd
  ``Delegate=yes``; ``reward.code.cgroup_parent`` names another delegated directory);
- it can enable them for a child: cgroup v2 gives controllers only to the children of a cgroup
  without processes, so the processes of this cgroup move to a leaf child (``LEAF``) first,
  as systemd's ``DelegateSubgroup=`` would; the sandboxes' cgroups go under ``SANDBOXES``;
- a child cgroup with the three limits can be created, written and removed (a probe).

Otherwise the rlimits alone cap, with the reason. A sandbox's cgroup (``SandboxCgroup``) is
made before its bubblewrap starts; bwrap blocks (``--block-fd``) until the process that will
run the program, named on its JSON status channel, is moved into it (``release_into``), so
nothing of the program ever runs outside; at the end every process left in it is killed
(``cgroup.kill``, else SIGKILL to each of ``cgroup.procs``) and it is removed.
"""

from __future__ import annotations

import errno
import itertools
import json
import logging
import os
import select
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from asyncrl.configs.reward import CodeRewardConfig, SandboxLimits

CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_SELF_CGROUP = Path("/proc/self/cgroup")
CONTROLLERS = ("cpu", "memory", "pids")
"""The controllers a sandbox's cgroup needs (cpu.max, memory.max, pids.max)."""
LEAF = "asyncrl-leaf"
"""Child of the process's own cgroup that its processes move to, so that the cgroup may give
its children controllers (cgroup v2's no-internal-processes rule)."""
SANDBOXES = "asyncrl-sandboxes"
"""Child of the process's own cgroup holding one cgroup per sandbox."""
CPU_PERIOD_US = 100_000
RELEASE_TIMEOUT_S = 30.0
"""How long a sandbox start waits for bubblewrap to name the process to move into the cgroup."""
REMOVE_TIMEOUT_S = 5.0
_names = itertools.count()
logger = logging.getLogger("asyncrl.reward.sandbox")


class CgroupUnavailable(Exception):
    """cgroup v2 cannot cap the sandboxes here; the message says why (shown in the caps report)."""


@dataclass(frozen=True)
class SandboxCaps:
    """The caps in force for every sandbox of a pool: a cgroup each under ``parent``, or (parent
    None) the per-process rlimits only, for ``reason``."""

    parent: str | None
    reason: str = ""

    @property
    def cgroup(self) -> bool:
        return self.parent is not None

    def describe(self, limits: SandboxLimits) -> str:
        """The one-line report: ``caps: cgroup v2 (...)`` or ``caps: rlimit (...: reason)``."""
        if self.parent is not None:
            return (
                f"caps: cgroup v2 (memory.max={limits.memory_mb} MiB, pids.max={limits.nproc}, "
                f"cpu.max={cpu_max(limits)} = {limits.cpus:g} CPU) per sandbox under {self.parent}; rlimits per process too"
            )
        return f"caps: rlimit (per process; cgroup v2 not available: {self.reason})"

    def for_workers(self, code: CodeRewardConfig) -> CodeRewardConfig:
        """``code`` as a pool's workers get it: the decision made, so no worker makes another
        (an ``off`` for the rlimits; the parent found for a cgroup)."""
        if self.parent is None:
            return code.model_copy(update={"cgroup": "off"})
        return code.model_copy(update={"cgroup_parent": self.parent})


def decide_caps(
    code: CodeRewardConfig, sandboxed: bool, root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_SELF_CGROUP
) -> SandboxCaps:
    """The caps for sandboxes run with ``code`` from this process (see the module docstring):
    a cgroup per sandbox if possible, else the rlimits with the reason. ``root`` and
    ``proc_cgroup`` are the cgroup v2 mount and ``/proc/self/cgroup`` (other paths in tests)."""
    if not sandboxed:
        return SandboxCaps(None, "no bubblewrap: the unsandboxed mode runs programs on the host with rlimits only")
    if code.cgroup == "off":
        return SandboxCaps(None, "turned off (reward.code.cgroup: off)")
    try:
        if code.cgroup_parent is not None:
            parent = Path(code.cgroup_parent)
            enable_controllers(parent, move_processes=False)
        else:
            parent = prepare_own_cgroup(root, proc_cgroup)
        sweep(parent)
        probe = SandboxCgroup.create(parent, code.limits, prefix="probe")
        if not probe.remove():
            raise CgroupUnavailable(f"a probe cgroup {probe.path} could not be removed")
    except CgroupUnavailable as exc:
        return SandboxCaps(None, str(exc))
    return SandboxCaps(str(parent))


def own_cgroup(proc_cgroup: Path = PROC_SELF_CGROUP) -> str:
    """This process's cgroup v2 path (``/...``) from the ``0::`` line of ``/proc/self/cgroup``."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError as exc:
        raise CgroupUnavailable(f"cannot read {proc_cgroup}: {exc.strerror}") from None
    for line in lines:
        if line.startswith("0::"):
            return line[3:].strip() or "/"
    raise CgroupUnavailable(f"no cgroup v2 entry (0::) in {proc_cgroup}")


def prepare_own_cgroup(root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_SELF_CGROUP) -> Path:
    """``<own cgroup>/asyncrl-sandboxes``, with the three controllers enabled for its children:
    the directory under which sandboxes get their cgroups. ``CgroupUnavailable`` says why not."""
    if not (root / "cgroup.controllers").is_file():
        raise CgroupUnavailable(
            f"no cgroup v2 unified hierarchy at {root} ({root / 'cgroup.controllers'} missing: cgroup v1 or hybrid)"
        )
    own = root / own_cgroup(proc_cgroup).lstrip("/")
    if own.name == LEAF and not missing(_words(own.parent / "cgroup.subtree_control")):
        own = own.parent  # started by a process that an earlier start moved to the leaf
    enable_controllers(own, move_processes=True)
    sandboxes = own / SANDBOXES
    try:
        sandboxes.mkdir(exist_ok=True)
        if missing(_words(sandboxes / "cgroup.subtree_control")):
            write(sandboxes / "cgroup.subtree_control", " ".join(f"+{c}" for c in CONTROLLERS))
    except OSError as exc:
        raise CgroupUnavailable(f"cannot create {sandboxes} with {', '.join(CONTROLLERS)} for its children: {exc.strerror}") from None
    return sandboxes


def missing(enabled: list[str]) -> list[str]:
    """Those of CONTROLLERS not in ``enabled``."""
    return [c for c in CONTROLLERS if c not in enabled]


def enable_controllers(directory: Path, move_processes: bool) -> None:
    """Enable CONTROLLERS in ``directory``'s ``cgroup.subtree_control`` (so its children get
    cpu.max, memory.max, pids.max). A non-root cgroup holding processes cannot: with
    ``move_processes`` they move to its child LEAF first, else that is the reason given."""
    if not (directory / "cgroup.controllers").is_file():
        raise CgroupUnavailable(f"{directory} is not a cgroup v2 directory")
    available = _words(directory / "cgroup.controllers")
    absent = missing(available)
    if absent:
        raise CgroupUnavailable(
            f"controller(s) {', '.join(absent)} not available in {directory} (cgroup.controllers: "
            f"{' '.join(available) or 'none'}): not root, and no cgroup delegated with them"
        )
    if not missing(_words(directory / "cgroup.subtree_control")):
        return
    non_root = (directory / "cgroup.type").exists()  # the root cgroup has no cgroup.type
    for attempt in range(3):
        pids = _pids(directory) if non_root else []
        if pids:
            if not move_processes:
                raise CgroupUnavailable(
                    f"{directory} holds processes ({len(pids)}), so cgroup v2 lets it give its children no controller"
                )
            _move(pids, directory / LEAF)
        try:
            write(directory / "cgroup.subtree_control", " ".join(f"+{c}" for c in CONTROLLERS))
            return
        except OSError as exc:
            if exc.errno == errno.EBUSY and move_processes and attempt < 2:
                continue  # a process started meanwhile: move it too
            raise CgroupUnavailable(
                f"cannot enable {', '.join(CONTROLLERS)} in {directory / 'cgroup.subtree_control'}: {exc.strerror}"
            ) from None


def _move(pids: list[int], leaf: Path) -> None:
    """Move ``pids`` into the cgroup ``leaf`` (made if needed), one write per pid."""
    try:
        leaf.mkdir(exist_ok=True)
        fd = os.open(leaf / "cgroup.procs", os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        raise CgroupUnavailable(f"cannot move this cgroup's processes into {leaf}: {exc.strerror}") from None
    try:
        for pid in pids:
            try:
                os.write(fd, f"{pid}\n".encode())
            except ProcessLookupError:
                continue  # exited meanwhile
            except OSError as exc:
                raise CgroupUnavailable(f"cannot move process {pid} into {leaf}: {exc.strerror}") from None
    finally:
        os.close(fd)


def sweep(parent: Path) -> None:
    """Remove the cgroups of sandboxes whose process is gone (a worker killed mid-run)."""
    try:
        children = [p for p in parent.iterdir() if p.is_dir()]
    except OSError:
        return
    for child in children:
        prefix, _, rest = child.name.partition("-")
        pid = rest.partition("-")[0]
        if prefix in ("sandbox", "probe") and pid.isdigit() and not _alive(int(pid)):
            SandboxCgroup(child).remove()


class SandboxCgroup:
    """The cgroup of one sandbox: made with its limits, given the sandbox's first process, read
    for OOM kills, emptied and removed at the end."""

    def __init__(self, path: Path) -> None:
        self.path = path

    @classmethod
    def create(cls, parent: Path, limits: SandboxLimits, prefix: str = "sandbox") -> SandboxCgroup:
        """``parent/<prefix>-<pid>-<n>`` with memory.max, memory.swap.max (0, where there is
        swap accounting), pids.max and cpu.max from ``limits``; ``CgroupUnavailable`` if not."""
        path = parent / f"{prefix}-{os.getpid()}-{next(_names)}"
        try:
            path.mkdir()
        except OSError as exc:
            raise CgroupUnavailable(f"cannot create the sandbox cgroup {path}: {exc.strerror}") from None
        cgroup = cls(path)
        try:
            write(path / "memory.max", str(limits.memory_mb << 20))
            if (path / "memory.swap.max").exists():
                write(path / "memory.swap.max", "0")
            write(path / "pids.max", str(limits.nproc))
            write(path / "cpu.max", cpu_max(limits))
        except OSError as exc:
            cgroup.remove()
            raise CgroupUnavailable(f"cannot set the limits of {path}: {exc.filename}: {exc.strerror}") from None
        return cgroup

    def add(self, pid: int) -> None:
        """Move process ``pid`` into this cgroup (its children to come are born in it)."""
        write(self.path / "cgroup.procs", str(pid))

    def oom_kills(self) -> int:
        """Processes of this cgroup the OOM killer ended so far (memory.events ``oom_kill``)."""
        try:
            for line in (self.path / "memory.events").read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
        except (OSError, ValueError):
            pass
        return 0

    def kill(self) -> None:
        """SIGKILL every process in the cgroup: ``cgroup.kill`` (Linux 5.14+), else each of ``cgroup.procs``."""
        if (self.path / "cgroup.kill").exists():
            try:
                write(self.path / "cgroup.kill", "1")
                return
            except OSError:
                pass  # fall back to the processes one by one
        for pid in _pids(self.path):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass  # already gone

    def remove(self, timeout_s: float = REMOVE_TIMEOUT_S) -> bool:
        """Kill what is left and remove the cgroup (retried while its processes die); False,
        logged, if it is still there after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            self.kill()
            try:
                os.rmdir(self.path)
                return True
            except FileNotFoundError:
                return True
            except OSError as exc:
                if time.monotonic() > deadline:
                    logger.warning("sandbox cgroup %s not removed: %s", self.path, exc.strerror)
                    return False
            time.sleep(0.01)


def release_into(cgroup: SandboxCgroup, status_r: int, block_w: int, timeout_s: float = RELEASE_TIMEOUT_S) -> bool:
    """Move bubblewrap's sandbox process into ``cgroup``, then let it go on: bwrap names it (its
    host pid, ``child-pid``) in the first line of ``--json-status-fd`` and waits on
    ``--block-fd`` before it runs anything of the program. False when bwrap ended or said
    nothing within ``timeout_s`` (it failed to start: its own error tells why);
    ``CgroupUnavailable`` when the move failed. Either way the caller must kill bwrap before
    closing ``block_w``: a closed block fd releases it too."""
    data = bytearray()
    deadline = time.monotonic() + timeout_s
    while b"\n" not in data:
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        ready, _, _ = select.select([status_r], [], [], left)
        if ready:
            chunk = os.read(status_r, 4096)
            if not chunk:
                return False
            data += chunk
    try:
        pid = int(json.loads(data.split(b"\n", 1)[0])["child-pid"])
    except (ValueError, KeyError, TypeError) as exc:
        raise CgroupUnavailable(f"bubblewrap's first status line names no child-pid: {bytes(data[:200])!r} ({exc})") from None
    try:
        cgroup.add(pid)
    except OSError as exc:
        raise CgroupUnavailable(f"cannot move the sandbox (pid {pid}) into {cgroup.path}: {exc.strerror}") from None
    try:
        os.write(block_w, b"1")
    except BrokenPipeError:
        return False  # bwrap died meanwhile
    return True


def cpu_max(limits: SandboxLimits) -> str:
    """``cpu.max`` for ``limits.cpus``: ``<quota> <period>`` in microseconds."""
    return f"{max(1000, round(limits.cpus * CPU_PERIOD_US))} {CPU_PERIOD_US}"


def write(path: Path, text: str) -> None:
    """One write of ``text`` to a cgroup interface file (created in a plain directory, as in tests)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def _words(path: Path) -> list[str]:
    try:
        return path.read_text().split()
    except OSError:
        return []


def _pids(directory: Path) -> list[int]:
    return [int(word) for word in _words(directory / "cgroup.procs") if word.isdigit()]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
