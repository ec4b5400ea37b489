"""The cgroup v2 caps of the code sandbox (``sandbox_cgroup.py``): the decision, its report, and
the cgroup writer, against a fake cgroupfs tree in tmp_path (files the tests write where the
kernel would). cgroup v1: test_sandbox_cgroup_v1.py. The real cgroupfs path:
tests/integration/reward/test_sandbox_cgroup.py.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
from pydantic import ValidationError

from asyncrl.configs.reward import CodeRewardConfig, SandboxLimits
from asyncrl.tasks.reward.pool import PoolStats
from asyncrl.tasks.reward.sandbox_cgroup import LEAF, SandboxCaps, decide_caps, release_into
from asyncrl.tasks.reward.sandbox_cgroup_fs import SANDBOXES, CgroupUnavailable, SandboxCgroup, sweep
from asyncrl.tasks.reward.sandbox_outcome import Capture, classify
from asyncrl.tasks.reward.server import format_stats
from asyncrl.tasks.reward.types import Reason

LIMITS = SandboxLimits(memory_mb=256, nproc=16, cpus=1.5)
ALL = "cpuset cpu io memory hugetlb pids rdma misc"


Tree = Callable[..., tuple[Path, Path, Path]]


@pytest.fixture
def tree(tmp_path: Path) -> Tree:
    """A fake cgroup v2 mount and /proc/self/cgroup: ``(root, proc_self_cgroup, own cgroup dir)``."""

    def make(own: str = "/system.slice/reward.service", controllers: str = ALL, procs: tuple[int, ...] | None = None,
             enabled: str = "", proc_line: str | None = None) -> tuple[Path, Path, Path]:  # fmt: skip
        procs = (os.getpid(),) if procs is None else procs  # this process: its own, to move
        root = tmp_path / "cgroup"
        directory = root / own.lstrip("/")
        directory.mkdir(parents=True)
        (root / "cgroup.controllers").write_text(f"{ALL}\n")
        (directory / "cgroup.controllers").write_text(f"{controllers}\n")
        (directory / "cgroup.subtree_control").write_text(f"{enabled}\n")
        (directory / "cgroup.procs").write_text("".join(f"{pid}\n" for pid in procs))
        if directory != root:
            (directory / "cgroup.type").write_text("domain\n")  # the root cgroup has none
        proc_cgroup = tmp_path / "proc-self-cgroup"
        proc_cgroup.write_text(proc_line if proc_line is not None else f"0::{own}\n")
        return root, proc_cgroup, directory

    return make


def config(**update: object) -> CodeRewardConfig:
    return CodeRewardConfig(limits=LIMITS).model_copy(update=update)


def test_neither_cgroup_version_falls_back_to_rlimits_and_says_why(tmp_path: Path) -> None:
    mountinfo = tmp_path / "mountinfo"
    mountinfo.write_text("31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755\n")
    caps = decide_caps(config(), sandboxed=True, root=tmp_path, proc_cgroup=tmp_path / "none", mountinfo=mountinfo)
    assert caps.parents == () and not caps.cgroup and caps.version is None
    assert caps.reason == (
        f"no cgroup v2 unified hierarchy at {tmp_path} ({tmp_path / 'cgroup.controllers'} missing), and cgroup v1: "
        f"no cgroup v1 hierarchy with the cpu, memory, pids controller(s) is mounted ({mountinfo})"
    )
    assert caps.describe(LIMITS) == f"caps: rlimit (per process; no cgroup: {caps.reason})"


def test_off_and_unsandboxed_keep_the_rlimits() -> None:
    assert decide_caps(config(cgroup="off"), sandboxed=True).reason == "turned off (reward.code.cgroup: off)"
    assert "unsandboxed" in decide_caps(config(), sandboxed=False).reason


def test_own_cgroup_moves_its_processes_to_a_leaf_and_gets_a_sandboxes_child(
    tree: Tree, removed: dict[str, dict[str, str]]
) -> None:
    child = subprocess.Popen(["sleep", "60"])
    try:
        root, proc_cgroup, own = tree(procs=(os.getpid(), child.pid))
        caps = decide_caps(config(), sandboxed=True, root=root, proc_cgroup=proc_cgroup)
    finally:
        child.kill()
        child.wait()
    assert caps == SandboxCaps.v2(own / SANDBOXES) and caps.version == 2, caps
    # cgroup v2 gives controllers only to the children of a cgroup without processes.
    assert (own / LEAF / "cgroup.procs").read_text() == f"{os.getpid()}\n{child.pid}\n"
    assert (own / "cgroup.subtree_control").read_text() == "+cpu +memory +pids"
    assert (own / SANDBOXES / "cgroup.subtree_control").read_text() == "+cpu +memory +pids"
    # The probe cgroup was made with the limits, then removed.
    (probe,) = removed.values()
    assert probe == {"memory.max": str(256 << 20), "pids.max": "16", "cpu.max": "150000 100000"}
    assert [p.name for p in (own / SANDBOXES).iterdir() if p.is_dir()] == []
    assert caps.describe(LIMITS) == (
        f"caps: cgroup v2 (memory.max=256 MiB, pids.max=16, cpu.max=150000 100000 = 1.5 CPU) per sandbox "
        f"under {own / SANDBOXES}; rlimits per process too"
    )


def test_the_root_cgroup_keeps_its_processes(tree: Tree, removed: dict[str, dict[str, str]]) -> None:
    root, proc_cgroup, own = tree(own="/")
    caps = decide_caps(config(), sandboxed=True, root=root, proc_cgroup=proc_cgroup)
    assert caps == SandboxCaps.v2(root / SANDBOXES)
    assert not (root / LEAF).exists()  # the root cgroup may hold processes and give controllers
    assert (root / "cgroup.subtree_control").read_text() == "+cpu +memory +pids"


def test_a_process_already_in_the_leaf_uses_the_prepared_parent(tree: Tree, removed: dict[str, dict[str, str]]) -> None:
    root, proc_cgroup, own = tree(own=f"/reward.service/{LEAF}")
    (own.parent / "cgroup.subtree_control").write_text("cpu memory pids\n")  # as the kernel shows it
    (own.parent / "cgroup.controllers").write_text(f"{ALL}\n")
    caps = decide_caps(config(), sandboxed=True, root=root, proc_cgroup=proc_cgroup)
    assert caps == SandboxCaps.v2(own.parent / SANDBOXES)
    assert not (own / LEAF).exists()  # no leaf in the leaf


@pytest.mark.parametrize(
    ("options", "reason"),
    [
        ({"controllers": "cpu io"}, "controller(s) memory, pids not available in"),
        ({"proc_line": "1:name=systemd:/\n"}, "no cgroup v2 entry (0::) in"),
    ],
)
def test_what_is_missing_is_the_reason(tree: Tree, options: dict[str, str], reason: str) -> None:
    root, proc_cgroup, _ = tree(**options)
    caps = decide_caps(config(), sandboxed=True, root=root, proc_cgroup=proc_cgroup)
    assert not caps.cgroup and reason in caps.reason, caps
    assert caps.describe(LIMITS).startswith("caps: rlimit (per process; no cgroup: ")


def test_a_configured_parent_is_used_as_it_is_or_refused_with_the_reason(
    tree: Tree, removed: dict[str, dict[str, str]]
) -> None:
    _, _, delegated = tree(own="/delegated", procs=())
    assert decide_caps(config(cgroup_parent=str(delegated)), sandboxed=True) == SandboxCaps.v2(delegated)
    assert not (delegated / LEAF).exists()
    _, _, busy = tree(own="/busy", procs=(os.getpid(),))
    caps = decide_caps(config(cgroup_parent=str(busy)), sandboxed=True)
    assert not caps.cgroup and "holds processes (1)" in caps.reason  # a named parent is used as it is
    caps = decide_caps(config(cgroup_parent=str(busy / "nowhere")), sandboxed=True)
    assert not caps.cgroup and "is not a cgroup v2 directory" in caps.reason
    with pytest.raises(ValidationError, match="must be an absolute path"):
        CodeRewardConfig(cgroup_parent="sys/fs/cgroup/x")


def test_processes_of_other_programs_are_never_moved(tree: Tree) -> None:
    # Run as root in a shared cgroup, the service finds processes that are not its own: pid 1
    # is no descendant of it, nor is this process's parent (what started the test run).
    child = subprocess.Popen(["sleep", "60"])
    try:
        root, proc_cgroup, own = tree(procs=(os.getpid(), child.pid, 1, os.getppid()))
        caps = decide_caps(config(), sandboxed=True, root=root, proc_cgroup=proc_cgroup)
    finally:
        child.kill()
        child.wait()
    assert not caps.cgroup
    strangers = f"holds 2 process(es) not of this service (pid {os.getpid()} and its descendants): 1, {os.getppid()};"
    assert f"{own} {strangers}" in caps.reason, caps.reason
    assert "reward.code.cgroup_parent" in caps.reason, caps.reason
    assert not (own / LEAF).exists()  # nothing moved, not even this process
    assert (own / "cgroup.subtree_control").read_text() == "\n"


def test_a_process_gone_meanwhile_is_no_stranger(tree: Tree, removed: dict[str, dict[str, str]]) -> None:
    gone = subprocess.Popen(["true"])
    gone.wait()
    root, proc_cgroup, own = tree(procs=(os.getpid(), gone.pid))
    assert decide_caps(config(), sandboxed=True, root=root, proc_cgroup=proc_cgroup).cgroup


def test_workers_get_the_decision_not_a_new_one() -> None:
    code = config()
    off = SandboxCaps(reason="why").for_workers(code)
    assert off.cgroup == "off" and off.require_cgroup is False
    handed = SandboxCaps.v2(Path("/sys/fs/cgroup/x/asyncrl-sandboxes")).for_workers(code)
    assert handed.cgroup == "auto" and handed.cgroup_parent == "/sys/fs/cgroup/x/asyncrl-sandboxes"
    assert handed.require_cgroup is True  # a worker that cannot use it refuses code, never runs it uncapped
    assert CodeRewardConfig.model_validate(handed.model_dump(mode="json")) == handed


def test_a_sandbox_cgroup_gets_its_limits_its_process_and_is_killed_then_removed(
    tmp_path: Path, removed: dict[str, dict[str, str]]
) -> None:
    parent = tmp_path / "sandboxes"
    parent.mkdir()
    cgroup = SandboxCaps.v2(parent).new_cgroup(LIMITS.model_copy(update={"cpus": 0.001}))
    (path,) = cgroup.paths
    assert path.parent == parent and path.name.startswith(f"sandbox-{os.getpid()}-")
    assert (path / "cpu.max").read_text() == "1000 100000"  # the kernel's smallest quota
    assert not (path / "memory.swap.max").exists()  # written only where the kernel has it
    cgroup.add(31337)
    assert (path / "cgroup.procs").read_text() == "31337"
    assert cgroup.oom_kills() == 0
    (path / "memory.events").write_text("low 0\nhigh 0\nmax 4\noom 2\noom_kill 2\noom_group_kill 0\n")
    assert cgroup.oom_kills() == 2
    (path / "cgroup.kill").write_text("0")
    assert cgroup.remove() is True
    assert removed[str(path)]["cgroup.kill"] == "1"  # everything left was killed at once
    assert removed[str(path)]["memory.max"] == str(256 << 20)
    assert not path.exists()
    assert cgroup.remove() is True  # already gone


def test_without_cgroup_kill_each_process_is_killed(tmp_path: Path) -> None:
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        (tmp_path / "cgroup.procs").write_text(f"{sleeper.pid}\n")
        SandboxCgroup(tmp_path).kill()
        assert sleeper.wait(timeout=10) == -9
    finally:
        sleeper.kill()
        sleeper.wait()


def test_a_cgroup_that_stays_busy_is_left_and_reported(
    tmp_path: Path, removed: dict[str, dict[str, str]], caplog: pytest.LogCaptureFixture
) -> None:
    busy = SandboxCaps.v2(tmp_path).new_cgroup(LIMITS)
    (busy.paths[0] / "child").mkdir()  # EBUSY for ever
    assert busy.remove(timeout_s=0.05) is False
    assert busy.paths[0].exists() and "not removed" in caplog.text


def test_sweep_removes_the_cgroups_of_dead_processes_only(tmp_path: Path, removed: dict[str, dict[str, str]]) -> None:
    gone = subprocess.Popen(["true"])
    gone.wait()
    for name in (f"sandbox-{gone.pid}-0", f"sandbox-{os.getpid()}-0", "unrelated"):
        (tmp_path / name).mkdir()
    sweep(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"sandbox-{os.getpid()}-0", "unrelated"]


def test_release_moves_the_named_child_then_unblocks_it(tmp_path: Path) -> None:
    cgroup = SandboxCgroup(tmp_path)
    status_r, status_w = os.pipe()
    block_r, block_w = os.pipe()
    try:
        os.write(status_w, b'{ "child-pid": 4321, "cgroup-namespace": 4026531835 }\n')
        assert release_into(cgroup, status_r, block_w, timeout_s=5) is True
        assert (tmp_path / "cgroup.procs").read_text() == "4321"
        assert os.read(block_r, 10) == b"1"
        os.write(status_w, b'{ "no-pid": 1 }\n')
        with pytest.raises(CgroupUnavailable, match="names no child-pid"):
            release_into(cgroup, status_r, block_w, timeout_s=5)
        os.close(status_w)
        status_w = -1
        assert release_into(cgroup, status_r, block_w, timeout_s=5) is False  # bwrap ended first
        os.set_blocking(block_r, False)
        with pytest.raises(BlockingIOError):
            os.read(block_r, 10)  # not released
    finally:
        for fd in (status_r, status_w, block_r, block_w):
            if fd >= 0:
                os.close(fd)


def test_an_oom_kill_in_the_cgroup_is_a_memory_failure() -> None:
    capture = Capture(bytearray(), bytearray(b"Killed"), bytearray(), exited=True)
    reason, detail = classify(-9, capture, 0.2, LIMITS, oom_killed=True)
    assert reason == Reason.MEMORY
    assert detail.startswith("memory limit of 256 MiB for the whole sandbox (its cgroup's memory limit)") and "SIGKILL" in detail
    assert classify(-9, capture, 0.2, LIMITS)[0] == Reason.CRASH  # without the cgroup's word: a crash


def test_the_stats_line_reports_the_caps() -> None:
    stats = PoolStats(1, 0, 0, 0, {}, {}, 0, 0, caps="caps: rlimit (per process; no cgroup: why)")
    assert format_stats(stats).endswith("; caps: rlimit (per process; no cgroup: why)")
    assert "caps" not in format_stats(PoolStats(1, 0, 0, 0, {}, {}, 0, 0))
