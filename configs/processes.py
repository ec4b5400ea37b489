"""The config each process of a run reads: the run's identity, the sections that process uses,
and the few values the launcher derives from several sections and hands down.

The launcher validates the whole :class:`~asyncrl.configs.run_config.RunConfig` (its
cross-section rules included) and writes one file per process (:func:`process_configs`); a
process parses only its own model, so it never sees a section it does not use, nor that
section's secrets (the trainer gets no inference key and no MLflow URI). Sections are the run
config's own models, not copies: a field is declared once, in its section.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import Field

from asyncrl.configs.base import StrictModel
from asyncrl.configs.data import DataConfig
from asyncrl.configs.inference import InferenceConfig
from asyncrl.configs.model import ModelConfig
from asyncrl.configs.pipeline import PipelineConfig
from asyncrl.configs.placement import PlacementConfig
from asyncrl.configs.reward import RewardConfig
from asyncrl.configs.rollout import RolloutConfig
from asyncrl.configs.run_config import RunConfig
from asyncrl.configs.storage import StorageConfig
from asyncrl.configs.trainer import TrainerConfig

ProcessName = Literal["trainer", "scheduler", "evaluator", "reward"]
PROCESS_NAMES: tuple[ProcessName, ...] = ("trainer", "scheduler", "evaluator", "reward")


class ProcessConfig(StrictModel):
    """What every process config holds: the run's identity and its run root."""

    name: str = Field(description="The run's name (RunConfig.name).")
    seed: int = Field(description="The run's seed (RunConfig.seed).")
    work_dir: str = Field(description="The local scratch root (RunConfig.work_dir).")
    storage: StorageConfig = Field(description="The run root.")

    @property
    def run_work_dir(self) -> Path:
        """This run's local scratch directory: ``<work_dir>/<name>``."""
        return Path(self.work_dir) / self.name


class RewardProcessConfig(ProcessConfig):
    """The reward service (``tasks/reward/server.py``)."""

    reward: RewardConfig


class TrainerProcessConfig(ProcessConfig):
    """The trainer (``tasks/trainer/main.py``), RL or the SFT stage."""

    model: ModelConfig
    data: DataConfig
    trainer: TrainerConfig
    reward: RewardConfig = Field(description="Its prompt plug-ins and code extraction (SFT sequences).")
    pipeline: PipelineConfig = Field(description="The SFT stage's steps, batch and optimizer.")
    max_staleness: int = Field(ge=0, description="RunConfig.max_staleness: the bound a trained sample must meet.")
    pass_k: list[int] = Field(description="tracking.pass_k: the pass@k figures of each step.")
    replay_of: StorageConfig | None = Field(None, description="A replay: the run root whose ledger this trainer follows.")
    """Each step trains exactly the shards that run's step trained, read where that run keeps
    them (``asyncrl replay``); None: the shards the scheduler writes to this run root."""


class SchedulerProcessConfig(ProcessConfig):
    """The rollout scheduler (``tasks/scheduler/main.py``)."""

    model: ModelConfig
    data: DataConfig
    rollout: RolloutConfig
    inference: InferenceConfig = Field(description="The servers' API key.")
    trainer: TrainerConfig = Field(description="The batch size, the last step and LoRA.")
    reward: RewardConfig = Field(description="Its prompt plug-ins.")


class EvaluatorProcessConfig(ProcessConfig):
    """The evaluator during training (``tasks/evaluator/main.py``): it launches its own vLLM
    server as the run's servers are launched, hence the placement sections."""

    model: ModelConfig
    data: DataConfig
    rollout: RolloutConfig
    inference: InferenceConfig
    trainer: TrainerConfig
    reward: RewardConfig
    pipeline: PipelineConfig
    placement: PlacementConfig
    pass_k: list[int] = Field(description="tracking.pass_k.")
    longest_sequence: int = Field(ge=1, description="RunConfig.longest_sequence: its server's context length.")


ServerLaunchConfig = RunConfig | EvaluatorProcessConfig
"""What a vLLM server of the run is launched from: the run config (the run's rollout servers)
or the evaluator's (its own server)."""

@dataclass(frozen=True)
class ProcessConfigs:
    """One run's process configs, one field per process."""

    trainer: TrainerProcessConfig
    scheduler: SchedulerProcessConfig
    evaluator: EvaluatorProcessConfig
    reward: RewardProcessConfig

    def items(self) -> list[tuple[ProcessName, ProcessConfig]]:
        """(process name, its config) of every process."""
        return [(name, getattr(self, name)) for name in PROCESS_NAMES]


def process_configs(run: RunConfig) -> ProcessConfigs:
    """Each process's config, cut from the validated run config: its sections as they are, and
    the values derived from several sections (``max_staleness``, ``longest_sequence``,
    ``pass_k``) computed here, once."""
    identity = {"name": run.name, "seed": run.seed, "work_dir": run.work_dir, "storage": run.storage}
    return ProcessConfigs(
        trainer=TrainerProcessConfig(
            **identity, model=run.model, data=run.data, trainer=run.trainer, reward=run.reward,
            pipeline=run.pipeline, max_staleness=run.max_staleness, pass_k=list(run.tracking.pass_k),
        ),
        scheduler=SchedulerProcessConfig(
            **identity, model=run.model, data=run.data, rollout=run.rollout, inference=run.inference,
            trainer=run.trainer, reward=run.reward,
        ),
        evaluator=EvaluatorProcessConfig(
            **identity, model=run.model, data=run.data, rollout=run.rollout, inference=run.inference,
            trainer=run.trainer, reward=run.reward, pipeline=run.pipeline, placement=run.placement,
            pass_k=list(run.tracking.pass_k), longest_sequence=run.longest_sequence,
        ),
        reward=RewardProcessConfig(**identity, reward=run.reward),
    )  # fmt: skip
