"""The overlap factor of a run: (generation busy + training busy) / RL wall time, from the
trainer's step metrics of the phase and the scheduler's generation busy time."""

from __future__ import annotations

import pytest

from asyncrl.tasks.algo.overlap import overlap_figures, phase_steps, rl_phase_wall_s, step_busy_s, training_busy_s

READY_AT = 1_000.0


def test_two_equal_halves_fully_overlapped_give_two_and_in_turn_one() -> None:
    assert overlap_figures(50.0, 50.0, 50.0) == {
        "generation_busy_s": 50.0, "training_busy_s": 50.0, "rl_wall_s": 50.0, "overlap_factor": 2.0,
    }  # fmt: skip
    assert overlap_figures(30.0, 20.0, 50.0)["overlap_factor"] == pytest.approx(1.0)
    assert overlap_figures(10.0, 10.0, 40.0)["overlap_factor"] == pytest.approx(0.5)  # idle half the time


def test_nothing_measured_gives_zero_not_a_crash() -> None:
    assert overlap_figures(0.0, 0.0, 0.0) == {
        "generation_busy_s": 0.0, "training_busy_s": 0.0, "rl_wall_s": 0.0, "overlap_factor": 0.0,
    }  # fmt: skip
    assert overlap_figures(12.0, 0.0, 0.0)["overlap_factor"] == 0.0
    with pytest.raises(ValueError, match="training_busy_s must be >= 0"):
        overlap_figures(1.0, -1.0, 2.0)


def test_a_step_is_busy_for_its_step_time_else_its_measured_parts() -> None:
    assert step_busy_s({"step_time_s": 3.0, "proximal_time_s": 1.0, "update_time_s": 1.5}) == 3.0
    parts = {"proximal_time_s": 0.5, "update_time_s": 1.5, "publish_time_s": 0.25, "reward_mean": 0.9}
    assert step_busy_s(parts) == pytest.approx(2.25)
    assert step_busy_s({}) == 0.0


def test_the_phase_is_its_own_steps_from_every_server_ready_to_the_last_step() -> None:
    steps = {
        1: {"time": 900.0, "step_time_s": 5.0},  # an earlier phase of a resumed run
        2: {"time": 1_010.0, "step_time_s": 4.0},
        3: {"time": 1_030.0, "step_time_s": 6.0},
        4: {"step_time_s": 7.0},  # carried by a remote trainer's lineage: no time, cannot be placed
    }
    phase = phase_steps(steps, READY_AT)
    assert sorted(phase) == [2, 3]
    assert training_busy_s(phase) == pytest.approx(10.0)
    assert rl_phase_wall_s(phase, READY_AT) == pytest.approx(30.0)


def test_no_step_or_no_start_gives_a_zero_wall() -> None:
    steps = {1: {"time": 1_010.0, "step_time_s": 4.0}}
    assert phase_steps(steps, 0.0) == {} and rl_phase_wall_s(steps, 0.0) == 0.0
    assert rl_phase_wall_s({}, READY_AT) == 0.0 and training_busy_s({}) == 0.0
