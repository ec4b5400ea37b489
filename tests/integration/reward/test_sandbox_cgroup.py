"""A cgroup per sandbox with real bubblewrap: bwrap blocks until its sandbox is in the cgroup
(against a fake cgroupfs parent, which any machine has), and the caps themselves against the
machine's real cgroups: v2, else v1 (this repository's CI machine has v1 only); skipped, with
the reason, only where neither can cap a sandbox. The values a test cannot see from inside the
sandbox (pids.events, cpu.stat, the limits written) are read from the sandbox's cgroup on the
host while the program runs (``CgroupWatch``).
"""

from __future__ import annotations

import errno
import os
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from asyncrl.configs.reward import CodeRewardConfig, RewardConfig, SandboxLimits
from asyncrl.tasks.reward.code_reward import score_code
from asyncrl.tasks.reward.pool import RewardPool, RewardPoolError
from asyncrl.tasks.reward.sandbox import Sandbox
from asyncrl.tasks.reward.sandbox_cgroup import SandboxCaps, decide_caps
from asyncrl.tasks.reward.sandbox_cgroup_fs import SandboxCgroup
from asyncrl.tasks.reward.sandbox_session import SandboxSession
from asyncrl.tasks.reward.sandbox_outcome import RunOutcome, SandboxFile
from asyncrl.tasks.reward.types import CodeTests, Reason, RewardRequest, StdioCase
from hostile_programs import sleeper_bomb

LIMITS = SandboxLimits(cpu_s=2, wall_s=10.0, memory_mb=192, nproc=16)


def require_bwrap() -> None:
    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap (bwrap) is not installed: apt-get install bubblewrap")


