"""Reading run configs: YAML files, `a.b=value` overrides, errors that name the key."""

from __future__ import annotations

from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from asyncrl.configs.inference import moved_key
from asyncrl.configs.run_config import RunConfig
from asyncrl.configs.secrets import REDACTED, drop_uri_password, is_secret_key, redact, reveal_context


class ConfigError(ValueError):
    """A run config that cannot be used; the message names the key and the reason."""


ModelT = TypeVar("ModelT", bound=BaseModel)


def parse_override(override: str) -> tuple[list[str], Any]:
    """Split `a.b.c=value` into (["a", "b", "c"], value); the value is read as a YAML scalar
    or flow collection, so `3`, `0.5`, `true`, `null` and `[1, 2]` get their types."""
    key, sep, raw_value = override.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"override {override!r}: expected KEY=VALUE, e.g. trainer.batch_groups=8")
    parts = key.strip().split(".")
    if any(not part for part in parts):
        raise ConfigError(f"override {override!r}: empty component in key {key!r}")
    try:
        value = yaml.safe_load(raw_value) if raw_value.strip() else ""
    except yaml.YAMLError as exc:
        raise ConfigError(f"override {override!r}: value is not valid YAML ({exc})") from exc
    return parts, value


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Return a copy of `raw` with each `a.b=value` override set (later ones win)."""
    result = _deep_copy(raw)
    for override in overrides:
        parts, value = parse_override(override)
        moved = moved_key(".".join(parts))
        if moved:
            raise ConfigError(f"override {override!r}: {moved}")
        node = result
        for depth, part in enumerate(parts[:-1]):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                prefix = ".".join(parts[: depth + 1])
                raise ConfigError(f"override {override!r}: {prefix} is a value, not a section")
            node = child
        node[parts[-1]] = value
    return result


def _deep_copy(raw: dict[str, Any]) -> dict[str, Any]:
    return {k: _deep_copy(v) if isinstance(v, dict) else v for k, v in raw.items()}


def format_validation_error(exc: ValidationError, source: str) -> str:
    """One line per problem: `<source>: <dotted.key>: <reason> (got <value>)`."""
    lines = []
    for error in exc.errors():
        key = ".".join(str(p) for p in error["loc"])
        message = error["msg"].removeprefix("Value error, ")
        if error["type"] == "extra_forbidden":
            message = "unknown key"
        if key and message.startswith(key.split(".")[0] + "."):
            line = message  # a cross-field rule already names its dotted fields
        elif key:
            line = f"{key}: {message}"
        else:
            line = message
        if error["type"] not in ("missing", "value_error") and "input" in error:
            shown = REDACTED if any(is_secret_key(str(p)) for p in error["loc"]) else repr(redact(error["input"]))
            line += f" (got {shown})"
        lines.append(f"{source}: {line}")
    return "\n".join(lines)


def config_from_dict(raw: dict[str, Any], source: str = "config") -> RunConfig:
    """Validate a plain mapping into a RunConfig, raising ConfigError that names each bad key."""
    try:
        return RunConfig.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc, source)) from None


def read_yaml_mapping(path: Path) -> dict[str, Any]:
    """Read a YAML file that must hold a mapping; errors name the file."""
    if not path.is_file():
        raise ConfigError(f"{path}: config file not found")
    try:
        raw = yaml.safe_load(path.read_bytes().decode("utf-8")) or {}
    except UnicodeDecodeError as exc:
        line = exc.object.count(b"\n", 0, exc.start) + 1
        raise ConfigError(
            f"{path}: line {line}: not UTF-8 text (byte {exc.start} is {exc.object[exc.start:exc.start + 1]!r}); "
            "save the config as UTF-8"
        ) from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML ({exc})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: top level must be a mapping of sections, got {type(raw).__name__}")
    return raw


def load_config(path: str | Path, overrides: list[str] | None = None) -> RunConfig:
    """Load a YAML run config, apply `a.b=value` overrides and validate the result."""
    path = Path(path)
    raw = apply_overrides(read_yaml_mapping(path), overrides or [])
    return config_from_dict(raw, source=str(path))


def load_process_config(path: str | Path, model: type[ModelT], overrides: list[str] | None = None) -> ModelT:
    """Load the config the launcher wrote for one process
    (:func:`~asyncrl.configs.processes.process_configs`) as ``model``, with `a.b=value`
    overrides; errors name the file and the key (a whole run config here fails on the
    sections the process does not take)."""
    path = Path(path)
    raw = apply_overrides(read_yaml_mapping(path), overrides or [])
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        message = format_validation_error(exc, str(path))
        if any(error["type"] == "extra_forbidden" and len(error["loc"]) == 1 for error in exc.errors()):
            message += (
                f"\n{path}: a process reads the config its launcher wrote for it "
                "(`<work_dir>/<name>/processes/<process>.yaml`), not a whole run config"
            )
        raise ConfigError(message) from None


def public_dict(config: BaseModel) -> dict[str, Any]:
    """The config as plain data with every secret redacted (:func:`asyncrl.configs.secrets.redact`
    over the JSON dump, which already hides secret fields): safe for config.yaml, MLflow,
    Prefect artifacts, summaries and logs."""
    return redact(config.model_dump(mode="json"))


def parameter_dict(config: RunConfig) -> dict[str, Any]:
    """The config as a parameter of a flow run that the run starts (a remote component):
    public, with its secret fields left out rather than redacted (a redacted value is refused
    where it arrives): ``inference.api_key`` None, ``tracking.mlflow_uri`` without its password.
    The receiving flow run takes them from its own environment, like any deployment run."""
    data = config.model_dump(mode="json")
    data["inference"]["api_key"] = None
    data["tracking"]["mlflow_uri"] = drop_uri_password(config.tracking.mlflow_uri)
    return data


def private_dict(config: BaseModel) -> dict[str, Any]:
    """The config with its secrets in full: only for the run's local process config files
    (mode 0600, :func:`~asyncrl.configs.processes.process_configs`)."""
    return config.model_dump(mode="json", context=reveal_context())


def frozen_yaml(config: BaseModel) -> str:
    """The frozen run config written to `<run root>/config.yaml` (secrets redacted)."""
    return yaml.safe_dump(public_dict(config), sort_keys=False)
