"""Prefect task that runs one rollout server for the life of a flow.

:func:`supervise_rollout_server` is plain Python (tests call it directly): start the
server, wait until healthy, register its address in the run root, then watch it until
``stop`` is set or the server dies, and always kill its process group and remove its
entry on the way out. Prefect tasks have no ``on_cancellation`` hook, hence the
``finally``; if the supervising process is killed outright, the server's
parent-death signal (``RolloutServerConfig.die_with_parent``) stops it.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from asyncrl.storage.fs import open_root
from asyncrl.tasks.rollout.weight_sync import DEFAULT_CACHE_DIR, fetch_weight_version
from asyncrl.tasks.rollout.registry import register_server, unregister_server
from asyncrl.tasks.rollout.server import (
    RolloutServer,
    RolloutServerConfig,
    RolloutServerHandle,
)
from prefect import task
from prefect.cache_policies import NO_CACHE

logger = logging.getLogger(__name__)


def supervise_rollout_server(
    config: RolloutServerConfig,
    run_root: str,
    storage_options: dict[str, Any] | None,
    name: str,
    poll_interval_s: float = 5.0,
    stop: threading.Event | None = None,
    on_ready: Callable[[RolloutServerHandle], None] | None = None,
) -> int | None:
    """Run the server until ``stop`` is set; return its exit status.

    ``on_ready`` is called with the handle once the server is healthy and registered.
    Raises :class:`~asyncrl.tasks.rollout.server.RolloutServerError` (with the log tail)
    if the server fails to start or dies while watched, and
    :class:`~asyncrl.tasks.rollout.server.RolloutServerCancelled` if ``stop`` is set
    before it is healthy (a start-up can take minutes; a cancelled run does not wait for it).
    """
    root = open_root(run_root, storage_options)
    stop = stop or threading.Event()
    server = RolloutServer(config)
    registered = False
    try:
        handle = server.start()
        seconds = server.wait_healthy(stop=stop)
        logger.info("rollout server %r healthy at %s after %.1f s", name, handle.url, seconds)
        register_server(root, name, handle)
        registered = True
        if on_ready is not None:
            on_ready(handle)
        while not stop.wait(poll_interval_s):
            server.check_alive()
    finally:
        try:
            if registered:  # first, so that no controller picks a dying server
                unregister_server(root, name)
        finally:
            code = server.stop()
    return code


def config_for_version(
    config: RolloutServerConfig,
    run_root: str,
    storage_options: dict[str, Any] | None,
    version: int,
    cache_dir: Path,
) -> RolloutServerConfig:
    """`config` serving published weight `version` of the run root (fetched into `cache_dir`,
    reused if already there); an unpublished version names the available ones."""
    model_dir, _ = fetch_weight_version(run_root, dict(storage_options or {}), version, cache_dir)
    return dataclasses.replace(config, model_dir=model_dir)


@task(name="rollout-server", cache_policy=NO_CACHE)  # a long-lived side effect: never cached
def rollout_server_task(
    config: RolloutServerConfig,
    run_root: str,
    storage_options: dict[str, Any] | None,
    name: str,
    poll_interval_s: float = 5.0,
    weights_version: int | None = None,
    cache_dir: Path = Path(DEFAULT_CACHE_DIR),
) -> int | None:
    """Prefect task: :func:`supervise_rollout_server` until the flow cancels it or the server
    dies; with `weights_version`, the server starts from that published version of the run."""
    if weights_version is not None:
        config = config_for_version(config, run_root, storage_options, weights_version, cache_dir)
    return supervise_rollout_server(config, run_root, storage_options, name, poll_interval_s)
