"""Adaptive staleness: the drift reading, the bound's rule, the gate under a moving bound,
and the controller reading each version's figures from its lineage (and going on from them
after a restart)."""

from __future__ import annotations

import asyncio
import json
import logging
import random
from pathlib import Path

import pytest
from pydantic import ValidationError

from asyncrl.configs.loading import load_config
from asyncrl.storage.fs import RunRoot, open_root
from asyncrl.storage.weight_lineage import LINEAGE_FILE
from asyncrl.storage.weights import WeightStore
from asyncrl.tasks.algo.adaptive_eta import AdaptiveEta, AdaptiveState, read_drift
from asyncrl.configs.adaptive_staleness import AdaptiveStalenessConfig
from asyncrl.tasks.scheduler.controller import RolloutController
from asyncrl.tasks.scheduler.gate_state import load_adaptive_state
from controller_settings_builder import flat_controller_settings
from asyncrl.tasks.agent.episodes import SingleTurnEpisodes
from asyncrl.tasks.algo.staleness_gate import StalenessGate

from tests.unit.scheduler.test_gate_after_rollback import FixedGenerator, NoCodec, NoScorer, PromptRecord, PromptSchedule

REPO = Path(__file__).resolve().parents[3]
BUDGET = AdaptiveStalenessConfig(max_behav_weight_p99=1.5, recover_steps=2)


def p99(**by_staleness: float) -> dict[str, float]:
    return {f"mismatch/behav_weight_p99/staleness_{s[1:]}": v for s, v in by_staleness.items()}


def test_the_tail_is_judged_over_the_staleness_the_bound_still_admits() -> None:
    metrics = {**p99(s0=9.0, s1=1.1, s3=1.7, s6=4.0), "mismatch/ess": 0.97}
    at_8 = read_drift(5, metrics, eta=8, config=BUDGET)
    assert (at_8.behav_weight_p99, at_8.staleness, at_8.over_budget) == (4.0, 6, True)
    assert "p99 4 at staleness 6 > 1.5" in at_8.reason
    at_4 = read_drift(5, metrics, eta=4, config=BUDGET)  # staleness 6 was admitted under a larger bound
    assert (at_4.behav_weight_p99, at_4.staleness, at_4.over_budget) == (1.7, 3, True)
    at_2 = read_drift(5, metrics, eta=2, config=BUDGET)  # staleness 0 is the engines' numerics, not drift
    assert (at_2.behav_weight_p99, at_2.over_budget, at_2.reason) == (1.1, False, "")
    nothing = read_drift(5, {"loss": 1.0}, eta=8, config=BUDGET)
    assert (nothing.behav_weight_p99, nothing.ess, nothing.over_budget) == (None, None, False)
    nan = read_drift(5, p99(s1=float("nan")), eta=8, config=BUDGET)
    assert nan.behav_weight_p99 is None and not nan.over_budget


def test_the_ess_budget() -> None:
    config = AdaptiveStalenessConfig(max_behav_weight_p99=None, min_ess=0.9)
    low = read_drift(1, {**p99(s1=50.0), "mismatch/ess": 0.8}, eta=4, config=config)
    assert low.over_budget and low.reason == "ESS 0.8 < 0.9"  # the tail is not judged here
    assert not read_drift(1, {"mismatch/ess": 0.95}, eta=4, config=config).over_budget
    both = AdaptiveStalenessConfig(max_behav_weight_p99=1.5, min_ess=0.9)
    assert read_drift(1, {**p99(s1=2.0), "mismatch/ess": 0.8}, eta=4, config=both).reason.count(";") == 1


def test_halve_when_over_and_one_up_after_recover_steps_under(caplog: pytest.LogCaptureFixture) -> None:
    adaptive = AdaptiveEta(BUDGET, eta_limit=8)
    over, under = p99(s1=2.0), p99(s1=1.2)
    path = []
    caplog.set_level(logging.INFO, logger="asyncrl.scheduler.adaptive")
    for version, metrics in enumerate([over, over, under, over, over, over, under, under, under, under, under], start=1):
        adaptive.observe(version, version, metrics)
        path.append(adaptive.eta)
    # at e = 0 the staleness-1 tail of version 6 is not judged (e admits no stale token):
    # it counts as under, so the bound probes e = 1 again two steps later
    assert path == [4, 2, 2, 1, 0, 0, 1, 1, 2, 2, 3]
    assert [(c.version, c.before, c.after) for c in adaptive.changes] == [
        (1, 8, 4), (2, 4, 2), (4, 2, 1), (5, 1, 0), (7, 0, 1), (9, 1, 2), (11, 2, 3),
    ]  # fmt: skip
    assert adaptive.summary() == {"effective_eta": 3.0, "effective_eta_min": 0.0, "eta_changes": 7.0, "drift_readings": 11.0}
    messages = [r.getMessage() for r in caplog.records]
    assert messages[0].startswith("effective staleness bound lowered 8 -> 4 at version 1 (behaviour-weight p99 2")
    assert messages[4] == "effective staleness bound raised 0 -> 1 at version 7 (under budget through step 7)"
    assert adaptive.observe(10, 10, over) is None and adaptive.eta == 3  # a version already read


def test_the_bound_never_leaves_min_eta_and_eta() -> None:
    adaptive = AdaptiveEta(AdaptiveStalenessConfig(min_eta=3, recover_steps=1), eta_limit=5)
    for version in range(1, 6):
        adaptive.observe(version, version, p99(s1=9.0))
    assert adaptive.eta == 3
    for version in range(6, 20):
        adaptive.observe(version, version, {})
    assert adaptive.eta == 5 and max(c.after for c in adaptive.changes) == 5
    # a restart with a smaller configured eta clamps the saved bound
    assert AdaptiveEta(BUDGET, eta_limit=2, state=AdaptiveState(eta=6, version=9, under=1)).eta == 2


