"""The scheduler process's figures survive its restarts: one line per controller cycle,
added up by the run (counts and seconds summed, rates recomputed over the summed time)."""

from __future__ import annotations

from pathlib import Path

import pytest

from asyncrl.tasks.scheduler.cycle_stats import append_cycle_stats, combine_cycle_stats, read_cycle_stats


def cycle(elapsed: float, tokens: int, samples: int, reward: float, stall: float) -> dict[str, float]:
    return {
        "elapsed_s": elapsed, "admitted": 4, "samples": samples, "output_tokens": tokens,
        "gen_tokens_per_s": tokens / elapsed, "reward_mean": reward, "weight_updates": 2,
        "weight_sync_stall_s": stall, "weight_sync_stall_fraction": stall / elapsed,
    }  # fmt: skip


def test_cycles_of_a_restarted_scheduler_add_up(tmp_path: Path) -> None:
    path = tmp_path / "scheduler-stats.jsonl"
    append_cycle_stats(path, cycle(10.0, 1000, 8, 0.5, 1.0))
    append_cycle_stats(path, cycle(30.0, 2000, 24, 0.25, 3.0))
    with open(path, "a") as handle:
        handle.write('{"elapsed_s": 5')  # a line cut by a SIGKILL

    total = combine_cycle_stats(read_cycle_stats(path))

    assert total["cycles"] == 2 and total["elapsed_s"] == 40.0 and total["admitted"] == 8
    assert total["gen_tokens_per_s"] == pytest.approx(3000 / 40)
    assert total["weight_sync_stall_fraction"] == pytest.approx(4.0 / 40)
    assert total["reward_mean"] == pytest.approx((0.5 * 8 + 0.25 * 24) / 32)
    assert total["weight_updates"] == 4


def test_generation_busy_time_adds_up_over_the_scheduler_restarts() -> None:
    cycles = [{**cycle(10.0, 100, 8, 0.5, 0.0), "generation_busy_s": 7.5},
              {**cycle(20.0, 100, 8, 0.5, 0.0), "generation_busy_s": 12.0}]  # fmt: skip
    assert combine_cycle_stats(cycles)["generation_busy_s"] == pytest.approx(19.5)


def test_no_cycle_gives_no_figures(tmp_path: Path) -> None:
    assert combine_cycle_stats(read_cycle_stats(tmp_path / "absent.jsonl")) == {}


def test_per_task_reward_means_are_recomputed_over_all_cycles(tmp_path: Path) -> None:
    path = tmp_path / "scheduler-stats.jsonl"
    first = {**cycle(10.0, 100, 8, 0.5, 0.0), "samples/math": 4, "reward_sum/math": 4.0, "reward_mean/math": 1.0,
             "samples/code": 4, "reward_sum/code": 0.0, "reward_mean/code": 0.0, "reward_wait_s": 2.0}
    second = {**cycle(10.0, 100, 4, 0.5, 0.0), "samples/code": 4, "reward_sum/code": 2.0, "reward_mean/code": 0.5,
              "reward_wait_s": 1.0}
    append_cycle_stats(path, first)
    append_cycle_stats(path, second)
    total = combine_cycle_stats(read_cycle_stats(path))
    assert total["reward_mean/math"] == 1.0 and total["samples/math"] == 4
    assert total["reward_mean/code"] == pytest.approx(2.0 / 8) and total["samples/code"] == 8
    assert total["reward_wait_s"] == 3.0


def test_the_adaptive_bound_is_the_last_cycles_and_its_minimum_the_lowest() -> None:
    cycles = [
        {"elapsed_s": 10.0, "effective_eta": 2.0, "effective_eta_min": 1.0, "eta_changes": 3.0, "drift_readings": 5.0},
        {"elapsed_s": 5.0, "effective_eta": 4.0, "effective_eta_min": 2.0, "eta_changes": 1.0, "drift_readings": 2.0},
    ]
    total = combine_cycle_stats(cycles)
    assert (total["effective_eta"], total["effective_eta_min"]) == (4.0, 1.0)
    assert (total["eta_changes"], total["drift_readings"]) == (4.0, 7.0)


def test_the_fleet_size_is_the_most_servers_a_cycle_ran_on() -> None:
    cycles = [{**cycle(10.0, 100, 8, 0.5, 0.0), "rollout_servers": n} for n in (1.0, 2.0, 1.0)]
    assert combine_cycle_stats(cycles)["rollout_servers"] == 2.0
