"""The bearer-token middleware in front of a small Starlette app (no vLLM needed)."""

from __future__ import annotations

import pytest
from asyncrl.tasks.inference.auth import BearerAuthMiddleware
from asyncrl.configs.secrets import API_KEY_ENV
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route, WebSocketRoute
from starlette.testclient import TestClient
from starlette.websockets import WebSocket, WebSocketDisconnect

KEY = "k3y-for-tests"
PATHS = ["/pause", "/resume", "/collective_rpc", "/update_weight_version", "/v1/completions", "/is_paused", "/"]


async def echo(request: object) -> PlainTextResponse:
    return PlainTextResponse("reached")


async def ws_echo(websocket: WebSocket) -> None:
    await websocket.accept()
    await websocket.send_text("reached")
    await websocket.close()


def make_client() -> TestClient:
    routes = [Route(path, echo, methods=["GET", "POST"]) for path in PATHS + ["/health"]]
    app = Starlette(routes=routes + [WebSocketRoute("/ws", ws_echo)])
    app.add_middleware(BearerAuthMiddleware)  # as vLLM's --middleware does: cls(app)
    return TestClient(app)


@pytest.fixture
def client(monkeypatch: pytest.MonkeyPatch) -> TestClient:
    monkeypatch.setenv(API_KEY_ENV, KEY)
    return make_client()


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"Authorization": "Bearer wrong"},
        {"Authorization": f"Bearer {KEY}x"},
        {"Authorization": f"Bearer {KEY[:-1]}"},
        {"Authorization": KEY},
        {"Authorization": f"Basic {KEY}"},
        {"X-Api-Key": KEY},
    ],
)
def test_refused_without_the_key(client: TestClient, path: str, headers: dict[str, str]) -> None:
    for method in ("GET", "POST"):
        response = client.request(method, path, headers=headers)
        assert response.status_code == 401
        assert response.headers["www-authenticate"] == "Bearer"
        assert "Unauthorized" in response.json()["error"]


@pytest.mark.parametrize("path", PATHS)
def test_accepted_with_the_key(client: TestClient, path: str) -> None:
    for scheme in ("Bearer", "bearer"):
        response = client.post(path, headers={"Authorization": f"{scheme} {KEY}"})
        assert (response.status_code, response.text) == (200, "reached")


def test_health_is_open(client: TestClient) -> None:
    assert client.get("/health").text == "reached"


def test_websocket_refused_without_key(client: TestClient) -> None:
    with pytest.raises(WebSocketDisconnect) as info, client.websocket_connect("/ws") as websocket:
        websocket.receive_text()
    assert info.value.code == 1008
    with client.websocket_connect("/ws", headers={"Authorization": f"Bearer {KEY}"}) as websocket:
        assert websocket.receive_text() == "reached"


@pytest.mark.parametrize("value", [None, ""])
def test_missing_key_refuses_to_start(monkeypatch: pytest.MonkeyPatch, value: str | None) -> None:
    if value is None:
        monkeypatch.delenv(API_KEY_ENV, raising=False)
    else:
        monkeypatch.setenv(API_KEY_ENV, value)
    # Starlette builds its middleware stack on first use.
    with pytest.raises(RuntimeError, match=f"{API_KEY_ENV} is unset or empty"), make_client() as client:
        client.get("/health")
