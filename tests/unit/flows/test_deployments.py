"""prefect.yaml: every deployment points at a real flow, and its parameters pass that
flow's validation (the same the Prefect UI form and `prefect deploy` apply)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from asyncrl.configs.run_config import RunConfig

REPO = Path(__file__).resolve().parents[3]
PREFECT_YAML = yaml.safe_load((REPO / "prefect.yaml").read_text())
DEPLOYMENTS = {d["name"]: d for d in PREFECT_YAML["deployments"]}


def load_flow(entrypoint: str):  # noqa: ANN201 - a prefect Flow
    """Load the flow the way a Prefect worker does: by file path from the repository root."""
    from prefect.flows import load_flow_from_entrypoint

    return load_flow_from_entrypoint(str(REPO / entrypoint))


def test_expected_deployments() -> None:
    assert set(DEPLOYMENTS) >= {"train", "train-nightly", "evaluate", "pipeline", "scheduler", "replay"}
    assert DEPLOYMENTS["train-nightly"]["schedules"][0]["cron"]


def test_component_deployments_have_a_queue_each() -> None:
    """The deployments `placement` names (`component/<name>`): one work queue per component kind."""
    components = {name: d for name, d in DEPLOYMENTS.items() if d["entrypoint"] == "flows/component.py:component"}
    assert {name: d["parameters"]["kind"] for name, d in components.items()} == {
        "rollout-server": "rollout-server", "trainer": "trainer", "scheduler-service": "scheduler",
    }  # fmt: skip
    queues = [d["work_pool"]["work_queue_name"] for d in components.values()]
    assert len(set(queues)) == 3 and "default" not in queues


@pytest.mark.parametrize("name", sorted(DEPLOYMENTS))
def test_entrypoint_is_a_flow_and_parameters_validate(name: str) -> None:
    from prefect import Flow

    deployment = DEPLOYMENTS[name]
    flow = load_flow(deployment["entrypoint"])
    assert isinstance(flow, Flow)
    parameters = deployment.get("parameters", {})
    flow.validate_parameters(parameters)  # raises on a missing or mistyped parameter
    schema = flow.parameters.model_dump()
    if name == "replay":  # a run root, not a run config: the original's frozen config is used
        assert {"root", "trainer_overrides", "from_step"} <= set(schema["properties"])
        return
    RunConfig.model_validate(parameters["config"])
    assert "config" in schema["properties"]


def test_a_bad_parameter_is_refused_by_name() -> None:
    from prefect.exceptions import ParameterTypeError

    flow = load_flow(DEPLOYMENTS["train"]["entrypoint"])
    bad = dict(DEPLOYMENTS["train"]["parameters"]["config"])
    bad["trainer"] = {**bad["trainer"], "batch_groups": 0}
    with pytest.raises(ParameterTypeError, match="batch_groups"):
        flow.validate_parameters({"config": bad})


def test_deployments_run_the_demo_config() -> None:
    """The config a Prefect UI user launches is the one `make demo` runs (measured in the README)."""
    from asyncrl.configs.loading import load_config

    demo = load_config(REPO / "configs" / "demo.yaml")
    for name in ("train", "pipeline", "scheduler", "train-nightly"):
        deployed = RunConfig.model_validate(DEPLOYMENTS[name]["parameters"]["config"])
        assert deployed.model_dump() == demo.model_dump(), name


def test_the_example_automation_is_a_valid_prefect_automation_on_the_gate_s_event() -> None:
    from prefect.events.schemas.automations import AutomationCore

    from asyncrl.flows.prefect_api.events import PROMOTION_EVENT

    raw = yaml.safe_load((REPO / "infra" / "automations" / "promotion-rejected.yaml").read_text())
    automation = AutomationCore.model_validate(raw)
    assert automation.trigger.expect == {PROMOTION_EVENT.format(outcome="rejected")}
