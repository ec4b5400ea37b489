"""Reading a flow run's tree back from the Prefect server (the test session's)."""

from __future__ import annotations

from typing import Any


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