def test_config_errors_name_the_field() -> None:
    with pytest.raises(ValidationError, match="set max_behav_weight_p99 or min_ess"):
        AdaptiveStalenessConfig(max_behav_weight_p99=None)
    with pytest.raises(ValidationError, match="max_behav_weight_p99"):
        AdaptiveStalenessConfig(max_behav_weight_p99=0.9)
    with pytest.raises(ValueError, match=r"rollout.adaptive_staleness.min_eta: 5 is above rollout.eta = 2"):
        load_config(REPO / "configs" / "demo.yaml", ["rollout.adaptive_staleness={min_eta: 5}"])
    config = load_config(REPO / "configs" / "demo.yaml", ["rollout.adaptive_staleness={max_behav_weight_p99: 1.3}"])
    assert config.rollout.adaptive_staleness == AdaptiveStalenessConfig(max_behav_weight_p99=1.3)


class Version:
    def __init__(self) -> None:
        self.value = 0

    def current_version(self) -> int:
        return self.value


def test_under_a_moving_bound_every_admission_keeps_the_configured_rule() -> None:
    """Random versions and bounds: each admitted group k (from 0) had floor(k / B) <= i + e
    at its admission with e <= eta, and the admitted total reached the capacity of the
    bound in force whenever admission was refused."""
    rng = random.Random(7)
    B, ETA = 3, 6
    version = Version()
    gate = StalenessGate(B, ETA, version)
    for _ in range(400):
        action = rng.random()
        if action < 0.1:
            version.value += 1
        elif action < 0.25:
            gate.set_eta(rng.randint(0, ETA))
        else:
            stats = gate.stats()
            if gate.try_admit():
                k = stats.admitted
                assert k // B <= version.value + stats.eta <= version.value + ETA
            else:
                assert stats.admitted == (version.value + stats.eta + 1) * B or stats.admitted > stats.capacity
    lowered = gate.stats()
    gate.set_eta(0)
    assert gate.stats().admitted == lowered.admitted  # lowering withdraws nothing
    assert gate.stats().eta_limit == ETA
    for bad in (-1, ETA + 1, True, 1.0):
        with pytest.raises(ValueError, match=r"effective eta must be an int in \[0, 6\]"):
            gate.set_eta(bad)  # type: ignore[arg-type]


def publish_step(root: RunRoot, tmp_path: Path, version: int, metrics: dict[str, float]) -> None:
    local = tmp_path / f"w{version}"
    local.mkdir()
    (local / "config.json").write_text("{}")
    (local / "model.safetensors").write_bytes(b"\0" * 16)
    lineage = {"version": version, "parent_version": version - 1, "step": version, "metrics": metrics}
    (local / LINEAGE_FILE).write_text(json.dumps(lineage))
    WeightStore(root).publish(version, local)


def adaptive_controller(root: RunRoot, generator: FixedGenerator, eta: int = 4) -> RolloutController:
    settings = flat_controller_settings(run_id="adaptive", batch_groups=2, eta=eta, n_samples=2, max_new_tokens=4,
                                  max_prompt_tokens=4, adaptive_staleness=BUDGET)  # fmt: skip
    prompts = PromptSchedule([PromptRecord(prompt_id="p0", prompt="Q", answer="A", solution=None)], seed=0)
    episodes = SingleTurnEpisodes(settings.sampling, lambda r: r.prompt, NoCodec(), generator, NoScorer())
    return RolloutController(settings, root, prompts, generator=generator, episodes=episodes,
                             weight_loader=lambda v: (lambda _: None))  # fmt: skip


def test_the_controller_reads_each_versions_figures_and_a_restart_goes_on_from_its_bound(tmp_path: Path) -> None:
    root = open_root(str(tmp_path / "store"))
    generator = FixedGenerator(0)
    first = adaptive_controller(root, generator)

    async def start_and_read(controller: RolloutController, latest: int) -> None:
        await controller._start_adaptive()
        await controller._read_drift(latest)

    asyncio.run(start_and_read(first, 0))
    assert first.gate.stats().eta == 4 and load_adaptive_state(root) is None  # nothing read yet
    publish_step(root, tmp_path, 1, p99(s1=1.1))
    publish_step(root, tmp_path, 2, p99(s1=1.2, s2=1.9))  # over at e = 4
    generator.current_version = 2
    asyncio.run(first._read_drift(2))
    assert first.gate.stats().eta == 2 and first.gate.stats().capacity == (2 + 2 + 1) * 2
    assert load_adaptive_state(root) == AdaptiveState(eta=2, version=2, under=0)
    assert first.stats.summary()["effective_eta"] == 2.0

    second = adaptive_controller(root, generator)  # a restarted scheduler
    asyncio.run(second._start_adaptive())
    assert second.gate.stats().eta == 2 and second.adaptive is not None and second.adaptive.version == 2
    publish_step(root, tmp_path, 3, p99(s1=1.1))
    publish_step(root, tmp_path, 4, p99(s1=1.1, s3=3.0))  # staleness 3 is beyond e = 2: not judged
    generator.current_version = 4
    second._version_changed.clear()
    asyncio.run(second._read_drift(4))
    assert second.gate.stats().eta == 3 and second._version_changed.is_set()  # raised: the gate may admit
    assert [(c.version, c.before, c.after) for c in second.adaptive.changes] == [(4, 2, 3)]
    # a configured eta below the saved bound clamps it
    third = adaptive_controller(root, generator, eta=1)
    asyncio.run(third._start_adaptive())
    assert third.gate.stats().eta == 1
