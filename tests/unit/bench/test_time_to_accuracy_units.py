"""Units of `asyncrl bench time-to-accuracy`: the curve figures, the sweep, the summary, the
arm configs, the table, the plot and the MLflow figures."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from asyncrl.bench.accuracy_curves import (
    accuracy_target, centred_mean, first_crossing, seed_mean_curve, value_at, version_wall_times,
)  # fmt: skip
from asyncrl.bench.time_to_accuracy import Arm, TimeToAccuracySettings, arm_config, clear_arm_run, summarize
from asyncrl.bench.time_to_accuracy_report import format_table, mlflow_metrics, plot_curves
from asyncrl.configs.loading import load_config

REPO = Path(__file__).resolve().parents[3]


def test_version_wall_times_count_from_the_servers_ready() -> None:
    metrics = {1: {"time": 1010.0}, 2: {"time": 1025.5}}
    assert version_wall_times(metrics, 1000.0, 0) == {0: 0.0, 1: 10.0, 2: 25.5}
    assert version_wall_times(metrics, 1000.0, 3) == {3: 0.0, 4: 10.0, 5: 25.5}
    with pytest.raises(ValueError, match="no ready time"):
        version_wall_times(metrics, 0.0, 0)


def test_seed_mean_curve_averages_at_equal_versions() -> None:
    points = seed_mean_curve([{0: (0.0, 0.4), 2: (10.0, 0.5), 4: (20.0, 0.6)}, {0: (0.0, 0.4), 2: (14.0, 0.7)}])
    assert [p.version for p in points] == [0, 2]  # version 4 is not in every seed
    assert points[1].wall_s == pytest.approx(12.0) and points[1].pass_at_1 == pytest.approx(0.6)
    assert points[1].pass_at_1_std == pytest.approx(0.1414, abs=1e-4)
    assert seed_mean_curve([{0: (0.0, 0.4)}])[0].pass_at_1_std == 0.0
    with pytest.raises(ValueError, match="no seed"):
        seed_mean_curve([])


def test_centred_mean_keeps_the_curve_in_place() -> None:
    assert centred_mean([0.0, 3.0, 0.0, 3.0], 3) == pytest.approx([1.5, 1.0, 2.0, 1.5])
    assert centred_mean([1.0, 2.0], 1) == [1.0, 2.0]
    with pytest.raises(ValueError, match="odd number"):
        centred_mean([1.0], 2)


def test_target_and_crossing() -> None:
    assert accuracy_target(0.4, 0.6, 0.9) == pytest.approx(0.58)
    with pytest.raises(ValueError, match="fraction"):
        accuracy_target(0.4, 0.6, 0.0)
    times, values = [0.0, 10.0, 20.0, 30.0], [0.40, 0.50, 0.60, 0.55]
    assert first_crossing(times, values, 0.58) == pytest.approx(18.0)  # interpolated between 10 s and 20 s
    assert first_crossing(times, values, 0.40) == 0.0
    assert first_crossing(times, values, 0.61) is None
    with pytest.raises(ValueError, match="2 times for 1 values"):
        first_crossing([0.0, 1.0], [0.5], 0.5)


def test_value_at_interpolates_and_never_extrapolates() -> None:
    times, values = [0.0, 10.0, 20.0], [0.4, 0.5, 0.7]
    assert value_at(times, values, 15.0) == pytest.approx(0.6)
    assert value_at(times, values, 20.0) == pytest.approx(0.7)
    assert value_at(times, values, 25.0) is None and value_at(times, values, -1.0) is None


def test_generation_share_of_the_synchronous_run() -> None:
    from asyncrl.bench.accuracy_curves import generation_share

    overlaps = [{"generation_busy_s": 60.0, "training_busy_s": 30.0}, {"generation_busy_s": 50.0, "training_busy_s": 50.0}]
    assert generation_share(overlaps) == pytest.approx((2 / 3 + 1 / 2) / 2)
    assert generation_share([{}]) is None


def test_settings_sweep_and_refusals() -> None:
    settings = TimeToAccuracySettings()
    assert [a.label for a in settings.arms()] == ["sync", "eta2-keep"]
    assert settings.seeds == (0, 1, 2) and settings.eval_every is None
    sweep = TimeToAccuracySettings(etas=(0, 1, 2, 4), modes=("recompute", "keep"))
    assert [a.label for a in sweep.arms()] == [
        "sync", "eta1-recompute", "eta1-keep", "eta2-recompute", "eta2-keep", "eta4-recompute", "eta4-keep",
    ]
    compare = TimeToAccuracySettings(etas=(0, 4), modes=("keep",), objective_etas=(4, 8))
    assert [a.label for a in compare.arms()] == ["sync", "eta4-keep", "eta4-keep-standard", "eta8-keep", "eta8-keep-standard"]
    for kwargs, message in [
        ({"etas": (1, 2)}, "must include 0"),
        ({"etas": (0,)}, "at least one asynchronous eta"),
        ({"etas": (0, 2, 2)}, "a value repeats"),
        ({"modes": ("pause",)}, "modes: must be distinct values"),
        ({"seeds": ()}, "seeds: must be distinct"),
        ({"smooth": 2}, "smooth: must be an odd number"),
        ({"eval_every": 0}, "eval_every: must be >= 1"),
        ({"target_fraction": 1.5}, "target_fraction"),
    ]:
        with pytest.raises(ValueError, match=message):
            TimeToAccuracySettings(**kwargs)


def curve(walls: list[float], values: list[float], every: int = 2) -> dict[int, tuple[float, float]]:
    return {i * every: (w, v) for i, (w, v) in enumerate(zip(walls, values, strict=True))}


def arm_row(label: str, eta: int, per_seed: list[dict[int, tuple[float, float]]]) -> dict:
    return {"label": label, "eta": eta, "mode": "keep", "objective": "decoupled", "per_seed": per_seed,
            "staleness_counts": {0: 64} if eta == 0 else {0: 8, eta: 56}, "rl_wall_s_per_seed": [1.0],
            "overlap_per_seed": [{"overlap_factor": 1.0 + 0.4 * (eta > 0)}]}  # fmt: skip


def two_arm_summary() -> dict:
    settings = TimeToAccuracySettings(etas=(0, 2), modes=("keep",), seeds=(0,), smooth=1)
    sync = arm_row("sync", 0, [curve([0.0, 100.0, 200.0, 300.0], [0.40, 0.50, 0.58, 0.60])])
    fast = arm_row("eta2-keep", 2, [curve([0.0, 50.0, 100.0, 150.0], [0.40, 0.48, 0.56, 0.59])])
    return summarize([sync, fast], 0.40, settings)


def test_summary_times_speedup_and_gaps() -> None:
    summary = two_arm_summary()
    assert summary["target_pass_at_1"] == pytest.approx(0.58)  # 0.40 + 0.9 * (0.60 - 0.40)
    sync, fast = summary["arms"]
    assert sync["time_to_target_s"] == pytest.approx(200.0)
    assert fast["time_to_target_s"] == pytest.approx(100.0 + 50.0 * (0.02 / 0.03))
    assert fast["time_to_target_speedup"] == pytest.approx(200.0 / fast["time_to_target_s"])
    assert summary["best_arm"] == "eta2-keep"
    assert summary["time_to_target_speedup"] == fast["time_to_target_speedup"]
    assert summary["equal_steps_gap_points"] == pytest.approx(-1.0)  # 0.59 - 0.60 at the last step
    assert summary["equal_wall_s"] == 150.0  # the fastest arm's last publish
    assert sync["pass_at_1_equal_wall"] == pytest.approx(0.54) and fast["pass_at_1_equal_wall"] == pytest.approx(0.59)


def test_summary_with_an_arm_that_never_reaches_the_target() -> None:
    settings = TimeToAccuracySettings(etas=(0, 2), modes=("keep",), seeds=(0,), smooth=1)
    sync = arm_row("sync", 0, [curve([0.0, 100.0, 200.0], [0.40, 0.55, 0.60])])
    slow = arm_row("eta2-keep", 2, [curve([0.0, 50.0, 100.0], [0.40, 0.45, 0.50])])
    summary = summarize([sync, slow], 0.40, settings)
    assert summary["arms"][1]["time_to_target_s"] is None and summary["arms"][1]["time_to_target_speedup"] is None
    # no arm reached the target: the best arm is the best at equal steps, with no speed-up
    assert summary["best_arm"] == "eta2-keep" and summary["time_to_target_speedup"] is None
    assert "not reached" in format_table(table_result(summary))
    with pytest.raises(ValueError, match="synchronous arm did not run"):
        summarize([slow], 0.40, settings)


def table_result(summary: dict) -> dict:
    return {"config": "reasoning", "steps": 6, "batch_groups": 8, "n_samples": 8, "max_new_tokens": 448,
            "eval_prompts": 200, "eval_samples": 4, "sync_generation_share": 0.7,
            "settings": {"seeds": [0], "smooth": 1, "target_fraction": 0.9}, **summary}  # fmt: skip


def test_table_plot_and_mlflow_figures(tmp_path: Path) -> None:
    result = table_result(two_arm_summary())
    table = format_table(result)
    assert "| eta2-keep | 133 | 133 | 1.50 | 59.0% | -1.0 | 59.0% | 1 | 1.40 | 0:8 2:56 |" in table
    assert "generation 70% of the synchronous run's busy time" in table
    assert "best asynchronous arm: eta2-keep; time_to_target_speedup 1.50; equal_steps_gap_points -1.0" in table
    json.dumps(result)  # the JSON the bench writes
    png = plot_curves(result, tmp_path / "t2a.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    batches = mlflow_metrics(result)
    step0 = batches[0][1]
    assert step0["time_to_target_speedup"] == pytest.approx(1.5) and "time_to_target_s/sync" in step0
    assert (150, {"pass_at_1_by_wall_s/eta2-keep": pytest.approx(0.59)}) in batches
    assert (6, {"pass_at_1/eta2-keep": pytest.approx(0.59)}) in batches


def test_arm_config_changes_only_the_arm(tmp_path: Path) -> None:
    base = load_config(REPO / "configs" / "reasoning.yaml", [])
    config = arm_config(base, tmp_path, tmp_path / "warm", Arm(2, "recompute", "standard"), seed=1)
    assert (config.rollout.eta, config.rollout.interrupt_mode, config.trainer.objective, config.seed) == (2, "recompute", "standard", 1)
    assert config.model.path == str(tmp_path / "warm") and config.pipeline.sft_steps == 0
    assert config.pipeline.eval_every == 0  # evaluation never competes with a run for the CPUs
    assert config.trainer.keep_versions == base.trainer.max_steps + 1
    assert config.name == "reasoning-eta2-recompute-standard-seed1"
    assert config.trainer.optimizer == base.trainer.optimizer and config.rollout.n_samples == base.rollout.n_samples


def test_an_earlier_run_of_the_arm_is_removed_and_nothing_else(tmp_path: Path) -> None:
    """A finished run root would be taken for the new run: the arm's work directory goes,
    the warm start and the other arms stay."""
    base = load_config(REPO / "configs" / "reasoning.yaml", [])
    config = arm_config(base, tmp_path, tmp_path / "warm", Arm(4, "keep"), seed=0)
    other = arm_config(base, tmp_path, tmp_path / "warm", Arm(0, "keep"), seed=0)
    for kept in (tmp_path / "warm", other.run_work_dir):
        kept.mkdir(parents=True)
    (Path(config.storage.root) / "weights").mkdir(parents=True)
    clear_arm_run(config)
    assert not config.run_work_dir.exists() and (tmp_path / "warm").is_dir() and other.run_work_dir.is_dir()
    clear_arm_run(config)  # nothing there: nothing to do
    elsewhere = config.model_copy(update={"storage": config.storage.model_copy(update={"root": str(tmp_path / "store")})})
    with pytest.raises(ValueError, match="storage.root: .* is not inside the arm's work directory"):
        clear_arm_run(elsewhere)


def test_the_arms_are_evaluated_together_and_the_shared_start_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every arm goes to one evaluation (one server); the start is asked of the first arm only
    and its score given to the others."""
    import asyncrl.tasks.launch.context as context
    import asyncrl.tasks.pipeline.stages as stages
    from asyncrl.bench.time_to_accuracy import evaluate_arms
    from asyncrl.storage.evaluations import EvalResult

    base = load_config(REPO / "configs" / "reasoning.yaml", [])
    arms = [{"config": arm_config(base, tmp_path, tmp_path / "warm", Arm(eta, "keep"), seed=0), "start": 0} for eta in (0, 2)]
    asked: list[list[list[int]]] = []

    def evaluate_runs(runs: list) -> list[dict[int, EvalResult]]:
        asked.append([versions for _, _, versions in runs])
        return [{v: EvalResult(v, 0.1 * v + 0.01 * k, 4, 1, 1.0) for v in versions} for k, (_, _, versions) in enumerate(runs)]

    monkeypatch.setattr(stages, "evaluate_runs", evaluate_runs)
    monkeypatch.setattr(context, "prepare_run", lambda config: None)
    scores = evaluate_arms([(arms[0], [0, 1, 2]), (arms[1], [0, 2])])
    assert asked == [[[0, 1, 2], [2]]]
    assert scores == [{0: 0.0, 1: pytest.approx(0.1), 2: pytest.approx(0.2)}, {0: 0.0, 2: pytest.approx(0.21)}]


