"""The pipeline's batch stages as plain functions (the `pipeline` flow wraps each in a cached
task run): prepare the data, write the tiny model, SFT warm start, evaluate versions,
register the best. Each stage's cache key (:func:`stage_key` inputs) and the check that its
outputs are still there live beside it, so a key and what it stands for cannot drift apart.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from asyncrl.configs.loading import ConfigError
from asyncrl.configs.processes import process_configs
from asyncrl.configs.run_config import RunConfig
from asyncrl.storage import fs, paths
from asyncrl.storage.weight_lineage import LINEAGE_FILE
from asyncrl.storage.weights import WeightStore
from asyncrl.tasks.data.loader import dataset_files, load_prompts
from asyncrl.tasks.data.records import DatasetError
from asyncrl.tasks.data.prepared_stamp import file_state, write_stamp
from asyncrl.tasks.placement.launch_settings import server_config, server_start_dir, trainer_launch
from asyncrl.tasks.system.run_paths import RunPaths
from asyncrl.storage.evaluations import EvalResult
from asyncrl.tasks.evaluator.held_out import held_out_task
from asyncrl.tasks.launch.components import trainer_component
from asyncrl.tasks.pipeline.progress import StageProgress
from asyncrl.tasks.launch.supervisor import RestartPolicy, supervise
from asyncrl.tasks.pipeline.stage_cache import content_digest, stage_key
from asyncrl.tasks.trainer.metrics import read_jsonl_metrics
from asyncrl.tasks.trainer.process import TrainerLaunch

LOG = logging.getLogger("asyncrl.pipeline")

SFT_RECORD = "stages/sft.json"
"""In the run root: the identity of the warm start its weights came from (its key without the
code version), and their version."""


# ----- prepare-data -----

DATA_FIELDS = ("train_path", "eval_path", "sft_path")


def data_paths(config: RunConfig) -> dict[str, str]:
    """The run's data files by their ``data.*`` key; for a folder ``data.train_path``, the files
    the run chose from it (:mod:`asyncrl.tasks.pipeline.train_data`) as ``data.train_path[i]``."""
    found = {f"data.{field}": path for field in DATA_FIELDS if (path := getattr(config.data, field))}
    if config.data.train_folder:
        from asyncrl.tasks.data.train_files import train_files
        from asyncrl.tasks.system.run_paths import run_paths

        del found["data.train_path"]
        chosen = train_files(config.data, run_paths(config).root) or ()
        found = {**{f"data.train_path[{i}]": file.uri for i, file in enumerate(chosen)}, **found}
    return found


def data_files(config: RunConfig) -> list[str]:
    return list(data_paths(config).values())


def synthetic_settings(config: RunConfig) -> dict[str, Any] | None:
    """What synthetic files are written for (their stamp, :mod:`asyncrl.tasks.data.prepared_stamp`):
    the generator's settings and the seed; None for a user's own files."""
    synthetic = config.pipeline.synthetic_data
    return None if synthetic is None else {"synthetic": synthetic.model_dump(mode="json"), "seed": config.seed}


def data_key(config: RunConfig) -> str:
    """Synthetic data: the generator's settings and seed (the files are its output); a
    user's files: their content."""
    settings = synthetic_settings(config)
    if settings is not None:
        return stage_key("prepare-data", {**settings, "files": data_files(config)}, [])
    return stage_key("prepare-data", {"files": data_files(config)}, data_files(config))


def data_present(config: RunConfig) -> bool:
    """Every data file is there and, for synthetic data, written for this config's settings."""
    settings = synthetic_settings(config)
    if settings is None:
        return all(content_digest(path) != "absent" for path in data_files(config))
    return all(file_state(Path(path), settings).state == "current" for path in data_files(config))


