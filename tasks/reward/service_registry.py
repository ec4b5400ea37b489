"""Where the run's reward service listens: ``rewards/service.json`` under the run root.

The reward service (``python -m asyncrl.tasks.reward.server``) writes the entry once it
serves and a healthy pool stands behind it, and removes it when it stops; a restarted
service (on another port) replaces it with one atomic write. Clients
(:class:`~asyncrl.tasks.reward.remote.RemoteRewardScorer`) read it again after every
connection failure. The entry holds no secret: the bearer token reaches clients through
their environment (``ASYNCRL_REWARD_TOKEN``).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass

from asyncrl.storage import fs, paths
from asyncrl.storage.fs import RunRoot

TOKEN_ENV = "ASYNCRL_REWARD_TOKEN"
"""Environment variable holding the bearer token the service requires and clients send."""


@dataclass(frozen=True)
class RewardServiceInfo:
    """The registered reward service."""

    url: str
    """Base URL, e.g. ``http://127.0.0.1:41234`` (no trailing slash)."""
    pid: int
    """Pid of the service process (the leader of its process group)."""
    started_at: float
    """Unix time the service registered."""


def register_reward_service(root: RunRoot, url: str, pid: int) -> RewardServiceInfo:
    """Write (or replace) the entry with ``url``; return what was written."""
    info = RewardServiceInfo(url=url.rstrip("/"), pid=pid, started_at=time.time())
    fs.put_atomic_replace(root, paths.reward_service_path(), json.dumps(asdict(info), sort_keys=True).encode())
    return info


def read_reward_service(root: RunRoot) -> RewardServiceInfo | None:
    """The registered service, None if none is registered; ``ValueError`` naming the entry if corrupt."""
    relpath = paths.reward_service_path()
    try:
        content = fs.read_json_object(root, relpath)
        if content is None:
            return None
        info = RewardServiceInfo(**{name: content[name] for name in RewardServiceInfo.__dataclass_fields__})
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{root.display(relpath)}: corrupt reward service entry ({exc})") from None
    if not isinstance(info.url, str) or not info.url.startswith(("http://", "https://")):
        raise ValueError(f"{root.display(relpath)}: url {info.url!r} is not an http(s) URL")
    return info


def unregister_reward_service(root: RunRoot, info: RewardServiceInfo) -> bool:
    """Remove the entry if it still names ``info`` (a stopping service must not remove the
    entry of its successor, already registered); return whether it was removed.

    Check-then-delete is not atomic: a successor registering in between loses its entry,
    and clients then wait until it is restarted. The window is one read long.
    """
    try:
        current = read_reward_service(root)
    except ValueError:
        return False  # not ours to clean up: someone else wrote it
    if current != info:
        return False
    fs.delete(root, paths.reward_service_path(), missing_ok=True)
    return True
