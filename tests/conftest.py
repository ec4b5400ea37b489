"""Session-wide settings and shared servers of the test suite.

One SeaweedFS, one moto server and one tiny model per test session; the inference tests
share one vLLM server (``server_a`` in tests/support/fixtures_inference.py). Helpers live in
tests/support (on pytest's pythonpath).

The suite is split by cost: tests/unit (no live process), tests/integration (live processes
or servers: vLLM, DeepSpeed, Prefect, SeaweedFS, reward workers, sandboxes, asyncrl
subprocesses) and tests/e2e (whole runs), each by the code's package names. The fixtures
that tests of one package share across those three live in the plugin modules of
``pytest_plugins`` below (tests/support), so they reach each test wherever it lives.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import s3_servers

pytest_plugins = ["fixtures_inference", "fixtures_storage", "fixtures_trainer"]

# Prefect must not try to reach its telemetry service from an offline machine.
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def aws_env() -> Iterator[None]:
    with s3_servers.aws_test_env():
        yield


@pytest.fixture(scope="session")
def moto_endpoint(aws_env: None) -> Iterator[Any]:
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    with s3_servers.moto_server() as endpoint:
        yield endpoint


@pytest.fixture(scope="session")
def seaweedfs_endpoint(aws_env: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    with s3_servers.seaweedfs_server(tmp_path_factory.mktemp("seaweedfs")) as endpoint:
        yield endpoint


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Qwen2 model, written once per session (tests must not modify it)."""
    from asyncrl.tasks.model.tiny import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("tiny-model") / "tiny", seed=0)


@pytest.fixture(scope="session")
def prefect_server() -> Iterator[None]:
    """One Prefect test server for the tests that run flows in this process."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The longest modules first, so that `make test`'s two pytest-xdist workers (``--dist
    loadfile --no-loadscope-reorder``: a module at a time, in this order) end together: the
    whole runs (tests/e2e), the trainer's (DeepSpeed ranks, torchrun), the other integration
    tests, then the short unit tests, each part in its collection order."""

    def rank(item: pytest.Item) -> int:
        parts = item.path.parts
        if "e2e" in parts:
            return 0
        if "integration" in parts:
            return 1 if "trainer" in parts else 2
        return 3

    items.sort(key=rank)


RUN_MARKER = "ASYNCRL_RUN_TEST_MARKER"


@pytest.fixture
def process_marker(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A value of ``RUN_MARKER`` that every process a test starts inherits: the test checks
    that none is left (``process_scan.processes_with_env(RUN_MARKER, value)``), and the
    teardown kills what a failed test left."""
    import uuid

    from process_scan import kill_processes, processes_with_env

    value = uuid.uuid4().hex
    monkeypatch.setenv(RUN_MARKER, value)
    yield value
    kill_processes(processes_with_env(RUN_MARKER, value))
