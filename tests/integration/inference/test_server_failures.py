"""Servers that must not start, or fail to: clear errors, bounded time, nothing left running."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import pytest
from asyncrl.tasks.inference.server import RolloutServer, server_env
from asyncrl.tasks.inference.vllm_command import server_command
from asyncrl.tasks.inference.server_ports import server_urls
from asyncrl.tasks.inference.server_errors import RolloutServerError
from asyncrl.tasks.inference.server_config import RolloutServerConfig


def assert_group_gone(pgid: int) -> None:
    with pytest.raises(ProcessLookupError):
        os.killpg(pgid, 0)


def test_missing_model_dir_fails_before_spawning(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    server = RolloutServer(RolloutServerConfig(model_dir=missing, log_path=tmp_path / "server.log"))
    started = time.monotonic()
    with pytest.raises(FileNotFoundError, match=str(missing)):
        server.start()
    assert time.monotonic() - started < 1.0
    assert server.returncode() is None and not (tmp_path / "server.log").exists()
    assert server.stop() is None  # never started: nothing to stop


def test_model_dir_without_config_is_refused(tmp_path: Path) -> None:
    (tmp_path / "model").mkdir()
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        RolloutServer(RolloutServerConfig(model_dir=tmp_path / "model")).start()


@pytest.mark.parametrize("content", ["{ this is not json", "[1, 2]", "\xff\xfe"])
def test_unparsable_config_json_is_refused_before_spawning(content: str, tmp_path: Path) -> None:
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(content, encoding="latin-1")
    server = RolloutServer(RolloutServerConfig(model_dir=tmp_path / "model", log_path=tmp_path / "server.log"))
    with pytest.raises(ValueError, match=r"model/config.json (is not valid JSON|must hold a JSON object)"):
        server.start()
    assert not (tmp_path / "server.log").exists()


@pytest.mark.parametrize("host", ["0.0.0.0", "192.168.1.10", "::", "rollout.example.org"])
def test_non_loopback_host_requires_api_key(host: str, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=f"host {host!r} is not a loopback address.*needs api_key"):
        RolloutServerConfig(model_dir=tmp_path, host=host)
    assert RolloutServerConfig(model_dir=tmp_path, host=host, api_key="k").api_key == "k"


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "::1", "localhost"])
def test_loopback_host_may_run_without_key(host: str, tmp_path: Path) -> None:
    assert RolloutServerConfig(model_dir=tmp_path, host=host).api_key is None


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("port", 70000, "port must be in"),
        ("kv_cache_gib", 0.0, "kv_cache_gib must be > 0"),
        ("max_model_len", 0, "max_model_len must be >= 1"),
        ("start_timeout_s", 0.0, "start_timeout_s must be > 0"),
        ("api_key", "", "api_key must be a non-empty string"),
        ("api_key", "two words", "api_key must be a non-empty string"),
    ],
)
def test_config_bounds(field: str, value: object, message: str, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=message):
        RolloutServerConfig(model_dir=tmp_path, **{field: value})  # type: ignore[arg-type]


def test_api_key_travels_in_environment_not_command_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = RolloutServerConfig(model_dir=tmp_path, host="0.0.0.0", api_key="s3cret-key", kv_cache_gib=1.5)
    command = server_command(config, tmp_path, 8000)
    assert not any("s3cret-key" in part for part in command)
    assert command[command.index("--middleware") + 1] == "asyncrl.tasks.inference.auth.BearerAuthMiddleware"
    env = server_env(config)
    assert env["ASYNCRL_ROLLOUT_API_KEY"] == env["VLLM_API_KEY"] == "s3cret-key"
    assert env["VLLM_SERVER_DEV_MODE"] == "1" and env["VLLM_CPU_KVCACHE_SPACE"] == "2"
    assert "s3cret-key" not in repr(config)
    # A keyless server inherits no key from the caller's environment.
    monkeypatch.setenv("ASYNCRL_ROLLOUT_API_KEY", "leaked")
    keyless = server_env(RolloutServerConfig(model_dir=tmp_path))
    assert "ASYNCRL_ROLLOUT_API_KEY" not in keyless and "VLLM_API_KEY" not in keyless
    assert "--middleware" not in server_command(RolloutServerConfig(model_dir=tmp_path), tmp_path, 8000)


@pytest.mark.slow
def test_timeout_kills_server_and_reports_log_tail(tiny_model_dir: Path, tmp_path: Path) -> None:
    """A real start given too little time: killed at the deadline, the log tail is in the error."""
    server = RolloutServer(RolloutServerConfig(model_dir=tiny_model_dir, log_path=tmp_path / "server.log"))
    handle = server.start()
    started = time.monotonic()
    with pytest.raises(RolloutServerError, match="was not healthy within 3 s; it was stopped") as info:
        server.wait_healthy(timeout_s=3.0)
    assert time.monotonic() - started < 3.0 + 30.0  # deadline + SIGTERM grace + reaping
    assert "vllm.entrypoints.openai.api_server" in info.value.log_tail  # the logged command line
    assert server.returncode() is not None
    assert_group_gone(handle.pgid)
    assert server.stop() == server.returncode()  # idempotent


@pytest.mark.slow
def test_broken_model_config_fails_with_log_tail(tiny_model_dir: Path, tmp_path: Path) -> None:
    """A config.json naming a model type vLLM does not know: the server dies during start
    and the error quotes its log."""
    broken = tmp_path / "broken"
    shutil.copytree(tiny_model_dir, broken)
    config = json.loads((broken / "config.json").read_text())
    config.update(model_type="no-such-model-type", architectures=["NoSuchModelForCausalLM"])
    (broken / "config.json").write_text(json.dumps(config))
    server = RolloutServer(RolloutServerConfig(model_dir=broken, log_path=tmp_path / "server.log"))
    handle = server.start()
    started = time.monotonic()
    with pytest.raises(RolloutServerError, match="exited with code") as info:
        server.wait_healthy(timeout_s=600.0)
    print(f"\nbroken config detected after {time.monotonic() - started:.1f} s")
    assert info.value.log_tail and len(info.value.log_tail.splitlines()) <= 40
    assert "no-such-model-type" in info.value.log_tail or "NoSuchModelForCausalLM" in info.value.log_tail
    server.stop()
    assert_group_gone(handle.pgid)
    json.loads((tiny_model_dir / "config.json").read_text())  # the original is untouched


SUPERVISOR_SCRIPT = """
import sys, time
from pathlib import Path
from asyncrl.tasks.inference.server import RolloutServer, RolloutServerConfig
server = RolloutServer(RolloutServerConfig(model_dir=Path(sys.argv[1]), log_path=Path(sys.argv[2])))
print(server.start().pgid, flush=True)
time.sleep(600)
"""


@pytest.mark.slow
def test_server_dies_with_a_killed_supervisor(tiny_model_dir: Path, tmp_path: Path) -> None:
    """SIGKILL the process that started the server: no ``finally`` runs, the parent-death signal stops it."""
    import subprocess
    import sys

    supervisor = subprocess.Popen(
        [sys.executable, "-c", SUPERVISOR_SCRIPT, str(tiny_model_dir), str(tmp_path / "server.log")],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert supervisor.stdout is not None
    pgid = int(supervisor.stdout.readline())
    os.killpg(pgid, 0)  # the server runs
    supervisor.kill()
    supervisor.wait(30)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)
    pytest.fail(f"server group {pgid} still alive 60 s after its supervisor was killed")


@pytest.mark.slow
def test_stop_during_start_up_stops_the_server_at_once(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A supervisor told to stop while its server starts (30 s to minutes here; a cancelled
    run) does not wait for health: the server is stopped, nothing registered, nothing left."""
    import threading
    import uuid

    import process_scan
    from asyncrl.storage.fs import open_root
    from asyncrl.tasks.inference.server_registry import list_servers
    from asyncrl.tasks.launch.components import RolloutComponent
    from asyncrl.tasks.launch.supervisor import ComponentEvent, ComponentStatus, RestartPolicy, supervise

    marker = uuid.uuid4().hex
    monkeypatch.setenv("ASYNCRL_TEST_MARKER", marker)  # inherited by the server and its engine
    root = open_root(f"file://{tmp_path}/run")
    config = RolloutServerConfig(model_dir=tiny_model_dir, log_path=tmp_path / "server.log")
    component = RolloutComponent("rollout-0", "rollout-0", root, lambda: (config, None, None), tmp_path / "server.log")
    stop = threading.Event()
    events: list[ComponentEvent] = []
    status = ComponentStatus("rollout-0")
    timer = threading.Timer(2.0, stop.set)
    timer.start()
    started = time.monotonic()
    try:
        outcome = supervise(component, stop, RestartPolicy(max_restarts=0), on_event=events.append, status=status)
    finally:
        timer.cancel()
    assert time.monotonic() - started < 60, "the supervisor waited for the start-up"
    assert outcome.end == "stopped" and outcome.component == "rollout-0" and outcome.restarts == 0
    assert "ready" not in [event.kind for event in events] and not status.ready
    assert not component.registered and list_servers(root) == []
    assert process_scan.processes_with_env("ASYNCRL_TEST_MARKER", marker) == []
    assert "vllm.entrypoints.openai.api_server" in (tmp_path / "server.log").read_text()  # it had started


