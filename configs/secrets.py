"""The one redaction rule, and the types of config fields that hold secrets.

A value is secret when its key is one of :data:`SECRET_KEYS` (exact name, case and
``-``/``_`` ignored): ``max_new_tokens`` and ``micro_batch_tokens`` are not secrets,
``token`` and ``aws_secret_access_key`` are. Any string that is a URI with a password
(``scheme://user:password@host``) keeps its user and loses the password. That is all
:func:`redact` does, and every place that shows or stores a config uses it (``config
show``, the run root's ``config.yaml``, MLflow params, Prefect artifacts, summaries, logs).

Config fields that hold secrets serialise themselves redacted in JSON mode, so a config
passed as a Prefect flow parameter (Prefect stores ``model_dump(mode="json")``) never
carries them: :data:`SecretUri` (a URI whose password is stripped) and :data:`Secret`
(a :class:`SecretStr` shown as ``***``). Only :func:`reveal_context` (the run's private,
local config for the processes it starts) dumps them in full. A redacted value that comes
back (a deployment run's parameters) is refused by :func:`refuse_redacted`: secrets reach
a flow run from its environment, an instance profile or a Prefect Secret block.
"""

from __future__ import annotations

import re
from typing import Annotated, Any

from pydantic import PlainSerializer, SecretStr, SerializationInfo

REDACTED = "***"
SECRET_KEYS = frozenset(
    {
        "key",
        "secret",
        "token",
        "password",
        "passwd",
        "api_key",
        "apikey",
        "access_key",
        "secret_key",
        "access_key_id",
        "secret_access_key",
        "session_token",
        "security_token",
        "aws_access_key_id",
        "aws_secret_access_key",
        "aws_session_token",
        "client_secret",
        "private_key",
        "credentials",
        "authorization",
        "sas_token",
        "account_key",
    }
)
"""Keys whose values are secrets, by exact (normalised) name."""

_URI_PASSWORD = re.compile(r"(?P<head>[A-Za-z][A-Za-z0-9+.\-]*://[^/@:\s]*):(?P<password>[^/@\s]*)@")
_REVEAL = "reveal_secrets"


def is_secret_key(key: str) -> bool:
    """True when ``key`` names a secret: its lower-cased name, ``-`` read as ``_``, is in
    :data:`SECRET_KEYS`."""
    return key.strip().lower().replace("-", "_") in SECRET_KEYS


def strip_uri_password(text: str) -> str:
    """``scheme://user:password@host/...`` -> ``scheme://user:***@host/...`` (every such URI
    in ``text``); text without one is returned unchanged."""
    return _URI_PASSWORD.sub(lambda m: f"{m.group('head')}:{REDACTED}@", text)


def drop_uri_password(text: str) -> str:
    """``scheme://user:password@host/...`` -> ``scheme://user@host/...``: the password left
    out, not masked (for a value that must still validate where it is received)."""
    return _URI_PASSWORD.sub(lambda m: f"{m.group('head')}@", text)


def redact(value: Any, key: str = "") -> Any:  # noqa: ANN401
    """The redaction rule: a value under a secret key (see :func:`is_secret_key`) becomes
    ``***`` (``None`` stays ``None``); every string loses URI passwords; mappings and lists
    are redacted item by item."""
    if key and is_secret_key(key) and value is not None:
        return REDACTED
    if isinstance(value, dict):
        return {k: redact(v, str(k)) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [redact(v) for v in value]
    if isinstance(value, str):
        return strip_uri_password(value)
    return value


def secret_keys_in(value: Any, prefix: str = "") -> list[str]:  # noqa: ANN401
    """Dotted paths of the secret keys (and of strings holding URI passwords) in ``value``."""
    found: list[str] = []
    if isinstance(value, dict):
        for k, v in value.items():
            path = f"{prefix}.{k}" if prefix else str(k)
            if is_secret_key(str(k)) and v is not None:
                found.append(path)
            else:
                found.extend(secret_keys_in(v, path))
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            found.extend(secret_keys_in(v, f"{prefix}[{i}]"))
    elif isinstance(value, str) and strip_uri_password(value) != value:
        found.append(prefix)
    return found


def reveal_context() -> dict[str, bool]:
    """The serialisation context that dumps secret fields in full (process config files only):
    ``config.model_dump(mode="json", context=reveal_context())``."""
    return {_REVEAL: True}


def _revealing(info: SerializationInfo) -> bool:
    return bool(info.context and info.context.get(_REVEAL))


def _serialise_uri(value: str, info: SerializationInfo) -> str:
    return value if _revealing(info) else strip_uri_password(value)


def _serialise_secret(value: SecretStr, info: SerializationInfo) -> str:
    return value.get_secret_value() if _revealing(info) else REDACTED


SecretUri = Annotated[str, PlainSerializer(_serialise_uri, return_type=str, when_used="json")]
"""A URI that may hold ``user:password@``: the password never leaves in JSON mode."""

Secret = Annotated[SecretStr, PlainSerializer(_serialise_secret, return_type=str, when_used="json")]
"""A secret string: ``***`` in JSON mode (and ``**********`` in reprs)."""


def refuse_redacted(field: str, value: str, source_hint: str) -> None:
    """Raise ``ValueError`` naming ``field`` when ``value`` is a redacted placeholder (a
    secret that came back through a flow parameter); ``source_hint`` says where it belongs."""
    masked = value in (REDACTED, "*" * 10) or f":{REDACTED}@" in value
    if masked:
        raise ValueError(
            f"{field}: holds a redacted secret ({value!r}); secrets never travel as flow parameters: "
            f"{source_hint}"
        )


API_KEY_ENV = "ASYNCRL_ROLLOUT_API_KEY"
