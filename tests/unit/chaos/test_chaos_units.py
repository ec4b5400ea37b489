"""The pieces of the chaos run that need no process: the kill plan, the scheduler process's
stop conditions (final step published, a server registering again), its argument checks,
and the report table (fast)."""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path

import pytest
from run_root_builder import RunRootBuilder

from asyncrl.chaos.run import KINDS, ChaosReport, ChaosSettings, KillRecord, kill_plan, kill_steps_range
from asyncrl.cli.chaos import format_report
from asyncrl.tasks.scheduler.main import EXIT_CONFIG, ServerSource, main, wait_for_servers
from asyncrl.storage.weights import final_step_published
from asyncrl.chaos.audit import audit_run
from asyncrl.storage.fs import open_root
from asyncrl.tasks.inference.server_registry import register_server
from asyncrl.tasks.inference.server import RolloutServerHandle


@pytest.fixture
def build(tmp_path: Path) -> RunRootBuilder:
    return RunRootBuilder(open_root(str(tmp_path / "store")), tmp_path)


def test_kill_plan_has_k_of_each_kind_in_a_seeded_order() -> None:
    plan = kill_plan(random.Random(3), 2, 48)
    assert sorted(k.kind for k in plan) == ["reward", "reward", "rollout", "rollout", "scheduler", "scheduler",
                                           "trainer", "trainer"]  # fmt: skip
    assert plan == kill_plan(random.Random(3), 2, 48)  # deterministic for a seed: kinds and steps
    assert {tuple(kill_plan(random.Random(seed), 2, 48)) for seed in range(10)} != {tuple(plan)}
    assert kill_plan(random.Random(0), 0, 48) == []
    with pytest.raises(ValueError, match="kills_per_component must be an int >= 0"):
        kill_plan(random.Random(0), -1, 48)
    with pytest.raises(ValueError, match="max_steps must be an int >= 1"):
        kill_plan(random.Random(0), 1, 0)


