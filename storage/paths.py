"""The run-root layout: every relative path the storage layer uses is built here.

Other modules never format these names by hand; paths are POSIX-style, relative, without
``..`` (:func:`join` checks that). The main areas of a run root: ``config.yaml`` (frozen run
config), ``trajectories/`` (shards waiting, with their ``_seq/`` claims), ``consumed/``,
``quarantine/``, ``weights/`` (versions, their ``_COMPLETE`` manifests and ``LATEST``),
``ledger/``, ``checkpoints/``, ``scheduler/``, ``doorbells/``, ``components/`` (heartbeats
of remote components) and ``evaluations/``. The full layout with each name's format:
``docs/internals/storage.md``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

CONFIG = "config.yaml"
TRAJECTORIES_DIR = "trajectories"
SHARD_SEQ_DIR = f"{TRAJECTORIES_DIR}/_seq"
CONSUMED_DIR = "consumed"
QUARANTINE_DIR = "quarantine"
WEIGHTS_DIR = "weights"
WEIGHTS_LATEST = f"{WEIGHTS_DIR}/LATEST"
WEIGHTS_COMPLETE_MARKER = "_COMPLETE"
LEDGER_DIR = "ledger"
CHECKPOINTS_DIR = "checkpoints"
SCHEDULER_DIR = "scheduler"
SCHEDULER_STATE = f"{SCHEDULER_DIR}/state.json"
SCHEDULER_WRITTEN = f"{SCHEDULER_DIR}/written.json"
ROLLOUT_SERVERS_DIR = "rollout/servers"
REWARD_SERVICE = "rewards/service.json"
COMPONENTS_DIR = "components"

_SHARD_RE = re.compile(r"^shard-(\d{8,})-v(\d{6,})-v(\d{6,})\.arrow$")
_SEQ_CLAIM_RE = re.compile(r"^(\d{8,})$")
_WEIGHTS_VERSION_RE = re.compile(r"^v(\d{6,})$")
_LEDGER_RE = re.compile(r"^step-(\d{8,})\.json$")


def join(*parts: str) -> str:
    """Join relative path parts with ``/`` after checking each is a safe relative path.

    Raises ``ValueError`` naming the part for an empty part, an absolute part,
    a backslash, or a ``.``/``..``/empty segment.
    """
    if not parts:
        raise ValueError("join() needs at least one path part")
    for part in parts:
        if not part:
            raise ValueError(f"empty path part in {parts!r}")
        if part.startswith("/") or "\\" in part:
            raise ValueError(f"path part {part!r} must be relative and use '/'")
        for segment in part.split("/"):
            if segment in ("", ".", ".."):
                raise ValueError(f"path part {part!r} has a forbidden segment {segment!r}")
    return "/".join(parts)


def _check_non_negative(what: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{what} must be a non-negative int, got {value!r}")


@dataclass(frozen=True)
class ShardName:
    """The fields a shard file name carries."""

    seq: int
    min_version: int
    max_version: int


def shard_name(seq: int, min_version: int, max_version: int) -> str:
    """File name of a trajectory shard: ``shard-{seq:08d}-v{min:06d}-v{max:06d}.arrow``."""
    _check_non_negative("shard seq", seq)
    _check_non_negative("shard min_version", min_version)
    _check_non_negative("shard max_version", max_version)
    if min_version > max_version:
        raise ValueError(f"shard min_version {min_version} > max_version {max_version}")
    return f"shard-{seq:08d}-v{min_version:06d}-v{max_version:06d}.arrow"


def parse_shard_name(name: str) -> ShardName | None:
    """Fields of a shard file name, or ``None`` if ``name`` is not one (or min > max)."""
    match = _SHARD_RE.match(name)
    if match is None:
        return None
    seq, min_version, max_version = (int(g) for g in match.groups())
    if min_version > max_version:
        return None
    return ShardName(seq, min_version, max_version)


def shard_path(name: str) -> str:
    """Relative path of the shard file ``name``."""
    if parse_shard_name(name) is None:
        raise ValueError(f"{name!r} is not a shard file name")
    return join(TRAJECTORIES_DIR, name)


def consumed_shard_path(name: str) -> str:
    """Relative path of the shard file ``name`` once a ledger entry consumed it."""
    if parse_shard_name(name) is None:
        raise ValueError(f"{name!r} is not a shard file name")
    return join(CONSUMED_DIR, name)


def shard_seq_claim(seq: int) -> str:
    """Relative path of the object that reserves shard sequence number ``seq``."""
    _check_non_negative("shard seq", seq)
    return join(SHARD_SEQ_DIR, f"{seq:08d}")


def quarantine_path(name: str) -> str:
    """Relative path where a rejected file called ``name`` is kept."""
    return join(QUARANTINE_DIR, name)


_QUARANTINE_SUFFIX_RE = re.compile(r"^[0-9a-f]{8}$")


def parse_quarantine_name(name: str) -> str | None:
    """The shard file name of which ``name`` (in ``quarantine/``) is a copy: ``name`` itself,
    or ``name`` less the unique suffix ``.{8 hex digits}`` of a second copy (see
    :meth:`asyncrl.storage.shards.ShardReader.quarantine`); ``None`` for any other name."""
    shard, dot, suffix = name.partition(".arrow.")
    if dot:
        shard = f"{shard}.arrow"
        if not _QUARANTINE_SUFFIX_RE.match(suffix):
            return None
    else:
        shard = name
    return shard if parse_shard_name(shard) is not None else None


def component_heartbeat(component: str, replica: int) -> str:
    """Relative path of the heartbeat of replica ``replica`` of a remote ``component``."""
    _check_non_negative("component replica", replica)
    return join(COMPONENTS_DIR, component, f"{replica}.json")


def component_stop_request(component: str, replica: int) -> str:
    """Relative path of the request that replica ``replica`` of a remote ``component`` stop."""
    _check_non_negative("component replica", replica)
    return join(COMPONENTS_DIR, component, f"{replica}.stop")


def weights_version_dirname(version: int) -> str:
    """Directory name of one weight version: ``v{version:06d}``."""
    _check_non_negative("weight version", version)
    return f"v{version:06d}"


def weights_version_dir(version: int) -> str:
    """Relative directory of weight version ``version``."""
    return join(WEIGHTS_DIR, weights_version_dirname(version))


def weights_file(version: int, relname: str) -> str:
    """Relative path of file ``relname`` (may contain ``/``) of weight version ``version``."""
    return join(weights_version_dir(version), relname)


def weights_complete_marker(version: int) -> str:
    """Relative path of the marker written once all files of ``version`` are uploaded."""
    return weights_file(version, WEIGHTS_COMPLETE_MARKER)


def split_weights_uri(uri: str) -> tuple[str, int]:
    """The run root URI and the version of a weight version's URI (``{root}/weights/v000012``,
    as the lineage records it); ``ValueError`` naming the URI for anything else."""
    head, _, name = uri.rstrip("/").rpartition("/")
    root, _, weights = head.rpartition("/")
    version = parse_weights_version_dirname(name)
    if weights != WEIGHTS_DIR or version is None or not root:
        raise ValueError(f"{uri!r}: not a weight version's URI ({{root}}/{WEIGHTS_DIR}/v000012)")
    return root, version


def parse_weights_version_dirname(name: str) -> int | None:
    """Version of a ``v{version:06d}`` directory name, or ``None`` if it is not one."""
    match = _WEIGHTS_VERSION_RE.match(name)
    return int(match.group(1)) if match else None


def ledger_entry(step: int) -> str:
    """Relative path of the ledger entry of training step ``step``."""
    _check_non_negative("ledger step", step)
    return join(LEDGER_DIR, f"step-{step:08d}.json")


def parse_ledger_name(name: str) -> int | None:
    """Step of a ledger entry file name, or ``None`` if it is not one."""
    match = _LEDGER_RE.match(name)
    return int(match.group(1)) if match else None


def checkpoint_dir(step: int) -> str:
    """Relative directory of the trainer checkpoint taken after step ``step``."""
    _check_non_negative("checkpoint step", step)
    return join(CHECKPOINTS_DIR, f"step-{step:08d}")


def reward_service_path() -> str:
    """Relative path of the reward service's registration (its URL, written once it serves)."""
    return join(REWARD_SERVICE)


