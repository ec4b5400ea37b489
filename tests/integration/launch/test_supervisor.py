"""The run's one supervisor on real process groups (small Python programs): restarts with
backoff up to the budget, the failure past it names the component and carries its log,
a normal end is not a crash, a start that never gets ready counts as a crash, stop kills
the whole group, and the process-group file lets a hook kill what a dead flow left."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from asyncrl.tasks.system.process_group import group_alive, spawn_session
from asyncrl.tasks.launch.components import ProcessComponent, sigkill_group
from asyncrl.tasks.launch.rl import PROCESS_GROUPS_FILE, ProcessGroupFile, RunStop, kill_recorded_groups
from asyncrl.tasks.launch.supervisor import ComponentEvent, ComponentFailed, ComponentStatus, RestartPolicy, supervise

FAST = RestartPolicy(max_restarts=2, backoff_s=0.05, backoff_max_s=0.1, start_timeout_s=30.0, poll_s=0.05)


def program(tmp_path: Path, name: str, code: str) -> ProcessComponent:
    """A component running ``python -c code`` (a normal end is exit 0)."""
    log = tmp_path / f"{name}.log"
    return ProcessComponent(name, lambda: spawn_session([sys.executable, "-c", code], log), log, lambda c: c == 0)


def test_a_component_that_keeps_crashing_fails_after_its_restart_budget_with_its_log(tmp_path: Path) -> None:
    events: list[ComponentEvent] = []
    crasher = program(tmp_path, "trainer", "import sys; print('boom: out of memory', flush=True); sys.exit(3)")

    with pytest.raises(ComponentFailed) as failed:
        supervise(crasher, threading.Event(), FAST, events.append)

    error = failed.value
    assert error.component == "trainer" and error.restarts == 2
    assert "exited with status 3" in str(error) and "boom: out of memory" in str(error)
    kinds = [e.kind for e in events]
    assert kinds.count("started") == 3 and kinds.count("restarting") == 2 and kinds[-2:] == ["failed", "stopped"]
    assert [e.restarts for e in events if e.kind == "restarting"] == [1, 2]


def test_a_crash_is_restarted_and_the_component_then_finishes(tmp_path: Path) -> None:
    marker = tmp_path / "crashed-once"
    code = f"import os, sys; p = {str(marker)!r}\nif not os.path.exists(p):\n    open(p, 'w').close(); sys.exit(1)\n"
    status = ComponentStatus("trainer")

    outcome = supervise(program(tmp_path, "trainer", code), threading.Event(), FAST, status=status)

    assert outcome.end == "finished" and outcome.restarts == 1 and outcome.exit_code == 0
    assert status.restarts == 1 and status.state == "stopped"


def test_sigkill_of_a_running_component_restarts_it(tmp_path: Path) -> None:
    status = ComponentStatus("server")
    stop = threading.Event()
    component = program(tmp_path, "server", "import time; time.sleep(600)")
    component._is_finished = lambda code: False  # a server never ends on its own
    result: list[object] = []
    thread = threading.Thread(target=lambda: result.append(supervise(component, stop, FAST, status=status)))
    thread.start()
    try:
        wait_for(lambda: status.ready)
        first = status.pgid
        sigkill_group(first)
        wait_for(lambda: status.restarts == 1 and status.ready and status.pgid != first)
        assert not group_alive(first)
        second = status.pgid
    finally:
        stop.set()
        thread.join(30)
    assert result and result[0].end == "stopped" and result[0].restarts == 1  # type: ignore[attr-defined]
    assert not group_alive(second)  # stop killed the group


def test_not_ready_within_the_start_timeout_counts_as_a_crash(tmp_path: Path) -> None:
    component = program(tmp_path, "reward-service", "import time; time.sleep(600)")
    component._is_ready = lambda pgid: False  # never registers
    policy = RestartPolicy(max_restarts=0, start_timeout_s=0.5, poll_s=0.05)

    with pytest.raises(ComponentFailed, match="not ready within 0 s|not ready within 1 s"):
        supervise(component, threading.Event(), policy)
    assert component.process is not None and not group_alive(component.process.pid)


def test_backoff_doubles_up_to_its_cap() -> None:
    policy = RestartPolicy(backoff_s=1.0, backoff_max_s=5.0)
    assert [policy.backoff(r) for r in (1, 2, 3, 4)] == [1.0, 2.0, 4.0, 5.0]
    with pytest.raises(ValueError, match="max_restarts"):
        RestartPolicy(max_restarts=-1)


def test_recorded_process_groups_are_killed_by_the_hook(tmp_path: Path) -> None:
    """What a flow's on_cancellation / on_crashed hook does after the flow process died."""
    child = spawn_session([sys.executable, "-c", "import time; time.sleep(600)"], tmp_path / "c.log")
    groups = ProcessGroupFile(tmp_path / PROCESS_GROUPS_FILE)
    groups.update("trainer", child.pid)
    groups.update("gone", None)

    killed = kill_recorded_groups(tmp_path)

    assert killed == [child.pid]
    child.wait(10)
    assert not group_alive(child.pid)
    assert kill_recorded_groups(tmp_path) == []  # nothing left, nothing killed twice


def test_run_stop_keeps_the_first_reason() -> None:
    stop = RunStop()
    stop.request("failed: trainer")
    stop.request("finished")
    assert stop.cancelled and stop.reason == "failed: trainer"
    normal = RunStop()
    normal.request("finished")
    assert not normal.cancelled


def wait_for(condition: Callable[[], bool], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)
