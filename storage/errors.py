"""Errors raised by the storage layer."""

from __future__ import annotations


class ShardValidationError(ValueError):
    """A trajectory shard (or the data meant for one) breaks the shard contract.

    ``source`` names the file (run-root relative path) or the input that failed,
    ``problem`` says what is wrong (field, row, value).
    """

    def __init__(self, source: str, problem: str) -> None:
        super().__init__(f"{source}: {problem}")
        self.source = source
        self.problem = problem


class UnknownWeightVersionError(KeyError):
    """A weight version was asked for that is not published (complete) in the run root."""

    def __init__(self, version: int, available: list[int]) -> None:
        self.message = (
            f"weight version {version} is not published; available complete versions: {available}"
        )
        super().__init__(self.message)
        self.version = version
        self.available = available

    def __str__(self) -> str:
        # KeyError would print the repr (quoted) of its argument.
        return self.message


class StorageOperationError(OSError):
    """An object-store operation met a transient fault (5xx, throttling, dropped connection,
    cut-off body) that its retries did not absorb, or with retries turned off.

    ``operation`` names the storage call (``put_if_absent``, ``read``, ``list``...),
    ``target`` the object or directory URI, ``attempts`` the attempts allowed per request
    and ``cause`` the last fault. Nothing is half-written: the call either took effect
    completely or not at all, and repeating it is safe.
    """

    def __init__(self, operation: str, target: str, attempts: int, cause: BaseException) -> None:
        self.message = (
            f"{operation} {target} failed: {type(cause).__name__}: {cause} "
            f"(a transient storage fault left after {attempts} attempt(s) per request; "
            f"storage.options.config_kwargs.retries.total_max_attempts sets the attempts)"
        )
        super().__init__(self.message)
        self.operation = operation
        self.target = target
        self.attempts = attempts
        self.cause = cause

    def __str__(self) -> str:
        return self.message
