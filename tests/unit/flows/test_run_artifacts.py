"""The Prefect UI report of a run: its reward curve and throughput figures."""

from __future__ import annotations

import math

import pytest

from asyncrl.flows.prefect_api.artifacts import CURVE_ROWS, artifact_key, sparkline, training_report_markdown


def test_artifact_key_is_a_valid_prefect_key() -> None:
    assert artifact_key("Demo_Run 1", "rl-report") == "demo-run-1-rl-report"
    assert artifact_key("___", "summary") == "run-summary"


def test_sparkline_scales_between_min_and_max() -> None:
    assert sparkline([0.0, 0.5, 1.0]) == "▁▅█"
    assert sparkline([2.0, 2.0]) == "▁▁"
    assert sparkline([0.0, math.nan, 1.0]) == "▁ █"
    assert sparkline([]) == ""


def test_report_lists_the_curve_and_throughput() -> None:
    steps = {
        s: {"reward_mean": s / 40, "tokens_per_s": 100.0 * s, "staleness_max": float(s % 3), "step_time_s": 2.0}
        for s in range(1, 41)
    }
    rollout = {"gen_tokens_per_s": 321.0, "weight_sync_stall_fraction": 0.05, "groups_written": 90, "admitted": 96}
    text = training_report_markdown("demo", steps, rollout, wall_s=123.4, final_version=40)
    assert "| steps | 40 |" in text and "| final weight version | 40 |" in text
    assert "| reward, first -> last step | 0.025 -> 1.000 |" in text
    assert "| trained tokens/s (mean over steps) | 2050 |" in text  # mean of 100..4000
    assert "| generated tokens/s | 321 |" in text and "| groups written / admitted | 90 / 96 |" in text
    rows = [line for line in text.splitlines() if line.startswith("| ") and line.split("|")[1].strip().isdigit()]
    assert len(rows) == CURVE_ROWS and rows[0].startswith("| 1 |") and rows[-1].startswith("| 40 |")
    assert sparkline([s / 40 for s in range(1, 41)]) in text


def test_report_of_a_run_without_steps_says_so() -> None:
    text = training_report_markdown("empty", {}, {}, wall_s=1.0, final_version=0)
    assert "| steps | 0 |" in text and "| reward, first -> last step | n/a -> n/a |" in text


def test_report_and_summary_show_each_task() -> None:
    from asyncrl.flows.prefect_api.artifacts import PipelineSummary, summary_markdown

    steps = {
        1: {"reward_mean": 0.2, "pass_at_1/math": 0.25, "pass_at_1/code": 0.125},
        2: {"reward_mean": 0.4, "pass_at_1/math": 0.5},
        3: {"reward_mean": 0.6, "pass_at_1/code": 0.375},
    }
    rollout = {"groups_written": 4, "reward_wait_s": 2.0, "reward_mean/code": 0.3, "reward_mean/math": 0.4}
    text = training_report_markdown("mixed", steps, rollout, wall_s=10.0, final_version=3)
    assert "| code: pass@1 first -> last step; rollout mean reward | 0.125 -> 0.375; 0.300 |" in text
    assert "| math: pass@1 first -> last step; rollout mean reward | 0.250 -> 0.500; 0.400 |" in text
    assert "| reward wait per group (s) | 0.500 |" in text
    summary = PipelineSummary(
        run="mixed", steps=3, final_version=3, pass_at_1_before=0.2, pass_at_1_after=0.4, best_version=3,
        registered_model=None, registered_model_version=None, wall_s=1.0, train_wall_s=1.0, mlflow_uri="m",
        mlflow_run_id="r", storage_root="s", restarts={}, stages={},
        by_task_before={"pass_at_1/code": 0.1, "pass_at_4/code": 0.3, "reward_mean/code": 0.2},
        by_task_after={"pass_at_1/code": 0.25, "pass_at_4/code": 0.5, "reward_mean/code": 0.4},
    )
    markdown = summary_markdown(summary)
    assert "| held-out pass@1 of code | 10.0% -> 25.0% |" in markdown
    assert "| held-out pass@4 of code | 30.0% -> 50.0% |" in markdown


