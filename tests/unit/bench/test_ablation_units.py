"""Units of `asyncrl bench ablation`: the figures, the variant configs, the table and plot."""

from __future__ import annotations

from pathlib import Path

import pytest

from asyncrl.configs.loading import load_config
from asyncrl.bench.ablation import (
    warm_start_config,
    AblationSettings,
    eval_versions,
    format_table,
    moving_mean,
    plot_curves,
    run_summary,
    variant_config,
)

REPO = Path(__file__).resolve().parents[3]


def test_eval_versions_keep_first_and_last() -> None:
    assert eval_versions(0, 30, 10) == [0, 10, 20, 30]
    assert eval_versions(5, 27, 10) == [5, 15, 25, 27]
    assert eval_versions(0, 30, 0) == [0, 30]
    assert eval_versions(3, 3, 10) == [3]
    with pytest.raises(ValueError, match="last version 2 is before the first 3"):
        eval_versions(3, 2, 1)


def test_moving_mean_is_trailing() -> None:
    assert moving_mean([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]
    assert moving_mean([2.0, 4.0], 5) == [2.0, 3.0]
    with pytest.raises(ValueError, match="window must be >= 1"):
        moving_mean([1.0], 0)


def step(reward: float, **counts: float) -> dict[str, float]:
    return {"reward_mean": reward, "clip_fraction": 0.1, "dropped_stale": 0.0, **counts}


def test_run_summary_measures_the_change_and_the_staleness_reached() -> None:
    metrics = {1: step(0.2, **{"staleness/count_0": 6.0}), 2: step(0.4, **{"staleness/count_0": 2.0, "staleness/count_3": 6.0})}
    summary = run_summary(4, "standard", metrics, {10: 0.30, 11: 0.35, 12: 0.45}, start_version=10)
    assert summary["pass_at_1_change"] == pytest.approx(0.15)
    assert summary["pass_at_1_curve"] == [[0, 0.30], [1, 0.35], [2, 0.45]]
    assert summary["reward_curve"] == [[1, 0.2], [2, 0.4]]
    assert (summary["staleness_max"], summary["staleness_counts"]) == (3, {0: 8, 3: 6})
    assert summary["staleness_mean"] == pytest.approx(18 / 14)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"etas": ()}, "etas: must be ints >= 0"),
        ({"etas": (0, 0)}, "etas: a value repeats"),
        ({"objectives": ("ppo",)}, "objectives: must be distinct values of"),
        ({"eval_every": -1}, "eval_every: must be >= 0"),
        ({"smooth": 0}, "smooth: must be >= 1"),
        ({"adaptive_etas": (0,)}, "adaptive_etas: must be ints >= 1"),
        ({"adaptive_etas": (8, 8)}, "adaptive_etas: a value repeats"),
    ],
)
def test_settings_refuse_bad_values(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        AblationSettings(**kwargs)  # type: ignore[arg-type]


def test_variants_differ_only_in_eta_objective_and_where_they_write(tmp_path: Path) -> None:
    base = load_config(REPO / "configs" / "demo.yaml")
    variant = variant_config(base, tmp_path, tmp_path / "warm", 8, "standard")
    assert (variant.rollout.eta, variant.trainer.objective) == (8, "standard")
    assert variant.model.path == str(tmp_path / "warm") and variant.pipeline.sft_steps == 0
    assert variant.storage.root.startswith(str(tmp_path)) and variant.name == "demo-eta8-standard"
    same = ("seed", "data", "reward")
    assert all(getattr(variant, key) == getattr(base, key) for key in same)
    changed = {"objective", "keep_versions"}  # every version is kept for the sweep's evaluation
    assert variant.trainer.model_dump(exclude=changed) == base.trainer.model_dump(exclude=changed)
    assert variant.trainer.keep_versions > variant.trainer.max_steps
    assert variant.rollout.model_dump(exclude={"eta"}) == base.rollout.model_dump(exclude={"eta"})
    assert variant.rollout.adaptive_staleness is None


def test_the_adaptive_arm_differs_only_in_its_bound_control(tmp_path: Path) -> None:
    base = load_config(REPO / "configs" / "demo.yaml")
    fixed = variant_config(base, tmp_path, tmp_path / "warm", 8, "decoupled")
    adaptive = variant_config(base, tmp_path, tmp_path / "warm", 8, "decoupled", adaptive=True)
    assert adaptive.name == "demo-eta8-adaptive-decoupled" and adaptive.storage.root != fixed.storage.root
    assert adaptive.rollout.adaptive_staleness is not None and adaptive.rollout.eta == 8
    exclude = {"name", "storage", "rollout"}
    assert adaptive.model_dump(exclude=exclude) == fixed.model_dump(exclude=exclude)
    assert adaptive.rollout.model_dump(exclude={"adaptive_staleness"}) == fixed.rollout.model_dump(exclude={"adaptive_staleness"})
    # the base's own budget is kept when it sets one
    tuned = base.model_copy(update={"rollout": base.rollout.model_copy(update={"adaptive_staleness": adaptive.rollout.adaptive_staleness.model_copy(update={"max_behav_weight_p99": 1.2})})})
    assert variant_config(tuned, tmp_path, tmp_path / "warm", 8, "decoupled", adaptive=True).rollout.adaptive_staleness.max_behav_weight_p99 == 1.2
    settings = AblationSettings(etas=(0, 8), objectives=("decoupled",), adaptive_etas=(8,))
    assert settings.sweep() == [(0, "decoupled", False), (8, "decoupled", False), (8, "decoupled", True)]


def test_table_and_plot(tmp_path: Path) -> None:
    metrics = {s: step(0.1 * s, **{"staleness/count_0": 8.0}) for s in range(1, 4)}
    ok = run_summary(0, "decoupled", metrics, {0: 0.3, 3: 0.4}, start_version=0)
    result = {
        "config": "demo", "steps": 3, "batch_groups": 2, "n_samples": 4, "eval_prompts": 10, "eval_samples": 2,
        "runs": [ok, {"eta": 4, "objective": "standard", "error": "RuntimeError: boom\nmore"}],
    }  # fmt: skip
    adaptive = {**run_summary(8, "decoupled", metrics, {0: 0.3, 3: 0.5}, start_version=0,
                              scheduler={"effective_eta_min": 2.0, "eta_changes": 5.0, "effective_eta": 4.0}),
                "train_wall_s": 61.2}  # fmt: skip
    result["runs"].append(adaptive)
    table = format_table(result)
    assert "| 0 | decoupled | 0.300 | 0.400 | +0.100 | n/a | 0 | 0.00 | 0:24 | 0 | 0.100 |" in table
    assert "| 4 | standard | failed: RuntimeError: boom |" in table
    assert "| 8 adaptive (min 2, 5 changes) | decoupled | 0.300 | 0.500 | +0.200 | 61 |" in table
    png = plot_curves(result, tmp_path / "out" / "curves.png", smooth=2)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_a_mixed_run_lists_pass_at_1_per_task() -> None:
    metrics = {s: step(0.1 * s, **{"staleness/count_0": 8.0}) for s in range(1, 4)}
    run = {**run_summary(2, "decoupled", metrics, {0: 0.3, 3: 0.4}, start_version=0),
           "by_task_start": {"pass_at_1/code": 0.1, "pass_at_1/math": 0.5},
           "by_task_final": {"pass_at_1/code": 0.25, "pass_at_1/math": 0.55}}  # fmt: skip
    result = {"config": "mixed", "steps": 3, "batch_groups": 2, "n_samples": 4, "eval_prompts": 10, "eval_samples": 2,
              "runs": [run]}  # fmt: skip
    assert "- eta 2 decoupled: code 0.100 -> 0.250, math 0.500 -> 0.550" in format_table(result)
    single = {**result, "runs": [{**run, "by_task_final": {"pass_at_1/math": 0.5}}]}
    assert "per task" not in format_table(single)


def test_arms_that_change_only_rl_settings_share_one_warm_start(tmp_path: Path) -> None:
    """The warm start's run root freezes its trajectory settings: RL-only ones are held at
    their defaults there, so a sweep over them reuses one SFT instead of being refused."""
    from asyncrl.configs.loading import frozen_yaml
    from asyncrl.tasks.launch.context import config_differences
    import yaml

    base = load_config("configs/reasoning.yaml", [])
    arm = load_config("configs/reasoning.yaml", ["trainer.optimizer.lr=2e-4", "trainer.batch_groups=4", "rollout.eta=1",
                                                 "rollout.interrupt_mode=recompute", "trainer.objective=standard"])  # fmt: skip
    frozen = yaml.safe_load(frozen_yaml(warm_start_config(base, tmp_path)))
    assert config_differences(frozen, warm_start_config(arm, tmp_path)) == []
    sft_change = load_config("configs/reasoning.yaml", ["pipeline.sft_optimizer.lr=5e-4"])
    assert [key for key, _, _ in config_differences(frozen, warm_start_config(sft_change, tmp_path))] == ["pipeline.sft_optimizer.lr"]
