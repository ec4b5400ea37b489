"""The `pipeline` flow: prepare data -> optional SFT warm start -> asynchronous RL ->
evaluate (held-out pass@1 through vLLM) -> register the best version in MLflow."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger
from prefect.artifacts import create_markdown_artifact

from asyncrl.configs.loading import public_dict
from asyncrl.configs.run_config import RunConfig
from asyncrl.flows.evaluate import EvalResult, evaluate
from asyncrl.flows.lineage_recorder import file_ref
from asyncrl.flows.run_artifacts import StepProgressArtifact, artifact_key, publish_training_report
from asyncrl.flows.run_setup import RunPaths, prepare_run
from asyncrl.flows.train_flow import TrainResult, load_codec, train_run
from asyncrl.storage import fs
from asyncrl.storage.lineage import RunLineage
from asyncrl.storage.weights import WeightStore
from asyncrl.tasks.data.loader import load_prompts
from asyncrl.tasks.data.prompting import render_prompt
from asyncrl.tasks.reward.pool import RewardPool
from asyncrl.tasks.rollout.client import RolloutClient
from asyncrl.tasks.rollout.server import RolloutServer, RolloutServerConfig
from asyncrl.tasks.rollout.weight_sync import update_server_weights
from asyncrl.tasks.trainer.process import TrainerLaunch, supervise_trainer

SUMMARY_FILE = "summary.json"


@dataclass(frozen=True)
class PipelineSummary:
    run: str
    steps: int
    final_version: int
    pass_at_1_before: float | None
    pass_at_1_after: float | None
    best_version: int | None
    registered_model: str | None
    registered_model_version: str | None
    wall_s: float
    train_wall_s: float
    mlflow_uri: str
    mlflow_run_id: str
    storage_root: str


def prepare_inputs(config: RunConfig) -> None:
    """Write the tiny model and the synthetic task where the config asks for them and
    nothing is there yet (a user's own model and files are never touched)."""
    if config.pipeline.init_tiny_model and not (Path(config.model.path) / "config.json").exists():
        from asyncrl.tasks.model.tiny import write_tiny_model

        write_tiny_model(Path(config.model.path), seed=config.seed)
    synthetic = config.pipeline.synthetic_data
    if synthetic is None:
        return
    from asyncrl.tasks.data.synthetic import make_arithmetic_dataset, mixed_solutions, split_train_heldout, write_problems

    data = config.data
    targets = [Path(p) for p in (data.train_path, data.eval_path, data.sft_path if synthetic.n_sft else None) if p]
    if all(path.exists() for path in targets):
        return
    # One draw of distinct problems, shuffled and cut: held-out, RL prompts, warm-start set
    # (no problem in two splits, all three from the same distribution).
    problems = make_arithmetic_dataset(
        synthetic.n_train + synthetic.n_heldout + synthetic.n_sft, seed=config.seed, spec=synthetic.spec()
    )
    rest, heldout = split_train_heldout(problems, synthetic.n_heldout, seed=config.seed)
    train, sft = rest[: synthetic.n_train], rest[synthetic.n_train :]
    write_problems(Path(data.train_path), train)
    if data.eval_path:
        write_problems(Path(data.eval_path), heldout)
    if data.sft_path and sft:
        solutions = mixed_solutions(sft, synthetic.sft_answer_only_share, seed=config.seed)
        write_problems(Path(data.sft_path), sft, solutions=solutions)


def run_sft(config: RunConfig, paths: RunPaths) -> int | None:
    """The warm start: SFT in the trainer process, published as the next weight version."""
    if config.pipeline.sft_steps == 0:
        return None
    store = WeightStore(paths.root)
    if store.latest() is not None:
        return store.latest()  # a restarted pipeline: the warm start (or more) is already published
    launch = TrainerLaunch(
        config_path=paths.private_config,
        log_path=paths.log("sft.log"),
        mode="sft",
        work_dir=paths.work_dir / "sft",
        metrics_file=paths.work_dir / "sft-metrics.jsonl",
    )
    supervise_trainer(launch)
    return store.latest()


def evaluate_versions(config: RunConfig, paths: RunPaths, versions: list[int]) -> dict[int, EvalResult]:
    """pass@1 of each version on the held-out split, on one vLLM server that loads each
    version in turn (through the same interruptible weight update the scheduler uses)."""
    if not config.data.eval_path or not versions:
        return {}
    prompts = load_prompts(config.data.eval_path)[: config.pipeline.eval_prompts]
    store = WeightStore(paths.root)
    first = paths.work_dir / "eval" / f"v{versions[0]}"
    if not (first / "config.json").exists():
        store.download(versions[0], first)
    codec, stop_ids = load_codec(str(first))
    server_config = RolloutServerConfig(
        model_dir=first,
        kv_cache_gib=config.rollout.kv_cache_gib,
        max_model_len=config.data.max_prompt_tokens + config.rollout.max_new_tokens,
        seed=config.seed,
        log_path=paths.log("eval-server.log"),
    )
    results: dict[int, EvalResult] = {}

    async def run_all(server: RolloutServer) -> None:
        async with RolloutClient([server.handle], initial_version=versions[0]) as client:
            with RewardPool(config.reward) as pool:
                for version in versions:
                    if version != client.current_version:
                        await client.update_weights(
                            version,
                            lambda handle, v=version: update_server_weights(
                                handle, config.storage.root, dict(config.storage.options), v,
                                cache_dir=str(paths.work_dir / "weights-cache"),
                            ),
                        )
                    results[version] = await evaluate(
                        client, version, prompts,
                        lambda record: render_prompt(record.prompt, config.data.prompt_format, codec.tokenizer),
                        codec, pool,
                        samples_per_prompt=config.pipeline.eval_samples,
                        max_new_tokens=config.rollout.max_new_tokens,
                        temperature=config.rollout.temperature,
                        stop_token_ids=stop_ids,
                    )

    with RolloutServer(server_config) as server:
        asyncio.run(run_all(server))
    return results


def register_best(
    config: RunConfig, lineage: RunLineage, train: TrainResult, results: dict[int, EvalResult]
) -> tuple[int | None, str | None]:
    """Link evaluation metrics to each LoggedModel; register the best version with the
    aliases `best` and `current` (MLflow reserves `latest`; `models:/<name>/latest`
    already names the newest registered version)."""
    eval_ref = file_ref(config.data.eval_path, Path(config.data.eval_path).name) if config.data.eval_path else None
    for version, result in results.items():
        model_id = train.logged_models.get(version)
        if model_id is not None and eval_ref is not None:
            lineage.log_evaluation(model_id, version, result.metrics(), eval_ref)
    if not results:
        return None, None
    best = max(results.values(), key=lambda r: (r.pass_at_1, r.version))
    model_id = train.logged_models.get(best.version)
    if model_id is None:
        return best.version, None
    return best.version, lineage.register(model_id, config.pipeline.registered_model, ["best", "current"])


def pipeline_run(
    config: RunConfig,
    progress: Callable[[int, int], None] | None = None,
    on_trained: Callable[[TrainResult], None] | None = None,
) -> PipelineSummary:
    """The whole pipeline as plain Python; writes `summary.json` into the run root.
    ``progress(step, total)`` is called per RL step, ``on_trained`` once RL ends."""
    started = time.monotonic()
    prepare_inputs(config)
    paths = prepare_run(config)
    run_sft(config, paths)
    lineage = RunLineage.start(config.tracking.mlflow_uri, config.tracking.experiment, config.name, public_dict(config))
    if config.pipeline.sft_steps and config.data.sft_path:
        # The warm start's own examples (RL's prompts are logged by train_run).
        lineage.log_dataset(file_ref(config.data.sft_path, Path(config.data.sft_path).name), context="sft")
    train = train_run(config, lineage=lineage, progress=progress)
    if on_trained is not None:
        on_trained(train)
    versions = sorted({min(train.logged_models, default=0), train.final_version})
    lineage = RunLineage.resume(config.tracking.mlflow_uri, train.mlflow_run_id)
    results = evaluate_versions(config, paths, versions)
    best_version, registered = register_best(config, lineage, train, results)
    before = results.get(versions[0])
    after = results.get(versions[-1])
    summary = PipelineSummary(
        run=config.name,
        steps=train.steps,
        final_version=train.final_version,
        pass_at_1_before=None if before is None else before.pass_at_1,
        pass_at_1_after=None if after is None else after.pass_at_1,
        best_version=best_version,
        registered_model=config.pipeline.registered_model if registered else None,
        registered_model_version=registered,
        wall_s=time.monotonic() - started,
        train_wall_s=train.wall_s,
        mlflow_uri=config.tracking.mlflow_uri,
        mlflow_run_id=train.mlflow_run_id,
        storage_root=paths.root.uri,
    )
    fs.put_atomic_replace(paths.root, SUMMARY_FILE, json.dumps(asdict(summary), indent=1).encode())
    return summary


def summary_markdown(summary: PipelineSummary) -> str:
    def pct(value: float | None) -> str:
        return "n/a" if value is None else f"{100 * value:.1f}%"

    return "\n".join(
        [
            f"# asyncrl run `{summary.run}`",
            "",
            "| figure | value |",
            "| --- | --- |",
            f"| held-out pass@1 before RL | {pct(summary.pass_at_1_before)} |",
            f"| held-out pass@1 after RL | {pct(summary.pass_at_1_after)} |",
            f"| steps | {summary.steps} |",
            f"| final weight version | {summary.final_version} |",
            f"| wall time | {summary.wall_s:.0f} s (RL {summary.train_wall_s:.0f} s) |",
            f"| MLflow | {summary.mlflow_uri}, run {summary.mlflow_run_id} |",
            f"| storage | {summary.storage_root} |",
        ]
    )


@flow(name="pipeline", log_prints=True)
def pipeline(config: RunConfig) -> dict[str, Any]:
    """Prepare data, optional SFT warm start, asynchronous RL, evaluation, registration."""
    logger = get_run_logger()
    progress_artifact = StepProgressArtifact(config.name, config.trainer.max_steps)

    def progress(step: int, total: int) -> None:
        logger.info("RL step %d/%d", step, total)
        progress_artifact(step, total)

    def report(train: TrainResult) -> None:
        publish_training_report(config.name, train.step_metrics, train.scheduler, train.wall_s, train.final_version)

    summary = pipeline_run(config, progress=progress, on_trained=report)
    create_markdown_artifact(
        summary_markdown(summary), key=artifact_key(config.name, "summary"), description="asyncrl run summary"
    )
    return asdict(summary)
