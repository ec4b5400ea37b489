"""The cgroup v1 caps of the code sandbox (``sandbox_cgroup_v1.py``) and ``reward.code.require_cgroup``,
against a fake hybrid layout in tmp_path: v1 hierarchies as plain directories, their
``/proc/self/mountinfo`` and ``/proc/self/cgroup``, an empty cgroup v2 mount beside them. The
real hierarchies: tests/integration/reward/test_sandbox_cgroup.py.
"""

from __future__ import annotations

import functools
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from asyncrl.configs.reward import CodeRewardConfig, RewardConfig, SandboxLimits
from asyncrl.tasks.reward import pool as pool_module
from asyncrl.tasks.reward.pool import RewardPool, RewardPoolError
from asyncrl.tasks.reward.sandbox_cgroup import LEAF, SandboxCaps, decide_caps
from asyncrl.tasks.reward.sandbox_cgroup_fs import SANDBOXES, CgroupParent, CgroupUnavailable, LimitFile, SandboxCgroup
from asyncrl.tasks.reward.sandbox_cgroup_v1 import hierarchies, limit_files, own_paths, sandbox_parents

LIMITS = SandboxLimits(memory_mb=256, nproc=16, cpus=1.5)
MEMORY_PATH = "/process_api/a1c8"
"""This process's memory cgroup in the fake layout; its cpu and pids cgroups are the roots."""


@dataclass(frozen=True)
class Layout:
    """A fake hybrid cgroup layout: ``root`` (no cgroup v2 there), the hierarchies' mount
    points under it, and the two /proc files that describe them."""

    root: Path
    mountinfo: Path
    proc_cgroup: Path

    def decide(self, **update: object) -> SandboxCaps:
        code = CodeRewardConfig(limits=LIMITS).model_copy(update=update)
        return decide_caps(code, sandboxed=True, root=self.root, proc_cgroup=self.proc_cgroup, mountinfo=self.mountinfo)

    def own(self, hierarchy: str) -> Path:
        """This process's cgroup directory in ``hierarchy`` (a mount point's name)."""
        return self.root / hierarchy / (MEMORY_PATH.lstrip("/") if hierarchy == "memory" else "")


def make_layout(tmp_path: Path, mounts: dict[str, str] | None = None, memory_root: str = "/",
                memory_options: str = "rw,nosuid,nodev,noexec,relatime") -> Layout:  # fmt: skip
    """Mount points ``<tmp>/cgroup/<name>`` for ``mounts`` (name -> super options), as
    this host has them: cpu and cpuacct apart, memory, pids, a named systemd one, cgroup2."""
    root = tmp_path / "cgroup"
    mounts = mounts if mounts is not None else {"cpu": "rw,cpu", "cpuacct": "rw,cpuacct", "memory": "rw,memory",
                                                "pids": "rw,pids", "systemd": "rw,xattr,name=systemd"}  # fmt: skip
    lines = [f"31 23 0:28 / {root} rw,nosuid,nodev,noexec - tmpfs tmpfs rw,mode=755"]
    for n, (name, options) in enumerate(mounts.items()):
        (root / name).mkdir(parents=True)
        mount_root, mount_options = (memory_root, memory_options) if name == "memory" else ("/", "rw,relatime")
        lines.append(f"{40 + n} 31 0:{30 + n} {mount_root} {root / name} {mount_options} shared:{n} - cgroup cgroup {options}")
    (root / "unified").mkdir(parents=True)
    lines.append(f"60 31 0:50 / {root / 'unified'} rw,relatime - cgroup2 cgroup2 rw,nsdelegate")
    mountinfo = tmp_path / "mountinfo"
    mountinfo.write_text("\n".join(lines) + "\n")
    proc_cgroup = tmp_path / "proc-self-cgroup"
    proc_cgroup.write_text(f"9:name=systemd:/\n8:pids:/\n4:memory:{MEMORY_PATH}\n2:cpuacct:/\n1:cpu:/\n0::/\n")
    layout = Layout(root, mountinfo, proc_cgroup)
    for name in mounts:
        layout.own(name).mkdir(parents=True, exist_ok=True)
        (layout.own(name) / "cgroup.procs").write_text(f"{os.getpid()}\n1\n")  # another program's process too
    return layout


