"""The evaluator as a component of the run: its server's launch (devices, GPU memory share,
CPU priority), and the run's policy for it: its failure past the restart budget is a warning
and training goes on; at the end the run waits for it a bounded time, then stops it, naming
a version whose evaluation is abandoned."""

from __future__ import annotations

import logging
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest

from asyncrl.configs.run_config import RunConfig
from asyncrl.storage.evaluations import EvaluationStore, EvaluatorState
from asyncrl.configs.cpus import machine_cpus
from asyncrl.tasks.placement.launch_settings import evaluator_server_config, server_config
from asyncrl.tasks.system.run_paths import run_paths
from asyncrl.tasks.placement.devices import DeviceError, Machine
from asyncrl.tasks.launch.rl import RunStop, _raise_first_failure, _wait_evaluator, run_components
from asyncrl.tasks.launch.supervisor import ComponentFailed, ComponentOutcome

GPUS_4 = Machine(gpus=("0", "1", "2", "3"), gpu_source="fake: 4 GPUs")


def run_config(tmp_path: Path, **sections: dict[str, Any]) -> RunConfig:
    return RunConfig.model_validate({
        "work_dir": str(tmp_path / "work"),
        "model": {"path": str(tmp_path / "model")},
        "data": {"train_path": str(tmp_path / "train.parquet"), "eval_path": str(tmp_path / "heldout.parquet")},
        "storage": {"root": str(tmp_path / "store")},
        **sections,
    })  # fmt: skip


def model_dir(tmp_path: Path) -> Path:
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text("{}")
    return model


def test_its_server_is_launched_on_its_own_devices_at_low_priority(tmp_path: Path) -> None:
    config = run_config(tmp_path, inference={"devices": [[0]]},
                        pipeline={"eval_every": 2, "training_eval": {"devices": [3], "nice": 15}})  # fmt: skip
    paths = run_paths(config)
    launch = evaluator_server_config(config, paths, model_dir(tmp_path), GPUS_4)
    assert launch.cuda_visible_devices == "3" and launch.gpu_memory_utilization is None
    assert launch.session_nice == 15 and launch.port == 0 and launch.log_path == paths.log("evaluator-server.log")
    assert server_config(config, paths, model_dir(tmp_path), 0, GPUS_4).session_nice is None  # rollout: unchanged
    cpu = max(machine_cpus())  # a real CPU: the launch checks it exists here
    pinned = run_config(tmp_path, pipeline={"eval_every": 2, "training_eval": {"devices": [cpu]}})
    on_cpu = evaluator_server_config(pinned, paths, model_dir(tmp_path), Machine(gpus=(), cpus=machine_cpus()))
    assert on_cpu.cpu_cores == (cpu,) and on_cpu.cuda_visible_devices is None
    with pytest.raises(DeviceError, match=r"^pipeline\.training_eval\.devices: device 3 is not on this machine"):
        evaluator_server_config(config, paths, model_dir(tmp_path), Machine(gpus=("0", "1"), gpu_source="fake"))


def test_a_shared_gpu_splits_its_memory_with_the_evaluator(tmp_path: Path) -> None:
    config = run_config(tmp_path, inference={"devices": [[0]]}, placement={"share_devices": True},
                        pipeline={"eval_every": 2, "training_eval": {"devices": [0]}})  # fmt: skip
    paths = run_paths(config)
    assert evaluator_server_config(config, paths, model_dir(tmp_path), GPUS_4).gpu_memory_utilization == 0.45
    assert server_config(config, paths, model_dir(tmp_path), 0, GPUS_4).gpu_memory_utilization == 0.45


