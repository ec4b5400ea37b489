"""Caps on a sandbox as a whole: a cgroup per sandbox (v2, else v1) capping memory, pids and CPU.

The rlimits (``sandbox_process.prlimit_argv``) cap each PROCESS of a sandbox: a program that
forks can hold ``nproc x memory_mb``. Where the machine allows it, every sandbox also gets a
cgroup of its own that caps all its processes together. Whether it does, and with which
cgroup version, is decided once per pool (``decide_caps``) and reported (``SandboxCaps.describe``).

cgroup v2 (memory.max, pids.max, cpu.max) is used when:

- the unified hierarchy is mounted at ``/sys/fs/cgroup`` (its ``cgroup.controllers`` exists);
- the cpu, memory and pids controllers are available in this process's cgroup (the ``0::``
  line of ``/proc/self/cgroup``): it runs as root, or its cgroup was delegated to it (systemd
  ``Delegate=yes``; ``reward.code.cgroup_parent`` names another delegated directory);
- it can enable them for a child: cgroup v2 gives controllers only to the children of a cgroup
  without processes, so the processes of this cgroup move to a leaf child (``LEAF``) first,
  as systemd's ``DelegateSubgroup=`` would; only when every one of them is this process or
  one of its descendants (no other program's process is moved); the sandboxes' cgroups go
  under ``SANDBOXES``;
- a child cgroup with the three limits can be created, written and removed (a probe).

Where the unified hierarchy is absent, cgroup v1 (``sandbox_cgroup_v1.py``) is used when its
memory, pids and cpu hierarchies are mounted and writable, and a probe works there. Otherwise
the rlimits alone cap, with the reason. A sandbox's cgroup (``SandboxCgroup``,
``sandbox_cgroup_fs.py``) is made before its bubblewrap starts; bwrap blocks (``--block-fd``)
until the process that will run the program, named on its JSON status channel, is moved into
it (``release_into``), so nothing of the program ever runs outside; at the end every process
left in it is killed and it is removed.
"""

from __future__ import annotations

import errno
import json
import os
import select
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from asyncrl.configs.reward import CodeRewardConfig, SandboxLimits
from asyncrl.tasks.reward import sandbox_cgroup_v1
from asyncrl.tasks.reward.sandbox_cgroup_fs import (
    CONTROLLERS,
    CPU_PERIOD_US,
    SANDBOXES,
    CgroupParent,
    CgroupUnavailable,
    LimitFile,
    SandboxCgroup,
    cfs_quota_us,
    procs,
    sweep,
    words,
    write,
)

CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_SELF_CGROUP = Path("/proc/self/cgroup")
LEAF = "asyncrl-leaf"
"""Child of the process's own cgroup that its processes move to, so that the cgroup may give
its children controllers (cgroup v2's no-internal-processes rule)."""
RELEASE_TIMEOUT_S = 30.0
"""How long a sandbox start waits for bubblewrap to name the process to move into the cgroup."""
FOREIGN_SHOWN = 5
"""Pids of other programs' processes named in the reason a cgroup v2 is refused."""


