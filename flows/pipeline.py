"""The `pipeline` flow: `prepare-data` -> `init-model` (when asked) -> `sft` -> `train`
(child flow run) -> `evaluate` -> `register`, each its own task or flow run.

The batch stages are cached by content (:mod:`asyncrl.tasks.pipeline.stage_cache`): their keys
are built from their config section, the content of their inputs and the code version, and
their results are persisted under the run's work directory. Re-running a config after a
failure in RL skips data and SFT (state "Cached"); a changed setting or input file redoes the
stage and everything after it; a stage whose outputs are gone runs again; ``refresh`` redoes
every stage. The RL phase (`train`) is never cached: it resumes the run root.

First the run's train files are chosen (:mod:`asyncrl.tasks.pipeline.train_data`; a folder
``data.train_path`` grows between runs); with ``data.require_new_files`` and no new file the
run ends there, in a Completed state named "Skipped" whose message says why.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from prefect.states import Completed

from asyncrl.flows.prefect_api.credentials import apply_storage_credentials
from asyncrl.flows.prefect_api.events import emit_promotion
from asyncrl.configs.run_config import RunConfig
from asyncrl.configs.secrets import strip_uri_password
from asyncrl.flows.train import train
from asyncrl.storage import fs
from asyncrl.tasks.pipeline import registration, stages, train_data
from asyncrl.flows.prefect_api.artifacts import PipelineSummary, artifact_key, stage_progress_artifact, summary_markdown
from asyncrl.tasks.launch.context import RunContext, open_run_context, system_metrics
from asyncrl.tasks.system.run_paths import run_paths
from asyncrl.tasks.tracking.lineage_recorder import file_ref
from asyncrl.tasks.pipeline.progress import StageProgress, clear_progress
from asyncrl.tasks.tracking.run_report import log_run_report

SUMMARY_FILE = "summary.json"
RESULTS_DIR = "prefect-results"


def _config(parameters: dict[str, Any]) -> RunConfig:
    config = parameters["config"]
    return config if isinstance(config, RunConfig) else RunConfig.model_validate(config)


@task(name="prepare-data", task_run_name="prepare-data", cache_key_fn=lambda ctx, p: stages.data_key(_config(p)), persist_result=True)
def prepare_data(config: RunConfig) -> dict[str, str]:
    """Write the synthetic task (when configured) and check the data files; their digests."""
    with stage_progress_artifact(config.run_work_dir, config.name, "prepare-data"):
        return stages.prepare_data(config)


@task(name="init-model", task_run_name="init-model", cache_key_fn=lambda ctx, p: stages.model_key(_config(p)), persist_result=True)
def init_model(config: RunConfig) -> str:
    """Write the tiny model at model.path unless one is there; its content digest."""
    with stage_progress_artifact(config.run_work_dir, config.name, "init-model"):
        return stages.init_model(config)


@task(name="sft", task_run_name="sft", cache_key_fn=lambda ctx, p: stages.sft_key(_config(p)), persist_result=True)
def sft(config: RunConfig, data: dict[str, str], model: str | None) -> int:
    """SFT warm start, published as the run root's first weight version. ``data`` and
    ``model`` (the earlier stages' digests) order it after them; its key reads the files."""
    with stage_progress_artifact(config.run_work_dir, config.name, "sft"):
        return stages.run_sft(config, run_paths(config))


@task(
    name="evaluate",
    task_run_name="evaluate",
    cache_key_fn=lambda ctx, p: stages.evaluation_key(_config(p), run_paths(_config(p)), p["versions"]),
    persist_result=True,
)
def evaluate(config: RunConfig, versions: list[int]) -> dict[str, dict[str, Any]]:
    """Held-out pass@1 of ``versions`` on one vLLM server."""
    with stage_progress_artifact(config.run_work_dir, config.name, "evaluate"):
        return stages.eval_results_to_json(stages.evaluate_versions(config, run_paths(config), versions))


@task(name="register", task_run_name="register")
def register(config: RunConfig, run_id: str, logged_models: dict[int, str], results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Evaluation metrics on each LoggedModel; the best version registered as the candidate
    and promoted to `best`/`current` only through the gate (``pipeline.promotion``)."""
    from asyncrl.tasks.tracking.mlflow_run import RunLineage

    lineage = RunLineage.resume(config.tracking.mlflow_uri, run_id)
    done = registration.register_best(config, lineage, logged_models, stages.eval_results_from_json(results))
    decision = done.decision
    if decision is not None and decision.incumbent is not None:
        create_markdown_artifact(
            decision.markdown(), key=artifact_key(config.name, "promotion"), description="asyncrl promotion decision"
        )
        emit_promotion(config.name, config.pipeline.registered_model, decision)
    return {
        "best_version": done.best_version,
        "registered_version": done.registered_version,
        "promotion": None if decision is None else decision.message(),
    }


def run_stage(stage_task: Any, config: RunConfig, refresh: bool, outputs_present: bool, *args: Any) -> tuple[Any, str]:  # noqa: ANN401
    """Run a cached stage; a stage whose outputs are gone (or ``refresh``) is run again.
    Returns its result and whether it ran or came from the cache."""
    results = config.run_work_dir / RESULTS_DIR
    options = stage_task.with_options(result_storage=results, refresh_cache=refresh or not outputs_present)
    state = options(config, *args, return_state=True)
    how = "cached" if state.name == "Cached" else "run"
    if how == "cached":
        StageProgress(config.run_work_dir, stage_task.name, 1, "stage").finish(
            "from an earlier run", state="cached"
        )
    return state.result(), how


def pipeline_stages(config: RunConfig, context: RunContext, refresh: bool) -> tuple[PipelineSummary, dict[str, Any]]:
    """The stages in order (see the module docstring); the summary and the evaluation
    results (weight version -> result as JSON)."""
    logger = get_run_logger()
    started = time.monotonic()
    how: dict[str, str] = {}
    data, how["prepare-data"] = run_stage(prepare_data, config, refresh, stages.data_present(config))
    model = None
    if config.pipeline.init_tiny_model:
        model, how["init-model"] = run_stage(init_model, config, refresh, stages.model_present(config))
    if config.pipeline.sft_steps:
        _, how["sft"] = run_stage(sft, config, refresh, stages.sft_present(config, context.paths), data, model)
        if config.data.sft_path:
            context.lineage.log_dataset(file_ref(config.data.sft_path, Path(config.data.sft_path).name), context="sft")
    logger.info("stages so far: %s", how)
    trained = train.with_options(flow_run_name=f"{config.name}-train")(config, mlflow_owned=False)
    logged_models = {int(k): v for k, v in trained["logged_models"].items()}
    versions = sorted({min(logged_models, default=0), trained["final_version"]})
    results: dict[str, dict[str, Any]] = {}
    if config.data.eval_path:
        results, how["evaluate"] = run_stage(evaluate, config, refresh, True, versions)
    registered = register(config, context.lineage.run_id, logged_models, results)
    before, after = results.get(str(versions[0])), results.get(str(versions[-1]))
    return PipelineSummary(
        run=config.name,
        steps=trained["steps"],
        final_version=trained["final_version"],
        pass_at_1_before=None if before is None else before["pass_at_1"],
        pass_at_1_after=None if after is None else after["pass_at_1"],
        best_version=registered["best_version"],
        registered_model=config.pipeline.registered_model if registered["registered_version"] else None,
        registered_model_version=registered["registered_version"],
        promotion=registered["promotion"],
        wall_s=time.monotonic() - started,
        train_wall_s=trained["wall_s"],
        mlflow_uri=strip_uri_password(config.tracking.mlflow_uri),
        mlflow_run_id=context.lineage.run_id,
        storage_root=context.paths.root.uri,
        restarts=trained["restarts"],
        stages=how,
        by_task_before={} if before is None else dict(before.get("by_task", {})),
        by_task_after={} if after is None else dict(after.get("by_task", {})),
        pass_at_1_during_training={int(v): r["pass_at_1"] for v, r in trained.get("evaluations", {}).items()},
        overlap=dict(trained.get("overlap", {})),
    ), results


SKIPPED = "Skipped"
"""Name of the Completed state of a run that ended without training (``data.require_new_files``)."""


def skipped_result(config: RunConfig, context: RunContext, reason: str) -> dict[str, Any]:
    """The result of a skipped run: ``skipped`` holds why."""
    return {"run": config.name, "skipped": reason, "mlflow_run_id": context.lineage.run_id,
            "storage_root": context.paths.root.uri}  # fmt: skip


@flow(name="pipeline", log_prints=True)
def pipeline(config: RunConfig, refresh: bool = False) -> Any:  # noqa: ANN401 - the summary, or a state holding it
    """Prepare data, optional SFT warm start, asynchronous RL, evaluation, registration through
    the promotion gate; ``refresh`` redoes the cached stages. The summary (a dict) is the
    result; with a promotion decision the final state's message is that decision."""
    apply_storage_credentials(config.storage)
    context = open_run_context(config)
    clear_progress(context.paths.work_dir)
    try:
        skipped = train_data.choose_train_data(config, context.lineage).skipped
        if skipped is not None:  # data.require_new_files, and nothing new: not a failure
            context.lineage.end()
            return Completed(name=SKIPPED, message=skipped, data=skipped_result(config, context, skipped))
        with system_metrics(context):
            summary, results = pipeline_stages(config, context, refresh)
        evaluations = {int(version): result for version, result in results.items()}
        log_run_report(context.lineage, config.name, evaluations, asdict(summary))
    except BaseException as exc:
        context.lineage.end("FAILED" if isinstance(exc, Exception) else "KILLED")
        raise
    context.lineage.end()
    fs.put_atomic_replace(context.paths.root, SUMMARY_FILE, json.dumps(asdict(summary), indent=1).encode())
    create_markdown_artifact(
        summary_markdown(summary), key=artifact_key(config.name, "summary"), description="asyncrl run summary"
    )
    return Completed(message=summary.promotion, data=asdict(summary)) if summary.promotion else asdict(summary)
