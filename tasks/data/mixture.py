"""Mixture files: one dataset made of several prompt files, each with a weight.

A ``.yaml``/``.yml`` path given to ``load_prompts`` holds an optional ``seed`` and
``sources``, each ``{path, weight (> 0, default 1), task (optional)}``; a relative path
resolves against the mixture file's directory. One epoch: with n_i records in source i,
N = sum_i n_i and W = sum_i w_i, source i contributes c_i = floor(N * w_i / W + 1/2) records,
r[p_i[j mod n_i]] for j = 0 .. c_i - 1 with p_i a shuffle seeded by (seed, i), so a source
cycles when c_i > n_i and gives a seeded subset otherwise. The epoch is then shuffled
(seeded), so any prefix samples the mixture. Ids become ``"{i}:{prompt_id}"``, and
``"{i}:{prompt_id}~{k}"`` for the k-th repeat: distinct and stable. Example:
``docs/internals/data.md``.
"""

from __future__ import annotations

import math
import os
import posixpath
import random
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, ValidationError

from asyncrl.tasks.data.records import DatasetError, PromptRecord

MIXTURE_SUFFIXES: tuple[str, ...] = (".yaml", ".yml")


class _Source(BaseModel):
    model_config = ConfigDict(extra="forbid")

    path: Annotated[StrictStr, Field(min_length=1)]
    weight: Annotated[float, Field(gt=0, allow_inf_nan=False)] = 1.0
    task: Annotated[StrictStr, Field(min_length=1)] | None = None


class _Spec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    sources: Annotated[list[_Source], Field(min_length=1)]
    seed: StrictInt = 0


@dataclass(frozen=True)
class MixtureSource:
    path: str
    """Resolved: relative paths joined to the mixture file's directory."""
    weight: float = 1.0
    task: str | None = None


@dataclass(frozen=True)
class Mixture:
    path: str
    sources: tuple[MixtureSource, ...]
    seed: int = 0


def _location(loc: Sequence[Any]) -> str:
    text = ""
    for part in loc:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text or "(top level)"


def resolve_source(mixture_path: str, source: str) -> str:
    """``source`` as given if it is a URI or an absolute path, else joined to the mixture's directory."""
    if "://" in source or os.path.isabs(source):
        return source
    if "://" in mixture_path:
        scheme, rest = mixture_path.split("://", 1)
        return f"{scheme}://{posixpath.normpath(posixpath.join(posixpath.dirname(rest), source))}"
    return os.path.normpath(os.path.join(os.path.dirname(mixture_path), source))


def parse_mixture(raw: bytes, path: str) -> Mixture:
    """Validate a mixture file's bytes; a :class:`DatasetError` names the file and field."""
    import yaml

    try:
        data = yaml.safe_load(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise DatasetError(f"{path}: not UTF-8 text (byte {exc.start}); save the mixture file as UTF-8") from None
    except yaml.YAMLError as exc:
        raise DatasetError(f"{path}: not valid YAML ({exc})".replace("\n", " ")) from None
    if not isinstance(data, dict):
        raise DatasetError(f"{path}: a mixture file must be a mapping with 'sources' (and optional 'seed'), got {type(data).__name__}")
    try:
        spec = _Spec.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(f"field {_location(e['loc'])!r}: {e['msg']}" for e in exc.errors())
        raise DatasetError(f"{path}: {problems}") from None
    sources = tuple(
        MixtureSource(path=resolve_source(path, s.path), weight=s.weight, task=s.task) for s in spec.sources
    )
    return Mixture(path=path, sources=sources, seed=spec.seed)


def source_counts(mixture: Mixture, sizes: Sequence[int]) -> list[int]:
    """``c_i = floor(N * w_i / W + 1/2)`` (module docstring)."""
    total, weight = sum(sizes), sum(source.weight for source in mixture.sources)
    return [math.floor(total * source.weight / weight + 0.5) for source in mixture.sources]


def mix(mixture: Mixture, loaded: Sequence[Sequence[PromptRecord]]) -> list[PromptRecord]:
    """One epoch of the mixture from each source's records (module docstring)."""
    epoch: list[PromptRecord] = []
    for index, (records, count) in enumerate(zip(loaded, source_counts(mixture, [len(r) for r in loaded]))):
        order = list(range(len(records)))
        random.Random(f"{mixture.seed}:{index}").shuffle(order)
        for j in range(count):
            record = records[order[j % len(records)]]
            repeat = j // len(records)
            suffix = f"~{repeat}" if repeat else ""
            epoch.append(replace(record, prompt_id=f"{index}:{record.prompt_id}{suffix}"))
    random.Random(f"{mixture.seed}:epoch").shuffle(epoch)
    return epoch
