"""Promotion history in the MLflow Model Registry: which version is ``best``, and the way back.

The aliases ``best`` and ``current`` name the promoted version; ``candidate`` the newest one a
run registered, promoted or not. Each version carries its decision as tags
(``asyncrl.promotion`` = promoted | rejected | rolled_back, the figures, the reason), and a
promoted version names the version it replaced (``asyncrl.promotion.previous``), so the
history is a chain through the versions' own tags: a rollback moves ``best`` one link back,
and a second rollback one more. Nothing grows per promotion but the new version's tags.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mlflow import MlflowClient
from mlflow.exceptions import MlflowException

from asyncrl.storage import fs, paths
from asyncrl.storage.fs import open_root

PROMOTED_ALIASES = ("best", "current")
CANDIDATE_ALIAS = "candidate"
OUTCOME_TAG = "asyncrl.promotion"
PREVIOUS_TAG = "asyncrl.promotion.previous"


class UnknownRegisteredVersionError(ValueError):
    """The registry holds no such model version, or its weights are gone from the store."""


@dataclass(frozen=True)
class RegisteredWeights:
    """One registered version and where its weights live in a run root."""

    name: str
    number: str
    model_id: str
    weights_uri: str
    tags: Mapping[str, str]

    @property
    def ref(self) -> str:
        return f"models:/{self.name}/{self.number}"

    def root_and_version(self) -> tuple[str, int]:
        """The run root URI and the weight version of its weights."""
        return paths.split_weights_uri(self.weights_uri)


def _client(tracking_uri: str) -> MlflowClient:
    return MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri)


def _weights(client: MlflowClient, version: Any) -> RegisteredWeights:  # noqa: ANN401 - an MLflow ModelVersion
    model_id = version.tags.get("asyncrl.model_id") or version.model_id
    uri = version.tags.get("asyncrl.weights_uri")
    if not uri and model_id:
        uri = client.get_logged_model(model_id).tags.get("asyncrl.weights_uri")
    if not model_id or not uri:
        raise UnknownRegisteredVersionError(
            f"models:/{version.name}/{version.version} names no asyncrl LoggedModel with weights (asyncrl.weights_uri)"
        )
    return RegisteredWeights(version.name, str(version.version), model_id, uri, dict(version.tags))


def aliased_version(tracking_uri: str, name: str, alias: str) -> RegisteredWeights | None:
    """``models:/<name>@<alias>``, or None when the model or the alias does not exist."""
    client = _client(tracking_uri)
    try:
        version = client.get_model_version_by_alias(name, alias)
    except MlflowException:
        return None
    return _weights(client, version)


def registered_version(tracking_uri: str, name: str, number: str, storage_options: dict[str, Any] | None = None) -> RegisteredWeights:
    """``models:/<name>/<number>`` with its weights checked complete in their run root;
    :class:`UnknownRegisteredVersionError` naming the version when it does not exist or its
    weights are gone."""
    client = _client(tracking_uri)
    try:
        version = client.get_model_version(name, str(number))
    except MlflowException as exc:
        raise UnknownRegisteredVersionError(f"models:/{name}/{number}: no such registered model version") from exc
    weights = _weights(client, version)
    root_uri, weight_version = weights.root_and_version()
    if not fs.exists(open_root(root_uri, storage_options), paths.weights_complete_marker(weight_version)):
        raise UnknownRegisteredVersionError(
            f"{weights.ref}: its weights are gone from the store ({weights.weights_uri} has no complete version)"
        )
    return weights


def record_decision(
    tracking_uri: str, name: str, number: str, tags: Mapping[str, str], report: str, promote: bool, previous: str | None
) -> None:
    """Write a gate's decision on version ``number``: its tags, the report appended to its
    description; when ``promote``, ``best`` and ``current`` move to it and it names
    ``previous`` (the version it replaced) in its history tag."""
    client = _client(tracking_uri)
    for key, value in tags.items():
        client.set_model_version_tag(name, number, key, value)
    description = client.get_model_version(name, number).description or ""
    client.update_model_version(name, number, description=f"{description}\n\n{report}".strip())
    if promote:
        if previous is not None and previous != number:
            client.set_model_version_tag(name, number, PREVIOUS_TAG, previous)
        for alias in PROMOTED_ALIASES:
            client.set_registered_model_alias(name, alias, number)


def promote(tracking_uri: str, name: str, number: str, storage_options: dict[str, Any] | None = None) -> str:
    """Make ``models:/<name>/<number>`` the promoted version by hand (``asyncrl promote``):
    refused, naming it, when it does not exist or its weights are gone. Returns a line saying
    what changed."""
    chosen = registered_version(tracking_uri, name, number, storage_options)
    incumbent = aliased_version(tracking_uri, name, PROMOTED_ALIASES[0])
    if incumbent is not None and incumbent.number == chosen.number:
        return f"{chosen.ref} is {name}@best already"
    previous = None if incumbent is None else incumbent.number
    tags = {OUTCOME_TAG: "promoted", "asyncrl.promotion.reason": "promoted by hand (asyncrl promote)"}
    record_decision(tracking_uri, name, chosen.number, tags, f"Promoted by hand over version {previous}.", True, previous)
    return f"{chosen.ref} is now {name}@best and @current" + (f" (was version {previous})" if previous else "")


def rollback(tracking_uri: str, name: str, storage_options: dict[str, Any] | None = None) -> str:
    """Move ``best`` and ``current`` back to the version the promoted one replaced (its
    ``asyncrl.promotion.previous``) and mark the promoted one ``rolled_back``; refused, naming
    the version, when there is no earlier promoted version or its weights are gone. Returns
    a line saying what changed."""
    current = aliased_version(tracking_uri, name, PROMOTED_ALIASES[0])
    if current is None:
        raise UnknownRegisteredVersionError(f"models:/{name}@best: no such model or alias; nothing to roll back")
    previous = current.tags.get(PREVIOUS_TAG)
    if not previous:
        raise UnknownRegisteredVersionError(f"{current.ref} (@best) replaced no earlier version; nothing to roll back to")
    target = registered_version(tracking_uri, name, previous, storage_options)
    client = _client(tracking_uri)
    client.set_model_version_tag(name, current.number, OUTCOME_TAG, "rolled_back")
    for alias in PROMOTED_ALIASES:
        client.set_registered_model_alias(name, alias, target.number)
    return f"{name}@best and @current rolled back from version {current.number} to {target.number}"
