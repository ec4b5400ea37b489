"""The run's view of its fleet and the drain: every change of the registered rollout servers is
reported once (metric at the newest version, a line, the callback); a drain unregisters the
server, waits until its queue is empty, then asks its hosting flow run to stop; a server's
queue is read from its Prometheus metrics."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from asyncrl.storage.fs import open_root
from asyncrl.storage.heartbeats import stop_requested
from asyncrl.storage.weights import WeightStore
from asyncrl.tasks.inference.routing import ServerEndpoint
from asyncrl.tasks.inference.server import RolloutServerHandle
from asyncrl.tasks.inference.server_registry import list_servers, register_server, unregister_server
from asyncrl.tasks.launch.fleet import FleetChange, FleetWatch, drain_server, queued_requests


def handle(url: str) -> RolloutServerHandle:
    return RolloutServerHandle(url, 1, 1, Path("/dev/null"), "m", None)


def test_each_change_of_the_registry_is_reported_once(tmp_path: Path, tiny_model_dir: Path) -> None:
    root = open_root(str(tmp_path / "store"))
    logged: list[tuple[int, float]] = []
    seen: list[FleetChange] = []
    watch = FleetWatch(root, lambda step, size: logged.append((step, size)), seen.append, every_s=0.0)
    assert watch.check() is None  # nothing registered yet: no change from nothing to nothing
    register_server(root, "server-0", handle("http://127.0.0.1:1"))
    assert watch.check() is not None and watch.check() is None  # once
    WeightStore(root).publish(3, tiny_model_dir)
    register_server(root, "server-1", handle("http://127.0.0.1:2"))
    joined = watch.check()
    unregister_server(root, "server-1")
    left = watch.check()
    assert joined is not None and joined.joined == ("server-1",) and joined.servers == ("server-0", "server-1")
    assert left is not None and left.left == ("server-1",) and "server-1 left at weight version 3" in left.message()
    assert logged == [(0, 1.0), (3, 2.0), (3, 1.0)] and seen == watch.changes and len(seen) == 3


class Metrics(http.server.BaseHTTPRequestHandler):
    """A vLLM /metrics: ``queue`` running requests, then none once ``drained`` is set."""

    queue: list[int] = [2, 1, 0, 0, 0, 0, 0]

    def do_GET(self) -> None:  # noqa: N802 - the handler's API
        if self.path != "/metrics":
            self.send_error(404)
            return
        running = Metrics.queue.pop(0) if len(Metrics.queue) > 1 else Metrics.queue[0]
        lines = ["# HELP vllm:num_requests_running x", f'vllm:num_requests_running{{engine="0"}} {running}.0',
                 'vllm:num_requests_waiting{engine="0"} 0.0', "vllm:num_requests_waiting_total 5.0"]  # fmt: skip
        body = ("\n".join(lines) + "\n").encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def metrics_url() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Metrics)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()


def test_the_queue_is_read_from_the_metrics_and_a_silent_server_gives_none(metrics_url: str) -> None:
    Metrics.queue = [3, 0]
    assert queued_requests(ServerEndpoint(metrics_url)) == 3
    assert queued_requests(ServerEndpoint(metrics_url)) == 0
    assert queued_requests(ServerEndpoint("http://127.0.0.1:9"), timeout_s=0.5) is None


def test_a_drain_unregisters_waits_for_an_empty_queue_then_asks_the_flow_run_to_stop(
    tmp_path: Path, metrics_url: str
) -> None:  # fmt: skip
    root = open_root(str(tmp_path / "store"))
    register_server(root, "server-0", handle("http://127.0.0.1:1"))
    register_server(root, "server-1", handle(metrics_url))
    Metrics.queue = [2, 1, 0, 0]
    report = drain_server(root, 1, None, settle_s=0.0, poll_s=0.01)
    assert report.idle and report.url == metrics_url and not Metrics.queue[1:]  # looked until two empty looks
    assert [r.name for r in list_servers(root)] == ["server-0"]
    assert stop_requested(root, "rollout-server-1", 0, "")
    with pytest.raises(FileNotFoundError, match="server-1"):
        drain_server(root, 1, None, settle_s=0.0)


def test_an_added_server_without_its_device_entry_is_refused_naming_the_field() -> None:
    from asyncrl.configs.inference import InferenceConfig
    from asyncrl.tasks.placement.devices import Machine, rollout_placement

    inference = InferenceConfig(num_servers=1, devices=[[0]])
    machine = Machine(cpus=frozenset({0, 1}))
    assert rollout_placement(inference, 0, machine) is not None
    with pytest.raises(ValueError, match=r"inference.devices: 1 entries, none for rollout server 1"):
        rollout_placement(inference, 1, machine)


def test_an_added_server_stops_with_its_run_and_the_runs_own_do_not(tmp_path: Path) -> None:
    from run_root_builder import RunRootBuilder

    from asyncrl.configs.run_config import RunConfig
    from asyncrl.tasks.launch.fleet import added_server_done

    build = RunRootBuilder(open_root(str(tmp_path / "store")), tmp_path)
    config = RunConfig.model_validate({
        "name": "r", "model": {"path": "m"}, "data": {"train_path": "t.jsonl"},
        "storage": {"root": str(tmp_path / "store")}, "inference": {"num_servers": 2}, "trainer": {"max_steps": 2},
    })  # fmt: skip
    build.publish(0, 0, None, [])
    build.publish(1, 1, 0, [])
    assert not added_server_done(config, build.root, "rollout-server", 2)  # the run goes on
    build.publish(2, 2, 1, [])
    assert added_server_done(config, build.root, "rollout-server", 2)  # the last step is out: an added one stops
    assert not added_server_done(config, build.root, "rollout-server", 1)  # the run's own: stopped by the run
    assert not added_server_done(config, build.root, "trainer", 2)