def synthetic_files_to_write(config: RunConfig, settings: dict[str, Any]) -> bool:
    """Whether the synthetic files must be (re)written: one is absent or was written for other
    settings (logged, naming them). A file there that the generator did not write, or that was
    changed since, is never replaced: :class:`ConfigError` names its key."""
    states = {key: file_state(Path(path), settings) for key, path in data_paths(config).items()}
    for key, found in states.items():
        if found.state == "foreign":
            raise ConfigError(
                f"{key}: {data_paths(config)[key]} is there, but {found.detail}; pipeline.synthetic_data "
                f"would replace it: delete it to have it written for this config, point {key} elsewhere, "
                "or remove pipeline.synthetic_data to train on the file as it is"
            )
        if found.state == "stale":
            LOG.warning("%s: %s was %s: writing it again", key, data_paths(config)[key], found.detail)
    return any(found.state != "current" for found in states.values())


def prepare_data(config: RunConfig) -> dict[str, str]:
    """Write the synthetic task (``pipeline.synthetic_data.task``: arithmetic, code or tool) where
    the config asks for it and its files are absent or were written for other settings (a
    user's own files are never touched), check the prompt files load, and return each data
    file's content digest (what the later stages' keys are built from)."""
    settings = synthetic_settings(config)
    if settings is not None and synthetic_files_to_write(config, settings):
        synthetic = config.pipeline.synthetic_data
        assert synthetic is not None
        for path in data_files(config):
            write_stamp(Path(path), settings, pending=True)
        data = config.data
        splits = {  # where and how many of each split, for the tool and code writers
            "train_path": Path(data.train_path),
            "heldout_path": Path(data.eval_path) if data.eval_path else None,
            "sft_path": Path(data.sft_path) if data.sft_path else None,
            "n_train": synthetic.n_train,
            "n_heldout": synthetic.n_heldout,
            "n_sft": synthetic.n_sft,
            "seed": config.seed,
        }
        if synthetic.task == "tool":
            from asyncrl.tasks.data.synthetic_tool import write_calc_splits

            # The tools the episode offers the model (checked by the run config when demonstrations are asked for).
            episode = config.rollout.episode
            tools = episode.options.get("tools", []) if episode is not None else []
            write_calc_splits(**splits, tool_share=synthetic.sft_tool_share, tools=tools)
        elif synthetic.task == "code":
            from asyncrl.tasks.data.synthetic_code import write_code_splits

            # One draw of distinct problems, shuffled and cut as for arithmetic below.
            write_code_splits(**splits, spec=synthetic.code_spec(), sft_styles=synthetic.sft_styles)
        else:
            from asyncrl.tasks.data.synthetic import make_arithmetic_dataset, mixed_solutions, split_train_heldout, write_problems

            # One draw of distinct problems, shuffled and cut: held-out, RL prompts, warm-start set
            # (no problem in two splits, all three from the same distribution).
            spec = synthetic.spec()
            problems = make_arithmetic_dataset(
                synthetic.n_train + synthetic.n_heldout + synthetic.n_sft, seed=config.seed, spec=spec
            )
            rest, heldout = split_train_heldout(problems, synthetic.n_heldout, seed=config.seed)
            train, sft = rest[: synthetic.n_train], rest[synthetic.n_train :]
            write_problems(Path(data.train_path), train, style=spec.solution_style)
            if data.eval_path:
                write_problems(Path(data.eval_path), heldout, style=spec.solution_style)
            if data.sft_path and sft:
                solutions = mixed_solutions(sft, synthetic.sft_answer_only_share, seed=config.seed, style=spec.solution_style)
                write_problems(Path(data.sft_path), sft, solutions=solutions)
        for path in data_files(config):
            if Path(path).exists():
                write_stamp(Path(path), settings)
    progress = StageProgress(config.run_work_dir, "prepare-data", len(data_files(config)), "files")
    rows = 0
    for index, (key, path) in enumerate(data_paths(config).items(), start=1):
        try:
            rows += len(load_prompts(path))  # a malformed file fails here, naming file, row and field
        except DatasetError as exc:
            raise DatasetError(f"{key}: {exc}") from None
        progress.update(index, f"{rows} rows")
    progress.finish(f"{rows} rows in {len(data_files(config))} files")
    return {path: content_digest(path) for path in data_files(config)}


