"""Process config files as the launcher writes them: a run config (a plain mapping) validated,
then cut for one process (:func:`asyncrl.configs.processes.process_configs`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from asyncrl.configs.loading import config_from_dict, private_dict
from asyncrl.configs.processes import ProcessName, process_configs


def write_process_config(path: Path, run: dict[str, Any], process: ProcessName) -> Path:
    """``process``'s config of the run config ``run``, written to ``path``."""
    config = getattr(process_configs(config_from_dict(run)), process)
    path.write_text(yaml.safe_dump(private_dict(config), sort_keys=False))
    return path
