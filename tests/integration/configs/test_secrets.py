"""The one redaction rule, where configs are shown or stored, and where credentials come from."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import s3_servers
import yaml

from asyncrl.cli.main import main as asyncrl_main
from asyncrl.configs.loading import ConfigError, config_from_dict, frozen_yaml, load_config, private_dict, public_dict
from asyncrl.configs.run_config import RunConfig
from asyncrl.configs.secrets import REDACTED, is_secret_key, redact, strip_uri_password
from asyncrl.flows.prefect_api.credentials import apply_storage_credentials, credential_environment

API_KEY = "canary-api-key-3f9a"
DB_PASSWORD = "canary-db-password-77c1"


def config_with_secrets(tmp_path: Path) -> dict[str, Any]:
    return {
        "model": {"path": "/m"},
        "data": {"train_path": "/d/train.parquet"},
        "rollout": {"max_new_tokens": 32}, "inference": {"host": "10.0.0.5", "api_key": API_KEY},
        "trainer": {"micro_batch_tokens": 512},
        "storage": {"root": str(tmp_path / "store"), "options": {"endpoint_url": "http://127.0.0.1:8333"}},
        "tracking": {"mlflow_uri": f"postgresql://mlflow:{DB_PASSWORD}@db:5432/mlflow"},
    }


@pytest.mark.parametrize(
    ("key", "secret"),
    [
        ("token", True), ("api_key", True), ("API-KEY", True), ("aws_secret_access_key", True), ("key", True),
        ("password", True), ("max_new_tokens", False), ("micro_batch_tokens", False), ("keep_versions", False),
        ("session", False), ("tokenizer", False), ("endpoint_url", False),
    ],
)
def test_secret_keys_are_named_exactly(key: str, secret: bool) -> None:
    assert is_secret_key(key) is secret


def test_redact_strips_uri_passwords_and_secret_keys_only() -> None:
    value = {
        "max_new_tokens": 256,
        "micro_batch_tokens": 4096,
        "mlflow_uri": "postgresql://user:pw@host:5432/db",
        "endpoint_url": "https://AKIA:s3cr3t@s3.example.com/bucket",
        "plain": "http://host:8080/path",
        "nested": [{"token": "t0k3n", "name": "x"}],
    }
    assert redact(value) == {
        "max_new_tokens": 256,
        "micro_batch_tokens": 4096,
        "mlflow_uri": f"postgresql://user:{REDACTED}@host:5432/db",
        "endpoint_url": f"https://AKIA:{REDACTED}@s3.example.com/bucket",
        "plain": "http://host:8080/path",
        "nested": [{"token": REDACTED, "name": "x"}],
    }
    assert strip_uri_password("no uri here: a:b@c") == "no uri here: a:b@c"


def test_public_dump_hides_secrets_and_private_dump_round_trips(tmp_path: Path) -> None:
    config = config_from_dict(config_with_secrets(tmp_path))
    shown = frozen_yaml(config) + json.dumps(public_dict(config))
    assert API_KEY not in shown and DB_PASSWORD not in shown
    public = public_dict(config)
    assert public["rollout"]["max_new_tokens"] == 32 and public["trainer"]["micro_batch_tokens"] == 512
    assert public["inference"]["api_key"] == REDACTED
    assert public["tracking"]["mlflow_uri"] == f"postgresql://mlflow:{REDACTED}@db:5432/mlflow"
    private = private_dict(config)
    assert private["inference"]["api_key"] == API_KEY and DB_PASSWORD in private["tracking"]["mlflow_uri"]
    assert config_from_dict(private) == config


def test_config_show_prints_no_secret(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config_with_secrets(tmp_path)))
    assert asyncrl_main(["config", "show", str(path)]) == 0
    out = capsys.readouterr().out
    assert API_KEY not in out and DB_PASSWORD not in out
    assert "max_new_tokens: 32" in out and "micro_batch_tokens: 512" in out


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"key": "AKIA", "secret": "s"}, "storage.options.key, storage.options.secret"),
        ({"client_kwargs": {"aws_session_token": "t"}}, "storage.options.client_kwargs.aws_session_token"),
        ({"endpoint_url": "http://user:pw@127.0.0.1:8333"}, "storage.options.endpoint_url"),
    ],
)
def test_credentials_in_storage_options_are_refused(tmp_path: Path, options: dict[str, Any], named: str) -> None:
    raw = config_with_secrets(tmp_path)
    raw["storage"]["options"] = options
    with pytest.raises(ConfigError, match=f"{named}: credentials do not belong in the run config") as caught:
        config_from_dict(raw)
    assert "pw" not in str(caught.value).replace("pw@", "") and "AKIA" not in str(caught.value)


@pytest.mark.parametrize(
    ("section", "value", "message"),
    [
        ("storage.root", "gs://bucket/run", "scheme gs:// is not supported for a run root"),
        ("storage.root", "s3://AKIA:s3cr3t@bucket/run", "storage.root: holds a password"),
        ("tracking.mlflow_uri", "postgresql://u:***@h/db", "tracking.mlflow_uri: holds a redacted secret"),
        ("inference.api_key", REDACTED, "inference.api_key: holds a redacted secret"),
        ("inference.api_key", "*" * 10, "inference.api_key: holds a redacted secret"),
    ],
)
def test_unusable_values_are_refused_by_name(tmp_path: Path, section: str, value: str, message: str) -> None:
    raw = config_with_secrets(tmp_path)
    head, field = section.split(".")
    raw[head][field] = value
    with pytest.raises(ConfigError, match=message.replace("*", r"\*")):
        config_from_dict(raw)


def test_api_key_from_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    raw = config_with_secrets(tmp_path)
    del raw["inference"]["api_key"]
    monkeypatch.delenv("ASYNCRL_ROLLOUT_API_KEY", raising=False)
    with pytest.raises(ConfigError, match="inference.api_key: required when inference.host is '10.0.0.5'"):
        config_from_dict(raw)
    monkeypatch.setenv("ASYNCRL_ROLLOUT_API_KEY", API_KEY)
    config = config_from_dict(raw)
    assert config.inference.api_key is None and config.inference.api_key_value() == API_KEY


def test_non_utf8_config_names_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "latin1.yaml"
    path.write_bytes(b"name: run\nmodel: {path: /m\xe9}\n")
    with pytest.raises(ConfigError, match=rf"{path}: line 2: not UTF-8 text"):
        load_config(path)


def test_secret_block_value_maps_to_botocore_environment() -> None:
    env = credential_environment("store", '{"key": "AKIA", "secret": "s", "token": "t"}')
    assert env == {"AWS_ACCESS_KEY_ID": "AKIA", "AWS_SECRET_ACCESS_KEY": "s", "AWS_SESSION_TOKEN": "t"}
    with pytest.raises(ValueError, match="unknown credential 'region'"):
        credential_environment("store", {"key": "a", "secret": "b", "region": "x"})
    with pytest.raises(ValueError, match="needs an access key id and a secret access key"):
        credential_environment("store", {"key": "a"})
    with pytest.raises(ValueError, match="not a JSON object"):
        credential_environment("store", "AKIA")


def test_flow_parameters_in_prefect_hold_no_secret(prefect_server: None, tmp_path: Path) -> None:
    """A config passed to a flow reaches the flow whole, while Prefect's record of the flow
    run's parameters (what its UI and API show) holds only redacted values."""
    from prefect import flow
    from prefect.client.orchestration import get_client

    @flow(name="secrets-probe")
    def probe(config: RunConfig) -> list[str]:
        assert config.inference.api_key is not None
        return [config.inference.api_key.get_secret_value(), config.tracking.mlflow_uri]

    config = config_from_dict(config_with_secrets(tmp_path))
    state = probe(config, return_state=True)
    assert state.result() == [API_KEY, config.tracking.mlflow_uri]
    with get_client(sync_client=True) as client:
        stored = client.read_flow_run(state.state_details.flow_run_id).parameters
    text = json.dumps(stored)
    assert API_KEY not in text and DB_PASSWORD not in text
    assert stored["config"]["inference"]["api_key"] == REDACTED
    # a deployment run parses those parameters back: the redacted values are refused by name
    with pytest.raises(ConfigError, match="inference.api_key: holds a redacted secret"):
        config_from_dict(stored["config"])


def test_credentials_block_opens_an_s3_root_without_credentials_in_config(
    prefect_server: None, moto_endpoint: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from prefect.blocks.system import Secret

    from asyncrl.configs.storage import StorageConfig
    from asyncrl.storage import fs

    Secret(value={"aws_access_key_id": moto_endpoint.key, "aws_secret_access_key": moto_endpoint.secret}).save(
        "asyncrl-test-store", overwrite=True
    )
    bucket = s3_servers.create_bucket(moto_endpoint)
    storage = StorageConfig(
        root=f"s3://{bucket}/run", options={"endpoint_url": moto_endpoint.url}, credentials_block="asyncrl-test-store"
    )
    environ: dict[str, str] = {}
    assert apply_storage_credentials(storage, environ) == ["AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"]
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    root = fs.open_root(storage.root, storage.options)
    fs.put_if_absent(root, "probe.txt", b"ok")
    assert fs.read_bytes(root, "probe.txt") == b"ok"
    missing = StorageConfig(root=f"s3://{bucket}/run", credentials_block="asyncrl-no-such-block")
    with pytest.raises(ValueError, match="Prefect Secret block 'asyncrl-no-such-block' not found"):
        apply_storage_credentials(missing, {})
