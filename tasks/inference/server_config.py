"""How to start one rollout server: model, address, devices and cores, KV cache, compilation,
API key and vLLM's extra arguments, checked when the config is built so a mistake is
reported before the server's slow start.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from asyncrl.tasks.system.network import is_loopback
from asyncrl.tasks.system.process_group import check_session_nice
from asyncrl.configs.cpus import check_cpu_cores

VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The only ``--max-lora-rank`` values vLLM 0.32 accepts (``vllm.config.lora.MaxLoRARanks``;
a unit test checks the two agree)."""
DEFAULT_MAX_LORAS = 4
"""Adapters a LoRA server keeps resident by default (:attr:`RolloutServerConfig.max_loras`)."""


@dataclass(frozen=True)
class RolloutServerConfig:
    """How to start one rollout server."""

    model_dir: Path
    """HF-format model directory (config.json, *.safetensors, tokenizer files)."""
    host: str = "127.0.0.1"
    """Address to bind; anything but a loopback address requires ``api_key``."""
    port: int = 0
    """TCP port; 0 picks a free one."""
    advertise_host: str | None = None
    """Host name in ``handle.url`` (what clients and the registry see); None = ``host``, or
    this machine's name (``socket.gethostname()``) when ``host`` is a wildcard address."""
    api_key: str | None = field(default=None, repr=False)
    """Bearer token every request but ``/health`` must carry; None = no auth (loopback only)."""
    kv_cache_gib: float = 1.0
    """KV cache size in GiB (``VLLM_CPU_KVCACHE_SPACE``; on CPU it is integral, rounded up, >= 1)."""
    max_model_len: int | None = None
    """Longest prompt + output in tokens; None = the model's maximum."""
    max_num_seqs: int | None = None
    """Most sequences decoded at once (``--max-num-seqs``); None = vLLM's default."""
    served_model_name: str | None = None
    """Name requests may give as ``model``; None = ``model_dir`` as given to vLLM. The server
    also serves ``<name>-<nonce>`` (``handle.model``), unique to each start."""
    seed: int = 0
    """vLLM's sampling seed (``--seed``)."""
    enable_scale_out: bool = True
    """Serve vLLM's token-in/token-out ``POST /inference/v1/generate`` (``--enable-scale-out``),
    whose choices carry per-token ``weight_versions`` spans; the rollout client uses it."""
    extra_args: tuple[str, ...] = ()
    """Further ``api_server`` arguments, appended last."""
    log_path: Path | None = None
    """Server log file (stdout + stderr); None = a new temporary directory."""
    start_timeout_s: float = 600.0
    """Seconds :meth:`RolloutServer.wait_healthy` waits by default."""
    stop_grace_s: float = 15.0
    """Seconds between SIGTERM and SIGKILL in :meth:`RolloutServer.stop`."""
    die_with_parent: bool = True
    """Linux: the server gets SIGTERM when the *thread* that started it exits
    (``PR_SET_PDEATHSIG``), so a killed supervisor leaves no orphaned server. Start the
    server from a thread that outlives it (the main thread, or the supervising task)."""
    cpu_cores: tuple[int, ...] | None = None
    """Linux: CPU ids the server and every process it spawns (vLLM's engine core) are pinned
    to (``sched_setaffinity`` before ``exec``); None = no pinning."""
    tensor_parallel_size: int = 1
    """GPUs (or CPU ranks) the model is sharded over (vLLM's ``--tensor-parallel-size``, given
    when above 1)."""
    cuda_visible_devices: str | None = None
    """``CUDA_VISIBLE_DEVICES`` of the server (comma-separated GPU indices or UUIDs, at least
    ``tensor_parallel_size`` of them); None = inherited from this process."""
    gpu_memory_utilization: float | None = None
    """Share of each GPU's memory vLLM may take (``--gpu-memory-utilization``), lowered when
    other components share the GPU; None = vLLM's default."""
    dtype: str = "float32"
    """Parameter dtype (``--dtype``): the run's ``model.dtype``, the trainer's."""
    enforce_eager: bool = True
    """``--enforce-eager``: no CUDA graphs (on CPU they do not exist; on GPUs graphs are
    captured once per start, faster generation for a slower start), and nothing else
    compiled either: the server runs with ``TORCH_COMPILE_DISABLE=1`` (:func:`server_env`)."""
    session_nice: int | None = None
    """Lower CPU priority (nice 0..19) of the server's whole session, so that on a machine
    with few cores the processes beside it (driver, trainer) are not starved by vLLM's
    busy-polling engine (see :func:`~asyncrl.tasks.system.process_group.lower_own_session_priority`);
    None = unchanged."""
    worker_in_engine_process: bool = True
    """On CPU (the ``vllm-cpu`` build) with ``tensor_parallel_size`` 1: run vLLM's model worker
    inside its engine-core process (vLLM's ``uni`` executor, its own choice on a GPU) instead of
    a third spawned process that imports vLLM again, a large share of every start on few cores,
    and busy-polls a queue between the two. The worker's OpenMP threads are then the server's
    cores less one, at least one (:func:`cpu_worker_threads`, the count vLLM's CPU binding
    gives its worker); an ``OMP_NUM_THREADS`` in the environment wins. False = vLLM's CPU
    default, the multiprocess executor."""
    fork_engine_core: bool = True
    """With the worker in the engine core (``worker_in_engine_process`` on the ``vllm-cpu``
    build): the API server forks its engine-core process instead of spawning it as vLLM's CPU
    platform asks (:mod:`asyncrl.tasks.inference.vllm_platform`), so the engine core does not
    import vLLM again, a large share of every start. False = vLLM's spawn."""
    max_lora_rank: int | None = None
    """LoRA: serve the base model with weight versions loaded as LoRA adapters (``--enable-lora``,
    :mod:`asyncrl.tasks.inference.adapter_sync`); the largest adapter rank it must serve
    (``trainer.lora.rank``). vLLM accepts only the ranks of :data:`VLLM_LORA_RANKS`: the
    command passes the smallest one >= this (:func:`~asyncrl.tasks.inference.vllm_command.vllm_lora_rank`:
    rank 4 -> 8, 100 -> 128), which only sizes vLLM's adapter buffers. None = no LoRA
    (full-model weight sync)."""
    max_loras: int = DEFAULT_MAX_LORAS
    """With LoRA: adapters resident at once, in a batch (``--max-loras``) and in the worker's
    memory (``--max-cpu-loras``): the newest ``max_loras`` versions stay loaded, so a request
    still running on an older adapter (``keep`` mode, a version up to ``max_loras - 1`` behind)
    finishes on it. Give the weight loader the same count (``ServerWeightLoader(keep_adapters=...)``)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "cpu_cores", check_cpu_cores(self.cpu_cores, "RolloutServerConfig.cpu_cores"))
        check_session_nice(self.session_nice, "RolloutServerConfig.session_nice")
        tp = self.tensor_parallel_size
        if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
            raise ValueError(f"RolloutServerConfig.tensor_parallel_size must be an int >= 1, got {tp!r}")
        if self.cuda_visible_devices is not None:
            entries = self.cuda_visible_devices.split(",")
            if any(not entry or entry != entry.strip() for entry in entries):
                raise ValueError(
                    "RolloutServerConfig.cuda_visible_devices must be comma-separated GPU indices or UUIDs "
                    f"without spaces, got {self.cuda_visible_devices!r}"
                )
            if len(entries) < tp:
                raise ValueError(
                    f"RolloutServerConfig: tensor_parallel_size {tp} needs {tp} GPUs, cuda_visible_devices "
                    f"{self.cuda_visible_devices!r} names {len(entries)}"
                )
        utilization = self.gpu_memory_utilization
        if utilization is not None and not 0 < utilization <= 1:
            raise ValueError(f"RolloutServerConfig.gpu_memory_utilization must be in (0, 1], got {utilization}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"RolloutServerConfig.port must be in [0, 65535], got {self.port}")
        if self.kv_cache_gib <= 0:
            raise ValueError(f"RolloutServerConfig.kv_cache_gib must be > 0, got {self.kv_cache_gib}")
        if self.max_num_seqs is not None and self.max_num_seqs < 1:
            raise ValueError(f"RolloutServerConfig.max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"RolloutServerConfig.max_model_len must be >= 1, got {self.max_model_len}")
        if self.start_timeout_s <= 0 or self.stop_grace_s < 0:
            raise ValueError(
                f"RolloutServerConfig: start_timeout_s must be > 0 and stop_grace_s >= 0, "
                f"got {self.start_timeout_s} and {self.stop_grace_s}"
            )
        rank = self.max_lora_rank
        if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int) or not 1 <= rank <= VLLM_LORA_RANKS[-1]):
            raise ValueError(
                f"RolloutServerConfig.max_lora_rank must be an int in [1, {VLLM_LORA_RANKS[-1]}] or None, got {rank!r}"
            )
        loras = self.max_loras
        if isinstance(loras, bool) or not isinstance(loras, int) or loras < 1:
            raise ValueError(f"RolloutServerConfig.max_loras must be an int >= 1, got {loras!r}")
        if self.api_key is not None and (not self.api_key or any(c.isspace() for c in self.api_key)):
            raise ValueError("RolloutServerConfig.api_key must be a non-empty string without whitespace")
        if self.api_key is None and not is_loopback(self.host):
            raise ValueError(
                f"RolloutServerConfig: host {self.host!r} is not a loopback address; "
                "a server reachable from other machines needs api_key"
            )