@dataclass(frozen=True)
class SandboxCaps:
    """The caps in force for every sandbox of a pool: a cgroup each under ``parents`` (cgroup
    ``version`` 2: one directory; 1: one per hierarchy), or (no parents) the per-process
    rlimits only, for ``reason``."""

    parents: tuple[CgroupParent, ...] = ()
    version: Literal[1, 2] | None = None
    reason: str = ""

    @classmethod
    def v2(cls, parent: Path) -> SandboxCaps:
        """A cgroup v2 per sandbox under ``parent`` (with all of CONTROLLERS)."""
        return cls((CgroupParent(str(parent), CONTROLLERS),), 2)

    @property
    def cgroup(self) -> bool:
        """True when each sandbox gets a cgroup (v1 or v2)."""
        return bool(self.parents)

    def describe(self, limits: SandboxLimits) -> str:
        """The one-line report: ``caps: cgroup v2 (...)``, ``caps: cgroup v1 (...)`` or
        ``caps: rlimit (...: reason)``."""
        under = ", ".join(p.path for p in self.parents)
        if self.version == 2:
            return (
                f"caps: cgroup v2 (memory.max={limits.memory_mb} MiB, pids.max={limits.nproc}, "
                f"cpu.max={cpu_max(limits)} = {limits.cpus:g} CPU) per sandbox under {under}; rlimits per process too"
            )
        if self.version == 1:
            return (
                f"caps: cgroup v1 (memory.limit_in_bytes={limits.memory_mb} MiB, pids.max={limits.nproc}, "
                f"cpu.cfs_quota_us={cfs_quota_us(limits)} per cpu.cfs_period_us={CPU_PERIOD_US} = {limits.cpus:g} CPU) "
                f"per sandbox under {under}; rlimits per process too"
            )
        return f"caps: rlimit (per process; no cgroup: {self.reason})"

    def refusal(self, code: CodeRewardConfig) -> str | None:
        """Why code may not be scored under these caps (``reward.code.require_cgroup`` and no
        cgroup), or None."""
        if code.require_cgroup and not self.cgroup:
            return f"reward.code.require_cgroup is true, but no cgroup can cap the code sandboxes: {self.reason}"
        return None

    def for_workers(self, code: CodeRewardConfig) -> CodeRewardConfig:
        """``code`` as a pool's workers get it: the decision made, so no worker makes another.
        An ``off`` for the rlimits; for a cgroup, ``require_cgroup`` (a worker that cannot use
        it refuses code rather than run it uncapped) and, on v2, the parent found. On v1 a
        worker finds the same parents again: it is in its pool's cgroups, which v1 never moves."""
        if not self.parents:
            return code.model_copy(update={"cgroup": "off"})
        update: dict[str, object] = {"require_cgroup": True}
        if self.version == 2:
            update["cgroup_parent"] = self.parents[0].path
        return code.model_copy(update=update)

    def new_cgroup(self, limits: SandboxLimits, prefix: str = "sandbox") -> SandboxCgroup:
        """A cgroup with ``limits`` for one sandbox (a directory under each parent);
        ``CgroupUnavailable`` when it cannot be made."""
        if not self.parents:
            raise CgroupUnavailable(f"no cgroup for the sandboxes: {self.reason}")
        layout = [(Path(p.path), self._limit_files(p.controllers, limits)) for p in self.parents]
        return SandboxCgroup.create(layout, prefix)

    def _limit_files(self, controllers: tuple[str, ...], limits: SandboxLimits) -> list[LimitFile]:
        if self.version == 1:
            return sandbox_cgroup_v1.limit_files(controllers, limits)
        return [
            LimitFile("memory.max", str(limits.memory_mb << 20)),
            LimitFile("memory.swap.max", "0", only_if_present=True),
            LimitFile("pids.max", str(limits.nproc)),
            LimitFile("cpu.max", cpu_max(limits)),
        ]


def decide_caps(
    code: CodeRewardConfig,
    sandboxed: bool,
    root: Path = CGROUP_ROOT,
    proc_cgroup: Path = PROC_SELF_CGROUP,
    mountinfo: Path = sandbox_cgroup_v1.PROC_SELF_MOUNTINFO,
) -> SandboxCaps:
    """The caps for sandboxes run with ``code`` from this process (see the module docstring):
    a cgroup per sandbox if possible, else the rlimits with the reason. ``root``,
    ``proc_cgroup`` and ``mountinfo`` are the cgroup v2 mount, ``/proc/self/cgroup`` and
    ``/proc/self/mountinfo`` (other paths in tests)."""
    if not sandboxed:
        return SandboxCaps(reason="no bubblewrap: the unsandboxed mode runs programs on the host with rlimits only")
    if code.cgroup == "off":
        return SandboxCaps(reason="turned off (reward.code.cgroup: off)")
    try:
        caps = find_parents(code, root, proc_cgroup, mountinfo)
        for parent in caps.parents:
            sweep(Path(parent.path))
        probe = caps.new_cgroup(code.limits, prefix="probe")
        if not probe.remove():
            raise CgroupUnavailable(f"a probe cgroup {probe} could not be removed")
    except CgroupUnavailable as exc:
        return SandboxCaps(reason=str(exc))
    return caps


