"""One RL step on the real DeepSpeed engine (shared, reset before each test)."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch

from asyncrl.tasks.trainer.batch import TokenSequence
from asyncrl.tasks.trainer.logprobs import sequence_logprobs
from asyncrl.tasks.trainer.step import prepare_step, run_rl_step
from asyncrl.tasks.trainer.rl_settings import RLSettings

TEST_LR = 1e-3  # the shared engine's learning rate (tests/support/fixtures_trainer.py)


def _params(engine: Any) -> list[torch.Tensor]:
    return [p.detach().clone() for p in engine.module.parameters()]


def _max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


def _moved_fraction(a: list[torch.Tensor], b: list[torch.Tensor], threshold: float) -> float:
    """Fraction of all coordinates that differ by more than ``threshold``."""
    moved = sum(int(((x - y).abs() > threshold).sum()) for x, y in zip(a, b))
    return moved / sum(x.numel() for x in a)


def _output_logprob_sums(engine: Any, samples: list[Any]) -> list[float]:
    seqs = [TokenSequence(tuple(s.prompt_token_ids), tuple(s.output_token_ids)) for s in samples]
    return [float(v.sum()) for v in sequence_logprobs(engine.ds, seqs, [[i] for i in range(len(seqs))])]


def test_positive_advantage_raises_and_negative_lowers_logprob(engine: Any, trajectories: Any, model_logprobs: Any) -> None:
    group = trajectories.group("g0", [1.0, 0.0], logprobs=model_logprobs, output_len=(8, 8))
    before = _output_logprob_sums(engine, group)
    result = run_rl_step(engine, [group], RLSettings(micro_batch_tokens=256), trainer_updates=0)
    after = _output_logprob_sums(engine, group)
    assert result.prepared.advantages[0] > 0 > result.prepared.advantages[1]
    assert after[0] > before[0] + 1e-3, (before, after)
    assert after[1] < before[1] - 1e-3, (before, after)
    assert result.update.updates == 1


def test_proximal_equal_to_behaviour_gives_the_standard_ppo_update(
    shared_engine: Any, engine: Any, trajectories: Any, model_logprobs: Any
) -> None:
    """On-policy data: pi_prox (recomputed at step start) equals pi_behav, so the decoupled
    objective must reproduce standard PPO, including in the second mini-batch where u != 1."""
    groups = [trajectories.group(f"g{k}", [1.0, 0.0, 0.5], logprobs=model_logprobs) for k in range(4)]
    initial = _params(engine)
    decoupled = run_rl_step(engine, groups, RLSettings(objective="decoupled", mini_batches=2, micro_batch_tokens=64), 0)
    after_decoupled = _params(engine)
    shared_engine.reset()
    standard = run_rl_step(engine, groups, RLSettings(objective="standard", mini_batches=2, micro_batch_tokens=64), 0)
    after_standard = _params(engine)
    assert decoupled.update.updates == standard.update.updates == 2
    assert decoupled.micro_batches > 2  # several micro-batches per mini-batch
    assert _max_diff(initial, after_decoupled) > 1e-4
    assert _max_diff(after_decoupled, after_standard) < 1e-6
    assert decoupled.update.means()["behav_weight_max"] == pytest.approx(1.0, abs=1e-4)

    # Control: off-policy behaviour log-probs make the two objectives differ.
    shifted = [[type(s)(**{**vars(s), "behaviour_logprobs": [v - 0.3 for v in s.behaviour_logprobs]}) for s in g] for g in groups]
    shared_engine.reset()
    run_rl_step(engine, shifted, RLSettings(objective="decoupled", mini_batches=2, micro_batch_tokens=64), 0)
    off_decoupled = _params(engine)
    shared_engine.reset()
    run_rl_step(engine, shifted, RLSettings(objective="standard", mini_batches=2, micro_batch_tokens=64), 0)
    assert _max_diff(off_decoupled, _params(engine)) > 1e-5


def test_one_update_takes_proximal_from_its_forward_and_matches_the_separate_pass(
    shared_engine: Any, engine: Any, trajectories: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One mini-batch: log pi_prox = stop_gradient(log pi_theta) of the update's own forward
    pass, the same update, losses and mismatch figures as the separate proximal pass (the
    reference: the step with that pass forced), without the pass."""
    import asyncrl.tasks.trainer.step as step

    # Off-policy behaviour log-probs spread over three versions: w != 1 and capped tokens.
    groups = [trajectories.group(f"g{k}", [1.0, 0.0, 0.5], versions=[0, 1, 2]) for k in range(4)]
    settings = RLSettings(mini_batches=1, micro_batch_tokens=64, behav_weight_cap=2.0)
    assert step.reuses_update_forward(engine.module, settings, 1)
    reused = run_rl_step(engine, groups, settings, trainer_updates=2)
    after_reused = _params(engine)

    shared_engine.reset()
    initial = _params(engine)
    monkeypatch.setattr(step, "reuses_update_forward", lambda *args: False)
    separate = run_rl_step(engine, groups, settings, trainer_updates=2)
    after_separate = _params(engine)

    assert reused.micro_batches == separate.micro_batches > 2 and reused.update.updates == separate.update.updates == 1
    assert reused.proximal_time_s == 0.0 < separate.proximal_time_s
    assert _max_diff(initial, after_separate) > 1e-4
    assert _max_diff(after_reused, after_separate) < 1e-6
    means, reference = reused.update.means(), separate.update.means()
    for name in ("loss", "behav_weight_mean", "behav_weight_max", "behav_capped_fraction", "approx_kl", "grad_norm"):
        assert means[name] == pytest.approx(reference[name], rel=1e-5, abs=1e-7), name
    assert 0 < means["behav_capped_fraction"] < 1 and means["clip_fraction"] == reference["clip_fraction"] == 0.0
    assert reused.mismatch.keys() == separate.mismatch.keys() and reused.mismatch
    for name, value in separate.mismatch.items():
        assert reused.mismatch[name] == pytest.approx(value, rel=1e-5, abs=1e-6), name


