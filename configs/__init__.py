"""Run configuration: the pydantic model and the YAML loader (no heavy imports here)."""

from asyncrl.configs.loading import ConfigError, load_config
from asyncrl.configs.run_config import RunConfig

__all__ = ["ConfigError", "RunConfig", "load_config"]