def find_parents(code: CodeRewardConfig, root: Path, proc_cgroup: Path, mountinfo: Path) -> SandboxCaps:
    """The sandboxes' parent directories, prepared: ``code.cgroup_parent``; else on cgroup v2
    ``<own cgroup>/asyncrl-sandboxes``; else those of cgroup v1. ``CgroupUnavailable`` says why not."""
    if code.cgroup_parent is not None:
        parent = Path(code.cgroup_parent)
        enable_controllers(parent, move_processes=False)
        return SandboxCaps.v2(parent)
    if (root / "cgroup.controllers").is_file():
        return SandboxCaps.v2(prepare_own_cgroup(root, proc_cgroup))
    try:
        return SandboxCaps(sandbox_cgroup_v1.sandbox_parents(proc_cgroup, mountinfo), 1)
    except CgroupUnavailable as exc:
        raise CgroupUnavailable(
            f"no cgroup v2 unified hierarchy at {root} ({root / 'cgroup.controllers'} missing), and cgroup v1: {exc}"
        ) from None


# -- cgroup v2 ------------------------------------------------------------------------------


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
    if own.name == LEAF and not missing(words(own.parent / "cgroup.subtree_control")):
        own = own.parent  # started by a process that an earlier start moved to the leaf
    enable_controllers(own, move_processes=True)
    sandboxes = own / SANDBOXES
    try:
        sandboxes.mkdir(exist_ok=True)
        if missing(words(sandboxes / "cgroup.subtree_control")):
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
    ``move_processes`` they move to its child LEAF first, if all are this process or its
    descendants; else that is the reason given."""
    if not (directory / "cgroup.controllers").is_file():
        raise CgroupUnavailable(f"{directory} is not a cgroup v2 directory")
    available = words(directory / "cgroup.controllers")
    absent = missing(available)
    if absent:
        raise CgroupUnavailable(
            f"controller(s) {', '.join(absent)} not available in {directory} (cgroup.controllers: "
            f"{' '.join(available) or 'none'}): not root, and no cgroup delegated with them"
        )
    if not missing(words(directory / "cgroup.subtree_control")):
        return
    non_root = (directory / "cgroup.type").exists()  # the root cgroup has no cgroup.type
    for attempt in range(3):
        pids = procs(directory) if non_root else []
        if pids:
            if not move_processes:
                raise CgroupUnavailable(
                    f"{directory} holds processes ({len(pids)}), so cgroup v2 lets it give its children no controller"
                )
            strangers = foreign(pids)
            if strangers:
                shown = ", ".join(map(str, strangers[:FOREIGN_SHOWN])) + (", ..." if len(strangers) > FOREIGN_SHOWN else "")
                raise CgroupUnavailable(
                    f"{directory} holds {len(strangers)} process(es) not of this service (pid {os.getpid()} and its "
                    f"descendants): {shown}; they are not moved to {LEAF}, so cgroup v2 lets the cgroup give its "
                    "children no controller; name a cgroup delegated to the service in reward.code.cgroup_parent"
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


def foreign(pids: list[int], proc: Path = Path("/proc")) -> list[int]:
    """Those of ``pids`` that are neither this process nor one of its descendants (their chain
    of parents, ``/proc/<pid>/stat``, never reaches it). A process gone meanwhile is none."""
    me = os.getpid()
    strangers = []
    for pid in pids:
        chain, current = set(), pid
        while current != me:
            parent = _parent_of(current, proc)
            if parent is None and current == pid:
                break  # gone: nothing to move
            if parent is None or parent == 0 or current in chain:  # 0: above pid 1
                strangers.append(pid)
                break
            chain.add(current)
            current = parent
    return strangers


def _parent_of(pid: int, proc: Path) -> int | None:
    """The parent pid of ``pid`` (the field after the state in ``/proc/<pid>/stat``), None if gone."""
    try:
        stat = (proc / str(pid) / "stat").read_text()
        return int(stat.rpartition(")")[2].split()[1])
    except (OSError, ValueError, IndexError):
        return None


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


def cpu_max(limits: SandboxLimits) -> str:
    """``cpu.max`` for ``limits.cpus``: ``<quota> <period>`` in microseconds."""
    return f"{cfs_quota_us(limits)} {CPU_PERIOD_US}"


# -- both -----------------------------------------------------------------------------------


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
        raise CgroupUnavailable(f"cannot move the sandbox (pid {pid}) into {cgroup}: {exc.strerror}") from None
    try:
        os.write(block_w, b"1")
    except BrokenPipeError:
        return False  # bwrap died meanwhile
    return True
