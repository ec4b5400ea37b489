"""Feeds MLflow from what the trainer leaves in storage: per-step metrics (its JSONL file, or
the ``metrics`` of its lineage files when the trainer runs elsewhere) and each published
weight version with the shards it was trained on, as a LoggedModel plus one lineage
manifest artifact; with ``follow_evaluations``, the evaluator's records as ``eval/*``
metrics. The trainer process itself never talks to MLflow. Work per poll does not grow
with the run: the metrics file is read from where the last poll stopped, versions come from
a :class:`VersionFollower` that looks only above the last one handed out, and evaluation
records are listed only when the evaluator's state says there is a new one.
Requests per poll: ``docs/internals/tracking.md``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa

from asyncrl.storage import fs, paths
from asyncrl.storage.errors import ShardValidationError
from asyncrl.storage.evaluations import EvaluationStore
from asyncrl.storage.fs import RunRoot
from asyncrl.tasks.tracking.mlflow_run import DataRef, RunLineage
from asyncrl.storage.schema import ShardMetadata
from asyncrl.storage.shards import quarantined_shard_names
from asyncrl.storage.weight_lineage import read_lineage
from asyncrl.storage.weights import WeightStore
from asyncrl.storage.evaluations import EvalResult
from asyncrl.tasks.data.train_files import file_digest

LOG = logging.getLogger("asyncrl.lineage")
EVAL_PREFIX = "eval/"
"""Prefix of the MLflow metrics of evaluation during training (step = weight version)."""


def _read_shard(root: RunRoot, shard_name: str) -> tuple[str, bytes]:
    """Where the shard is now and its bytes: ``consumed/`` (after its step), else
    ``trajectories/`` (rolled back), else ``quarantine/`` (under its name, else a copy with a
    unique suffix: one listing); :class:`FileNotFoundError` names all three if none holds it.
    One read for a consumed shard."""
    candidates = (
        paths.consumed_shard_path(shard_name),
        paths.shard_path(shard_name),
        paths.quarantine_path(shard_name),
    )
    for relpath in candidates:
        try:
            return relpath, fs.read_bytes(root, relpath)
        except FileNotFoundError:
            continue
    for relpath in quarantined_shard_names(root).get(shard_name, ()):
        try:
            return relpath, fs.read_bytes(root, relpath)
        except FileNotFoundError:
            continue
    raise FileNotFoundError(f"shard {shard_name} is in none of {[root.display(c) for c in candidates]}")


def shard_record(root: RunRoot, shard_name: str) -> dict[str, Any]:
    """A shard as the lineage manifest lists it: name, URI, sha256 of its bytes (first 16 hex),
    and the rows and groups its Arrow metadata states (None if unreadable)."""
    relpath, data = _read_shard(root, shard_name)
    rows: int | None = None
    groups: int | None = None
    try:
        metadata = ShardMetadata.from_arrow(pa.ipc.open_file(pa.py_buffer(data)).schema.metadata, relpath)
        rows, groups = metadata.num_rows, metadata.num_groups
    except (pa.ArrowException, OSError, ValueError, ShardValidationError):
        pass
    return {
        "name": shard_name,
        "uri": root.display(relpath),
        "digest": hashlib.sha256(data).hexdigest()[:16],
        "rows": rows,
        "groups": groups,
    }


def version_manifest(
    root: RunRoot,
    version: int,
    datasets: Sequence[DataRef] = (),
    lineage: dict[str, Any] | None = None,
    shards_root: RunRoot | None = None,
) -> dict[str, Any]:
    """The lineage manifest of weight ``version``: step, version, parent version, each shard
    it was trained on (:func:`shard_record`), from its lineage file, and the prompt
    ``datasets`` the shards' prompts came from (name, URI, digest). ``lineage``: the version's
    lineage file if the caller has read it already; ``shards_root``: where the shards are, when
    not in ``root`` (a replay trains another run's shards)."""
    info = (read_lineage(root, version) if lineage is None else lineage) or {}
    step = info.get("step")
    return {
        "version": version,
        "step": step if isinstance(step, int) else None,
        "parent_version": info.get("parent_version"),
        "shards": [shard_record(shards_root or root, name) for name in info.get("shards", [])],
        "datasets": [asdict(ref) for ref in datasets],
    }


def file_ref(path: str, name: str) -> DataRef:
    """A dataset file as an MLflow dataset (:func:`~asyncrl.tasks.data.train_files.file_digest`)."""
    import fsspec

    return DataRef(name=name, uri=str(path), digest=file_digest(*fsspec.core.url_to_fs(str(path))))


class VersionFollower:
    """Hands out each published weight version once, in order, without listing versions.

    ``after`` is the last version handed out (-1: none). :meth:`new_versions` reads ``LATEST``
    (L) and walks after+1 .. L: a version whose manifest is there is yielded; one without
    (pruned by retention before it was handed out, or a publish abandoned by a killed
    trainer: versions only grow, so neither can appear later) is skipped with a warning.
    ``after`` moves past a version only once the caller's work on it is done (the
    generator resumes), so a failure retries it at the next poll. Work per call: one read,
    plus one existence check per version above ``after``. A version complete above L (a
    publisher killed between manifest and pointer) is handed out once L passes it.
    Restart-safe: the follower keeps nothing in storage; a restarted one starts from what
    its owner already holds (e.g. the versions MLflow has).
    """

    def __init__(self, root: RunRoot, after: int = -1) -> None:
        self._root = root
        self._store = WeightStore(root)
        self.after = after

    def new_versions(self) -> Iterator[int]:
        latest = self._store.latest()
        if latest is None:
            return
        for version in range(self.after + 1, latest + 1):
            if fs.exists(self._root, paths.weights_complete_marker(version)):
                yield version
            else:
                LOG.warning(
                    "weight version %d was not logged to MLflow: it is no longer published "
                    "(pruned by retention, or its publish was abandoned); skipped", version
                )
            self.after = version


@dataclass
class LineageRecorder:
    lineage: RunLineage
    root: RunRoot
    metrics_file: Path
    datasets: Sequence[DataRef] = ()
    """The prompt datasets of the run (each version's manifest names them)."""
    logged_versions: dict[int, str] = field(default_factory=dict)
    """Weight version -> LoggedModel id."""
    metrics_by_step: dict[int, dict[str, float]] = field(default_factory=dict)
    follow_evaluations: bool = False
    """Log the evaluator's records (evaluation during training) too."""
    evaluations: dict[int, EvalResult] = field(default_factory=dict)
    """Weight version -> its held-out result evaluated during training."""
    shards_root: RunRoot | None = None
    """Where the shards the versions name are, when not in ``root`` (a replay's: the original's)."""
    _metrics_offset: int = 0
    """Bytes of the metrics file already read (whole lines only)."""
    _follower: VersionFollower | None = None
    _evaluated_after: int = -1
    """Newest version whose record has been read."""
    _evaluations_in_mlflow: set[int] = field(default_factory=set)
    """Versions whose ``eval/`` metrics the MLflow run held when this recorder started."""
    _evaluation_error: str = ""
    """The last error reading the records (logged once until it changes)."""

    def adopt_logged_versions(self) -> None:
        """Count the versions this MLflow run already holds as logged (a resumed run): the
        follower goes on after the newest of them."""
        self.logged_versions.update(self.lineage.logged_versions())
        self.follower.after = max(self.follower.after, max(self.logged_versions, default=-1))
        if self.follow_evaluations:
            self._evaluations_in_mlflow = self.lineage.metric_steps(f"{EVAL_PREFIX}pass_at_1")

    @property
    def follower(self) -> VersionFollower:
        if self._follower is None:
            self._follower = VersionFollower(self.root, max(self.logged_versions, default=-1))
        return self._follower

    def poll(self) -> None:
        """Log new metric lines, then every newly published version, then new evaluations."""
        self._log_new_metrics()
        for version in self.follower.new_versions():
            if version not in self.logged_versions:
                self._log_version(version)
        if self.follow_evaluations:
            try:
                self._log_new_evaluations()
            except (OSError, ValueError) as exc:  # training goes on; the next poll reads again
                if repr(exc) != self._evaluation_error:
                    LOG.warning("evaluation records not read (retried at the next poll): %r", exc)
                self._evaluation_error = repr(exc)

    def _log_new_evaluations(self) -> None:
        """The records written since the last look, once the evaluator's state says there are
        any; a version the MLflow run already holds (a resumed run) is not logged again."""
        state = EvaluationStore(self.root).state()
        if state is None or state.done <= self._evaluated_after:
            return
        for version, result in read_evaluations(self.root, after=self._evaluated_after).items():
            self.evaluations[version] = result
            if version not in self._evaluations_in_mlflow:
                self.lineage.log_metrics(version, result.metrics(EVAL_PREFIX))
            self._evaluated_after = max(self._evaluated_after, version)
        self._evaluation_error = ""

    def _log_new_metrics(self) -> None:
        """Log the whole lines appended since the last poll (a torn last line waits; a line
        that is not JSON, left by a killed trainer, is skipped with a warning)."""
        if not self.metrics_file.exists():
            return
        with open(self.metrics_file, "rb") as handle:
            handle.seek(self._metrics_offset)
            chunk = handle.read()
        end = chunk.rfind(b"\n")
        if end < 0:
            return
        for line in chunk[:end].splitlines():
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError:
                LOG.warning("%s: skipping a line that is not JSON: %r", self.metrics_file, line[:120])
                continue
            step = int(record.get("step", 0) or 0)
            values = {k: float(v) for k, v in record.items() if k != "step" and isinstance(v, (int, float))}
            self.metrics_by_step[step] = values
            self.lineage.log_metrics(step, values)
        self._metrics_offset += end + 1

    def _log_carried_metrics(self, step: int, carried: Any) -> None:  # noqa: ANN401 - lineage JSON
        """Log the step metrics a version's lineage carries: the trainer runs on another
        machine (a remote placement), so this one has no metrics file to read."""
        if not isinstance(carried, dict):
            return
        values = {str(k): float(v) for k, v in carried.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        self.metrics_by_step[step] = values
        self.lineage.log_metrics(step, values)

    def _log_version(self, version: int) -> None:
        info = read_lineage(self.root, version) or {}
        manifest = version_manifest(self.root, version, self.datasets, info, self.shards_root)
        step = manifest["step"]
        if isinstance(step, int) and step not in self.metrics_by_step and not self.metrics_file.exists():
            self._log_carried_metrics(step, info.get("metrics"))
        metrics = self.metrics_by_step.get(step, {}) if isinstance(step, int) else {}
        weights_uri = self.root.display(paths.weights_version_dir(version))
        parent = manifest["parent_version"]
        parent_model_id = self.logged_versions.get(parent) if isinstance(parent, int) else None
        model_id = self.lineage.log_version(version, weights_uri, manifest, metrics, parent_model_id=parent_model_id)
        self.logged_versions[version] = model_id
        LOG.info("MLflow: weight version %d -> LoggedModel %s (%d shards)", version, model_id, len(manifest["shards"]))


def read_evaluations(root: RunRoot, after: int = -1) -> dict[int, EvalResult]:
    """The results the evaluator recorded in the run root for versions above ``after``."""
    return {v: EvalResult.from_json(record) for v, record in EvaluationStore(root).records_after(after).items()}


class BackgroundPoller:
    """Calls ``poll`` every ``interval_s`` on a thread of its own, so that an exception raised
    in the main thread (Prefect's ``TerminationSignal`` when a run is cancelled) never stops it
    in the middle of an MLflow write: an SQLite write cut short that way kept the store locked,
    and the cancelled run could no longer be marked KILLED.

    ``check()`` re-raises, in the caller, the error that ended the thread; ``finish()`` stops
    it, polls once more (on the thread) and waits for that; ``stop()`` stops it without a last
    poll and does not wait for a write in flight."""

    def __init__(self, poll: Callable[[], None], interval_s: float) -> None:
        self._poll = poll
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._last = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="asyncrl-lineage-recorder", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._poll()
                self._stop.wait(self._interval_s)
            if self._last.is_set():
                self._poll()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller by check()
            self._error = exc

    def check(self) -> None:
        if self._error is not None:
            raise self._error

    def finish(self) -> None:
        self._last.set()
        self._stop.set()
        self._thread.join()
        self.check()

    def stop(self) -> None:
        self._stop.set()