def test_the_proximal_pass_stays_where_the_forward_cannot_stand_for_it(engine: Any) -> None:
    """Several updates in a step (later mini-batches train on moved parameters), the
    standard objective, dropout as a module or in the model config: a separate pass."""
    from types import SimpleNamespace

    import asyncrl.tasks.trainer.step as step

    one = RLSettings(mini_batches=1)
    assert step.reuses_update_forward(engine.module, one, 1)
    assert not step.reuses_update_forward(engine.module, RLSettings(mini_batches=2), 2)
    assert not step.reuses_update_forward(engine.module, RLSettings(objective="standard"), 1)
    assert not step.reuses_update_forward(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.1)), one, 1)
    assert step.reuses_update_forward(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.0)), one, 1)
    with_config = torch.nn.Linear(2, 2)
    with_config.config = SimpleNamespace(attention_dropout=0.1, hidden_size=2)  # type: ignore[assignment]
    assert not step.reuses_update_forward(with_config, one, 1)
    with_config.config = SimpleNamespace(router_jitter_noise=0.01)  # type: ignore[assignment]
    assert not step.reuses_update_forward(with_config, one, 1)
    with_config.config = SimpleNamespace(attention_dropout=0.0, resid_pdrop=0.0, classifier_dropout=None)  # type: ignore[assignment]
    assert step.reuses_update_forward(with_config, one, 1)


def test_micro_batch_split_does_not_change_the_update(shared_engine: Any, engine: Any, trajectories: Any) -> None:
    """Loss normalised by the mini-batch's tokens: one big micro-batch or many small ones, same step."""
    groups = [trajectories.group(f"g{k}", [1.0, 0.0, 0.0, 1.0], versions=0) for k in range(3)]
    one = run_rl_step(engine, groups, RLSettings(micro_batch_tokens=1024), trainer_updates=1)
    params_one = _params(engine)
    shared_engine.reset()
    many = run_rl_step(engine, groups, RLSettings(micro_batch_tokens=40), trainer_updates=1)
    assert one.micro_batches == 1 and many.micro_batches >= 4
    # Adam's first step is ~lr * g / (|g| + eps) per coordinate: summation-order rounding
    # can move the rare coordinates whose gradient is ~eps by a fraction of lr (2.4e-5 seen
    # at lr 1e-3), while a wrong per-micro-batch weighting flips the sign of every
    # coordinate where micro-batches disagree, moving a large share of them by ~2 lr.
    # The equal losses pin the global scale.
    after = _params(engine)
    assert _moved_fraction(params_one, after, 0.01 * TEST_LR) < 1e-4
    assert _max_diff(params_one, after) < 0.5 * TEST_LR
    assert one.update.means()["loss"] == pytest.approx(many.update.means()["loss"], abs=1e-5)


