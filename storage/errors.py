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
