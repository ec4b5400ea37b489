"""One real Prefect stack for the test session's deployment tests: a `prefect server start`,
the `asyncrl-process` work pool, `prefect deploy --all` from the repository root, and two
process workers standing for two machines:

- ``node-a`` takes the `default` queue (the `train` flow and the other whole-run flows), the
  `rollout-server` and `scheduler` queues;
- ``node-b`` takes the `trainer` queue only.

So a run placed with `placement.trainer` on `component/trainer` trains on node-b while its
flow and its rollout servers run on node-a. The processes live for the session; the test
process's Prefect client points at the stack's server only during a test that asks for
``worker_stack`` (the other tests use the session's in-process test server).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import prefect_stack
import pytest
import yaml

from prefect_stack import WorkerStack

REPO = Path(__file__).resolve().parents[3]
POOL = yaml.safe_load((REPO / "prefect.yaml").read_text())["definitions"]["work_pools"]["process"]["name"]
WORKER_QUEUES = {"node-a": ("default", "rollout-server", "scheduler"), "node-b": ("trainer",)}


@pytest.fixture(scope="session")
def worker_stack_processes(aws_env: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[WorkerStack]:
    """The stack's processes for the session (module docstring); after ``aws_env``, so flow
    runs reach the test S3 servers."""
    from contextlib import ExitStack

    work_dir = tmp_path_factory.mktemp("prefect-stack")
    with prefect_stack.prefect_server(work_dir) as server, ExitStack() as workers:
        prefect_stack.run_prefect(server, ["work-pool", "create", POOL, "--type", "process"], cwd=work_dir)
        prefect_stack.run_prefect(server, ["deploy", "--all"], cwd=REPO, env={"ASYNCRL_HOME": str(REPO)})
        worker_env = {"PREFECT_WORKER_QUERY_SECONDS": "2", "PREFECT_WORKER_PREFETCH_SECONDS": "5"}
        logs, pids = {}, {}
        for name, queues in WORKER_QUEUES.items():
            logs[name] = work_dir / f"worker-{name}.log"
            worker = workers.enter_context(
                prefect_stack.prefect_worker(server, POOL, logs[name], cwd=work_dir, env=worker_env, name=name, queues=queues)
            )
            pids[name] = worker.pid
        yield WorkerStack(server=server, worker_logs=logs, worker_pids=pids)


@pytest.fixture
def worker_stack(worker_stack_processes: WorkerStack) -> Iterator[WorkerStack]:
    """The session's stack, with this process's Prefect client pointed at its server for one
    test only (tests of other modules use the session's in-process test server)."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings(updates={PREFECT_API_URL: worker_stack_processes.server.api_url}):
        yield worker_stack_processes
