"""A real local Prefect stack for tests: ``prefect server start`` on a free port of
127.0.0.1 with its own PREFECT_HOME and SQLite database, the ``prefect`` CLI against it,
and ``prefect worker start`` processes.

Plain context managers and functions, no pytest: a test module wraps them in fixtures.
Every process started here runs in a session of its own and is killed with its whole
process group on exit; every process that inherited the stack's PREFECT_HOME (flow runs
and what they spawned) is killed too, so a failing test leaves nothing behind.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
from process_scan import kill_processes, processes_with_env

from asyncrl.tasks.system.process_group import kill_group, read_log_tail
from asyncrl.tasks.inference.server_ports import free_port

LOG_TAIL_LINES = 60


@dataclass(frozen=True)
class PrefectServer:
    """A running local Prefect server and the environment of the processes that use it."""

    api_url: str
    home: Path
    log_path: Path

    def env(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        """This process's environment, minus its Prefect settings, pointed at this server."""
        inherited = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
        return {
            **inherited,
            "PREFECT_HOME": str(self.home),
            "PREFECT_API_URL": self.api_url,
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            **(extra or {}),
        }


def prefect_command(*args: str) -> list[str]:
    """The ``prefect`` CLI of this interpreter's environment."""
    return [str(Path(sys.executable).parent / "prefect"), *args]


def run_prefect(server: PrefectServer, args: list[str], cwd: Path, env: Mapping[str, str] | None = None,
                timeout_s: float = 300.0) -> str:
    """Run one ``prefect`` CLI command against ``server``; return its output, raise with it on failure."""
    done = subprocess.run(
        prefect_command(*args), cwd=cwd, env=server.env(env), capture_output=True, text=True,
        timeout=timeout_s, check=False, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    output = done.stdout + done.stderr
    if done.returncode != 0:
        raise RuntimeError(f"prefect {' '.join(args)} exited with {done.returncode}:\n{output}")
    return output


def wait_healthy(url: str, process: subprocess.Popen[bytes], log_path: Path, timeout_s: float) -> None:
    """Poll ``url`` until it answers 200; raise with the log tail if ``process`` exits or time runs out."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"exited with {process.returncode}:\n{read_log_tail(log_path, LOG_TAIL_LINES)}")
        try:
            if httpx.get(url, timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url} not healthy within {timeout_s:.0f} s:\n{read_log_tail(log_path, LOG_TAIL_LINES)}")


def start_logged(command: list[str], log_path: Path, env: Mapping[str, str], cwd: Path) -> subprocess.Popen[bytes]:
    """Start ``command`` in a new session, stdout and stderr to ``log_path``."""
    with open(log_path, "ab") as log:
        return subprocess.Popen(
            command, cwd=cwd, env=dict(env), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip


@contextmanager
def prefect_server(work_dir: Path, start_timeout_s: float = 180.0) -> Iterator[PrefectServer]:
    """``prefect server start`` (no UI, no scheduler: no cron run fires during a test) with
    PREFECT_HOME and its SQLite database under ``work_dir``. On exit every process of the
    stack is killed: the server's group and whatever inherited its PREFECT_HOME."""
    home = work_dir / "prefect-home"
    home.mkdir(parents=True, exist_ok=True)
    port = free_port("127.0.0.1")
    server = PrefectServer(api_url=f"http://127.0.0.1:{port}/api", home=home, log_path=work_dir / "server.log")
    command = prefect_command(
        "server", "start", "--host", "127.0.0.1", "--port", str(port), "--no-ui", "--no-scheduler"
    )
    process = start_logged(command, server.log_path, server.env(), work_dir)
    try:
        try:
            wait_healthy(f"{server.api_url}/health", process, server.log_path, start_timeout_s)
        except (RuntimeError, TimeoutError) as exc:
            raise RuntimeError(f"prefect server did not start: {exc}") from exc
        yield server
    finally:
        kill_processes(processes_with_env("PREFECT_HOME", str(home)))
        kill_group(process, grace_s=5.0)


@contextmanager
def prefect_worker(server: PrefectServer, pool: str, log_path: Path, cwd: Path,
                   env: Mapping[str, str] | None = None, name: str | None = None,
                   queues: tuple[str, ...] = ()) -> Iterator[subprocess.Popen[bytes]]:
    """``prefect worker start --pool pool [--work-queue q ...]`` against ``server`` (every
    queue of the pool when ``queues`` is empty). On exit its process group (the flow runs it
    started included) is killed: it does not stop on SIGTERM while it has runs."""
    command = prefect_command("worker", "start", "--pool", pool, "--name", name or f"test-{os.getpid()}")
    for queue in queues:
        command += ["--work-queue", queue]
    process = start_logged(command, log_path, server.env(env), cwd)
    try:
        yield process
    finally:
        kill_group(process, grace_s=0.0)


@dataclass(frozen=True)
class WorkerStack:
    """A Prefect server with its process workers (by name) and their logs."""

    server: PrefectServer
    worker_logs: dict[str, Path]
    worker_pids: dict[str, int]

    def diagnostics(self, run_dir: Path | None = None) -> str:
        """Log tails for an assertion message: the workers' and the run's components' (``run_dir/logs``)."""
        logs = list(self.worker_logs.values()) + (sorted((run_dir / "logs").glob("*.log")) if run_dir is not None else [])
        return "\n".join(f"--- {path.name} ---\n{read_log_tail(path, LOG_TAIL_LINES)}" for path in logs)
