"""vLLM's CPU platform with a forked engine core: a vLLM platform plugin (entry point group
``vllm.platform_plugins`` in ``pyproject.toml``), active only in a rollout server's process
tree when :func:`~asyncrl.tasks.inference.server.server_env` sets :data:`FORK_ENGINE_CORE_ENV`.

vLLM's CPU platform spawns every process it starts, so the engine core imports vLLM, torch
and transformers all over again, a large share of every server start. With the model worker
inside the engine core the API server has run no OpenMP region and initialised no
accelerator when it starts the engine core, so forking it is safe, and the engine core
starts with everything imported. Elsewhere (no variable, a GPU build, another CPU platform)
the plugin answers None and vLLM picks its platform as it always does.
"""

from __future__ import annotations

import os

FORK_ENGINE_CORE_ENV = "ASYNCRL_VLLM_FORK_ENGINE_CORE"
"""Set to ``1`` in a rollout server's environment to start its engine core by ``fork``."""

VLLM_CPU_PLATFORM = "vllm.platforms.cpu.CpuPlatform"
FORKING_CPU_PLATFORM = "asyncrl.tasks.inference.vllm_forking_platform.ForkingCpuPlatform"


def forking_cpu_platform() -> str | None:
    """The plugin (vLLM calls it while it picks the platform): :data:`FORKING_CPU_PLATFORM`
    when :data:`FORK_ENGINE_CORE_ENV` is ``1`` and vLLM's own CPU detection picks its plain
    CPU platform, else None (no opinion)."""
    if os.environ.get(FORK_ENGINE_CORE_ENV) != "1":
        return None
    from vllm.platforms import cpu_platform_plugin

    return FORKING_CPU_PLATFORM if cpu_platform_plugin() == VLLM_CPU_PLATFORM else None
