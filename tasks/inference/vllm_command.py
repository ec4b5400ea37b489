"""The vLLM api_server command line of a rollout server: the checked model directory, the
flags its config asks for (worker extension, auth middleware, parallelism, memory), and the
served model names unique to one start, by which a server is told from a foreign one.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from asyncrl.tasks.inference.server_config import RolloutServerConfig


WORKER_EXTENSION = "asyncrl.tasks.inference.weight_sync.WeightSyncExtension"
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
        WORKER_EXTENSION,
    ]
    if config.max_model_len is not None:
        command += ["--max-model-len", str(config.max_model_len)]
    if config.enable_scale_out:
        command += ["--enable-scale-out"]
    if config.api_key is not None:
        command += ["--middleware", AUTH_MIDDLEWARE]
    if config.tensor_parallel_size > 1:
        command += ["--tensor-parallel-size", str(config.tensor_parallel_size)]
    if config.gpu_memory_utilization is not None:
        command += ["--gpu-memory-utilization", str(config.gpu_memory_utilization)]
    return command + list(config.extra_args)
