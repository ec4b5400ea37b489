"""What the end-to-end benchmark sweeps and on what: its settings (etas, interrupt modes, steps,
placement on CPUs or GPUs), checked when built, the named workloads they start from, and the
workload every run generates (each group's prompt and output budget).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from asyncrl.tasks.system.process_group import usable_cpus
from asyncrl.configs.cpus import check_cpu_cores
from asyncrl.bench.sweep_checks import check_distinct_ints, check_includes_sync, check_modes
from asyncrl.tasks.inference.samples import INTERRUPT_MODES, InterruptMode

if TYPE_CHECKING:
    pass


def split_cores() -> tuple[tuple[int, ...] | None, tuple[int, ...] | None]:
    """(rollout CPUs, trainer CPUs): the first half of this process's usable CPUs (rounded
    down) and the rest, e.g. ((0,), (1,)) on 2 CPUs; (None, None), no pinning, on 1 CPU."""
    cpus = sorted(usable_cpus())
    if len(cpus) < 2:
        return None, None
    half = len(cpus) // 2
    return tuple(cpus[:half]), tuple(cpus[half:])


WORKLOADS: dict[str, dict[str, float]] = {
    "balanced": {},
    "generation-bound": {"max_new_tokens": 1536, "micro_batch_tokens": 2048},
    "mixed": {"code_share": 0.5, "max_prompt_tokens": 96},
}
"""Named workloads: settings they change from the defaults. ``balanced`` (the default):
generation and training take about as long;
``generation-bound``: four times longer outputs, so generation is the bottleneck and the
rollout server's utilisation can be judged; ``mixed``: half the prompts are synthetic code
problems (a weighted mixture file of the two tasks), every code answer run against its tests
in the sandbox (``reward.code.extract: whole``), so the reward wait per step can be judged.
Explicit options override a workload's values."""


