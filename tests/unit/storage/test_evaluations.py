"""The run root's ``evaluations/``: a record per version written once, the evaluator's
state, and which versions it still needs (what weight retention keeps for it)."""

from __future__ import annotations

from pathlib import Path

import pytest

from asyncrl.storage import fs, paths
from asyncrl.storage.evaluations import EvaluationStore, EvaluatorState
from asyncrl.storage.fs import open_root


def test_records_are_written_once_and_read_back_by_version(tmp_path: Path) -> None:
    store = EvaluationStore(open_root(str(tmp_path / "run")))
    assert store.versions() == [] and store.records_after(-1) == {} and store.state() is None
    assert store.write(10, {"version": 10, "pass_at_1": 0.5})
    assert store.write(0, {"version": 0, "pass_at_1": 0.25})
    assert not store.write(10, {"version": 10, "pass_at_1": 0.75})  # never twice: the first stays
    assert store.read(10) == {"version": 10, "pass_at_1": 0.5} and store.read(5) is None
    assert store.versions() == [0, 10]
    assert store.records_after(0) == {10: {"version": 10, "pass_at_1": 0.5}}
    assert paths.evaluation_record(10) == "evaluations/v000010.json"
    assert paths.parse_evaluation_record_name("v000010.json") == 10
    assert paths.parse_evaluation_record_name("state.json") is None


def test_the_state_round_trips_and_a_broken_one_is_named(tmp_path: Path) -> None:
    root = open_root(str(tmp_path / "run"))
    store = EvaluationStore(root)
    store.set_state(EvaluatorState(every=5, done=10, current=15))
    assert store.state() == EvaluatorState(5, 10, 15)
    fs.put_atomic_replace(root, paths.EVALUATIONS_STATE, b'{"every": 0, "done": 3}')
    with pytest.raises(ValueError, match=r"evaluations/state.json: evaluator state: every must be an int >= 1"):
        store.state()


def test_the_versions_the_evaluator_still_needs() -> None:
    # the one in evaluation, and the newest multiple above the last record (its next pick)
    assert EvaluatorState(5, done=10, current=15).needed(latest=23) == {15, 20}
    assert EvaluatorState(5, done=20, current=None).needed(latest=23) == set()
    assert EvaluatorState(5, done=-1).needed(latest=3) == {0}
    assert EvaluatorState(1, done=4).needed(latest=7) == {7}
