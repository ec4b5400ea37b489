"""The run's watch on the scheduler's effective staleness bound: one MLflow point and one
log line per change, nothing when the bound stands, and a bad state file is a warning."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from asyncrl.storage import fs, paths
from asyncrl.storage.fs import open_root
from asyncrl.tasks.launch.bound_watch import EffectiveBoundWatch
from asyncrl.tasks.algo.adaptive_eta import AdaptiveState
from asyncrl.tasks.scheduler.gate_state import save_gate_state
from asyncrl.tasks.algo.staleness_gate import GateState


def test_each_change_is_one_point_and_one_line(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    root = open_root(str(tmp_path / "store"))
    points: list[tuple[int, float]] = []
    watch = EffectiveBoundWatch(root, eta=8, log_metric=lambda step, value: points.append((step, value)))
    caplog.set_level(logging.INFO, logger="asyncrl.run.staleness")
    watch.check(force=True)  # no state yet
    gate = GateState(admitted=10, batch_groups=2, eta=8)
    save_gate_state(root, gate, AdaptiveState(eta=8, version=3, under=1))
    watch.check(force=True)  # the configured bound: nothing to say
    save_gate_state(root, gate, AdaptiveState(eta=4, version=5, under=0))
    watch.check(force=True)
    watch.check(force=True)
    save_gate_state(root, gate, AdaptiveState(eta=5, version=9, under=0))
    watch.check()  # within every_s of the last read: not read
    watch.check(force=True)
    assert points == [(5, 4.0), (9, 5.0)] and watch.changes == [(5, 8, 4), (9, 4, 5)]
    lines = [(r.levelno, r.getMessage()) for r in caplog.records]
    assert lines[0][0] == logging.WARNING and "lowered 8 -> 4 (scheduler at version 5" in lines[0][1]
    assert lines[1][0] == logging.INFO and "raised 4 -> 5 (scheduler at version 9" in lines[1][1]
    assert len(lines) == 2

    fs.put_atomic_replace(root, paths.SCHEDULER_STATE, b'{"gate": {}, "adaptive": {"eta": "x"}}')
    watch.check(force=True)
    assert "could not read the scheduler's effective staleness bound" in caplog.records[-1].getMessage()
    assert points == [(5, 4.0), (9, 5.0)]
