"""Where the sandboxes' cgroups go on cgroup v1, and the limits each carries there.

Used where the cgroup v2 unified hierarchy is not mounted at ``/sys/fs/cgroup`` (cgroup v1, or
the hybrid layout with an empty v2 mount beside the v1 ones). cgroup v1 has one hierarchy per
controller, or per few combined (``cpu,cpuacct``), each mounted on its own (``/proc/self/mountinfo``:
file system type ``cgroup``, the controllers among its super options), and a process has a
path in each (``<id>:<controllers>:<path>`` lines of ``/proc/self/cgroup``). Every sandbox gets
one directory in each hierarchy of the memory, pids and cpu controllers, under
``<mount>/<own path>/asyncrl-sandboxes``, with:

- memory: ``memory.limit_in_bytes`` = ``limits.memory_mb``, then
  ``memory.memsw.limit_in_bytes`` the same where swap is accounted (memory + swap: no escape
  to swap; it may not be below ``limit_in_bytes``, hence the order);
- pids: ``pids.max`` = ``limits.nproc``;
- cpu: ``cpu.cfs_period_us`` = 100000, then ``cpu.cfs_quota_us`` = ``limits.cpus`` of it.

cgroup v1 has no rule against processes in a cgroup with children, so nothing is moved: the
service's own cgroups keep their processes (its own and any other's).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from asyncrl.configs.reward import SandboxLimits
from asyncrl.tasks.reward.sandbox_cgroup_fs import (
    CONTROLLERS,
    CPU_PERIOD_US,
    SANDBOXES,
    CgroupParent,
    CgroupUnavailable,
    LimitFile,
    cfs_quota_us,
)

PROC_SELF_MOUNTINFO = Path("/proc/self/mountinfo")
_OCTAL_ESCAPE = re.compile(r"\\([0-7]{3})")


@dataclass(frozen=True)
class Hierarchy:
    """One mounted cgroup v1 hierarchy."""

    mount: Path
    root: str
    """The cgroup path shown at ``mount`` (mountinfo's root field; ``/`` but in some containers)."""
    controllers: tuple[str, ...]
    """Its super options but ``rw``/``ro``: the controllers (``cpu``, ``cpuacct``), ``name=...``."""
    writable: bool


def hierarchies(mountinfo: Path = PROC_SELF_MOUNTINFO) -> list[Hierarchy]:
    """The cgroup v1 hierarchies mounted, from ``mountinfo`` (the format of proc(5))."""
    try:
        lines = mountinfo.read_text().splitlines()
    except OSError as exc:
        raise CgroupUnavailable(f"cannot read {mountinfo}: {exc.strerror}") from None
    found = []
    for line in lines:
        fields = line.split()
        if "-" not in fields:
            continue
        dash = fields.index("-")
        if len(fields) < dash + 4 or fields[dash + 1] != "cgroup" or dash < 6:
            continue
        found.append(
            Hierarchy(
                mount=Path(_unescape(fields[4])),
                root=_unescape(fields[3]),
                controllers=tuple(o for o in fields[dash + 3].split(",") if o not in ("rw", "ro")),
                writable="rw" in fields[5].split(","),
            )
        )
    return found


def own_paths(proc_cgroup: Path) -> dict[str, str]:
    """This process's cgroup v1 path by controller, from ``/proc/self/cgroup``'s
    ``<id>:<controllers>:<path>`` lines (the v2 ``0::`` line and named hierarchies have none)."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError as exc:
        raise CgroupUnavailable(f"cannot read {proc_cgroup}: {exc.strerror}") from None
    paths = {}
    for line in lines:
        _, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        for controller in controllers.split(","):
            if controller:
                paths[controller] = path.strip() or "/"
    return paths


def sandbox_parents(proc_cgroup: Path, mountinfo: Path = PROC_SELF_MOUNTINFO) -> tuple[CgroupParent, ...]:
    """``<mount>/<own path>/asyncrl-sandboxes`` in each hierarchy of CONTROLLERS, made if
    needed: the directories under which every sandbox gets its cgroup (module docstring).
    ``CgroupUnavailable`` names what is missing: a controller not mounted, a read-only mount,
    a path outside the mount, a directory that cannot be made."""
    mounted = hierarchies(mountinfo)
    absent = [c for c in CONTROLLERS if not any(c in h.controllers for h in mounted)]
    if absent:
        raise CgroupUnavailable(f"no cgroup v1 hierarchy with the {', '.join(absent)} controller(s) is mounted ({mountinfo})")
    own = own_paths(proc_cgroup)
    parents: list[CgroupParent] = []
    for controller in CONTROLLERS:
        if any(controller in p.controllers for p in parents):
            continue  # a hierarchy combining it with one done already
        candidates = [h for h in mounted if controller in h.controllers]
        hierarchy = next((h for h in candidates if h.writable), candidates[0])
        if not hierarchy.writable:
            raise CgroupUnavailable(f"the cgroup v1 {controller} hierarchy at {hierarchy.mount} is mounted read-only")
        if controller not in own:
            raise CgroupUnavailable(f"no {controller} line in {proc_cgroup}")
        relative = _below(own[controller], hierarchy.root)
        if relative is None:
            raise CgroupUnavailable(
                f"this process's {controller} cgroup {own[controller]} is outside the one mounted at "
                f"{hierarchy.mount} ({hierarchy.root})"
            )
        directory = hierarchy.mount / relative / SANDBOXES
        try:
            directory.mkdir(exist_ok=True)
        except OSError as exc:
            raise CgroupUnavailable(f"cannot create {directory}: {exc.strerror}") from None
        parents.append(CgroupParent(str(directory), tuple(c for c in CONTROLLERS if c in hierarchy.controllers)))
    return tuple(parents)


def limit_files(controllers: tuple[str, ...], limits: SandboxLimits) -> list[LimitFile]:
    """The v1 limit files of a sandbox's cgroup in a hierarchy of ``controllers``, in the order
    they are written (module docstring)."""
    files = []
    if "memory" in controllers:
        memory = str(limits.memory_mb << 20)
        files += [LimitFile("memory.limit_in_bytes", memory), LimitFile("memory.memsw.limit_in_bytes", memory, True)]
    if "pids" in controllers:
        files.append(LimitFile("pids.max", str(limits.nproc)))
    if "cpu" in controllers:
        files += [LimitFile("cpu.cfs_period_us", str(CPU_PERIOD_US)), LimitFile("cpu.cfs_quota_us", str(cfs_quota_us(limits)))]
    return files


def _below(path: str, root: str) -> str | None:
    """``path`` relative to ``root`` (both cgroup paths), or None when it is not under it."""
    path, root = path.rstrip("/") or "/", root.rstrip("/") or "/"
    if root == "/":
        return path.lstrip("/")
    if path == root:
        return ""
    if path.startswith(root + "/"):
        return path[len(root) + 1 :]
    return None


def _unescape(field: str) -> str:
    """A mountinfo path with its octal escapes (``\\040`` for a space) decoded."""
    return _OCTAL_ESCAPE.sub(lambda m: chr(int(m.group(1), 8)), field)
