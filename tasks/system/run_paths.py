"""The local paths of one run: its run root in storage, its scratch directory, and the private
config its processes read."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from asyncrl.configs.run_config import RunConfig
from asyncrl.storage.fs import RunRoot, open_root


PRIVATE_CONFIG = "run-config.private.yaml"


@dataclass(frozen=True)
class RunPaths:
    """The run root in storage and the local scratch directory of one run."""

    root: RunRoot
    work_dir: Path
    private_config: Path
    """The full config (secrets included) for the processes this run starts: mode 0600,
    local, never uploaded. The run root holds the redacted `config.yaml`."""

    def log(self, name: str) -> Path:
        return self.work_dir / "logs" / name


def run_paths(config: RunConfig) -> RunPaths:
    """The run's paths as :func:`prepare_run` lays them out, writing nothing."""
    return RunPaths(
        root=open_root(config.storage.root, config.storage.options),
        work_dir=config.run_work_dir,
        private_config=config.run_work_dir / PRIVATE_CONFIG,
    )