def test_supervisor_start_failure_registers_nothing(tmp_path: Path) -> None:
    import threading

    from asyncrl.storage.fs import open_root
    from asyncrl.tasks.inference.server_registry import list_servers
    from asyncrl.tasks.launch.components import RolloutComponent
    from asyncrl.tasks.launch.supervisor import RestartPolicy, supervise

    root = open_root(f"file://{tmp_path}/run")
    config = RolloutServerConfig(model_dir=tmp_path / "missing", log_path=tmp_path / "server.log")
    component = RolloutComponent("rollout-0", "rollout-0", root, lambda: (config, None, None), tmp_path / "server.log")
    with pytest.raises(FileNotFoundError, match="missing"):
        supervise(component, threading.Event(), RestartPolicy(max_restarts=0))
    assert list_servers(root) == []
    assert not (tmp_path / "server.log").exists()  # nothing was spawned


@pytest.mark.parametrize(
    ("host", "advertise", "url", "probe"),
    [
        ("127.0.0.1", None, "http://127.0.0.1:9000", "http://127.0.0.1:9000"),
        ("::1", None, "http://[::1]:9000", "http://[::1]:9000"),
        ("0.0.0.0", "rollout-7.cluster", "http://rollout-7.cluster:9000", "http://127.0.0.1:9000"),
        ("::", "10.0.0.7", "http://10.0.0.7:9000", "http://[::1]:9000"),
        ("10.0.0.7", None, "http://10.0.0.7:9000", "http://10.0.0.7:9000"),
    ],
)
def test_server_urls(host: str, advertise: str | None, url: str, probe: str, tmp_path: Path) -> None:
    config = RolloutServerConfig(model_dir=tmp_path, host=host, advertise_host=advertise, api_key="k")
    assert server_urls(config, 9000) == (url, probe)


