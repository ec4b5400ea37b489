"""The platform class :func:`asyncrl.tasks.inference.vllm_platform.forking_cpu_platform` names;
imported by vLLM only once that plugin has picked it (it imports vLLM)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from vllm.platforms.cpu import CpuPlatform

if TYPE_CHECKING:
    from vllm.config import VllmConfig


class ForkingCpuPlatform(CpuPlatform):
    """vLLM's CPU platform, but processes it starts (the engine core) are forked, not spawned."""

    @classmethod
    def check_and_update_config(cls, vllm_config: VllmConfig) -> None:
        """vLLM's CPU set-up, then ``VLLM_WORKER_MULTIPROC_METHOD=fork`` in place of the
        ``spawn`` that set-up writes."""
        super().check_and_update_config(vllm_config)
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "fork"
