"""The reward config: defaults validate, bad values name their field."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from asyncrl.tasks.reward.config import PluginRewardConfig, RewardConfig


def test_defaults_refuse_unsandboxed_code() -> None:
    config = RewardConfig()
    assert config.code.allow_unsandboxed is False
    assert config.plugin is None


@pytest.mark.parametrize("spec", ["module_only", ":fn", "mod:", "mod:not-an-identifier"])
def test_plugin_function_needs_module_and_name(spec: str) -> None:
    with pytest.raises(ValidationError, match="must look like 'package.module:function'"):
        PluginRewardConfig(function=spec)


@pytest.mark.parametrize(
    ("data", "field"),
    [
        ({"code": {"limits": {"cpu": 3}}}, "code.limits.cpu"),
        ({"code": {"limits": {"nproc": 1}}}, "code.limits.nproc"),
        ({"code": {"scoring": "best"}}, "code.scoring"),
        ({"math": {"timeout_s": 0}}, "math.timeout_s"),
        ({"pool": {"workers": 0}}, "pool.workers"),
    ],
)
def test_bad_values_name_their_field(data: dict[str, object], field: str) -> None:
    with pytest.raises(ValidationError, match=field.replace(".", r"\.")):
        RewardConfig.model_validate(data)
