"""vLLM's CPU platform with a forked engine core: a vLLM platform plugin (entry point group
``vllm.platform_plugins`` in ``pyproject.toml``), active only in a rollout server's process
tree when :func:`~asyncrl.tasks.inference.server.server_env` sets :data:`FORK_ENGINE_CORE_ENV`.

vLLM's CPU platform sets ``VLLM_WORKER_MULTIPROC_METHOD=spawn`` for every process it starts,
so the API server's engine-core process imports vLLM, torch and transformers all over again:
8-10 s of each start on 2 cores (26-37 s spawned). With the model worker inside the engine
core (``worker_in_engine_process``: vLLM's ``uni`` executor, no worker process of its own)
the API server has run no OpenMP region and initialised no accelerator when it starts the
engine core, so forking it is safe, and the engine core starts with everything imported.

Elsewhere the plugin answers None and vLLM picks its platform as it always does: without
the variable, on a GPU build, or where vLLM's CPU detection picks another CPU platform.
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