@pytest.fixture
def fake_parent(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A delegated cgroup directory as cgroupfs shows it, whose child cgroups rmdir removes with
    their interface files (as the kernel does; a plain directory would be ENOTEMPTY)."""
    parent = tmp_path / "delegated"
    parent.mkdir()
    (parent / "cgroup.controllers").write_text("cpu memory pids\n")
    (parent / "cgroup.subtree_control").write_text("cpu memory pids\n")
    real_rmdir = os.rmdir

    def rmdir(path: str | os.PathLike[str], *args: object, **kwargs: object) -> None:
        directory = Path(path)
        if parent in directory.parents:
            if any(p.is_dir() for p in directory.iterdir()):
                raise OSError(errno.EBUSY, os.strerror(errno.EBUSY), str(directory))
            for f in directory.iterdir():
                f.unlink()
        real_rmdir(path, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "rmdir", rmdir)
    return parent


def watch_cgroup(parent: Path, seen: dict[str, object], stop: threading.Event) -> None:
    """Record the first sandbox cgroup's process: its pid namespace ids, uid and descendants."""
    while not stop.is_set():
        for cgroup in parent.glob("sandbox-*"):
            procs = cgroup / "cgroup.procs"
            if procs.exists() and procs.read_text().strip():
                pid = int(procs.read_text())
                status = dict(line.split(":\t", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
                time.sleep(0.3)  # the program starts meanwhile
                children = [" ".join(p.cmdline()) for p in psutil.Process(pid).children(recursive=True)]
                seen.update(nspid=status["NSpid"].split(), uid=int(status["Uid"].split()[0]), children=children,
                            limits={f: (cgroup / f).read_text() for f in ("memory.max", "pids.max", "cpu.max")})  # fmt: skip
                return
        time.sleep(0.005)


@pytest.mark.parametrize("sandbox_per", ["test", "program"])
def test_the_sandbox_runs_nothing_before_it_is_in_its_cgroup(fake_parent: Path, sandbox_per: str) -> None:
    require_bwrap()
    box = Sandbox(CodeRewardConfig(limits=LIMITS, cgroup_parent=str(fake_parent)))
    assert box.caps == SandboxCaps.v2(fake_parent), box.caps
    files = [SandboxFile("main.py", b"import time\ntime.sleep(1.0)\nprint('done')\n")]
    seen: dict[str, object] = {}
    stop = threading.Event()
    watcher = threading.Thread(target=watch_cgroup, args=(fake_parent, seen, stop))
    watcher.start()
    try:
        if sandbox_per == "test":
            outcome: RunOutcome = box.run(files, "main.py")
        else:
            with SandboxSession(box, files) as session:
                outcome = session.run("main.py")
    finally:
        stop.set()
        watcher.join()
    assert outcome.reason == Reason.OK and outcome.stdout == b"done\n", outcome
    # The process moved is the sandbox's pid 1 (bwrap's init, or the driver), as the sandbox user,
    # and the program runs below it: moved before it forked anything.
    nspid = seen["nspid"]
    assert isinstance(nspid, list) and nspid[-1] == "1" and len(nspid) >= 2, seen
    assert seen["uid"] == box.config.sandbox_uid
    assert any("/sandbox/main.py" in c for c in seen["children"]), seen  # type: ignore[union-attr]
    assert seen["limits"] == {"memory.max": str(192 << 20), "pids.max": "16", "cpu.max": "100000 100000"}
    assert list(fake_parent.glob("sandbox-*")) == []  # removed at the end


# -- the machine's real cgroups (v2, else v1) ------------------------------------------------

HOG = (
    "import os, time\n"
    "pids = []\n"
    "for _ in range({children}):\n"
    "    pid = os.fork()\n"
    "    if pid == 0:\n"
    "        block = b'x' * ({mib} << 20)\n"
    "        time.sleep(3)\n"
    "        os._exit(0)\n"
    "    pids.append(pid)\n"
    "killed = sum(os.WIFSIGNALED(os.waitpid(p, 0)[1]) for p in pids)\n"
    "print('killed', killed)\n"
    "raise SystemExit({fail_if_killed} and killed > 0)\n"
)
"""Forking children of ``mib`` MiB each: under RLIMIT_AS one by one, over the cgroup's memory
limit together; exits 1 when the OOM killer ended one and ``fail_if_killed``."""


@pytest.fixture(scope="module")
def capped() -> Iterator[Sandbox]:
    """A sandbox capped by a real cgroup (as a pool's worker gets it), or a skip saying why this
    machine has none."""
    require_bwrap()
    config = CodeRewardConfig(limits=LIMITS)
    caps = decide_caps(config, sandboxed=True)
    if not caps.cgroup:
        pytest.skip(f"no cgroup can cap the sandboxes here: {caps.reason}")
    box = Sandbox(caps.for_workers(config))
    assert box.caps == caps, (box.caps, caps)  # a worker finds the pool's decision again
    yield box
    for parent in caps.parents:
        assert list(Path(parent.path).glob(f"sandbox-{os.getpid()}-*")) == [], "a sandbox cgroup was left"


class CgroupWatch:
    """The last contents of ``files`` in the cgroups of this process's sandboxes, read every few
    ms while a run goes, in a with-block (a sandbox's cgroup is removed when its run ends)."""

    def __init__(self, caps: SandboxCaps, *files: str) -> None:
        self.parents = [Path(p.path) for p in caps.parents]
        self.files = files
        self.seen: dict[str, str] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll)

    def __enter__(self) -> CgroupWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _poll(self) -> None:
        while not self._stop.is_set():
            for parent in self.parents:
                for cgroup in parent.glob(f"sandbox-{os.getpid()}-*"):
                    for name in self.files:
                        try:
                            self.seen[name] = (cgroup / name).read_text()
                        except OSError:
                            continue  # not in this hierarchy, or removed meanwhile
            time.sleep(0.005)

    def counter(self, name: str, key: str) -> int:
        """The ``<key> <n>`` value last seen in file ``name`` (0 if never seen)."""
        for line in self.seen.get(name, "").splitlines():
            word, _, value = line.partition(" ")
            if word == key:
                return int(value)
        return 0


def test_the_report_names_the_cgroup_version_in_force(capped: Sandbox) -> None:
    report = capped.caps.describe(LIMITS)
    if capped.caps.version == 1:
        assert report.startswith("caps: cgroup v1 (memory.limit_in_bytes=192 MiB, pids.max=16, cpu.cfs_quota_us=100000 per "), report
    else:
        assert report.startswith("caps: cgroup v2 (memory.max=192 MiB, pids.max=16, cpu.max=100000 100000 = 1 CPU) "), report


def test_the_limits_are_written_into_the_sandbox_cgroup(capped: Sandbox) -> None:
    v1 = ("memory.limit_in_bytes", "memory.memsw.limit_in_bytes", "pids.max", "cpu.cfs_period_us", "cpu.cfs_quota_us")
    files = v1 if capped.caps.version == 1 else ("memory.max", "memory.swap.max", "pids.max", "cpu.max")
    with CgroupWatch(capped.caps, *files) as watch:
        outcome = capped.run([SandboxFile("main.py", b"import time\ntime.sleep(0.5)\n")], "main.py")
    assert outcome.reason == Reason.OK, outcome
    seen = {name: text.strip() for name, text in watch.seen.items()}
    memory = str(192 << 20)
    if capped.caps.version == 1:
        expected = {"memory.limit_in_bytes": memory, "memory.memsw.limit_in_bytes": memory, "pids.max": "16",
                    "cpu.cfs_period_us": "100000", "cpu.cfs_quota_us": "100000"}  # fmt: skip
    else:
        expected = {"memory.max": memory, "memory.swap.max": "0", "pids.max": "16", "cpu.max": "100000 100000"}
    for swap in ("memory.memsw.limit_in_bytes", "memory.swap.max"):
        if swap not in seen:
            expected.pop(swap, None)  # no swap accounting on this kernel
    assert seen == expected


def test_a_forking_memory_hog_is_capped_as_a_whole(capped: Sandbox) -> None:
    # Four children of 100 MiB each: under RLIMIT_AS (192 MiB) one by one, over the cgroup's limit together.
    source = HOG.format(children=4, mib=100, fail_if_killed=False)
    outcome = capped.run([SandboxFile("main.py", source.encode())], "main.py")
    assert outcome.reason == Reason.OK, outcome
    assert int(outcome.stdout.split()[1]) >= 1, outcome.stdout  # the OOM killer of the cgroup struck


@pytest.mark.parametrize("sandbox_per", ["test", "program"])
def test_an_oom_kill_fails_the_program_as_memory(capped: Sandbox, sandbox_per: str) -> None:
    files = [SandboxFile("main.py", HOG.format(children=3, mib=120, fail_if_killed=True).encode())]
    oom_file = "memory.oom_control" if capped.caps.version == 1 else "memory.events"
    with CgroupWatch(capped.caps, oom_file) as watch:
        if sandbox_per == "test":
            outcome = capped.run(files, "main.py")
        else:
            with SandboxSession(capped, files) as session:
                outcome = session.run("main.py")
    assert outcome.reason == Reason.MEMORY, outcome
    assert outcome.detail.startswith("memory limit of 192 MiB for the whole sandbox (its cgroup's memory limit)"), outcome.detail
    assert watch.counter(oom_file, "oom_kill") >= 1  # the kernel's own count, read on the host


def test_a_fork_bomb_stops_at_pids_max_not_at_rlimit_nproc(capped: Sandbox, monkeypatch: pytest.MonkeyPatch) -> None:
    # RLIMIT_NPROC 64 for the run, pids.max 8 for its cgroup: below 64 only the cgroup can stop it.
    limits = LIMITS.model_copy(update={"nproc": 64})

    def new_cgroup(run_limits: SandboxLimits) -> SandboxCgroup:
        return capped.caps.new_cgroup(run_limits.model_copy(update={"nproc": 8}))

    monkeypatch.setattr(capped, "new_cgroup", new_cgroup)
    with CgroupWatch(capped.caps, "pids.max", "pids.events") as watch:
        outcome = capped.run([SandboxFile("main.py", sleeper_bomb(linger_s=0.3).encode())], "main.py", limits=limits)
    assert outcome.reason == Reason.OK, outcome
    assert 0 < int(outcome.stdout) < 8, outcome.stdout  # the sandbox's init and the program count too
    assert watch.seen["pids.max"].strip() == "8"
    assert watch.counter("pids.events", "max") >= 1  # forks the cgroup refused


def test_cpu_time_is_capped_by_the_cfs_quota(capped: Sandbox) -> None:
    # One spinning process, 0.2 CPU: it gets about 20 ms of every 100 ms period, throttled the rest.
    limits = LIMITS.model_copy(update={"cpus": 0.2, "cpu_s": 10})
    source = (
        "import time\n"
        "start, cpu = time.monotonic(), time.process_time()\n"
        "while time.monotonic() - start < 1.5:\n"
        "    pass\n"
        "print((time.process_time() - cpu) / (time.monotonic() - start))\n"
    )
    with CgroupWatch(capped.caps, "cpu.stat") as watch:
        outcome = capped.run([SandboxFile("main.py", source.encode())], "main.py", limits=limits)
    assert outcome.reason == Reason.OK, outcome
    assert float(outcome.stdout) < 0.3, outcome.stdout  # unthrottled, a spinning process gets up to 1
    assert watch.counter("cpu.stat", "nr_throttled") >= 5  # periods in which the quota ran out


# -- reward.code.require_cgroup ---------------------------------------------------------------------


def test_require_cgroup_without_a_cgroup_refuses_the_pool_and_the_code() -> None:
    require_bwrap()
    config = RewardConfig.model_validate({"code": {"cgroup": "off", "require_cgroup": True}})
    refusal = "reward.code.require_cgroup is true, but no cgroup can cap the code sandboxes: turned off (reward.code.cgroup: off)"
    with pytest.raises(RewardPoolError, match="reward pool failed to start: ") as info:
        RewardPool(config, workers=1).start()
    assert str(info.value).endswith(refusal)
    box = Sandbox(config.code)
    outcome = box.run([SandboxFile("main.py", b"print(1)\n")], "main.py")
    assert (outcome.reason, outcome.detail) == (Reason.SANDBOX_UNAVAILABLE, refusal)
    result = score_code("```python\nprint(1)\n```", CodeTests(stdio=(StdioCase("", "1\n"),)), config.code, box)
    assert (result.reward, result.reason, result.detail) == (0.0, Reason.SANDBOX_UNAVAILABLE, refusal)


def test_a_pool_requiring_a_cgroup_starts_and_its_workers_use_it(capped: Sandbox) -> None:
    config = RewardConfig.model_validate(
        {"code": {"require_cgroup": True, "limits": LIMITS.model_dump()}, "pool": {"workers": 1, "preload_math": False}}
    )
    hog = HOG.format(children=3, mib=120, fail_if_killed=True)
    with RewardPool(config) as pool:
        assert pool.caps == capped.caps
        assert pool.caps_report.startswith(f"caps: cgroup v{capped.caps.version} (")
        (result,) = pool.score_sync([RewardRequest("code", f"```python\n{hog}```", CodeTests(stdio=(StdioCase("", ""),)))], 60)
    # The worker found the pool's cgroups again: the whole sandbox was capped, not each process.
    assert result.reason == Reason.MEMORY and "for the whole sandbox" in result.detail, result
