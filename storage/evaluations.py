"""Held-out evaluations made while a run trains, in its run root (``evaluations/``):

- one record per evaluated weight version, ``evaluations/v{version:06d}.json``, written
  once (put-if-absent): a version is never recorded twice, whoever tries;
- the evaluator's state, ``evaluations/state.json``: its period K (it evaluates the versions
  that are multiples of K), the newest version it has a record of (``done``) and the version
  it is evaluating now (``current``, None between two). Replaced whole at each change.

The evaluator writes both; the run's lineage recorder reads the state at each poll (one
read) and lists the records only when ``done`` has moved; the trainer's weight retention
keeps the versions :meth:`EvaluatorState.needed` names. A record's content is the
evaluator's business (a JSON object); this module keeps it as given.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from asyncrl.storage import fs, paths
from asyncrl.storage.fs import RunRoot


@dataclass(frozen=True)
class EvaluatorState:
    every: int
    """K: versions that are multiples of K are evaluated."""
    done: int = -1
    """Newest version with a record (-1: none yet)."""
    current: int | None = None
    """Version being evaluated (its weights loaded or about to be); None: none."""

    def __post_init__(self) -> None:
        if isinstance(self.every, bool) or not isinstance(self.every, int) or self.every < 1:
            raise ValueError(f"evaluator state: every must be an int >= 1, got {self.every!r}")
        if isinstance(self.done, bool) or not isinstance(self.done, int) or self.done < -1:
            raise ValueError(f"evaluator state: done must be an int >= -1, got {self.done!r}")
        if self.current is not None and (isinstance(self.current, bool) or not isinstance(self.current, int)):
            raise ValueError(f"evaluator state: current must be an int or None, got {self.current!r}")

    def needed(self, latest: int) -> set[int]:
        """The versions the evaluator may still load, with ``latest`` the newest published:
        ``current``, and the newest multiple of K in (done, latest] (its next pick; older
        pending multiples are skipped, so nothing else is needed)."""
        needed = {self.current} if self.current is not None else set()
        newest = latest - latest % self.every
        if self.done < newest <= latest:
            needed.add(newest)
        return needed


@dataclass(frozen=True)
class EvalResult:
    version: int
    pass_at_1: float
    prompts: int
    samples_per_prompt: int
    mean_output_tokens: float
    by_task: dict[str, float] = field(default_factory=dict)
    """:func:`~asyncrl.tasks.reward.pass_at_k.task_figures` of the held-out prompts (``pass_at_1/<task>``, ...)."""
    prompt_pass: tuple[float, ...] = ()
    """Each prompt's c_p / n, in the held-out file's order: what a paired comparison of two
    versions on the same prompts pairs (the promotion gate)."""
    prompt_tasks: tuple[str, ...] = ()
    """Each prompt's task, in the same order."""

    def metrics(self, prefix: str = "eval_") -> dict[str, float]:
        """The figures as metrics named ``<prefix>pass_at_1``, ``<prefix>pass_at_1/<task>``, ...
        (``eval_``: the evaluate stage's, on each LoggedModel; ``eval/``: evaluation during
        training, on the run at step = version)."""
        return {
            f"{prefix}pass_at_1": self.pass_at_1,
            f"{prefix}prompts": float(self.prompts),
            f"{prefix}mean_output_tokens": self.mean_output_tokens,
            **{f"{prefix}{name}": value for name, value in self.by_task.items()},
        }

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> EvalResult:
        """The result of its JSON form (``dataclasses.asdict``); other keys are ignored."""
        values = {f.name: raw[f.name] for f in fields(cls) if f.name in raw}
        for name in ("prompt_pass", "prompt_tasks"):
            if name in values:
                values[name] = tuple(values[name])
        return cls(**values)


class EvaluationStore:
    """The ``evaluations/`` part of one run root (see the module docstring)."""

    def __init__(self, root: RunRoot) -> None:
        self.root = root

    def write(self, version: int, record: dict[str, Any]) -> bool:
        """Record ``version``'s result; False (nothing written) if it has a record already."""
        data = json.dumps(record, sort_keys=True).encode()
        try:
            fs.put_if_absent(self.root, paths.evaluation_record(version), data)
        except FileExistsError:
            return False
        return True

    def read(self, version: int) -> dict[str, Any] | None:
        return fs.read_json_object(self.root, paths.evaluation_record(version))

    def versions(self) -> list[int]:
        """The versions that have a record, ascending (one listing)."""
        found = (paths.parse_evaluation_record_name(name) for name in fs.list_dir(self.root, paths.EVALUATIONS_DIR))
        return sorted(v for v in found if v is not None)

    def records_after(self, after: int) -> dict[int, dict[str, Any]]:
        """Every record of a version above ``after``, by version (one listing, then their reads)."""
        wanted = [v for v in self.versions() if v > after]
        raw = fs.read_many(self.root, [paths.evaluation_record(v) for v in wanted])
        records = {}
        for version in wanted:
            content = json.loads(raw[paths.evaluation_record(version)])
            if not isinstance(content, dict):
                raise ValueError(f"{self.root.display(paths.evaluation_record(version))}: not a JSON object")
            records[version] = content
        return records

    def state(self) -> EvaluatorState | None:
        """The evaluator's state, None if no evaluator has run on this root; ``ValueError``
        names the object if it is malformed."""
        content = fs.read_json_object(self.root, paths.EVALUATIONS_STATE)
        if content is None:
            return None
        try:
            return EvaluatorState(**content)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{self.root.display(paths.EVALUATIONS_STATE)}: {exc}") from None

    def set_state(self, state: EvaluatorState) -> None:
        fs.put_atomic_replace(self.root, paths.EVALUATIONS_STATE, json.dumps(asdict(state)).encode())
