"""The benchmark tables show the samples dropped as too stale, the tokens wasted and the
groups dynamic filtering left out."""

from __future__ import annotations

from asyncrl.bench.ablation import format_table, run_summary
from asyncrl.bench.e2e_report import format_tables
from asyncrl.bench.e2e_figures import wasted_tokens


def test_wasted_tokens_sum_the_trainers_steps() -> None:
    steps = {1: {"wasted_tokens": 40.0}, 2: {"wasted_tokens": 0.0}, 3: {}}
    assert wasted_tokens(steps) == 40 and wasted_tokens({}) == 0


def test_the_e2e_table_has_dropped_wasted_and_filtered_columns() -> None:
    run = {"eta": 2, "mode": "recompute", "wall_s": 10.0, "trained_tokens_per_s": 5.0, "rollout_utilisation": 0.5,
           "weight_sync_stall_fraction": 0.01, "packing_efficiency": 0.9, "staleness_max": 2,
           "staleness_counts": {0: 4, 2: 1}, "dropped_stale": 0, "wasted_tokens": 0, "cut_tokens": 7,
           "filtered_groups": 3}
    config = {"rollout": {"n_samples": 2}, "trainer": {"max_steps": 2, "batch_groups": 2, "cpu_cores": [1]},
              "inference": {"cpu_cores": [0]}}
    result = {"settings": {"workload": "balanced"}, "config": config,
              "workload": {"groups": 4, "budget_mean": 8.0, "budget_p50": 8, "budget_p90": 8, "budget_max": 8},
              "standalone": {"t_gen_s": 1.0, "throughput": []}, "runs": [run]}  # fmt: skip
    table = format_tables(result)
    assert "| staleness (value:samples) | dropped | wasted tok. | cut tok. | filtered groups |" in table
    assert "| 2 | 0:4 2:1 | 0 | 0 | 7 | 3 |" in table


def test_the_ablation_table_has_wasted_and_filtered_columns() -> None:
    metrics = {1: {"reward_mean": 0.5, "staleness/count_0": 4.0, "dropped_stale": 1.0, "wasted_tokens": 9.0}}
    run = run_summary(1, "decoupled", metrics, {0: 0.1, 1: 0.2}, 0, {"wasted_tokens": 1.0, "filtered_groups": 2.0})
    assert (run["dropped_stale"], run["wasted_tokens"], run["cut_tokens"], run["filtered_groups"]) == (1, 9, 1, 2)
    table = format_table({"config": "c", "steps": 1, "batch_groups": 2, "n_samples": 2, "eval_prompts": 1,
                          "eval_samples": 1, "runs": [run]})  # fmt: skip
    assert "| dropped | clip frac. | wasted tok. | filtered groups |" in table and "| 1 | 0.000 | 9 | 2 |" in table
