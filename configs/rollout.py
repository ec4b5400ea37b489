"""The ``rollout`` section: the vLLM servers and how the scheduler feeds them."""

from __future__ import annotations

import os
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from asyncrl.configs.adaptive_staleness import AdaptiveStalenessConfig
from asyncrl.configs.base import StrictModel
from asyncrl.configs.cpus import check_cpu_cores
from asyncrl.configs.episode import EpisodeConfig
from asyncrl.configs.secrets import API_KEY_ENV, Secret, refuse_redacted


class RolloutConfig(StrictModel):
    num_servers: int = Field(1, ge=1, description="Number of vLLM servers the run starts.")
    host: str = Field("127.0.0.1", description="Address the servers bind to; anything but loopback requires `api_key`.")
    base_port: int = Field(8100, ge=1024, le=65535, description="Server k listens on base_port + k.")
    api_key: Secret | None = Field(None, description="Bearer key the servers require (mandatory off loopback).")
    """Never a flow parameter in clear: leave it out and set ``ASYNCRL_ROLLOUT_API_KEY`` in the
    environment of the flow run (a Prefect worker's environment), which :meth:`api_key_value` reads."""
    n_samples: int = Field(4, ge=1, description="Samples per prompt (the group size n).")
    max_new_tokens: int = Field(256, ge=1, description="Generation budget per sample, across interruptions.")
    temperature: float = Field(1.0, ge=0.0, le=2.0, description="Sampling temperature of generation.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus-sampling probability mass of generation.")
    eta: int = Field(4, ge=0, description="Maximum staleness in policy versions; 0 makes the system synchronous.")
    interrupt_mode: Literal["recompute", "keep"] = Field(
        "recompute", description="On a weight update: recompute the KV cache with the new weights, or keep it."
    )
    """``recompute``: abort and resubmit with prompt + tokens so far (recompute the KV cache with
    new weights, the paper's); ``keep``: keep vLLM's KV cache (pause mode=keep)."""
    kv_cache_gib: float = Field(1.0, gt=0.0, description="KV cache of a CPU server, GiB (VLLM_CPU_KVCACHE_SPACE).")
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
    shard_groups: int = Field(4, ge=1, description="Write a partial shard every this many finished groups.")
    """The scheduler writes groups in admission order, a shard as soon as a batch of
    `trainer.batch_groups` is complete, and a partial one every `shard_groups` finished groups
    or after `shard_seconds`, whichever comes first."""
    shard_seconds: float = Field(10.0, gt=0.0, description="...or when the oldest unwritten group has waited this long.")
    weight_poll_seconds: float = Field(
        0.5, gt=0.0, description="How often the scheduler looks for a newly published weight version."
    )
    max_groups_in_flight: int | None = Field(
        None, ge=1, description="Most prompt groups generating or being scored at once; None: the staleness rule alone."
    )
    """Over all servers (AReaL's ``max_concurrent_rollouts``): a group is admitted only below it,
    which bounds what the servers hold at once (KV cache, open agent episodes). The staleness
    rule still bounds admission; None: the rule alone, up to (eta + 1) x ``trainer.batch_groups``
    groups. A cap need not shorten a run (README, "Groups in flight")."""
    ignore_eos: bool = Field(False, description="Generate every sample to its full budget, ignoring end-of-sequence tokens.")
    """For benchmarks: output lengths set by the budgets alone, identical in every run."""
    dynamic_filter: bool = Field(False, description="DAPO-style dynamic filtering: groups with all-equal rewards are not trained.")
    """A prompt group whose rewards are all equal (no advantage signal) is not trained, and its
    admission is released, so the staleness rule counts the trained groups only (needs
    ``n_samples`` >= 2)."""
    episode: EpisodeConfig | None = Field(None, description="Multi-turn agent episodes; None: single-turn samples.")
    """Each prompt's group is n runs of the user's episode function against a recording
    OpenAI-compatible endpoint (:mod:`asyncrl.tasks.agent`); None: single-turn samples of the
    rendered prompt."""
    adaptive_staleness: AdaptiveStalenessConfig | None = Field(
        None, description="Lower the staleness bound while measured drift is over budget; None: the bound is `eta`."
    )
    """The gate's effective bound drops toward ``min_eta`` while the drift the trainer measures
    (behaviour-weight tail, ESS) is over its budget and comes back up to ``eta``, never above
    it, when it is under (each change logged)."""
    cpu_cores: tuple[int, ...] | None = Field(
        None, description="CPU ids the rollout servers (and their engine processes) are pinned to; None = no pinning."
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
        return check_cpu_cores(cores, "rollout.cpu_cores")

    @model_validator(mode="after")
    def _adaptive_within_eta(self) -> RolloutConfig:
        adaptive = self.adaptive_staleness
        if adaptive is not None and adaptive.min_eta > self.eta:
            raise ValueError(
                f"rollout.adaptive_staleness.min_eta: {adaptive.min_eta} is above rollout.eta = {self.eta}; "
                "the effective bound moves between min_eta and eta"
            )
        return self

    @model_validator(mode="after")
    def _episodes_end_themselves(self) -> RolloutConfig:
        if self.episode is not None and self.ignore_eos:
            raise ValueError(
                "rollout.ignore_eos: an episode's turns must end on their own (the endpoint returns each "
                "turn when the model stops); it cannot be combined with rollout.episode"
            )
        return self

    @model_validator(mode="after")
    def _filter_needs_groups(self) -> RolloutConfig:
        if self.dynamic_filter and self.n_samples < 2:
            raise ValueError(
                f"rollout.dynamic_filter needs rollout.n_samples >= 2 (got {self.n_samples}): "
                "a group of one sample always has equal rewards and would never be trained"
            )
        return self

    @model_validator(mode="after")
    def _device_sets(self) -> RolloutConfig:
        if self.devices is None:
            return self
        if len(self.devices) != self.num_servers:
            raise ValueError(
                f"rollout.devices: {len(self.devices)} device sets for rollout.num_servers={self.num_servers}; "
                "give one set per server"
            )
        for k, ids in enumerate(self.devices):
            if len(ids) != self.tensor_parallel_size or len(set(ids)) != len(ids) or min(ids, default=0) < 0:
                raise ValueError(
                    f"rollout.devices[{k}]: {list(ids)} must be {self.tensor_parallel_size} distinct device ids >= 0 "
                    f"(rollout.tensor_parallel_size={self.tensor_parallel_size})"
                )
        return self

    @field_validator("api_key")
    @classmethod
    def _not_redacted(cls, api_key: Any) -> Any:  # noqa: ANN401
        if api_key is not None:
            refuse_redacted("rollout.api_key", api_key.get_secret_value(), f"set {API_KEY_ENV} in the flow run's environment")
        return api_key

    @model_validator(mode="after")
    def _api_key_off_loopback(self) -> RolloutConfig:
        if self.host not in ("127.0.0.1", "localhost", "::1") and self.api_key_value() is None:
            raise ValueError(
                f"rollout.api_key: required when rollout.host is {self.host!r} (not loopback); set it "
                f"or {API_KEY_ENV} in the environment: the pause/resume/collective-RPC endpoints must "
                "never be reachable without it"
            )
        return self

    def api_key_value(self) -> str | None:
        """The servers' bearer key: ``api_key``, else ``$ASYNCRL_ROLLOUT_API_KEY``, else None."""
        if self.api_key is not None:
            return self.api_key.get_secret_value()
        return os.environ.get(API_KEY_ENV) or None