def test_inference_max_num_seqs_reaches_rollout_and_evaluator_servers(tmp_path: Path) -> None:
    config = run_config(tmp_path, inference={"max_num_seqs": 400}, pipeline={"eval_every": 2})
    paths = run_paths(config)
    assert server_config(config, paths, model_dir(tmp_path), 0, GPUS_4).max_num_seqs == 400
    assert evaluator_server_config(config, paths, model_dir(tmp_path), GPUS_4).max_num_seqs == 400
    default = run_config(tmp_path)
    assert server_config(default, paths, model_dir(tmp_path), 0, GPUS_4).max_num_seqs is None


def test_the_run_has_an_evaluator_only_when_asked(tmp_path: Path) -> None:
    off = run_config(tmp_path)
    assert "evaluator" not in [kind for kind, _ in run_components(off, run_paths(off), drain=False)]
    on = run_config(tmp_path, pipeline={"eval_every": 3})
    kinds = [kind for kind, _ in run_components(on, run_paths(on), drain=False)]
    assert kinds[-1] == "evaluator" and kinds.count("evaluator") == 1


def done(outcome: ComponentOutcome | None = None, error: BaseException | None = None) -> Future[ComponentOutcome]:
    future: Future[ComponentOutcome] = Future()
    if error is not None:
        future.set_exception(error)
    elif outcome is not None:
        future.set_result(outcome)
    return future


def test_an_evaluator_failure_is_a_warning_and_the_run_goes_on(caplog: pytest.LogCaptureFixture) -> None:
    failed = ComponentFailed("evaluator", "exited with status 1", 3, "Traceback ...")
    futures = {"trainer": done(), "evaluator": done(error=failed)}
    failures: dict[str, str] = {}
    with caplog.at_level(logging.WARNING, logger="asyncrl.run"):
        _raise_first_failure(futures, RunStop(), failures)
    assert list(futures) == ["trainer"]
    assert failures == {"evaluator": "evaluator failed after 3 restart(s): exited with status 1"}
    assert "evaluator failed; the run goes on without it" in caplog.text
    # its normal end before the run's is no failure either; the trainer's failure still is one
    _raise_first_failure({"evaluator": done(ComponentOutcome("evaluator", "finished", 0, 0))}, RunStop(), failures)
    trainer = ComponentFailed("trainer", "exited with status -9", 1, "")
    with pytest.raises(ComponentFailed, match="trainer failed"):
        _raise_first_failure({"trainer": done(error=trainer)}, RunStop(), failures)


def test_at_the_end_the_run_waits_a_bounded_time_then_names_the_abandoned_version(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    config = run_config(tmp_path, pipeline={"eval_every": 2})
    paths = run_paths(config)
    EvaluationStore(paths.root).set_state(EvaluatorState(every=2, done=4, current=6))
    running = {"evaluator": done()}  # never ends by itself
    with caplog.at_level(logging.INFO, logger="asyncrl.run"):
        _wait_evaluator(running, 0.3, 0.05, RunStop(), {}, paths)
    assert "its evaluation of version 6 is abandoned" in caplog.text
    finished = {"evaluator": done(ComponentOutcome("evaluator", "finished", 0, 0))}
    _wait_evaluator(finished, 600.0, 0.05, RunStop(), {}, paths)  # returns at once
    _wait_evaluator({}, 600.0, 0.05, RunStop(), {}, paths)  # no evaluator


def test_a_remote_placement_needs_the_flow_s_remote_factory(tmp_path: Path) -> None:
    config = run_config(tmp_path, placement={"trainer": {"deployment": "component/asyncrl-gpu"}})
    with pytest.raises(ValueError, match=r"^placement\.trainer: a component on another machine runs only under the train flow"):
        run_components(config, run_paths(config), drain=False)
    made: list[tuple[str, int]] = []

    def remote(config: RunConfig, paths: Any, kind: str, index: int, drain: bool, stop: RunStop | None) -> Any:
        made.append((kind, index))
        return object()

    kinds = [kind for kind, _ in run_components(config, run_paths(config), drain=False, remote=remote)]
    assert made == [("trainer", 0)] and kinds == ["rollout-server", "reward-service", "trainer", "scheduler"]
