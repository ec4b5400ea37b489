"""``asyncrl bench storage``: does the storage work of one training step grow with the run?

A synthetic run (no model, no vLLM) drives the real storage code of every per-step path in
process: the scheduler's shard writes and written-groups index, the trainer's feed, ledger,
shard retirement, weight publish and retention pass, and the lineage recorder's follower.
Every call of the :mod:`asyncrl.storage.fs` primitives is counted (outermost calls only), and
at sample steps the bench reports ops/step and s/step over a window and the ratio last/first.
Exit status 1 when the ops ratio exceeds ``--max-ops-ratio``: the bench guards the rule that
per-step storage work stays O(1) in the run's length. Details: ``docs/internals/bench.md``.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from asyncrl.storage import fs
from asyncrl.storage.fs import RunRoot, open_root
from asyncrl.storage.ledger import Ledger
from asyncrl.storage.schema import Sample
from asyncrl.storage.shards import ShardReader, ShardWriter
from asyncrl.storage.weight_lineage import LINEAGE_FILE
from asyncrl.storage.weights import WeightStore
from asyncrl.tasks.tracking.lineage_recorder import VersionFollower, version_manifest
from asyncrl.tasks.scheduler.written_index import WrittenGroups, save_written_groups, written_group_indices
from asyncrl.tasks.scheduler.group_schedule import group_id
from asyncrl.tasks.trainer.feed import ShardFeed
from asyncrl.tasks.trainer.retention import RetentionPolicy, prune_after_publish

COUNTED = (
    "read_bytes", "read_many", "exists", "list_dir", "put_if_absent", "put_atomic_replace",
    "delete", "delete_tree", "move_no_overwrite", "upload_file", "download_file",
)  # fmt: skip
COMPONENTS = ("scheduler", "trainer", "publish", "lineage")
RUN_ID = "storage-bench"
VOCAB = 1000
BENCH_ETA = 2
"""The synthetic run's staleness bound: retention keeps about BENCH_ETA + 2 versions."""


@dataclass
class OpCounter:
    """Storage calls and listed names, by component (set with :meth:`within`)."""

    ops: Counter[str] = field(default_factory=Counter)
    listed: Counter[str] = field(default_factory=Counter)
    by_call: Counter[str] = field(default_factory=Counter)
    seconds: Counter[str] = field(default_factory=Counter)
    current: str = "other"
    depth: int = 0

    @contextmanager
    def within(self, component: str) -> Iterator[None]:
        before, self.current = self.current, component
        started = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[component] += time.perf_counter() - started
            self.current = before


