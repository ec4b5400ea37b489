"""Fixtures of the storage tests (a pytest plugin listed in tests/conftest.py, so they reach
tests/unit/storage and tests/integration/storage alike): one run root per test on three backends.

``root`` is parametrised over a local directory, a moto S3 server and a real
SeaweedFS server (session-scoped servers, a fresh bucket per test). The server
code lives in ``tests/support/s3_servers.py`` (plain context managers, reusable elsewhere).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import s3_servers

from asyncrl.storage.fs import RunRoot, open_root
from asyncrl.storage.schema import Sample


BACKENDS = ("local", "moto", "seaweedfs")


@dataclass(frozen=True)
class RootSpec:
    """How to open one test run root: its URI and fsspec options."""

    backend: str
    uri: str
    options: dict[str, Any]

    def open(self) -> RunRoot:
        """A new :class:`RunRoot` (on S3 with its own filesystem instance)."""
        return open_root(self.uri, dict(self.options))


@pytest.fixture(params=BACKENDS)
def root_spec(request: pytest.FixtureRequest, tmp_path: Path) -> RootSpec:
    """A fresh, empty run root on each backend (S3: a new bucket per test)."""
    backend = request.param
    if backend == "local":
        return RootSpec(backend, f"file://{tmp_path}/run", {})
    endpoint = request.getfixturevalue(f"{backend}_endpoint")
    bucket = s3_servers.create_bucket(endpoint)
    return RootSpec(backend, f"s3://{bucket}/run", s3_servers.storage_options(endpoint))


@pytest.fixture
def root(root_spec: RootSpec) -> RunRoot:
    return root_spec.open()


def make_sample(
    group_id: str = "g0",
    *,
    prompt_id: str | None = None,
    prompt: tuple[int, ...] = (11, 12, 13),
    versions: tuple[int, ...] = (0, 0, 1),
    output: tuple[int, ...] | None = None,
    logprobs: tuple[float, ...] | None = None,
    reward: float = 1.0,
    finish_reason: str = "stop",
    submit_time: float = 1_700_000_000.25,
    finish_time: float = 1_700_000_003.5,
) -> Sample:
    """A valid sample; values are exactly representable in float32 so round trips compare equal."""
    n = len(versions)
    return Sample(
        prompt_id=prompt_id if prompt_id is not None else f"p-{group_id}",
        group_id=group_id,
        prompt_token_ids=list(prompt),
        output_token_ids=list(output) if output is not None else [100 + i for i in range(n)],
        behaviour_logprobs=list(logprobs) if logprobs is not None else [-0.25 * (i + 1) for i in range(n)],
        token_versions=list(versions),
        reward=reward,
        finish_reason=finish_reason,
        submit_time=submit_time,
        finish_time=finish_time,
    )


def make_group(group_id: str, size: int = 3, versions: tuple[int, ...] = (0, 0, 1)) -> list[Sample]:
    """``size`` valid samples of one group; sample i gets reward i and its own output tokens."""
    return [
        make_sample(group_id, versions=versions, output=tuple(200 + 10 * i + t for t in range(len(versions))), reward=float(i))
        for i in range(size)
    ]


@pytest.fixture
def sample_factory() -> Callable[..., Sample]:
    return make_sample


@pytest.fixture
def group_factory() -> Callable[..., list[Sample]]:
    return make_group
