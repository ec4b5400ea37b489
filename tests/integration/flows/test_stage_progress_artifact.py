"""A pipeline stage's progress reaches the Prefect UI: the flow layer mirrors the stage's
``progress.json`` entry (written by the Prefect-free StageProgress) into the progress artifact
``<run>-<stage>-progress``, while the stage runs and at its end."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from asyncrl.flows.prefect_api.artifacts import stage_progress_artifact
from asyncrl.tasks.pipeline.progress import StageProgress, read_progress


def _artifact(key: str) -> Any:  # noqa: ANN401 - a prefect Artifact
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    with get_client(sync_client=True) as client:
        found = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key])))
    return found[0] if found else None


def test_a_stage_s_progress_is_mirrored_into_its_artifact(prefect_server: None, tmp_path: Path) -> None:
    from prefect import flow, task

    seen: list[float] = []

    @task(name="counting-stage")
    def counting_stage(work_dir: Path) -> None:
        with stage_progress_artifact(work_dir, "Mirror Run", "count", every_s=0.05):
            progress = StageProgress(work_dir, "count", 4, "items")
            for done in range(1, 4):
                progress.update(done)
                deadline = time.monotonic() + 10
                while time.monotonic() < deadline:  # the mirror shows each value while the stage runs
                    shown = _artifact("mirror-run-count-progress")
                    if shown is not None and shown.data == 25.0 * done:
                        seen.append(shown.data)
                        break
                    time.sleep(0.05)
            progress.finish("all counted")

    @flow(name="mirror-flow")
    def mirror_flow(work_dir: Path) -> None:
        counting_stage(work_dir)

    mirror_flow(tmp_path)
    assert seen == [25.0, 50.0, 75.0]
    final = _artifact("mirror-run-count-progress")
    assert final.type == "progress" and final.data == 100.0
    assert read_progress(tmp_path)["count"].state == "done"


def test_stage_progress_needs_no_prefect_run(tmp_path: Path) -> None:
    progress = StageProgress(tmp_path, "sft", 0, "steps")  # total 0 counts as 1: no division by zero
    progress.update(1, "one step")
    state = read_progress(tmp_path)["sft"]
    assert (state.done, state.total, state.unit, state.detail, state.percent) == (1, 1, "steps", "one step", 100.0)


@pytest.mark.parametrize("done, total, percent", [(0, 4, 0.0), (3, 4, 75.0), (9, 4, 100.0)])
def test_percent_is_capped_at_100(tmp_path: Path, done: int, total: int, percent: float) -> None:
    StageProgress(tmp_path, "evaluate", total, "prompts").update(done)
    assert read_progress(tmp_path)["evaluate"].percent == percent
