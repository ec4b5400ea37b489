"""What starting or talking to a rollout server raises: the base error carrying the tail of the
server log, a fixed port already taken, and a foreign process answering on our port.
"""

from __future__ import annotations


class RolloutServerError(RuntimeError):
    """The rollout server could not start, died, or refused a request.

    ``log_tail`` holds the last lines of the server log (empty if there is none).
    """

    def __init__(self, message: str, log_tail: str = "") -> None:
        full = f"{message}\n--- rollout server log (last lines) ---\n{log_tail}" if log_tail else message
        super().__init__(full)
        self.log_tail = log_tail


class PortInUseError(RolloutServerError):
    """The server's fixed port is taken by another process (found before spawning)."""


class ForeignServerError(RolloutServerError):
    """Something answers on the server's port, but it is not the server this object started."""
