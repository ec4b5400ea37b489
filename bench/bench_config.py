"""The run config a bench's runs start from (``asyncrl bench e2e``, ``asyncrl bench scale``): a
YAML file (the bench's own under ``configs/`` unless one is named), the bench's presets (a
named workload, ``--gpus``), then the user's ``a.b=value`` overrides, which win. Every value
the runs share is a run config key, declared once in ``configs/``; the bench sets only what
differs per run (its sweep, names and paths).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import asyncrl.configs
from asyncrl.tasks.system.process_group import usable_cpus

if TYPE_CHECKING:
    from asyncrl.configs.run_config import RunConfig

PLACEMENT_KEYS = frozenset({"cpu_cores", "devices"})
"""Keys of ``inference`` and ``trainer`` that place a component; with none set the bench
splits the CPUs (:func:`split_cores`)."""


def bundled_config(name: str) -> Path:
    """A run config file shipped in ``configs/`` (e.g. ``bench-e2e.yaml``)."""
    return Path(asyncrl.configs.__file__).parent / name


def split_cores() -> tuple[tuple[int, ...] | None, tuple[int, ...] | None]:
    """(rollout CPUs, trainer CPUs): the first half of this process's usable CPUs (rounded
    down) and the rest, e.g. ((0,), (1,)) on 2 CPUs; (None, None), no pinning, on 1 CPU."""
    cpus = sorted(usable_cpus())
    if len(cpus) < 2:
        return None, None
    half = len(cpus) // 2
    return tuple(cpus[:half]), tuple(cpus[half:])


def config_and_overrides(config: str | None, positionals: Sequence[str], default: Path) -> tuple[Path, list[str]]:
    """The run config file and the overrides of a bench's ``[CONFIG] [KEY=VALUE ...]`` and
    ``--config``: ``--config``, else a first positional that is a file or holds no ``=``, else
    ``default``; ``ValueError`` when the config is given twice."""
    rest = list(positionals)
    if rest and (Path(rest[0]).is_file() or "=" not in rest[0]):
        if config is not None:
            raise ValueError(f"{rest[0]}: the run config is already --config {config}; give it once")
        config, rest = rest[0], rest[1:]
    return (Path(config) if config is not None else default), rest


def gpu_overrides(gpus: Sequence[int] | None) -> list[str]:
    """``--gpus``: one GPU id, shared by the rollout server and the trainer
    (``placement.share_devices``, the server taking its share of the memory), or two, (server,
    trainer), as ``inference.devices`` and ``trainer.devices``; none for None (CPUs).
    ``ValueError`` naming ``--gpus`` for another count or an id that is not an int >= 0."""
    if gpus is None:
        return []
    ids_ok = all(isinstance(g, int) and not isinstance(g, bool) and g >= 0 for g in gpus)
    if not (1 <= len(gpus) <= 2 and ids_ok):
        raise ValueError(f"--gpus: one GPU id (shared) or two (server, trainer), ints >= 0; got {tuple(gpus)!r}")
    server, trainer = gpus[0], gpus[-1]
    shared = "true" if server == trainer else "false"
    return [f"inference.devices=[[{server}]]", f"trainer.devices=[{trainer}]", f"placement.share_devices={shared}"]


def is_placed(config: RunConfig) -> bool:
    """Whether the config sets a placement key (:data:`PLACEMENT_KEYS`, null included) of the
    rollout servers or the trainer."""
    return bool(PLACEMENT_KEYS & (config.inference.model_fields_set | config.trainer.model_fields_set))


def load_bench_config(path: Path, presets: Sequence[str], overrides: Sequence[str]) -> RunConfig:
    """``path`` with ``presets`` then ``overrides`` applied (later ones win), validated (a
    ``ConfigError`` names the file and each bad key). Unless it places the components
    (:func:`is_placed`), the rollout servers and the trainer are pinned to the two halves of
    the CPUs (:func:`split_cores`; ``inference.cpu_cores=null`` pins nothing)."""
    from asyncrl.configs.loading import apply_overrides, config_from_dict, read_yaml_mapping

    raw = apply_overrides(read_yaml_mapping(path), [*presets, *overrides])
    config = config_from_dict(raw, source=str(path))
    rollout, trainer = split_cores()
    if is_placed(config) or rollout is None or trainer is None:
        return config
    split = [f"inference.cpu_cores=[{','.join(map(str, rollout))}]", f"trainer.cpu_cores=[{','.join(map(str, trainer))}]"]
    return config_from_dict(apply_overrides(raw, split), source=str(path))
