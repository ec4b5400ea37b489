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
