"""What ``asyncrl bench scale`` runs: the Qwen2 model sizes it compares and its own settings,
checked when built with errors that name the command-line option. Everything its runs share
is the run config's (``configs/bench-scale.yaml`` by default; :mod:`asyncrl.bench.bench_config`).

Every size keeps Qwen2.5's real vocabulary (151,936 tokens, tied embeddings), so the
embedding alone is V * hidden parameters: the smallest hidden size a vLLM CPU attention
kernel takes (head size 32) already makes it 4.86 M, and the smallest preset is ~5 M, not 3 M.
The larger shapes follow Qwen2.5's proportions (head size 64, intermediate ~5.4 x hidden).
"""

from __future__ import annotations

import importlib.util
import types
from dataclasses import dataclass, replace
from pathlib import Path

from asyncrl.bench.bench_config import bundled_config, gpu_overrides
from asyncrl.tasks.model.tiny import QWEN25_05B_SPEC, TinyModelSpec

SIZE_SPECS: types.MappingProxyType[str, TinyModelSpec] = types.MappingProxyType({
    "5m": replace(QWEN25_05B_SPEC, hidden_size=32, num_layers=2, num_heads=1, num_kv_heads=1, intermediate_size=176),
    "30m": replace(QWEN25_05B_SPEC, hidden_size=192, num_layers=4, num_heads=3, num_kv_heads=1, intermediate_size=1024),
    "125m": replace(QWEN25_05B_SPEC, hidden_size=512, num_layers=10, num_heads=8, num_kv_heads=2, intermediate_size=2816),
    "0.5b": QWEN25_05B_SPEC,
    "1.5b": replace(QWEN25_05B_SPEC, hidden_size=1536, num_layers=28, num_heads=12, num_kv_heads=2, intermediate_size=8960),
})  # fmt: skip
"""The sizes, smallest first: Qwen2 shapes with Qwen2.5-0.5B's vocabulary, positions and RoPE
base. Parameters (:meth:`TinyModelSpec.num_parameters`): 4,904,288; 31,927,232; 127,617,024;
494,032,768 (Qwen2.5-0.5B itself); 1,543,714,304 (Qwen2.5-1.5B's shape, for GPUs: its
float32 trainer states alone are ~25 GB)."""
DEFAULT_SIZES = ("5m", "30m", "125m", "0.5b")
"""What ``--sizes`` runs by default: the sizes a 24 GB CPU machine holds."""
DEFAULT_CONFIG = bundled_config("bench-scale.yaml")
"""The run config of ``asyncrl bench scale`` when none is given."""


def parse_sizes(text: str) -> tuple[str, ...]:
    """``--sizes``: comma-separated names of :data:`SIZE_SPECS`, returned smallest first;
    ``ValueError`` naming the option for an empty list, an unknown or a repeated name."""
    names = [part.strip().lower() for part in text.split(",") if part.strip()]
    if not names:
        raise ValueError(f"--sizes: name at least one of {', '.join(SIZE_SPECS)}")
    unknown = [n for n in names if n not in SIZE_SPECS]
    if unknown:
        raise ValueError(f"--sizes: unknown size {unknown[0]!r}; choose from {', '.join(SIZE_SPECS)}")
    if len(set(names)) != len(names):
        raise ValueError(f"--sizes: a size repeats in {text!r}")
    return tuple(n for n in SIZE_SPECS if n in names)


@dataclass(frozen=True)
class ScaleBenchSettings:
    """The sizes and what is measured beside each size's run (the run itself is the run
    config's: ``trainer.max_steps`` RL steps of ``trainer.batch_groups`` prompt groups x
    ``rollout.n_samples`` samples, outputs up to ``rollout.max_new_tokens``), then ``repeats``
    fresh versions published, fetched and loaded into a rollout server. Each field but
    ``sample_s`` is the option of the same name, which its errors name."""

    sizes: tuple[str, ...] = DEFAULT_SIZES
    repeats: int = 2
    """Fresh versions published, fetched and loaded per size."""
    sample_s: float = 0.5
    """Interval of the memory sampler (:class:`~asyncrl.bench.process_memory.MemorySampler`)."""
    gpus: tuple[int, ...] | None = None
    """As ``asyncrl bench e2e --gpus`` (:func:`~asyncrl.bench.bench_config.gpu_overrides`)."""
    work_dir: Path | None = None
    """Models, prompts, run roots and logs, one directory per size; None: a new temporary one."""
    json_path: Path | None = None
    png_path: Path | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "sizes", parse_sizes(",".join(self.sizes)))
        if isinstance(self.repeats, bool) or not isinstance(self.repeats, int) or self.repeats < 1:
            raise ValueError(f"--repeats: must be an int >= 1, got {self.repeats!r}")
        if isinstance(self.sample_s, bool) or not isinstance(self.sample_s, int | float) or not self.sample_s > 0:
            raise ValueError(f"sample_s: must be > 0, got {self.sample_s!r}")
        for option, path in (("--json", self.json_path), ("--png", self.png_path)):
            if path is not None and not path.parent.is_dir():
                raise ValueError(f"{option}: {path.parent} is not a directory (checked now, not after the runs)")
        if self.png_path is not None:
            if self.png_path.suffix.lower() != ".png":
                raise ValueError(f"--png: {self.png_path} must end with .png")
            if importlib.util.find_spec("matplotlib") is None:
                raise ValueError("--png: matplotlib is not installed in this environment (pip install matplotlib)")
        self.presets()  # --gpus's own checks, before any run

    def presets(self) -> list[str]:
        """Run config overrides of ``--gpus``; the user's come after."""
        return gpu_overrides(self.gpus)
