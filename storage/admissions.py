"""The scheduler's admission records: for each group of a shard, the weights the rollout
servers held when the staleness gate admitted the group, as their version label and as
their update count (the training steps they had received: the gate's i).

They travel in the shard's schema metadata, key ``asyncrl.admissions``, as JSON
``{"<group id>": [version, updates], ...}``: published in the same put as the groups they
describe (no request of their own, never one without the other), and moved with the shard
to ``consumed/``. The run audit counts over-stale samples from them
(:mod:`asyncrl.chaos.waste`), a count that reads neither the token versions nor the trainer's
staleness formula. A shard written without records (an older scheduler, a test) has no key.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass

from asyncrl.storage.errors import ShardValidationError

META_ADMISSIONS = b"asyncrl.admissions"


@dataclass(frozen=True)
class Admission:
    """When one group was admitted, in the weights the servers then generated with."""

    version: int
    """Label of those weights (``weights/v{version}``)."""
    updates: int
    """Training steps those weights had received, U(version): what the gate compared."""

    def __post_init__(self) -> None:
        for name in ("version", "updates"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"Admission.{name} must be an int >= 0, got {value!r}")


def admissions_metadata(admissions: Mapping[str, Admission]) -> dict[bytes, bytes]:
    """The schema metadata entry holding ``admissions`` (group id -> its admission)."""
    payload = {gid: [a.version, a.updates] for gid, a in sorted(admissions.items())}
    return {META_ADMISSIONS: json.dumps(payload, separators=(",", ":")).encode()}


def read_admissions(metadata: Mapping[bytes, bytes] | None, source: str) -> dict[str, Admission] | None:
    """Group id -> admission from a shard's schema metadata; None when the shard has no
    records. :class:`ShardValidationError` names ``source`` if the entry is malformed."""
    raw = (metadata or {}).get(META_ADMISSIONS)
    if raw is None:
        return None
    try:
        parsed = json.loads(raw)
        if not isinstance(parsed, dict):
            raise ValueError("not a JSON object")
        return {str(gid): Admission(*pair) for gid, pair in parsed.items()}
    except (ValueError, TypeError) as exc:
        raise ShardValidationError(source, f"schema metadata {META_ADMISSIONS.decode()}: {exc}") from None