def _counted(counter: OpCounter, name: str, function: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        outermost = counter.depth == 0
        if outermost:  # counted before the call: a miss (FileNotFoundError) is an operation too
            if name == "read_many":
                args = (args[0], list(args[1]), *args[2:])
            count = len(args[1]) if name == "read_many" else 1
            counter.ops[counter.current] += count
            counter.by_call[name] += count
        counter.depth += 1
        try:
            result = function(*args, **kwargs)
        finally:
            counter.depth -= 1
        if outermost and name == "list_dir":
            counter.listed[counter.current] += len(result)
        return result

    return wrapper


@contextmanager
def counting_storage_ops() -> Iterator[OpCounter]:
    """Count the calls of the :mod:`asyncrl.storage.fs` primitives made inside the block (the
    module's functions are wrapped for the block's duration and restored after it)."""
    counter = OpCounter()
    originals = {name: getattr(fs, name) for name in COUNTED}
    try:
        for name, function in originals.items():
            setattr(fs, name, _counted(counter, name, function))
        yield counter
    finally:
        for name, function in originals.items():
            setattr(fs, name, function)


@dataclass(frozen=True)
class StorageBenchSettings:
    steps: int = 1000
    sample_at: tuple[int, ...] = (10, 1000)
    window: int = 5
    """Steps averaged at each sample point (ending at it)."""
    shards_per_step: int = 1
    groups_per_shard: int = 2
    samples_per_group: int = 2
    max_ops_ratio: float = 1.2

    def __post_init__(self) -> None:
        if self.steps < 1 or self.window < 1 or self.shards_per_step < 1 or self.groups_per_shard < 1:
            raise ValueError("steps, window, shards_per_step and groups_per_shard must be >= 1")
        if len(self.sample_at) < 2 or list(self.sample_at) != sorted(set(self.sample_at)):
            raise ValueError(f"sample_at must be >= 2 increasing steps, got {self.sample_at}")
        if self.sample_at[0] < self.window or self.sample_at[-1] > self.steps:
            raise ValueError(
                f"sample_at {self.sample_at} must lie in [window={self.window}, steps={self.steps}]"
            )


@dataclass(frozen=True)
class SamplePoint:
    step: int
    ops_per_step: float
    s_per_step: float
    listed_per_step: float
    ops_by_component: dict[str, float]
    listed_by_component: dict[str, float]
    s_by_component: dict[str, float]


@dataclass(frozen=True)
class BackendResult:
    backend: str
    uri: str
    points: tuple[SamplePoint, ...]

    @property
    def ops_ratio(self) -> float:
        return self.points[-1].ops_per_step / max(self.points[0].ops_per_step, 1e-9)

    @property
    def time_ratio(self) -> float:
        return self.points[-1].s_per_step / max(self.points[0].s_per_step, 1e-9)

    def to_json(self) -> dict[str, Any]:
        return {
            "backend": self.backend,
            "uri": self.uri,
            "points": [asdict(p) for p in self.points],
            "ops_ratio": self.ops_ratio,
            "time_ratio": self.time_ratio,
        }


def _group(index: int, version: int, size: int) -> list[Sample]:
    gid = group_id(index)
    return [
        Sample(
            prompt_id=f"p{index % 97}", group_id=gid, prompt_token_ids=[1, 2, 3], output_token_ids=[4, 5],
            behaviour_logprobs=[-0.5, -0.25], token_versions=[version, version], reward=float(i % 2),
            finish_reason="stop", submit_time=1.0, finish_time=2.0,
        )  # fmt: skip
        for i in range(size)
    ]


def _weights_dir(base: Path) -> Path:
    base.mkdir(parents=True, exist_ok=True)
    (base / "config.json").write_text("{}")
    (base / "model.safetensors").write_bytes(b"\0" * 64)
    return base


class SyntheticRun:
    """The per-step storage work of a run, on one root (see the module docstring)."""

    def __init__(self, root: RunRoot, settings: StorageBenchSettings, counter: OpCounter, work_dir: Path) -> None:
        self.root = root
        self.settings = settings
        self.counter = counter
        self.writer = ShardWriter(root, RUN_ID)
        self.reader = ShardReader(root, RUN_ID)
        self.feed = ShardFeed(self.reader, VOCAB, 64)
        self.ledger = Ledger(root)
        self.store = WeightStore(root)
        self.follower = VersionFollower(root)
        self.written = WrittenGroups()
        self.weights = _weights_dir(work_dir / "weights")
        self.next_group = 0
        self.version = 0

    def start(self) -> None:
        (self.weights / LINEAGE_FILE).write_text(json.dumps({"version": 0, "parent_version": None, "step": 0}))
        self.store.publish(0, self.weights)

    def step(self, step: int) -> None:
        settings = self.settings
        with self.counter.within("scheduler"):
            for _ in range(settings.shards_per_step):
                indices = range(self.next_group, self.next_group + settings.groups_per_shard)
                self.next_group += settings.groups_per_shard
                groups = [_group(k, self.version, settings.samples_per_group) for k in indices]
                shard = self.writer.write_groups(groups)
                self.written.add(indices)
                self.written.next_seq = max(self.written.next_seq, shard.seq + 1)
                save_written_groups(self.root, self.written)
            seen = written_group_indices(self.root, RUN_ID)  # a scheduler cycle's look
            if seen.count_below(self.next_group) != self.next_group:
                raise AssertionError(f"step {step}: the written-groups index lost groups: {seen}")
        with self.counter.within("trainer"):
            batch = settings.shards_per_step * settings.groups_per_shard
            taken = self.feed.take(batch)
            if taken is None:
                raise AssertionError(f"step {step}: fewer than {batch} groups waiting")
            self.ledger.record(step, taken.shards)
            self.reader.retire(taken.shards)
            self.feed.forget(taken.shards)
        with self.counter.within("publish"):
            lineage = {"version": step, "parent_version": self.version, "step": step, "shards": list(taken.shards)}
            (self.weights / LINEAGE_FILE).write_text(json.dumps(lineage))
            self.store.publish(step, self.weights)
            prune_after_publish(self.store, step, RetentionPolicy(max_staleness=BENCH_ETA))
            self.version = step
        with self.counter.within("lineage"):
            for version in self.follower.new_versions():
                manifest = version_manifest(self.root, version)
                if version > 0 and len(manifest["shards"]) != settings.shards_per_step:
                    raise AssertionError(f"version {version}: manifest lists {manifest['shards']}")


def run_backend(backend: str, root: RunRoot, settings: StorageBenchSettings, work_dir: Path) -> BackendResult:
    """Run the synthetic run on ``root``; return the figures at the sample points."""
    with counting_storage_ops() as counter:
        run = SyntheticRun(root, settings, counter, work_dir)
        run.start()
        wanted = set(settings.sample_at)
        window_start = {k - settings.window + 1: k for k in wanted}
        marks: dict[int, tuple[Counter[str], Counter[str], Counter[str], float]] = {}
        points: list[SamplePoint] = []
        for step in range(1, settings.steps + 1):
            if step in window_start:
                marks[window_start[step]] = (
                    Counter(counter.ops), Counter(counter.listed), Counter(counter.seconds), time.perf_counter()
                )
            run.step(step)
            if step in wanted:
                ops0, listed0, seconds0, t0 = marks.pop(step)
                n = settings.window
                ops = counter.ops - ops0
                listed = counter.listed - listed0
                points.append(
                    SamplePoint(
                        step=step,
                        ops_per_step=sum(ops.values()) / n,
                        s_per_step=(time.perf_counter() - t0) / n,
                        listed_per_step=sum(listed.values()) / n,
                        ops_by_component={c: ops[c] / n for c in COMPONENTS},
                        listed_by_component={c: listed[c] / n for c in COMPONENTS},
                        s_by_component={c: (counter.seconds[c] - seconds0[c]) / n for c in COMPONENTS},
                    )
                )
    return BackendResult(backend, root.uri, tuple(points))


def _s3_root(endpoint: str, bucket: str) -> RunRoot:
    options: dict[str, Any] = {"endpoint_url": endpoint}
    key, secret = os.environ.get("AWS_ACCESS_KEY_ID"), os.environ.get("AWS_SECRET_ACCESS_KEY")
    if not key or not secret:
        raise ValueError("--s3-endpoint needs AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY in the environment")
    options.update(key=key, secret=secret)
    import s3fs

    s3 = s3fs.S3FileSystem(key=key, secret=secret, endpoint_url=endpoint)
    if not s3.exists(bucket):
        s3.mkdir(bucket)
    return open_root(f"s3://{bucket}/bench-{uuid.uuid4().hex[:8]}", options)


def run_storage_bench(
    settings: StorageBenchSettings, work_dir: Path, s3_endpoint: str | None = None, s3_bucket: str = "asyncrl-bench"
) -> list[BackendResult]:
    """The bench on a fresh local root under ``work_dir``, then on S3 when an endpoint is given."""
    results = [run_backend("local", open_root(str(work_dir / "local-root")), settings, work_dir / "local")]
    if s3_endpoint:
        results.append(run_backend("s3", _s3_root(s3_endpoint, s3_bucket), settings, work_dir / "s3"))
    return results


def format_table(results: list[BackendResult]) -> str:
    header = (
        f"{'backend':8} {'step':>6} {'ops/step':>9} {'listed/step':>11} {'s/step':>9}  "
        "by component: ops (names listed) ms"
    )
    lines = [header, "-" * len(header)]
    for result in results:
        for point in result.points:
            parts = " ".join(
                f"{c}={v:g}({point.listed_by_component[c]:g}){1000 * point.s_by_component[c]:.1f}ms"
                for c, v in point.ops_by_component.items()
            )
            lines.append(
                f"{result.backend:8} {point.step:>6} {point.ops_per_step:>9.2f} {point.listed_per_step:>11.2f} "
                f"{point.s_per_step:>9.4f}  {parts}"
            )
        lines.append(
            f"{result.backend:8} {'ratio':>6} {result.ops_ratio:>9.3f} {'':>11} {result.time_ratio:>9.3f}  "
            f"(step {result.points[-1].step} / step {result.points[0].step})"
        )
    return "\n".join(lines)


def cmd_bench_storage(args: argparse.Namespace) -> int:
    try:
        settings = StorageBenchSettings(
            steps=args.steps, sample_at=args.sample_at, window=args.window, shards_per_step=args.shards_per_step,
            groups_per_shard=args.groups_per_shard, max_ops_ratio=args.max_ops_ratio,
        )  # fmt: skip
    except ValueError as exc:
        print(f"bench storage: {exc}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="asyncrl-storage-bench-") as scratch:
        work_dir = Path(args.work_dir) if args.work_dir else Path(scratch)
        results = run_storage_bench(settings, work_dir, args.s3_endpoint, args.s3_bucket)
    print(format_table(results))
    worst = max(result.ops_ratio for result in results)
    report = {
        "settings": asdict(settings),
        "results": [result.to_json() for result in results],
        "max_ops_ratio": worst,
        "ok": worst <= settings.max_ops_ratio,
    }
    print(json.dumps(report, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    if worst > settings.max_ops_ratio:
        print(f"bench storage: ops per step grew by {worst:.3f}x, over --max-ops-ratio {settings.max_ops_ratio}",
              file=sys.stderr)  # fmt: skip
        return 1
    return 0
