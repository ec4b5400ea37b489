"""The weight-sync bench's settings and its base model: what ``asyncrl bench weight-sync``
and its LoRA variant (:mod:`~asyncrl.bench.lora_sync`) both start from."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from asyncrl.tasks.model.tiny import TinyModelSpec

MIB = 2**20
CHUNK_BYTES = 8 * MIB
"""Read/write chunk of the link probes (a multiple of 4096, as ``O_DIRECT`` needs)."""
SIZES = ("0.5b", "tiny")
"""``--size`` presets: ``0.5b`` = Qwen2.5-0.5B's shape, ``tiny`` = :class:`TinyModelSpec` (3 M)."""
SERVER_DTYPES = ("float32", "bfloat16")
"""``--server-dtype`` choices: the rollout server's ``--dtype``. The checkpoint is bfloat16;
a float32 server converts every tensor on each load, a bfloat16 one (what a GPU serves in)
copies it as it is."""


@dataclass(frozen=True)
class WeightSyncBenchSettings:
    size: str = "0.5b"
    """Model preset, one of :data:`SIZES`."""
    repeats: int = 3
    """Fresh versions published, fetched and loaded per backend."""
    probe_mib: int = 1024
    """Size of the disk file and memory buffer of the link probes, MiB (a multiple of 8)."""
    kv_cache_gib: float = 1.0
    max_model_len: int = 512
    seed: int = 0
    server_start_timeout_s: float = 900.0
    server_dtype: str = "float32"
    """The rollout server's dtype, one of :data:`SERVER_DTYPES`."""

    def __post_init__(self) -> None:
        if self.size not in SIZES:
            raise ValueError(f"WeightSyncBenchSettings.size must be one of {SIZES}, got {self.size!r}")
        if self.server_dtype not in SERVER_DTYPES:
            raise ValueError(
                f"WeightSyncBenchSettings.server_dtype must be one of {SERVER_DTYPES}, got {self.server_dtype!r}"
            )
        for name, low in (("repeats", 1), ("probe_mib", 8), ("max_model_len", 16), ("seed", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"WeightSyncBenchSettings.{name} must be an int >= {low}, got {value!r}")
        if self.probe_mib % (CHUNK_BYTES // MIB):
            raise ValueError(
                f"WeightSyncBenchSettings.probe_mib must be a multiple of {CHUNK_BYTES // MIB}, got {self.probe_mib}"
            )
        for name in ("kv_cache_gib", "server_start_timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
                raise ValueError(f"WeightSyncBenchSettings.{name} must be > 0, got {value!r}")


def model_spec(size: str) -> TinyModelSpec:
    """The model shape of a ``--size`` preset."""
    from asyncrl.tasks.model.tiny import QWEN25_05B_SPEC, TinyModelSpec

    if size == "0.5b":
        return QWEN25_05B_SPEC
    if size == "tiny":
        return TinyModelSpec()
    raise ValueError(f"size must be one of {SIZES}, got {size!r}")


def write_bench_model(out_dir: Path, settings: WeightSyncBenchSettings) -> Path:
    """The bench's base checkpoint: :func:`model_spec` of ``settings.size``, random, bfloat16."""
    from asyncrl.tasks.model.tiny import write_qwen2_model

    return write_qwen2_model(out_dir, model_spec(settings.size), seed=settings.seed, dtype="bfloat16")


def dir_bytes(directory: Path, suffix: str = "") -> int:
    """Total bytes of the files of ``directory`` (names ending with ``suffix``; hidden skipped)."""
    return sum(
        p.stat().st_size for p in directory.rglob(f"*{suffix}") if p.is_file() and not p.name.startswith(".")
    )