@dataclass(frozen=True)
class E2EBenchSettings:
    """The sweep and its workload. The defaults: 9 runs of 16 steps; each run's start-up and
    shutdown are outside its RL-phase wall (:func:`rl_wall_s`)."""

    workload: str = "balanced"
    """Name of the workload (:data:`WORKLOADS`); recorded with the result."""
    etas: tuple[int, ...] = (0, 1, 2, 4, 8)
    """Staleness bounds; must include 0 (the synchronous baseline, run once)."""
    modes: tuple[InterruptMode, ...] = INTERRUPT_MODES
    """Interrupt modes of every eta > 0 (eta = 0 interrupts nothing: it runs with the first)."""
    steps: int = 16
    batch_groups: int = 4
    n_samples: int = 4
    max_new_tokens: int = 384
    """Budget of the longest reference solution; shorter ones get proportionally less."""
    max_prompt_tokens: int = 64
    micro_batch_tokens: int = 1024
    n_prompts: int = 256
    code_share: float = 0.0
    """Weight of the synthetic code task in the prompt mixture (0: arithmetic only)."""
    seed: int = 0
    rollout_cores: tuple[int, ...] | None = field(default_factory=lambda: split_cores()[0])
    trainer_cores: tuple[int, ...] | None = field(default_factory=lambda: split_cores()[1])
    gpus: tuple[int, ...] | None = None
    """GPU ids (as this process sees them) of the rollout server and the trainer: one id, which
    they share (``placement.share_devices``, the server taking its share of the memory, as in
    ``configs/gpu-check.yaml``), or two, (server, trainer). None: CPUs only. With GPUs no CPU
    is pinned: ``rollout_cores`` and ``trainer_cores`` must be None."""
    kv_cache_gib: float = 1.0
    max_groups_in_flight: int | None = None
    """``rollout.max_groups_in_flight`` of every run (None: the staleness gate alone)."""
    work_dir: Path | None = None
    """Model, prompt file, run roots and logs; None = a new temporary directory."""
    json_path: Path | None = None
    """Write the result here as JSON (after every configuration, so a long sweep keeps what it measured)."""

    def __post_init__(self) -> None:
        if self.workload not in WORKLOADS:
            raise ValueError(f"workload: must be one of {list(WORKLOADS)}, got {self.workload!r}")
        check_distinct_ints("etas", self.etas, 0)
        check_includes_sync("etas", self.etas, "the synchronous baseline of every speed-up")
        check_modes("modes", self.modes)
        if self.max_groups_in_flight is not None and self.max_groups_in_flight < 1:
            raise ValueError(f"max_groups_in_flight: must be >= 1 or None, got {self.max_groups_in_flight}")
        for name in ("steps", "batch_groups", "n_samples", "max_new_tokens", "max_prompt_tokens", "n_prompts"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if not 0.0 <= self.code_share < 1.0:
            raise ValueError(f"code_share: must be in [0, 1), got {self.code_share}")
        if self.micro_batch_tokens < self.max_prompt_tokens + self.max_new_tokens:
            raise ValueError(
                f"micro_batch_tokens: {self.micro_batch_tokens} is below max_prompt_tokens + "
                f"max_new_tokens = {self.max_prompt_tokens + self.max_new_tokens}"
            )
        if self.gpus is not None:
            ids_ok = all(isinstance(g, int) and not isinstance(g, bool) and g >= 0 for g in self.gpus)
            if not (1 <= len(self.gpus) <= 2 and ids_ok):
                raise ValueError(f"gpus: one GPU id (shared) or two (server, trainer), ints >= 0; got {self.gpus!r}")
            if self.rollout_cores is not None or self.trainer_cores is not None:
                raise ValueError(
                    "gpus: the rollout server and the trainer run on GPUs; give no rollout_cores or trainer_cores "
                    f"(CPU pinning) with them, got {self.rollout_cores!r} and {self.trainer_cores!r}"
                )
        rollout = check_cpu_cores(self.rollout_cores, "rollout_cores")
        trainer = check_cpu_cores(self.trainer_cores, "trainer_cores")
        shared = sorted(set(rollout or ()) & set(trainer or ()))
        if shared:
            raise ValueError(
                f"rollout_cores, trainer_cores: both hold CPU {', '.join(map(str, shared))}; "
                "pin them to separate CPUs (or pin neither)"
            )
        object.__setattr__(self, "rollout_cores", rollout)
        object.__setattr__(self, "trainer_cores", trainer)

    def placement(self) -> dict[str, dict[str, Any]]:
        """The run config's placement of the rollout server and the trainer (sections
        ``inference``, ``trainer``, ``placement``): GPU device ids with ``gpus``, else CPU pinning."""
        if self.gpus is None:
            return {
                "inference": {"cpu_cores": None if self.rollout_cores is None else list(self.rollout_cores)},
                "trainer": {"cpu_cores": None if self.trainer_cores is None else list(self.trainer_cores)},
                "placement": {},
            }
        server, trainer = self.gpus[0], self.gpus[-1]
        return {
            "inference": {"devices": [[server]]},
            "trainer": {"devices": [trainer]},
            "placement": {"share_devices": server == trainer},
        }

    def sweep(self) -> list[tuple[int, InterruptMode]]:
        """(eta, mode) of every run: eta = 0 once, first; then each eta > 0 in each mode."""
        return [(0, self.modes[0])] + [(eta, mode) for eta in sorted(self.etas) if eta > 0 for mode in self.modes]

    def concurrency(self, eta: int) -> int:
        """Most samples a run keeps in flight: c = min((eta + 1) * B, G) * n (the staleness gate
        admits at most (i + eta + 1) * B groups while the servers hold version i; G =
        ``max_groups_in_flight``, no cap when None)."""
        groups = (eta + 1) * self.batch_groups
        if self.max_groups_in_flight is not None:
            groups = min(groups, self.max_groups_in_flight)
        return groups * self.n_samples


@dataclass(frozen=True)
class Workload:
    """What every run generates: group k's prompt token ids and budget, k < steps * B."""

    model_dir: Path
    train_path: Path
    prompts: tuple[tuple[int, ...], ...]
    budgets: tuple[int, ...]
    code_groups: int = 0
    """Groups of the run whose prompt is a code problem (the ``mixed`` workload)."""

    def batches(self, batch_groups: int) -> list[range]:
        """Group indices of each training step's batch, in admission order."""
        return [range(start, start + batch_groups) for start in range(0, len(self.prompts), batch_groups)]