# ----- init-model -----

def model_key(config: RunConfig) -> str:
    return stage_key("init-model", {"seed": config.seed, "path": config.model.path}, [])


def model_present(config: RunConfig) -> bool:
    return (Path(config.model.path) / "config.json").exists()


def init_model(config: RunConfig) -> str:
    """Write the tiny Qwen2 model at ``model.path`` unless one is there; its content digest."""
    progress = StageProgress(config.run_work_dir, "init-model", 1, "model")
    present = model_present(config)
    if not present:
        from asyncrl.tasks.model.tiny import write_tiny_model

        write_tiny_model(Path(config.model.path), seed=config.seed)
    progress.finish(f"{'found' if present else 'wrote'} {config.model.path}")
    return content_digest(config.model.path)


def prepare_inputs(config: RunConfig) -> None:
    """The model (when ``pipeline.init_tiny_model``) and data stages outside the pipeline
    (benchmarks, deployments' tests): same functions, no cache."""
    if config.pipeline.init_tiny_model:
        init_model(config)
    prepare_data(config)


# ----- sft -----

def sft_key(config: RunConfig, with_code: bool = True) -> str:
    """The warm start's settings, the model it starts from and its examples (by content);
    without ``with_code``, its identity in the run root (a code upgrade keeps a run's warm
    start)."""
    settings = {
        "steps": config.pipeline.sft_steps,
        "batch_size": config.pipeline.sft_batch_size,
        "optimizer": (config.pipeline.sft_optimizer or config.trainer.optimizer).model_dump(mode="json"),
        "micro_batch_tokens": config.trainer.micro_batch_tokens,
        "zero_stage": config.trainer.zero_stage,
        "prompt_format": config.data.prompt_format,
        "seed": config.seed,
        "root": config.storage.root,
    }
    return stage_key("sft", settings, [config.model.path, config.data.sft_path or config.data.train_path], with_code)


def read_sft_record(run_paths: RunPaths) -> dict[str, Any] | None:
    return fs.read_json_object(run_paths.root, SFT_RECORD)


def sft_present(config: RunConfig, run_paths: RunPaths) -> bool:
    """The run root holds the weights of this warm start."""
    record = read_sft_record(run_paths)
    return (
        record is not None
        and record.get("identity") == sft_key(config, with_code=False)
        and record.get("version") in WeightStore(run_paths.root).list_versions()
    )


def run_sft(config: RunConfig, run_paths: RunPaths) -> int:
    """The warm start: SFT in the trainer process, published as the run root's first weight
    version and recorded with its key. A run root that already holds weights of another
    warm start (or of RL without one) is refused: its RL steps were trained from those."""
    identity = sft_key(config, with_code=False)
    store = WeightStore(run_paths.root)
    record = read_sft_record(run_paths)
    if sft_present(config, run_paths):
        version = int(record["version"])  # type: ignore[index] - present means recorded
        progress = StageProgress(run_paths.work_dir, "sft", 1, "stage")
        progress.finish(f"the run root holds this warm start as weight version {version}")
        return version
    if store.latest() is not None:
        was = "another warm start" if record is not None else "a run without this warm start"
        raise ValueError(
            f"{run_paths.root.display('weights')}: holds weight versions {store.list_versions()} from {was}; "
            f"this config's SFT stage (pipeline.sft_*, its data or model) differs: set a new storage.root "
            "to redo SFT and RL, or run the config this run root was started with"
        )
    launch = trainer_launch(config, run_paths, mode="sft")
    launch.metrics_file.unlink(missing_ok=True)  # type: ignore[union-attr] - set just above
    progress = StageProgress(run_paths.work_dir, "sft", config.pipeline.sft_steps, "steps")
    run_with_metrics(launch, lambda step, m: progress.update(step, f"loss {m.get('sft_loss', m.get('loss', 0.0)):.4f}"))
    version = store.latest()
    if version is None:
        raise RuntimeError(f"the SFT trainer exited 0 but published no weights; see {launch.log_path}")
    fs.put_atomic_replace(run_paths.root, SFT_RECORD, json.dumps({"identity": identity, "version": version}).encode())
    progress.finish(f"published as weight version {version}")
    return version


