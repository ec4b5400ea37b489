"""What the end-to-end benchmark sweeps and on what: its own settings (etas, interrupt modes,
the named workload, ``--gpus``), checked when built, the named workloads, and the workload
every run generates (each group's prompt and output budget). Everything its runs share is
the run config's (``configs/bench-e2e.yaml`` by default; :mod:`asyncrl.bench.bench_config`).
"""

from __future__ import annotations

import types
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from asyncrl.bench.bench_config import bundled_config, gpu_overrides
from asyncrl.bench.sweep_checks import check_distinct_ints, check_includes_sync, check_modes
from asyncrl.tasks.inference.samples import INTERRUPT_MODES, InterruptMode

if TYPE_CHECKING:
    from asyncrl.configs.run_config import RunConfig

DEFAULT_CONFIG = bundled_config("bench-e2e.yaml")
"""The run config of ``asyncrl bench e2e`` when none is given."""
N_PROMPTS = 256
"""Synthetic problems in the prompt file of ``asyncrl bench e2e`` and ``asyncrl bench scale``."""


@dataclass(frozen=True)
class WorkloadPreset:
    """A named workload: run config overrides applied before the user's, and the share of
    synthetic code problems among the prompts (not a run config key: the bench writes them)."""

    overrides: tuple[str, ...] = ()
    code_share: float = 0.0


WORKLOADS: types.MappingProxyType[str, WorkloadPreset] = types.MappingProxyType({
    "balanced": WorkloadPreset(),
    "generation-bound": WorkloadPreset(("rollout.max_new_tokens=1536", "trainer.micro_batch_tokens=2048")),
    "mixed": WorkloadPreset(("data.max_prompt_tokens=96",), code_share=0.5),
})  # fmt: skip
"""``balanced`` (the default): generation and training take about as long;
``generation-bound``: four times longer outputs, so generation is the bottleneck and the
rollout server's utilisation can be judged; ``mixed``: half the prompts are synthetic code
problems (a weighted mixture file of the two tasks), every code answer run against its tests
in the sandbox (``reward.code.extract: whole``), so the reward wait per step can be judged.
The user's overrides win over a workload's."""


@dataclass(frozen=True)
class E2EBenchSettings:
    """The sweep and its workload. The defaults: 9 runs; each run's start-up and shutdown are
    outside its RL-phase wall (:func:`~asyncrl.bench.e2e_figures.rl_wall_s`)."""

    workload: str = "balanced"
    """Name of the workload (:data:`WORKLOADS`); recorded with the result."""
    etas: tuple[int, ...] = (0, 1, 2, 4, 8)
    """Staleness bounds (``rollout.eta`` of each run); must include 0 (the synchronous baseline, run once)."""
    modes: tuple[InterruptMode, ...] = INTERRUPT_MODES
    """Interrupt modes of every eta > 0 (eta = 0 interrupts nothing: it runs with the first)."""
    n_prompts: int = N_PROMPTS
    """Synthetic problems in the prompt file the runs draw from."""
    gpus: tuple[int, ...] | None = None
    """``--gpus`` (:func:`~asyncrl.bench.bench_config.gpu_overrides`); None: CPUs."""
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
        if self.n_prompts < 1:
            raise ValueError(f"n_prompts: must be >= 1, got {self.n_prompts}")
        self.presets()  # --gpus's own checks, before any run

    @property
    def code_share(self) -> float:
        """Weight of the synthetic code task in the prompt mixture (0: arithmetic only)."""
        return WORKLOADS[self.workload].code_share

    def presets(self) -> list[str]:
        """Run config overrides of the workload, then of ``--gpus``; the user's come after."""
        return [*WORKLOADS[self.workload].overrides, *gpu_overrides(self.gpus)]

    def sweep(self) -> list[tuple[int, InterruptMode]]:
        """(eta, mode) of every run: eta = 0 once, first; then each eta > 0 in each mode."""
        return [(0, self.modes[0])] + [(eta, mode) for eta in sorted(self.etas) if eta > 0 for mode in self.modes]


SWEPT_KEYS: types.MappingProxyType[str, str] = types.MappingProxyType(
    {"rollout.eta": "--etas", "rollout.interrupt_mode": "--modes"}
)
"""Run config keys the sweep sets in every run, and the option that sets them."""


def check_not_swept(overrides: Sequence[str]) -> None:
    """``ValueError`` for an override of a key the sweep sets (:data:`SWEPT_KEYS`), naming the
    option to use instead: the override would change no run."""
    for override in overrides:
        key = override.partition("=")[0].strip()
        if key in SWEPT_KEYS:
            raise ValueError(f"{key}: the sweep sets it in every run; use {SWEPT_KEYS[key]} instead of {override!r}")


def concurrency(config: RunConfig, eta: int) -> int:
    """Most samples a run keeps in flight: c = min((eta + 1) * B, G) * n, with B =
    ``trainer.batch_groups``, n = ``rollout.n_samples`` and G = ``rollout.max_groups_in_flight``
    (no cap when None): the staleness gate admits at most (i + eta + 1) * B groups while the
    servers hold version i."""
    groups = (eta + 1) * config.trainer.batch_groups
    if config.rollout.max_groups_in_flight is not None:
        groups = min(groups, config.rollout.max_groups_in_flight)
    return groups * config.rollout.n_samples


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
