"""The vLLM api_server command line of a rollout server: the checked model directory, the
flags its config asks for (worker extension, auth middleware, parallelism, memory, LoRA), and
the served model names unique to one start, by which a server is told from a foreign one.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from asyncrl.tasks.inference.server_config import VLLM_LORA_RANKS, RolloutServerConfig


WORKER_EXTENSION = "asyncrl.tasks.inference.weight_sync.WeightSyncExtension"
ADAPTER_WORKER_EXTENSION = "asyncrl.tasks.inference.adapter_sync.AdapterSyncExtension"
"""The worker extension of a LoRA server: :data:`WORKER_EXTENSION`'s methods plus the adapter ones."""
AUTH_MIDDLEWARE = "asyncrl.tasks.inference.auth.BearerAuthMiddleware"


def served_names(config: RolloutServerConfig, model_dir: Path, nonce: str) -> tuple[str, str]:
    """(name unique to this start, plain name): ``<name>-<nonce>`` and ``served_model_name``
    or the model directory."""
    plain = config.served_model_name or str(model_dir)
    return f"{plain}-{nonce}", plain


def served_name_args(config: RolloutServerConfig, model_dir: Path, nonce: str) -> list[str]:
    """``--served-model-name <name>-<nonce> <name>``: the first is the name responses carry
    and :meth:`RolloutServer.is_ready` looks for; requests may give either. Appended after
    ``extra_args``, so that it is the one vLLM takes."""
    return ["--served-model-name", *served_names(config, model_dir, nonce)]


def check_model_dir(model_dir: Path) -> Path:
    """``model_dir`` resolved, if it is a directory whose ``config.json`` is a JSON object.

    Raises ``FileNotFoundError`` or ``ValueError`` naming the path otherwise: these
    mistakes are reported at once instead of after the server's slow imports.
    """
    resolved = Path(model_dir).expanduser().resolve()
    if not resolved.is_dir():
        raise FileNotFoundError(f"rollout server model directory {resolved} does not exist or is not a directory")
    config_path = resolved / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"rollout server model directory {resolved} has no config.json")
    try:
        content = json.loads(config_path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{config_path} is not valid JSON: {exc}") from None
    if not isinstance(content, dict):
        raise ValueError(f"{config_path} must hold a JSON object, got {type(content).__name__}")  # noqa: TRY004
    return resolved


def vllm_lora_rank(rank: int) -> int:
    """The smallest rank vLLM accepts as ``--max-lora-rank`` (:data:`VLLM_LORA_RANKS`) that is
    >= ``rank``: 4 -> 8, 16 -> 16, 100 -> 128, 300 -> 320. ``ValueError`` above the largest."""
    for allowed in VLLM_LORA_RANKS:
        if rank <= allowed:
            return allowed
    raise ValueError(f"LoRA rank {rank} is above the largest vLLM serves ({VLLM_LORA_RANKS[-1]})")


def lora_args(config: RolloutServerConfig) -> list[str]:
    """``--enable-lora --max-lora-rank R --max-loras N --max-cpu-loras N`` for a LoRA server
    (R = :func:`vllm_lora_rank` of ``max_lora_rank``, N = ``max_loras``); nothing without LoRA.
    The server also needs ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1`` (:func:`~asyncrl.tasks.inference.server.server_env`)."""
    if config.max_lora_rank is None:
        return []
    loras = str(config.max_loras)
    return [
        "--enable-lora", "--max-lora-rank", str(vllm_lora_rank(config.max_lora_rank)),
        "--max-loras", loras, "--max-cpu-loras", loras,
    ]  # fmt: skip


def server_command(config: RolloutServerConfig, model_dir: Path, port: int) -> list[str]:
    """The api_server command line (no secrets: the key travels in the environment), less the
    served model names that :meth:`RolloutServer.start` appends (:func:`served_name_args`)."""
    command = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model_dir),
        "--host",
        config.host,
        "--port",
        str(port),
        "--dtype",
        config.dtype,
        *(["--enforce-eager"] if config.enforce_eager else []),
        "--seed",
        str(config.seed),
        "--worker-extension-cls",
        WORKER_EXTENSION if config.max_lora_rank is None else ADAPTER_WORKER_EXTENSION,
        *lora_args(config),
    ]
    if config.max_model_len is not None:
        command += ["--max-model-len", str(config.max_model_len)]
    if config.max_num_seqs is not None:
        command += ["--max-num-seqs", str(config.max_num_seqs)]
    if config.enable_scale_out:
        command += ["--enable-scale-out"]
    if config.api_key is not None:
        command += ["--middleware", AUTH_MIDDLEWARE]
    if config.tensor_parallel_size > 1:
        command += ["--tensor-parallel-size", str(config.tensor_parallel_size)]
    if config.gpu_memory_utilization is not None:
        command += ["--gpu-memory-utilization", str(config.gpu_memory_utilization)]
    return command + list(config.extra_args)