def run_with_metrics(launch: TrainerLaunch, on_step: Any, poll_s: float = 1.0) -> None:  # noqa: ANN401 - callback
    """Run the trainer process to its end under the one supervisor (no restart: a failed stage
    is retried as a whole, by its Prefect task) while following its metrics file:
    ``on_step(step, metrics)`` per new line. A failure raises
    :class:`~asyncrl.tasks.launch.supervisor.ComponentFailed` here, with the log's last lines;
    the process group is always killed."""
    stop = threading.Event()
    errors: list[BaseException] = []
    policy = RestartPolicy(max_restarts=0)

    def run() -> None:
        try:
            supervise(trainer_component(launch), stop, policy)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            errors.append(exc)

    thread = threading.Thread(target=run, name="asyncrl-trainer", daemon=True)
    thread.start()
    seen = 0
    try:
        while thread.is_alive():
            thread.join(poll_s)
            records = read_jsonl_metrics(launch.metrics_file) if launch.metrics_file and launch.metrics_file.exists() else []
            for record in records[seen:]:
                on_step(int(record.get("step", 0) or 0), {k: float(v) for k, v in record.items() if isinstance(v, (int, float))})
            seen = len(records)
    finally:
        stop.set()
        thread.join()
    if errors:
        raise errors[0]


# ----- evaluate -----

def evaluation_key(config: RunConfig, run_paths: RunPaths, versions: list[int]) -> str:
    """The evaluation settings, the held-out file's content and each version's identity:
    weight versions are written once and never changed, so (run root, version, its lineage
    file) names their content without hashing gigabytes of weights."""
    settings = {
        "samples": config.pipeline.eval_samples,
        "prompts": config.pipeline.eval_prompts,
        "max_new_tokens": config.rollout.max_new_tokens,
        "temperature": config.rollout.temperature,
        "prompt_format": config.data.prompt_format,
        "seed": config.seed,
        "pass_k": config.tracking.pass_k,
        "versions": {
            str(v): _lineage_digest(run_paths, v) for v in versions
        },
        "root": config.storage.root,
    }
    return stage_key("evaluate", settings, dataset_files(config.data.eval_path) if config.data.eval_path else [])


def _lineage_digest(run_paths: RunPaths, version: int) -> str:
    from hashlib import sha256

    try:
        return sha256(fs.read_bytes(run_paths.root, paths.weights_file(version, LINEAGE_FILE))).hexdigest()[:16]
    except FileNotFoundError:
        return "absent"


def evaluate_versions(config: RunConfig, run_paths: RunPaths, versions: list[int]) -> dict[int, EvalResult]:
    """pass@1 of each version on the held-out split, on one vLLM server that loads each
    version in turn (through the same interruptible weight update the scheduler uses)."""
    return evaluate_runs([(config, run_paths, versions)])[0]