def test_report_and_summary_show_the_held_out_curve_evaluated_during_training() -> None:
    from asyncrl.flows.prefect_api.artifacts import PipelineSummary, summary_markdown
    from asyncrl.storage.evaluations import EvalResult

    def result(version: int, math: float, code: float) -> EvalResult:
        return EvalResult(version, (math + code) / 2, 8, 2, 12.0, {"pass_at_1/math": math, "pass_at_1/code": code})

    evaluations = {0: result(0, 0.25, 0.0), 5: result(5, 0.5, 0.25), 10: result(10, 0.75, 0.5)}
    text = training_report_markdown("run", {1: {"reward_mean": 0.1}}, {}, 1.0, 10, evaluations)
    assert "## Held-out pass@1 during training" in text
    assert f"3 versions, 8 held-out prompts x 2 samples each: `{sparkline([0.125, 0.375, 0.625])}`" in text
    assert "| weight version | held-out pass@1 | code | math |" in text
    assert "| 0 | 12.5% | 0.0% | 25.0% |" in text and "| 10 | 62.5% | 50.0% | 75.0% |" in text
    assert "Held-out pass@1 during training" not in training_report_markdown("run", {}, {}, 1.0, 0)
    failed = training_report_markdown("run", {}, {}, 1.0, 0, {}, "evaluator failed after 3 restart(s): exited with 1")
    assert "The evaluator failed and the run went on without it: evaluator failed after 3 restart(s)" in failed

    summary = PipelineSummary(
        run="r", steps=10, final_version=10, pass_at_1_before=0.2, pass_at_1_after=0.4, best_version=10,
        registered_model=None, registered_model_version=None, wall_s=1.0, train_wall_s=1.0, mlflow_uri="m",
        mlflow_run_id="x", storage_root="s", restarts={}, stages={},
        pass_at_1_during_training={v: r.pass_at_1 for v, r in evaluations.items()},
    )
    assert "| held-out pass@1 during training (subset), v0 -> v10 | 12.5% -> 62.5% `▁▅█` |" in summary_markdown(summary)


def test_report_summary_and_cli_say_what_asynchrony_bought(capsys: pytest.CaptureFixture[str]) -> None:
    from dataclasses import asdict

    from asyncrl.cli.main import print_summary
    from asyncrl.flows.prefect_api.artifacts import PipelineSummary, summary_markdown

    overlap = {"generation_busy_s": 80.0, "training_busy_s": 60.0, "rl_wall_s": 100.0, "overlap_factor": 1.4}
    row = "| overlap factor (generation + training busy) / RL wall | 1.40 = (80 s + 60 s) / 100 s |"
    assert row in training_report_markdown("run", {1: {"reward_mean": 0.1}}, {}, 1.0, 1, overlap=overlap)
    assert "overlap factor" not in training_report_markdown("run", {}, {}, 1.0, 0)
    summary = PipelineSummary(
        run="r", steps=1, final_version=1, pass_at_1_before=None, pass_at_1_after=None, best_version=None,
        registered_model=None, registered_model_version=None, wall_s=150.0, train_wall_s=120.0, mlflow_uri="m",
        mlflow_run_id="x", storage_root="s", restarts={}, stages={}, overlap=overlap,
    )  # fmt: skip
    assert row in summary_markdown(summary)
    assert asdict(summary)["overlap"] == overlap  # summary.json
    print_summary(asdict(summary))
    assert "overlap factor: 1.40 = (generation busy 80 s + training busy 60 s) / RL wall 100 s" in capsys.readouterr().out
    nothing = {"generation_busy_s": 0.0, "training_busy_s": 0.0, "rl_wall_s": 0.0, "overlap_factor": 0.0}
    assert "overlap factor" not in summary_markdown(PipelineSummary(**{**asdict(summary), "overlap": nothing}))
