"""The ``inference`` section (the vLLM servers) and the keys that moved into it from
``rollout``: a config file or an override that still uses an old key is refused naming the
new one."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from asyncrl.configs.inference import MOVED_KEYS, InferenceConfig, moved_key, moved_keys_error
from asyncrl.configs.loading import ConfigError, apply_overrides, config_from_dict, load_config
from asyncrl.configs.rollout import RolloutConfig
from asyncrl.configs.run_config import RunConfig

SERVER_KEYS = {"num_servers", "host", "base_port", "api_key", "kv_cache_gib", "max_num_seqs",
               "worker_in_engine_process", "fork_engine_core", "cpu_cores", "tensor_parallel_size", "devices"}  # fmt: skip
MOVED_FROM_ROLLOUT = SERVER_KEYS - {"max_num_seqs"}  # added to `inference` after the move, never in `rollout`


def minimal() -> dict:
    return {"model": {"path": "/m"}, "data": {"train_path": "/d/train.parquet"}, "storage": {"root": "/tmp/run"}}


def write(tmp_path: Path, raw: dict) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def test_the_servers_settings_are_their_own_section() -> None:
    assert set(InferenceConfig.model_fields) == SERVER_KEYS
    assert not SERVER_KEYS & set(RolloutConfig.model_fields)
    assert "interrupt_mode" in RolloutConfig.model_fields  # the scheduler's choice
    assert RunConfig.model_fields["inference"].annotation is InferenceConfig
    config = config_from_dict({**minimal(), "inference": {"num_servers": 2, "devices": [[0], [1]]}})
    assert config.inference.num_servers == 2 and config.inference.devices == [(0,), (1,)]


def test_the_table_names_every_moved_key() -> None:
    assert MOVED_KEYS == {f"rollout.{key}": f"inference.{key}" for key in MOVED_FROM_ROLLOUT}
    assert moved_key("rollout.devices") == (
        "rollout.devices moved to inference.devices (the vLLM servers' settings are the `inference` section now)"
    )
    assert moved_key("rollout.eta") is None and moved_key("inference.devices") is None
    assert moved_keys_error(minimal()) is None and moved_keys_error({"rollout": None}) is None


def test_an_old_key_in_a_file_names_its_new_place(tmp_path: Path) -> None:
    path = write(tmp_path, {**minimal(), "rollout": {"num_servers": 2, "eta": 1}})
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value) == (
        f"{path}: rollout.num_servers moved to inference.num_servers "
        "(the vLLM servers' settings are the `inference` section now)"
    )


def test_every_old_key_in_a_file_is_named_at_once(tmp_path: Path) -> None:
    path = write(tmp_path, {**minimal(), "rollout": {"devices": [[0]], "host": "10.0.0.5", "n_samples": 2}})
    with pytest.raises(ConfigError, match=r"rollout\.host moved to inference\.host; "
                                          r"rollout\.devices moved to inference\.devices \("):  # fmt: skip
        load_config(path)


def test_an_old_key_as_an_override_names_the_override_and_its_new_place(tmp_path: Path) -> None:
    path = write(tmp_path, minimal())
    with pytest.raises(ConfigError) as info:
        load_config(path, ["rollout.eta=1", "rollout.devices=[[0]]"])
    assert str(info.value) == (
        "override 'rollout.devices=[[0]]': rollout.devices moved to inference.devices "
        "(the vLLM servers' settings are the `inference` section now)"
    )
    with pytest.raises(ConfigError, match=r"^override 'rollout\.api_key=k': rollout\.api_key moved to inference\.api_key"):
        apply_overrides(minimal(), ["rollout.api_key=k"])
    assert load_config(path, ["inference.devices=[[0]]"]).inference.devices == [(0,)]


def test_an_old_key_set_through_a_whole_section_override_is_refused(tmp_path: Path) -> None:
    path = write(tmp_path, minimal())
    with pytest.raises(ConfigError, match=rf"^{path}: rollout\.base_port moved to inference\.base_port"):
        load_config(path, ["rollout={base_port: 9000}"])


def test_a_flow_parameter_with_an_old_key_is_refused_by_the_model() -> None:
    with pytest.raises(ValueError, match=r"rollout\.kv_cache_gib moved to inference\.kv_cache_gib"):
        RunConfig.model_validate({**minimal(), "rollout": {"kv_cache_gib": 2.0}})


@pytest.mark.parametrize(
    ("section", "needle"),
    [
        ({"num_servers": 2, "devices": [[0]]}, "inference.devices: 1 device sets for inference.num_servers=2"),
        ({"tensor_parallel_size": 2, "devices": [[0]]}, "inference.devices[0]: [0] must be 2 distinct device ids"),
        ({"host": "0.0.0.0"}, "inference.api_key: required when inference.host is '0.0.0.0'"),
        ({"api_key": "***"}, "inference.api_key: holds a redacted secret"),
        ({"cpu_cores": [-1]}, "inference.cpu_cores: CPU ids are ints >= 0"),
    ],
)
def test_the_sections_rules_name_the_new_keys(
    section: dict, needle: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("ASYNCRL_ROLLOUT_API_KEY", raising=False)
    with pytest.raises(ConfigError) as info:
        config_from_dict({**minimal(), "inference": section})
    assert needle in str(info.value)
