"""The scheduler (rollout controller) as an OS process of its own, scoring through the run's
reward service (:mod:`asyncrl.tasks.reward.server`, found through its registration):
``python -m asyncrl.tasks.scheduler.main --config PROCESS_CONFIG [--server URL ...]``
(:class:`~asyncrl.configs.processes.SchedulerProcessConfig`).

Cycle after cycle it finds the servers (``--server`` or the run's registry), brings each to
the newest published weight version (a label is set only after its weights are loaded, so
token versions stay exact) and runs the controller (:func:`run_scheduler`) from
``scheduler/state.json``. A cycle ends on SIGTERM/SIGINT (exit 0), once the last step's
weights are out (drain unless ``--no-drain``, exit 0), when the registry changes (next cycle
on the new servers), or when no server is live (wait, next cycle). Exit status: 0 stopped or
finished, 2 bad config or arguments, 1 any other error. See ``docs/internals/scheduler.md``.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from asyncrl.configs.loading import ConfigError, frozen_yaml, load_process_config
from asyncrl.configs.processes import SchedulerProcessConfig
from asyncrl.tasks.system.run_paths import RunPaths, run_paths
from asyncrl.tasks.system.stop_signal import StopSignal
from asyncrl.tasks.system.durable_count import DurableCount
from asyncrl.tasks.scheduler.written_index import written_group_indices
from asyncrl.tasks.scheduler.cycle_stats import CYCLE_STATS_FILE, append_cycle_stats
from asyncrl.tasks.scheduler.gate_state import load_gate_state
from asyncrl.tasks.scheduler.process import MODULE
from asyncrl.tasks.model.codec import HFCodec, load_codec
from asyncrl.tasks.scheduler.setup import DELIVERED_PREFIX, run_scheduler
from asyncrl.storage.fs import RunRoot
from asyncrl.storage.weights import WeightStore, final_step_published
from asyncrl.tasks.data.train_files import load_train_prompts
from asyncrl.tasks.data.records import PromptRecord
from asyncrl.tasks.inference.server_registry import list_servers
from asyncrl.tasks.inference.routing import NoLiveServerError
from asyncrl.tasks.inference.server import RolloutServerHandle
from asyncrl.tasks.inference.weight_loader import ServerWeightLoader
from asyncrl.tasks.inference.weight_sync import server_weight_version

EXIT_OK, EXIT_ERROR, EXIT_CONFIG = 0, 1, 2
logger = logging.getLogger("asyncrl.scheduler")

# Cycle outcomes (see the module docstring).
TERMINATED, FINISHED, SERVERS_CHANGED, NO_LIVE_SERVER, DRAINED = (
    "terminated", "finished", "servers changed", "no live server", "drained",
)  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="the scheduler's process config (RunPaths.process_config)")
    parser.add_argument(
        "--server", action="append", default=[], metavar="URL",
        help="a rollout server's base URL (repeatable); default: the servers registered in the run root",
    )  # fmt: skip
    parser.add_argument(
        "--no-drain", action="store_true",
        help="once the last step's weights are out, exit at once (groups in flight are left unwritten) "
        "instead of writing every admitted group first",
    )  # fmt: skip
    parser.add_argument("--poll-seconds", type=float, default=1.0, help="how often to look at storage and the registry")
    parser.add_argument(
        "--retry-seconds", type=float, default=30.0,
        help="with no live server and no new registration, try the known servers again after this long",
    )  # fmt: skip
    return parser


@dataclass(frozen=True)
class ServerSource:
    """Where the rollout servers are: fixed URLs, or the run's registry."""

    root: RunRoot
    api_key: str | None
    urls: tuple[str, ...] = ()

    def snapshot(self) -> tuple[tuple[str, str, int], ...]:
        """What identifies the current set: (name, url, pid) of each server. A restarted
        server registers again with another pid."""
        if self.urls:
            return tuple((url, url, 0) for url in self.urls)
        return tuple((r.name, r.url, r.pid) for r in list_servers(self.root))

    def handles(self) -> list[RolloutServerHandle]:
        """The servers as handles. Registry entries carry no log path (the server runs
        elsewhere): ``log_path`` is ``os.devnull``; only url, model and key are used here."""
        if self.urls:
            return [RolloutServerHandle(url.rstrip("/"), 0, 0, Path(os.devnull), "", self.api_key) for url in self.urls]
        return [
            RolloutServerHandle(r.url, r.pid, r.pid, Path(os.devnull), r.model, self.api_key)
            for r in list_servers(self.root)
        ]