def test_mountinfo_and_proc_cgroup_are_read_as_the_kernel_writes_them(tmp_path: Path) -> None:
    mountinfo = tmp_path / "mountinfo"
    mountinfo.write_text(
        "32 31 0:29 / /sys/fs/cgroup/cpu,cpuacct rw,nosuid - cgroup cgroup rw,cpu,cpuacct\n"
        "35 31 0:32 /docker/abc /mnt/my\\040cgroups ro,relatime shared:7 master:3 - cgroup cgroup rw,memory\n"
        "41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw\n"
        "26 1 8:1 / / rw,relatime - ext4 /dev/sda1 rw\n"
    )
    (cpu, memory) = hierarchies(mountinfo)
    assert cpu.mount == Path("/sys/fs/cgroup/cpu,cpuacct") and cpu.controllers == ("cpu", "cpuacct")
    assert cpu.root == "/" and cpu.writable
    assert memory.mount == Path("/mnt/my cgroups") and memory.root == "/docker/abc" and not memory.writable
    proc_cgroup = tmp_path / "cgroup"
    proc_cgroup.write_text("12:cpu,cpuacct:/a\n4:memory:/docker/abc/b\n1:name=systemd:/\n0::/\n")
    assert own_paths(proc_cgroup) == {"cpu": "/a", "cpuacct": "/a", "memory": "/docker/abc/b", "name=systemd": "/"}


def test_each_hierarchy_gets_a_sandboxes_directory_under_the_own_cgroup_and_nothing_moves(
    tmp_path: Path, removed: dict[str, dict[str, str]]
) -> None:
    layout = make_layout(tmp_path)
    caps = layout.decide()
    assert caps.version == 1 and caps.cgroup and caps.reason == ""
    assert caps.parents == (
        CgroupParent(str(layout.root / "cpu" / SANDBOXES), ("cpu",)),
        CgroupParent(str(layout.root / "memory" / MEMORY_PATH.lstrip("/") / SANDBOXES), ("memory",)),
        CgroupParent(str(layout.root / "pids" / SANDBOXES), ("pids",)),
    )
    # cgroup v1 may give limits below a cgroup with processes: no leaf, no process moved
    # (another program's, pid 1, stays where it is).
    for name in ("cpu", "memory", "pids"):
        assert (layout.own(name) / "cgroup.procs").read_text() == f"{os.getpid()}\n1\n"
        assert not (layout.own(name) / LEAF).exists()
    # The probe cgroup, one directory per hierarchy, had its limits and was removed.
    probes = {Path(path).relative_to(layout.root).parts[0]: files for path, files in removed.items()}
    assert probes == {
        "cpu": {"cpu.cfs_period_us": "100000", "cpu.cfs_quota_us": "150000"},
        "memory": {"memory.limit_in_bytes": str(256 << 20)},  # memsw only where swap is accounted
        "pids": {"pids.max": "16"},
    }
    assert all(not list(Path(p.path).iterdir()) for p in caps.parents)
    assert caps.describe(LIMITS) == (
        "caps: cgroup v1 (memory.limit_in_bytes=256 MiB, pids.max=16, cpu.cfs_quota_us=150000 per "
        f"cpu.cfs_period_us=100000 = 1.5 CPU) per sandbox under {', '.join(p.path for p in caps.parents)}; "
        "rlimits per process too"
    )


def test_limits_are_written_in_the_order_the_kernel_needs() -> None:
    # memsw may not be below limit_in_bytes (written first); the quota goes with the period set.
    assert limit_files(("cpu", "memory", "pids"), LIMITS.model_copy(update={"cpus": 0.001})) == [
        LimitFile("memory.limit_in_bytes", str(256 << 20)),
        LimitFile("memory.memsw.limit_in_bytes", str(256 << 20), only_if_present=True),
        LimitFile("pids.max", "16"),
        LimitFile("cpu.cfs_period_us", "100000"),
        LimitFile("cpu.cfs_quota_us", "1000"),  # the kernel's smallest quota
    ]
    assert limit_files(("pids",), LIMITS) == [LimitFile("pids.max", "16")]


