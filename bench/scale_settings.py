"""What ``asyncrl bench scale`` runs: the Qwen2 model sizes it compares and its settings,
checked when built with errors that name the command-line option.

Every size keeps Qwen2.5's real vocabulary (151,936 tokens, tied embeddings), so the
embedding alone is V * hidden parameters: the smallest hidden size a vLLM CPU attention
kernel takes (head size 32) already makes it 4.86 M, and the smallest preset is ~5 M, not 3 M.
The larger shapes follow Qwen2.5's proportions (head size 64, intermediate ~5.4 x hidden).
"""

from __future__ import annotations

import importlib.util
import types
from dataclasses import dataclass, field, replace
from pathlib import Path

from asyncrl.bench.e2e_settings import E2EBenchSettings, split_cores
from asyncrl.tasks.inference.samples import INTERRUPT_MODES
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
MODEL_DTYPE = "float32"
"""dtype of each size's checkpoint: the run's ``model.dtype`` (its default, as on CPU), in
which the trainer publishes, so the base checkpoint and every version have the same bytes."""
MAX_PROMPT_TOKENS = 64
"""``data.max_prompt_tokens`` of the runs (the synthetic prompts are a few dozen tokens)."""


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
    """The sizes and the workload every size runs: ``steps`` RL steps of ``batch_groups``
    prompt groups x ``n_samples`` samples, outputs up to ``max_new_tokens`` (budgets follow the
    reference solutions, EOS ignored, as in ``asyncrl bench e2e``), then ``repeats`` fresh
    versions published, fetched and loaded into a rollout server. Each field but ``sample_s``
    is the option of the same name (``--batch-groups`` for ``batch_groups``), which its
    errors name."""

    sizes: tuple[str, ...] = DEFAULT_SIZES
    steps: int = 3
    """RL steps per size; the figures are the mean of the steps after the first (which also
    allocates the optimizer's states), or of the one step."""
    repeats: int = 2
    """Fresh versions published, fetched and loaded per size."""
    eta: int = 0
    """``rollout.eta``: 0 (default) trains the same samples at every size, so step times compare."""
    batch_groups: int = 4
    n_samples: int = 4
    max_new_tokens: int = 256
    micro_batch_tokens: int = 4096
    """``trainer.micro_batch_tokens``: a step's samples fit in one micro-batch, longer than
    one logit chunk (``trainer.logit_chunk_tokens``)."""
    logit_chunk_tokens: int = 1024
    """``trainer.logit_chunk_tokens``: positions whose (tokens x 151,936) logits exist at once."""
    activation_checkpointing: bool = False
    """``trainer.activation_checkpointing``: decoder layers recomputed in backward."""
    zero_stage: int = 0
    """``trainer.zero_stage`` of the one trainer process: 0, since on one rank ZeRO partitions
    nothing and its stage 1-2 optimizer keeps a second float32 copy of the parameters."""
    seed: int = 0
    sample_s: float = 0.5
    """Interval of the memory sampler (:class:`~asyncrl.bench.process_memory.MemorySampler`)."""
    rollout_cores: tuple[int, ...] | None = field(default_factory=lambda: split_cores()[0])
    trainer_cores: tuple[int, ...] | None = field(default_factory=lambda: split_cores()[1])
    gpus: tuple[int, ...] | None = None
    """As ``asyncrl bench e2e --gpus`` (:class:`E2EBenchSettings`)."""
    work_dir: Path | None = None
    """Models, prompts, run roots and logs, one directory per size; None: a new temporary one."""
    json_path: Path | None = None
    png_path: Path | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "sizes", parse_sizes(",".join(self.sizes)))
        for name, low in (("steps", 1), ("repeats", 1), ("eta", 0), ("batch_groups", 1), ("n_samples", 1),
                          ("max_new_tokens", 1), ("micro_batch_tokens", 1), ("logit_chunk_tokens", 1), ("seed", 0)):  # fmt: skip
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"--{name.replace('_', '-')}: must be an int >= {low}, got {value!r}")
        if self.micro_batch_tokens < MAX_PROMPT_TOKENS + self.max_new_tokens:
            raise ValueError(
                f"--micro-batch-tokens: {self.micro_batch_tokens} is below the longest sequence, "
                f"{MAX_PROMPT_TOKENS} prompt + {self.max_new_tokens} (--max-new-tokens) output tokens"
            )
        if self.zero_stage not in (0, 1, 2, 3) or isinstance(self.zero_stage, bool):
            raise ValueError(f"--zero-stage: must be 0, 1, 2 or 3, got {self.zero_stage!r}")
        if not isinstance(self.activation_checkpointing, bool):
            raise ValueError(f"--activation-checkpointing: must be a bool, got {self.activation_checkpointing!r}")
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
        self.e2e_settings()  # the placement's own checks (CPUs, GPUs), before any run

    def e2e_settings(self) -> E2EBenchSettings:
        """The same workload as :class:`E2EBenchSettings`: what ``asyncrl bench e2e``'s
        workload and run config are built from (one eta, one interrupt mode)."""
        return E2EBenchSettings(
            etas=tuple(sorted({0, self.eta})),
            modes=INTERRUPT_MODES[:1],
            steps=self.steps,
            batch_groups=self.batch_groups,
            n_samples=self.n_samples,
            max_new_tokens=self.max_new_tokens,
            max_prompt_tokens=MAX_PROMPT_TOKENS,
            micro_batch_tokens=self.micro_batch_tokens,
            seed=self.seed,
            rollout_cores=self.rollout_cores,
            trainer_cores=self.trainer_cores,
            gpus=self.gpus,
            work_dir=self.work_dir,
        )
