"""Retries of object-store requests: the policy, where it comes from, and which faults are transient.

Three layers absorb the transient faults of an S3-compatible store (throttling, 5xx answers,
dropped connections, truncated bodies), each repeating only what is safe to repeat:
botocore per HTTP request (``storage.options.config_kwargs.retries``), s3fs per call
(``S3FileSystem.retries``), and :mod:`asyncrl.storage.fs` per operation where the lower
layers cannot know the outcome (a conditional put answered 412 after a retry, bulk
deletes). Every repeated request is idempotent; the one non-idempotent request, the
conditional PUT, is resolved by reading the object back. A fault left after all retries
raises :class:`~asyncrl.storage.errors.StorageOperationError`. This module imports no heavy
library. Back-off formulas and each layer's rules: ``docs/internals/storage.md``.
"""

from __future__ import annotations

import os
import random
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

RETRY_MODES = ("legacy", "standard", "adaptive")
DEFAULT_MODE = "standard"
DEFAULT_ATTEMPTS = 5
"""Total attempts per request (the first one included): botocore's legacy default, and s3fs's."""
_RETRY_KEYS = ("mode", "total_max_attempts", "max_attempts")
_OPTION_PATH = "config_kwargs.retries"
# Error codes and HTTP statuses that a retry may cure: the store was busy or broken for a moment.
_TRANSIENT_CODES = frozenset(
    {
        "500", "502", "503", "504",
        "InternalError", "ServiceUnavailable", "SlowDown", "RequestTimeout",
        "Throttling", "ThrottlingException", "RequestLimitExceeded", "TooManyRequestsException",
    }
)


@dataclass(frozen=True)
class RetryPolicy:
    """How often and how one S3 request is retried (see the module docstring)."""

    attempts: int = DEFAULT_ATTEMPTS
    """Total attempts per request, the first included; 1 turns off the retries of botocore,
    s3fs and asyncrl (not aiohttp's single re-send, see above)."""
    mode: str = DEFAULT_MODE
    """botocore retry mode: ``legacy``, ``standard`` or ``adaptive``."""

    def botocore_retries(self) -> dict[str, Any]:
        """The ``retries`` entry of botocore's ``Config`` for this policy."""
        return {"mode": self.mode, "total_max_attempts": self.attempts}


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def retry_policy(options: Mapping[str, Any] | None, environ: Mapping[str, str] | None = None) -> RetryPolicy:
    """The policy set by fsspec/s3fs ``options`` (``config_kwargs.retries``); without it,
    botocore's own variables ``AWS_RETRY_MODE`` / ``AWS_MAX_ATTEMPTS`` in ``environ``
    (default ``os.environ``) and then the defaults (standard mode, 5 attempts).

    ``retries`` takes botocore's keys: ``mode`` (``legacy``, ``standard``, ``adaptive``)
    and either ``total_max_attempts`` (attempts, >= 1) or ``max_attempts`` (retries
    after the first attempt, >= 0; attempts = max_attempts + 1). ``ValueError`` names
    the offending key (relative to the options) or variable and lists what is allowed.
    """
    config_kwargs = (options or {}).get("config_kwargs") or {}
    if not isinstance(config_kwargs, Mapping):
        kind = type(config_kwargs).__name__
        raise ValueError(f"config_kwargs: must be a mapping of botocore Config arguments, got {kind}")
    retries = config_kwargs.get("retries")
    if retries is None:
        return _policy_from_environment(os.environ if environ is None else environ)
    if not isinstance(retries, Mapping):
        raise ValueError(f"{_OPTION_PATH}: must be a mapping with keys {list(_RETRY_KEYS)}, got {retries!r}")
    unknown = sorted(set(retries) - set(_RETRY_KEYS))
    if unknown:
        raise ValueError(f"{_OPTION_PATH}: unknown keys {unknown}; allowed: {list(_RETRY_KEYS)}")
    mode = retries.get("mode", DEFAULT_MODE)
    if mode not in RETRY_MODES:
        raise ValueError(f"{_OPTION_PATH}.mode: {mode!r} is not one of {list(RETRY_MODES)}")
    if "total_max_attempts" in retries and "max_attempts" in retries:
        raise ValueError(
            f"{_OPTION_PATH}: give total_max_attempts (attempts) or max_attempts (retries after the first), not both"
        )
    if "max_attempts" in retries:
        retries_after_first = retries["max_attempts"]
        if not _is_int(retries_after_first) or retries_after_first < 0:
            raise ValueError(
                f"{_OPTION_PATH}.max_attempts: must be an int >= 0 (retries), got {retries_after_first!r}"
            )
        return RetryPolicy(attempts=retries_after_first + 1, mode=mode)
    attempts = retries.get("total_max_attempts", DEFAULT_ATTEMPTS)
    if not _is_int(attempts) or attempts < 1:
        raise ValueError(f"{_OPTION_PATH}.total_max_attempts: must be an int >= 1, got {attempts!r}")
    return RetryPolicy(attempts=attempts, mode=mode)