def test_a_hierarchy_combining_controllers_gets_one_directory(tmp_path: Path, removed: dict[str, dict[str, str]]) -> None:
    layout = make_layout(tmp_path, mounts={"cpu,cpuacct": "rw,cpu,cpuacct", "memory,pids": "rw,memory,pids"})
    layout.proc_cgroup.write_text("3:memory,pids:/\n2:cpu,cpuacct:/\n")
    caps = layout.decide()
    assert [(Path(p.path).relative_to(layout.root).parts[0], p.controllers) for p in caps.parents] == [
        ("cpu,cpuacct", ("cpu",)),
        ("memory,pids", ("memory", "pids")),
    ]
    (memory_pids,) = [files for path, files in removed.items() if "memory,pids" in path]
    assert memory_pids == {"memory.limit_in_bytes": str(256 << 20), "pids.max": "16"}


def test_a_mount_of_a_subtree_is_followed(tmp_path: Path, removed: dict[str, dict[str, str]]) -> None:
    # In a container the memory hierarchy may be mounted from /process_api: the own cgroup
    # /process_api/a1c8 is then at <mount>/a1c8.
    layout = make_layout(tmp_path, memory_root="/process_api")
    (layout.root / "memory" / "a1c8").mkdir()
    caps = layout.decide()
    assert caps.parents[1].path == str(layout.root / "memory" / "a1c8" / SANDBOXES)


@pytest.mark.parametrize(
    ("options", "reason"),
    [
        ({"mounts": {"cpu": "rw,cpu", "memory": "rw,memory"}}, "no cgroup v1 hierarchy with the pids controller(s) is mounted"),
        ({"memory_options": "ro,relatime"}, "the cgroup v1 memory hierarchy at {root}/memory is mounted read-only"),
        ({"memory_root": "/elsewhere"}, "this process's memory cgroup /process_api/a1c8 is outside the one mounted at"),
    ],
)
def test_what_v1_lacks_is_the_reason(tmp_path: Path, options: dict[str, object], reason: str) -> None:
    layout = make_layout(tmp_path, **options)  # type: ignore[arg-type]
    caps = layout.decide()
    assert not caps.cgroup and caps.version is None
    assert caps.reason.startswith(f"no cgroup v2 unified hierarchy at {layout.root} (")
    assert f"and cgroup v1: {reason.format(root=layout.root)}" in caps.reason, caps.reason


def test_no_line_for_a_controller_is_the_reason(tmp_path: Path) -> None:
    layout = make_layout(tmp_path)
    layout.proc_cgroup.write_text("1:cpu:/\n0::/\n")
    with pytest.raises(CgroupUnavailable, match="no memory line in"):
        sandbox_parents(layout.proc_cgroup, layout.mountinfo)


def test_workers_find_the_v1_parents_again_and_must_use_them() -> None:
    caps = SandboxCaps((CgroupParent("/sys/fs/cgroup/pids/asyncrl-sandboxes", ("pids",)),), 1)
    handed = caps.for_workers(CodeRewardConfig())
    # No parent to hand over (one per hierarchy): a worker finds them again in its own cgroups,
    # which are its pool's; require_cgroup makes one that cannot refuse code instead of running it uncapped.
    assert (handed.cgroup, handed.cgroup_parent, handed.require_cgroup) == ("auto", None, True)


