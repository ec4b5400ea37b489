"""Per-step metrics: a sink protocol, a JSON Lines file sink, and a fan-out.

The orchestration layer supplies its own sink (e.g. MLflow) by implementing
:class:`MetricsSink`; the trainer only ever calls ``log``.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Protocol, runtime_checkable


@runtime_checkable
class MetricsSink(Protocol):
    """Receives one mapping of metric name -> value per training step."""

    def log(self, step: int, metrics: Mapping[str, float]) -> None: ...


class JsonlMetricsSink:
    """Appends ``{"step": ..., "time": ..., <metrics>}`` as one JSON line per call.

    Non-finite values are written as null (JSON has no NaN); each line is flushed, so a
    killed trainer leaves whole lines only (a torn last line at worst).
    """

    def __init__(self, path: Path) -> None:
        self._path = Path(path)
        self._path.parent.mkdir(parents=True, exist_ok=True)

    @property
    def path(self) -> Path:
        return self._path

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        record: dict[str, float | int | None] = {"step": step, "time": time.time()}
        for name, value in metrics.items():
            number = float(value)
            record[name] = number if math.isfinite(number) else None
        with open(self._path, "a", encoding="utf-8") as handle:
            handle.write(json.dumps(record) + "\n")
            handle.flush()


class FanoutSink:
    """Forwards every step's metrics to several sinks, in order."""

    def __init__(self, sinks: Sequence[MetricsSink]) -> None:
        self._sinks = tuple(sinks)

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        for sink in self._sinks:
            sink.log(step, metrics)


def read_jsonl_metrics(path: Path) -> list[dict[str, float | int | None]]:
    """The records of a metrics file, skipping a torn last line left by a killed writer."""
    records = []
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    for number, line in enumerate(lines, start=1):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if number == len(lines):
                break
            raise ValueError(f"{path}: line {number} is not JSON: {line[:120]!r}") from None
    return records