def test_stale_samples_are_dropped_and_counted(
    engine: Any, trajectories: Any, caplog: pytest.LogCaptureFixture
) -> None:
    fresh = trajectories.group("g0", [1.0, 0.0], versions=[4, 5])
    mixed = trajectories.group("g1", [0.0, 1.0], versions=[0, 2])
    settings = RLSettings(max_staleness=3, micro_batch_tokens=256)
    with caplog.at_level(logging.WARNING):
        result = run_rl_step(engine, [fresh, mixed], settings, trainer_updates=5)
    metrics = result.metrics(pass_k=(2,))
    assert result.prepared.staleness == (1, 0, 5, 3)
    # per-task figures count every sample of the step, the dropped one included
    assert metrics["reward_mean/math"] == 0.5 and metrics["pass_at_1/math"] == 0.5
    assert metrics["pass_at_2/math"] == 1.0 and metrics["prompts/math"] == 2
    assert metrics["dropped_stale"] == 1 and metrics["trained_samples"] == 3
    assert metrics["staleness_max"] == 5 and metrics["staleness/count_5"] == 1
    assert "dropped 1 of 4 samples staler than max_staleness=3" in caplog.text

    # A batch with nothing fresh enough: no optimizer update at all.
    before = _params(engine)
    all_stale = run_rl_step(engine, [mixed], RLSettings(max_staleness=1, micro_batch_tokens=256), trainer_updates=5)
    assert all_stale.update.updates == 0 and all_stale.prepared.dropped_stale == 2
    assert _max_diff(before, _params(engine)) == 0.0


def test_advantages_use_the_whole_group_before_drops(trajectories: Any) -> None:
    group = trajectories.group("g0", [1.0, 0.0, 0.0, 0.0], versions=[0, 9, 9, 9])
    prepared = prepare_step([group], RLSettings(max_staleness=2, advantage="drgrpo"), trainer_updates=9)
    assert prepared.advantages == pytest.approx((0.75, -0.25, -0.25, -0.25))
    assert [item.advantage for item in prepared.items] == pytest.approx([-0.25, -0.25, -0.25])


def test_the_negative_advantage_scale_shrinks_below_mean_samples_only(trajectories: Any) -> None:
    group = trajectories.group("g0", [1.0, 0.0, 0.0, 0.0], versions=[0, 0, 0, 0])
    prepared = prepare_step([group], RLSettings(advantage="drgrpo", negative_advantage_scale=0.2), trainer_updates=0)
    assert [item.advantage for item in prepared.items] == pytest.approx([0.75, -0.05, -0.05, -0.05])


def test_per_task_figures_follow_each_group_s_task(trajectories: Any) -> None:
    import dataclasses

    math_group = trajectories.group("g0", [1.0, 0.0], versions=[0, 0])
    code_group = [dataclasses.replace(s, task="code") for s in trajectories.group("g1", [0.5, 0.0], versions=[0, 0])]
    prepared = prepare_step([math_group, code_group], RLSettings(), trainer_updates=0)
    assert prepared.group_rewards == (("math", (1.0, 0.0)), ("code", (0.5, 0.0)))


def test_the_kl_penalty_to_the_reference_is_zero_at_the_first_step_then_grows_and_holds_theta_back(
    shared_engine: Any, engine: Any, trajectories: Any, model_logprobs: Any, tiny_model_dir: Any
) -> None:
    from asyncrl.tasks.trainer.reference import load_reference

    reference = load_reference(engine, tiny_model_dir)
    group = trajectories.group("g0", [1.0, 0.0], logprobs=model_logprobs, output_len=(8, 8))
    settings = RLSettings(micro_batch_tokens=256, kl_coef=1.0)
    first = run_rl_step(engine, [group], settings, trainer_updates=0, reference=reference)
    assert first.update.means()["ref_kl"] == pytest.approx(0.0, abs=1e-9)  # theta = ref at the start
    steps = [run_rl_step(engine, [group], settings, trainer_updates=k, reference=reference) for k in (1, 2, 3)]
    assert all(s.update.means()["ref_kl"] > 0 for s in steps)
    with_kl = _output_logprob_sums(engine, group)

    shared_engine.reset()
    for k in range(4):
        run_rl_step(engine, [group], RLSettings(micro_batch_tokens=256), trainer_updates=k)
    without_kl = _output_logprob_sums(engine, group)
    # The penalty pulls the pushed-down sample's log-prob back toward the reference's.
    assert with_kl[1] > without_kl[1], (with_kl, without_kl)

    with pytest.raises(ValueError, match="needs the reference policy"):
        run_rl_step(engine, [group], settings, trainer_updates=4)


def test_a_kl_penalty_is_refused_with_zero_stage_3_naming_the_field() -> None:
    from pydantic import ValidationError

    from asyncrl.configs.trainer import TrainerConfig

    with pytest.raises(ValidationError, match="trainer.kl_coef"):
        TrainerConfig(kl_coef=0.05, zero_stage=3)
    assert TrainerConfig(kl_coef=0.05, zero_stage=2).kl_coef == 0.05
