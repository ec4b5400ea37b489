"""The mismatch canary's check, its once-per-crossing rule, its config and its Prefect event
(the real-engine case, a broken weight sync, is in tests/integration/trainer/test_mismatch_metrics.py)."""

from __future__ import annotations

import logging
from typing import Any

import prefect
import prefect.events
import pytest
from pydantic import ValidationError

from asyncrl.configs.tracking import TrackingConfig
from asyncrl.tasks.launch.canary import EVENT, CanaryAlarm, MismatchCanary, mismatch_crossings
from asyncrl.flows.prefect_api.events import prefect_alarm
from asyncrl.configs.canary import MismatchCanaryConfig

HEALTHY = {"mismatch/current_version_tokens": 500.0, "mismatch/abs_logp_diff_mean": 0.004,
           "mismatch/k3_kl": 2e-4, "mismatch/ratio_outside_frac": 0.001}  # fmt: skip
BROKEN = {"mismatch/current_version_tokens": 500.0, "mismatch/abs_logp_diff_mean": 0.4,
          "mismatch/k3_kl": 0.16, "mismatch/ratio_outside_frac": 0.004}  # fmt: skip


def test_crossings_name_each_figure_over_its_threshold() -> None:
    config = MismatchCanaryConfig()
    assert mismatch_crossings(HEALTHY, config) == {}
    assert mismatch_crossings(BROKEN, config) == {
        "mismatch/abs_logp_diff_mean": (0.4, 0.1),
        "mismatch/k3_kl": (0.16, 0.02),
    }
    at_threshold = {**HEALTHY, "mismatch/k3_kl": 0.02}
    assert mismatch_crossings(at_threshold, config) == {}  # strictly above


def test_steps_that_cannot_be_judged_are_skipped() -> None:
    config = MismatchCanaryConfig(min_tokens=100)
    assert mismatch_crossings({**BROKEN, "mismatch/current_version_tokens": 99.0}, config) is None
    assert mismatch_crossings({"reward_mean": 0.5}, config) is None  # standard objective: no figures
    nan = {**HEALTHY, "mismatch/k3_kl": float("nan")}
    assert mismatch_crossings(nan, config) == {}


def test_a_threshold_set_to_none_is_off() -> None:
    config = MismatchCanaryConfig(abs_logp_diff_mean=None, k3_kl=None)
    assert set(config.thresholds()) == {"mismatch/ratio_outside_frac"}
    assert mismatch_crossings(BROKEN, config) == {}


def test_the_canary_fires_once_per_crossing_and_re_arms() -> None:
    alarms: list[CanaryAlarm] = []
    canary = MismatchCanary(MismatchCanaryConfig(), alarms.append)
    steps = {1: HEALTHY, 2: BROKEN, 3: BROKEN, 4: {**BROKEN, "mismatch/ratio_outside_frac": 0.2}, 5: HEALTHY, 6: BROKEN}
    canary.observe_new({s: steps[s] for s in (1, 2)})
    canary.observe_new(steps)  # steps 1 and 2 are not checked again
    assert [(a.step, sorted(a.crossed)) for a in alarms] == [
        (2, ["mismatch/abs_logp_diff_mean", "mismatch/k3_kl"]),
        (4, ["mismatch/ratio_outside_frac"]),  # a new figure crossing while the others stay over
        (6, ["mismatch/abs_logp_diff_mean", "mismatch/k3_kl"]),  # back over after a healthy step
    ]
    assert alarms[0].tokens == 500
    assert "step 2" in alarms[0].message() and "mismatch/k3_kl = 0.16 > 0.02" in alarms[0].message()
    assert canary.alarms == alarms


def test_the_default_reaction_is_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    canary = MismatchCanary(MismatchCanaryConfig())
    with caplog.at_level(logging.WARNING, logger="asyncrl.canary"):
        canary.observe(7, BROKEN)
    assert "train/inference mismatch at step 7" in caplog.text


def test_the_prefect_reaction_logs_a_run_warning_and_emits_the_event(monkeypatch: pytest.MonkeyPatch) -> None:
    emitted: list[dict[str, Any]] = []
    warnings: list[str] = []

    class RunLogger:
        def warning(self, fmt: str, *args: Any) -> None:
            warnings.append(fmt % args)

    monkeypatch.setattr(prefect.events, "emit_event", lambda **kwargs: emitted.append(kwargs))
    monkeypatch.setattr(prefect, "get_run_logger", lambda: RunLogger())
    canary = MismatchCanary(MismatchCanaryConfig(), prefect_alarm("demo-run"))
    canary.observe(3, BROKEN)
    canary.observe(4, BROKEN)
    assert len(emitted) == 1 and len(warnings) == 1
    event = emitted[0]
    assert event["event"] == EVENT == "asyncrl.mismatch.canary"
    assert event["resource"]["prefect.resource.id"] == "asyncrl.run.demo-run"
    assert event["payload"]["step"] == 3 and event["payload"]["tokens"] == 500
    assert event["payload"]["crossed"]["mismatch/k3_kl"] == {"value": 0.16, "threshold": 0.02}
    assert "step 3" in warnings[0]


def test_the_config_is_on_by_default_and_validated() -> None:
    tracking = TrackingConfig()
    assert tracking.mismatch_canary.thresholds() == {
        "mismatch/abs_logp_diff_mean": 0.1,
        "mismatch/k3_kl": 0.02,
        "mismatch/ratio_outside_frac": 0.05,
    }
    off = TrackingConfig.model_validate({"mismatch_canary": {"abs_logp_diff_mean": None, "k3_kl": None,
                                                             "ratio_outside_frac": None}})  # fmt: skip
    assert off.mismatch_canary.thresholds() == {}
    with pytest.raises(ValidationError, match="mismatch_canary.k3_kl"):
        TrackingConfig.model_validate({"mismatch_canary": {"k3_kl": 0}})
    with pytest.raises(ValidationError, match="mismatch_canary.ratio_outside_frac"):
        TrackingConfig.model_validate({"mismatch_canary": {"ratio_outside_frac": 1.5}})
    with pytest.raises(ValidationError, match="mismatch_canary.kl"):
        TrackingConfig.model_validate({"mismatch_canary": {"kl": 0.1}})