WEIGHTS_PINS_DIR = f"{WEIGHTS_DIR}/_pins"
"""``weights/_pins/v{version:06d}``: one object per weight version that pruning must keep
(a registered model's weights); written put-if-absent, never by pruning."""


def weights_pin(version: int) -> str:
    """Relative path of the pin object that keeps weight version ``version`` from pruning."""
    return join(WEIGHTS_PINS_DIR, weights_version_dirname(version))


PRUNED_LINEAGE_DIR = "weights-lineage"
"""``weights-lineage/v{version:06d}.json``: the lineage file of a pruned weight version,
moved out of ``weights/`` so that listing ``weights/`` costs only the versions kept."""


def pruned_lineage(version: int) -> str:
    """Relative path of pruned weight version ``version``'s lineage file."""
    return join(PRUNED_LINEAGE_DIR, f"{weights_version_dirname(version)}.json")


PRUNED_MANIFEST_DIR = "weights-manifests"
"""``weights-manifests/v{version:06d}.json``: the manifest of a pruned weight version (its
files' sizes and SHA-256), so a replay can still compare every version it trains again."""


def pruned_manifest(version: int) -> str:
    """Relative path of pruned weight version ``version``'s manifest."""
    return join(PRUNED_MANIFEST_DIR, f"{weights_version_dirname(version)}.json")


def _parse_version_json(name: str) -> int | None:
    """The version of a ``v{version:06d}.json`` name, else None."""
    stem, dot, suffix = name.partition(".")
    return parse_weights_version_dirname(stem) if dot and suffix == "json" else None


def parse_pruned_lineage_name(name: str) -> int | None:
    """The version of a ``v{version:06d}.json`` name in ``weights-lineage/``, else None."""
    return _parse_version_json(name)


DOORBELLS_DIR = "doorbells"
_TOPIC_RE = re.compile(r"^[a-z][a-z0-9-]*$")


def doorbell_dir(topic: str) -> str:
    """``doorbells/{topic}``: the listeners of one topic (lower-case letters, digits, ``-``)."""
    if not _TOPIC_RE.match(topic):
        raise ValueError(f"doorbell topic {topic!r}: use lower-case letters, digits and '-'")
    return join(DOORBELLS_DIR, topic)


def doorbell(topic: str, listener: str) -> str:
    """``doorbells/{topic}/{listener}.json``: one listener's address."""
    return join(doorbell_dir(topic), f"{listener}.json")


EVALUATIONS_DIR = "evaluations"
EVALUATIONS_STATE = f"{EVALUATIONS_DIR}/state.json"


def evaluation_record(version: int) -> str:
    """``evaluations/v{version:06d}.json``: the held-out result of weight version ``version``
    evaluated during training."""
    return join(EVALUATIONS_DIR, f"{weights_version_dirname(version)}.json")


def parse_evaluation_record_name(name: str) -> int | None:
    """The version of a ``v{version:06d}.json`` name in ``evaluations/``, else None."""
    return _parse_version_json(name)


TRACKING_FILE = "tracking.json"

TRAIN_FILES = "data/train-files.json"
"""The train files a run selected from a folder ``data.train_path`` (:mod:`asyncrl.storage.train_manifest`)."""
