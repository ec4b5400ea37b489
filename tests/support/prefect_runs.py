"""Starting deployment runs and reading flow runs back from the Prefect server (the test session's)."""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any
from pathlib import Path
from uuid import UUID

from ports import restartable_base_port

from asyncrl.configs.run_config import RunConfig
from asyncrl.tasks.pipeline.stages import prepare_inputs


def run_tree(flow_run_id: Any) -> dict[str, str]:  # noqa: ANN401 - a UUID
    """Name -> final state of the flow run's task runs and child flow runs, recursively."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterParentFlowRunId, FlowRunFilterId

    found: dict[str, str] = {}
    with get_client(sync_client=True) as client:
        pending = [flow_run_id]
        while pending:
            parent = pending.pop()
            runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[parent])))
            for task_run in runs:
                found[task_run.name] = task_run.state.name if task_run.state else "?"
            children = client.read_flow_runs(
                flow_run_filter=FlowRunFilter(parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[parent]))
            )
            for child in children:
                found[f"flow:{child.name}"] = child.state.name if child.state else "?"
                pending.append(child.id)
    return found


def run_records_text(flow_run_id: Any) -> str:  # noqa: ANN401 - a UUID
    """Everything the Prefect server holds about a flow run's tree as one text: each flow
    run's parameters, every log line and every artifact of the tree (what its UI shows)."""
    import json

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        ArtifactFilter,
        ArtifactFilterFlowRunId,
        FlowRunFilter,
        FlowRunFilterParentFlowRunId,
        LogFilter,
        LogFilterFlowRunId,
    )

    parts: list[str] = []
    with get_client(sync_client=True) as client:
        pending, seen = [flow_run_id], []
        while pending:
            run_id = pending.pop()
            seen.append(run_id)
            parts.append(json.dumps(client.read_flow_run(run_id).parameters, default=str))
            children = client.read_flow_runs(
                flow_run_filter=FlowRunFilter(parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[run_id]))
            )
            pending.extend(child.id for child in children)
        log_filter = LogFilter(flow_run_id=LogFilterFlowRunId(any_=seen))
        read = 0
        while True:
            logs = client.read_logs(log_filter=log_filter, limit=200, offset=read)
            parts.extend(log.message for log in logs)
            read += len(logs)
            if len(logs) < 200:
                break
        artifacts = client.read_artifacts(artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=seen)))
        parts.extend(json.dumps(artifact.data, default=str) for artifact in artifacts)
    return "\n".join(parts)


def start_train_run(config: dict[str, Any]) -> UUID:
    """Validate `config`, write its synthetic data, and start a run of the `train` deployment."""
    from prefect.deployments import run_deployment

    prepare_inputs(RunConfig.model_validate(config))
    flow_run = run_deployment("train/train", parameters={"config": config}, timeout=0)
    return flow_run.id


def read_state(flow_run_id: UUID) -> Any:  # noqa: ANN401 - a prefect State
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        return client.read_flow_run(flow_run_id).state


def wait_until(
    condition: Callable[[], bool], timeout_s: float, describe: Callable[[], str], poll_s: float = 2.0
) -> None:
    """Poll `condition` until true; raise TimeoutError with `describe()` when time runs out."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"not within {timeout_s:.0f} s: {describe()}")
        time.sleep(poll_s)


def wait_final_state(flow_run_id: UUID, timeout_s: float, diagnostics: Callable[[], str]) -> Any:  # noqa: ANN401
    """The flow run's state (a prefect State) once final: completed, failed, crashed, cancelled."""
    states: list[Any] = []

    def final() -> bool:
        states.append(read_state(flow_run_id))
        return states[-1] is not None and states[-1].is_final()

    wait_until(final, timeout_s, lambda: f"flow run {flow_run_id} final, last state {states[-1]}\n{diagnostics()}")
    return states[-1]


def train_config(tmp_path: Path, model_dir: Path, name: str, max_steps: int) -> dict[str, Any]:
    """A short `train` run on the tiny model and a small synthetic task, local storage."""
    return {
        "name": name,
        "work_dir": str(tmp_path / "work"),
        "model": {"path": str(model_dir)},
        "data": {"train_path": str(tmp_path / "data" / "train.parquet"), "max_prompt_tokens": 64},
        "rollout": {"n_samples": 2, "max_new_tokens": 24, "eta": 1, "shard_groups": 2, "shard_seconds": 2.0},
        "inference": {"base_port": restartable_base_port()},
        "trainer": {"batch_groups": 2, "max_steps": max_steps, "micro_batch_tokens": 256,
                    "checkpoint_every": max_steps, "optimizer": {"lr": 1.0e-4}},
        "reward": {"pool": {"workers": 1}},
        "pipeline": {"synthetic_data": {"n_train": 64, "n_heldout": 4}},
        "storage": {"root": str(tmp_path / "store")},
        "tracking": {"mlflow_uri": f"sqlite:///{tmp_path / 'mlflow.db'}", "experiment": name},
    }  # fmt: skip


def result_error(state: Any) -> BaseException | None:  # noqa: ANN401 - a Prefect State
    """The exception a final state's ``result()`` raises (a failed run's error), or None."""
    try:
        state.result()
    except BaseException as exc:  # noqa: BLE001 - the tests read its message
        return exc
    return None


def read_events(event: str, resource_id: str, since: datetime, expected: int, timeout_s: float = 30.0) -> list[Any]:
    """The events named ``event`` on resource ``resource_id`` since ``since``, oldest first,
    from the Prefect server: polled until ``expected`` are there (events reach the server
    asynchronously) or ``timeout_s`` has passed."""
    from prefect.client.orchestration import get_client
    from prefect.events.filters import EventFilter, EventNameFilter, EventOccurredFilter, EventOrder, EventResourceFilter

    query = EventFilter(
        occurred=EventOccurredFilter(since=since), event=EventNameFilter(name=[event]),
        resource=EventResourceFilter(id=[resource_id]), order=EventOrder.ASC,
    )  # fmt: skip
    deadline = time.monotonic() + timeout_s
    while True:
        query.occurred.until = datetime.now(timezone.utc)
        with get_client(sync_client=True) as client:
            found = list(client.read_events(query, limit=50).events)
        if len(found) >= expected or time.monotonic() > deadline:
            return found
        time.sleep(0.5)


def latest_artifacts(keys: list[str]) -> dict[str, Any]:
    """The newest Prefect artifact of each key, from the test server."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactCollectionFilter, ArtifactCollectionFilterKey

    with get_client(sync_client=True) as client:
        wanted = ArtifactCollectionFilter(key=ArtifactCollectionFilterKey(any_=keys))
        found = client.read_latest_artifacts(artifact_filter=wanted)
    return {a.key: a for a in found}
