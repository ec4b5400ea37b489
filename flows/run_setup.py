"""What every flow does first: open the run root, freeze the config into it, and lay out
the local scratch directory. Plain functions; the flows call them."""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path

import yaml

from asyncrl.configs.loading import frozen_yaml
from asyncrl.configs.run_config import RunConfig
from asyncrl.storage import fs, paths
from asyncrl.storage.fs import RunRoot, open_root


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


def prepare_run(config: RunConfig) -> RunPaths:
    """Open the root, write `config.yaml` once (a restarted run must keep its config), and
    write the private config for child processes."""
    root = open_root(config.storage.root, config.storage.options)
    frozen = frozen_yaml(config).encode()
    try:
        fs.put_if_absent(root, paths.CONFIG, frozen)
    except FileExistsError:
        existing = yaml.safe_load(fs.read_bytes(root, paths.CONFIG))
        if existing.get("name") != config.name:
            raise ValueError(
                f"{root.display(paths.CONFIG)}: the run root belongs to run {existing.get('name')!r}, "
                f"not {config.name!r}; use another storage.root"
            ) from None
    work_dir = Path(config.work_dir) / config.name
    (work_dir / "logs").mkdir(parents=True, exist_ok=True)
    private = work_dir / "run-config.private.yaml"
    full = config.model_dump(mode="json")
    if config.rollout.api_key is not None:
        full["rollout"]["api_key"] = config.rollout.api_key.get_secret_value()
    descriptor = os.open(private, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, stat.S_IRUSR | stat.S_IWUSR)
    with os.fdopen(descriptor, "w") as handle:
        yaml.safe_dump(full, handle, sort_keys=False)
    return RunPaths(root=root, work_dir=work_dir, private_config=private)