def _policy_from_environment(environ: Mapping[str, str]) -> RetryPolicy:
    mode = environ.get("AWS_RETRY_MODE", DEFAULT_MODE)
    if mode not in RETRY_MODES:
        raise ValueError(f"AWS_RETRY_MODE (environment): {mode!r} is not one of {list(RETRY_MODES)}")
    raw = environ.get("AWS_MAX_ATTEMPTS", str(DEFAULT_ATTEMPTS))
    if not raw.strip().isdigit() or int(raw) < 1:
        raise ValueError(f"AWS_MAX_ATTEMPTS (environment): must be an int >= 1 (total attempts), got {raw!r}")
    return RetryPolicy(attempts=int(raw), mode=mode)


def with_retry_config(options: Mapping[str, Any], policy: RetryPolicy) -> dict[str, Any]:
    """A copy of ``options`` whose ``config_kwargs.retries`` states ``policy`` explicitly."""
    updated = dict(options)
    updated["config_kwargs"] = {**(options.get("config_kwargs") or {}), "retries": policy.botocore_retries()}
    return updated


def backoff_s(attempt: int, base_s: float = 0.05, cap_s: float = 2.0, rng: random.Random | None = None) -> float:
    """Wait before repeating an operation for the ``attempt``-th time (1-based), "full jitter":

        wait = rand(0, 1) * min(cap_s, base_s * 2 ** (attempt - 1))
    """
    if attempt < 1:
        raise ValueError(f"attempt must be >= 1, got {attempt}")
    return (rng or random).random() * min(cap_s, base_s * 2 ** (attempt - 1))


def _chain(exc: BaseException) -> list[BaseException]:
    """``exc`` and its causes (explicit, else implicit context), without cycles."""
    seen: list[BaseException] = []
    current: BaseException | None = exc
    while current is not None and all(current is not other for other in seen):
        seen.append(current)
        current = current.__cause__ or current.__context__
    return seen


def s3_error_codes(exc: BaseException) -> set[str]:
    """Error codes and HTTP statuses of the botocore errors in ``exc``'s cause chain."""
    codes: set[str] = set()
    for error in _chain(exc):
        response = getattr(error, "response", None)
        if isinstance(response, dict):
            codes.add(str(response.get("Error", {}).get("Code", "")))
            codes.add(str(response.get("ResponseMetadata", {}).get("HTTPStatusCode", "")))
    codes.discard("")
    return codes


def is_transient(exc: BaseException) -> bool:
    """Whether ``exc`` is a fault a later attempt may not meet: a 5xx or throttling answer,
    a dropped, reset or refused connection, a timeout, or a body cut off mid-stream.

    Answers about the object itself (missing, exists, forbidden, invalid) are not transient.
    """
    if isinstance(exc, (FileNotFoundError, FileExistsError, PermissionError, IsADirectoryError, NotADirectoryError)):
        return False
    import aiohttp
    from botocore.exceptions import ConnectionError as BotoConnectionError
    from s3fs.core import S3_RETRYABLE_ERRORS  # timeouts, HTTP client errors, cut-off bodies

    transient_types = (
        TimeoutError,
        ConnectionError,
        BotoConnectionError,
        aiohttp.ClientConnectionError,
        *S3_RETRYABLE_ERRORS,
    )
    if any(isinstance(error, transient_types) for error in _chain(exc)):
        return True
    return bool(_TRANSIENT_CODES & s3_error_codes(exc))
