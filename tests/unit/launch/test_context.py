"""A run root keeps the config it was started with: a restart that changes what shapes the
run's trajectories is refused, naming each key with both values, before anything is written;
settings that do not shape them may change."""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path
from typing import Any

import pytest

from asyncrl.configs.processes import PROCESS_NAMES
from asyncrl.configs.run_config import RunConfig
from asyncrl.tasks.launch.context import RunRootMismatchError, check_resumable, prepare_run


def raw_config(tmp_path: Path) -> dict[str, Any]:
    return {
        "name": "resume",
        "work_dir": str(tmp_path / "work"),
        "model": {"path": str(tmp_path / "model")},
        "data": {"train_path": str(tmp_path / "train.parquet")},
        "storage": {"root": str(tmp_path / "store")},
    }


def with_changes(raw: dict[str, Any], changes: dict[str, Any]) -> RunConfig:
    data: dict[str, Any] = {key: dict(value) if isinstance(value, dict) else value for key, value in raw.items()}
    for dotted, value in changes.items():
        *parents, leaf = dotted.split(".")
        node = data
        for part in parents:
            node[part] = dict(node.get(part, {}))
            node = node[part]
        node[leaf] = value
    return RunConfig.model_validate(data)


def snapshot(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        ({"model.path": "/elsewhere/model"}, ["model.path"]),
        ({"data.train_path": "/elsewhere/train.parquet"}, ["data.train_path"]),
        ({"data.max_prompt_tokens": 64, "data.prompt_format": "chat"}, ["data.max_prompt_tokens", "data.prompt_format"]),
        ({"rollout.n_samples": 8, "rollout.temperature": 0.7}, ["rollout.n_samples", "rollout.temperature"]),
        ({"rollout.max_new_tokens": 64, "rollout.top_p": 0.9, "rollout.eta": 1}, ["rollout.eta", "rollout.max_new_tokens", "rollout.top_p"]),
        ({"rollout.interrupt_mode": "keep"}, ["rollout.interrupt_mode"]),
        ({"trainer.batch_groups": 4, "trainer.mini_batches": 2}, ["trainer.batch_groups", "trainer.mini_batches"]),
        ({"trainer.objective": "standard", "trainer.eps_clip": 0.1}, ["trainer.eps_clip", "trainer.objective"]),
        ({"trainer.eps_clip_high": 0.3, "trainer.behav_weight_cap": 2.0}, ["trainer.behav_weight_cap", "trainer.eps_clip_high"]),
        ({"trainer.behav_cap_mode": "clamp", "trainer.advantage": "rloo"}, ["trainer.advantage", "trainer.behav_cap_mode"]),
        ({"trainer.max_staleness": 1}, ["trainer.max_staleness"]),
        ({"trainer.optimizer.lr": 0.001}, ["trainer.optimizer.lr"]),
        ({"seed": 7}, ["seed"]),
        ({"reward.math.timeout_s": 9}, ["reward.math.timeout_s"]),
        ({"pipeline.sft_optimizer": {"lr": 0.001}}, ["pipeline.sft_optimizer"]),  # null then, a section now
        ({"pipeline.sft_steps": 3, "data.sft_path": "/data/sft.parquet"}, ["data.sft_path", "pipeline.sft_steps"]),
    ],
)
def test_a_restart_with_other_trajectory_settings_is_refused_and_writes_nothing(
    changes: dict[str, Any], named: list[str], tmp_path: Path
) -> None:
    raw = raw_config(tmp_path)
    first = RunConfig.model_validate(raw)
    paths = prepare_run(first)
    store, work = snapshot(tmp_path / "store"), snapshot(tmp_path / "work")
    changed = with_changes(raw, changes)
    for attempt in (check_resumable, prepare_run):
        with pytest.raises(RunRootMismatchError) as info:
            attempt(changed)
        message = str(info.value)
        assert message.startswith(f"{paths.root.display('config.yaml')}: run 'resume' was started with other settings")
        for key in named:
            assert f"{key}: " in message
        assert "restore them to resume this run, or start a new run (another name and storage.root)" in message
        assert "\n" not in message
    first_key = named[0]
    old_value = first.model_dump(mode="json")
    for part in first_key.split("."):
        old_value = old_value[part]
    assert f"{first_key}: {old_value!r} -> " in message
    assert snapshot(tmp_path / "store") == store and snapshot(tmp_path / "work") == work  # nothing rewritten


def test_settings_that_do_not_shape_trajectories_may_change(tmp_path: Path) -> None:
    raw = raw_config(tmp_path)
    prepare_run(RunConfig.model_validate(raw))
    frozen = (tmp_path / "store" / "config.yaml").read_bytes()
    changed = with_changes(raw, {
        "trainer.max_steps": 50, "trainer.checkpoint_every": 2, "trainer.micro_batch_tokens": 8192,
        "inference.num_servers": 2, "inference.base_port": 9100, "rollout.shard_seconds": 3.0,
        "rollout.shard_groups": 2, "inference.kv_cache_gib": 2.0, "rollout.weight_poll_seconds": 1.0,
        "reward.pool.workers": 4, "tracking.experiment": "other", "run.max_restarts": 9,
        "pipeline.eval_samples": 2, "work_dir": str(tmp_path / "work2"),
    })  # fmt: skip
    check_resumable(changed)
    paths = prepare_run(changed)
    assert (tmp_path / "store" / "config.yaml").read_bytes() == frozen  # the first config stays frozen
    for process in PROCESS_NAMES:
        assert stat.S_IMODE(paths.process_config(process).stat().st_mode) == 0o600  # secrets: the owner's only


