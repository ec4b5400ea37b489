"""The evaluator on the real stack (tiny model, its own vLLM server, a real reward pool),
under the run's supervisor, against a run root whose weight versions this test publishes:
it evaluates exactly the multiples of K it finds published (the newest when it fell behind,
loaded in place; the others skipped and listed), writes one record each, resumes after its
last record when SIGKILLed and restarted (evaluating nothing twice), and ends on its own
once the last step is published and every multiple up to it is decided. (The resume rule
itself, without vLLM: test_resume.py.)"""

from __future__ import annotations

import json
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from process_scan import processes_with_env, wait_gone

from asyncrl.configs.run_config import RunConfig
from asyncrl.storage.evaluations import EvaluationStore, EvaluatorState
from asyncrl.storage.weight_lineage import LINEAGE_FILE
from asyncrl.storage.weights import WeightStore
from asyncrl.tasks.data.synthetic import write_synthetic_splits
from asyncrl.tasks.launch.components import evaluator_component, sigkill_group
from asyncrl.tasks.launch.context import prepare_run
from asyncrl.tasks.launch.supervisor import ComponentOutcome, ComponentStatus, RestartPolicy, supervise

pytestmark = pytest.mark.slow

MARKER = "ASYNCRL_RUN_TEST_MARKER"  # tests/conftest.py: process_marker
EVERY, LAST_STEP = 2, 7


def evaluator_config(tmp_path: Path, model_dir: Path) -> RunConfig:
    splits = write_synthetic_splits(tmp_path / "data", n_train=8, n_heldout=6, seed=0)
    return RunConfig.model_validate({
        "name": "evaluator-live",
        "work_dir": str(tmp_path / "work"),
        "model": {"path": str(model_dir)},
        "data": {"train_path": str(splits["train"]), "eval_path": str(splits["heldout"]), "max_prompt_tokens": 64},
        "rollout": {"max_new_tokens": 16},
        "trainer": {"max_steps": LAST_STEP, "micro_batch_tokens": 256},
        "reward": {"pool": {"workers": 1}},
        # nice 0: this test checks what is evaluated, not who gets the CPU (a loaded test machine
        # starved a nice 10 server for minutes)
        "pipeline": {"eval_every": EVERY, "training_eval": {"prompts": 4, "samples": 2, "nice": 0}},
        "storage": {"root": str(tmp_path / "store")},
    })  # fmt: skip


class Publisher:
    """Publishes the tiny model as weight version v of training step v."""

    def __init__(self, store: WeightStore, model_dir: Path, scratch: Path) -> None:
        self.store, self.model_dir, self.scratch = store, model_dir, scratch

    def __call__(self, *versions: int) -> None:
        for version in versions:
            local = self.scratch / f"v{version}"
            shutil.copytree(self.model_dir, local)
            (local / LINEAGE_FILE).write_text(json.dumps({"version": version, "step": version, "shards": []}))
            self.store.publish(version, local)


def wait_until(condition: Callable[[], bool], what: str, log: Path, timeout_s: float = 420.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s:.0f} s: {what}; evaluator log:\n{log.read_text()[-4000:]}")
        time.sleep(0.2)


def test_the_evaluator_takes_each_published_multiple_once_and_resumes_after_a_kill(
    tiny_model_dir: Path, tmp_path: Path, process_marker: str
) -> None:
    config = evaluator_config(tmp_path, tiny_model_dir)
    paths = prepare_run(config)
    publish = Publisher(WeightStore(paths.root), tiny_model_dir, tmp_path / "published")
    records = EvaluationStore(paths.root)
    component = evaluator_component(config, paths)
    status = ComponentStatus(component.name)
    outcome: list[ComponentOutcome | BaseException] = []
    stop = threading.Event()
    policy = RestartPolicy(max_restarts=1, backoff_s=3.0, start_timeout_s=60.0, poll_s=0.2)

    def run() -> None:
        try:
            outcome.append(supervise(component, stop, policy, status=status))
        except BaseException as exc:  # noqa: BLE001 - the test reads it
            outcome.append(exc)

    publish(0)
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    log = component.log_path
    try:
        state = records.state
        wait_until(lambda: (state() or EvaluatorState(EVERY)).current == 0, "version 0 taken", log)
        publish(1, 2, 3, 4, 5, 6)  # while its server starts: it falls behind, takes 6 next, skips 2 and 4
        wait_until(lambda: records.read(6) is not None, "a record of version 6", log)
        sigkill_group(status.pgid)  # its server goes with it (parent-death signal)
        publish(7)  # the last step: the restarted evaluator has nothing left to evaluate
        thread.join(timeout=300)
    finally:
        stop.set()
        thread.join(timeout=60)

    text = log.read_text()
    assert outcome and isinstance(outcome[0], ComponentOutcome), f"{outcome}\n{text[-4000:]}"
    assert outcome[0].end == "finished" and outcome[0].restarts == 1
    assert records.versions() == [0, 6]
    assert records.read(6)["skipped"] == [2, 4] and records.read(0)["skipped"] == []
    first = records.read(0)
    assert (first["prompts"], first["samples_per_prompt"]) == (4, 2) and 0.0 <= first["pass_at_1"] <= 1.0
    assert "pass_at_1/math" in first["by_task"]
    assert records.state() == EvaluatorState(every=EVERY, done=6, current=None)
    assert "skipping versions [2, 4]" in text and "weight version 6 on 1 servers" in text  # loaded in place
    assert "resuming after version 6" in text and "every version up to it is decided: done" in text
    for version in (0, 6):
        assert text.count(f"version {version}: held-out pass@1") == 1, text[-4000:]
    left = wait_gone(processes_with_env(MARKER, process_marker), timeout_s=30.0)
    assert not left, f"processes left behind: {[p.cmdline[:120] for p in left]}"