def test_a_v1_sandbox_cgroup_takes_its_process_everywhere_counts_oom_kills_and_kills_all(
    tmp_path: Path, removed: dict[str, dict[str, str]]
) -> None:
    layout = make_layout(tmp_path)
    caps = layout.decide()
    cgroup = caps.new_cgroup(LIMITS)
    assert len(cgroup.paths) == 3 and len({p.name for p in cgroup.paths}) == 1
    cgroup.add(31337)
    assert [(p / "cgroup.procs").read_text() for p in cgroup.paths] == ["31337"] * 3
    memory = cgroup.paths[1]
    (memory / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 3\n")
    assert cgroup.oom_kills() == 3
    # No cgroup.kill in v1: every process listed in any hierarchy gets SIGKILL.
    sleepers = [subprocess.Popen(["sleep", "60"]) for _ in range(2)]
    try:
        (cgroup.paths[0] / "cgroup.procs").write_text(f"{sleepers[0].pid}\n")
        (cgroup.paths[2] / "cgroup.procs").write_text(f"{sleepers[1].pid}\n")
        assert cgroup.remove() is True
        assert [s.wait(timeout=10) for s in sleepers] == [-9, -9]
    finally:
        for s in sleepers:
            s.kill()
            s.wait()
    assert not any(p.exists() for p in cgroup.paths)


def test_stale_v1_cgroups_of_dead_processes_are_swept_in_every_hierarchy(
    tmp_path: Path, removed: dict[str, dict[str, str]]
) -> None:
    layout = make_layout(tmp_path)
    parents = [Path(p.path) for p in layout.decide().parents]
    gone = subprocess.Popen(["true"])
    gone.wait()
    for parent in parents:
        for name in (f"sandbox-{gone.pid}-3", f"sandbox-{os.getpid()}-99"):
            (parent / name).mkdir()
    layout.decide()
    assert [sorted(p.name for p in parent.iterdir()) for parent in parents] == [[f"sandbox-{os.getpid()}-99"]] * 3


def test_a_cgroup_made_halfway_is_removed_again(tmp_path: Path, removed: dict[str, dict[str, str]]) -> None:
    good, bad = tmp_path / "good", tmp_path / "missing"
    good.mkdir()
    with pytest.raises(CgroupUnavailable, match="cannot create the sandbox cgroup"):
        SandboxCgroup.create([(good, [LimitFile("pids.max", "16")]), (bad, [])])
    assert list(good.iterdir()) == []


# -- reward.code.require_cgroup ------------------------------------------------------------------


def test_require_cgroup_refuses_without_one_naming_the_field_and_the_reason(
    tmp_path: Path, removed: dict[str, dict[str, str]]
) -> None:
    layout = make_layout(tmp_path, mounts={"cpu": "rw,cpu", "memory": "rw,memory"})
    code = CodeRewardConfig(limits=LIMITS, require_cgroup=True)
    caps = layout.decide(require_cgroup=True)
    assert caps.refusal(code) == (
        f"reward.code.require_cgroup is true, but no cgroup can cap the code sandboxes: {caps.reason}"
    )
    assert "no cgroup v1 hierarchy with the pids controller(s) is mounted" in caps.reason
    assert caps.refusal(code.model_copy(update={"require_cgroup": False})) is None
    assert make_layout(tmp_path / "full").decide().refusal(code) is None


def test_a_pool_requiring_a_cgroup_does_not_start_without_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    layout = make_layout(tmp_path, mounts={"cpu": "rw,cpu", "memory": "rw,memory"})
    fake = functools.partial(decide_caps, root=layout.root, proc_cgroup=layout.proc_cgroup, mountinfo=layout.mountinfo)
    monkeypatch.setattr(pool_module, "decide_caps", fake)
    monkeypatch.setattr(pool_module.shutil, "which", lambda name: f"/usr/bin/{name}")  # bwrap "installed"
    pool = RewardPool(RewardConfig.model_validate({"code": {"require_cgroup": True}}), workers=1)
    with pytest.raises(RewardPoolError, match="reward pool failed to start: reward.code.require_cgroup is true, but no cgroup") as info:
        pool.start()
    assert "pids controller(s) is mounted" in str(info.value)
    assert pool.worker_pids() == [] and not pool.healthy  # no worker was started