def test_runs_that_need_another_server_or_evaluation_are_refused_together(tmp_path: Path) -> None:
    from asyncrl.tasks.pipeline.stages import evaluate_runs
    from asyncrl.tasks.system.run_paths import run_paths

    base = load_config(REPO / "configs" / "reasoning.yaml", [])
    one = arm_config(base, tmp_path, tmp_path / "warm", Arm(0, "keep"), seed=0)
    longer = arm_config(base, tmp_path, tmp_path / "warm", Arm(2, "keep"), seed=0)
    longer = longer.model_copy(update={"rollout": longer.rollout.model_copy(update={"max_new_tokens": 500})})
    with pytest.raises(ValueError, match=r"^longest_sequence: runs evaluated on one server must agree"):
        evaluate_runs([(one, run_paths(one), [0]), (longer, run_paths(longer), [1])])
    other_model = one.model_copy(update={"model": one.model.model_copy(update={"path": str(tmp_path / "other")})})
    with pytest.raises(ValueError, match=r"^model.path: "):
        evaluate_runs([(one, run_paths(one), [0]), (other_model, run_paths(other_model), [1])])


def test_learning_check_gain_and_verdict() -> None:
    from asyncrl.bench.learning_check import format_check, gain_summary

    summary = gain_summary(0.50, [0.70, 0.74, 0.66], 18.0)
    assert summary["gain_points"] == pytest.approx([20.0, 24.0, 16.0])
    assert summary["gain_points_mean"] == pytest.approx(20.0) and summary["gain_points_std"] == pytest.approx(4.0)
    assert summary["passed"] is True
    assert gain_summary(0.50, [0.60], 18.0)["passed"] is False
    assert gain_summary(0.50, [0.60], None)["passed"] is None
    with pytest.raises(ValueError, match="no run"):
        gain_summary(0.5, [], None)
    line = format_check({"config": "demo", "arm": "eta2-recompute", "steps": 30, "seeds": [0, 1, 2], **summary})
    assert "gain per run +20.0, +24.0, +16.0 points; mean +20.0 +- 4.0 (threshold +18.0): PASSED" in line


