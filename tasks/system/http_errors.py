"""The message of a vLLM server's error response."""

from __future__ import annotations

import httpx


def error_text(response: httpx.Response, limit: int = 2000) -> str:
    """The server's error message from a JSON body (`error`/`detail`/`message`, possibly
    nested as `{"message": ...}`), else the raw text; at most `limit` characters."""
    try:
        body = response.json()
    except ValueError:
        return response.text[:limit]
    if isinstance(body, dict):
        for key in ("error", "detail", "message"):
            value = body.get(key)
            if isinstance(value, dict):
                value = value.get("message", value)
            if value:
                return str(value)[:limit]
    return str(body)[:limit]
