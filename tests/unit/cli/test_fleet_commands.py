"""``asyncrl fleet``: the one line a user sees for an index of the run's own, a server already
registered and a drain of a server that is not registered; ``list`` shows what is registered
(joining and draining run on the real stack in tests/e2e/flows/test_elastic_fleet.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from asyncrl.cli.main import main
from asyncrl.storage.fs import open_root
from asyncrl.tasks.inference.server import RolloutServerHandle
from asyncrl.tasks.inference.server_registry import register_server


def run_config(tmp_path: Path, **inference: object) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({
        "name": "fleet-cli", "work_dir": str(tmp_path / "work"), "model": {"path": str(tmp_path / "model")},
        "data": {"train_path": str(tmp_path / "train.jsonl")}, "storage": {"root": str(tmp_path / "store")},
        "inference": {"num_servers": 2, **inference},
    }))  # fmt: skip
    return path


def test_an_index_of_the_runs_own_or_one_already_registered_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:  # fmt: skip
    config = run_config(tmp_path)
    assert main(["fleet", "add", str(config), "--index", "1"]) == 2
    assert "--index 1: rollout servers 0..1 are the run's own (inference.num_servers 2); add one at index 2" in (
        capsys.readouterr().err
    )
    register_server(open_root(str(tmp_path / "store")), "server-2",
                    RolloutServerHandle("http://127.0.0.1:1", 7, 7, Path("/dev/null"), "m", None))  # fmt: skip
    assert main(["fleet", "add", str(config), "--index", "2"]) == 2
    assert "--index 2: server-2 is already registered in run fleet-cli" in capsys.readouterr().err
    assert main(["fleet", "list", str(config)]) == 0
    out = capsys.readouterr().out
    assert "run fleet-cli: 1 rollout server(s) registered" in out and "server-2  http://127.0.0.1:1  pid 7" in out


def test_a_drain_of_a_server_not_registered_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["fleet", "drain", str(run_config(tmp_path)), "--index", "3"]) == 2
    assert "--index 3: server-3 is not registered in run fleet-cli" in capsys.readouterr().err


def test_an_add_through_a_deployment_starts_its_flow_run_with_the_config_without_secrets(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:  # fmt: skip
    """The edge to Prefect's API replaced: what ``fleet add --deployment`` asks of it."""
    import prefect.deployments

    from asyncrl.storage.heartbeats import request_stop, stop_requested

    asked: list[tuple[str, dict[str, object], object]] = []

    class FlowRun:
        name, id = "brisk-otter", "0f1e"

    def run_deployment(name: str, parameters: dict[str, object], timeout: object) -> FlowRun:
        asked.append((name, parameters, timeout))
        return FlowRun()

    monkeypatch.setattr(prefect.deployments, "run_deployment", run_deployment)
    monkeypatch.setenv("ASYNCRL_ROLLOUT_API_KEY", "sk-fleet-secret")
    config = run_config(tmp_path, host="0.0.0.0")
    root = open_root(str(tmp_path / "store"))
    request_stop(root, "rollout-server-2", 0, "")  # left by an earlier drain of index 2
    assert main(["fleet", "add", str(config), "--index", "2", "--deployment", "component/rollout-server"]) == 0
    ((name, parameters, timeout),) = asked
    assert name == "component/rollout-server" and timeout == 0
    assert parameters["kind"] == "rollout-server" and parameters["index"] == 2
    assert parameters["config"]["inference"]["api_key"] is None and "sk-fleet-secret" not in str(parameters)
    assert not stop_requested(root, "rollout-server-2", 0, "")  # cleared: the new server is not stopped at once
    assert "started flow run brisk-otter (0f1e) of component/rollout-server: server-2 joins run fleet-cli" in (
        capsys.readouterr().out
    )
