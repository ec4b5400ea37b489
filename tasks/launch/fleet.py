"""An elastic fleet: rollout servers joining and leaving a running run, and the run's view of it.

A run's rollout servers meet its scheduler only through the server registry in the run root
(:mod:`~asyncrl.tasks.inference.server_registry`). The scheduler ends its controller cycle
whenever the registered set changes and starts the next one on the new set, at the newest
weight version (:mod:`~asyncrl.tasks.scheduler.main`); the groups in flight are journaled at
the cycle's end and go on from their journaled tokens, on whichever servers are left
(:mod:`~asyncrl.tasks.inference.sample_journal`). So:

- **joining** is starting one more rollout server of the run (the ``component`` flow, kind
  ``rollout-server``, at an index past ``inference.num_servers``; on this machine or as a run of
  the ``component/rollout-server`` deployment): it registers once healthy, and the scheduler's
  next cycle loads the newest version into it and generates on it;
- **draining** (:func:`drain_server`) unregisters the server, waits until it has no request
  left (the scheduler's cycle ended and its samples were journaled, then resumed on the
  others at their last token), and only then asks the flow run hosting it to stop. An added
  server that is never drained stops when the run's last step is out (:func:`added_server_done`).

:class:`FleetWatch` is the run's view: it reads the registry while the run trains and, on each
change, logs the MLflow metric ``fleet/rollout_servers`` (at step = the newest published
weight version) and a line naming who joined or left, and calls ``on_change`` (the ``train``
flow emits the Prefect event ``asyncrl.fleet.changed``). One listing of a small directory a
check: the work does not grow with the run.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx

from asyncrl.configs.run_config import RunConfig
from asyncrl.storage.fs import RunRoot
from asyncrl.storage.heartbeats import request_stop
from asyncrl.storage.weights import WeightStore, final_step_published
from asyncrl.tasks.inference.routing import ServerEndpoint, bearer_headers
from asyncrl.tasks.inference.server_registry import list_servers, read_server, server_name, unregister_server
from asyncrl.tasks.launch.kinds import component_name

LOG = logging.getLogger("asyncrl.run.fleet")
METRIC = "fleet/rollout_servers"
QUEUE_METRICS = ("vllm:num_requests_running", "vllm:num_requests_waiting")


@dataclass(frozen=True)
class FleetChange:
    """The registered rollout servers changed."""

    version: int
    """The newest published weight version when the change was seen."""
    servers: tuple[str, ...]
    """Registry names now, sorted."""
    joined: tuple[str, ...]
    left: tuple[str, ...]

    def message(self) -> str:
        pairs = ((self.joined, "joined"), (self.left, "left"))
        moves = [f"{', '.join(names)} {verb}" for names, verb in pairs if names]
        return (
            f"fleet: {len(self.servers)} rollout server(s) ({', '.join(self.servers) or 'none'})"
            f"{': ' + '; '.join(moves) if moves else ''} at weight version {self.version}"
        )


class FleetWatch:
    """Reports every change of the registered rollout servers (module docstring);
    :meth:`check` reads at most every ``every_s`` seconds."""

    def __init__(
        self,
        root: RunRoot,
        log_metric: Callable[[int, float], None],
        on_change: Callable[[FleetChange], None] | None = None,
        logger: logging.Logger | logging.LoggerAdapter[logging.Logger] = LOG,
        every_s: float = 2.0,
    ) -> None:
        self.root = root
        self.log_metric = log_metric
        self.on_change = on_change
        self.logger = logger
        self.every_s = every_s
        self.servers: tuple[str, ...] | None = None
        """The set last seen (None before the first read)."""
        self.changes: list[FleetChange] = []
        self._next_read = 0.0

    def check(self, force: bool = False) -> FleetChange | None:
        """Read the registry (when due, or ``force``); the change seen, if any. The first read
        that finds a server is a change (from nothing), so the metric starts at the run's size."""
        now = time.monotonic()
        if not force and now < self._next_read:
            return None
        self._next_read = now + self.every_s
        try:
            servers = tuple(sorted(record.name for record in list_servers(self.root)))
        except (OSError, ValueError) as exc:  # a report, not the run: say so and go on
            self.logger.warning("could not read the rollout server registry: %s", exc)
            return None
        before = self.servers or ()
        if servers == before:
            return None
        self.servers = servers
        change = FleetChange(
            version=WeightStore(self.root).latest() or 0,
            servers=servers,
            joined=tuple(s for s in servers if s not in before),
            left=tuple(s for s in before if s not in servers),
        )
        self.changes.append(change)
        self.log_metric(change.version, float(len(servers)))
        self.logger.info("%s", change.message())
        if self.on_change is not None:
            self.on_change(change)
        return change


def added_server_done(config: RunConfig, root: RunRoot, kind: str, index: int) -> bool:
    """Whether a component is a rollout server added to the run (index past
    ``inference.num_servers``) whose run has published its last step: it then stops on its own,
    as the run's own servers do when the run ends, rather than waiting for a drain."""
    added = kind == "rollout-server" and index >= config.inference.num_servers
    return added and final_step_published(root, config.trainer.max_steps)


def queued_requests(server: ServerEndpoint, timeout_s: float = 5.0) -> int | None:
    """Requests a vLLM server is running or holding in its queue, from its Prometheus
    ``/metrics`` (``vllm:num_requests_running`` + ``vllm:num_requests_waiting``, summed over
    engines); None if it does not answer."""
    try:
        response = httpx.get(f"{server.url.rstrip('/')}/metrics", headers=bearer_headers(server), timeout=timeout_s)
        response.raise_for_status()
    except httpx.HTTPError:
        return None
    total = 0.0
    for line in response.text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in QUEUE_METRICS:
            total += float(line.rsplit(" ", 1)[1])
    return int(total)


@dataclass(frozen=True)
class DrainReport:
    server: str
    url: str
    idle: bool
    """Whether the server was seen with no request before its stop was asked (else the wait timed out)."""
    waited_s: float


def drain_server(
    root: RunRoot,
    index: int,
    api_key: str | None,
    *,
    settle_s: float = 3.0,
    timeout_s: float = 120.0,
    poll_s: float = 1.0,
) -> DrainReport:
    """Take rollout server ``index`` out of its run (module docstring): unregister it, wait at
    least ``settle_s`` (the scheduler's look at the registry) and then until two looks in a row
    find it without a request, or ``timeout_s``; then ask its hosting flow run to stop
    (it ends Completed). ``FileNotFoundError`` names the server if it is not registered.

    Stopped before it is idle (the timeout), the server's requests are cut: the scheduler keeps
    their tokens up to the cut and resubmits them elsewhere, so nothing is lost either way.
    """
    name = server_name(index)
    record = read_server(root, name)
    unregister_server(root, name)
    endpoint = ServerEndpoint(record.url, api_key)
    started = time.monotonic()
    time.sleep(settle_s)
    idle_looks = 0
    while time.monotonic() - started < timeout_s:
        queued = queued_requests(endpoint)
        idle_looks = idle_looks + 1 if queued in (0, None) else 0  # None: gone already
        if idle_looks >= 2:
            break
        time.sleep(poll_s)
    request_stop(root, component_name("rollout-server", index), 0, "")
    return DrainReport(name, record.url, idle_looks >= 2, time.monotonic() - started)
