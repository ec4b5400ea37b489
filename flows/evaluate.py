"""The `evaluate` flow: held-out pass@1 of published weight versions of a run."""

from __future__ import annotations

from typing import Any

from prefect import flow, get_run_logger
from prefect.artifacts import create_table_artifact

from asyncrl.flows.prefect_api.credentials import apply_storage_credentials
from asyncrl.configs.run_config import RunConfig
from asyncrl.tasks.pipeline.stages import evaluate_versions
from asyncrl.tasks.launch.context import prepare_run
from asyncrl.storage.weights import WeightStore


def resolve_versions(available: list[int], requested: list[int] | None) -> list[int]:
    """The versions to evaluate: `requested` (each must be published), else the newest."""
    if not available:
        raise ValueError("the run root has no published weight version to evaluate")
    if not requested:
        return [available[-1]]
    missing = sorted(set(requested) - set(available))
    if missing:
        raise ValueError(f"weight versions {missing} are not published; available: {available}")
    return sorted(set(requested))


@flow(name="evaluate", log_prints=True)
def evaluate_run(config: RunConfig, versions: list[int] | None = None) -> dict[str, Any]:
    """pass@1 (averaged over pipeline.eval_samples samples) of `versions` (default: newest)."""
    apply_storage_credentials(config.storage)
    paths = prepare_run(config)
    chosen = resolve_versions(WeightStore(paths.root).list_versions(), versions)
    results = evaluate_versions(config, paths, chosen)
    rows = [
        {"version": v, "pass_at_1": r.pass_at_1, "prompts": r.prompts, **r.by_task} for v, r in sorted(results.items())
    ]
    create_table_artifact(rows, key="asyncrl-evaluation", description=f"held-out pass@1 of run {config.name}")
    get_run_logger().info("pass@1: %s", {row["version"]: round(row["pass_at_1"], 4) for row in rows})
    return {str(v): r.pass_at_1 for v, r in results.items()}