def test_a_section_set_then_and_null_now_is_a_difference(tmp_path: Path) -> None:
    raw = raw_config(tmp_path)
    prepare_run(with_changes(raw, {"pipeline.synthetic_data": {"n_train": 16, "n_heldout": 4}}))
    with pytest.raises(RunRootMismatchError, match=r"pipeline.synthetic_data: \{.*'n_train': 16.*\} -> None"):
        prepare_run(RunConfig.model_validate(raw))


def test_another_runs_root_is_refused_by_name(tmp_path: Path) -> None:
    raw = raw_config(tmp_path)
    prepare_run(RunConfig.model_validate(raw))
    with pytest.raises(RunRootMismatchError, match="belongs to run 'resume', not 'other'; use another storage.root"):
        prepare_run(with_changes(raw, {"name": "other"}))


@pytest.mark.parametrize("content", [b"\xff\xfe not utf-8", b"just a string", b"a: [unclosed"])
def test_a_damaged_frozen_config_is_named(content: bytes, tmp_path: Path) -> None:
    raw = raw_config(tmp_path)
    (tmp_path / "store").mkdir()
    (tmp_path / "store" / "config.yaml").write_bytes(content)
    with pytest.raises(ValueError, match=r"store/config.yaml: not a (readable config|YAML mapping).*use another storage.root"):
        prepare_run(RunConfig.model_validate(raw))
    assert (tmp_path / "store" / "config.yaml").read_bytes() == content


def test_a_full_disk_writing_a_process_config_names_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import asyncrl.tasks.launch.context as context

    safe_dump = context.yaml.safe_dump

    def full_disk(data: object, stream: Any = None, **kwargs: Any) -> Any:  # noqa: ANN401
        if stream is None:  # to a string: the frozen config.yaml
            return safe_dump(data, **kwargs)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))  # what a write on a full disk raises: no file name

    config = RunConfig.model_validate(raw_config(tmp_path))
    monkeypatch.setattr(context.yaml, "safe_dump", full_disk)
    with pytest.raises(OSError) as info:
        prepare_run(config)
    assert info.value.errno == errno.ENOSPC
    assert info.value.filename == str(config.run_work_dir / "processes" / "trainer.yaml")


def test_a_full_disk_freezing_the_config_names_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import asyncrl.tasks.launch.context as context

    def full_disk(*args: object) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(context.fs, "put_if_absent", full_disk)
    with pytest.raises(OSError) as info:
        prepare_run(RunConfig.model_validate(raw_config(tmp_path)))
    assert info.value.errno == errno.ENOSPC and str(info.value.filename).endswith("store/config.yaml")


def test_a_credentials_block_outside_the_flows_needs_the_store_s_credentials_in_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only the flows load a Prefect Secret block; prepare_run elsewhere (chaos, a benchmark)
    refuses by name before touching the store, unless the credentials are already in the
    environment."""
    raw = raw_config(tmp_path)
    raw["storage"]["credentials_block"] = "store-creds"
    config = RunConfig.model_validate(raw)
    monkeypatch.delenv("AWS_ACCESS_KEY_ID", raising=False)
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY", raising=False)
    with pytest.raises(ValueError, match=r"^storage\.credentials_block: the Prefect Secret block 'store-creds' is loaded by the flows only"):
        prepare_run(config)
    with pytest.raises(ValueError, match=r"^storage\.credentials_block"):
        check_resumable(config)
    assert not Path(raw["storage"]["root"]).exists()
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "id")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "secret")
    prepare_run(config)
    assert (Path(raw["storage"]["root"]) / "config.yaml").is_file()


def test_a_process_config_is_replaced_whole_and_a_failed_write_keeps_the_old_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Components placed on one machine each prepare the run while processes started before
    them read their configs: a reader sees the old file or the new one, never a part."""
    import yaml

    paths = prepare_run(RunConfig.model_validate(raw_config(tmp_path)))
    config = paths.process_config("scheduler")
    before = config.read_bytes()
    inode = config.stat().st_ino

    real_dump = yaml.safe_dump

    def dump_half(data: Any, handle: Any = None, **kwargs: Any) -> Any:  # noqa: ANN401 - a write to a file fails midway
        if handle is None:
            return real_dump(data, **kwargs)
        handle.write("name: resu")
        raise OSError(errno.EIO, "disk gone mid-write")

    monkeypatch.setattr(yaml, "safe_dump", dump_half)
    with pytest.raises(OSError, match="disk gone mid-write"):
        prepare_run(RunConfig.model_validate(raw_config(tmp_path)))
    assert config.read_bytes() == before and not list(config.parent.glob(".*partial"))
    monkeypatch.undo()
    prepare_run(RunConfig.model_validate(raw_config(tmp_path)))
    assert config.read_bytes() == before and config.stat().st_ino != inode  # renamed over, not rewritten in place
    assert stat.S_IMODE(config.stat().st_mode) == 0o600 and not list(config.parent.glob(".*partial"))
