"""The rollout controller's staleness gate counts the policy in training steps, read from
each version's lineage, so a trainer rollback (labels ahead of steps) cannot open it.

The trainer of this run root published versions 0..4 as steps 0..4 and was killed; its
successor resumed from checkpoint step 1 and publishes steps 2, 3, ... as versions 5, 6, ...
With B = 2 and eta = 1 the gate had admitted (4 + 1 + 1) * 2 = 12 groups at step 4. Against
the label 5 it would admit 2 more at once, groups the resumed trainer trains only at step
6, 4 steps after their first token (sampled at step 2): dropped as stale. Against steps
it stays closed until the weights have received 5 steps again.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from asyncrl.storage.fs import RunRoot, open_root
from asyncrl.storage.weight_lineage import LINEAGE_FILE
from asyncrl.storage.weights import WeightStore
from asyncrl.tasks.data.records import PromptRecord
from asyncrl.tasks.scheduler.controller import RolloutController
from asyncrl.tasks.scheduler.gate_state import save_gate_state
from asyncrl.tasks.scheduler.group_schedule import PromptSchedule
from controller_settings_builder import flat_controller_settings
from asyncrl.tasks.agent.episodes import SingleTurnEpisodes
from asyncrl.tasks.algo.staleness_gate import GateState

B, ETA = 2, 1


class FixedGenerator:
    """Only the version the servers generate with matters to the gate."""

    def __init__(self, version: int) -> None:
        self.current_version = version

    async def generate_group(self, *args: Any, **kwargs: Any) -> list[Any]:
        raise AssertionError("nothing is generated in these tests")

    async def update_weights(self, version: int, load: Any) -> Any:
        raise AssertionError("weights are set by the test")


class NoScorer:
    async def score(self, requests: Any) -> list[Any]:
        raise AssertionError("nothing is scored in these tests")


class NoCodec:
    def encode(self, text: str) -> list[int]:
        return [1]

    def decode(self, token_ids: Any) -> str:
        return ""


def publish(root: RunRoot, tmp_path: Path, version: int, step: int, parent: int | None) -> None:
    local = tmp_path / f"w{version}"
    local.mkdir()
    (local / "config.json").write_text("{}")
    (local / "model.safetensors").write_bytes(b"\0" * 16)
    (local / LINEAGE_FILE).write_text(json.dumps({"version": version, "parent_version": parent, "step": step}))
    WeightStore(root).publish(version, local)


def controller(root: RunRoot, generator: FixedGenerator) -> RolloutController:
    settings = flat_controller_settings(run_id="gate-rollback", batch_groups=B, eta=ETA, n_samples=2, max_new_tokens=4,
                                  max_prompt_tokens=4)  # fmt: skip
    prompts = PromptSchedule([PromptRecord(prompt_id="p0", prompt="Q", answer="A", solution=None)], seed=0)
    episodes = SingleTurnEpisodes(settings.sampling, lambda r: r.prompt, NoCodec(), generator, NoScorer())
    return RolloutController(settings, root, prompts, generator=generator, episodes=episodes,
                             weight_loader=lambda v: (lambda _: None))  # fmt: skip


def test_the_gate_stays_closed_until_the_resumed_trainer_catches_up(tmp_path: Path) -> None:
    root = open_root(str(tmp_path / "store"))
    for version in range(5):  # the killed trainer: label = step
        publish(root, tmp_path, version, version, version - 1 if version else None)
    save_gate_state(root, GateState(admitted=(4 + ETA + 1) * B, batch_groups=B, eta=ETA))
    generator = FixedGenerator(4)
    gate = controller(root, generator).gate
    assert gate.stats().version == 4 and not gate.try_admit()

    label = 4
    for step in (2, 3, 4):  # the resumed trainer, from checkpoint step 1
        label += 1
        publish(root, tmp_path, label, step, label - 1)
        generator.current_version = label
        stats = gate.stats()
        assert (stats.version, stats.capacity) == (step, (step + ETA + 1) * B)
        assert not gate.try_admit(), f"admitted at label {label}, step {step}"

    publish(root, tmp_path, label + 1, 5, label)
    generator.current_version = label + 1
    assert gate.try_admit() and gate.try_admit() and not gate.try_admit()  # step 5: (5 + 2) * 2 = 14
    assert gate.stats().admitted == 14


def test_without_lineage_the_label_is_the_step_count(tmp_path: Path) -> None:
    """Weights published without a lineage file (benchmarks, the controller's own tests)
    count as many steps as their label: the gate behaves as before."""
    root = open_root(str(tmp_path / "store"))
    gate = controller(root, FixedGenerator(3)).gate
    assert gate.stats().capacity == (3 + ETA + 1) * B
