"""The ``tracking`` section: MLflow, pass@k and the mismatch canary."""

from __future__ import annotations

from pydantic import Field, field_validator

from asyncrl.configs.base import StrictModel
from asyncrl.configs.canary import MismatchCanaryConfig
from asyncrl.configs.secrets import SecretUri, refuse_redacted


class TrackingConfig(StrictModel):
    mlflow_uri: SecretUri = Field(
        "sqlite:///mlflow.db", description="MLflow tracking (and registry) URI; a password in it is never shown."
    )
    """A password in it (``postgresql://user:pw@host``) is stripped wherever the config is shown
    or passed as a flow parameter; for deployment runs give it through the environment
    (``PGPASSWORD``, ``MLFLOW_TRACKING_PASSWORD``)."""
    experiment: str = Field("asyncrl", min_length=1, description="MLflow experiment the run is logged to.")
    artifact_location: str | None = Field(
        None, description="Where a new experiment keeps its artifacts; None: the store's default."
    )
    """``file://...``, ``s3://...``; None: beside a SQLite store (``<its directory>/mlartifacts``),
    the tracking server's default otherwise."""
    pass_k: list[int] = Field(
        default_factory=list, description="k values (>= 2) of pass@k reported per task, besides pass@1."
    )
    """Reported for training steps (over rollout.n_samples per prompt) and evaluation
    (pipeline.eval_samples); pass@1 is always reported."""
    system_metrics: bool = Field(True, description="Log MLflow's system metrics of the flow's machine into the run.")
    """``system/cpu_utilization_percentage``, memory, disk, network, GPU, while the run runs."""
    system_metrics_interval_s: float = Field(10.0, gt=0, le=3600, description="Seconds between two system-metrics samples.")
    mismatch_canary: MismatchCanaryConfig = Field(
        default_factory=MismatchCanaryConfig, description="Thresholds on the train/inference mismatch figures."
    )
    """Of the trainer's current-version tokens (``mismatch/*``); a step that crosses one logs a
    run warning and emits the Prefect event ``asyncrl.mismatch.canary`` (once per crossing). On
    by default with generous thresholds; each one can be set to null."""

    @field_validator("pass_k")
    @classmethod
    def _ks_above_one(cls, ks: list[int]) -> list[int]:
        small = [k for k in ks if k < 2]
        if small:
            raise ValueError(f"tracking.pass_k: {small} — pass@1 is always reported; list k values >= 2")
        return sorted(set(ks))

    @field_validator("mlflow_uri")
    @classmethod
    def _not_redacted(cls, uri: str) -> str:
        refuse_redacted("tracking.mlflow_uri", uri, "leave the password out of the URI and set it in the environment")
        return uri
