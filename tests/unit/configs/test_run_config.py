"""The run config: every YAML in the repo parses, and bad values are refused by name."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from asyncrl.configs.loading import ConfigError, load_config
from asyncrl.configs.run_config import RunConfig
from asyncrl.configs.loading import apply_overrides, config_from_dict, frozen_yaml, public_dict

REPO = Path(__file__).resolve().parents[3]
CONFIG_FILES = sorted((REPO / "configs").rglob("*.yaml"))


def minimal() -> dict:
    return {
        "model": {"path": "/m"},
        "data": {"train_path": "/d/train.parquet"},
        "storage": {"root": "/tmp/run"},
    }


def test_repo_has_config_files() -> None:
    assert {p.name for p in CONFIG_FILES} >= {"demo.yaml", "qwen-gsm8k.yaml"}


@pytest.mark.parametrize("path", CONFIG_FILES, ids=lambda p: p.name)
def test_every_config_file_in_the_repo_validates(path: Path) -> None:
    config = load_config(path)
    assert isinstance(config, RunConfig)


def test_defaults_fill_sections() -> None:
    config = config_from_dict(minimal())
    assert config.trainer.batch_groups == 8
    assert config.rollout.interrupt_mode == "recompute"
    assert config.max_staleness == config.rollout.eta


def test_overrides_set_typed_values(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(minimal()))
    config = load_config(
        path,
        ["trainer.batch_groups=3", "rollout.eta=0", "rollout.temperature=0.7",
         "trainer.eps_clip_high=0.28", "rollout.interrupt_mode=keep", "trainer.behav_weight_cap=null"],
    )
    assert config.trainer.batch_groups == 3
    assert config.rollout.eta == 0
    assert config.rollout.temperature == pytest.approx(0.7)
    assert config.trainer.eps_clip_high == pytest.approx(0.28)
    assert config.rollout.interrupt_mode == "keep"
    assert config.trainer.behav_weight_cap is None


def test_later_override_wins_and_source_is_untouched() -> None:
    raw = minimal()
    result = apply_overrides(raw, ["trainer.max_steps=5", "trainer.max_steps=7"])
    assert result["trainer"]["max_steps"] == 7
    assert "trainer" not in raw


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        (["trainer.batch_groups=0"], "trainer.batch_groups: Input should be greater than or equal to 1"),
        (["rollout.eta=-1"], "rollout.eta: Input should be greater than or equal to 0"),
        (["rollout.max_groups_in_flight=0"], "rollout.max_groups_in_flight: Input should be greater than or equal to 1"),
        (["trainer.batch_size=8"], "trainer.batch_size: unknown key"),
        (["bogus.section=1"], "bogus: unknown key"),
        (["trainer.batch_groups=many"], "trainer.batch_groups: Input should be a valid integer"),
        (["rollout.interrupt_mode=pause"], "rollout.interrupt_mode: Input should be 'recompute' or 'keep'"),
        (["trainer.micro_batch_tokens=100"], "trainer.micro_batch_tokens: 100 is smaller than one sequence's maximum"),
        (["trainer.advantage=rloo", "rollout.n_samples=1"], "trainer.advantage: 'rloo' needs rollout.n_samples >= 2"),
        (["trainer.mini_batches=9"], "trainer.mini_batches: 9 exceeds trainer.batch_groups"),
        (["inference.host=0.0.0.0"], "inference.api_key: required when inference.host is '0.0.0.0'"),
        (["trainer.behav_cap_mode=drop"], "trainer.behav_cap_mode: Input should be 'mask' or 'clamp'"),
        (["pipeline.synthetic_data.n_sft=10"], "pipeline.synthetic_data.n_sft: set data.sft_path"),
        (
            ["pipeline.synthetic_data.sft_answer_only_share=0.3"],
            "pipeline.synthetic_data.sft_answer_only_share: needs n_sft > 0",
        ),
        (["pipeline.synthetic_data.sft_answer_only_share=1.5"], "sft_answer_only_share: Input should be less than"),
    ],
)
def test_bad_values_are_refused_naming_the_key(tmp_path: Path, overrides: list[str], needle: str) -> None:
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(minimal()))
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides)
    assert needle in str(info.value)
    assert str(path) in str(info.value)


def test_missing_section_is_named() -> None:
    raw = minimal()
    del raw["storage"]
    with pytest.raises(ConfigError, match="storage: Field required"):
        config_from_dict(raw)


@pytest.mark.parametrize("override", ["novalue", "=3", "a..b=1", "trainer.optimizer.lr=[1"])
def test_malformed_overrides(override: str) -> None:
    with pytest.raises(ConfigError, match="override"):
        apply_overrides(minimal(), [override])


def test_override_into_a_value_is_refused() -> None:
    with pytest.raises(ConfigError, match="model.path is a value, not a section"):
        apply_overrides(minimal(), ["model.path.x=1"])


def test_file_errors_name_the_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "absent.yaml")
    broken = tmp_path / "broken.yaml"
    broken.write_text("model: [unclosed\n")
    with pytest.raises(ConfigError, match=f"{broken}: not valid YAML"):
        load_config(broken)
    scalar = tmp_path / "scalar.yaml"
    scalar.write_text("42\n")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(scalar)


def test_the_public_dump_hides_the_api_key_and_uri_passwords() -> None:
    raw = minimal()
    raw["storage"]["options"] = {"endpoint_url": "http://127.0.0.1:8333"}
    raw["inference"] = {"host": "10.0.0.5", "api_key": "server-api-key"}
    raw["tracking"] = {"mlflow_uri": "postgresql://mlflow:db-password@db:5432/mlflow"}
    config = config_from_dict(raw)
    dumped = frozen_yaml(config) + repr(public_dict(config))
    for secret in ("server-api-key", "db-password"):
        assert secret not in dumped
    assert "postgresql://mlflow:***@db:5432/mlflow" in dumped


def test_secret_values_are_not_echoed_in_errors() -> None:
    raw = minimal()
    raw["inference"] = {"api_key": ["not", "a", "string"]}
    with pytest.raises(ConfigError) as info:
        config_from_dict(raw)
    assert "inference.api_key" in str(info.value)
    assert "'not'" not in str(info.value)


def test_the_tool_task_s_demonstrations_need_the_episode_s_calc_tool_named_in_its_options() -> None:
    demo = REPO / "configs" / "demo-tool.yaml"
    raw = yaml.safe_load(demo.read_text())
    assert load_config(str(demo)).rollout.episode.options["tools"][0]["function"]["name"] == "calc"  # type: ignore[union-attr]
    del raw["rollout"]["episode"]["options"]["tools"]
    with pytest.raises(ValueError, match=r"rollout\.episode\.options\.tools: the tool task's demonstrations call the `calc` tool"):
        RunConfig.model_validate(raw)
    raw["pipeline"]["synthetic_data"]["n_sft"] = 0  # no demonstrations: nothing to render them with
    RunConfig.model_validate(raw)