def test_the_learning_command_runs_each_seed_from_one_warm_start_and_exits_by_the_verdict(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`asyncrl bench learning` around its edges (the warm start, the arms' runs and their one
    evaluation, all run for real by the time-to-accuracy e2e test): one warm start, one run per
    seed with that seed, one evaluation of the start and every final, the JSON, and exit 1 on a
    failed check, 0 on a passed one."""
    import asyncrl.bench.learning_check as learning
    from asyncrl.cli.main import main

    calls: dict[str, list] = {"warm": [], "runs": [], "evaluations": []}

    def train_arm(config):  # noqa: ANN001, ANN202 - the arm's run: its seed decides its final score
        calls["runs"].append((config.seed, config.model.path))
        return {"config": config, "start": 0, "final": 2, "steps": 2, "wall_s": 1.0, "seed": config.seed}

    def evaluate_arms(arms):  # noqa: ANN001, ANN202
        calls["evaluations"].append([versions for _, versions in arms])
        return [{0: 0.40, 2: 0.50 + 0.10 * run["seed"]} for run, _ in arms]

    monkeypatch.setattr(learning, "prepare_warm_start", lambda base, work: calls["warm"].append(work) or tmp_path / "warm")
    monkeypatch.setattr(learning, "train_arm", train_arm)
    monkeypatch.setattr(learning, "evaluate_arms", evaluate_arms)
    config = REPO / "configs" / "reasoning.yaml"
    work = tmp_path / "work"
    assert main(["bench", "learning", str(config), "--repeats", "2", "--min-gain", "101", "--work-dir", str(work)]) == 1
    check = json.loads((work / "learning.json").read_text())
    assert "FAILED" in capsys.readouterr().out and check["passed"] is False
    assert check["seeds"] == [0, 1] and check["gain_points"] == pytest.approx([10.0, 20.0])
    assert calls["warm"] == [work] and calls["runs"] == [(0, str(tmp_path / "warm")), (1, str(tmp_path / "warm"))]
    assert calls["evaluations"] == [[[0, 2], [0, 2]]]  # one evaluation for every run
    assert main(["bench", "learning", str(config), "--repeats", "1", "--min-gain", "5", "--work-dir", str(work)]) == 0
    assert "PASSED" in capsys.readouterr().out


def test_the_benches_are_on_the_command_line() -> None:
    from asyncrl.cli.main import build_parser

    parser = build_parser()
    args = parser.parse_args(["bench", "time-to-accuracy", "configs/reasoning.yaml", "--etas", "0,2", "--seeds", "0"])
    assert args.etas == (0, 2) and args.seeds == (0,) and args.modes == ("keep",) and args.eval_every is None
    args = parser.parse_args(["bench", "learning", "configs/demo.yaml", "--min-gain", "18"])
    assert args.repeats == 3 and args.min_gain == 18.0
