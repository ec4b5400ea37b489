"""The ``placement`` and ``run`` sections: where each component runs, and how it is supervised."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Discriminator, Field, Tag, field_validator, model_validator

from asyncrl.configs.base import StrictModel
from asyncrl.configs.secrets import secret_keys_in


class RemotePlacement(StrictModel):
    """A component run as its own flow run of a Prefect deployment (on that deployment's work pool)."""

    # A validation error must not echo what was given (a credential put there by mistake).
    model_config = ConfigDict(**StrictModel.model_config, hide_input_in_errors=True)

    deployment: str = Field(
        pattern=r"^[^/]+/[^/]+$", description="`flow-name/deployment-name`, e.g. `component/rollout-server`."
    )
    """As named in ``prefect.yaml``."""
    job_variables: dict[str, Any] = Field(
        default_factory=dict, description="Work-pool job variables of this component's flow runs; no credentials."
    )
    """Image, gpus, memory, env ...; no credentials: they are shown in the Prefect UI."""

    @field_validator("job_variables")
    @classmethod
    def _no_credentials(cls, variables: dict[str, Any]) -> dict[str, Any]:
        found = secret_keys_in(variables)
        if found:
            raise ValueError(
                f"{', '.join(found)}: credentials do not belong in job variables, which the Prefect UI shows; give "
                "them to the work pool (its base job template, or a Secret block its workers read)"
            )
        return variables


def _placement_tag(value: Any) -> str:  # noqa: ANN401 - the raw value
    return "local" if isinstance(value, str) else "deployment"


Placement = Annotated[
    Annotated[Literal["local"], Tag("local")] | Annotated[RemotePlacement, Tag("deployment")],
    Discriminator(_placement_tag),
]


class PlacementConfig(StrictModel):
    """Where each long-lived component runs: ``local`` (a process group of the `train` flow
    run's machine) or as flow runs of a deployment (:class:`RemotePlacement`). Components meet
    only through the run root and its registry, wherever they run."""

    rollout_server: Placement = Field(
        "local", description="`local` or a deployment; each of the `inference.num_servers` servers is one flow run."
    )
    trainer: Placement = Field("local", description="`local` or a deployment; one flow run per trainer node (`trainer.nodes`).")
    scheduler: Placement = Field(
        "local", description="`local` or a deployment for the scheduler and its reward service (one flow run)."
    )
    heartbeat_s: float = Field(5.0, gt=0.0, description="A remote component's flow run writes a heartbeat this often.")
    """Into the run root."""
    heartbeat_timeout_s: float = Field(
        60.0, gt=0.0, description="A remote component whose heartbeat is older than this counts as crashed."
    )
    """Its machine may be gone without a final state: it is cancelled and restarted."""
    share_devices: bool = Field(
        False, description="Allow components on the same placement to share device ids."
    )
    """``inference.devices``, ``trainer.devices``, e.g. a small model's server and trainer on one GPU."""

    @model_validator(mode="after")
    def _heartbeat_window(self) -> PlacementConfig:
        if self.heartbeat_timeout_s < 3 * self.heartbeat_s:
            raise ValueError(
                f"placement.heartbeat_timeout_s: {self.heartbeat_timeout_s} must be at least 3 x "
                f"placement.heartbeat_s ({self.heartbeat_s}), so that one late heartbeat is not a crash"
            )
        return self


class RunSettings(StrictModel):
    """How the run's components are supervised."""

    max_restarts: int = Field(3, ge=0, description="Restarts allowed per component over the run.")
    """Per component: trainer, each rollout server, reward service, scheduler; one more crash
    fails the run, naming the component."""
    restart_backoff_s: float = Field(
        1.0, ge=0.0, description="Wait before the r-th restart: min(restart_backoff_s * 2**(r-1), 30 s)."
    )
    component_start_timeout_s: float = Field(
        600.0, gt=0.0, description="A component not up this long after it was started counts as crashed."
    )
