"""The ``inference`` section: the vLLM servers of a run (how many, where they listen, their
devices and engine processes). What they generate, and how the scheduler feeds them, is the
``rollout`` section."""

from __future__ import annotations

import os
from typing import Any

from pydantic import Field, field_validator, model_validator

from asyncrl.configs.base import StrictModel
from asyncrl.configs.cpus import check_cpu_cores
from asyncrl.configs.secrets import API_KEY_ENV, Secret, refuse_redacted

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
"""Hosts a server may bind to without ``inference.api_key``."""


class InferenceConfig(StrictModel):
    num_servers: int = Field(1, ge=1, description="Number of vLLM servers the run starts.")
    host: str = Field("127.0.0.1", description="Address the servers bind to; anything but loopback requires `api_key`.")
    base_port: int = Field(
        8100, ge=1024, le=65535, description="Server k listens on base_port + k; keep it below 20000."
    )
    """asyncrl's own processes (a trainer's rendezvous) draw listening ports from 20000 up to the
    kernel's range for outgoing connections; a fixed port in either may be taken while its server
    is down (:func:`~asyncrl.tasks.system.network.listen_port`)."""
    api_key: Secret | None = Field(None, description="Bearer key the servers require (mandatory off loopback).")
    """Never a flow parameter in clear: leave it out and set ``ASYNCRL_ROLLOUT_API_KEY`` in the
    environment of the flow run (a Prefect worker's environment), which :meth:`api_key_value` reads."""
    kv_cache_gib: float = Field(1.0, gt=0.0, description="KV cache of a CPU server, GiB (VLLM_CPU_KVCACHE_SPACE).")
    max_num_seqs: int | None = Field(
        None, ge=1, description="Most sequences a server decodes at once (vLLM's --max-num-seqs); None: vLLM's default."
    )
    """vLLM's default is low on CPU (128 for its API server): an evaluation of more answers, or a
    rollout with more samples in flight, then decodes in waves, each as long as its longest answer."""
    worker_in_engine_process: bool = Field(
        True, description="CPU servers: run vLLM's model worker inside its engine-core process."
    )
    """CPU servers (``vllm-cpu``, one rank): vLLM's model worker runs inside its engine-core
    process, with the server's cores less one as OpenMP threads (a shorter start, one
    busy-polling process fewer); False = vLLM's CPU default, a worker process of its own. No
    effect on GPUs (``RolloutServerConfig.worker_in_engine_process``)."""
    fork_engine_core: bool = Field(
        True, description="CPU servers with the worker in the engine core: fork the engine core, not spawn it."
    )
    """The engine-core process is forked from vLLM's API server, not spawned (no second import
    of vLLM: a shorter start); False = vLLM's spawn (``RolloutServerConfig.fork_engine_core``)."""
    cpu_cores: tuple[int, ...] | None = Field(
        None, description="CPU ids the servers (and their engine processes) are pinned to; None = no pinning."
    )
    tensor_parallel_size: int = Field(
        1, ge=1, description="Devices each server shards its model over (vLLM's `--tensor-parallel-size`)."
    )
    devices: list[tuple[int, ...]] | None = Field(
        None, description="One device set per server (GPU ids, or CPU ids without GPUs); None: no placement."
    )
    """``num_servers`` sets of ``tensor_parallel_size`` ids each: GPU ids
    (``CUDA_VISIBLE_DEVICES``) on a GPU machine, CPU ids (pinning) on a machine without GPUs.
    Sets of components on the same placement must not overlap unless
    ``placement.share_devices``."""

    @field_validator("cpu_cores")
    @classmethod
    def _existing_cores(cls, cores: tuple[int, ...] | None) -> tuple[int, ...] | None:
        return check_cpu_cores(cores, "inference.cpu_cores")

    @model_validator(mode="after")
    def _device_sets(self) -> InferenceConfig:
        if self.devices is None:
            return self
        if len(self.devices) != self.num_servers:
            raise ValueError(
                f"inference.devices: {len(self.devices)} device sets for inference.num_servers={self.num_servers}; "
                "give one set per server"
            )
        for k, ids in enumerate(self.devices):
            if len(ids) != self.tensor_parallel_size or len(set(ids)) != len(ids) or min(ids, default=0) < 0:
                raise ValueError(
                    f"inference.devices[{k}]: {list(ids)} must be {self.tensor_parallel_size} distinct device ids >= 0 "
                    f"(inference.tensor_parallel_size={self.tensor_parallel_size})"
                )
        return self

    @field_validator("api_key")
    @classmethod
    def _not_redacted(cls, api_key: Any) -> Any:  # noqa: ANN401
        if api_key is not None:
            refuse_redacted("inference.api_key", api_key.get_secret_value(), f"set {API_KEY_ENV} in the flow run's environment")
        return api_key

    @model_validator(mode="after")
    def _api_key_off_loopback(self) -> InferenceConfig:
        if self.host not in LOOPBACK_HOSTS and self.api_key_value() is None:
            raise ValueError(
                f"inference.api_key: required when inference.host is {self.host!r} (not loopback); set it "
                f"or {API_KEY_ENV} in the environment: the pause/resume/collective-RPC endpoints must "
                "never be reachable without it"
            )
        return self

    def api_key_value(self) -> str | None:
        """The servers' bearer key: ``api_key``, else ``$ASYNCRL_ROLLOUT_API_KEY``, else None."""
        if self.api_key is not None:
            return self.api_key.get_secret_value()
        return os.environ.get(API_KEY_ENV) or None


MOVED_KEYS: dict[str, str] = {
    f"rollout.{name}": f"inference.{name}"
    for name in (
        "num_servers",
        "host",
        "base_port",
        "api_key",
        "kv_cache_gib",
        "worker_in_engine_process",
        "fork_engine_core",
        "cpu_cores",
        "tensor_parallel_size",
        "devices",
    )
}
"""Keys that moved out of a section (old dotted key -> new one): the servers' settings left
``rollout`` for their own ``inference`` section."""


MOVED_NOTE = "the vLLM servers' settings are the `inference` section now"
"""Why the keys of :data:`MOVED_KEYS` moved, appended to the error that names them."""


def moved_key(dotted: str) -> str | None:
    """The error for a dotted key (or a key under it) that moved, e.g. ``rollout.devices`` ->
    ``"rollout.devices moved to inference.devices (...)"``; None for a key that did not move."""
    for old, new in MOVED_KEYS.items():
        if dotted == old or dotted.startswith(old + "."):
            return f"{old} moved to {new} ({MOVED_NOTE})"
    return None


def moved_keys_error(raw: Any) -> str | None:  # noqa: ANN401 - a raw config mapping
    """The error naming every moved key the raw config mapping ``raw`` still sets, with its
    new place (in the table's order), e.g. ``"rollout.num_servers moved to
    inference.num_servers; rollout.devices moved to inference.devices (...)"``; None if it
    sets none."""
    moved = []
    for old, new in MOVED_KEYS.items():
        node = raw
        for part in old.split("."):
            node = node.get(part, _ABSENT) if isinstance(node, dict) else _ABSENT
        if node is not _ABSENT:
            moved.append(f"{old} moved to {new}")
    return f"{'; '.join(moved)} ({MOVED_NOTE})" if moved else None


_ABSENT = object()
