"""The ``storage`` section: the run root and how to reach it (never its credentials)."""

from __future__ import annotations

from typing import Any

from pydantic import ConfigDict, Field, field_validator

from asyncrl.configs.base import StrictModel
from asyncrl.configs.secrets import secret_keys_in
from asyncrl.storage.protocols import check_root_protocol
from asyncrl.storage.retry import retry_policy


class StorageConfig(StrictModel):
    # A validation error must not echo what was given (a credential put there by mistake).
    model_config = ConfigDict(**StrictModel.model_config, hide_input_in_errors=True)

    root: str = Field(min_length=1, description="Run root: a local directory, file:// or s3:// URI.")
    options: dict[str, Any] = Field(
        default_factory=dict, description="fsspec storage options without credentials (endpoint_url, retries ...)."
    )
    """``endpoint_url``, ``client_kwargs``, ``config_kwargs`` ... S3 retries: `config_kwargs:
    {retries: {mode: standard, total_max_attempts: 5}}` (the defaults; botocore's keys, see
    asyncrl.storage.retry). Credentials come from the environment (``AWS_ACCESS_KEY_ID`` ...),
    an instance profile, or the Prefect Secret block named by ``credentials_block``; a
    credential key here is refused, since the config is a flow parameter the Prefect UI shows."""
    credentials_block: str | None = Field(
        None, min_length=1, description="Name of a Prefect Secret block holding the store's credentials as JSON."
    )
    """A JSON object (``{"aws_access_key_id": ..., "aws_secret_access_key": ...,
    "aws_session_token": ...}``, or s3fs's ``key``/``secret``/``token``); loaded in the flow
    run, handed to the processes it starts through their environment."""

    @field_validator("root")
    @classmethod
    def _supported_root(cls, root: str) -> str:
        check_root_protocol(root)
        if secret_keys_in(root):
            raise ValueError(
                "storage.root: holds a password (scheme://user:password@...); give credentials through "
                "the environment or storage.credentials_block"
            )
        return root

    @field_validator("options")
    @classmethod
    def _no_credentials(cls, options: dict[str, Any]) -> dict[str, Any]:
        found = secret_keys_in(options)
        if found:
            named = ", ".join(f"storage.options.{key}" for key in found)
            raise ValueError(
                f"{named}: credentials do not belong in the run config (it is a flow parameter the "
                "Prefect UI shows): set AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (/ AWS_SESSION_TOKEN) "
                "in the environment, use an instance profile, or name a Prefect Secret block in "
                "storage.credentials_block"
            )
        return options

    @field_validator("options")
    @classmethod
    def _retry_options(cls, options: dict[str, Any]) -> dict[str, Any]:
        try:
            retry_policy(options, environ={})  # the options alone; the environment is read where the root opens
        except ValueError as exc:
            raise ValueError(f"storage.options.{exc}") from None
        return options
