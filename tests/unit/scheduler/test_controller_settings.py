"""The controller's settings from the scheduler's process config: the ``rollout`` section as it
is (the cap on groups in flight included), the sampling derived from it and ``data``, and the
values handed down (the run's name and seed, ``trainer.batch_groups``)."""

from __future__ import annotations

from pathlib import Path

from asyncrl.configs.processes import process_configs
from asyncrl.configs.run_config import RunConfig
from asyncrl.tasks.scheduler.setup import controller_settings


def test_the_scheduler_config_reaches_the_controller_whole(tmp_path: Path) -> None:
    sections = {"name": "ctl", "seed": 5, "model": {"path": str(tmp_path / "m")},
                "data": {"train_path": str(tmp_path / "t.parquet"), "max_prompt_tokens": 40},
                "trainer": {"batch_groups": 3}, "storage": {"root": str(tmp_path / "store")}}  # fmt: skip
    capped = process_configs(RunConfig.model_validate({**sections, "rollout": {"max_groups_in_flight": 3, "n_samples": 6}}))
    settings = controller_settings(capped.scheduler, (7, 9), max_groups=12)
    assert settings.rollout is capped.scheduler.rollout and settings.rollout.max_groups_in_flight == 3
    assert (settings.run_id, settings.seed, settings.batch_groups, settings.max_groups) == ("ctl", 5, 3, 12)
    sampling = settings.sampling
    assert (sampling.n_samples, sampling.max_prompt_tokens, sampling.stop_token_ids) == (6, 40, (7, 9))
    assert (sampling.max_new_tokens, sampling.temperature, sampling.ignore_eos) == (256, 1.0, False)
    uncapped = process_configs(RunConfig.model_validate(sections)).scheduler
    assert controller_settings(uncapped, (), None).rollout.max_groups_in_flight is None
