"""The config of evaluation during training (``pipeline.eval_every``,
``pipeline.training_eval``): off by default, and every bad value refused naming its field,
also the rules across sections (held-out file, parallelism, devices of the other local
components)."""

from __future__ import annotations

from typing import Any

import pytest

from asyncrl.configs.loading import ConfigError, apply_overrides, config_from_dict


def raw(*overrides: str) -> dict[str, Any]:
    base = {
        "model": {"path": "/m"},
        "data": {"train_path": "/d/train.parquet", "eval_path": "/d/heldout.parquet"},
        "storage": {"root": "/tmp/run"},
    }
    return apply_overrides(base, list(overrides))


def test_off_by_default_with_documented_defaults() -> None:
    config = config_from_dict(raw())
    assert config.pipeline.eval_every == 0
    settings = config.pipeline.training_eval
    assert (settings.prompts, settings.samples, settings.devices, settings.nice) == (32, 2, None, 10)
    assert settings.finish_timeout_s == 300.0


def test_turned_on_by_overrides() -> None:
    config = config_from_dict(raw("pipeline.eval_every=5", "pipeline.training_eval.prompts=8",
                                  "pipeline.training_eval.samples=1", "pipeline.training_eval.devices=[1]"))  # fmt: skip
    assert config.pipeline.eval_every == 5 and config.pipeline.training_eval.prompts == 8
    assert config.pipeline.training_eval.devices == (1,)


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        ("pipeline.eval_every=-1", "pipeline.eval_every: Input should be greater than or equal to 0"),
        ("pipeline.training_eval.prompts=0", "pipeline.training_eval.prompts: Input should be greater than or equal to 1"),
        ("pipeline.training_eval.samples=0", "pipeline.training_eval.samples: Input should be greater than or equal to 1"),
        ("pipeline.training_eval.nice=20", "pipeline.training_eval.nice: Input should be less than or equal to 19"),
        ("pipeline.training_eval.finish_timeout_s=-1", "pipeline.training_eval.finish_timeout_s"),
        ("pipeline.training_eval.devices=[0, 0]", "pipeline.training_eval.devices: [0, 0] must be distinct device ids"),
        ("pipeline.training_eval.devices=[-1]", "pipeline.training_eval.devices: [-1] must be distinct device ids"),
        ("pipeline.training_eval.every=3", "pipeline.training_eval.every: unknown key"),
    ],
)
def test_bad_values_are_refused_naming_the_field(override: str, needle: str) -> None:
    with pytest.raises(ConfigError) as error:
        config_from_dict(raw(override), source="run.yaml")
    assert needle in str(error.value), str(error.value)
    assert str(error.value).startswith("run.yaml: ")


def test_evaluation_during_training_needs_the_held_out_file() -> None:
    settings = raw("pipeline.eval_every=4")
    del settings["data"]["eval_path"]
    with pytest.raises(ConfigError, match=r"run.yaml: pipeline.eval_every: 4 .* set data.eval_path"):
        config_from_dict(settings, source="run.yaml")
    config_from_dict(raw("pipeline.eval_every=0"))  # off: no held-out file needed


def test_its_devices_follow_the_parallelism_and_the_overlap_rule() -> None:
    with pytest.raises(ConfigError, match=r"pipeline.training_eval.devices: \[1\] must be 2 device ids "
                                          r"\(inference.tensor_parallel_size=2\)"):
        config_from_dict(raw("pipeline.eval_every=1", "pipeline.training_eval.devices=[1]",
                             "inference.tensor_parallel_size=2"))  # fmt: skip
    with pytest.raises(ConfigError, match=r"pipeline.training_eval.devices: devices \[1\] are also in "
                                          r"inference.devices\[0\] on the same placement"):
        config_from_dict(raw("pipeline.eval_every=1", "pipeline.training_eval.devices=[1]", "inference.devices=[[1]]"))
    with pytest.raises(ConfigError, match=r"devices \[2\] are also in trainer.devices"):
        config_from_dict(raw("pipeline.eval_every=1", "pipeline.training_eval.devices=[2]", "trainer.devices=[2]"))
    # allowed: shared on purpose, a rollout server on another machine, or evaluation off
    config_from_dict(raw("pipeline.eval_every=1", "pipeline.training_eval.devices=[1]", "inference.devices=[[1]]",
                         "placement.share_devices=true"))  # fmt: skip
    config_from_dict(raw("pipeline.eval_every=1", "pipeline.training_eval.devices=[1]", "inference.devices=[[1]]",
                         "placement.rollout_server={deployment: component/rollout-server}"))  # fmt: skip
    config_from_dict(raw("pipeline.training_eval.devices=[1]", "inference.devices=[[1]]"))
