"""The reward config: defaults validate, bad values name their field."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from asyncrl.configs.reward import PluginRewardConfig, RewardConfig


def test_defaults_refuse_unsandboxed_code() -> None:
    config = RewardConfig()
    assert config.code.allow_unsandboxed is False
    assert config.plugins == {}


@pytest.mark.parametrize("spec", ["module_only", ":fn", "mod:", "mod:not-an-identifier"])
def test_plugin_function_needs_module_and_name(spec: str) -> None:
    with pytest.raises(ValidationError, match="must look like 'package.module:function'"):
        PluginRewardConfig(function=spec)


def test_plugins_are_named() -> None:
    config = RewardConfig.model_validate(
        {"plugins": {"judge": {"function": "pkg.mod:judge"}, "style": {"function": "/x/style.py:score", "timeout_s": 3}}}
    )
    assert sorted(config.plugins) == ["judge", "style"]
    assert config.plugins["style"].timeout_s == 3.0
    assert RewardConfig.model_validate(config.model_dump(mode="json")) == config


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("math", r"reward\.plugins\.math: 'math' is a built-in task"),
        ("code", r"reward\.plugins\.code: 'code' is a built-in task"),
        ("my-judge", r"reward\.plugins\.my-judge: plug-in name 'my-judge' must be an identifier"),
    ],
)
def test_plugin_names_refuse_builtin_tasks_and_non_identifiers(name: str, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        RewardConfig.model_validate({"plugins": {name: {"function": "pkg.mod:judge"}}})


def test_a_bad_plugin_names_its_field_in_the_run_config() -> None:
    from asyncrl.configs.loading import ConfigError, config_from_dict

    with pytest.raises(ConfigError, match=r"reward\.plugins\.math: 'math' is a built-in task"):
        config_from_dict({"reward": {"plugins": {"math": {"function": "pkg.mod:judge"}}}})
    with pytest.raises(ConfigError, match=r"reward\.plugins\.judge\.function: 'judge' must look like"):
        config_from_dict({"reward": {"plugins": {"judge": {"function": "judge"}}}})


@pytest.mark.parametrize(
    ("data", "field"),
    [
        ({"code": {"limits": {"cpu": 3}}}, "code.limits.cpu"),
        ({"code": {"limits": {"nproc": 1}}}, "code.limits.nproc"),
        ({"code": {"scoring": "best"}}, "code.scoring"),
        ({"math": {"timeout_s": 0}}, "math.timeout_s"),
        ({"pool": {"workers": 0}}, "pool.workers"),
        ({"plugin": {"function": "pkg.mod:judge"}}, "plugin"),  # the single plug-in of old: now `plugins`
        ({"plugins": {"judge": {"function": "pkg.mod:judge", "timeout_s": 0}}}, "plugins.judge.timeout_s"),
    ],
)
def test_bad_values_name_their_field(data: dict[str, object], field: str) -> None:
    with pytest.raises(ValidationError, match=field.replace(".", r"\.")):
        RewardConfig.model_validate(data)
