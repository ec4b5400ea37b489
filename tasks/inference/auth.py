"""Bearer-token guard for every rollout-server path except ``/health``.

vLLM's own ``--api-key`` middleware only guards paths under ``/v1``, ``/v2``,
``/inference`` and ``/cohere``, so the dev-mode endpoints (``/pause``, ``/resume``,
``/collective_rpc``, ``/update_weight_version``...) would answer anyone. This pure
ASGI middleware is loaded by vLLM's ``--middleware`` option, which constructs it as
``cls(app)``: the key therefore comes from the server's environment
(``ASYNCRL_ROLLOUT_API_KEY``), never from its command line.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any
from asyncrl.configs.secrets import API_KEY_ENV

OPEN_PATHS = frozenset({"/health"})
"""Paths answered without a key (liveness probes)."""

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

_UNAUTHORIZED = json.dumps({"error": "Unauthorized: missing or wrong 'Authorization: Bearer <key>'"}).encode()
_WS_POLICY_VIOLATION = 1008


def bearer_token(scope: Scope) -> str | None:
    """The token of the ``Authorization: Bearer <token>`` header, or None."""
    for name, value in scope.get("headers", ()):
        if name.lower() == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            return token.strip() if scheme.lower() == "bearer" else None
    return None


class BearerAuthMiddleware:
    """Refuses (401) every HTTP or WebSocket request but ``OPEN_PATHS`` without the key.

    The comparison is constant-time: both sides are SHA-256 hashed, then compared with
    ``hmac.compare_digest`` (so neither content nor length leaks through timing).
    Construction fails if ``ASYNCRL_ROLLOUT_API_KEY`` is unset or empty, so a server
    told to use this middleware never starts open.
    """

    def __init__(self, app: ASGIApp) -> None:
        key = os.environ.get(API_KEY_ENV, "")
        if not key:
            raise RuntimeError(f"{API_KEY_ENV} is unset or empty: the rollout server refuses to start without its key")
        self.app = app
        self._key_digest = hashlib.sha256(key.encode()).digest()

    def authorized(self, scope: Scope) -> bool:
        """Whether the request carries the right bearer token."""
        token = bearer_token(scope)
        if token is None:
            return False
        return hmac.compare_digest(hashlib.sha256(token.encode()).digest(), self._key_digest)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):  # lifespan events
            await self.app(scope, receive, send)
            return
        path = scope["path"].removeprefix(scope.get("root_path", ""))
        if path in OPEN_PATHS or self.authorized(scope):
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": _WS_POLICY_VIOLATION})
            return
        await send(
            {
                "type": "http.response.start",
                "status": 401,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(_UNAUTHORIZED)).encode()),
                    (b"www-authenticate", b"Bearer"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": _UNAUTHORIZED})
