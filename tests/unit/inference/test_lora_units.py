"""LoRA on the rollout side, without a server: the LoRA server's command line and environment,
the rounding of its rank to one vLLM accepts, the adapter names of weight versions, the
per-token versions of a segment sampled by an adapter, and the adapter directory check."""

from __future__ import annotations

import json
from pathlib import Path
from typing import get_args

import pytest

from asyncrl.tasks.inference.adapter_sync import check_adapter_dir, oldest_kept
from asyncrl.tasks.inference.server import server_env
from asyncrl.tasks.inference.server_config import DEFAULT_MAX_LORAS, VLLM_LORA_RANKS, RolloutServerConfig
from asyncrl.tasks.inference.vllm_api import adapter_name, adapter_version, segment_versions
from asyncrl.tasks.inference.vllm_command import (
    ADAPTER_WORKER_EXTENSION,
    WORKER_EXTENSION,
    server_command,
    vllm_lora_rank,
)
from asyncrl.tasks.inference.weight_loader import ServerWeightLoader


def test_the_allowed_ranks_are_vllms() -> None:
    from vllm.config.lora import MaxLoRARanks

    assert VLLM_LORA_RANKS == get_args(MaxLoRARanks)


@pytest.mark.parametrize(
    ("rank", "expected"), [(1, 1), (2, 8), (4, 8), (8, 8), (9, 16), (16, 16), (100, 128), (257, 320), (321, 512), (512, 512)]
)
def test_a_rank_is_rounded_up_to_the_next_one_vllm_accepts(rank: int, expected: int) -> None:
    assert vllm_lora_rank(rank) == expected


def test_a_rank_above_vllms_largest_is_refused() -> None:
    with pytest.raises(ValueError, match="LoRA rank 513 is above the largest vLLM serves"):
        vllm_lora_rank(513)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("max_lora_rank", 0, r"max_lora_rank must be an int in \[1, 512\] or None"),
        ("max_lora_rank", 513, r"max_lora_rank must be an int in \[1, 512\] or None"),
        ("max_lora_rank", True, r"max_lora_rank must be an int in \[1, 512\] or None"),
        ("max_loras", 0, "max_loras must be an int >= 1"),
    ],
)
def test_lora_settings_are_bounded(field: str, value: object, message: str, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=f"RolloutServerConfig.{message}"):
        RolloutServerConfig(model_dir=tmp_path, **{field: value})  # type: ignore[arg-type]


def test_a_lora_server_gets_the_lora_flags_the_adapter_extension_and_runtime_loading(tmp_path: Path) -> None:
    config = RolloutServerConfig(model_dir=tmp_path, max_lora_rank=4, max_loras=3)
    command = server_command(config, tmp_path, 8000)
    start = command.index("--enable-lora")
    assert command[start : start + 7] == ["--enable-lora", "--max-lora-rank", "8", "--max-loras", "3", "--max-cpu-loras", "3"]
    assert command[command.index("--worker-extension-cls") + 1] == ADAPTER_WORKER_EXTENSION
    assert server_env(config)["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "1"
    assert RolloutServerConfig(model_dir=tmp_path, max_lora_rank=16).max_loras == DEFAULT_MAX_LORAS


def test_a_server_without_lora_is_launched_as_before(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", raising=False)
    config = RolloutServerConfig(model_dir=tmp_path)
    command = server_command(config, tmp_path, 8000)
    assert not any("lora" in arg for arg in command if arg.startswith("--"))
    assert command[command.index("--worker-extension-cls") + 1] == WORKER_EXTENSION
    assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING" not in server_env(config)


def test_adapter_names_round_trip() -> None:
    assert adapter_name(0) == "asyncrl-v0" and adapter_name(12) == "asyncrl-v12"
    assert [adapter_version(n) for n in ("asyncrl-v0", "asyncrl-v12")] == [0, 12]
    assert [adapter_version(n) for n in ("asyncrl-v", "asyncrl-v01", "asyncrl-vx", "other", "/models/tiny")] == [None] * 5
    with pytest.raises(ValueError, match="non-negative int"):
        adapter_name(-1)


SPANS = [{"version": "3", "start": 0, "end": 2}, {"version": "4", "start": 2, "end": 5}]


def test_a_segment_on_an_adapter_carries_the_version_it_was_submitted_at() -> None:
    """Keep mode under LoRA: the engine's spans say 3 then 4, but the request kept adapter 3."""
    assert segment_versions(SPANS, 5, "test", None) == [3, 3, 4, 4, 4]
    assert segment_versions(SPANS, 5, "test", 3) == [3] * 5
    with pytest.raises(RuntimeError, match="do not tile"):  # the spans are checked all the same
        segment_versions(SPANS, 6, "test", 3)


def test_an_adapter_directory_must_hold_a_peft_adapter(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"x" * 10)
    with pytest.raises(ValueError, match=r"weight version 7 is not a LoRA adapter: it lacks \['adapter_config.json', 'adapter_model.safetensors'\]"):
        check_adapter_dir(tmp_path, 7)
    (tmp_path / "adapter_config.json").write_text(json.dumps({"r": 4}))
    (tmp_path / "adapter_model.safetensors").write_bytes(b"y" * 100)
    assert check_adapter_dir(tmp_path, 7) == 2 + 10 + len(json.dumps({"r": 4})) + 100


def test_the_newest_keep_versions_are_kept() -> None:
    assert [oldest_kept(v, 2) for v in (0, 1, 2, 5)] == [0, 0, 1, 4]
    assert oldest_kept(5, 1) == 5


def test_the_loader_refuses_a_keep_count_below_one() -> None:
    with pytest.raises(ValueError, match="keep_adapters: must be an int >= 1"):
        ServerWeightLoader("file:///nowhere", None, adapters=True, keep_adapters=0)