def align_server_versions(config: SchedulerProcessConfig, paths: RunPaths, handles: Sequence[RolloutServerHandle]) -> int:
    """Bring every server to the newest published version W (0 before any) and resume it;
    return W. A server that fails is logged and left to the client's start-up probe, which
    takes it out of rotation."""
    latest = WeightStore(paths.root).latest()
    target = 0 if latest is None else latest
    cache = str(paths.work_dir / "weights-cache")
    adapters = config.trainer.lora is not None  # a LoRA run's versions are adapters
    with ServerWeightLoader(config.storage.root, config.storage.options, cache, adapters=adapters) as loader:
        for handle in handles:
            try:
                label = server_weight_version(handle)
                if latest is not None and (label is None or label < latest):
                    logger.info("rollout server %s: loading weight version %d (was %s)", handle.url, latest, label)
                    loader.load(handle, latest)
                response = httpx.post(f"{handle.url}/resume", headers=handle.headers(), timeout=30.0)
                response.raise_for_status()
            except Exception as exc:  # noqa: BLE001 - the reason is logged; the probe takes the server out
                logger.warning("rollout server %s could not be brought to version %d: %r", handle.url, target, exc)
    return target


def watch_cycle(
    stop: threading.Event,
    terminate: threading.Event,
    finished: Callable[[], bool] | None,
    changed: Callable[[], bool],
    poll_s: float,
) -> list[str]:
    """Start a thread that sets ``stop`` with the first reason that holds (terminate,
    finished, servers changed); returns the list the reason is appended to."""
    reasons: list[str] = []

    def watch() -> None:
        while not stop.is_set():
            for reason, holds in ((TERMINATED, terminate.is_set), (FINISHED, finished), (SERVERS_CHANGED, changed)):
                if holds is not None and holds():
                    reasons.append(reason)
                    stop.set()
                    return
            terminate.wait(poll_s)

    threading.Thread(target=watch, name="scheduler-watch", daemon=True).start()
    return reasons


def wait_for_servers(
    source: ServerSource, terminate: threading.Event, poll_s: float, unlike: object = None, retry_s: float = 30.0
) -> bool:
    """Wait until at least one server is known and, with ``unlike`` (the snapshot of a cycle
    that found no live server), until the set differs from it or ``retry_s`` have passed (a
    server that failed once may answer again; fixed URLs: ``retry_s`` only). False if
    terminated first."""
    deadline = time.monotonic() + retry_s
    logger.info("waiting for rollout servers (%s)", ", ".join(source.urls) or "registered in the run root")
    while not terminate.is_set():
        snapshot = source.snapshot()
        if snapshot and (snapshot != unlike or time.monotonic() >= deadline):
            return True
        terminate.wait(poll_s)
    return False