def test_wildcard_host_advertises_machine_name(tmp_path: Path) -> None:
    import socket

    config = RolloutServerConfig(model_dir=tmp_path, host="0.0.0.0", api_key="k")
    assert server_urls(config, 9000)[0] == f"http://{socket.gethostname()}:9000"


# ----- the port and the server on it are ours -----


class _ForeignHandler:
    """Handler factory of a foreign HTTP server: ``/health`` 200, ``/v1/models`` as given."""

    @staticmethod
    def make(models_status: int, models_body: bytes) -> type:
        from http.server import BaseHTTPRequestHandler

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                status, body = (200, b"ok") if self.path == "/health" else (models_status, models_body)
                self.send_response(status)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        return Handler


def _serve_foreign(models_status: int = 200, models_body: bytes = b'{"object": "list", "data": [{"id": "other-model"}]}'):  # noqa: ANN202
    import threading
    from http.server import ThreadingHTTPServer

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _ForeignHandler.make(models_status, models_body))
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return httpd


def _model_dir(tmp_path: Path) -> Path:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    return model


def test_a_port_in_use_is_refused_before_spawning(tmp_path: Path) -> None:
    from asyncrl.tasks.inference.server_errors import PortInUseError

    httpd = _serve_foreign()
    port = httpd.server_address[1]
    try:
        server = RolloutServer(RolloutServerConfig(model_dir=_model_dir(tmp_path), port=port, log_path=tmp_path / "server.log"))
        started = time.monotonic()
        holder = f"pid {os.getpid()} "  # the foreign server runs in this process: the error names it
        with pytest.raises(PortInUseError, match=f"port {port} on 127.0.0.1 is already in use by {holder}"):
            server.start()
        assert time.monotonic() - started < 1.0
        assert server.returncode() is None and not (tmp_path / "server.log").exists()  # nothing spawned
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_a_free_fixed_port_passes_the_bind_test() -> None:
    from asyncrl.tasks.inference.server_ports import check_port_free, free_port

    check_port_free("127.0.0.1", free_port("127.0.0.1"))


def _fake_spawn(monkeypatch: pytest.MonkeyPatch) -> None:
    """The race the bind test cannot close (another process takes the port after it): the
    bind test passes, and a sleeping process stands in for vLLM (which would fail to bind)."""
    import sys

    from asyncrl.tasks.inference import server as server_module

    monkeypatch.setattr(server_module, "check_port_free", lambda host, port: None)
    monkeypatch.setattr(
        server_module, "server_command", lambda config, model_dir, port: [sys.executable, "-c", "import time; time.sleep(120)"]
    )


