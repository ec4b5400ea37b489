"""A cgroup per sandbox with real bubblewrap: bwrap blocks until its sandbox is in the cgroup
(against a fake cgroupfs parent, which any machine has), and the caps themselves (against the
real cgroup v2 hierarchy, skipped with the reason where this machine has none).
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

from asyncrl.configs.reward import CodeRewardConfig, SandboxLimits
from asyncrl.tasks.reward.sandbox import Sandbox
from asyncrl.tasks.reward.sandbox_cgroup import decide_caps
from asyncrl.tasks.reward.sandbox_session import SandboxSession
from asyncrl.tasks.reward.sandbox_outcome import RunOutcome, SandboxFile
from asyncrl.tasks.reward.types import Reason
from hostile_programs import SLEEPER_BOMB

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
    assert box.caps.parent == str(fake_parent), box.caps
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


# -- the real cgroup v2 hierarchy -------------------------------------------------------------


@pytest.fixture(scope="module")
def capped() -> Iterator[Sandbox]:
    """A sandbox capped by a real cgroup v2, or a skip saying why this machine has none."""
    require_bwrap()
    config = CodeRewardConfig(limits=LIMITS)
    caps = decide_caps(config, sandboxed=True)
    if caps.parent is None:
        pytest.skip(f"cgroup v2 not available: {caps.reason}")
    yield Sandbox(config.model_copy(update={"cgroup_parent": caps.parent}))


def test_a_forking_memory_hog_is_capped_as_a_whole(capped: Sandbox) -> None:
    # Four children of 100 MiB each: under RLIMIT_AS (192 MiB) one by one, over memory.max together.
    source = (
        "import os\n"
        "pids = []\n"
        "for _ in range(4):\n"
        "    pid = os.fork()\n"
        "    if pid == 0:\n"
        "        block = b'x' * (100 << 20)\n"
        "        import time; time.sleep(3)\n"
        "        os._exit(0)\n"
        "    pids.append(pid)\n"
        "print('killed', sum(os.WIFSIGNALED(os.waitpid(p, 0)[1]) for p in pids))\n"
    )
    outcome = capped.run([SandboxFile("main.py", source.encode())], "main.py")
    assert outcome.reason == Reason.OK, outcome
    assert int(outcome.stdout.split()[1]) >= 1, outcome.stdout  # the OOM killer of the cgroup struck
    assert capped.caps.parent is not None
    assert list(Path(capped.caps.parent).glob("sandbox-*")) == []


def test_a_fork_bomb_stops_at_pids_max(capped: Sandbox) -> None:
    outcome = capped.run([SandboxFile("main.py", SLEEPER_BOMB.encode())], "main.py")
    assert outcome.reason == Reason.OK, outcome
    assert 0 < int(outcome.stdout) < LIMITS.nproc


def test_an_oom_kill_fails_the_program_as_memory(capped: Sandbox) -> None:
    source = (
        "import os, time\n"
        "pids = []\n"
        "for _ in range(3):\n"
        "    pid = os.fork()\n"
        "    if pid == 0:\n"
        "        block = b'x' * (120 << 20)\n"
        "        time.sleep(3)\n"
        "        os._exit(0)\n"
        "    pids.append(pid)\n"
        "if any(os.WIFSIGNALED(os.waitpid(p, 0)[1]) for p in pids):\n"
        "    raise SystemExit(1)\n"
    )
    outcome = capped.run([SandboxFile("main.py", source.encode())], "main.py")
    assert outcome.reason == Reason.MEMORY and "cgroup memory.max" in outcome.detail, outcome
