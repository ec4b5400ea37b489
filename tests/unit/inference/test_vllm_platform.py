"""The vLLM platform plugin that forks a rollout server's engine core: registered under vLLM's
plugin group, silent unless a server's environment asks, and only over vLLM's plain CPU
platform. (That a live server's engine core is forked: tests/integration/inference/test_server_live.py.)"""

from __future__ import annotations

import importlib.metadata
import os

import pytest

from asyncrl.tasks.inference.vllm_platform import (
    FORK_ENGINE_CORE_ENV,
    FORKING_CPU_PLATFORM,
    VLLM_CPU_PLATFORM,
    forking_cpu_platform,
)


def test_the_plugin_is_registered_where_vllm_looks_for_platforms() -> None:
    (entry,) = [e for e in importlib.metadata.entry_points(group="vllm.platform_plugins") if e.name == "asyncrl_forking_cpu"]
    assert entry.load() is forking_cpu_platform


@pytest.mark.parametrize(
    ("asked", "detected", "picked"),
    [
        (None, VLLM_CPU_PLATFORM, None),  # not a rollout server of ours
        ("0", VLLM_CPU_PLATFORM, None),
        ("1", VLLM_CPU_PLATFORM, FORKING_CPU_PLATFORM),
        ("1", "vllm.platforms.zen_cpu.ZenCpuPlatform", None),  # another CPU platform: left alone
        ("1", None, None),  # a GPU build
    ],
)
def test_the_plugin_picks_the_forking_platform_only_when_asked_on_the_plain_cpu_platform(
    asked: str | None, detected: str | None, picked: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    import vllm.platforms

    monkeypatch.setattr(vllm.platforms, "cpu_platform_plugin", lambda: detected)
    if asked is None:
        monkeypatch.delenv(FORK_ENGINE_CORE_ENV, raising=False)
    else:
        monkeypatch.setenv(FORK_ENGINE_CORE_ENV, asked)
    assert forking_cpu_platform() == picked


def test_the_forking_platform_runs_vllm_s_cpu_set_up_then_forks(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.platforms.cpu import CpuPlatform

    from asyncrl.tasks.inference.vllm_forking_platform import ForkingCpuPlatform

    assert FORKING_CPU_PLATFORM == f"{ForkingCpuPlatform.__module__}.{ForkingCpuPlatform.__qualname__}"
    seen: list[object] = []

    def cpu_set_up(cls: type, vllm_config: object) -> None:  # what vLLM's CPU platform does to the method
        seen.append(vllm_config)
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"

    monkeypatch.setattr(CpuPlatform, "check_and_update_config", classmethod(cpu_set_up))
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "spawn")  # restored to this process's own afterwards
    config = object()
    ForkingCpuPlatform.check_and_update_config(config)  # type: ignore[arg-type]
    assert seen == [config] and os.environ["VLLM_WORKER_MULTIPROC_METHOD"] == "fork"