@pytest.mark.parametrize(
    ("status", "body", "detail"),
    [
        (200, b'{"object": "list", "data": [{"id": "other-model"}]}', r"/v1/models lists \['other-model'\]"),
        (404, b"not found", "/v1/models answered HTTP 404"),
        (200, b"<html>hello</html>", "without an OpenAI model list"),
    ],
)
def test_a_foreign_server_on_the_port_is_not_taken_for_ours(
    status: int, body: bytes, detail: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from asyncrl.tasks.inference.server_errors import ForeignServerError

    _fake_spawn(monkeypatch)
    httpd = _serve_foreign(status, body)
    port = httpd.server_address[1]
    try:
        server = RolloutServer(RolloutServerConfig(model_dir=_model_dir(tmp_path), port=port, log_path=tmp_path / "server.log"))
        handle = server.start()
        assert server.is_healthy()  # the foreign server answers /health...
        with pytest.raises(ForeignServerError, match=f"port {handle.url} is held by another process.*{detail}"):
            server.wait_healthy(timeout_s=30.0)  # ...but it is not ours
        assert server.returncode() is not None  # ours was stopped
        assert_group_gone(handle.pgid)
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_a_foreign_server_fails_the_supervised_start_and_registers_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import threading

    from asyncrl.storage.fs import open_root
    from asyncrl.tasks.inference.server_registry import list_servers
    from asyncrl.tasks.inference.server_errors import ForeignServerError
    from asyncrl.tasks.launch.components import RolloutComponent
    from asyncrl.tasks.launch.supervisor import RestartPolicy, supervise

    _fake_spawn(monkeypatch)
    httpd = _serve_foreign()
    try:
        root = open_root(f"file://{tmp_path}/run")
        config = RolloutServerConfig(model_dir=_model_dir(tmp_path), port=httpd.server_address[1], log_path=tmp_path / "s.log")
        component = RolloutComponent("rollout-0", "rollout-0", root, lambda: (config, None, None), tmp_path / "s.log")
        with pytest.raises(ForeignServerError, match="held by another process"):
            supervise(component, threading.Event(), RestartPolicy(max_restarts=3, poll_s=0.05))
        assert list_servers(root) == [] and not component.registered
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_each_start_serves_a_name_of_its_own(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from asyncrl.tasks.inference.vllm_command import served_name_args, served_names

    config = RolloutServerConfig(model_dir=tmp_path, served_model_name="policy")
    # this start's name first (responses carry it), the plain one kept for requests
    assert served_name_args(config, tmp_path, "abc123") == ["--served-model-name", "policy-abc123", "policy"]
    assert "--served-model-name" not in server_command(config, tmp_path, 8000)  # start() appends them last
    assert served_names(RolloutServerConfig(model_dir=tmp_path), tmp_path, "n1") == (f"{tmp_path}-n1", str(tmp_path))
    _fake_spawn(monkeypatch)
    model = _model_dir(tmp_path)
    handles = []
    for _ in range(2):
        server = RolloutServer(RolloutServerConfig(model_dir=model, log_path=tmp_path / "server.log"))
        handles.append(server.start())
        server.stop()
    assert handles[0].model != handles[1].model
    assert all(h.model.startswith(f"{model}-") for h in handles)


def test_a_port_in_use_fails_the_supervised_start_before_spawning(tmp_path: Path) -> None:
    import threading

    from asyncrl.storage.fs import open_root
    from asyncrl.tasks.inference.server_registry import list_servers
    from asyncrl.tasks.inference.server_errors import PortInUseError
    from asyncrl.tasks.launch.components import RolloutComponent
    from asyncrl.tasks.launch.supervisor import RestartPolicy, supervise

    httpd = _serve_foreign()
    try:
        root = open_root(f"file://{tmp_path}/run")
        config = RolloutServerConfig(model_dir=_model_dir(tmp_path), port=httpd.server_address[1], log_path=tmp_path / "s.log")
        component = RolloutComponent("rollout-0", "rollout-0", root, lambda: (config, None, None), tmp_path / "s.log")
        with pytest.raises(PortInUseError, match=f"port {httpd.server_address[1]} on 127.0.0.1 is already in use"):
            supervise(component, threading.Event(), RestartPolicy(max_restarts=3))
        assert list_servers(root) == [] and not (tmp_path / "s.log").exists()
    finally:
        httpd.shutdown()
        httpd.server_close()