def evaluate_runs(runs: list[tuple[RunConfig, RunPaths, list[int]]]) -> list[dict[int, EvalResult]]:
    """:func:`evaluate_versions` of several runs of one model and held-out set (a benchmark's
    arms) on one vLLM server, started once: each run's first version is loaded into it
    directly, the rest through the weight update. Runs that differ in what the server or the
    evaluation is made of (model, LoRA, sequence length, held-out set and its sampling) are
    refused, naming the field."""
    from asyncrl.tasks.reward.pool import RewardPool
    from asyncrl.tasks.inference.client import RolloutClient
    from asyncrl.tasks.inference.server import RolloutServer
    from asyncrl.tasks.inference.weight_loader import ServerWeightLoader

    results: list[dict[int, EvalResult]] = [{} for _ in runs]
    todo = [(i, config, paths, versions) for i, (config, paths, versions) in enumerate(runs) if config.data.eval_path and versions]
    if not todo:
        return results
    _, config, run_paths, versions = todo[0]
    for _, other, _, _ in todo[1:]:
        for field, mine, theirs in (
            ("model.path", config.model.path, other.model.path), ("trainer.lora", config.trainer.lora, other.trainer.lora),
            ("longest_sequence", config.longest_sequence, other.longest_sequence),
            ("data.eval_path", config.data.eval_path, other.data.eval_path),
            ("pipeline.eval_prompts", config.pipeline.eval_prompts, other.pipeline.eval_prompts),
            ("pipeline.eval_samples", config.pipeline.eval_samples, other.pipeline.eval_samples),
            ("data.prompt_format", config.data.prompt_format, other.data.prompt_format),
            ("rollout.max_new_tokens", config.rollout.max_new_tokens, other.rollout.max_new_tokens),
            ("rollout.temperature", config.rollout.temperature, other.rollout.temperature),
            ("rollout.episode", config.rollout.episode, other.rollout.episode),
        ):  # fmt: skip
            if mine != theirs:
                raise ValueError(f"{field}: runs evaluated on one server must agree ({other.name!r} differs from {config.name!r})")
    # A cache of its own: the loads below prune "weights-cache" under the server started from it.
    first = server_start_dir(config, run_paths, versions[0], run_paths.work_dir / "eval-weights-cache")
    adapters = config.trainer.lora is not None  # a LoRA run: the server starts on the base, loads each version
    evaluator = process_configs(config).evaluator  # the prompts and sampling the evaluator uses
    task = held_out_task(evaluator, first, config.pipeline.eval_prompts, config.pipeline.eval_samples)
    # Rollout server 0's devices, dtype and parallelism, on a port of its own.
    eval_server = replace(server_config(config, run_paths, first, 0), port=0, log_path=run_paths.log("eval-server.log"))
    total_versions = sum(len(v) for _, _, _, v in todo)
    progress = StageProgress(run_paths.work_dir, "evaluate", len(task.prompts) * total_versions, "prompts")
    done = [0]

    def prompt_done() -> None:
        done[0] += 1
        progress.update(done[0], f"{total_versions} version(s)")

    async def run_all(server: RolloutServer) -> None:
        with RewardPool(config.reward) as pool:
            for position, (index, run, paths, chosen) in enumerate(todo):
                cache = str(paths.work_dir / "weights-cache")
                with ServerWeightLoader(run.storage.root, run.storage.options, cache, adapters=adapters) as loader:
                    if adapters or position > 0:  # the server holds the first run's first version, or the base
                        await asyncio.to_thread(loader.load, server.handle, chosen[0])
                    async with RolloutClient([server.handle], initial_version=chosen[0], adapters=adapters) as client:
                        for version in chosen:
                            if version != client.current_version:
                                await client.update_weights(version, loader.for_version(version))
                            results[index][version] = await task.run(client, version, pool, on_prompt_done=prompt_done)

    with RolloutServer(eval_server) as server:
        asyncio.run(run_all(server))
    progress.finish("; ".join(
        ", ".join(f"v{v} pass@1 {100 * r.pass_at_1:.1f}%" for v, r in sorted(results[index].items())) for index, *_ in todo
    ))  # fmt: skip
    return results


def eval_results_to_json(results: dict[int, EvalResult]) -> dict[str, dict[str, Any]]:
    return {str(v): asdict(r) for v, r in results.items()}


def eval_results_from_json(raw: dict[str, dict[str, Any]]) -> dict[int, EvalResult]:
    return {int(v): EvalResult.from_json(r) for v, r in raw.items()}
