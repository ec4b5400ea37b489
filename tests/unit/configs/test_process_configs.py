"""Each process reads a config made for it: the launcher cuts it from the validated run config
(the sections the process uses, the values derived from several sections computed once), the
process parses only its own model, and a whole run config given to a process is refused."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from asyncrl.configs.loading import ConfigError, config_from_dict, load_process_config, private_dict
from asyncrl.configs.processes import (
    PROCESS_NAMES,
    EvaluatorProcessConfig,
    RewardProcessConfig,
    SchedulerProcessConfig,
    TrainerProcessConfig,
    process_configs,
)


def run_dict(tmp_path: Path) -> dict[str, Any]:
    return {
        "name": "proc", "seed": 3, "work_dir": str(tmp_path / "work"),
        "model": {"path": str(tmp_path / "model")},
        "data": {"train_path": str(tmp_path / "train.parquet"), "eval_path": str(tmp_path / "eval.parquet"),
                 "max_prompt_tokens": 40},
        "rollout": {"n_samples": 4, "max_new_tokens": 30, "eta": 3},
        "trainer": {"max_staleness": 2, "micro_batch_tokens": 128},
        "inference": {"api_key": "sk-inference-secret"},
        "storage": {"root": str(tmp_path / "store")},
        "tracking": {"mlflow_uri": "postgresql://u:tracking-secret@db/mlflow", "pass_k": [2]},
        "pipeline": {"eval_samples": 2},
    }  # fmt: skip


def test_each_process_gets_its_sections_and_the_derived_values(tmp_path: Path) -> None:
    run = config_from_dict(run_dict(tmp_path))
    configs = process_configs(run)
    for name, config in configs.items():
        assert (config.name, config.seed, config.run_work_dir) == ("proc", 3, run.run_work_dir)
        assert config.storage == run.storage
    assert configs.trainer.max_staleness == run.max_staleness == 2  # trainer.max_staleness wins over rollout.eta
    assert configs.trainer.pass_k == [2] and configs.evaluator.pass_k == [2]
    assert configs.evaluator.longest_sequence == run.longest_sequence == 70
    assert configs.scheduler.rollout == run.rollout and configs.trainer.trainer == run.trainer
    assert set(RewardProcessConfig.model_fields) == {"name", "seed", "work_dir", "storage", "reward"}
    assert "tracking" not in TrainerProcessConfig.model_fields and "inference" not in TrainerProcessConfig.model_fields
    assert [name for name, _ in configs.items()] == list(PROCESS_NAMES)


def test_a_process_holds_only_the_secrets_it_uses(tmp_path: Path) -> None:
    configs = process_configs(config_from_dict(run_dict(tmp_path)))
    for name, config in configs.items():
        written = yaml.safe_dump(private_dict(config))
        assert "tracking-secret" not in written  # no process reads the MLflow URI
        assert ("sk-inference-secret" in written) is (name in ("scheduler", "evaluator")), name


@pytest.mark.parametrize(
    "model", [TrainerProcessConfig, SchedulerProcessConfig, EvaluatorProcessConfig, RewardProcessConfig]
)
def test_a_process_config_round_trips_and_a_run_config_is_refused(tmp_path: Path, model: type) -> None:
    run = config_from_dict(run_dict(tmp_path))
    own = next(config for _, config in process_configs(run).items() if isinstance(config, model))
    path = tmp_path / "process.yaml"
    path.write_text(yaml.safe_dump(private_dict(own)))
    assert load_process_config(path, model) == own
    path.write_text(yaml.safe_dump(private_dict(run)))
    with pytest.raises(ConfigError, match=r"tracking: unknown key") as refused:
        load_process_config(path, model)
    assert "not a whole run config" in str(refused.value)


def test_overrides_apply_to_a_process_config_and_bad_values_name_the_key(tmp_path: Path) -> None:
    path = tmp_path / "trainer.yaml"
    path.write_text(yaml.safe_dump(private_dict(process_configs(config_from_dict(run_dict(tmp_path))).trainer)))
    assert load_process_config(path, TrainerProcessConfig, ["trainer.max_steps=7"]).trainer.max_steps == 7
    with pytest.raises(ConfigError, match=rf"^{path}: trainer.batch_groups: Input should be greater than"):
        load_process_config(path, TrainerProcessConfig, ["trainer.batch_groups=0"])


def test_no_process_main_parses_the_run_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Given the whole run config, each process's entry point refuses it (exit 2) naming the
    file it should read: it parses only its own model."""
    from asyncrl.tasks.evaluator.main import main as evaluator_main
    from asyncrl.tasks.reward.server import main as reward_main
    from asyncrl.tasks.scheduler.main import main as scheduler_main
    from asyncrl.tasks.trainer.main import main as trainer_main

    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(private_dict(config_from_dict(run_dict(tmp_path)))))
    for name, main in (("trainer", trainer_main), ("scheduler", scheduler_main), ("evaluator", evaluator_main),
                       ("reward service", reward_main)):  # fmt: skip
        assert main(["--config", str(path)]) == 2, name
        err = capsys.readouterr().err
        assert f"{name}: config error" in err and "not a whole run config" in err, err
