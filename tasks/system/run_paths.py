"""The local paths of one run: its run root in storage, its scratch directory, and the config
file of each process it starts."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from asyncrl.configs.processes import ProcessConfig, ProcessName
from asyncrl.configs.run_config import RunConfig
from asyncrl.storage.fs import RunRoot, open_root

PROCESS_CONFIG_DIR = "processes"


@dataclass(frozen=True)
class RunPaths:
    """The run root in storage and the local scratch directory of one run."""

    root: RunRoot
    work_dir: Path

    def log(self, name: str) -> Path:
        return self.work_dir / "logs" / name

    @property
    def token_counts(self) -> Path:
        """Each scheduler process's count of output tokens received
        (:class:`~asyncrl.tasks.system.durable_count.DurableCount`, prefix ``delivered``):
        local, one small file per process start."""
        return self.work_dir / "token-counts"

    def process_config(self, process: ProcessName) -> Path:
        """The config file of ``process`` (:func:`~asyncrl.configs.processes.process_configs`):
        its secrets included, so mode 0600, local, never uploaded. The run root holds the
        redacted run config, `config.yaml`."""
        return self.work_dir / PROCESS_CONFIG_DIR / f"{process}.yaml"


def run_paths(config: RunConfig | ProcessConfig) -> RunPaths:
    """The run's paths as :func:`prepare_run` lays them out, writing nothing."""
    return RunPaths(root=open_root(config.storage.root, config.storage.options), work_dir=config.run_work_dir)
