"""What the run's components are configured with, from the run config (:mod:`asyncrl.tasks.placement.launch_settings`)."""

from __future__ import annotations

from pathlib import Path

from asyncrl.configs.run_config import RunConfig
from asyncrl.tasks.scheduler.setup import controller_settings


def test_the_cap_on_groups_in_flight_reaches_the_controller(tmp_path: Path) -> None:
    sections = {"model": {"path": str(tmp_path / "m")}, "data": {"train_path": str(tmp_path / "t.parquet")},
                "storage": {"root": str(tmp_path / "store")}}  # fmt: skip
    capped = RunConfig.model_validate({**sections, "rollout": {"max_groups_in_flight": 3}})
    assert controller_settings(capped, (), None).max_groups_in_flight == 3
    assert controller_settings(RunConfig.model_validate(sections), (), None).max_groups_in_flight is None
