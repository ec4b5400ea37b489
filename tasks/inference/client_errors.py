"""What the rollout client raises, and how a server's answer maps to it: a bad key, a missing
endpoint, a rejected request (the caller's to fix), or a failing server (internal
:class:`ServerFailure`: the client takes the server out and moves its requests).
"""

from __future__ import annotations

import httpx

from asyncrl.tasks.system.http_errors import error_text as _error_text
from asyncrl.tasks.inference.routing import ServerState
from asyncrl.tasks.inference.samples import Segment
from asyncrl.tasks.inference.vllm_api import GENERATE_PATH


class RolloutAuthError(PermissionError):
    """A server refused the client's API key (HTTP 401)."""


class RolloutSetupError(RuntimeError):
    """A server lacks an endpoint the client needs (a launch flag is missing)."""


class RolloutRequestError(ValueError):
    """A server rejected a generation request as invalid (HTTP 400/422)."""


class ServerFailure(Exception):
    """The server failed mid-request; ``partial`` holds the tokens that can be kept."""

    def __init__(self, reason: str, partial: Segment | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.partial = partial


def raise_for_status(server: ServerState, path: str, response: httpx.Response) -> None:
    """Map a non-200 answer to the error that says what to fix; 5xx means a failing server."""
    status = response.status_code
    if status == 200:
        return
    text = _error_text(response)
    where = f"rollout server {server.url}{path}"
    if status == 401:
        raise RolloutAuthError(
            f"{where} refused the API key (HTTP 401: {text}); check the api_key given for this server"
        )
    if status == 403 and "scale-out" in text.lower():
        raise RolloutSetupError(f"{where} is disabled: start vLLM with --enable-scale-out ({text})")
    if status == 404:
        raise RolloutSetupError(
            f"{where} not found (HTTP 404): the server needs VLLM_SERVER_DEV_MODE=1 and --enable-scale-out"
        )
    if status in (400, 413, 422):
        raise RolloutRequestError(f"{where} rejected the request (HTTP {status}): {text}")
    if status >= 500:
        raise ServerFailure(f"{path} answered HTTP {status}: {text}")
    raise RolloutSetupError(f"{where}: unexpected HTTP {status}: {text}")


def raise_stream_error(server: ServerState, error: object) -> None:
    """An error sent inside the stream: a 4xx code is a bad request, anything else a failing server."""
    code = error.get("code") if isinstance(error, dict) else None
    message = error.get("message", error) if isinstance(error, dict) else error
    if isinstance(code, int) and 400 <= code < 500:
        raise RolloutRequestError(
            f"rollout server {server.url}{GENERATE_PATH} rejected the request (HTTP {code}): {str(message)[:1000]}"
        )
    raise ServerFailure(f"stream error: {str(error)[:500]}")


def misconfigured(error: BaseException) -> bool:
    """A server that refused the key or lacks the endpoints: no rejoin can mend it."""
    return isinstance(error, (RolloutAuthError, RolloutSetupError))
