"""The evaluator's bookkeeping without vLLM: a start resumes after the newest record and
announces itself in the state; picks move forward only, skipping what it fell behind on and
what is no longer published (listed in the next record); it is done once the last step is
published and nothing is left; a stop ends its wait."""

from __future__ import annotations

import json
import threading
from pathlib import Path

from asyncrl.configs.processes import EvaluatorProcessConfig, process_configs
from asyncrl.configs.run_config import RunConfig
from asyncrl.storage.evaluations import EvaluationStore, EvaluatorState
from asyncrl.storage.weight_lineage import LINEAGE_FILE
from asyncrl.storage.weights import WeightStore
from asyncrl.tasks.evaluator.loop import Evaluator
from asyncrl.tasks.system.run_paths import run_paths
from asyncrl.storage.evaluations import EvalResult


def config(tmp_path: Path, every: int, max_steps: int) -> EvaluatorProcessConfig:
    return process_configs(RunConfig.model_validate({
        "work_dir": str(tmp_path / "work"),
        "model": {"path": str(tmp_path / "model")},
        "data": {"train_path": str(tmp_path / "train.parquet"), "eval_path": str(tmp_path / "heldout.parquet")},
        "trainer": {"max_steps": max_steps},
        "pipeline": {"eval_every": every},
        "storage": {"root": str(tmp_path / "store")},
    })).evaluator  # fmt: skip


def publish(store: WeightStore, tmp_path: Path, *versions: int) -> None:
    for version in versions:
        local = tmp_path / "local" / f"v{version}"
        local.mkdir(parents=True)
        (local / "config.json").write_text("{}")
        (local / "model.safetensors").write_bytes(b"not really tensors")
        (local / LINEAGE_FILE).write_text(json.dumps({"version": version, "step": version, "shards": []}))
        store.publish(version, local)


def test_a_start_resumes_after_the_newest_record_and_moves_forward_only(tmp_path: Path) -> None:
    run = config(tmp_path, every=3, max_steps=10)
    paths = run_paths(run)
    records = EvaluationStore(paths.root)
    records.write(0, {"version": 0})
    records.write(3, {"version": 3})
    weights = WeightStore(paths.root)
    publish(weights, tmp_path, *range(8))
    weights.prune(keep_latest=1, referenced=[0, 3, 4])  # 6 is gone before the evaluator gets to it

    evaluator = Evaluator(run, paths, threading.Event(), poll_s=0.02)
    assert evaluator.after == 3 and records.state() == EvaluatorState(every=3, done=3)
    later = threading.Timer(0.3, publish, (weights, tmp_path, 8, 9))
    later.start()
    assert evaluator.next_version() == 9  # 6 skipped (pruned), then it waits for the next multiple
    later.join()
    assert records.state() == EvaluatorState(every=3, done=3, current=9)
    evaluator._record(EvalResult(9, 0.5, 4, 2, 10.0), seconds=1.5)
    assert records.read(9)["skipped"] == [6] and records.read(9)["pass_at_1"] == 0.5
    assert records.state() == EvaluatorState(every=3, done=9)

    publish(weights, tmp_path, 10)  # the last step: no multiple of 3 above 9 up to it
    assert evaluator.next_version() is None
    assert records.versions() == [0, 3, 9]

    restarted = Evaluator(run, paths, threading.Event(), poll_s=0.02)
    assert restarted.after == 9 and restarted.next_version() is None  # nothing evaluated twice


def test_version_0_is_the_models_own_weights_without_a_published_one_and_a_stop_ends_the_wait(
    tmp_path: Path,
) -> None:
    run = config(tmp_path, every=2, max_steps=4)
    Path(run.model.path).mkdir()
    (Path(run.model.path) / "config.json").write_text("{}")
    paths = run_paths(run)
    stop = threading.Event()
    evaluator = Evaluator(run, paths, stop, poll_s=0.02)
    assert evaluator.next_version() == 0 and evaluator.model_dir(0) == Path(run.model.path)
    threading.Timer(0.2, stop.set).start()
    assert evaluator.next_version() is None and stop.is_set()
