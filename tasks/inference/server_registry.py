"""Where the run's rollout servers listen: ``rollout/servers/{name}.json`` under the run root.

A supervising task registers its server once it is healthy and removes the entry when
it stops; the rollout controller lists the entries to find the servers. An entry holds
no secret (the API key is handed to clients by other means). A restarted server
replaces its entry (one atomic write).
"""

from __future__ import annotations

import json
import re
import socket
import time
from dataclasses import asdict, dataclass

from asyncrl.storage import fs, paths
from asyncrl.storage.fs import RunRoot
from asyncrl.tasks.inference.server import RolloutServerHandle

SERVERS_DIR = paths.ROLLOUT_SERVERS_DIR
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
_SUFFIX = ".json"


@dataclass(frozen=True)
class ServerRecord:
    """One registered rollout server."""

    name: str
    url: str
    model: str
    """Value for the ``model`` field of completion requests."""
    pid: int
    hostname: str
    registered_at: float


def server_name(index: int) -> str:
    """Rollout server ``index``'s name in the registry: ``server-{index}``."""
    return f"server-{index}"


def server_entry(name: str) -> str:
    """Relative path of server ``name``'s entry; ``ValueError`` for a name that is not
    1-128 characters of letters, digits, ``_``, ``.``, ``-`` starting with a letter or digit."""
    if not _NAME_RE.match(name):
        raise ValueError(
            f"rollout server name {name!r} must be 1-128 characters of [A-Za-z0-9_.-], starting with a letter or digit"
        )
    return paths.join(SERVERS_DIR, f"{name}{_SUFFIX}")


def register_server(root: RunRoot, name: str, handle: RolloutServerHandle) -> ServerRecord:
    """Write (or replace) ``name``'s entry with ``handle``'s address; return the record."""
    record = ServerRecord(
        name=name,
        url=handle.url,
        model=handle.model,
        pid=handle.pid,
        hostname=socket.gethostname(),
        registered_at=time.time(),
    )
    fs.put_atomic_replace(root, server_entry(name), json.dumps(asdict(record), sort_keys=True).encode())
    return record


def unregister_server(root: RunRoot, name: str) -> None:
    """Remove ``name``'s entry; a missing entry is not an error."""
    fs.delete(root, server_entry(name), missing_ok=True)


def read_server(root: RunRoot, name: str) -> ServerRecord:
    """``name``'s record; ``FileNotFoundError`` names the entry if absent, ``ValueError`` if corrupt."""
    relpath = server_entry(name)
    raw = fs.read_bytes(root, relpath)
    try:
        content = json.loads(raw)
        record = ServerRecord(**{field: content[field] for field in ServerRecord.__dataclass_fields__})
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{root.display(relpath)}: corrupt rollout server entry ({exc!r}): {raw[:200]!r}") from None
    if record.name != name:
        raise ValueError(f"{root.display(relpath)}: entry names server {record.name!r}, expected {name!r}")
    return record


def list_servers(root: RunRoot) -> list[ServerRecord]:
    """Every registered server, sorted by name. An entry removed between the listing and its
    read (a server unregistered meanwhile) is left out, not an error."""
    names = [entry[: -len(_SUFFIX)] for entry in fs.list_dir(root, SERVERS_DIR) if entry.endswith(_SUFFIX)]
    records = []
    for name in sorted(names):
        try:
            records.append(read_server(root, name))
        except FileNotFoundError:
            continue
    return records
