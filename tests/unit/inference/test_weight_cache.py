"""The rollout side of the weights path without a vLLM server: load requests carry no
credentials, and a prefetch fills the cache of the servers on this host (the cache itself:
tests/unit/model/test_weight_fetch.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from safetensors.numpy import save_file

from asyncrl.storage.fs import open_root
from asyncrl.storage.weights import WeightStore
from asyncrl.tasks.inference import weight_loader, weight_sync
from asyncrl.tasks.inference.weight_sync import load_request_body, public_storage_options, update_server_weights
from asyncrl.tasks.model.weight_fetch import cached_version_dir, fetch_weight_version

SECRET_OPTIONS: dict[str, Any] = {
    "key": "AKIA-TOP",
    "secret": "s3cr3t-top",
    "token": "tok-top",
    "endpoint_url": "http://10.0.0.5:8333",
    "client_kwargs": {
        "region_name": "eu-west-1",
        "aws_access_key_id": "AKIA-NESTED",
        "aws_secret_access_key": "s3cr3t-nested",
        "aws_session_token": "tok-nested",
    },
    "config_kwargs": {"retries": {"mode": "standard", "total_max_attempts": 5}},
    "password": "pw",
    "access_key": "ak",
    "secret_key": "sk",
    "session_token": "st",
}
PUBLIC_OPTIONS = {
    "endpoint_url": "http://10.0.0.5:8333",
    "client_kwargs": {"region_name": "eu-west-1"},
    "config_kwargs": {"retries": {"mode": "standard", "total_max_attempts": 5}},
}


def test_public_storage_options_drop_every_credential() -> None:
    assert public_storage_options(SECRET_OPTIONS) == PUBLIC_OPTIONS
    assert public_storage_options(None) == {}
    assert SECRET_OPTIONS["client_kwargs"]["aws_access_key_id"] == "AKIA-NESTED"  # the input is not modified


def test_a_load_request_sends_a_reference_and_no_credentials(monkeypatch: pytest.MonkeyPatch) -> None:
    assert load_request_body("s3://b/run", SECRET_OPTIONS, 3, "/cache", 60.0) == {
        "method": weight_sync.LOAD_METHOD,
        "args": ["s3://b/run", PUBLIC_OPTIONS, 3, "/cache"],
        "timeout": 60.0,
    }
    sent: list[bytes] = []
    report = {"version": 3, "local_dir": "/cache/x/v000003", "cached": False, "num_tensors": 1,
              "checksum_tensor": "w", "file_sha256": "0", "model_sha256": None, "download_s": 0.0, "reload_s": 0.0}

    def post(url: str, **kwargs: Any) -> httpx.Response:
        request = httpx.Request("POST", url, json=kwargs.get("json"))
        sent.append(request.read())
        if url.endswith("/collective_rpc"):
            return httpx.Response(200, json={"results": [report]}, request=request)
        return httpx.Response(200, json={"success": True}, request=request)

    class Handle:
        url = "http://rollout:8000"

        def headers(self) -> dict[str, str]:
            return {}

    monkeypatch.setattr(httpx, "post", post)
    update_server_weights(Handle(), "s3://b/run", SECRET_OPTIONS, 3, cache_dir="/cache")  # type: ignore[arg-type]
    wire = b"".join(sent)
    for secret in ("AKIA", "s3cr3t", "tok-", '"pw"', '"ak"', '"sk"', '"st"'):
        assert secret.encode() not in wire
    assert b"http://10.0.0.5:8333" in wire


def publish(store: WeightStore, base: Path, version: int) -> None:
    local = base / f"v{version}"
    local.mkdir(parents=True)
    save_file({"w": np.full(64, float(version), dtype=np.float32)}, str(local / "model.safetensors"))
    (local / "config.json").write_text(json.dumps({"v": version}))
    store.publish(version, local)


def cached(cache: Path, root_uri: str) -> list[str]:
    base = cached_version_dir(cache, root_uri, 0).parent
    return sorted(entry.name for entry in base.iterdir() if not entry.name.endswith(".lock"))


def test_prefetch_fills_the_cache_of_a_server_on_this_host_only(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Before an update pauses generation, the scheduler fetches the version into the cache
    its servers on this host load from: the worker's load then finds it cached (verified)."""
    from asyncrl.tasks.inference.routing import ServerEndpoint

    root_uri = f"file://{tmp_path / 'run'}"
    store = WeightStore(open_root(root_uri))
    for version in range(2):
        publish(store, tmp_path / "local", version)
    cache = tmp_path / "cache"
    here, elsewhere = ServerEndpoint("http://127.0.0.1:8001"), ServerEndpoint("http://10.1.2.3:8001")
    with weight_loader.ServerWeightLoader(root_uri, {}, str(cache)) as loader:
        assert loader.prefetch(1, [elsewhere]) is False  # that server fetches in its own load
        assert not cache.exists()
        assert loader.prefetch(1, [elsewhere, here]) is True
        assert cached(cache, root_uri) == ["v000001"]
        model_dir, was_cached = fetch_weight_version(root_uri, {}, 1, cache)  # what the worker's load does
        assert was_cached and json.loads((model_dir / "config.json").read_text()) == {"v": 1}
        # An unpublished version: logged, not raised; the load fetches again and reports it.
        with caplog.at_level("WARNING", logger=weight_loader.__name__):
            assert loader.prefetch(7, [here]) is False
        assert "prefetching weight version 7 failed" in caplog.text and "available" in caplog.text
        assert cached(cache, root_uri) == ["v000001"]
