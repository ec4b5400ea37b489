"""Store credentials from a Prefect Secret block, handed on through the environment.

A run config never holds credentials (it is a flow parameter: see
``StorageConfig.credentials_block``). When it names a Secret block, the flow run loads it
once and puts the credentials in its own environment under botocore's standard names, so
that s3fs in this process and in every process the run starts (trainer, scheduler, reward
service, rollout servers, which read the store with their own credentials) finds them the
way it finds an instance profile's or a worker's. The sandbox and reward workers get an
allow-listed environment and never see them.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, MutableMapping
from typing import Any

from asyncrl.configs.storage import StorageConfig

CREDENTIAL_ENV = {
    "aws_access_key_id": "AWS_ACCESS_KEY_ID",
    "key": "AWS_ACCESS_KEY_ID",
    "access_key_id": "AWS_ACCESS_KEY_ID",
    "aws_secret_access_key": "AWS_SECRET_ACCESS_KEY",
    "secret": "AWS_SECRET_ACCESS_KEY",
    "secret_access_key": "AWS_SECRET_ACCESS_KEY",
    "aws_session_token": "AWS_SESSION_TOKEN",
    "token": "AWS_SESSION_TOKEN",
    "session_token": "AWS_SESSION_TOKEN",
}
"""Credential names a Secret block may use -> the environment variable botocore reads."""


def load_secret_block(name: str) -> Any:  # noqa: ANN401
    """The value of the Prefect Secret block ``name`` (``ValueError`` naming it if absent)."""
    from prefect.blocks.system import Secret

    try:
        return Secret.load(name).get()
    except ValueError as exc:
        raise ValueError(f"storage.credentials_block: Prefect Secret block {name!r} not found ({exc})") from None


def credential_environment(block_name: str, value: Any) -> dict[str, str]:  # noqa: ANN401
    """The environment variables for a Secret block's value: a JSON object (or its text) of
    credential names (see :data:`CREDENTIAL_ENV`) to strings. ``ValueError`` names the block
    and the offending key, never a value."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise ValueError(
                f"storage.credentials_block {block_name!r}: the secret is not a JSON object of credentials"
            ) from None
    if not isinstance(value, dict) or not value:
        raise ValueError(f"storage.credentials_block {block_name!r}: the secret must be a non-empty JSON object")
    environment: dict[str, str] = {}
    for key, item in value.items():
        variable = CREDENTIAL_ENV.get(str(key).lower())
        if variable is None:
            raise ValueError(
                f"storage.credentials_block {block_name!r}: unknown credential {key!r} "
                f"(expected one of {sorted(set(CREDENTIAL_ENV))})"
            )
        if not isinstance(item, str) or not item:
            raise ValueError(f"storage.credentials_block {block_name!r}: {key!r} must be a non-empty string")
        environment[variable] = item
    if "AWS_ACCESS_KEY_ID" not in environment or "AWS_SECRET_ACCESS_KEY" not in environment:
        raise ValueError(
            f"storage.credentials_block {block_name!r}: needs an access key id and a secret access key"
        )
    return environment


def apply_storage_credentials(
    storage: StorageConfig,
    environ: MutableMapping[str, str] | None = None,
    load: Callable[[str], Any] = load_secret_block,
) -> list[str]:
    """Put the credentials of ``storage.credentials_block`` (if named) into ``environ`` (the
    process environment by default), replacing what was there; return the variable names set."""
    if storage.credentials_block is None:
        return []
    target = os.environ if environ is None else environ
    environment = credential_environment(storage.credentials_block, load(storage.credentials_block))
    target.update(environment)
    return sorted(environment)