@pytest.mark.parametrize("kills, max_steps", [(1, 32), (2, 48), (3, 48), (1, 8), (2, 3), (3, 5), (5, 200)])
def test_kill_steps_are_spread_over_the_run_and_distinct_per_kind(kills: int, max_steps: int) -> None:
    first, last = kill_steps_range(max_steps)
    assert 1 <= first <= last < max(max_steps, 2)  # every kill is armed before the last step
    for seed in range(20):
        plan = kill_plan(random.Random(seed), kills, max_steps)
        steps = [k.step for k in plan]
        assert len(plan) == kills * len(KINDS) and steps == sorted(steps)
        assert all(first <= step <= last for step in steps)
        for kind in KINDS:  # each kind's kills at distinct steps
            of_kind = [k.step for k in plan if k.kind == kind]
            assert len(of_kind) == kills and len(set(of_kind)) == kills, plan
        n, span = len(plan), last - first + 1
        if n <= span:  # one kill per slot of the range: all distinct, spread from start to end
            assert len(set(steps)) == n
            slots = [first + (i * span) // n for i in range(n + 1)]
            assert all(slots[i] <= step < slots[i + 1] for i, step in enumerate(steps)), (plan, slots)


def test_kill_steps_cover_the_run_not_its_start() -> None:
    plan = kill_plan(random.Random(1), 2, 48)
    assert plan[0].step <= 48 // 8 and plan[-1].step > 48 // 2  # first slot early, last slot in the later half
    assert kill_steps_range(48) == (1, 38) and kill_steps_range(2) == (1, 1) and kill_steps_range(1) == (1, 1)
    with pytest.raises(ValueError, match="need as many distinct steps"):
        kill_plan(random.Random(0), 2, 2)  # one step to arm at, two kills of each kind


def test_chaos_settings_are_checked_by_name() -> None:
    with pytest.raises(ValueError, match="ChaosSettings.timeout_s must be > 0"):
        ChaosSettings(timeout_s=0)
    with pytest.raises(ValueError, match="ChaosSettings.max_delay_s must be >= 0"):
        ChaosSettings(max_delay_s=-1)
    assert ChaosSettings(max_delay_s=0).max_delay_s == 0


def test_final_step_published_reads_the_lineage_of_the_latest_version(build: RunRootBuilder) -> None:
    assert not final_step_published(build.root, 2)  # nothing published
    build.publish(0, 0, None, [])
    build.publish(1, 1, 0, [])
    assert not final_step_published(build.root, 2)
    build.publish(2, 2, 1, [])
    assert final_step_published(build.root, 2)
    build.publish(3, 1, 2, [])  # a trainer resumed before step 2 redoes step 1: not finished
    assert not final_step_published(build.root, 2)


def test_a_server_registering_again_changes_the_snapshot(build: RunRootBuilder) -> None:
    source = ServerSource(build.root, api_key="k")
    assert source.snapshot() == ()
    register_server(build.root, "server-0", RolloutServerHandle("http://127.0.0.1:9", 100, 100, Path("log"), "m"))
    before = source.snapshot()
    assert before == (("server-0", "http://127.0.0.1:9", 100),)
    handle = source.handles()[0]
    assert (handle.url, handle.model, handle.headers()) == ("http://127.0.0.1:9", "m", {"Authorization": "Bearer k"})
    register_server(build.root, "server-0", RolloutServerHandle("http://127.0.0.1:9", 200, 200, Path("log"), "m"))
    assert source.snapshot() != before  # same address, new process: a new cycle takes it back


def test_fixed_urls_need_no_registry(build: RunRootBuilder) -> None:
    source = ServerSource(build.root, api_key=None, urls=("http://a:1/",))
    assert [h.url for h in source.handles()] == ["http://a:1"] and source.snapshot() == (("http://a:1/", "http://a:1/", 0),)


def test_scheduler_process_refuses_a_bad_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nrollout: {eta: -1}\n")
    assert main(["--config", str(bad)]) == EXIT_CONFIG
    assert "scheduler: config error" in capsys.readouterr().err
    assert main(["--config", str(bad), "--retry-seconds", "0"]) == EXIT_CONFIG


def test_report_table_lists_kills_and_every_violation(build: RunRootBuilder) -> None:
    build.clean_run()
    build.admit(5)
    audit = audit_run(build.root, "audit-test", 1)
    kills = [KillRecord("trainer", 11, 5.0, 1, 1, 5.2, up_at_s=6.0, recovered_at_s=9.5),
             KillRecord("rollout-server-0", 12, 10.0, 2, 2, 12.0), KillRecord("reward-service", 13, 11.0, 2, 2, 11.0)]  # fmt: skip
    report = ChaosReport("r", "/tmp/store", 0, 1, ["trainer", "rollout", "scheduler", "reward"], kills, 20.0, 2, 2, audit,
                         ["1 of 4 planned kills did not fire (scheduler@2)"], planned_steps=[1, 1, 2, 2],
                         unfired=["scheduler@2"])  # fmt: skip
    table = format_report(report)
    assert "| 1 | trainer | 5.0 | 1 | 1 | 11 | 6.0 | 9.5 |" in table
    assert "| 2 | rollout-server-0 | 10.0 | 2 | 2 | 12 | - | - |" in table
    assert "restarts: trainer 1, rollout 1, scheduler 0, reward 1 (planned: 4 kills, fired: 3)" in table
    assert "unfired kills (kind@step): scheduler@2" in table
    assert "VIOLATION 1 of 4 planned kills did not fire (scheduler@2)" in table
    assert "VIOLATION (a) 1 of 5 admitted groups are in no shard: g00000004" in table
    assert table.endswith("report: /tmp/store/chaos.json") and "result: FAILED (2 problems)" in table
    assert not report.ok and report.to_json()["restarts"] == {"trainer": 1, "rollout": 1, "scheduler": 0, "reward": 1}
    assert (report.to_json()["kills_planned"], report.to_json()["kills_fired"]) == (4, 3)


def test_waiting_for_servers_after_none_was_live(build: RunRootBuilder) -> None:
    source = ServerSource(build.root, api_key=None)
    terminate = threading.Event()
    register_server(build.root, "server-0", RolloutServerHandle("http://127.0.0.1:9", 100, 100, Path("log"), "m"))
    dead = source.snapshot()
    assert wait_for_servers(source, terminate, poll_s=0.01)  # a first cycle needs one server
    started = time.monotonic()
    assert wait_for_servers(source, terminate, poll_s=0.01, unlike=dead, retry_s=0.3)  # no change: retried later
    assert time.monotonic() - started >= 0.3
    register_server(build.root, "server-0", RolloutServerHandle("http://127.0.0.1:9", 200, 200, Path("log"), "m"))
    started = time.monotonic()
    assert wait_for_servers(source, terminate, poll_s=0.01, unlike=dead, retry_s=60.0)  # re-registered: at once
    assert time.monotonic() - started < 5.0
    terminate.set()
    assert not wait_for_servers(source, terminate, poll_s=0.01, unlike=source.snapshot(), retry_s=60.0)
