"""Placement settings of the run config: device sets, trainer processes and nodes, remote
placements and heartbeats are checked when the config is read, and refused by name."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from asyncrl.configs.loading import ConfigError, config_from_dict, load_config
from asyncrl.configs.placement import RemotePlacement
from asyncrl.configs.run_config import RunConfig


def config(**sections: dict[str, Any]) -> RunConfig:
    return config_from_dict(
        {"model": {"path": "/m"}, "data": {"train_path": "/d/train.parquet"}, "storage": {"root": "/tmp/run"}, **sections}
    )


def refused(message: str, **sections: dict[str, Any]) -> None:
    with pytest.raises(ConfigError, match=message):
        config(**sections)


def test_no_placement_by_default() -> None:
    plain = config()
    assert plain.inference.devices is None and plain.trainer.devices is None
    assert plain.inference.tensor_parallel_size == 1 and plain.trainer.processes == 1 and plain.trainer.nodes == 1
    assert plain.placement.rollout_server == plain.placement.trainer == plain.placement.scheduler == "local"
    assert plain.placement.share_devices is False


def test_overlapping_rollout_sets_are_refused() -> None:
    refused(r"^config: inference\.devices\[1\]: devices \[0\] are also in inference\.devices\[0\] on the same placement; "
            r"give each component its own devices, or set placement\.share_devices: true",
            inference={"num_servers": 2, "devices": [[0], [0]]})
    refused(r"inference\.devices\[2\]: devices \[3\] are also in inference\.devices\[1\]",
            inference={"num_servers": 3, "tensor_parallel_size": 2, "devices": [[0, 1], [2, 3], [3, 4]]})
    apart = config(inference={"num_servers": 2, "tensor_parallel_size": 2, "devices": [[0, 1], [2, 3]]})
    assert apart.inference.devices == [(0, 1), (2, 3)]


def test_rollout_and_trainer_overlap_is_refused() -> None:
    refused(r"^config: trainer\.devices: devices \[1\] are also in inference\.devices\[0\] on the same placement",
            inference={"tensor_parallel_size": 2, "devices": [[0, 1]]}, trainer={"processes": 2, "devices": [1, 2]})
    assert config(inference={"devices": [[0]]}, trainer={"devices": [1]}).trainer.devices == (1,)


def test_share_devices_allows_overlap() -> None:
    shared = config(inference={"num_servers": 2, "devices": [[0], [0]]}, trainer={"devices": [0]},
                    placement={"share_devices": True})
    assert shared.inference.devices == [(0,), (0,)] and shared.trainer.devices == (0,)


def test_components_on_different_placements_may_reuse_ids() -> None:
    # device ids are each machine's own: a remote server's GPU 0 is not the local trainer's
    split = config(inference={"devices": [[0]]}, trainer={"devices": [0]},
                   placement={"rollout_server": {"deployment": "component/rollout-server"}})
    assert isinstance(split.placement.rollout_server, RemotePlacement)


def test_device_sets_fit_servers_and_tensor_parallel_size() -> None:
    refused(r"^config: inference\.devices: 1 device sets for inference\.num_servers=2; give one set per server",
            inference={"num_servers": 2, "devices": [[0]]})
    refused(r"inference\.devices\[0\]: \[0\] must be 2 distinct device ids >= 0 \(inference\.tensor_parallel_size=2\)",
            inference={"tensor_parallel_size": 2, "devices": [[0]]})
    refused(r"inference\.devices\[0\]: \[1, 1\] must be 2 distinct device ids", inference={"tensor_parallel_size": 2, "devices": [[1, 1]]})
    refused(r"inference\.devices\[0\]: \[-1\] must be 1 distinct device ids >= 0", inference={"devices": [[-1]]})
    refused(r"inference\.tensor_parallel_size: Input should be greater than or equal to 1", inference={"tensor_parallel_size": 0})


def test_trainer_devices_one_per_process() -> None:
    refused(r"trainer\.devices: \[0\] must be 2 distinct device ids, one per process \(trainer\.processes=2\)",
            trainer={"processes": 2, "devices": [0]})
    refused(r"trainer\.devices: \[3, 3\] must be 2 distinct device ids", trainer={"processes": 2, "devices": [3, 3]})
    refused(r"trainer\.devices: \[-1\] holds a negative id", trainer={"devices": [-1]})
    assert config(trainer={"processes": 2, "devices": [2, 3]}).trainer.devices == (2, 3)


def test_nodes_need_a_rendezvous_and_a_remote_trainer() -> None:
    remote = {"trainer": {"deployment": "component/trainer"}}
    refused(r"^config: trainer\.rendezvous: trainer\.nodes=2 needs the host:port the nodes meet at",
            trainer={"nodes": 2}, placement=remote)
    refused(r"^config: trainer\.nodes: 2 nodes need placement\.trainer to name a deployment",
            trainer={"nodes": 2, "rendezvous": "trainer-0:29400"})
    refused(r"trainer\.rendezvous: String should match pattern", trainer={"rendezvous": "no-port"})
    multi = config(trainer={"nodes": 2, "rendezvous": "trainer-0:29400"}, placement=remote)
    assert multi.trainer.rendezvous == "trainer-0:29400"


def test_job_variables_with_credentials_are_refused() -> None:
    with pytest.raises(ConfigError) as caught:
        config(placement={"rollout_server": {"deployment": "component/rollout-server",
                                             "job_variables": {"env": {"AWS_SECRET_ACCESS_KEY": "leaked-value"}}}})
    message = str(caught.value)
    assert "placement.rollout_server.deployment.job_variables: env.AWS_SECRET_ACCESS_KEY: credentials" in message
    assert "leaked-value" not in message  # never echoed
    fine = config(placement={"rollout_server": {"deployment": "component/rollout-server",
                                                "job_variables": {"image": "asyncrl:gpu", "env": {"HF_HOME": "/cache"}}}})
    assert fine.placement.rollout_server.job_variables["image"] == "asyncrl:gpu"  # type: ignore[union-attr]


def test_deployment_names_flow_and_deployment() -> None:
    refused(r"placement\.trainer\.deployment\.deployment: String should match pattern",
            placement={"trainer": {"deployment": "no-slash"}})


def test_heartbeat_timeout_covers_three_heartbeats() -> None:
    refused(r"^config: placement\.heartbeat_timeout_s: 10\.0 must be at least 3 x placement\.heartbeat_s \(5\.0\)",
            placement={"heartbeat_s": 5, "heartbeat_timeout_s": 10})
    assert config(placement={"heartbeat_s": 5, "heartbeat_timeout_s": 15}).placement.heartbeat_timeout_s == 15


def test_remote_placement_from_yaml(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({
        "model": {"path": "/m"}, "data": {"train_path": "/d/train.parquet"}, "storage": {"root": "s3://bucket/run"},
        "inference": {"num_servers": 2, "devices": [[0], [0]]},
        "trainer": {"processes": 2, "nodes": 2, "rendezvous": "trainer-0:29400", "devices": [0, 1]},
        "placement": {
            "rollout_server": {"deployment": "component/rollout-server", "job_variables": {"gpus": 1}},
            "trainer": {"deployment": "component/trainer", "job_variables": {"gpus": 2}},
            "heartbeat_s": 2, "heartbeat_timeout_s": 30,
        },
    }))  # fmt: skip
    with pytest.raises(ConfigError, match=r"inference\.devices\[1\]: devices \[0\] are also in inference\.devices\[0\]"):
        load_config(path)  # two servers of one deployment count as one placement
    loaded = load_config(path, ["placement.share_devices=true"])
    server, trainer = loaded.placement.rollout_server, loaded.placement.trainer
    assert isinstance(server, RemotePlacement) and server.deployment == "component/rollout-server"
    assert isinstance(trainer, RemotePlacement) and trainer.job_variables == {"gpus": 2}
    assert loaded.placement.scheduler == "local"
    assert loaded.trainer.nodes == 2 and loaded.trainer.devices == (0, 1)