def run_cycle(
    config: SchedulerProcessConfig,
    paths: RunPaths,
    source: ServerSource,
    prompts: list[PromptRecord],
    codec: tuple[HFCodec, tuple[int, ...]],
    terminate: threading.Event,
    max_groups: int | None,
    poll_s: float,
    delivered: DurableCount | None = None,
) -> tuple[str, tuple[object, ...]]:
    """One cycle on the servers known now; returns (outcome, the servers' snapshot).
    ``delivered``: the process's count of output tokens received, across its cycles."""
    snapshot = source.snapshot()
    handles = source.handles()
    version = align_server_versions(config, paths, handles)
    stop = threading.Event()
    finished = None if max_groups is not None else (lambda: final_step_published(paths.root, config.trainer.max_steps))
    changed = (lambda: False) if source.urls else (lambda: source.snapshot() != snapshot)
    reasons = watch_cycle(stop, terminate, finished, changed, poll_s)
    admitted = _admitted(paths.root)
    unwritten = admitted - written_group_indices(paths.root, config.name).count_below(admitted)  # index: no shard read
    logger.info("controller starting on %s at weight version %d: %d groups admitted so far, %d of them in no shard "
                "(generated again)%s", [h.url for h in handles], version, admitted, unwritten,
                "" if max_groups is None else "; draining")  # fmt: skip
    try:
        stats = run_scheduler(
            config, paths, handles, prompts, stop, initial_version=version, max_groups=max_groups, codec=codec,
            delivered=delivered,
        )
    except NoLiveServerError as exc:
        logger.warning("%s; waiting for a server to register again", exc)
        return (reasons[0] if reasons else NO_LIVE_SERVER), snapshot
    finally:
        stop.set()
    outcome = reasons[0] if reasons else DRAINED
    summary = {**stats.summary(), "rollout_servers": float(len(handles))}
    logger.info("controller stopped (%s): %s", outcome, summary)
    append_cycle_stats(paths.work_dir / CYCLE_STATS_FILE, summary)
    return outcome, snapshot


def serve(
    config: SchedulerProcessConfig, urls: Sequence[str], poll_s: float, retry_s: float, drain: bool = True
) -> int:
    """Cycles until terminated or finished (see the module docstring)."""
    paths = run_paths(config)
    api_key = config.inference.api_key_value()
    source = ServerSource(paths.root, api_key, tuple(urls))
    terminate = StopSignal()
    terminate.install()
    prompts = load_train_prompts(config.data, paths.root, plugins=config.reward.plugins)  # a folder: the run's chosen files
    codec = load_codec(config.model.path)  # while the servers start: slow on busy CPUs, so not on the first batch
    max_groups: int | None = None
    unlike: object = None
    delivered = DurableCount.new(paths.token_counts, DELIVERED_PREFIX)  # survives a kill: the audit's waste count
    try:
        while wait_for_servers(source, terminate.event, poll_s, unlike, retry_s):
            if final_step_published(paths.root, config.trainer.max_steps):
                if not drain:
                    return EXIT_OK
                if max_groups is None:
                    max_groups = _admitted(paths.root)
            outcome, snapshot = run_cycle(
                config, paths, source, prompts, codec, terminate.event, max_groups, poll_s, delivered
            )
            if outcome in (TERMINATED, DRAINED):
                return EXIT_OK
            if outcome == FINISHED:
                if not drain:
                    return EXIT_OK
                max_groups = _admitted(paths.root)
            unlike = snapshot if outcome == NO_LIVE_SERVER else None
        return EXIT_OK
    finally:
        delivered.close()


def _admitted(root: RunRoot) -> int:
    state = load_gate_state(root)
    return 0 if state is None else state.admitted


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s", stream=sys.stderr)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per generation request drowns the log
    if args.poll_seconds <= 0 or args.retry_seconds <= 0:
        print(f"scheduler: --poll-seconds and --retry-seconds must be > 0, got {args.poll_seconds}, "
              f"{args.retry_seconds}", file=sys.stderr)  # fmt: skip
        return EXIT_CONFIG
    try:
        config = load_process_config(args.config, SchedulerProcessConfig)
    except ConfigError as exc:
        print(f"scheduler: config error: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    logger.info("config (secrets redacted):\n%s", frozen_yaml(config))
    return serve(config, args.server, args.poll_seconds, args.retry_seconds, drain=not args.no_drain)


if __name__ == "__main__":
    sys.exit(main())
