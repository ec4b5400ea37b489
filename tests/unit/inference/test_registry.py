"""Rollout server entries in the run root (local root; the fs layer is tested on S3 elsewhere)."""

from __future__ import annotations

from pathlib import Path

import pytest
from asyncrl.storage.fs import open_root, put_atomic_replace
from asyncrl.tasks.inference.server_registry import (
    list_servers,
    read_server,
    register_server,
    server_entry,
    unregister_server,
)
from asyncrl.tasks.inference.server import RolloutServerHandle


def handle(port: int) -> RolloutServerHandle:
    return RolloutServerHandle(
        url=f"http://127.0.0.1:{port}", pid=1000 + port, pgid=1000 + port, log_path=Path("/x.log"), model="m",
        api_key="never-written",
    )


def test_register_list_replace_unregister(tmp_path: Path) -> None:
    root = open_root(f"file://{tmp_path}/run")
    assert list_servers(root) == []
    register_server(root, "b", handle(2))
    first = register_server(root, "a", handle(1))
    assert [r.name for r in list_servers(root)] == ["a", "b"]
    assert read_server(root, "a") == first
    assert (first.url, first.model, first.pid) == ("http://127.0.0.1:1", "m", 1001)
    replaced = register_server(root, "a", handle(3))
    assert read_server(root, "a").url == replaced.url == "http://127.0.0.1:3"
    assert "never-written" not in (tmp_path / "run" / server_entry("a")).read_text()
    unregister_server(root, "a")
    unregister_server(root, "a")  # idempotent
    assert [r.name for r in list_servers(root)] == ["b"]
    with pytest.raises(FileNotFoundError, match="rollout/servers/a.json"):
        read_server(root, "a")


@pytest.mark.parametrize("name", ["", ".hidden", "a/b", "../x", "a b", "x" * 129])
def test_bad_names_are_refused(name: str) -> None:
    with pytest.raises(ValueError, match="rollout server name"):
        server_entry(name)


def test_corrupt_entry_is_named(tmp_path: Path) -> None:
    root = open_root(f"file://{tmp_path}/run")
    put_atomic_replace(root, server_entry("s"), b"{not json")
    with pytest.raises(ValueError, match="rollout/servers/s.json: corrupt rollout server entry"):
        read_server(root, "s")


def test_an_entry_removed_between_listing_and_reading_is_left_out(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A server unregisters (its supervisor saw it die) while another process lists the
    registry: the listing goes on without it (seen: a test's poll crashed on this race)."""
    from asyncrl.tasks.inference import server_registry as registry

    root = open_root(f"file://{tmp_path}/run")
    for name, port in (("a", 1), ("b", 2)):
        register_server(root, name, handle(port))
    listed = registry.fs.list_dir

    def list_then_unregister(*args: object, **kwargs: object) -> list[str]:
        names = listed(*args, **kwargs)  # type: ignore[arg-type]
        unregister_server(root, "a")
        return names

    monkeypatch.setattr(registry.fs, "list_dir", list_then_unregister)
    assert [r.name for r in list_servers(root)] == ["b"]
